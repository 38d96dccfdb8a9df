// weight_store.h — the bytes a served model computes with: file mappings of the sidecar and the
// base GGUF, repacked or gathered copies, the dense weights as ggml tensors, and the sparse lane's
// per-layer views. Layers are addressed by position (index in the layout given at construction).
//
// Dense weights (the exact lane): for each served layer at position p
//   gate[p] : ggml ne = [n_embd, n_ff]  (n_ff rows; row i = base gate row i)  from the sidecar bundles
//   up[p]   : ggml ne = [n_embd, n_ff]                                        from the sidecar bundles
//   down[p] : ggml ne = [n_ff, n_embd]  (n_embd rows)                          from the base GGUF
// Bundle k of the sidecar holds gate/up row order[k]; rows are put back in base order here, so the
// dense lane computes exactly   y = down · act(gate · x) ⊙ (up · x)   with the base model's bytes.
// down comes from the base file because the sidecar stores it transposed and requantized (for the
// sparse lane); reading it from the base keeps the dense lane bit-exact with stock llama.cpp.
//
// Placement (load_dense), mirroring what stock llama.cpp does with the base GGUF:
//   in memory : a weight the CPU backend repacks (e.g. Q4_K 8x8) → an anonymous repacked copy; else a
//               view into a read-only shared mapping (page cache): down into the base file, gate/up
//               into the sidecar bundles (row stride = bundle stride) when the bundles are in base
//               order; else (hot-first bundle order) a plain copy gathered back into base order.
//   offload   : gate resident (repacked or plain copy), or with stream_gate a view of the base file's
//               gate; up and down views of the base file (page cache, touched only by prefill).
// Every mapping covers just the byte range it serves, mapped once (a whole-file mapping would let
// fault-around map neighbouring tensors' pages too).
//
// Integrity (integrity.h), with verify on and checksums in the sidecar: every row set a load reads is
// checked once, before anything computes with it: in memory the mapped rows read from the file (the
// same page cache the mapping shows) or the copy's read buffer (bundles, down_t, base up and down,
// as used); offload: the gate copy's bundle reads, and the
// base file's up, down (and streamed gate) prefill views read in chunks and dropped from the page
// cache again (not with whole layers: the layer stream checks what it reads). The neuron cache and the
// layer stream check their own reads with checksums() of the store.
//
// Lifetime: owned by FlashModel; the tensors and mappings live as long as the store.
#pragma once

#include "ggml-backend.h"
#include "io/file_reader.h"
#include "io/integrity.h"
#include "lanes/sparse_ffn.h"
#include "model/engine_config.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace llamaflash {

// One layer as the sparse lane sees it: views into the sidecar mapping.
struct SparseLayerView {
    SparseFfnLayer kernel;   // bundles + down_t, bundle order
    bool base_order = true;  // bundle k holds base neuron k (gate values from ggml usable)
};

class WeightStore {
public:
    WeightStore(std::vector<LayerSpec> layers, std::string sidecar_path, std::string base_path, bool verify = true);
    ~WeightStore();
    WeightStore(const WeightStore &) = delete;
    WeightStore & operator=(const WeightStore &) = delete;

    // Reads or maps every layer's dense weights (see Placement). Throws IoError (truncated file,
    // unreadable), std::runtime_error (order not a permutation, allocation failed).
    // repack false: plain CPU copies only (EngineConfig::repack). views_used false (offload with whole
    // layers, OffloadConfig::stream_layers): nothing computes from the base file's views, whose rows
    // come through the layer stream and are checked there on every read, so they are not checked here.
    void load_dense(bool offload, bool stream_gate, bool repack = true, bool views_used = true);
    // Maps every layer's bundle and down_t regions for the kernel (in memory), or leaves the kernel's
    // rows to the neuron cache (offload: placeholders until the lane points them at slots). Needs
    // load_dense. Throws std::invalid_argument (down_t row size) / IoError.
    void load_sparse(FfnActivation activation, bool offload);

