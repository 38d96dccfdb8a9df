// row_prefetch.h — software prefetch of weight rows: ahead of a row-by-row vec_dot loop, and of the
// rows a sparse lane has just selected.
//
// A product with one activation column (decode) reads every weight byte once, so its speed is that of
// the memory stream, not of the arithmetic. Calling ggml-cpu's vec_dot row after row leaves the stream
// to the hardware prefetcher alone; asking for the bytes kPrefetchAheadBytes ahead of the row about to
// be computed keeps more of it in flight. The arithmetic is untouched: the same calls, the same bits.
//
// Measured single-threaded on the 2-core Intel Xeon (AVX-512 VNNI), vec_dot over 113-165 MB of
// Q4_K / Q6_K expert rows (out of cache): 0.56-0.58× the time with 4 KiB ahead, 0.56-0.63× with 8 KiB,
// 0.67-0.77× with the non-temporal hint; over one 442 KB expert already in cache 1.07-1.13× the time.
// Deterministic decode in memory (every matmul's rows by vec_dot): 1.09-1.31× stock's on the synthetic
// half-size Qwen3-30B-A3B, where it was 0.85-0.90×; 1.41× on Qwen2.5-1.5B (docs/BENCHMARKS.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace llamaflash {

constexpr size_t kPrefetchAheadBytes = 4096;
constexpr size_t kCacheLineBytes = 64;

// Prefetch [p, p + bytes) into L2 (a down_t row is 26 lines for n_embd 1536 Q8_0: into L1 it would
// evict the partial y and quantized x while a whole cluster's rows are in flight).
inline void prefetch_l2(const uint8_t * p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += kCacheLineBytes) {
        __builtin_prefetch(p + off, 0, 2);
    }
}

// Prefetch (for reading, into every cache level) the row_bytes that lie kPrefetchAheadBytes after
// `row`, stopping at `end` (one past the last byte of the rows this loop reads).
inline void prefetch_row_ahead(const uint8_t * row, size_t row_bytes, const uint8_t * end) {
    const size_t left = static_cast<size_t>(end - row);  // bytes from `row` to the end, row < end
    if (left <= kPrefetchAheadBytes) return;
    const size_t stop = left - kPrefetchAheadBytes < row_bytes ? left - kPrefetchAheadBytes : row_bytes;
    for (size_t off = 0; off < stop; off += kCacheLineBytes) {
        __builtin_prefetch(row + kPrefetchAheadBytes + off, 0, 3);
    }
}

}  // namespace llamaflash
