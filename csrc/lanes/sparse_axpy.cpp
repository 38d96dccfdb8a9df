// sparse_axpy.cpp — see sparse_axpy.h: the fused scalar loops (every ISA's fallback), the choice of a
// kernel per (type, ISA), and the CPU's best ISA. The SIMD kernels are in sparse_axpy_x86.cpp; the block
// layouts all of them read are in sparse_axpy_kernels.h.
#include "lanes/sparse_axpy.h"

#include "lanes/sparse_axpy_kernels.h"

namespace llamaflash {

namespace axpy {
namespace {

void axpy_q8_0_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        const uint8_t * row = rows[r];
        for (int64_t b = 0; b < n_embd / 32; ++b) {
            const uint8_t * blk = row + b * kQ8_0Bytes;
            const float d = ggml_fp16_to_fp32(load_u16(blk)) * h[r];
            const int8_t * q = reinterpret_cast<const int8_t *>(blk + 2);
            float * a = acc + b * 32;
            for (int j = 0; j < 32; ++j) {
                a[j] += d * static_cast<float>(q[j]);
            }
        }
    }
}

void axpy_f16_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        const uint16_t * row = reinterpret_cast<const uint16_t *>(rows[r]);
        for (int64_t j = 0; j < n_embd; ++j) {
            acc[j] += h[r] * ggml_fp16_to_fp32(row[j]);
        }
    }
}

template <bool kMin>
void axpy_q4_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    const size_t bytes = kMin ? kQ4_1Bytes : kQ4_0Bytes;
    for (int r = 0; r < n; ++r) {
        for (int64_t b = 0; b < n_embd / 32; ++b) {
            const uint8_t * blk = rows[r] + b * bytes;
            const float d = ggml_fp16_to_fp32(load_u16(blk)) * h[r];
            const float m = kMin ? ggml_fp16_to_fp32(load_u16(blk + 2)) * h[r] : -8.0f * d;
            const uint8_t * qs = blk + (kMin ? 4 : 2);
            float * a = acc + b * 32;
            for (int j = 0; j < 16; ++j) {
                a[j] += d * static_cast<float>(qs[j] & 15) + m;
                a[j + 16] += d * static_cast<float>(qs[j] >> 4) + m;
            }
        }
    }
}

void axpy_q4_k_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        for (int64_t b = 0; b < n_embd / kQK; ++b) {
            const uint8_t * blk = rows[r] + b * kQ4_KBytes;
            const float d = ggml_fp16_to_fp32(load_u16(blk)) * h[r];
            const float dmin = ggml_fp16_to_fp32(load_u16(blk + 2)) * h[r];
            uint8_t sm[16];
            q4_k_scales_mins(blk + 4, sm);
            const uint8_t * qs = blk + 16;
            float * a = acc + b * kQK;
            for (int c = 0; c < 4; ++c) {
                const float d0 = d * sm[2 * c], m0 = dmin * sm[8 + 2 * c];
                const float d1 = d * sm[2 * c + 1], m1 = dmin * sm[8 + 2 * c + 1];
                for (int l = 0; l < 32; ++l) {
                    a[64 * c + l] += d0 * static_cast<float>(qs[32 * c + l] & 15) - m0;
                    a[64 * c + 32 + l] += d1 * static_cast<float>(qs[32 * c + l] >> 4) - m1;
                }
            }
        }
    }
}

void axpy_q2_k_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        for (int64_t b = 0; b < n_embd / kQK; ++b) {
            const uint8_t * blk = rows[r] + b * kQ2_KBytes;
            const float d = ggml_fp16_to_fp32(load_u16(blk + 80)) * h[r];
            const float dmin = ggml_fp16_to_fp32(load_u16(blk + 82)) * h[r];
            for (int s = 0; s < 16; ++s) {
                const int half = s / 8, j = (s % 8) / 2, g = s % 2;
                const float dl = d * static_cast<float>(blk[s] & 15), ml = dmin * static_cast<float>(blk[s] >> 4);
                const uint8_t * q = blk + 16 + 32 * half + 16 * g;
                float * a = acc + b * kQK + 128 * half + 32 * j + 16 * g;
                for (int l = 0; l < 16; ++l) a[l] += dl * static_cast<float>((q[l] >> (2 * j)) & 3) - ml;
            }
        }
    }
}

