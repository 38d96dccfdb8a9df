// kquant_gemm_kernels.h — the per-ISA kernels behind kquant_gemm (kquant_gemm.h), compiled with target
// attributes in kquant_gemm_x86.cpp and chosen at run time in kquant_gemm.cpp. Every kernel has
// kquant_gemm's contract for its type.
#pragma once

#include "kernels/kquant_gemm.h"

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define LLAMAFLASH_GEMM_X86 1
#else
#define LLAMAFLASH_GEMM_X86 0
#endif

namespace llamaflash {
namespace gemm {

// Columns the AVX-512 kernels reuse one unpacked weight block for (their tiles; kGemmCols elsewhere).
constexpr int kQ4KTileCols = 16;
constexpr int kQ6KTileCols = 16;
// The widest tile of any kernel (the probe checks column counts up to two tiles and one more).
constexpr int kWidestTileCols = kQ4KTileCols > kQ6KTileCols ? kQ4KTileCols : kQ6KTileCols;

// out[c * out_col_stride + r] = vec_dot(ne0, W row r, q column c), r < n_rows, c < n_cols; hook (may be
// nullptr) called per block of kGemmRowBlock rows once the block is multiplied (kquant_gemm.h).
using KernelFn = void (*)(int64_t ne0, const void * w, size_t w_row_bytes, int64_t n_rows, const void * q,
                          size_t q_col_bytes, int64_t n_cols, float * out, size_t out_col_stride,
                          const RowBlockHook * hook);

// The kernel of an instruction set for `type` ("avx2", "avx512vnni"), nullptr where this CPU or this
// type has none; "auto": the best this CPU has. Not checked against vec_dot (kquant_gemm does that).
KernelFn kernel_for(int type, const char * isa);

#if LLAMAFLASH_GEMM_X86
void q4_k_avx2(int64_t, const void *, size_t, int64_t, const void *, size_t, int64_t, float *, size_t,
               const RowBlockHook *);
void q4_k_avx512vnni(int64_t, const void *, size_t, int64_t, const void *, size_t, int64_t, float *, size_t,
                     const RowBlockHook *);
void q6_k_avx2(int64_t, const void *, size_t, int64_t, const void *, size_t, int64_t, float *, size_t,
               const RowBlockHook *);
void q6_k_avx512vnni(int64_t, const void *, size_t, int64_t, const void *, size_t, int64_t, float *, size_t,
                     const RowBlockHook *);
#endif

}  // namespace gemm
}  // namespace llamaflash
