// sparse_axpy_x86.cpp — the AVX2 and AVX-512 kernels of the fused down_t accumulation (sparse_axpy.h;
// entry points and block layouts in sparse_axpy_kernels.h), each compiled for its ISA with a target
// attribute and chosen at run time by pick_axpy (sparse_axpy.cpp). A pass adds R (1..4) rows into acc in
// one load/store of it (Q4_K: every row of the call); for a given (n, ISA) the summation order is fixed;
// the AVX2 and AVX-512 K-quant kernels sum in the same order, so they round alike.
#include "lanes/sparse_axpy_kernels.h"

#if LLAMAFLASH_X86
#include <immintrin.h>

#include <algorithm>

namespace llamaflash {
namespace axpy {

// GCC 12 reports its own AVX-512 intrinsics' `__m512 __Y = __Y;` as maybe-uninitialized in
// target("avx512f") functions (GCC bug 105593): silence that false positive for this section only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Q2_K, one row at a time (the scalar loop's order per value): 8 floats per FMA.
__attribute__((target("avx2,f16c,fma"))) void axpy_q2_k_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                             int n, int64_t n_embd) {
    const __m128i three = _mm_set1_epi8(3);
    for (int r = 0; r < n; ++r) {
        for (int64_t b = 0; b < n_embd / kQK; ++b) {
            const uint8_t * blk = rows[r] + b * kQ2_KBytes;
            const float d = _cvtsh_ss(load_u16(blk + 80)) * h[r];
            const float dmin = _cvtsh_ss(load_u16(blk + 82)) * h[r];
            for (int s = 0; s < 16; ++s) {
                const int half = s / 8, j = (s % 8) / 2, g = s % 2;
                const __m256 dl = _mm256_set1_ps(d * static_cast<float>(blk[s] & 15));
                const __m256 ml = _mm256_set1_ps(dmin * static_cast<float>(blk[s] >> 4));
                const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 16 + 32 * half + 16 * g));
                const __m128i v = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * j)), three);
                float * a = acc + b * kQK + 128 * half + 32 * j + 16 * g;
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
                _mm256_storeu_ps(a, _mm256_sub_ps(_mm256_fmadd_ps(dl, lo, _mm256_loadu_ps(a)), ml));
                _mm256_storeu_ps(a + 8, _mm256_sub_ps(_mm256_fmadd_ps(dl, hi, _mm256_loadu_ps(a + 8)), ml));
            }
        }
    }
}

namespace {

// R rows (1..4) in one pass over acc.
template <int R>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void q8_0_pass_avx512(float * acc, const uint8_t * const * rows,
                                                                           const float * h, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
        __m512 y0 = _mm512_loadu_ps(acc + 32 * b);
        __m512 y1 = _mm512_loadu_ps(acc + 32 * b + 16);
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * kQ8_0Bytes;
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(blk)) * h[r]);
            const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 2));
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
            y0 = _mm512_fmadd_ps(q0, d, y0);
            y1 = _mm512_fmadd_ps(q1, d, y1);
        }
        _mm512_storeu_ps(acc + 32 * b, y0);
        _mm512_storeu_ps(acc + 32 * b + 16, y1);
    }
}

template <int R>
__attribute__((target("avx2,f16c,fma"))) void q8_0_pass_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                             int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
        __m256 y[4];
        for (int k = 0; k < 4; ++k) {
            y[k] = _mm256_loadu_ps(acc + 32 * b + 8 * k);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * kQ8_0Bytes;
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)) * h[r]);
            for (int k = 0; k < 4; ++k) {
                const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(blk + 2 + 8 * k));
                y[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d, y[k]);
            }
        }
        for (int k = 0; k < 4; ++k) {
            _mm256_storeu_ps(acc + 32 * b + 8 * k, y[k]);
        }
    }
}

