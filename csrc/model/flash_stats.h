// flash_stats.h — per-model counters of the backend's work, read by Llama.flash_stats().
//
// Written by the split executor (split_executor.h) after each split it computes; relaxed atomics:
// counters, not synchronisation, so a snapshot taken while a split runs may mix before and after.
// Layers are addressed by position (index in FlashModel::layers()); position 0 is the first served
// layer, whose FFN evaluations count the tokens.
//
// Per split:            graph_splits += 1, compute_seconds += ggml compute, prepare_seconds += mirroring
// Per FFN evaluation:   ffn_evals += 1 (one layer over one ubatch); tokens += T at position 0
// Per dense-lane split: dense_lane_calls += 1
// Per sparse split:     sparse_lane_calls += 1, sparse_seconds += compute,
//                       layer_sparse_tokens[p] += T, layer_active[p] += Σ_t |A_t| (active neurons)
// Per sparse layer split that is not a plain GLU FFN: sparse_fallbacks += 1 (it ran dense)
// Per draft-mode split (OffloadState::set_draft): draft_splits += 1, draft_seconds += compute,
//                       draft_tokens += T at position 0; none of the counters above
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace llamaflash {

struct FlashStatsSnapshot {
    uint64_t graph_splits = 0;  // graph_compute calls handled
    uint64_t ffn_evals = 0;     // (layer, ubatch) FFN evaluations
    uint64_t tokens = 0;        // tokens through the first served layer
    uint64_t dense_lane_calls = 0;
    double compute_seconds = 0;                 // wall time computing splits (ggml kernels)
    double prepare_seconds = 0;                 // wall time preparing them (mirroring the split into a private graph)
    uint64_t sparse_lane_calls = 0;             // splits whose FFN ran on the sparse lane
    uint64_t sparse_fallbacks = 0;              // splits of sparse layers that had to run dense (pattern not plain GLU)
    double sparse_seconds = 0;                  // wall time in the sparse lane's graph computes (gate GEMV + kernel)
    uint64_t draft_splits = 0;                  // draft-mode splits
    uint64_t draft_tokens = 0;                  // draft tokens through the first served layer
    double draft_seconds = 0;                   // wall time in draft-mode graph computes
    std::vector<int> layer_ids;                 // served layers, in the order of the vectors below
    std::vector<uint64_t> layer_sparse_tokens;  // tokens computed sparsely per layer
    std::vector<uint64_t> layer_active;         // Σ over those tokens of the active neuron count
};

class FlashStats {
public:
    explicit FlashStats(std::vector<int> layer_ids);

    void count_split(double compute_seconds, double prepare_seconds);
    void count_ffn_eval(int pos, int64_t n_tokens);
    void count_dense_call() { dense_calls_.fetch_add(1, std::memory_order_relaxed); }
    // active_counts: n_tokens entries, |A_t| of each token
    void count_sparse_call(int pos, const int32_t * active_counts, int64_t n_tokens, double seconds);
    void count_sparse_fallback() { sparse_fallbacks_.fetch_add(1, std::memory_order_relaxed); }
    void count_draft_split(int pos, int64_t n_tokens, double seconds);

    FlashStatsSnapshot snapshot() const;
    void reset();

private:
    std::vector<int> layer_ids_;
    std::unique_ptr<std::atomic<uint64_t>[]> layer_sparse_tokens_, layer_active_;
    std::atomic<uint64_t> splits_{0}, ffn_evals_{0}, tokens_{0}, dense_calls_{0};
    std::atomic<uint64_t> compute_ns_{0}, prepare_ns_{0};
    std::atomic<uint64_t> sparse_calls_{0}, sparse_fallbacks_{0}, sparse_ns_{0};
    std::atomic<uint64_t> draft_splits_{0}, draft_tokens_{0}, draft_ns_{0};
};

}  // namespace llamaflash
