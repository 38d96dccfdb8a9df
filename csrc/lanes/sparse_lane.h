// sparse_lane.h — the sparse decode lane: a served layer's FFN split computed over its active
// neurons only, inside the split executor's private ggml graph (see split_executor.h).
//
// The split the scheduler hands over for a served layer L is recognised as a plain GLU FFN
//   gate = MUL_MAT(blk.L.ffn_gate.weight, x)     x : [n_embd, T] f32, T tokens
//   up   = MUL_MAT(blk.L.ffn_up.weight,   x)
//   h    = GLU(gate, up)  or  MUL(UNARY(gate), up)      act ∈ {silu, gelu (tanh), relu}
//   y    = MUL_MAT(blk.L.ffn_down.weight, h)     y : [n_embd, T] f32
// and nothing else. For such a split of a layer with a threshold, and T <= SparseConfig::max_tokens,
// the split executor chooses this lane, which puts the nodes below into the private graph in place
// of those nodes. Where g and u come from: with the sidecar's bundles in base order (every sidecar
// the converter writes by default, and every offloaded one), g by ggml's GEMV over the resident
// gate and u by the kernel (or, in memory with SparseConfig::up_by_ggml, by ggml's GEMV too); with
// bundles in another order (`convert --order hot`), both by the kernel, from the bundles.
//
// By range (g from the kernel, or u from ggml; sparse_ffn_by_cluster false):
//   g    = MUL_MAT(resident gate, x)   ggml's own (repacked) GEMV, written where the split's gate
//   [u   = MUL_MAT(resident up, x)]    (and up) node lives          (base order only)
//   q    = CUSTOM(x [, g, u])          kernel phase 1: x quantized to the vec_dot types
//   acc  = CUSTOM(q)                   phase 2: per token A = {i : |act(g_i)| > threshold},
//                                      h_i = act(g_i)·(up_i·x), partial y += h_i·down_t[i]
//   y'   = CUSTOM(acc)                 phase 3: y = Σ partials, written where the split's down
//                                      node lives (so every later split reads y as usual)
// ggml's graph executor puts a barrier between consecutive nodes, which is exactly what the kernel's
// phase API needs (sparse_ffn.h); the phases run on the context's threads, no extra fork/join.
//
// By cluster (g from ggml and u from the kernel: in memory by default, and always in offload): the
// kernel's cluster phase, y reduced in ascending cluster order (sparse_ffn_reduce_clusters), so a
// token's result does not depend on which clusters were resident, on read timing or on the other
// tokens of the batch (a verify batch of k tokens gives each token what decoding it alone gives),
// and in-memory and offload results are the same bits. In offload (the model has an offload state,
// offload_state.h) the kernel's rows are the neuron cache's slots, and the accumulate phase is cut
// where the flash reads are waited for (in memory every needed cluster is ready, the wait empty):
//   g    = MUL_MAT(resident gate, x)   as above
//   q    = CUSTOM(x, g)                phase 1, then (thread 0) the clusters holding an active neuron
//                                      are planned: resident ones ready, missing ones read (async)
//   a1   = CUSTOM(q)                   accumulate the ready clusters while the reads run
//   w    = CUSTOM(a1)                  thread 0 waits for the layer's reads (checking what arrives
//                                      meanwhile, neuron_cache.h)
//   a2   = CUSTOM(w)                   accumulate the clusters that just arrived
//   y'   = CUSTOM(a2)                  y = Σ cluster partials in cluster order
// In a1 and a2 each thread checks the cache slot of every cluster it is about to compute when the
// slot's rows are not checked yet (NeuronCache::check_cluster), so the checks of the reads that
// arrive last are spread over the threads instead of serialised in w.
// A failed read or check fails the compute (take_failure() says why); no cluster is computed from it.
// In draft mode (OffloadState::draft) no flash read is made and nothing is waited for; the result
// approximates the model, to draft tokens (DraftMode).
//
// Anything else (another op in the split, a fused gate_up weight, GEGLU_ERF, bias adds, batches
// over max_tokens) is left to the dense lane, which stays bit-identical to stock llama.cpp.
#pragma once

#include "ggml.h"
#include "lanes/sparse_ffn.h"
#include "model/flash_model.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace llamaflash {

class WeightRegistry;