// R rows (1..4) of Q4_0 (kMin false) or Q4_1 (true) in one pass over acc.
template <bool kMin, int R>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void q4_pass_avx512(float * acc, const uint8_t * const * rows,
                                                                         const float * h, int64_t nb) {
    const size_t bytes = kMin ? kQ4_1Bytes : kQ4_0Bytes;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 y0 = _mm512_loadu_ps(acc + 32 * b);
        __m512 y1 = _mm512_loadu_ps(acc + 32 * b + 16);
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * bytes;
            const float d = _cvtsh_ss(load_u16(blk)) * h[r];
            const __m512 vd = _mm512_set1_ps(d);
            const __m512 vm = _mm512_set1_ps(kMin ? _cvtsh_ss(load_u16(blk + 2)) * h[r] : -8.0f * d);
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + (kMin ? 4 : 2)));
            const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low)));
            const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low)));
            y0 = _mm512_add_ps(_mm512_fmadd_ps(q0, vd, vm), y0);
            y1 = _mm512_add_ps(_mm512_fmadd_ps(q1, vd, vm), y1);
        }
        _mm512_storeu_ps(acc + 32 * b, y0);
        _mm512_storeu_ps(acc + 32 * b + 16, y1);
    }
}

template <bool kMin, int R>
__attribute__((target("avx2,f16c,fma"))) void q4_pass_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                           int64_t nb) {
    const size_t bytes = kMin ? kQ4_1Bytes : kQ4_0Bytes;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        __m256 y[4];
        for (int k = 0; k < 4; ++k) {
            y[k] = _mm256_loadu_ps(acc + 32 * b + 8 * k);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * bytes;
            const float d = _cvtsh_ss(load_u16(blk)) * h[r];
            const __m256 vd = _mm256_set1_ps(d);
            const __m256 vm = _mm256_set1_ps(kMin ? _cvtsh_ss(load_u16(blk + 2)) * h[r] : -8.0f * d);
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + (kMin ? 4 : 2)));
            const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int k = 0; k < 4; ++k) {
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
                y[k] = _mm256_add_ps(_mm256_fmadd_ps(v, vd, vm), y[k]);
            }
        }
        for (int k = 0; k < 4; ++k) {
            _mm256_storeu_ps(acc + 32 * b + 8 * k, y[k]);
        }
    }
}
// R rows (1..4) of Q6_K in one pass over acc, one 256-value super-block at a time (16 zmm of acc).
template <int R>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void q6_k_pass_avx512(float * acc, const uint8_t * const * rows,
                                                                           const float * h, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; ++b) {
        float * a = acc + b * kQK;
        __m512 y[16];
        for (int k = 0; k < 16; ++k) {
            y[k] = _mm512_loadu_ps(a + 16 * k);
        }
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * kQ6_KBytes;
            const __m512 sc = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 192)))),
                _mm512_set1_ps(_cvtsh_ss(load_u16(blk + 208)) * h[r]));
            alignas(64) float scale[16];
            _mm512_store_ps(scale, sc);
            for (int half = 0; half < 2; ++half) {
                const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * half));
                const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * half + 32));
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * half));
                // q_j: the 32 values l + 32j of this half, as int8 in −32..31
                const __m256i q[4] = {
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(ql0, low),
                                                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), two_bits)),
                                    bias),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(ql1, low),
                                                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), two_bits)),
                                    bias),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                                                    _mm256_and_si256(qh, two_bits)),
                                    bias),
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low),
                                                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), two_bits)),
                                    bias),
                };
                for (int j = 0; j < 4; ++j) {
                    const int k = 8 * half + 2 * j;  // zmm index of values l + 32j, l < 16; scale index likewise
                    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q[j])));
                    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q[j], 1)));
                    y[k] = _mm512_fmadd_ps(v0, _mm512_set1_ps(scale[k]), y[k]);
                    y[k + 1] = _mm512_fmadd_ps(v1, _mm512_set1_ps(scale[k + 1]), y[k + 1]);
                }
            }
        }
        for (int k = 0; k < 16; ++k) {
            _mm512_storeu_ps(a + 16 * k, y[k]);
        }
    }
}

// AVX2 versions of the two K-quant passes above: the same per-value summation order (acc, then each
// row's FMA in row order, then Q4_K's summed mins), so they round exactly as the AVX-512 passes.
// 16 ymm registers do not hold a 256-value super-block: acc is walked in 32/64-value pieces.

