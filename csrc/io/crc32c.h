// crc32c.h — CRC-32C (Castagnoli): the checksum of every row the engine reads (sidecar format 3).
//
// Definition: reflected polynomial 0x82F63B78, initial value 0xFFFFFFFF, final XOR 0xFFFFFFFF (the
// iSCSI / ext4 / RFC 3720 CRC; crc32c("123456789") = 0xE3069283). Two implementations computing the
// same function, chosen at run time: the SSE4.2 `crc32` instruction where the CPU has it (x86-64),
// else a portable slicing-by-8 table (any machine). Nothing here needs a compile flag: the SSE4.2
// path is compiled with a function target attribute and only called after a CPU check.
#pragma once

#include <cstddef>
#include <cstdint>

namespace llamaflash {

enum class Crc32cImpl : int { automatic = 0, table = 1, hardware = 2 };

// CRC-32C of `n` bytes at `data`. `impl` forces an implementation (tests compare them); hardware on a
// CPU without it throws std::invalid_argument.
uint32_t crc32c(const void * data, size_t n, Crc32cImpl impl = Crc32cImpl::automatic);

// out[r] = crc32c(data + r·stride, row_bytes) for r in [0, n_rows). With the instruction, rows of
// 192 bytes or more are checksummed in three interleaved lanes joined by a precomputed shift (the
// same function, about twice as fast; tables kept per row size, see crc32c.cpp).
void crc32c_rows(const uint8_t * data, int64_t n_rows, size_t row_bytes, size_t stride, uint32_t * out,
                 Crc32cImpl impl = Crc32cImpl::automatic);

// crc32c(A ‖ B) from crc32c(A), crc32c(B) and |B| (pieces of one slice checksummed apart, by
// several threads, then joined).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b);

// "sse4.2" or "table": what Crc32cImpl::automatic runs on this machine.
const char * crc32c_implementation();

}  // namespace llamaflash