// Where a split's clusters come from, fixed when its nodes are appended (OffloadState::draft(),
// OffloadState::draft_rows()). Every mode selects by the same gate and reduces in cluster order.
enum class DraftMode : int {
    none,      // an exact pass: every needed cluster (offload: from the cache, the missing ones read)
    resident,  // a draft without a draft copy: only the clusters resident in the cache
               // (NeuronCache::plan_resident); the others' terms are dropped
    mixed,     // a draft with the copy: the resident clusters from the cache (exact rows, `ready`),
               // the others from the copy's low-bit up and down_t rows (`pending`: the wait node
               // switches the kernel's rows to the copy, sparse_ffn_rebind_cluster_rows)
    copy,      // a draft with the copy where x cannot be quantized for both up types at once (their
               // vec_dot types differ): every cluster from the copy
};

// The plain GLU FFN of one served layer, as found in a split (pointers into the split).
struct GluFfnPattern {
    FlashModel * model = nullptr;
    int layer = -1;
    const ggml_tensor * gate = nullptr;  // MUL_MAT node with the gate weight
    const ggml_tensor * up = nullptr;    // MUL_MAT node with the up weight
    const ggml_tensor * down = nullptr;  // MUL_MAT node with the down weight (its data = y)
    const ggml_tensor * x = nullptr;     // the FFN input, src[1] of gate and up
    FfnActivation activation = FfnActivation::silu;
};

// Fills `out` and returns true when `split` is exactly a plain GLU FFN of one served layer whose
// weights are bound in `registry` (see the top of this file).
bool match_glu_ffn(const ggml_cgraph * split, const WeightRegistry & registry, GluFfnPattern & out);

class SparseLane {
public:
    // Appends the lane's nodes for `ffn` to `graph`. `gate` is the mirrored gate MUL_MAT node (over
    // the resident gate weight, writing into the split's gate node memory), or nullptr when the
    // kernel should read the gate rows from the bundles (bundles not in base order). `up`: likewise
    // the mirrored up MUL_MAT node (u for every neuron), or nullptr (the kernel computes u for the
    // selected neurons). Calls sparse_ffn_begin (which validates and throws std::invalid_argument on
    // a bad layer). n_threads: the graph's thread count.
    void append(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn, const SparseLayerView & view,
                ggml_tensor * x_leaf, ggml_tensor * gate, ggml_tensor * up, int n_threads, int cluster_size);

    // After the graph computed: |A_t| per token of the last appended split (T entries).
    const std::vector<int32_t> & active_counts() const { return counts_; }
    // The last appended split ran in draft mode (OffloadState::set_draft).
    bool draft() const { return draft_ != DraftMode::none; }
    // After the graph computed: the error that failed it (empty: none), cleared by the call.
    std::string take_failure();

private:
    void append_by_range(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn, ggml_tensor * x_leaf,
                         ggml_tensor * gate, ggml_tensor * up);
    void append_by_cluster(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn, ggml_tensor * x_leaf,
                           ggml_tensor * gate);
    // a phase node (1 unused f32 value at `output`) after the nodes `args`, named
    // llamaflash.sparse.<name>-<layer>
    ggml_tensor * phase_node(ggml_context * ctx, ggml_tensor ** args, int n_args, ggml_custom_op_t op, void * userdata,
                             float * output, const char * name, int layer);
    // the last phase node: y, written where the split's down node lives
    void append_output(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn, ggml_tensor * prev,
                       ggml_custom_op_t op, void * userdata);
    // a draft with the draft copy: DraftMode mixed, or copy where the kernel cannot switch to the
    // copy's rows after quantizing x
    void use_draft_copy(const OffloadState::DraftRows & copy, size_t n_clusters, int cluster_size);
    void fail(const std::string & message);
    // the rows of the plan's ready / pending clusters are the cache's slots (checked before use)
    bool ready_from_cache() const { return cache_ != nullptr && draft_ != DraftMode::copy; }
    bool pending_from_cache() const { return cache_ != nullptr && draft_ == DraftMode::none; }

    SparseFfnScratch scratch_;
    SparseFfnLayer layer_;
    SparseFfnParams params_;
    SparseFfnBatch batch_;
    std::vector<int32_t> counts_;
    float phase_outputs_[16] = {};  // memory of the phase nodes' (unused) 1-value outputs
    // the cluster phase (in memory and offload)
    friend struct ClusterPhases;
    NeuronCache * cache_ = nullptr;  // offload: the neuron cache; nullptr in memory
    int cache_layer_ = -1;           // position of the layer in the cache
    NeuronCache::LayerPlan plan_;
    DraftMode draft_ = DraftMode::none;
    ggml_type copy_type_ = GGML_TYPE_COUNT;
    std::vector<const uint8_t *> copy_up_, copy_down_t_;  // per cluster: its rows in the copy
    std::vector<uint8_t> needed_;
    std::atomic<bool> failed_{false};
    std::string failure_;
};

}  // namespace llamaflash