// R rows (1..4) of Q6_K: per 32 values l + 32j of half n (scales 8n + 2j, 8n + 2j + 1), 4 ymm of acc.
template <int R>
__attribute__((target("avx2,f16c,fma"))) void q6_k_pass_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                             int64_t nb) {
    const __m256i low = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < nb; ++b) {
        float * a = acc + b * kQK;
        alignas(32) float scale[R][16];  // d·h·scales[k] per row
        for (int r = 0; r < R; ++r) {
            const uint8_t * blk = rows[r] + b * kQ6_KBytes;
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 208)) * h[r]);
            const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 192));
            _mm256_store_ps(scale[r], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8)), d));
            _mm256_store_ps(scale[r] + 8,
                            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8))), d));
        }
        for (int half = 0; half < 2; ++half) {
            for (int j = 0; j < 4; ++j) {
                float * aj = a + 128 * half + 32 * j;
                __m256 y[4];
                for (int k = 0; k < 4; ++k) {
                    y[k] = _mm256_loadu_ps(aj + 8 * k);
                }
                for (int r = 0; r < R; ++r) {
                    const uint8_t * blk = rows[r] + b * kQ6_KBytes;
                    // ql bytes: l (j even) or l + 32 (j odd), low nibble for j < 2, high for j >= 2;
                    // qh bits 2j..2j+1 become bits 4..5
                    const __m256i ql =
                        _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * half + 32 * (j & 1)));
                    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * half));
                    const __m256i nib =
                        j < 2 ? _mm256_and_si256(ql, low) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), low);
                    const __m256i top = _mm256_and_si256(j == 0   ? _mm256_slli_epi16(qh, 4)
                                                         : j == 1 ? _mm256_slli_epi16(qh, 2)
                                                         : j == 2 ? qh
                                                                  : _mm256_srli_epi16(qh, 2),
                                                         two_bits);
                    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, top), bias);
                    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                    const __m256 s0 = _mm256_set1_ps(scale[r][8 * half + 2 * j]);
                    const __m256 s1 = _mm256_set1_ps(scale[r][8 * half + 2 * j + 1]);
                    y[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), s0, y[0]);
                    y[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), s0, y[1]);
                    y[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), s1, y[2]);
                    y[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), s1, y[3]);
                }
                for (int k = 0; k < 4; ++k) {
                    _mm256_storeu_ps(aj + 8 * k, y[k]);
                }
            }
        }
    }
}

template <int R>
void q4_0_pass_avx512(float * a, const uint8_t * const * rw, const float * h, int64_t nb) {
    q4_pass_avx512<false, R>(a, rw, h, nb);
}
template <int R>
void q4_1_pass_avx512(float * a, const uint8_t * const * rw, const float * h, int64_t nb) {
    q4_pass_avx512<true, R>(a, rw, h, nb);
}
template <int R>
void q4_0_pass_avx2(float * a, const uint8_t * const * rw, const float * h, int64_t nb) {
    q4_pass_avx2<false, R>(a, rw, h, nb);
}
template <int R>
void q4_1_pass_avx2(float * a, const uint8_t * const * rw, const float * h, int64_t nb) {
    q4_pass_avx2<true, R>(a, rw, h, nb);
}

template <int R>
__attribute__((target("avx512f,f16c,fma"))) void f16_pass_avx512(float * acc, const uint8_t * const * rows,
                                                                 const float * h, int64_t n_embd) {
    int64_t j = 0;
    for (; j + 16 <= n_embd; j += 16) {
        __m512 y = _mm512_loadu_ps(acc + j);
        for (int r = 0; r < R; ++r) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(rows[r] + 2 * j));
            y = _mm512_fmadd_ps(_mm512_cvtph_ps(v), _mm512_set1_ps(h[r]), y);
        }
        _mm512_storeu_ps(acc + j, y);
    }
    for (; j < n_embd; ++j) {
        for (int r = 0; r < R; ++r) {
            acc[j] += h[r] * _cvtsh_ss(load_u16(rows[r] + 2 * j));
        }
    }
}

