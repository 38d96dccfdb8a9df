// expert_model.cpp — see expert_model.h.
#include "experts/expert_model.h"
#include "ggml-cpu.h"

#include "ggml.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace llamaflash {

namespace {

void validate(const ExpertConfig & config) {
    auto fail = [](const std::string & what) { throw std::invalid_argument("expert config: " + what); };
    if (config.base_path.empty()) fail("no base model path");
    if (config.n_embd <= 0) fail("n_embd must be positive");
    if (config.layers.empty()) fail("no served layers");
    int previous = -1;
    for (const ExpertLayerSpec & l : config.layers) {
        const std::string where = "layer " + std::to_string(l.layer) + ": ";
        if (l.layer <= previous) fail(where + "layers must be distinct and in increasing order");
        previous = l.layer;
        if (l.n_expert <= 0 || l.n_used <= 0 || l.n_used > l.n_expert) fail(where + "bad expert counts");
        if (l.n_slots < l.n_used || l.n_slots > l.n_expert) {
            fail(where + "n_slots " + std::to_string(l.n_slots) + " must lie in [n_used, n_expert] = [" +
                 std::to_string(l.n_used) + ", " + std::to_string(l.n_expert) + "]");
        }
        if (static_cast<int>(l.pinned.size()) > l.n_slots - l.n_used) fail(where + "too many pinned experts");
        std::vector<char> seen(static_cast<size_t>(l.n_expert), 0);
        for (int e : l.pinned) {
            if (e < 0 || e >= l.n_expert || seen[static_cast<size_t>(e)]) fail(where + "bad pinned expert");
            seen[static_cast<size_t>(e)] = 1;
        }
        if (l.tensors.size() < 2 || l.tensors.size() > 3) fail(where + "expects 2 or 3 expert tensors");
        for (const ExpertTensorSpec & t : l.tensors) {
            if (t.type < 0 || t.type >= GGML_TYPE_COUNT || t.ne0 <= 0 || t.ne1 <= 0) fail(where + "bad tensor");
            const uint64_t expect = static_cast<uint64_t>(ggml_row_size(static_cast<ggml_type>(t.type), t.ne0)) *
                                    static_cast<uint64_t>(t.ne1);
            if (t.expert_bytes != expect) {
                fail(where + "expert_bytes " + std::to_string(t.expert_bytes) + " != " + std::to_string(expect));
            }
            if (!t.checksums.empty() && t.checksums.size() != static_cast<size_t>(l.n_expert)) {
                fail(where + "one checksum per expert expected");
            }
        }
        if (!l.router.empty() && l.router.size() != static_cast<size_t>(l.n_expert * config.n_embd)) {
            fail(where + "router must be n_expert x n_embd floats");
        }
        if (config.router_rows && (l.router.empty() || !l.router_exact)) {
            fail(where + "router_rows needs the layer's router, stored in f32 by the file");
        }
    }
}

}  // namespace

ExpertModel::ExpertModel(ExpertConfig config) : config_(std::move(config)) {}

std::shared_ptr<ExpertModel> ExpertModel::open(ExpertConfig config) {
    validate(config);
    std::shared_ptr<ExpertModel> model(new ExpertModel(std::move(config)));
    const int max_layer = model->config_.layers.back().layer;
    model->position_of_.assign(static_cast<size_t>(max_layer) + 1, -1);
    for (size_t p = 0; p < model->config_.layers.size(); ++p) {
        model->position_of_[static_cast<size_t>(model->config_.layers[p].layer)] = static_cast<int>(p);
    }
    model->cache_ = std::make_unique<ExpertCache>(model->config_);
    return model;
}

int ExpertModel::position(int layer) const {
    if (layer < 0 || static_cast<size_t>(layer) >= position_of_.size()) {
        return -1;
    }
    return position_of_[static_cast<size_t>(layer)];
}

const ExpertTensorSpec * ExpertModel::tensor(int position, ExpertTensorKind kind) const {
    for (const ExpertTensorSpec & t : config_.layers[static_cast<size_t>(position)].tensors) {
        if (t.kind == kind) {
            return &t;
        }
    }
    return nullptr;
}

std::vector<float> ExpertModel::router_logits(int position, const float * x) const {
    const ExpertLayerSpec & spec = config_.layers[static_cast<size_t>(position)];
    if (spec.router.empty()) {
        return {};
    }
    // logits_e = router_e · x, by ggml-cpu's f32 dot product (SIMD, several partial sums: a plain
    // loop's single accumulator is one serial chain of n_embd dependent adds per expert, ~0.35 ms per
    // layer at 2048 x 128). Only rankings use these logits (prefetch, draft substitution): the order
    // of summation is free.
    static const ggml_vec_dot_t dot = ggml_get_type_traits_cpu(GGML_TYPE_F32)->vec_dot;
    const int n = static_cast<int>(config_.n_embd);
    std::vector<float> logits(static_cast<size_t>(spec.n_expert));
    for (int e = 0; e < spec.n_expert; ++e) {
        const float * row = spec.router.data() + static_cast<size_t>(e) * static_cast<size_t>(n);
        dot(n, &logits[static_cast<size_t>(e)], 0, row, 0, x, 0, 1);
    }
    return logits;
}

std::vector<int> ExpertModel::predict_next(int position, const float * x) const {
    if (!config_.prefetch || position + 1 >= static_cast<int>(config_.layers.size())) {
        return {};
    }
    const ExpertLayerSpec & next = config_.layers[static_cast<size_t>(position) + 1];
    const std::vector<float> logits = router_logits(position + 1, x);
    if (logits.empty()) {
        return {};
    }
    // the k largest (ties: lower expert first)
    const int k = std::min(next.n_expert, next.n_used);
    std::vector<int> order(static_cast<size_t>(next.n_expert));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
        return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
               (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
    });
    order.resize(static_cast<size_t>(k));
    return order;
}

void ExpertModel::count_draft_split(int64_t pairs, int64_t substituted, int64_t dropped) {
    ++lane_stats_.draft_splits;
    lane_stats_.draft_pairs += static_cast<uint64_t>(pairs);
    lane_stats_.draft_substituted += static_cast<uint64_t>(substituted);
    lane_stats_.draft_dropped += static_cast<uint64_t>(dropped);
}

void ExpertModel::count_split(int position, int64_t n_tokens, int64_t n_experts, int rounds, bool overlapped,
                              double compute_seconds, double split_seconds) {
    ++lane_stats_.splits;
    if (position == 0) {
        lane_stats_.tokens += static_cast<uint64_t>(n_tokens);
    }
    lane_stats_.experts += static_cast<uint64_t>(n_experts);
    lane_stats_.rounds += static_cast<uint64_t>(rounds);
    lane_stats_.multi_round_splits += rounds > (overlapped ? 2 : 1) ? 1 : 0;  // capacity rounds, not passes
    lane_stats_.overlapped_splits += overlapped ? 1 : 0;
    lane_stats_.compute_seconds += compute_seconds;
    lane_stats_.split_seconds += split_seconds;
}

void ExpertModel::reset_stats() {
    std::lock_guard<std::mutex> lock(lane_mu_);
    lane_stats_ = LaneStats{};
    cache_->reset_stats();
}

void ExpertModel::set_error(const std::string & message) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.empty()) {
        error_ = message;
    }
}

std::string ExpertModel::take_error() {
    std::lock_guard<std::mutex> lock(error_mu_);
    std::string out;
    out.swap(error_);
    return out;
}

}  // namespace llamaflash
