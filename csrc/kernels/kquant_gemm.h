// kquant_gemm.h — a K-quant matrix product whose every output has the bits of ggml-cpu's vec_dot.
//
// ggml-cpu multiplies K-quant weights by one row (and, without its tiled kernel, by any batch) with one
// vec_dot per output:
//   q[c]       = from_float(x[c])                     x[c]: one f32 row of ne0 values → Q8_K blocks
//   out[c][r]  = vec_dot_q{4,6}_K_q8_K(ne0, W[r], q[c])
// That is the only batch-invariant K-quant kernel ggml has, and it unpacks every weight block again for
// every output. kquant_gemm computes the same outputs for a tile of weight rows × activation columns,
// unpacking each weight block once per tile of up to kGemmCols columns, and summing exactly as ggml's
// x86 vec_dot does (its AVX2 path, ggml-cpu/arch/x86/quants.c):
//   per superblock i (256 values):
//     sumi[8]   int32 lanes; lane k sums, over the superblock's 32-byte chunks, the products of bytes
//               4k..4k+3 of each chunk times their sub-block's scale (Q4_K), or the same less
//               32·scale·Σq8 of the lane's pair of 16-value groups (Q6_K): exact integers, so any
//               instruction sequence that forms the same lane totals gives the same bits
//     acc[8]    = fma(d_i, float(sumi), acc)         d_i = q8.d · fp16(W.d)
//     acc_m[4]  = fma(dmin_i, float(m), acc_m)       Q4_K only: dmin_i = -q8.d · fp16(W.dmin),
//                                                    m[l] = min[2l]·s[2l] + min[2l+1]·s[2l+1],
//                                                    s[j] = bsums[2j] + bsums[2j+1]
//   out = ((acc[0]+acc[4]) + (acc[2]+acc[6])) + ((acc[1]+acc[5]) + (acc[3]+acc[7]))
//         [+ ((acc_m[0]+acc_m[2]) + (acc_m[1]+acc_m[3]))]
// Float operations are applied per output in that order, so the result is the same bits whatever the
// tile, the batch, the thread split or the instruction set (AVX-512 VNNI, AVX-512BW or AVX2).
//
// Whether that holds is probed once per type against the vec_dot of the ggml-cpu loaded in this
// process (a build whose vec_dot sums otherwise, e.g. without AVX2, is never matched). Where it does
// not, or for another type, kquant_gemm calls that vec_dot itself: the bits are vec_dot's either way.
// So does one column (decode), where vec_dot is faster than the kernels; that loop reads the rows
// ahead (row_prefetch.h): a one-column product waits on the memory stream, not on arithmetic.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>

namespace llamaflash {

// Columns one unpacked weight block is reused for (the AVX-512 kernels: 16, kquant_gemm_kernels.h).
constexpr int kGemmCols = 8;
// Weight rows multiplied by every column before the next rows: the block's rows stay in cache while
// the columns' tiles pass over them.
constexpr int64_t kGemmRowBlock = 64;

// Called by kquant_gemm after it has multiplied rows [r0, r0 + n) of w by every column: every row once,
// in order, in blocks of at most kGemmRowBlock rows (r0 relative to w). The block's rows are then in
// cache: a check of rows fresh from flash (crc32c) reads them from there instead of memory, while the
// product's own reads from memory overlap its arithmetic as without a check. It changes no output.
struct RowBlockHook {
    void (*fn)(void * ctx, int64_t r0, int64_t n) = nullptr;
    void * ctx = nullptr;
    void operator()(int64_t r0, int64_t n) const { fn(ctx, r0, n); }
};

// True if kquant_gemm computes this weight type with its own kernel (Q4_K, Q6_K on x86 with AVX2),
// having found it bit-identical to this process's ggml-cpu vec_dot (probed on first call per type:
// random blocks, column counts from 1 to two of the widest kernel tile and one more). False:
// kquant_gemm calls vec_dot per output.
bool kquant_gemm_supported(ggml_type type);

// out[c * out_col_stride + r] = vec_dot(ne0, W row r, q column c) for r < n_rows, c < n_cols.
//   w          n_rows rows of w_row_bytes (= ggml_row_size(type, ne0)), ne0 % 256 == 0
//   q          n_cols rows of Q8_K blocks (from_float of the f32 rows), q_col_bytes apart
// Any type with a vec_dot whose vec_dot_type is Q8_K. Single-threaded: callers split rows or columns.
// The AVX-512 kernels keep per-thread tables of the columns' Q8_K sums and scales (grown to the largest
// call: (n_cols / 16 rounded up) · (ne0 / 256) · 384 bytes for Q4_K, 576 for Q6_K).
// hook: nullptr, or called per block of rows once they are multiplied (RowBlockHook).
void kquant_gemm(ggml_type type, int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                 size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                 const RowBlockHook * hook = nullptr);

}  // namespace llamaflash
