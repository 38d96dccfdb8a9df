// bandwidth.cpp — see bandwidth.h.
#include "testing/bandwidth.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace llamaflash {

namespace {

// Sum of n 64-bit words; four independent accumulators keep the loads in flight.
#if defined(__x86_64__)
__attribute__((target("avx2"))) uint64_t sum_words_avx2(const uint64_t * p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i + 12)));
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i *>(lanes),
                       _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
    uint64_t s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; ++i) s += p[i];
    return s;
}
#endif

uint64_t sum_words(const uint64_t * p, size_t n) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2")) return sum_words_avx2(p, n);
#endif
    uint64_t s = 0;
    for (size_t i = 0; i < n; ++i) s += p[i];
    return s;
}

}  // namespace

BandwidthResult measure_read_bandwidth(size_t buffer_bytes, int n_threads, int repetitions) {
    if (buffer_bytes < (1u << 20) || n_threads < 1 || repetitions < 1) {
        throw std::invalid_argument("measure_read_bandwidth: need >= 1 MiB, >= 1 thread, >= 1 repetition");
    }
    const size_t n = buffer_bytes / sizeof(uint64_t);
    std::unique_ptr<uint64_t[]> buf(new uint64_t[n]);
    std::memset(buf.get(), 1, n * sizeof(uint64_t));
    std::vector<double> rates;
    volatile uint64_t sink = 0;
    for (int rep = 0; rep <= repetitions; ++rep) {
        uint64_t total = 0;
        const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(n_threads) reduction(+ : total)
        {
            const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
            const size_t b = n * ith / nth, e = n * (ith + 1) / nth;
            total += sum_words(buf.get() + b, e - b);
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        sink = sink + total;
        if (rep > 0) rates.push_back(static_cast<double>(n * sizeof(uint64_t)) / s);  // rep 0: warm-up
    }
    std::vector<double> sorted = rates;
    std::sort(sorted.begin(), sorted.end());
    BandwidthResult r;
    r.bytes_per_second = sorted.back();
    r.median_bytes_per_second = sorted[sorted.size() / 2];
    r.buffer_bytes = n * sizeof(uint64_t);
    r.n_threads = n_threads;
    r.repetitions = repetitions;
    return r;
}

}  // namespace llamaflash