    bool dense_loaded() const { return !weights_.empty(); }
    bool sparse_loaded() const { return !sparse_.empty(); }

    // Resident dense weight of the layer at `pos`; nullptr before load_dense.
    ggml_tensor * dense_weight(size_t pos, FfnWeightKind kind) const;
    // For a layer whose gate and up weights are used in place from unpadded bundles of one type: the
    // bundle region as one matrix, ggml ne = [n_embd, 2·n_ff], rows gate_0, up_0, gate_1, up_1, ...
    // (row 2i = gate row i, row 2i+1 = up row i, in base order). nullptr otherwise.
    ggml_tensor * fused_gate_up(size_t pos) const;
    const SparseLayerView & sparse_view(size_t pos) const { return sparse_.at(pos); }

    // The mapping of the base file that starts at `offset` (a dense view's region), or nullptr.
    const MappedFile * base_region(uint64_t offset) const;

    // bytes of anonymous memory holding copies (repacked or gathered) of FFN weights; weights used
    // in place from a file mapping are not counted (they are page cache, as in stock llama.cpp)
    size_t resident_bytes() const { return copied_bytes_; }

    // The sidecar's row checksums of the layer at `pos` (empty when it has none or verify is off);
    // valid after load_dense.
    const LayerChecksums & checksums(size_t pos) const { return checksums_.at(pos); }
    bool has_checksums() const { return has_checksums_; }  // the sidecar carries them
    bool verifying() const { return verify_ && has_checksums_; }
    uint64_t verified_bytes() const { return verified_bytes_; }  // checked at load (and by recheck_mapped)
    // Checks again every row set used in place from a file mapping (the files changed on disk: a
    // shared mapping shows the new bytes). Throws IntegrityError. No-op unless verifying().
    void recheck_mapped();
    double verify_seconds() const { return verify_seconds_; }  // time spent checking at load

private:
    enum File : int { kSidecar = 0, kBase = 1 };
    const uint8_t * map_region(File file, uint64_t offset, uint64_t length);
    // check row set `set` of the layer at `li` once: over `data` (row r at data + r·stride), or read
    // from `file`; no-op without checksums or when checked already
    void check_rows(size_t li, RowSet set, const uint8_t * data, size_t stride);
    void check_file_rows(size_t li, RowSet set, const FileReader & file);
    // a row set used in place from a mapping: deferred to run_checks, which checks them all in parallel
    void check_mapped(size_t li, RowSet set);
    void run_checks();  // throws IntegrityError (the first mismatch found) or IoError
    struct PendingCheck {
        size_t li;
        RowSet set;
    };
    std::vector<PendingCheck> pending_;
    bool needs_check(size_t li, RowSet set) const;
    std::vector<std::vector<int32_t>> read_orders(const FileReader & sidecar, std::vector<bool> & identity) const;

    std::vector<LayerSpec> layers_;
    std::string sidecar_path_;
    std::string base_path_;

    ggml_context * ctx_ = nullptr;
    std::vector<ggml_backend_buffer_t> buffers_;
    std::vector<ggml_tensor *> weights_;                        // 3 per layer, in layers_ order
    std::vector<ggml_tensor *> fused_;                          // 1 per layer (or nullptr), see fused_gate_up()
    std::vector<std::unique_ptr<MappedFile>> maps_;             // one per mapped region
    std::map<std::pair<int, uint64_t>, MappedFile *> regions_;  // (File, offset) -> its mapping
    std::vector<SparseLayerView> sparse_;                       // 1 per layer once load_sparse ran
    size_t copied_bytes_ = 0;
    bool verify_ = true;
    bool has_checksums_ = false;
    std::vector<LayerChecksums> checksums_;     // 1 per layer once load_dense ran
    std::set<std::pair<size_t, int>> checked_;  // (layer position, RowSet) checked
    uint64_t verified_bytes_ = 0;
    double verify_seconds_ = 0;
};

}  // namespace llamaflash
