// split_executor.h — what the llamaflash backend does with one graph split (one per backend, i.e.
// per llama.cpp context): mirror it, pick its lane, run it, account for it.
//
// Per split (graph_compute of the LLAMAFLASH backend; splits of one context run one at a time):
//   1. lane   the split is a plain GLU FFN (match_glu_ffn, sparse_lane.h) of a served layer whose
//             model has the sparse lane enabled, the layer a threshold >= 0, and T <= max_tokens
//             tokens → sparse lane; anything else → dense lane. A fixed rule, no timing: the lane
//             of a (layer, T) never changes while the configuration stands.
//   2. build  a private ggml graph in an arena reused across splits: the dense lane's mirror of the
//             whole split (dense_lane.h), or the sparse lane's nodes (sparse_lane.h) after the
//             gate (and up) GEMVs mirrored from ggml.
//   3. run    offload → OffloadState::before_split (a prompt batch first empties the neuron cache's
//             cold region: nothing of it is used until decode, and its memory serves the batch's
//             buffers); the graph on an internal ggml CPU backend with
//             the context's thread count; offload → OffloadState::after_split (page release, I/O
//             error → GGML_STATUS_FAILED).
//             A prompt batch under a budget also records its compute buffers (prompt_buffers.h).
//             Under flash offload a sparse split over more than kSparseChunkTokens tokens (a
//             deterministic batch of up to 63 rows) runs as chunks of kSparseChunkTokens tokens, one
//             after the other: the sparse lane's scratch holds one partial sum per (cluster, token),
//             and the planner counts it for kSparseChunkTokens tokens (plan_budget.VERIFY_ROWS). A
//             chunk's clusters are mostly resident after the chunk before it (the cold region holds a
//             layer's clusters), so the batch still reads each about once.
//             Under flash offload with whole layers (OffloadConfig::stream_layers, layer_stream.h) a
//             split over a served layer's weights instead waits for that layer in the stream (its
//             reads and the next layer's read-ahead are started first) and runs on the dense lane
//             with the split's streamed weights over the slot's rows (compute_streamed). Rows read
//             since their last check are checked by the products as they read them (matmul_rows.h
//             CheckedWeight; before computing where ggml-cpu multiplies a part); an I/O or checksum
//             error fails the split (GGML_STATUS_FAILED, the message kept by the offload state) and
//             the slot is dropped.
//   4. count  into the model's FlashStats (flash_stats.h): the split and its times, the lane call,
//             FFN evaluations, the sparse lane's active neurons.
#pragma once

#include "backend/matmul_rows.h"
#include "backend/prompt_buffers.h"
#include "experts/expert_lane.h"
#include "experts/router_rows.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "lanes/dense_lane.h"
#include "lanes/graph_mirror.h"
#include "lanes/sparse_lane.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

namespace llamaflash {

// The most tokens the sparse lane computes at once under flash offload: the planner counts the lane's
// scratch for this many (plugin/planning/plan_budget.py VERIFY_ROWS, the largest verify batch).
constexpr int64_t kSparseChunkTokens = 7;

class SplitExecutor {
public:
    SplitExecutor();
    ~SplitExecutor();
    SplitExecutor(const SplitExecutor &) = delete;
    SplitExecutor & operator=(const SplitExecutor &) = delete;

    void set_n_threads(int n_threads);

    // Computes all nodes of `split`. Aborts (loudly) if a phantom weight has no resident copy.
    ggml_status compute(const ggml_cgraph * split);

private:
    // A sparse split under flash offload over more than kSparseChunkTokens tokens, computed as
    // consecutive chunks of kSparseChunkTokens (each planned, read, computed and counted as a lane call
    // of its own; its tokens' results are those of the whole batch, sparse_lane.h by cluster).
    ggml_status compute_sparse_chunks(const ggml_cgraph * split, const GluFfnPattern & ffn,
                                      const SparseLayerView & view, std::chrono::steady_clock::time_point t_begin);
    // A split over weights of `layer` of `model`, whose layers come whole from its layer stream.
    ggml_status compute_streamed(const ggml_cgraph * split, FlashModel & model, int layer,
                                 std::chrono::steady_clock::time_point t_begin);
    void append_sparse(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn,
                       const SparseLayerView & view);
    // Counts the sparse lane's call just computed (a draft's, or its active neurons and FFN evaluations).
    void count_sparse_call(FlashModel & model, int pos, double seconds);

    ggml_backend_t cpu_ = nullptr;
    GraphArena arena_;  // metadata memory of the private graph, reused across calls
    DenseLane dense_;
    SparseLane sparse_;
    ExpertLane experts_;
    RouterRows routers_;
    MatmulRows matmul_rows_;
    std::array<CheckedWeight, 3> checks_;     // compute_streamed: a streamed layer's parts checked as multiplied
    PromptBuffers prompt_buffers_;            // the compute buffers of the last prompt batch under a budget
    int n_threads_ = GGML_DEFAULT_N_THREADS;  // the internal CPU backend's, kept in step by set_n_threads
};

}  // namespace llamaflash