void axpy_q6_k_scalar(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        for (int64_t b = 0; b < n_embd / kQK; ++b) {
            const uint8_t * blk = rows[r] + b * kQ6_KBytes;
            const float d = ggml_fp16_to_fp32(load_u16(blk + 208)) * h[r];
            for (int half = 0; half < 2; ++half) {
                const uint8_t * ql = blk + 64 * half;
                const uint8_t * qh = blk + 128 + 32 * half;
                const int8_t * sc = reinterpret_cast<const int8_t *>(blk + 192) + 8 * half;
                float * a = acc + b * kQK + 128 * half;
                for (int l = 0; l < 32; ++l) {
                    const int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    a[l] += d * sc[l / 16] * static_cast<float>(q1);
                    a[l + 32] += d * sc[2 + l / 16] * static_cast<float>(q2);
                    a[l + 64] += d * sc[4 + l / 16] * static_cast<float>(q3);
                    a[l + 96] += d * sc[6 + l / 16] * static_cast<float>(q4);
                }
            }
        }
    }
}

void axpy_f32(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) {
    for (int r = 0; r < n; ++r) {
        const float * row = reinterpret_cast<const float *>(rows[r]);
        for (int64_t j = 0; j < n_embd; ++j) {
            acc[j] += h[r] * row[j];
        }
    }
}

}  // namespace
}  // namespace axpy

AxpyFn pick_axpy(ggml_type type, SparseIsa isa) {
    using namespace axpy;
    if (type == GGML_TYPE_F32) return axpy_f32;  // (compiler-vectorized; not a production down_t type)
#if LLAMAFLASH_X86
    if (type == GGML_TYPE_Q8_0) {
        return isa == SparseIsa::avx512 ? axpy_q8_0_avx512 : isa == SparseIsa::avx2 ? axpy_q8_0_avx2 : axpy_q8_0_scalar;
    }
    if (type == GGML_TYPE_F16) {
        return isa == SparseIsa::avx512 ? axpy_f16_avx512 : isa == SparseIsa::avx2 ? axpy_f16_avx2 : axpy_f16_scalar;
    }
    if (type == GGML_TYPE_Q4_0) {
        return isa == SparseIsa::avx512 ? axpy_q4_0_avx512
               : isa == SparseIsa::avx2 ? axpy_q4_0_avx2
                                        : axpy_q4_scalar<false>;
    }
    if (type == GGML_TYPE_Q4_1) {
        return isa == SparseIsa::avx512 ? axpy_q4_1_avx512
               : isa == SparseIsa::avx2 ? axpy_q4_1_avx2
                                        : axpy_q4_scalar<true>;
    }
    if (type == GGML_TYPE_Q4_K) {
        return isa == SparseIsa::avx512 ? axpy_q4_k_avx512 : isa == SparseIsa::avx2 ? axpy_q4_k_avx2 : axpy_q4_k_scalar;
    }
    if (type == GGML_TYPE_Q6_K) {
        return isa == SparseIsa::avx512 ? axpy_q6_k_avx512 : isa == SparseIsa::avx2 ? axpy_q6_k_avx2 : axpy_q6_k_scalar;
    }
    if (type == GGML_TYPE_Q2_K) return isa == SparseIsa::scalar ? axpy_q2_k_scalar : axpy_q2_k_avx2;
#else
    if (type == GGML_TYPE_Q2_K) return axpy_q2_k_scalar;
    if (type == GGML_TYPE_Q4_K) return axpy_q4_k_scalar;
    if (type == GGML_TYPE_Q6_K) return axpy_q6_k_scalar;
    if (type == GGML_TYPE_Q4_0) return axpy_q4_scalar<false>;
    if (type == GGML_TYPE_Q4_1) return axpy_q4_scalar<true>;
    if (type == GGML_TYPE_Q8_0) return axpy_q8_0_scalar;
    if (type == GGML_TYPE_F16) return axpy_f16_scalar;
#endif
    return nullptr;  // generic path: to_float into a row buffer, then axpy
}

AxpyBatchFn pick_axpy_batch(ggml_type type, SparseIsa isa) {
#if LLAMAFLASH_X86
    if (type == GGML_TYPE_Q4_K && isa == SparseIsa::avx512) return axpy::axpy_batch_q4_k_avx512;
#else
    (void)type;
    (void)isa;
#endif
    return nullptr;
}

SparseIsa sparse_ffn_best_isa() {
#if LLAMAFLASH_X86
    static const SparseIsa best = [] {
        __builtin_cpu_init();
        const bool base = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        if (base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return SparseIsa::avx512;
        if (base && __builtin_cpu_supports("avx2")) return SparseIsa::avx2;
        return SparseIsa::scalar;
    }();
    return best;
#else
    return SparseIsa::scalar;
#endif
}

const char * sparse_isa_name(SparseIsa isa) {
    switch (isa) {
        case SparseIsa::auto_: return "auto";
        case SparseIsa::scalar: return "scalar";
        case SparseIsa::avx2: return "avx2";
        case SparseIsa::avx512: return "avx512";
    }
    return "?";
}

}  // namespace llamaflash