template <int R>
__attribute__((target("avx2,f16c,fma"))) void f16_pass_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                            int64_t n_embd) {
    int64_t j = 0;
    for (; j + 8 <= n_embd; j += 8) {
        __m256 y = _mm256_loadu_ps(acc + j);
        for (int r = 0; r < R; ++r) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(rows[r] + 2 * j));
            y = _mm256_fmadd_ps(_mm256_cvtph_ps(v), _mm256_set1_ps(h[r]), y);
        }
        _mm256_storeu_ps(acc + j, y);
    }
    for (; j < n_embd; ++j) {
        for (int r = 0; r < R; ++r) {
            acc[j] += h[r] * _cvtsh_ss(load_u16(rows[r] + 2 * j));
        }
    }
}

}  // namespace

// Q4_K, every row of the call per 256-value super-block (16 zmm of acc): per value, acc then each
// row's FMA in row order; the min terms Σ_r dmin_r·h_r·m_r[k] (FMA in row order, per sub-block k) are
// subtracted once at the end. So a row with h = 0 changes nothing, and the rows can be grouped in any
// way: the batched kernel below computes each token exactly as this one does.
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void axpy_q4_k_avx512(float * acc, const uint8_t * const * rows,
                                                                           const float * h, int n, int64_t n_embd) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < n_embd / kQK; ++b) {
        float * a = acc + b * kQK;
        __m512 y[16];
        for (int k = 0; k < 16; ++k) {
            y[k] = _mm512_loadu_ps(a + 16 * k);
        }
        __m256 min_sum = _mm256_setzero_ps();  // Σ_r dmin_r·h_r·m_r[k], k = sub-block
        for (int r = 0; r < n; ++r) {
            const uint8_t * blk = rows[r] + b * kQ4_KBytes;
            uint8_t sm[16];
            q4_k_scales_mins(blk + 4, sm);
            const __m128i sm8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(sm));
            const __m256 sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm8)),
                                            _mm256_set1_ps(_cvtsh_ss(load_u16(blk)) * h[r]));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8)));
            min_sum = _mm256_fmadd_ps(mn, _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2)) * h[r]), min_sum);
            alignas(32) float scale[8];
            _mm256_store_ps(scale, sc);
            for (int c = 0; c < 4; ++c) {
                const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16 + 32 * c));
                const __m256i lo = _mm256_and_si256(q, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                // 16 nibbles of sub-block 2c (low) or 2c + 1 (high) -> 16 floats, times that sub-block's scale
                const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                          _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
                for (int k = 0; k < 4; ++k) {
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[k]));
                    y[4 * c + k] = _mm512_fmadd_ps(v, _mm512_set1_ps(scale[2 * c + k / 2]), y[4 * c + k]);
                }
            }
        }
        alignas(32) float mins[8];
        _mm256_store_ps(mins, min_sum);
        for (int k = 0; k < 16; ++k) {
            _mm512_storeu_ps(a + 16 * k, _mm512_sub_ps(y[k], _mm512_set1_ps(mins[k / 2])));
        }
    }
}

// TT tokens (1..kTileTokens) of the batched Q4_K sum, per super-block and 32-value sub-block s (2 zmm
// per token, from +0 as axpy_q4_k_avx512 from a zeroed acc, stored over acc): each row's 32 values are
// converted once and added to every token's sum in row order, with that token's scale read from a table
// (a broadcast load, no shuffle); then each token's min terms are subtracted. Per token the operations
// of axpy_q4_k_avx512: the table holds float(sc[s])·(d·h), the product it computes lane by lane, and
// the min terms are the same FMAs in the same order. Eight tokens in one pass over the rows (the
// caller's groups of 8), so each row is unpacked once per group.
constexpr int kTileTokens = 8;

