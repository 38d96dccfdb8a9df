// sparse_axpy.h — the sparse kernel's down_t accumulation (sparse_ffn.h), fused per row type:
//     acc[0..n_embd) += Σ_{r < n} h[r] · dequant(rows[r])
// where rows[r] is one down_t row of n_embd values of the given ggml type, dequantized exactly as
// ggml's to_float does (Q8_0: d·q; Q4_0: d·(q − 8); Q4_1: d·q + m; Q4_K: d·sc·q − dmin·m per 32-value
// sub-block; Q6_K: d·sc·(q − 32) per 16-value sub-block; Q2_K: d·sc·q − dmin·m per 16-value
// sub-block; F16: the half value), in f32.
// SIMD passes handle up to 4 rows per load/store of acc (Q4_K: every row of the call); the summation
// order over rows is fixed for a given (n, ISA), so results are deterministic; ISAs differ only by float
// rounding (FMA).
#pragma once

#include "ggml.h"

#include <cstdint>

namespace llamaflash {

// Instruction set of the fused down_t accumulation. auto_ = the best this CPU supports.
enum class SparseIsa : int { auto_ = -1, scalar = 0, avx2 = 1, avx512 = 2 };
SparseIsa sparse_ffn_best_isa();  // avx512 (F+BW+F16C+FMA) > avx2 (+F16C+FMA) > scalar
const char * sparse_isa_name(SparseIsa isa);

// acc: n_embd floats; rows: n row pointers (n <= kAxpyMaxRows); h: n scales. n_embd a multiple of the
// type's block.
constexpr int kAxpyMaxRows = 256;
using AxpyFn = void (*)(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);

// The same sum for several tokens over one set of rows, each row's values unpacked once, written over
// acc (not added to it):
//     acc[t][0..n_embd) = Σ_{r < n} h[t][r] · dequant(rows[r])         t < n_tokens, n >= 1
// Token t gets exactly the bits of the AxpyFn of (type, ISA) into a zeroed acc over the rows with
// h[t][r] != 0 alone, in the same order: a row with h = 0 changes nothing there (x + 0·v = x; the sum
// never holds −0, starting from +0), and the kernel's order of operations per value does not depend on
// how rows are grouped. So
// tokens that select different rows of a cluster share one call over the union of their rows, with
// h = 0 where a token does not select a row. scratch: axpy_batch_scratch_floats(n) floats.
using AxpyBatchFn = void (*)(float * const * acc, int n_tokens, const uint8_t * const * rows, const float * const * h,
                             int n, int64_t n_embd, float * scratch);
constexpr size_t axpy_batch_scratch_floats(int n) { return static_cast<size_t>(24) * n; }

// The fused accumulation for `type` on `isa` (not auto_): Q8_0, Q4_0, Q4_1, F16, Q4_K / Q6_K
// (n_embd a multiple of 256; AVX2 and AVX-512 round alike), Q2_K (AVX2 on AVX2 and AVX-512; the
// draft copy's type), each with a fused scalar loop, and F32 (plain loop); nullptr for
// any other type (the caller dequantizes with ggml's to_float, then adds).
AxpyFn pick_axpy(ggml_type type, SparseIsa isa);

// The batched accumulation for `type` on `isa` where one exists with the property above (Q4_K on
// AVX-512), else nullptr (the caller runs pick_axpy's kernel per token).
AxpyBatchFn pick_axpy_batch(ggml_type type, SparseIsa isa);

}  // namespace llamaflash
