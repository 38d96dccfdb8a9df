// router_rows.h — an MoE layer's router MUL_MAT, every row computed as ggml-cpu computes a row alone.
//
// llama.cpp's build_moe_ffn scores the experts of a batch of T tokens with
//   logits = MUL_MAT(blk.L.ffn_gate_inp, x)      W : [n_embd, n_expert] f32   x : [n_embd, T] f32
//                                                logits : [n_expert, T] f32
// ggml-cpu multiplies an f32 matrix by T >= 2 rows with llamafile's tinyBLAS and by a lone row with
// one vec_dot per output. The two sum in other orders, so a token's logits, and possibly its experts,
// depend on the batch it came in. Where ExpertConfig::router_rows is set, the weight registry binds
// the routers to the device, the split holding the router's MUL_MAT comes here, and every row t is
// computed as a lone row:
//   logits[e, t] = vec_dot_f32(n_embd, W[e, :], x[:, t])
// with the engine's copy of W (the file's f32 bytes, ExpertLayerSpec::router_exact): an ExpertDots
// (expert_dots.h) with one "expert", the router, its outputs split over the threads. Batch-invariant
// evaluation (deterministic answers) then needs no filler row after a lone token.
#pragma once

#include "experts/expert_dots.h"
#include "experts/expert_model.h"
#include "lanes/graph_mirror.h"

#include "ggml-backend.h"
#include "ggml.h"

namespace llamaflash {

// A split that is one served router's MUL_MAT: its model, the layer's position and the node.
struct RouterSplit {
    ExpertModel * model = nullptr;  // nullptr: not a router split
    int position = -1;
    const ggml_tensor * node = nullptr;
};

// The split's router, if its first node is a MUL_MAT over a bound router.
RouterSplit match_router_split(const ggml_cgraph * split);

class RouterRows {
public:
    // Computes the router split on `cpu` (its thread count). Aborts on a split of other nodes or a
    // router of other shape or type than the engine's: an unsupported graph pattern, never a silent
    // wrong answer.
    ggml_status compute(const ggml_cgraph * split, const RouterSplit & match, ggml_backend_t cpu);

private:
    GraphArena arena_;
    ExpertDots dots_;
};

}  // namespace llamaflash