template <int TT>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void q4_k_tile_avx512(float * const * acc,
                                                                           const uint8_t * const * rows,
                                                                           const float * const * h, int n, int64_t nb,
                                                                           float * scratch) {
    static_assert(TT >= 1 && TT <= kTileTokens, "tokens per tile");
    float * const smf = scratch;     // [n][8] the rows' scales as floats
    float * const dh = smf + 8 * n;  // [n][8] d·h per row and token (tokens >= TT: 0)
    float * const tab = dh + 8 * n;  // [n][8] float(sc[s])·(d·h) of one sub-block
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t b = 0; b < nb; ++b) {
        __m256 min_sum[TT];
        for (int t = 0; t < TT; ++t) {
            min_sum[t] = _mm256_setzero_ps();
        }
        for (int r = 0; r < n; ++r) {
            const uint8_t * blk = rows[r] + b * kQ4_KBytes;
            uint8_t sm[16];
            q4_k_scales_mins(blk + 4, sm);
            const __m128i sm8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(sm));
            _mm256_storeu_ps(smf + 8 * r, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm8)));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8)));
            const float d = _cvtsh_ss(load_u16(blk)), dmin = _cvtsh_ss(load_u16(blk + 2));
            for (int t = 0; t < kTileTokens; ++t) {
                dh[8 * r + t] = t < TT ? d * h[t][r] : 0.0f;
            }
            for (int t = 0; t < TT; ++t) {
                min_sum[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dmin * h[t][r]), min_sum[t]);
            }
        }
        alignas(32) float mins[TT][8];
        for (int t = 0; t < TT; ++t) {
            _mm256_store_ps(mins[t], min_sum[t]);
        }
        for (int s = 0; s < 8; ++s) {
            // sub-block s: the low (s even) or high (s odd) nibbles of bytes 16 + 32·(s / 2) .. + 32
            for (int r = 0; r < n; ++r) {
                _mm256_storeu_ps(tab + 8 * r,
                                 _mm256_mul_ps(_mm256_set1_ps(smf[8 * r + s]), _mm256_loadu_ps(dh + 8 * r)));
            }
            const size_t at = 16 + 32 * static_cast<size_t>(s / 2);
            const int shift = 4 * (s & 1);
            __m512 y[TT][2];
            for (int t = 0; t < TT; ++t) {
                y[t][0] = y[t][1] = _mm512_setzero_ps();
            }
            for (int r = 0; r < n; ++r) {
                const uint8_t * q = rows[r] + b * kQ4_KBytes + at;
                const __m512i w0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q)));
                const __m512i w1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(q + 16)));
                const __m512 v0 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w0, shift), low));
                const __m512 v1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w1, shift), low));
                const float * a = tab + 8 * r;
                for (int t = 0; t < TT; ++t) {
                    const __m512 at_t = _mm512_set1_ps(a[t]);
                    y[t][0] = _mm512_fmadd_ps(v0, at_t, y[t][0]);
                    y[t][1] = _mm512_fmadd_ps(v1, at_t, y[t][1]);
                }
            }
            for (int t = 0; t < TT; ++t) {
                float * out = acc[t] + b * kQK + 32 * s;
                const __m512 m = _mm512_set1_ps(mins[t][s]);
                _mm512_storeu_ps(out, _mm512_sub_ps(y[t][0], m));
                _mm512_storeu_ps(out + 16, _mm512_sub_ps(y[t][1], m));
            }
        }
    }
}

void axpy_batch_q4_k_avx512(float * const * acc, int n_tokens, const uint8_t * const * rows, const float * const * h,
                            int n, int64_t n_embd, float * scratch) {
    const int64_t nb = n_embd / kQK;
    for (int t = 0; t < n_tokens; t += kTileTokens) {
        switch (std::min(kTileTokens, n_tokens - t)) {
            case 8: q4_k_tile_avx512<8>(acc + t, rows, h + t, n, nb, scratch); break;
            case 7: q4_k_tile_avx512<7>(acc + t, rows, h + t, n, nb, scratch); break;
            case 6: q4_k_tile_avx512<6>(acc + t, rows, h + t, n, nb, scratch); break;
            case 5: q4_k_tile_avx512<5>(acc + t, rows, h + t, n, nb, scratch); break;
            case 4: q4_k_tile_avx512<4>(acc + t, rows, h + t, n, nb, scratch); break;
            case 3: q4_k_tile_avx512<3>(acc + t, rows, h + t, n, nb, scratch); break;
            case 2: q4_k_tile_avx512<2>(acc + t, rows, h + t, n, nb, scratch); break;
            default: q4_k_tile_avx512<1>(acc + t, rows, h + t, n, nb, scratch); break;
        }
    }
}

