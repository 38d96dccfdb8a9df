// crc32c.cpp — see crc32c.h.
#include "crc32c.h"

#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLAMAFLASH_CRC32C_X86 1
#endif

namespace llamaflash {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

// table[k][b]: the CRC register after feeding byte b followed by k zero bytes (slicing-by-8)
struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t b = 0; b < 256; ++b) {
            uint32_t c = b;
            for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
            t[0][b] = c;
        }
        for (uint32_t b = 0; b < 256; ++b) {
            for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
        }
    }
};

const Tables & tables() {
    static const Tables instance;
    return instance;
}

uint32_t update_table(uint32_t crc, const uint8_t * p, size_t n) {
    const Tables & T = tables();
    while (n >= 8) {
        uint32_t lo, hi;
        std::memcpy(&lo, p, 4);
        std::memcpy(&hi, p + 4, 4);
        lo ^= crc;  // little endian: the register meets the first four bytes
        crc = T.t[7][lo & 0xFF] ^ T.t[6][(lo >> 8) & 0xFF] ^ T.t[5][(lo >> 16) & 0xFF] ^ T.t[4][lo >> 24] ^
              T.t[3][hi & 0xFF] ^ T.t[2][(hi >> 8) & 0xFF] ^ T.t[1][(hi >> 16) & 0xFF] ^ T.t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ T.t[0][(crc ^ *p++) & 0xFF];
    return crc;
}

#if defined(LLAMAFLASH_CRC32C_X86) && defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t update_hw(uint32_t crc, const uint8_t * p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return c32;
}

bool has_hw() {
    static const bool yes = __builtin_cpu_supports("sse4.2");
    return yes;
}
#else
uint32_t update_hw(uint32_t crc, const uint8_t * p, size_t n) { return update_table(crc, p, n); }
bool has_hw() { return false; }
#endif

using Update = uint32_t (*)(uint32_t, const uint8_t *, size_t);

Update pick(Crc32cImpl impl) {
    switch (impl) {
        case Crc32cImpl::table: return update_table;
        case Crc32cImpl::hardware:
            if (!has_hw()) throw std::invalid_argument("crc32c: this CPU has no SSE4.2 crc32 instruction");
            return update_hw;
        case Crc32cImpl::automatic: break;
    }
    return has_hw() ? update_hw : update_table;
}

}  // namespace

uint32_t crc32c(const void * data, size_t n, Crc32cImpl impl) {
    return ~pick(impl)(0xFFFFFFFFu, static_cast<const uint8_t *>(data), n);
}

void crc32c_rows(const uint8_t * data, int64_t n_rows, size_t row_bytes, size_t stride, uint32_t * out,
                 Crc32cImpl impl) {
    const Update update = pick(impl);
    for (int64_t r = 0; r < n_rows; ++r) {
        out[r] = ~update(0xFFFFFFFFu, data + static_cast<size_t>(r) * stride, row_bytes);
    }
}

const char * crc32c_implementation() { return has_hw() ? "sse4.2" : "table"; }

}  // namespace llamaflash
