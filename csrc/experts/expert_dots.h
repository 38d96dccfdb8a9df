// expert_dots.h — a MUL_MAT_ID over cached experts, each with fewer than 8 rows, as one node.
//
// ggml-cpu's MUL_MAT_ID computes an expert with fewer than 8 rows of the batch (decode: one row per
// expert; small batches) with one vec_dot per output (its tiled kernel starts at 8 rows):
//   q[j, t]       = from_float(src1[:, j, t])        in the weight type's vec_dot_type, block by
//                                                    block (the same bits whatever the split)
//   out[i, k, t]  = vec_dot(ne0, W_e[i, :], q[k mod ne11, t])   e = ids[k, t], i < ne1
// where W_e is expert e's [ne1 rows of ne0] matrix. ExpertDots is that computation for the pairs
// (slot k, token t) of one round, written straight into the MUL_MAT_ID's output [ne1, n_used, T],
// the weights read from the expert cache's slots: the same bits as ggml's node, in one node (one
// thread barrier) instead of a gather, one MUL_MAT_ID per expert and a scatter. Weights whose
// vec_dot_type is Q8_K (the K-quants) take kquant_gemm (kernels/kquant_gemm.h) over all pairs of an
// expert at once, each thread a share of the expert's rows: still vec_dot's bits per output.
#pragma once

#include "model/row_invariance.h"  // kTiledMinRows: where ggml-cpu's MUL_MAT_ID takes its tiled kernel

#include "ggml.h"

#include <cstdint>
#include <vector>

namespace llamaflash {

struct ExpertDots {
    ggml_type type = GGML_TYPE_F32;        // the weights'
    int64_t ne0 = 0;                       // input length: a weight row, a src1 row
    int64_t ne1 = 0;                       // output rows of one expert
    size_t row_bytes = 0;                  // one weight row
    std::vector<int32_t> pairs;            // (k, t) at [2p], [2p + 1]
    std::vector<const uint8_t *> weights;  // per pair: its expert's matrix, ne1 rows of row_bytes
    std::vector<int32_t> zero_pairs;       // (k, t) written as zeros (a draft's slots without an expert)
};

// Whether ggml-cpu computes an expert of this weight type with fewer than kTiledMinRows rows by
// vec_dot as above (false also where GGML_CPU_TILED_MM_FORCE=1 makes it take the tiled kernel).
bool expert_dots_supported(ggml_type type);

// The custom op: dst [ne1, n_used, T] f32, src[0] = src1 [ne0, ne11, T] f32; userdata: the
// ExpertDots. The outputs (pairs × rows) are split over the threads.
void expert_dots(ggml_tensor * dst, int ith, int nth, void * userdata);

}  // namespace llamaflash
