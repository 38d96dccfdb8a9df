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
#include "neuron_cache.h"
#include "sparse_ffn.h"
#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
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
    uint64_t base_up_offset = 0;   // the base model's row-major ffn_up (n_ff rows of up_row_bytes)
    uint64_t base_gate_offset = 0; // the base model's row-major ffn_gate (n_ff rows of gate_row_bytes)
    // sparsity (sidecar format 2): neuron k is skipped for input x when |act(gate_k·x)| <= threshold;
    // threshold < 0 (format 1, or no threshold) = the layer always runs dense
    float threshold = -1.0f;
};

struct FlashStatsSnapshot {
    uint64_t graph_splits = 0;     // graph_compute calls handled
    uint64_t ffn_evals = 0;        // (layer, ubatch) FFN evaluations
    uint64_t tokens = 0;           // tokens through the first served layer
    uint64_t dense_lane_calls = 0;
    double   compute_seconds = 0;  // wall time computing splits (ggml kernels)
    double   prepare_seconds = 0;  // wall time preparing them (mirroring the split into a private graph)
    uint64_t sparse_lane_calls = 0;   // splits whose FFN ran on the sparse lane
    uint64_t sparse_fallbacks = 0;    // splits of sparse layers that had to run dense (pattern not plain GLU)
    double   sparse_seconds = 0;      // wall time in the sparse lane's graph computes (gate GEMV + kernel)
    uint64_t draft_splits = 0;        // draft-mode splits (FlashModel::set_draft)
    uint64_t draft_tokens = 0;        // draft tokens through the first served layer
    double   draft_seconds = 0;       // wall time in draft-mode graph computes
    std::vector<int> layer_ids;                // served layers, in the order of the vectors below
    std::vector<uint64_t> layer_sparse_tokens; // tokens computed sparsely per layer
    std::vector<uint64_t> layer_active;        // Σ over those tokens of the active neuron count
};

// How the sparse lane runs (set with FlashModel::set_sparse_config).
struct SparseConfig {
    bool enabled = false;       // false: every split runs on the dense lane
    int64_t max_tokens = 1;     // batches of more tokens run dense (prefill); measured crossover
    int cluster_size = 32;      // neurons per work unit of the kernel
    // true: g = gate·x for all neurons by ggml's dense (repacked) GEMV, then the kernel reads only the
    // selected neurons' up rows and down_t rows; false: the kernel reads the gate rows from the bundles
    bool gate_by_ggml = true;
    // true (needs gate_by_ggml): u = up·x for all neurons by ggml's dense GEMV too; the kernel then
    // reads only the selected neurons' down_t rows. Faster while many neurons are active (ggml
    // streams a whole matrix faster than the kernel's per-row dots), slower at high sparsity.
    bool up_by_ggml = false;
    // Lane choice by measured cost, per layer and batch size (bucketed: 1, 2, 3-4, 5-8, ... tokens;
    // see batch_bucket): the first `autotune_steps` eligible splits of each (layer, bucket) alternate
    // between the sparse and the dense lane, each timed; from then on that (layer, bucket) runs on the
    // faster (sparse only if it beats dense by 3%). false: every eligible split runs sparse.
    bool autotune = false;
    int autotune_steps = 8;
};

// Batch sizes the lane choice measures apart: bucket 0 = 1 token, 1 = 2, 2 = 3-4, 3 = 5-8, ...,
// kBatchBuckets - 1 = the rest. batch_bucket_name: "1", "2", "3-4", ..., "65+".
constexpr int kBatchBuckets = 8;
int batch_bucket(int64_t n_tokens);
std::string batch_bucket_name(int bucket);

// Per-(layer, batch bucket) state of the lane choice (see SparseConfig::autotune).
struct LaneTuning {
    bool warmed[2] = {false, false};
    int n[2] = {0, 0};          // timed splits: [0] dense, [1] sparse
    double seconds[2] = {0, 0};
    int decided = -1;           // -1 measuring, 0 dense, 1 sparse
};

