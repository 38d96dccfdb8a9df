// sparse_axpy.h — the sparse kernel's down_t accumulation (sparse_ffn.h), fused per row type:
//     acc[0..n_embd) += Σ_{r < n} h[r] · dequant(rows[r])
// where rows[r] is one down_t row of n_embd values of the given ggml type, dequantized exactly as
// ggml's to_float does (Q8_0: d·q; Q4_0: d·(q − 8); Q4_1: d·q + m; Q4_K: d·sc·q − dmin·m per 32-value
// sub-block; Q6_K: d·sc·(q − 32) per 16-value sub-block; Q2_K: d·sc·q − dmin·m per 16-value
// sub-block; F16: the half value), in f32.
// SIMD passes handle up to 4 rows per load/store of acc; the summation order over rows is fixed for
// a given (n, ISA), so results are deterministic; ISAs differ only by float rounding (FMA).
#pragma once

#include "ggml.h"

#include <cstdint>

namespace llamaflash {

// Instruction set of the fused down_t accumulation. auto_ = the best this CPU supports.
enum class SparseIsa : int { auto_ = -1, scalar = 0, avx2 = 1, avx512 = 2 };
SparseIsa sparse_ffn_best_isa();  // avx512 (F+BW+F16C+FMA) > avx2 (+F16C+FMA) > scalar
const char * sparse_isa_name(SparseIsa isa);

// acc: n_embd floats; rows: n row pointers; h: n scales. n_embd a multiple of the type's block.
using AxpyFn = void (*)(float * acc, const uint8_t * const * rows, const float * h, int n, int64_t n_embd);

// The fused accumulation for `type` on `isa` (not auto_): Q8_0, Q4_0, Q4_1, F16, Q4_K / Q6_K
// (n_embd a multiple of 256; AVX2 and AVX-512 round alike), Q2_K (AVX2 on AVX2 and AVX-512; the
// draft copy's type), each with a fused scalar loop, and F32 (plain loop); nullptr for
// any other type (the caller dequantizes with ggml's to_float, then adds).
AxpyFn pick_axpy(ggml_type type, SparseIsa isa);

}  // namespace llamaflash
