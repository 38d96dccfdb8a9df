// kquant_gemm.cpp — see kquant_gemm.h: dispatch, the probe against ggml-cpu's vec_dot, the fallback.
#include "kernels/kquant_gemm.h"

#include "kernels/kquant_gemm_kernels.h"
#include "kernels/row_prefetch.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

namespace llamaflash {

namespace gemm {

KernelFn kernel_for(int type, const char * isa) {
#if LLAMAFLASH_GEMM_X86
    const bool is_auto = std::strcmp(isa, "auto") == 0;
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    // AVX-512 without VNNI (no vpdpwssd) takes the AVX2 kernels
    const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    const bool want_vnni = vnni && (is_auto || std::strcmp(isa, "avx512vnni") == 0);
    const bool want_avx2 = avx2 && !want_vnni && (is_auto || std::strcmp(isa, "avx2") == 0);
    switch (type) {
        case GGML_TYPE_Q4_K: return want_vnni ? q4_k_avx512vnni : want_avx2 ? q4_k_avx2 : nullptr;
        case GGML_TYPE_Q6_K: return want_vnni ? q6_k_avx512vnni : want_avx2 ? q6_k_avx2 : nullptr;
        default: return nullptr;
    }
#else
    (void)type;
    (void)isa;
    return nullptr;
#endif
}

}  // namespace gemm

namespace {

using gemm::KernelFn;

// Columns from which a kernel is faster than one vec_dot per output. Measured against vec_dot: AVX-512
// VNNI (8960 × 1536 Q4_K, a Q6_K ffn_down of Qwen2.5-1.5B) Q4_K 0.87× at 1 column, 1.2–1.3× at 2,
// 2.4–2.9× at 7, 2.8–2.9× at 63; Q6_K 1.8× at 2, 2.6–2.7× at 7. AVX2 (1536 × 1536) Q4_K 0.4× at 1,
// 0.7× at 2, 1.0× at 4, 1.2× from 8; Q6_K 0.7×, 1.0×, 1.3×, 1.5×.
constexpr int64_t kMinColsAvx512 = 2;
constexpr int64_t kMinColsAvx2 = 4;

// One output per vec_dot call: ggml-cpu's own computation, the rows read ahead (row_prefetch.h), in
// blocks of kGemmRowBlock rows (each block by every column before the next block).
void gemm_by_vec_dot(ggml_type type, int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                     size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                     const RowBlockHook * hook) {
    const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(type)->vec_dot;
    const uint8_t * rows = static_cast<const uint8_t *>(w);
    const uint8_t * rows_end = rows + static_cast<size_t>(n_rows) * w_row_bytes;
    for (int64_t r0 = 0; r0 < n_rows; r0 += kGemmRowBlock) {
        const int64_t r1 = std::min(n_rows, r0 + kGemmRowBlock);
        for (int64_t c = 0; c < n_cols; ++c) {
            const void * qc = static_cast<const uint8_t *>(q) + static_cast<size_t>(c) * q_col_bytes;
            for (int64_t r = r0; r < r1; ++r) {
                const uint8_t * row = rows + static_cast<size_t>(r) * w_row_bytes;
                prefetch_row_ahead(row, w_row_bytes, rows_end);
                vec_dot(static_cast<int>(ne0), out + static_cast<size_t>(c) * out_col_stride + r, 0, row, 0, qc, 0, 1);
            }
        }
        if (hook != nullptr) (*hook)(r0, r1 - r0);
    }
}

// Random weights of `type` (quantized from random floats by ggml itself) and random activations:
// does `kernel` give every output vec_dot's bits, for every column count up to two of the widest
// tiles and one more?
bool kernel_matches_vec_dot(ggml_type type, KernelFn kernel) {
    constexpr int64_t ne0 = 4 * 256, n_rows = 5, max_cols = 2 * gemm::kWidestTileCols + 1;
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(type);
    if (traits->vec_dot == nullptr || traits->vec_dot_type != GGML_TYPE_Q8_K) {
        return false;
    }
    std::mt19937 rng(20261128);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> f(static_cast<size_t>(ne0 * std::max(n_rows, max_cols)));
    for (float & v : f) {
        v = normal(rng);
    }
    const size_t w_row = ggml_row_size(type, ne0), q_col = ggml_row_size(GGML_TYPE_Q8_K, ne0);
    std::vector<uint8_t> w(w_row * n_rows), q(q_col * max_cols);
    ggml_quantize_chunk(type, f.data(), w.data(), 0, n_rows, ne0, nullptr);
    for (int64_t c = 0; c < max_cols; ++c) {
        // activations with outliers, as real hidden states have
        std::vector<float> x(f.begin() + c * ne0 / 2, f.begin() + c * ne0 / 2 + ne0);
        x[static_cast<size_t>(c * 37 % ne0)] *= 40.0f;
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x.data(), q.data() + c * q_col, ne0);
    }
    std::vector<float> want(static_cast<size_t>(n_rows * max_cols)), got(want.size());
    gemm_by_vec_dot(type, ne0, w.data(), w_row, n_rows, q.data(), q_col, max_cols, want.data(), n_rows, nullptr);
    for (int64_t n_cols = 1; n_cols <= max_cols; ++n_cols) {
        std::fill(got.begin(), got.end(), -1.0f);
        kernel(ne0, w.data(), w_row, n_rows, q.data(), q_col, n_cols, got.data(), n_rows, nullptr);
        if (std::memcmp(got.data(), want.data(), sizeof(float) * static_cast<size_t>(n_rows * n_cols)) != 0) {
            return false;
        }
    }
    return true;
}

struct Picked {
    std::once_flag once;
    KernelFn kernel = nullptr;
    int64_t min_cols = 0;  // vec_dot below
};

const Picked * checked_kernel(ggml_type type) {
    static Picked picked[GGML_TYPE_COUNT];
    if (type < 0 || type >= GGML_TYPE_COUNT) {
        return nullptr;
    }
    Picked & p = picked[type];
    std::call_once(p.once, [&] {
        ggml_cpu_init();  // vec_dot's fp16 table, where this build reads fp16 through it
        KernelFn k = gemm::kernel_for(type, "auto");
        p.kernel = k != nullptr && kernel_matches_vec_dot(type, k) ? k : nullptr;
        p.min_cols = k == gemm::kernel_for(type, "avx512vnni") ? kMinColsAvx512 : kMinColsAvx2;
    });
    return p.kernel != nullptr ? &p : nullptr;
}

}  // namespace

bool kquant_gemm_supported(ggml_type type) { return checked_kernel(type) != nullptr; }

void kquant_gemm(ggml_type type, int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                 size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride, const RowBlockHook * hook) {
    // few columns: vec_dot itself is faster (too few to amortize the unpacking over) and has the bits
    const Picked * p = checked_kernel(type);
    if (p != nullptr && n_cols >= p->min_cols) {
        p->kernel(ne0, w, w_row_bytes, n_rows, q, q_col_bytes, n_cols, out, out_col_stride, hook);
        return;
    }
    gemm_by_vec_dot(type, ne0, w, w_row_bytes, n_rows, q, q_col_bytes, n_cols, out, out_col_stride, hook);
}

}  // namespace llamaflash
