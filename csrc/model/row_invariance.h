// row_invariance.h — whether this process's ggml-cpu gives a K-quant matmul row the same bits in a
// batch as alone.
//
// ggml-cpu multiplies K-quant weights (Q2_K..Q6_K) by a batch of 8 or more rows with its tiled kernel
// (ggml-cpu/tiled) and by fewer rows with one vec_dot per output; the two give a row other bits. The
// tiled kernel is on unless GGML_CPU_TILED_MM=0 is in the environment when the process's first such
// matmul runs: ggml reads the variable once and keeps its answer for the process.
//
// kquant_rows_invariant(max_rows) finds out by computing, for each of those types,
//   Y = W · X        W : [256, 16] random weights in the type, X : [256, n] f32, n = 8 and max_rows
// once as one MUL_MAT and once per row alone, and comparing the bits. It may be the process's first
// K-quant matmul (ggml then decides here, as it would at the first model's).
#pragma once

#include <cstdint>

namespace llamaflash {

// Rows of a batch from which ggml-cpu multiplies K-quant weights with its tiled kernel (while it is on)
// instead of one vec_dot per output (ggml-cpu/tiled, ggml_tiled_min_batch).
constexpr int64_t kTiledMinRows = 8;

// True if every K-quant type gives each row of an n-row MUL_MAT (n = 8 and max_rows) the bits of
// that row alone, on n_threads threads.
bool kquant_rows_invariant(int max_rows, int n_threads);

}  // namespace llamaflash
