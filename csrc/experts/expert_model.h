// expert_model.h — a Mixture-of-Experts model whose routed experts llamaflash serves from flash.
//
// llama.cpp's build_moe_ffn computes, per MoE layer and batch of T tokens,
//   ids  = top-k(router(x))                         ids : [n_used, T] i32 (expert of slot k, token t)
//   up   = MUL_MAT_ID(blk.L.ffn_up_exps,   x, ids)  up  : [n_ff, n_used, T]   x : [n_embd, 1, T]
//   gate = MUL_MAT_ID(blk.L.ffn_gate_exps, x, ids)                            (or one merged gate_up)
//   h    = act(gate) * up  (+ per-expert biases via ADD_ID)
//   y_k  = MUL_MAT_ID(blk.L.ffn_down_exps, h, ids)  y   : [n_embd, n_used, T]
// The expert tensors are 3-D, [ne0 = input, ne1 = output rows, n_expert]: expert e's matrix is the
// contiguous slice of nb[2] bytes at data + e·nb[2], so it is one range of the base GGUF file.
//
// ExpertModel owns what serves those MUL_MAT_IDs: the base file's reader (direct I/O), the expert
// cache (expert_cache.h: per layer a fixed number of slots, pinned hot experts, LRU for the rest),
// the next-layer predictor (the next layer's router applied to this layer's FFN input), and the
// counters. The computation itself is the expert lane (expert_lane.h). Nothing is approximated:
// every expert a token routes to is computed from its exact bytes.
//
// Lifetime: opened from one ExpertConfig (ExpertModel::open), owned by Python (llamaflash.Llama) and
// by the weight registry for every llama.cpp buffer bound to it.
#pragma once

#include "experts/expert_cache.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace llamaflash {

class ExpertModel {
public:
    // Validates `config` and opens the base file, the cache and its pinned experts (read now, checked
    // against their checksums). Throws std::invalid_argument (bad config), IoError (the file),
    // std::runtime_error (a pinned expert failing its check).
    static std::shared_ptr<ExpertModel> open(ExpertConfig config);

    const ExpertConfig & config() const { return config_; }
    bool serves(int layer) const { return position(layer) >= 0; }
    // Whether the lane computes this layer's router MUL_MAT too (ExpertConfig::router_rows).
    bool serves_router(int layer) const { return config_.router_rows && serves(layer); }
    int position(int layer) const;  // index in config().layers, -1 when not served
    const ExpertLayerSpec & layer_spec(int position) const { return config_.layers[position]; }
    const ExpertTensorSpec * tensor(int position, ExpertTensorKind kind) const;

    ExpertCache & cache() { return *cache_; }
    const ExpertCache & cache() const { return *cache_; }

    // Experts predicted for the served layer after `position` from this layer's FFN input x
    // ([n_embd] f32): the n_used largest logits of the next layer's router
    // (more would cost more reads than they find: docs/MOE.md, "Predicting the next layer's experts").
    // Empty when there is no next layer, no router or prefetch is off.
    std::vector<int> predict_next(int position, const float * x) const;

    // logits_e = router_e · x for the layer at `position` (its router, [n_expert rows of n_embd] f32)
    // and its FFN input x ([n_embd] f32); empty when the config holds no router for it.
    std::vector<float> router_logits(int position, const float * x) const;

    // Draft mode (self-speculation). While set, the lane routes each token among the resident experts
    // only (cache-conditional routing): a routed expert that is not resident is replaced by the
    // resident expert the layer's router scores highest for that token and the token does not use yet
    // (the slot keeps its routing weight); with no router, the lowest-numbered such expert; with none
    // left, the slot's products are zero. Nothing is read from flash, waited for or prefetched. An
    // approximation, used only to propose tokens that an exact pass then verifies.
    void set_draft(bool on) { draft_.store(on); }
    bool draft() const { return draft_.load(); }

    // Counting llama.cpp's weights bound to this model (the weight registry), for the load check.
    void count_bound() { ++bound_; }
    int bound_count() const { return bound_; }

    // Serialises the lane's use of the cache (several llama.cpp contexts may share the model).
    std::mutex & lane_mutex() { return lane_mu_; }

    // Counters of the expert lane: splits, tokens (counted at the first served layer), experts
    // computed, rounds, and times.
    struct LaneStats {
        uint64_t splits = 0;
        uint64_t tokens = 0;
        uint64_t experts = 0;  // distinct experts per split, summed
        uint64_t rounds = 0;
        uint64_t multi_round_splits = 0;
        uint64_t overlapped_splits = 0;  // resident experts computed while the split's misses were read
        double compute_seconds = 0.0;    // the private graphs
        double split_seconds = 0.0;      // whole splits: reads, waits, checks and compute
        uint64_t draft_splits = 0;       // draft-mode splits (not counted above)
        uint64_t draft_pairs = 0;        // their (slot, token) pairs
        uint64_t draft_substituted = 0;  // pairs routed to a resident expert instead of their own
        uint64_t draft_dropped = 0;      // pairs left without a resident expert (zero products)
    };
    void count_split(int position, int64_t n_tokens, int64_t n_experts, int rounds, bool overlapped,
                     double compute_seconds, double split_seconds);
    void count_draft_split(int64_t pairs, int64_t substituted, int64_t dropped);
    LaneStats lane_stats() const { return lane_stats_; }
    void reset_stats();

    // The error that failed the last compute (I/O or checksum), cleared; "" if none.
    void set_error(const std::string & message);
    std::string take_error();

private:
    explicit ExpertModel(ExpertConfig config);

    ExpertConfig config_;
    std::vector<int> position_of_;  // layer id → position, -1
    std::unique_ptr<ExpertCache> cache_;
    int bound_ = 0;
    std::mutex lane_mu_;
    std::atomic<bool> draft_{false};
    LaneStats lane_stats_;
    mutable std::mutex error_mu_;
    std::string error_;
};

}  // namespace llamaflash
