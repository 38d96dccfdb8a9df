// engine_config.h — everything the native core needs to open one served model, in one value:
// the sidecar's layer layout, the lane settings and, for flash offload, the neuron cache's sizing.
//
// Python builds it once (llamaflash.engine_config) from one parse of the sidecar and the base
// header; EngineConfig::validate() checks it once, before anything is read, and FlashModel::open
// (flash_model.h) consumes it. Two variants:
//   in memory : offload empty. Dense weights from the sidecar bundles / base file (weight_store.h);
//               with sparse.enabled also the sparse lane's mappings of bundles and down_t.
//   offload   : offload set (needs sparse.enabled). Gate resident or streamed, up and down_t rows
//               through the neuron cache (neuron_cache.h), prefill streaming from the base file; or,
//               with offload.stream_layers (sparse off), whole layers through a layer stream.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace llamaflash {

enum class FfnWeightKind : int { gate = 0, up = 1, down = 2 };

// One served layer, as described by the sidecar reader (llamaflash.files.sidecar.LayerLayout). All
// offsets are absolute byte offsets in their file.
struct LayerSpec {
    int layer = -1;
    int64_t n_embd = 0;
    int64_t n_ff = 0;
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
    uint64_t base_up_offset = 0;    // the base model's row-major ffn_up (n_ff rows of up_row_bytes)
    uint64_t base_gate_offset = 0;  // the base model's row-major ffn_gate (n_ff rows of gate_row_bytes)
    // sparsity: neuron k is skipped for input x when |act(gate_k·x)| <= threshold; threshold < 0
    // (no threshold) = the layer always runs dense
    float threshold = -1.0f;
    // the draft copy (optional): n_ff rows of draft_row_bytes bytes of type draft_type at
    // draft_up_offset (row k = up row order[k]) and at draft_down_t_offset (row k = down column
    // order[k]) in the sidecar; draft_type GGML_TYPE_COUNT = the layer has none
    ggml_type draft_type = GGML_TYPE_COUNT;
    uint64_t draft_row_bytes = 0;
    uint64_t draft_up_offset = 0;
    uint64_t draft_down_t_offset = 0;
    uint64_t draft_checksum_offset = 0;            // uint32 [n_ff][2]: draft up, draft down_t rows (0: no checksums)
    std::string draft_up_name, draft_down_t_name;  // tensor names for messages
    // integrity (integrity.h): absolute sidecar offsets of the layer's row-checksum tables, both 0 when
    // the sidecar has none; and the tensor names the checks' messages use
    uint64_t checksum_offset = 0;            // uint32 [n_ff][4]: bundle, down_t, base gate, base up rows
    uint64_t base_down_checksum_offset = 0;  // uint32 [n_embd]: base down rows
    std::string bundle_name, down_t_name, base_gate_name, base_up_name, base_down_name;
};

// How the sparse lane runs. The lane of a split is fixed by this and the layer's threshold: a
// split of a layer with threshold >= 0 over T <= max_tokens tokens runs sparse when enabled.
struct SparseConfig {
    bool enabled = false;    // false: every split runs on the dense lane (and, at open, no sparse lane is loaded)
    int64_t max_tokens = 1;  // batches of more tokens run dense (prefill); >= 1
    int cluster_size = 32;   // neurons per work unit of the kernel (and per neuron-cache slot); 1..256
    // g = gate·x comes from ggml's dense (repacked) GEMV whenever the bundles are in base order (the
    // kernel then reads only the selected neurons' up and down_t rows), else from the kernel.
    // true (in memory, bundles in base order): u = up·x for all neurons by ggml's dense GEMV too; the
    // kernel then reads only the selected neurons' down_t rows. Faster while many neurons are active
    // (ggml streams a whole matrix faster than the kernel's per-row dots), slower at high sparsity.
    bool up_by_ggml = false;
};

// Flash offload: the neuron cache's sizing (the planner's OffloadPlan) and how to read flash.
// Per-layer vectors are in EngineConfig::layers order; the cache's cluster size is
// SparseConfig::cluster_size.
struct OffloadConfig {
    // gate matrices read from the base file every token (one layer ahead) instead of resident
    bool stream_gate = false;
    int64_t cold_slots = 0;                        // LRU slots, >= (1 + prefetch_layers) · max clusters per layer
    int prefetch_layers = 1;                       // read-ahead depth in served layers (0: demand reads only)
    float prefetch_min_prob = 0.5f;                // read ahead clusters at least this likely to be needed
    unsigned queue_depth = 32;                     // reads in flight per file
    bool direct = true;                            // O_DIRECT where the filesystem allows it
    std::string engine = "auto";                   // "auto" | "io_uring" | "pool"
    std::vector<std::vector<int32_t>> hot;         // per layer: clusters to pin
    std::vector<std::vector<float>> cluster_prob;  // per layer: P(cluster needed), one per cluster
    // keep every layer's draft copy resident (read at open) and compute draft-mode splits from it
    // (offload_state.h); needs a draft copy in every layer
    bool draft_copy = false;
    // Whole layers instead of neuron clusters (layer_stream.h): every FFN split of a served layer runs
    // on the dense lane over the layer's base up, down (and gate, when streamed) read whole from flash
    // into a layer slot, so every row is computed as stock computes it (deterministic answers). Then
    // cold_slots counts layer slots (>= 1 + prefetch_layers), hot_layers lists the positions pinned,
    // the sparse lane is off (sparse.enabled false) and no neuron cache is opened (hot, cluster_prob
    // and prefetch_min_prob unused).
    bool stream_layers = false;
    std::vector<int32_t> hot_layers;
};

struct EngineConfig {
    std::vector<LayerSpec> layers;  // served layers, strictly one entry per layer id
    std::string sidecar_path;
    std::string base_path;
    std::string activation = "silu";  // the sidecar's FFN activation: "silu" | "gelu" | "relu"
    SparseConfig sparse;
    std::optional<OffloadConfig> offload;
    // false: every FFN weight llamaflash holds in plain CPU memory, never in a repacked layout (as
    // llama.cpp with use_extra_bufts = false). ggml-cpu's repacked kernels compute a batch of 4+
    // rows with another summation order than one row; plain ones give each row the same bits
    // whatever the batch (what a speculative verify batch needs to equal one-token decoding).
    bool repack = true;
    // true: check every row read against the sidecar's checksums before it is computed with (loads
    // in memory check what they map or copy once; offload checks each flash read). false: no check
    // (for measuring its cost). Without checksums in the sidecar there is nothing to check.
    bool verify = true;

    // Throws std::invalid_argument naming the field and what it accepts: empty paths or layers, a
    // layer listed twice, an empty shape, an unknown ggml type, row sizes that do not match the
    // types, a bundle stride below gate + up row, an unknown activation, a sparse config out of
    // range, offload without the sparse lane, per-layer offload vectors of the wrong count, a bad
    // engine name. Checks that need the files (ranges, neuron order) happen when FlashModel::open
    // reads them.
    void validate() const;
};

// std::invalid_argument unless `c` is in range (see SparseConfig); shared by validate() and the
// run-time FlashModel::set_sparse_config.
void validate_sparse_config(const SparseConfig & c);

// std::invalid_argument unless a `type` row of `n` values is `row_bytes` bytes (the sidecar's
// row size agrees with its ggml type).
void check_row_bytes(const LayerSpec & s, ggml_type type, int64_t n, uint64_t row_bytes, const char * what);

}  // namespace llamaflash
