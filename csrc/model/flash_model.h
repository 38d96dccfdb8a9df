// flash_model.h — one base model as served by llamaflash: its layer layout, and the parts that
// serve it, each with one job:
//   WeightStore   (weight_store.h)   the dense weights, file mappings and the sparse lane's views
//   FlashStats    (flash_stats.h)    counters of the work done
//   OffloadState  (offload_state.h)  flash offload only: neuron cache, streamed gate, page release,
//                                    I/O errors
// plus what the split executor (split_executor.h) asks per split: is the layer served, its
// threshold, the sparse configuration.
//
// Lifetime: opened by FlashModel::open from one EngineConfig and owned by Python (llamaflash.Llama)
// through a shared_ptr; the weight registry holds another reference for every llama.cpp weight
// buffer bound to it, so the model outlives any graph that uses it.
//
// Threads: the layout is immutable after open. The thresholds and the sparse configuration may be
// replaced at run time (set_thresholds / set_sparse_config, from Python between evals); statistics
// are atomic counters.
#pragma once

#include "model/engine_config.h"
#include "model/flash_stats.h"
#include "model/weight_store.h"
#include "offload/offload_state.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace llamaflash {

struct InvariantMatmuls;  // backend/matmul_rows.h

class FlashModel {
public:
    // Validates `config` (EngineConfig::validate) and opens the model, in this order: dense weights
    // (in the offload layout when config.offload is set), the sparse lane's views when
    // config.sparse.enabled, then for offload the neuron cache and its pinned clusters (read now).
    // Throws std::invalid_argument (bad config, a sidecar that does not fit), IoError (files),
    // std::runtime_error (corrupt sidecar, allocation).
    static std::shared_ptr<FlashModel> open(EngineConfig config);
    ~FlashModel();
    FlashModel(const FlashModel &) = delete;
    FlashModel & operator=(const FlashModel &) = delete;

    const std::vector<LayerSpec> & layers() const { return layers_; }
    bool serves_layer(int layer) const { return index_.count(layer) != 0; }
    int layer_position(int layer) const;  // index in layers(), -1 if not served

    const WeightStore & weights() const { return store_; }
    // Resident dense weight for (layer, kind), or the fused gate/up matrix (WeightStore); nullptr
    // if the layer is not served.
    ggml_tensor * dense_weight(int layer, FfnWeightKind kind) const;
    ggml_tensor * fused_gate_up(int layer) const;

    // Thresholds, one per served layer in layers() order (< 0: that layer always dense).
    void set_thresholds(const std::vector<float> & thresholds);
    std::vector<float> thresholds() const;
    float threshold(int layer) const;  // -1 for a layer not served

    // Replaces the sparse configuration (validate_sparse_config). Enabling needs the sparse lane
    // loaded at open. Throws std::invalid_argument.
    void set_sparse_config(const SparseConfig & config);
    const SparseConfig & sparse_config() const { return sparse_config_; }
    bool sparse_loaded() const { return store_.sparse_loaded(); }
    FfnActivation activation() const { return activation_; }
    // The layer's sparse view when the sparse lane is enabled and the layer has a threshold; else
    // nullptr. The lane of a split: sparse iff this is non-null and T <= sparse_config().max_tokens.
    const SparseLayerView * sparse_layer(int layer) const;

    FlashStats & stats() { return stats_; }
    const FlashStats & stats() const { return stats_; }

    OffloadState * offload() const { return offload_.get(); }  // nullptr in memory
    // The error that failed the last graph compute (offload I/O), cleared; "" if none.
    std::string take_error();
    // Called before every evaluation (a few fstat calls), so that a file truncated between
    // evaluations is an error, not a SIGBUS on its mapped pages. Throws IoError when the sidecar or
    // the base file changed size since open. A file modified in place (same size, new modification
    // time): with checksums being checked, offload checks every row when it reads it anyway, and in
    // memory the mapped rows are checked again now (IntegrityError on a mismatch; if all match the
    // new time is accepted); without checks it throws IoError (its bytes cannot be vouched for).
    void check_files();
    // A served FFN that produced a NaN or an infinity (the split executor checks every output):
    // kept until taken, so Python raises it naming the layer after llama_decode reports the failure.
    void set_non_finite(const std::string & message);
    std::string take_non_finite();

    // Set while a load armed InvariantMatmuls (matmul_rows.h: deterministic answers) binds this
    // model's weights: then the lanes compute every MUL_MAT over a K-quant FFN weight with each row's
    // bits as alone, whatever the batch (dense_lane.h), counted there. nullptr: ggml-cpu's kernels.
    void set_invariant_matmuls(std::shared_ptr<InvariantMatmuls> matmuls) { invariant_matmuls_ = std::move(matmuls); }
    InvariantMatmuls * invariant_matmuls() const { return invariant_matmuls_.get(); }

    // number of llama.cpp weight tensors bound to this model (3 per served layer when loaded)
    void count_bound() { bound_.fetch_add(1, std::memory_order_relaxed); }
    int bound_count() const { return bound_.load(); }

private:
    explicit FlashModel(const EngineConfig & config);

    std::vector<LayerSpec> layers_;
    std::map<int, size_t> index_;  // layer -> position in layers_
    WeightStore store_;
    FlashStats stats_;
    std::unique_ptr<OffloadState> offload_;
    std::unique_ptr<FileReader> sidecar_watch_, base_watch_;  // opened at open, for check_files
    SparseConfig sparse_config_;
    FfnActivation activation_ = FfnActivation::silu;
    std::mutex non_finite_mutex_;
    std::string non_finite_;
    std::atomic<int> bound_{0};
    std::shared_ptr<InvariantMatmuls> invariant_matmuls_;
};

}  // namespace llamaflash
