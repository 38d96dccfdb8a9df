// weight_registry.cpp — see weight_registry.h.
#include "backend/weight_registry.h"

#include <cstdio>
#include <cstring>

namespace llamaflash {

bool parse_ffn_weight_name(const char * name, int * layer, FfnWeightKind * kind) {
    int il = -1;
    int consumed = 0;
    char which[8] = {0};
    // "blk.%d.ffn_%4[a-z].weight" — check the full match by the consumed length
    if (std::sscanf(name, "blk.%d.ffn_%4[a-z].weight%n", &il, which, &consumed) != 2 || consumed == 0 ||
        name[consumed] != '\0' || il < 0) {
        return false;
    }
    if (std::strcmp(which, "gate") == 0) {
        *kind = FfnWeightKind::gate;
    } else if (std::strcmp(which, "up") == 0) {
        *kind = FfnWeightKind::up;
    } else if (std::strcmp(which, "down") == 0) {
        *kind = FfnWeightKind::down;
    } else {
        return false;
    }
    *layer = il;
    return true;
}

bool parse_expert_weight_name(const char * name, int * layer, ExpertTensorKind * kind) {
    int il = -1;
    int consumed = 0;
    char which[16] = {0};
    if (std::sscanf(name, "blk.%d.ffn_%15[a-z_].weight%n", &il, which, &consumed) != 2 || consumed == 0 ||
        name[consumed] != '\0' || il < 0) {
        return false;
    }
    static const struct {
        const char * name;
        ExpertTensorKind kind;
    } kinds[] = {{"gate_exps", ExpertTensorKind::gate},
                 {"up_exps", ExpertTensorKind::up},
                 {"down_exps", ExpertTensorKind::down},
                 {"gate_up_exps", ExpertTensorKind::gate_up}};
    for (const auto & k : kinds) {
        if (std::strcmp(which, k.name) == 0) {
            *kind = k.kind;
            *layer = il;
            return true;
        }
    }
    return false;
}

bool parse_router_weight_name(const char * name, int * layer) {
    int il = -1;
    int consumed = 0;
    if (std::sscanf(name, "blk.%d.ffn_gate_inp.weight%n", &il, &consumed) != 1 || consumed == 0 ||
        name[consumed] != '\0' || il < 0) {
        return false;
    }
    *layer = il;
    return true;
}

WeightRegistry & WeightRegistry::instance() {
    static WeightRegistry registry;
    return registry;
}

void WeightRegistry::set_pending(std::shared_ptr<FlashModel> model) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ = std::move(model);
}

void WeightRegistry::set_pending_experts(std::shared_ptr<ExpertModel> model) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_experts_ = std::move(model);
}

void WeightRegistry::set_pending_matmuls(std::shared_ptr<InvariantMatmuls> model) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_matmuls_ = std::move(model);
}

void WeightRegistry::clear_pending() {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.reset();
    pending_experts_.reset();
    pending_matmuls_.reset();
}

std::shared_ptr<FlashModel> WeightRegistry::pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_;
}

bool WeightRegistry::pending_serves(const char * name) const {
    int layer = -1;
    FfnWeightKind kind;
    ExpertTensorKind expert_kind = ExpertTensorKind::up;
    if (parse_expert_weight_name(name, &layer, &expert_kind)) {
        std::lock_guard<std::mutex> lock(mu_);
        return pending_experts_ && pending_experts_->serves(layer);
    }
    if (parse_router_weight_name(name, &layer)) {
        std::lock_guard<std::mutex> lock(mu_);
        return pending_experts_ && pending_experts_->serves_router(layer);
    }
    if (!parse_ffn_weight_name(name, &layer, &kind)) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    return pending_ && pending_->serves_layer(layer);
}

bool WeightRegistry::pending_serves_matmul(const ggml_tensor * w) const {
    if (!invariant_matmul_weight(w) || pending_serves(w->name)) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    return pending_matmuls_ != nullptr;
}

bool WeightRegistry::bind(const ggml_tensor * tensor, ggml_backend_buffer_t buffer) {
    if (pending_serves_matmul(tensor)) {
        std::lock_guard<std::mutex> lock(mu_);
        BoundWeight w;
        w.matmuls = pending_matmuls_;
        auto [it, inserted] = bound_.emplace(tensor, Entry{std::move(w), buffer});
        if (inserted) {
            pending_matmuls_->bound.fetch_add(1, std::memory_order_relaxed);
            n_bound_.store(bound_.size(), std::memory_order_relaxed);
        }
        return true;
    }
    int layer = -1;
    FfnWeightKind kind;
    ExpertTensorKind expert_kind = ExpertTensorKind::up;
    const bool router = parse_router_weight_name(tensor->name, &layer);
    if (router || parse_expert_weight_name(tensor->name, &layer, &expert_kind)) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!pending_experts_ || !(router ? pending_experts_->serves_router(layer) : pending_experts_->serves(layer))) {
            return false;
        }
        BoundWeight w;
        w.layer = layer;
        w.experts = pending_experts_;
        w.expert_kind = expert_kind;
        w.router = router;
        auto [it, inserted] = bound_.emplace(tensor, Entry{std::move(w), buffer});
        if (inserted) {
            pending_experts_->count_bound();
            n_bound_.store(bound_.size(), std::memory_order_relaxed);
        }
        return true;
    }
    if (!parse_ffn_weight_name(tensor->name, &layer, &kind)) {
        return false;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!pending_ || !pending_->serves_layer(layer)) {
        return false;
    }
    auto [it, inserted] = bound_.emplace(tensor, Entry{BoundWeight{pending_, layer, kind}, buffer});
    if (inserted) {
        if (pending_matmuls_ != nullptr) {
            pending_->set_invariant_matmuls(pending_matmuls_);  // its lanes' matmuls row-invariant too
        }
        pending_->count_bound();
        n_bound_.store(bound_.size(), std::memory_order_relaxed);
    }
    return true;
}

void WeightRegistry::set_bytes(const ggml_tensor * tensor, const uint8_t * bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = bound_.find(tensor);
    if (it != bound_.end() && it->second.weight.matmuls != nullptr) {
        it->second.weight.bytes = bytes;
    }
}

const BoundWeight * WeightRegistry::lookup(const ggml_tensor * tensor) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = bound_.find(tensor);
    return it == bound_.end() ? nullptr : &it->second.weight;
}

void WeightRegistry::unbind_buffer(ggml_backend_buffer_t buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = bound_.begin(); it != bound_.end();) {
        if (it->second.buffer == buffer) {
            it = bound_.erase(it);
        } else {
            ++it;
        }
    }
    n_bound_.store(bound_.size(), std::memory_order_relaxed);
}

size_t WeightRegistry::bound_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bound_.size();
}

const ggml_tensor * WeightRegistry::any_bound() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bound_.empty() ? nullptr : bound_.begin()->first;
}

}  // namespace llamaflash
