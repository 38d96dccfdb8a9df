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
// Token chunks: a split that is exactly a plain GLU FFN of a served layer (match_glu_ffn) over more
// than kDenseChunkTokens tokens is mirrored as a sequence of token chunks of C tokens each
// (C = dense_chunk_tokens(T), a multiple of 8, the last chunk taking the remainder, never fewer than
// 8 tokens): per chunk gate·x_c, up·x_c and the activation write into the lane's own scratch
// [3 · n_ff · C] f32, and down·h_c writes rows c of the split's output. The weights are read from
// the same views for every chunk within the split, so the split still streams each weight once,
// while llama.cpp's [n_ff, T] gate/up/activation buffers are never written: prefill's compute memory
// is the output [n_embd, T] plus the scratch, not 3 · n_ff · T floats. Every output element is the
// same dot product of the same quantized row and the same quantized token row as unchunked (ggml
// quantizes src1 per row and picks the kernel by ne11 >= 8 / groups of 4 rows), so the values are
// those of the unchunked mirror; tests/test_dense_chunks.py checks it bit for bit.
//
// Row-invariant matmuls: for a model with InvariantMatmuls (FlashModel::invariant_matmuls, a
// deterministic load), every MUL_MAT over a bound K-quant weight (invariant_matmul_weight) is
// mirrored as matmul_rows.h's nodes over the resident weight (x quantized once per split, then
// kquant_gemm: each row's bits as alone, whatever the batch) and splits are not chunked. Fused
// gate/up stays (at most kMaxFusedTokens < 8 rows: ggml's vec_dot, the same bits).
//
// Use per split: begin(), then either append_all() (the whole split, dense) or, for the sparse
// lane, map_src()/mirror_node() of the few nodes it needs from ggml.
#pragma once

#include "backend/matmul_rows.h"
#include "ggml.h"
#include "model/engine_config.h"

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llamaflash {

class FlashModel;
struct GluFfnPattern;

// Splits over at most this many tokens are mirrored whole.
constexpr int64_t kDenseChunkTokens = 64;
// At most this many chunks per split (the private graph's size); larger splits take larger chunks.
constexpr int64_t kDenseMaxChunks = 8;
// Tokens per chunk for a split of n_tokens: kDenseChunkTokens, or ceil(n_tokens / kDenseMaxChunks)
// rounded up to a multiple of 8 when that is larger; n_tokens itself when n_tokens <= kDenseChunkTokens.
int64_t dense_chunk_tokens(int64_t n_tokens);
// Bytes of the lane's chunk scratch for a GLU layer of n_ff neurons: 3 · n_ff · (C + 7) f32 (gate, up,
// activation of the widest chunk, C = dense_chunk_tokens(n_ubatch)) when splits of n_ubatch tokens
// are chunked, else 0. (UNARY + MUL splits hold a fourth [n_ff] row per token.)
size_t dense_chunk_scratch_bytes(int64_t n_ff, int64_t n_ubatch);

class DenseLane {
public:
    // Starts the mirror of `split` in `ctx` (no_alloc; owned by the caller for this split).
    void begin(ggml_context * ctx, const ggml_cgraph * split);

    // The private graph's tensor for a source of the split: a bound phantom weight → the model's
    // resident weight (aborts if there is none, or its shape/type differs); a leaf → itself; a
    // tensor computed outside the split → a leaf over its memory.
    ggml_tensor * map_src(const ggml_tensor * src);
    // Before append_all: the split's phantom weight `phantom` (bound to a served layer) is computed over
    // `weight` instead of the model's resident weight: a tensor of the same shape and type whose rows
    // were read from flash (the layer stream's slot). Aborts on another shape or type. With `checked`
    // (reset over `weight` and its rows' checksums, alive through the compute), a row-invariant product
    // of it checks the rows as it reads them (matmul_rows.h CheckedWeight; `attached` then says so).
    void use_weight(const ggml_tensor * phantom, ggml_tensor * weight, CheckedWeight * checked = nullptr);
    // A node of the split, computed by the same op over mirrored sources into the same memory.
    ggml_tensor * mirror_node(const ggml_tensor * node);
    // Mirrors every node of the split into `graph`, fusing gate/up pairs where possible.
    void append_all(ggml_cgraph * graph);

    // The served model whose weights the mirror used (nullptr: none).
    FlashModel * model() const { return model_; }
    // One entry per down projection mirrored: (layer, tokens) of an FFN evaluation.
    const std::vector<std::pair<int, int64_t>> & evaluations() const { return evaluations_; }

    // The scratch held for chunked splits (nullptr / 0 until the first chunked split); its contents
    // live for one split (a later split writes before it reads).
    float * chunk_scratch_data() { return chunk_scratch_.empty() ? nullptr : chunk_scratch_.data(); }
    size_t chunk_scratch_bytes() const { return chunk_scratch_.size() * sizeof(float); }

private:
    bool try_fuse(int i, const ggml_tensor * node);
    // Appends the chunked mirror of a plain GLU FFN split (see the top of this file); false when the
    // split is not one or has too few tokens.
    bool try_chunks(ggml_cgraph * graph);
    ggml_tensor * chunk_node(const ggml_tensor * node, int64_t t0, int64_t n, float * scratch);
    // The model's InvariantMatmuls when `node` is a MUL_MAT mirror_node computes row-invariantly.
    static InvariantMatmuls * rows_alone(const ggml_tensor * node);

    ggml_context * ctx_ = nullptr;
    const ggml_cgraph * split_ = nullptr;
    int n_nodes_ = 0;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirror_;
    std::unordered_map<const ggml_tensor *, CheckedWeight *> checked_;  // use_weight's, by phantom
    std::vector<std::vector<float>> scratch_;  // fused gate/up products z, one per fused pair of a split
    size_t n_fused_ = 0;
    FlashModel * model_ = nullptr;
    std::vector<std::pair<int, int64_t>> evaluations_;
    std::vector<float> chunk_scratch_;  // [3][n_ff · C] of the chunked splits, reused
    QuantizedX quantized_;              // row-invariant matmuls: the split's x quantized (Q8_K columns)
    MatmulTasks tasks_;                 // and their nodes' work
};

}  // namespace llamaflash
