// expert_lane.h — computing an MoE layer's expert FFN split from the expert cache, exactly.
//
// The split (one per MoE layer, see expert_model.h) holds the layer's MUL_MAT_IDs over phantom
// expert weights and the element-wise ops between them (GLU / activation, ADD_ID biases, views).
// The lane mirrors every node into a private graph over the same memory, except each MUL_MAT_ID,
// which computes, for every (slot k, token t) whose expert e = ids[k, t] is in the current round,
//   out[:, k, t] = W_e · src1[:, k mod ne11, t]        W_e : [ne1 rows of ne0] from the cache slot
// as three steps: a gather node copies each pair's src1 row into a column of G [ne0, 1, P] (pairs
// grouped by expert, then by token and slot: the order of ggml-cpu's row table); per expert, ggml's
// own MUL_MAT_ID over a one-matrix weight at the expert's slot and its columns of G; a scatter node
// writes each product to (k, t). ggml-cpu sees, per expert, the same rows in the same order as in
// stock and chooses the same kernel (for K-quants with 8 or more rows a tiled kernel that rounds
// differently from one vec_dot per output), so the logits are bit-identical to stock llama.cpp with
// plain (not repacked) weights, whichever slots the experts sit in. Where every expert of the round
// has fewer than 8 rows (decode, small batches) each MUL_MAT_ID is one node instead (expert_dots.h):
// the vec_dots ggml's node makes for such experts, over the slots, without gathers and scatters.
// With ExpertConfig::router_rows (deterministic answers: every row as alone) K-quant experts take that
// node at any row count (kquant_gemm: vec_dot's bits per output), never the tiled kernel.
//
// Rounds. The distinct experts of the batch E = set(ids) are served in one round when they fit
// ExpertCache::capacity (decode and small batches), else in rounds of at most half the capacity, so
// that the next round's experts are read (ExpertCache::read_ahead) into the other half while one
// round computes. Each round: begin() submits the round's misses (none when read ahead), the next
// layer's predicted experts are prefetched (one-token batches), finish() waits and checks, the next
// round is read ahead, then the whole private graph runs; the custom nodes compute only the pairs of
// the round's experts. With one round (ExpertConfig::overlap), the experts usable after begin()
// (resident, or prefetched by a read already complete: ExpertCache::usable_now) are computed in a
// first pass before finish(), while the misses are read, and the misses in a second pass after it:
// the disk's time is spent under that compute. finish() checks the first pass's prefetched experts
// (while the misses are still read); a mismatch fails the split, so that pass's output is never used.
// With several rounds or passes each MUL_MAT_ID's products go to a private staging buffer that
// keeps every pair computed so far, and a copy node puts all of them into the node's memory before
// the element-wise ops run: ggml-alloc lets ops such as ADD_ID write in place into their input, so
// every round must start them from exact products. Each pair's final value is the one of
// the round its expert's down projection ran in, which equals one pass over all experts.
//
// Draft mode (ExpertModel::set_draft, the self-draft of speculative decoding): the routing is first
// rewritten among the resident experts (route_among_resident in the .cpp), then one round runs with
// no begin/finish, no read and no prefetch; a slot left without a resident expert computes zeros.
// Only draft tokens come from it; the exact pass that verifies them runs as above.
#pragma once

#include "experts/expert_model.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "lanes/graph_mirror.h"

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace llamaflash {

// The expert model and layer of a split's first MUL_MAT_ID over a served expert weight.
struct ExpertSplit {
    ExpertModel * model = nullptr;
    int position = -1;
};

// Recognises a split that computes a served MoE layer (nullptr model otherwise).
ExpertSplit match_expert_split(const ggml_cgraph * split);

class ExpertLane {
public:
    ExpertLane();
    ~ExpertLane();
    ExpertLane(const ExpertLane &) = delete;
    ExpertLane & operator=(const ExpertLane &) = delete;

    // Computes every node of `split` (a matched expert split) on `cpu`, whose n_threads threads also
    // check what the cache reads. On an I/O or checksum failure the model keeps the error and
    // GGML_STATUS_FAILED is returned.
    ggml_status compute(const ggml_cgraph * split, const ExpertSplit & match, ggml_backend_t cpu, int n_threads);

    // One MUL_MAT_ID node's work, and the pairs of a round (public for the node functions).
    struct Matmul;
    struct RoundPairs;

private:
    ggml_tensor * mirror(ggml_context * ctx, const ggml_tensor * t);
    // The private graph of one round (in the lane's arena; the caller frees the context).
    ggml_context * build_round(const ggml_cgraph * split, const ExpertModel & model, int position,
                               const std::vector<int> & round, const std::vector<int32_t> & expert_of, int64_t n_used,
                               int64_t n_tokens, bool with_dropped, bool staged, ggml_cgraph ** graph);

    GraphArena arena_;
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirror_;
    std::vector<std::unique_ptr<Matmul>> matmuls_;
    std::unique_ptr<RoundPairs> round_;
};

}  // namespace llamaflash
