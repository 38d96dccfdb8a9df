// flash_model.h — one base model as served by llamaflash: its sidecar layout, the FFN weights the
// dense lane computes with, and per-model statistics.
//
// Lifetime: owned by Python (llamaflash.Llama) through a shared_ptr; the weight registry holds another
// reference for every llama.cpp weight buffer bound to it, so the model outlives any graph that uses it.
//
// Dense weights (the exact lane): for each served layer L
//   gate[L] : ggml ne = [n_embd, n_ff]  (n_ff rows; row i = base gate row i)  from the sidecar bundles
//   up[L]   : ggml ne = [n_embd, n_ff]                                        from the sidecar bundles
//   down[L] : ggml ne = [n_ff, n_embd]  (n_embd rows)                          from the base GGUF
// Bundle k of the sidecar holds gate/up row order[k]; rows are put back in base order here, so the
// dense lane computes exactly   y = down · act(gate · x) ⊙ (up · x)   with the base model's bytes.
// down comes from the base file because the sidecar stores it transposed and requantized (for the
// sparse lane); reading it from the base keeps the dense lane bit-exact with stock llama.cpp.
#pragma once

#include "file_reader.h"
#include "ggml-backend.h"
#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

enum class FfnWeightKind : int { gate = 0, up = 1, down = 2 };

// One served layer, as described by the sidecar reader (llamaflash.sidecar.LayerLayout.to_dict()).
// All offsets are absolute byte offsets in their file.
struct LayerSpec {
    int      layer = -1;
    int64_t  n_embd = 0;
    int64_t  n_ff = 0;
    ggml_type gate_type = GGML_TYPE_COUNT;
    ggml_type up_type = GGML_TYPE_COUNT;
    ggml_type down_type = GGML_TYPE_COUNT;    // base down type
    ggml_type down_t_type = GGML_TYPE_COUNT;  // sidecar transposed down type
    uint64_t gate_row_bytes = 0;
    uint64_t up_row_bytes = 0;
    uint64_t bundle_offset = 0;
    uint64_t bundle_stride = 0;
    uint64_t down_t_offset = 0;
    uint64_t down_t_row_bytes = 0;
    uint64_t order_offset = 0;
    uint64_t base_down_offset = 0;
    uint64_t base_down_row_bytes = 0;
};

struct FlashStatsSnapshot {
    uint64_t graph_splits = 0;     // graph_compute calls handled
    uint64_t ffn_evals = 0;        // (layer, ubatch) FFN evaluations
    uint64_t tokens = 0;           // tokens through the first served layer
    uint64_t dense_lane_calls = 0;
    double   compute_seconds = 0;  // wall time computing splits (ggml kernels)
    double   prepare_seconds = 0;  // wall time preparing them (mirroring the split into a private graph)
};

class FlashModel {
public:
    FlashModel(std::vector<LayerSpec> layers, std::string sidecar_path, std::string base_path);
    ~FlashModel();
    FlashModel(const FlashModel &) = delete;
    FlashModel & operator=(const FlashModel &) = delete;

    // Reads every served layer's weights into ggml CPU buffers (repacked buffer types where the CPU
    // backend offers one for the weight, as stock llama.cpp does). Throws IoError / std::runtime_error.
    void load_dense_weights();
    bool dense_loaded() const { return dense_loaded_; }

    bool serves_layer(int layer) const { return index_.count(layer) != 0; }
    const std::vector<LayerSpec> & layers() const { return layers_; }
    int first_layer() const { return layers_.empty() ? -1 : layers_.front().layer; }

    // Resident dense weight for (layer, kind); nullptr if not served or not loaded.
    ggml_tensor * dense_weight(int layer, FfnWeightKind kind) const;

    // bytes of anonymous memory holding copies (repacked or gathered) of FFN weights; weights used
    // in place from a file mapping are not counted (they are page cache, as in stock llama.cpp)
    size_t resident_bytes() const;

    // For a layer whose gate and up weights are used in place from unpadded bundles of one type: the
    // bundle region as one matrix, ggml ne = [n_embd, 2·n_ff], rows gate_0, up_0, gate_1, up_1, ...
    // (row 2i = gate row i, row 2i+1 = up row i, in base order). nullptr otherwise.
    ggml_tensor * fused_gate_up(int layer) const;

    // statistics (updated by the backend; relaxed atomics: counters, not synchronisation)
    void count_split(double compute_seconds, double prepare_seconds);
    void count_ffn_eval(int layer, int64_t n_tokens);
    void count_dense_call() { dense_calls_.fetch_add(1, std::memory_order_relaxed); }
    FlashStatsSnapshot stats() const;
    void reset_stats();

    // number of llama.cpp weight tensors bound to this model (3 per served layer when loaded)
    void count_bound() { bound_.fetch_add(1, std::memory_order_relaxed); }
    int bound_count() const { return bound_.load(); }

private:
    std::vector<LayerSpec> layers_;
    std::map<int, size_t> index_;  // layer -> position in layers_
    std::string sidecar_path_;
    std::string base_path_;

    ggml_context * ctx_ = nullptr;
    std::vector<ggml_backend_buffer_t> buffers_;
    std::vector<ggml_tensor *> weights_;  // 3 per layer, in layers_ order
    std::vector<ggml_tensor *> fused_;    // 1 per layer (or nullptr), see fused_gate_up()
    std::vector<std::unique_ptr<MappedFile>> maps_;  // one per weight used in place from a file
    size_t copied_bytes_ = 0;
    bool dense_loaded_ = false;

    std::atomic<uint64_t> splits_{0}, ffn_evals_{0}, tokens_{0}, dense_calls_{0};
    std::atomic<uint64_t> compute_ns_{0}, prepare_ns_{0};
    std::atomic<int> bound_{0};
};

}  // namespace llamaflash
