// token_products.h — one token's MUL_MAT_ID over cached experts, as one node.
//
// For a batch of one token, ggml-cpu's MUL_MAT_ID computes every selected expert with one vec_dot
// per output row (its tiled kernel starts at 8 rows of one expert):
//   q_j        = from_float(src1[:, j])                j < ne11, in the weight type's vec_dot_type
//                                                      (block by block: the same bits for any split)
//   out[i, k]  = vec_dot(ne0, W_e[i, :], q_{k mod ne11})   for each slot k, e = ids[k], i < ne1
// where W_e is expert e's [ne1 rows of ne0] matrix. TokenProducts is that computation for the pairs
// (slot k, expert e) of one round, written straight into the MUL_MAT_ID's output [ne1, n_used, 1],
// the weights read from the expert cache's slots: the same bits as ggml's node, in one node (one
// thread barrier) instead of a gather, one MUL_MAT_ID per expert and a scatter.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <vector>

namespace llamaflash {

struct TokenProducts {
    ggml_type type = GGML_TYPE_F32;  // the weights'
    int64_t ne0 = 0;                 // input length: a weight row, a src1 column
    int64_t ne1 = 0;                 // output rows of one expert
    size_t row_bytes = 0;            // one weight row
    std::vector<int32_t> slots;      // per pair: its slot k
    std::vector<const uint8_t *> weights;  // per pair: its expert's matrix, ne1 rows of row_bytes
    std::vector<int32_t> zero_slots;       // slots written as zeros (a draft's slots without an expert)
};

// Whether ggml-cpu computes a one-token MUL_MAT_ID of this weight type with vec_dot as above.
bool token_products_supported(ggml_type type);

// The custom op: dst [ne1, n_used, 1] f32 (strides nb[1] per slot), src[0] = src1 [ne0, ne11, 1] f32;
// userdata: the TokenProducts. The outputs (pairs × rows) are split over the threads.
void token_products(ggml_tensor * dst, int ith, int nth, void * userdata);

}  // namespace llamaflash