// One layer as the sparse lane sees it: views into the sidecar mapping.
struct SparseLayerView {
    SparseFfnLayer kernel;           // bundles + down_t, bundle order
    bool base_order = true;          // bundle k holds base neuron k (gate values from ggml usable)
};

class FlashModel {
public:
    FlashModel(std::vector<LayerSpec> layers, std::string sidecar_path, std::string base_path);
    ~FlashModel();
    FlashModel(const FlashModel &) = delete;
    FlashModel & operator=(const FlashModel &) = delete;

    // Flash offload (flash_model_offload.cpp). set_offload_layout(true) before
    // load_dense_weights() places the dense weights for a RAM budget: gate as resident anonymous
    // memory (repacked when the CPU backend repacks it, else a plain copy: gate-first selection needs
    // every gate row every token), up and down as views into the base file (page cache, only touched
    // by prefill, released after each dense split by release_streamed()). enable_offload() then opens
    // the neuron cache (neuron_cache.h) that serves the sparse lane's up and down_t rows; it needs a
    // sidecar in base neuron order. Throws std::invalid_argument / IoError.
    // stream_gate (needs offload): the gate too is a view into the base file instead of resident
    // memory (plain, not repacked: ggml's vec_dot GEMV reads it in place). Decode then reads every
    // gate row from flash each token; stream_gate_ahead() starts the kernel's read-ahead of a layer's
    // gate (MADV_WILLNEED: asynchronous), release_gate() drops its pages after its split, so about
    // two layers' gates are in the page cache at a time instead of all of them.
    void set_offload_layout(bool offload, bool stream_gate = false);
    bool offload_layout() const { return offload_layout_; }
    bool stream_gate() const { return stream_gate_; }
    void stream_gate_ahead(int layer);  // no-op unless the gate is streamed (or the layer is not served)
    void release_gate(int layer);       // likewise
    int next_layer(int layer) const;    // the served layer after `layer`, cyclic (the first after the last)
    void enable_offload(std::vector<CacheLayerSource> sources, const NeuronCacheConfig & config);
    NeuronCache * neuron_cache() const { return cache_.get(); }
    void load_hot();                       // the cache's pinned clusters (blocking reads)
    int layer_position(int layer) const;   // index in layers(), -1 if not served
    // After a dense split of `layer` in offload layout: drop its up/down pages (MADV_DONTNEED on the
    // mappings, POSIX_FADV_DONTNEED on the file range) so prefill streams instead of accumulating.
    void release_streamed(int layer);
    // A failure inside a graph compute (an I/O error in the sparse lane): kept until taken, so the
    // Python layer can raise it after llama_decode reports the failed compute.
    void set_error(const std::string & message);
    std::string take_error();
    // Draft mode (offload only): while set, the sparse lane computes each decode split from the
    // clusters resident in the neuron cache only (NeuronCache::plan_resident): no flash read, no
    // wait, the cache untouched; the skipped clusters' terms are dropped, so the outputs are an
    // approximation of the model, for drafting tokens that exact passes then verify. Set by the
    // caller around its draft evaluations (one evaluation at a time per model).
    void set_draft(bool draft) { draft_.store(draft, std::memory_order_release); }
    bool draft() const { return draft_.load(std::memory_order_acquire); }

    // Reads every served layer's weights into ggml CPU buffers (repacked buffer types where the CPU
    // backend offers one for the weight, as stock llama.cpp does). Throws IoError / std::runtime_error.
    void load_dense_weights();
    // Before load_dense_weights: false = every weight in plain CPU memory, never in a repacked layout,
    // as llama.cpp with use_extra_bufts = false. ggml-cpu's repacked kernels compute a batch of 4+
    // rows with another summation order than one row; plain ones give each row the same bits
    // whatever the batch (what a speculative verify batch needs to equal one-token decoding).
    void set_repack(bool repack) { repack_ = repack; }
    bool repack() const { return repack_; }
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

