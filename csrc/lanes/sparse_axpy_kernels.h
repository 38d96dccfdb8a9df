// sparse_axpy_kernels.h — internal to the fused down_t accumulation (sparse_axpy.h): what its scalar
// loops and dispatch (sparse_axpy.cpp) share with its AVX2 / AVX-512 passes (sparse_axpy_x86.cpp): the
// ggml block layouts of the row types, their field readers, and the SIMD kernels' entry points. Every
// kernel has the AxpyFn contract: acc[0..n_embd) += Σ_{r < n} h[r] · dequant(rows[r]).
#pragma once

#include "lanes/sparse_axpy.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#define LLAMAFLASH_X86 1
#endif

namespace llamaflash {
namespace axpy {

// Q8_0 block: f16 scale d, then 32 int8 quants; value = d · q.
constexpr size_t kQ8_0Bytes = 34;

inline uint16_t load_u16(const uint8_t * p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// Q4_0 block (18 bytes): f16 d, 16 bytes of nibbles; value j (< 16) = d·((qs[j] & 15) − 8), value
// 16 + j = d·((qs[j] >> 4) − 8). Q4_1 block (20 bytes): f16 d, f16 m, nibbles; value = d·q + m.
constexpr size_t kQ4_0Bytes = 18;
constexpr size_t kQ4_1Bytes = 20;

// K-quant super-blocks of 256 values (ggml-common.h block_q4_K / block_q6_K):
//   Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes packing 8 six-bit scales sc[k] and mins m[k], then
//     128 bytes of nibbles. Sub-block k (32 values) of the 64-value chunk c = k/2 reads qs[32c..32c+32):
//     low nibbles for even k, high nibbles for odd k; value = d·sc[k]·q − dmin·m[k].
//   Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d. Half n (128
//     values) reads ql[64n..), qh[32n..), scales[8n..); for l < 32, with sc = scales + 8n:
//       v[l]    = d·sc[l/16]    ·((ql[l]    & 15) | ((qh[l]      & 3) << 4)) − 32)
//       v[l+32] = d·sc[2 + l/16]·((ql[l+32] & 15) | ((qh[l] >> 2 & 3) << 4)) − 32)
//       v[l+64] = d·sc[4 + l/16]·((ql[l]    >> 4) | ((qh[l] >> 4 & 3) << 4)) − 32)
//       v[l+96] = d·sc[6 + l/16]·((ql[l+32] >> 4) | ((qh[l] >> 6 & 3) << 4)) − 32)
constexpr int64_t kQK = 256;
constexpr size_t kQ4_KBytes = 144;
constexpr size_t kQ6_KBytes = 210;

// The 8 scales (out[0..8)) and 8 mins (out[8..16)) of a Q4_K block's 12 packed bytes.
inline void q4_k_scales_mins(const uint8_t * packed, uint8_t * out) {
    uint32_t u[4];
    std::memcpy(u, packed, 12);
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
    u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
    const uint32_t mins_lo = u[1] & kLow6;
    u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
    u[2] = mins_lo;
    u[0] &= kLow6;
    std::memcpy(out, u, 16);
}

// Q2_K (84 bytes per 256 values): 16 bytes of 4-bit scale (low) and min (high) per 16-value
// sub-block, 64 bytes of 2-bit quants, f16 d, f16 dmin; value = d·sc·q − dmin·m. Sub-block s of
// 16 values holds, for half h = s / 8, j = (s % 8) / 2, g = s % 2: bits 2j..2j+1 of bytes
// qs[32h + 16g .. 32h + 16g + 16), at values 128h + 32j + 16g + l (ggml's dequantize_row_q2_K).
constexpr size_t kQ2_KBytes = 84;

#if LLAMAFLASH_X86
// sparse_axpy_x86.cpp: AVX-512 (F+BW+F16C+FMA) and AVX2 (+F16C+FMA) kernels, up to 4 rows per load/store
// of acc (Q4_K: every row of the call; Q4_K / Q6_K round alike on both); Q2_K has one AVX2 kernel (one row
// at a time), AVX-512 CPUs too; the batched Q4_K sum (AxpyBatchFn) on AVX-512.
void axpy_q8_0_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q8_0_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_f16_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_f16_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_0_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_1_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_0_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_1_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_k_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q6_k_avx512(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q4_k_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q6_k_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_q2_k_avx2(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);
void axpy_batch_q4_k_avx512(float * const * acc, int n_tokens, const uint8_t * const * rows, const float * const * h,
                            int n, int64_t n_embd, float * scratch);
#endif  // LLAMAFLASH_X86

}  // namespace axpy
}  // namespace llamaflash
