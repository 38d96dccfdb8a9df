// weight_registry.h — which llama.cpp weight tensors are "phantom" FFN weights served by llamaflash.
//
// While a model is being loaded, the host sets a *pending* FlashModel (PlanEngine::begin_model_load). Two questions
// are then answered by tensor NAME (llama.cpp asks supports_op with a metadata tensor before any
// buffer exists): "does the pending model serve blk.N.ffn_{gate,up,down}.weight?". When llama.cpp
// hands such a weight to our buffer (set_tensor), the tensor POINTER is bound to the model; every
// later question (graph scheduling and compute) is answered by pointer, so several models can be
// loaded in one process. Bindings of a buffer are dropped when llama.cpp frees that buffer.
//
// Thread safety: all members lock one mutex; lookups are a hash-map probe.
#pragma once

#include "backend/matmul_rows.h"
#include "experts/expert_model.h"
#include "model/flash_model.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace llamaflash {

// Parses "blk.<N>.ffn_gate.weight" / "ffn_up" / "ffn_down". Returns false for any other name.
bool parse_ffn_weight_name(const char * name, int * layer, FfnWeightKind * kind);
// Parses "blk.<N>.ffn_{gate,up,down,gate_up}_exps.weight" (an MoE layer's routed expert tensors).
bool parse_expert_weight_name(const char * name, int * layer, ExpertTensorKind * kind);
// Parses "blk.<N>.ffn_gate_inp.weight" (an MoE layer's router).
bool parse_router_weight_name(const char * name, int * layer);

// A llama.cpp weight served by llamaflash: an FFN weight of a FlashModel (`model`), or a routed
// expert tensor of an ExpertModel (`experts`, `expert_kind`), or an ExpertModel's router (`experts`,
// `router`: ExpertConfig::router_rows), or a weight whose MUL_MATs llamaflash computes row by row
// with its bytes kept in the buffer (`matmuls`, matmul_rows.h). Exactly one of `model`, `experts`
// and `matmuls` is set.
struct BoundWeight {
    std::shared_ptr<FlashModel> model;
    int layer = -1;
    FfnWeightKind kind = FfnWeightKind::gate;
    std::shared_ptr<ExpertModel> experts;
    ExpertTensorKind expert_kind = ExpertTensorKind::up;
    bool router = false;
    std::shared_ptr<InvariantMatmuls> matmuls;
    // An InvariantMatmuls weight read in place: its bytes in the model file's mapping
    // (InvariantMatmuls::file_bytes); nullptr: in the buffer, at the tensor's data.
    const uint8_t * bytes = nullptr;
    // Where the bytes of `tensor` (this weight) are.
    const uint8_t * bytes_of(const ggml_tensor * tensor) const {
        return bytes != nullptr ? bytes : static_cast<const uint8_t *>(tensor->data);
    }
};

class WeightRegistry {
public:
    static WeightRegistry & instance();

    void set_pending(std::shared_ptr<FlashModel> model);
    // An MoE model whose expert tensors the next load places on the device (instead of a FlashModel).
    void set_pending_experts(std::shared_ptr<ExpertModel> model);
    // A model whose K-quant matmul weights (invariant_matmul_weight) the next load places on the
    // device, beside a pending FlashModel or ExpertModel or alone; a name a pending FlashModel or
    // ExpertModel serves stays theirs.
    void set_pending_matmuls(std::shared_ptr<InvariantMatmuls> model);
    void clear_pending();
    std::shared_ptr<FlashModel> pending() const;

    // Name-based: would the pending model serve this weight?
    bool pending_serves(const char * name) const;
    // Would the pending InvariantMatmuls take this weight (name, type and shape; not bound yet)?
    bool pending_serves_matmul(const ggml_tensor * w) const;

    // Binds `tensor` (a weight llama.cpp placed in our buffer) to the pending model. Returns false if
    // no pending model serves its name.
    bool bind(const ggml_tensor * tensor, ggml_backend_buffer_t buffer);

    // An InvariantMatmuls weight's bytes are read in place at `bytes` (BoundWeight::bytes).
    void set_bytes(const ggml_tensor * tensor, const uint8_t * bytes);
    // nullptr if `tensor` is not a bound phantom weight. The pointer stays valid until unbind_buffer().
    const BoundWeight * lookup(const ggml_tensor * tensor) const;

    void unbind_buffer(ggml_backend_buffer_t buffer);

    size_t bound_count() const;

    // Lock-free: is any weight bound (some served model loaded)? Asked for every node of every graph.
    bool any_model_bound() const { return n_bound_.load(std::memory_order_relaxed) != 0; }

    // Some bound weight, or nullptr (diagnostics and tests).
    const ggml_tensor * any_bound() const;

private:
    mutable std::mutex mu_;
    std::shared_ptr<FlashModel> pending_;
    std::shared_ptr<ExpertModel> pending_experts_;
    std::shared_ptr<InvariantMatmuls> pending_matmuls_;
    struct Entry {
        BoundWeight weight;
        ggml_backend_buffer_t buffer;
    };
    std::unordered_map<const ggml_tensor *, Entry> bound_;
    std::atomic<size_t> n_bound_{0};
};

}  // namespace llamaflash
