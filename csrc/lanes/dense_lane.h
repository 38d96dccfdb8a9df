// dense_lane.h — the exact dense FFN lane: a split mirrored into a private graph over llamaflash's
// own weights.
//
// The scheduler hands the llamaflash backend one graph split per served layer, e.g. for SwiGLU
//   up   = MUL_MAT(blk.L.ffn_up.weight,   x)      x    : [n_embd, n_tokens] f32
//   gate = MUL_MAT(blk.L.ffn_gate.weight, x)      gate : [n_ff,   n_tokens] f32
//   h    = GLU(gate, up)                          h    : [n_ff,   n_tokens] f32   (swiglu/geglu/reglu)
//   y    = MUL_MAT(blk.L.ffn_down.weight, h)      y    : [n_embd, n_tokens] f32
// (or unary activation + MUL, scaling, ... whatever the architecture builds). The weights in that
// split are phantom. The dense lane mirrors every node of the split into a private graph in which each
// phantom weight is replaced by the layer's resident weight (FlashModel::dense_weight) and every tensor
// computed outside the split becomes a leaf over the same memory; outputs are written to the memory
// the scheduler allocated for the original nodes. The split executor (split_executor.h) runs the
// private graph on its internal ggml CPU backend: ggml's own (blocked, repacked) kernels on the
// context's thread count. Result: bit-identical to stock llama.cpp for the same weights.
//
// Fused gate/up: when a layer's gate and up are used in place from unpadded bundles of one type
// (FlashModel::fused_gate_up) and the batch has at most kMaxFusedTokens tokens, ONE matmul streams
// the bundles once, z = [gate_0·x, up_0·x, gate_1·x, ...] : [2·n_ff, T], and two element-wise nodes
// copy rows 2i (gate) and 2i+1 (up) of z into the memory of the original gate and up nodes. The
// values are those of the two separate matmuls (same rows, same dot products).
//
// Use per split: begin(), then either append_all() (the whole split, dense) or, for the sparse
// lane, map_src()/mirror_node() of the few nodes it needs from ggml.
#pragma once

#include "ggml.h"
#include "model/engine_config.h"

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llamaflash {

class FlashModel;

class DenseLane {
public:
    // Starts the mirror of `split` in `ctx` (no_alloc; owned by the caller for this split).
    void begin(ggml_context * ctx, const ggml_cgraph * split);

    // The private graph's tensor for a source of the split: a bound phantom weight → the model's
    // resident weight (aborts if there is none, or its shape/type differs); a leaf → itself; a
    // tensor computed outside the split → a leaf over its memory.
    ggml_tensor * map_src(const ggml_tensor * src);
    // A node of the split, computed by the same op over mirrored sources into the same memory.
    ggml_tensor * mirror_node(const ggml_tensor * node);
    // Mirrors every node of the split into `graph`, fusing gate/up pairs where possible.
    void append_all(ggml_cgraph * graph);

    // The served model whose weights the mirror used (nullptr: none).
    FlashModel * model() const { return model_; }
    // One entry per down projection mirrored: (layer, tokens) of an FFN evaluation.
    const std::vector<std::pair<int, int64_t>> & evaluations() const { return evaluations_; }

private:
    bool try_fuse(int i, const ggml_tensor * node);

    ggml_context * ctx_ = nullptr;
    const ggml_cgraph * split_ = nullptr;
    int n_nodes_ = 0;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirror_;
    std::vector<std::vector<float>> scratch_;  // fused gate/up products z, one per fused pair of a split
    size_t n_fused_ = 0;
    FlashModel * model_ = nullptr;
    std::vector<std::pair<int, int64_t>> evaluations_;
};

}  // namespace llamaflash