    // The sparse lane (sparse_ffn.h) over the sidecar: maps every served layer's bundle and down_t
    // regions (shared read-only file mappings, page cache) and arms the per-layer thresholds. Needs
    // the dense weights (prefill and gate GEMV). activation: "silu" | "gelu" | "relu". Throws
    // std::invalid_argument / IoError.
    void load_sparse(const std::string & activation);
    bool sparse_loaded() const { return !sparse_.empty(); }
    void set_sparse_config(const SparseConfig & config);
    const SparseConfig & sparse_config() const { return sparse_config_; }
    // Replaces the thresholds (one per served layer, in layers() order; < 0 = that layer dense).
    void set_thresholds(const std::vector<float> & thresholds);
    std::vector<float> thresholds() const;
    // The layer's threshold (< 0: no sparsity; -1 for a layer not served).
    float threshold(int layer) const;
    // The layer's sparse view when the sparse lane is enabled and the layer has a threshold; else nullptr.
    const SparseLayerView * sparse_layer(int layer) const;
    FfnActivation activation() const { return activation_; }

    // Lane choice for an eligible split of `layer` over n_tokens tokens (true = sparse), and its
    // timing. Called by the backend thread that computes the split (splits run one at a time per
    // context); the state is per model, so contexts sharing a model share the measurement.
    bool choose_sparse(int layer, int64_t n_tokens);
    void record_lane_time(int layer, int64_t n_tokens, bool sparse, double seconds);
    // [served layer (layers() order) · kBatchBuckets + bucket]: -1 still measuring, 0 dense, 1 sparse;
    // mean seconds per split
    std::vector<LaneTuning> lane_tuning() const;

    // statistics (updated by the backend; relaxed atomics: counters, not synchronisation)
    void count_split(double compute_seconds, double prepare_seconds);
    void count_ffn_eval(int layer, int64_t n_tokens);
    void count_dense_call() { dense_calls_.fetch_add(1, std::memory_order_relaxed); }
    void count_sparse_call(int layer, const int32_t * active_counts, int64_t n_tokens, double seconds);
    void count_sparse_fallback() { sparse_fallbacks_.fetch_add(1, std::memory_order_relaxed); }
    // a draft-mode split (see set_draft): counted apart from the exact passes' statistics
    void count_draft_split(int layer, int64_t n_tokens, double seconds);
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
    std::vector<std::unique_ptr<MappedFile>> maps_;  // one per mapped region (see map_region)
    std::map<std::pair<int, uint64_t>, MappedFile *> regions_;  // (0 sidecar / 1 base, offset) -> map
    const uint8_t * map_region(int file, uint64_t offset, uint64_t length);
    std::vector<SparseLayerView> sparse_;  // 1 per layer once load_sparse ran
    SparseConfig sparse_config_;
    std::vector<LaneTuning> tuning_;  // kBatchBuckets per layer (see choose_sparse)
    mutable std::mutex tuning_mutex_;
    FfnActivation activation_ = FfnActivation::silu;
    std::unique_ptr<std::atomic<uint64_t>[]> layer_sparse_tokens_, layer_active_;
    std::atomic<uint64_t> sparse_calls_{0}, sparse_fallbacks_{0}, sparse_ns_{0};
    std::atomic<uint64_t> draft_splits_{0}, draft_tokens_{0}, draft_ns_{0};
    size_t copied_bytes_ = 0;
    bool dense_loaded_ = false;
    bool repack_ = true;
    bool offload_layout_ = false;
    std::unique_ptr<NeuronCache> cache_;
    struct StreamedRegion {
        MappedFile * map;
        uint64_t offset, length;  // in the base file
    };
    std::map<int, std::vector<StreamedRegion>> streamed_;  // layer -> its up/down views (offload layout)
    std::map<int, StreamedRegion> gate_streamed_;          // layer -> its gate view (stream_gate)
    bool stream_gate_ = false;
    std::unique_ptr<FileReader> base_file_;                // for dropping streamed pages
    std::atomic<bool> draft_{false};
    std::mutex error_mutex_;
    std::string error_;

    std::atomic<uint64_t> splits_{0}, ffn_evals_{0}, tokens_{0}, dense_calls_{0};
    std::atomic<uint64_t> compute_ns_{0}, prepare_ns_{0};
    std::atomic<int> bound_{0};
};

}  // namespace llamaflash