// Q4_K, every row of the call per super-block: per 64-value chunk c (sub-blocks 2c, 2c + 1), 8 ymm of
// acc; the rows' scales of the super-block first (up to kAxpyMaxRows rows, the AxpyFn contract).
__attribute__((target("avx2,f16c,fma"))) void axpy_q4_k_avx2(float * acc, const uint8_t * const * rows, const float * h,
                                                             int n, int64_t n_embd) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < n_embd / kQK; ++b) {
        float * a = acc + b * kQK;
        alignas(32) float scale[kAxpyMaxRows][8];  // d·h·sc[k] per row and sub-block
        __m256 min_sum = _mm256_setzero_ps();      // Σ_r dmin_r·h_r·m_r[k]
        for (int r = 0; r < n; ++r) {
            const uint8_t * blk = rows[r] + b * kQ4_KBytes;
            uint8_t sm[16];
            q4_k_scales_mins(blk + 4, sm);
            const __m128i sm8 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(sm));
            _mm256_store_ps(scale[r], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm8)),
                                                    _mm256_set1_ps(_cvtsh_ss(load_u16(blk)) * h[r])));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8)));
            min_sum = _mm256_fmadd_ps(mn, _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2)) * h[r]), min_sum);
        }
        alignas(32) float mins[8];
        _mm256_store_ps(mins, min_sum);
        for (int c = 0; c < 4; ++c) {
            float * ac = a + 64 * c;
            __m256 y[8];
            for (int k = 0; k < 8; ++k) {
                y[k] = _mm256_loadu_ps(ac + 8 * k);
            }
            for (int r = 0; r < n; ++r) {
                const __m256i q =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i *>(rows[r] + b * kQ4_KBytes + 16 + 32 * c));
                const __m256i lo = _mm256_and_si256(q, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                const __m128i parts[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                          _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
                for (int p = 0; p < 4; ++p) {
                    const __m256 s = _mm256_set1_ps(scale[r][2 * c + p / 2]);
                    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
                    const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(parts[p], 8)));
                    y[2 * p] = _mm256_fmadd_ps(v0, s, y[2 * p]);
                    y[2 * p + 1] = _mm256_fmadd_ps(v1, s, y[2 * p + 1]);
                }
            }
            for (int k = 0; k < 8; ++k) {
                _mm256_storeu_ps(ac + 8 * k, _mm256_sub_ps(y[k], _mm256_set1_ps(mins[2 * c + k / 4])));
            }
        }
    }
}

constexpr int kRowsPerPass = 4;

// n rows in passes of 4, then the remainder: PASS<R>(acc, rows, h, arg)
#define LLAMAFLASH_DEFINE_AXPY(name, pass, arg_expr)                                               \
    void name(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd) { \
        const int64_t arg = (arg_expr);                                                            \
        int r = 0;                                                                                 \
        for (; r + kRowsPerPass <= n; r += kRowsPerPass) pass<4>(acc, rows + r, h + r, arg);       \
        switch (n - r) {                                                                           \
            case 3: pass<3>(acc, rows + r, h + r, arg); break;                                     \
            case 2: pass<2>(acc, rows + r, h + r, arg); break;                                     \
            case 1: pass<1>(acc, rows + r, h + r, arg); break;                                     \
            default: break;                                                                        \
        }                                                                                          \
    }
LLAMAFLASH_DEFINE_AXPY(axpy_q8_0_avx512, q8_0_pass_avx512, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_q8_0_avx2, q8_0_pass_avx2, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_f16_avx512, f16_pass_avx512, n_embd)
LLAMAFLASH_DEFINE_AXPY(axpy_f16_avx2, f16_pass_avx2, n_embd)
LLAMAFLASH_DEFINE_AXPY(axpy_q4_0_avx512, q4_0_pass_avx512, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_q4_1_avx512, q4_1_pass_avx512, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_q4_0_avx2, q4_0_pass_avx2, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_q4_1_avx2, q4_1_pass_avx2, n_embd / 32)
LLAMAFLASH_DEFINE_AXPY(axpy_q6_k_avx512, q6_k_pass_avx512, n_embd / kQK)
LLAMAFLASH_DEFINE_AXPY(axpy_q6_k_avx2, q6_k_pass_avx2, n_embd / kQK)
#undef LLAMAFLASH_DEFINE_AXPY

#pragma GCC diagnostic pop

}  // namespace axpy
}  // namespace llamaflash
#endif  // LLAMAFLASH_X86
