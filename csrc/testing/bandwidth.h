// bandwidth.h — measured memory read bandwidth: the denominator of the decode bound
// (bytes that must move per token ÷ bandwidth), and an input of the planner.
#pragma once

#include <cstddef>

namespace llamaflash {

struct BandwidthResult {
    double bytes_per_second = 0;  // best of the repetitions
    double median_bytes_per_second = 0;
    size_t buffer_bytes = 0;
    int n_threads = 0;
    int repetitions = 0;
};

// Streams a freshly allocated buffer of `buffer_bytes` (far larger than the caches, so every pass
// comes from DRAM) with `n_threads` OpenMP threads, each summing its contiguous share with SIMD
// loads, `repetitions` times after one warm-up pass; the buffer is written once first so its pages
// exist. Returns best and median read bandwidth. Throws std::invalid_argument on bad arguments and
// std::bad_alloc when the buffer cannot be allocated.
BandwidthResult measure_read_bandwidth(size_t buffer_bytes, int n_threads, int repetitions);

}  // namespace llamaflash
