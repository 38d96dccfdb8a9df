// flash_stats.cpp — see flash_stats.h.
#include "model/flash_stats.h"

namespace llamaflash {

namespace {

uint64_t to_ns(double seconds) { return static_cast<uint64_t>(seconds * 1e9); }

double to_seconds(const std::atomic<uint64_t> & ns) { return static_cast<double>(ns.load()) * 1e-9; }

}  // namespace

FlashStats::FlashStats(std::vector<int> layer_ids)
    : layer_ids_(std::move(layer_ids)),
      layer_sparse_tokens_(new std::atomic<uint64_t>[layer_ids_.size()]()),
      layer_active_(new std::atomic<uint64_t>[layer_ids_.size()]()) {}

void FlashStats::count_split(double compute_seconds, double prepare_seconds) {
    splits_.fetch_add(1, std::memory_order_relaxed);
    compute_ns_.fetch_add(to_ns(compute_seconds), std::memory_order_relaxed);
    prepare_ns_.fetch_add(to_ns(prepare_seconds), std::memory_order_relaxed);
}

void FlashStats::count_ffn_eval(int pos, int64_t n_tokens) {
    ffn_evals_.fetch_add(1, std::memory_order_relaxed);
    if (pos == 0) {
        tokens_.fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    }
}

void FlashStats::count_sparse_call(int pos, const int32_t * active_counts, int64_t n_tokens, double seconds) {
    sparse_calls_.fetch_add(1, std::memory_order_relaxed);
    sparse_ns_.fetch_add(to_ns(seconds), std::memory_order_relaxed);
    if (pos < 0 || static_cast<size_t>(pos) >= layer_ids_.size()) {
        return;
    }
    uint64_t active = 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        active += static_cast<uint64_t>(active_counts[t]);
    }
    layer_sparse_tokens_[pos].fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    layer_active_[pos].fetch_add(active, std::memory_order_relaxed);
}

void FlashStats::count_draft_split(int pos, int64_t n_tokens, double seconds) {
    draft_splits_.fetch_add(1, std::memory_order_relaxed);
    draft_ns_.fetch_add(to_ns(seconds), std::memory_order_relaxed);
    if (pos == 0) {
        draft_tokens_.fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    }
}

FlashStatsSnapshot FlashStats::snapshot() const {
    FlashStatsSnapshot s;
    s.graph_splits = splits_.load();
    s.ffn_evals = ffn_evals_.load();
    s.tokens = tokens_.load();
    s.dense_lane_calls = dense_calls_.load();
    s.compute_seconds = to_seconds(compute_ns_);
    s.prepare_seconds = to_seconds(prepare_ns_);
    s.sparse_lane_calls = sparse_calls_.load();
    s.sparse_fallbacks = sparse_fallbacks_.load();
    s.sparse_seconds = to_seconds(sparse_ns_);
    s.draft_splits = draft_splits_.load();
    s.draft_tokens = draft_tokens_.load();
    s.draft_seconds = to_seconds(draft_ns_);
    s.layer_ids = layer_ids_;
    for (size_t p = 0; p < layer_ids_.size(); ++p) {
        s.layer_sparse_tokens.push_back(layer_sparse_tokens_[p].load());
        s.layer_active.push_back(layer_active_[p].load());
    }
    return s;
}

void FlashStats::reset() {
    for (std::atomic<uint64_t> * c :
         {&splits_, &ffn_evals_, &tokens_, &dense_calls_, &compute_ns_, &prepare_ns_, &sparse_calls_,
          &sparse_fallbacks_, &sparse_ns_, &draft_splits_, &draft_tokens_, &draft_ns_}) {
        c->store(0);
    }
    for (size_t p = 0; p < layer_ids_.size(); ++p) {
        layer_sparse_tokens_[p] = 0;
        layer_active_[p] = 0;
    }
}

}  // namespace llamaflash
