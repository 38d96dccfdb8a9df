// offload_state.h — what a model served under a RAM budget (flash offload) adds to the in-memory
// engine: the neuron cache (neuron_cache.h) that serves the sparse lane's up and down_t rows, the
// streamed gate and its read-ahead, the release of prefill pages, and the I/O error that failed a
// compute. Layers are addressed by position (index in FlashModel::layers()).
//
// Pages. The weight store (weight_store.h) maps, per served layer, the base file's up and down
// (and, with stream_gate, gate) as read-only views; they are page cache, touched by dense (prefill)
// splits and, for a streamed gate, by every decode split's gate GEMV. The split executor calls the
// hooks around each split of a served layer at position p:
//   before_split(p, sparse, prompt_batch)
//                             prompt_batch (a dense split over more tokens than the sparse lane
//                             takes): first empty the neuron cache's cold region and free its pages
//                             (NeuronCache::release_cold): a prompt computes no cluster, and the
//                             planner lets its batch buffers use that memory (plan_budget.py).
//                             sparse: start reading the next served layer's gate (MADV_WILLNEED,
//                             asynchronous), so it arrives while p computes. With checksums
//                             (integrity.h), first check the rows of p's views that the split reads
//                             (sparse: a streamed gate; dense: up, down and a streamed gate): their
//                             pages were dropped after the last use and come back from the file.
//                             Returns false after set_error on a mismatch: the split must not run.
//   after_split(p, sparse, failure)
//                             sparse: drop p's streamed gate pages; dense: drop p's up/down (and gate)
//                             pages (MADV_DONTNEED on the mapping, POSIX_FADV_DONTNEED on the file
//                             range), so prefill streams instead of accumulating. A non-empty
//                             `failure` (an I/O error of the sparse lane) is kept for take_error()
//                             and the split reports failure (returns false).
// So at most about two layers' gates (the computing one and the next) are resident at a time.
//
// Whole layers (OffloadConfig::stream_layers): instead of the neuron cache, a layer stream
// (layer_stream.h) over the base file's up and down (and gate, when streamed) of every served layer,
// each row checked against the sidecar's base-row checksums when the store verifies. The split
// executor plans and waits for a layer itself and computes its split on the dense lane over the
// slot; before_split / after_split are not called for those splits.
//
// Draft copy (OffloadConfig::draft_copy): every layer's draft up and down_t rows (n_ff rows each of
// one compact type, sidecar tensors blk.L.ffn_draft_up / ffn_draft_down_t, bundle order) read at
// construction into one resident buffer of draft_copy_bytes(), every row checked against the
// sidecar's draft checksums when the store verifies (IntegrityError otherwise). In draft mode the
// sparse lane then computes the needed clusters that are not resident from it.
//
// Errors: set_error keeps the first message until take_error (Python raises it as FlashIoError
// after llama_decode reports the failed compute). Thread-safe; the hooks are called by the backend
// thread computing the split (one split at a time per context).
#pragma once

#include "io/file_reader.h"
#include "io/integrity.h"
#include "model/engine_config.h"
#include "offload/layer_stream.h"
#include "offload/neuron_cache.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace llamaflash {

class WeightStore;

// Alignment of each tensor of the resident draft copy (one page).
constexpr uint64_t kDraftCopyAlign = 4096;

// Bytes the engine allocates for one tensor (up or down_t) of one layer's draft copy: n_ff rows of
// draft_row_bytes, rounded up to kDraftCopyAlign. A layer's copy is two of them; the planner counts
// the copy with it (llamaflash._native.draft_copy_tensor_bytes).
uint64_t draft_copy_tensor_bytes(int64_t n_ff, uint64_t draft_row_bytes);

class OffloadState {
public:
    // Opens the neuron cache over the layers' base up rows and sidecar down_t rows with the
    // config's sizing (cluster size = config.sparse.cluster_size) and collects the store's base-file
    // views to release. Needs the store's dense weights and sparse views loaded in the offload
    // layout and a sidecar in base neuron order. With stream_layers, opens the layer stream instead
    // (dense weights only). Throws std::invalid_argument / IoError.
    OffloadState(const EngineConfig & config, const WeightStore & store);
    ~OffloadState();
    OffloadState(const OffloadState &) = delete;
    OffloadState & operator=(const OffloadState &) = delete;

    void load_hot();  // reads the pinned clusters or layers (blocking); throws IoError / IntegrityError
    NeuronCache * cache() const { return cache_.get(); }          // nullptr with stream_layers
    LayerStream * layer_stream() const { return stream_.get(); }  // nullptr without
    void verify_files() const;                                    // IoError when a file read from flash changed on disk

    bool stream_gate() const { return stream_gate_; }
    // Gate bytes a decode token reads from flash: Σ over served layers of n_ff · gate_row_bytes
    // when the gate is streamed, else 0.
    uint64_t streamed_gate_bytes() const { return streamed_gate_bytes_; }

    bool before_split(int pos, bool sparse, bool prompt_batch = false);
    bool after_split(int pos, bool sparse, const std::string & failure);

    void set_error(const std::string & message);
    std::string take_error();

    // Draft mode: while set, the sparse lane computes each decode split from the clusters resident
    // in the cache only (NeuronCache::plan_resident): no flash read, no wait, the cache untouched;
    // the skipped clusters' terms are dropped, so the outputs approximate the model, for drafting
    // tokens that exact passes then verify. Set by the caller around its draft evaluations (one
    // evaluation at a time per model).
    void set_draft(bool draft) { draft_.store(draft, std::memory_order_release); }
    bool draft() const { return draft_.load(std::memory_order_acquire); }

    // The draft copy of the layer at `pos`: row k of up at up + k·row_bytes, of down_t at
    // down_t + k·row_bytes, both of `type`. nullptr without a draft copy.
    struct DraftRows {
        const uint8_t * up = nullptr;
        const uint8_t * down_t = nullptr;
        ggml_type type = GGML_TYPE_COUNT;
        size_t row_bytes = 0;
    };
    const DraftRows * draft_rows(int pos) const {
        return draft_rows_.empty() ? nullptr : &draft_rows_.at(static_cast<size_t>(pos));
    }
    size_t draft_copy_bytes() const { return draft_copy_.size(); }

private:
    struct Region {
        const MappedFile * map;
        uint64_t offset, length;                           // in the base file
        const std::vector<uint32_t> * expected = nullptr;  // row checksums (nullptr: not checked)
        RowSource source;
    };
    bool check(const Region & r);  // false after set_error on a mismatch
    void release(const Region & r) const;
    // reads every layer's draft copy; with `verify`, checks each row against the sidecar's draft checksums
    void load_draft_copy(const EngineConfig & config, bool verify);

    std::unique_ptr<NeuronCache> cache_;
    std::unique_ptr<LayerStream> stream_;
    std::vector<int> next_;                      // [pos] -> position of the next served layer id, cyclic
    std::vector<std::vector<Region>> streamed_;  // [pos] -> its up/down (and gate) views
    std::vector<std::vector<Region>> gate_;      // [pos] -> its gate view when streamed (0 or 1)
    bool stream_gate_ = false;
    uint64_t streamed_gate_bytes_ = 0;
    std::unique_ptr<FileReader> base_file_;  // for dropping streamed pages
    std::mutex error_mutex_;
    std::string error_;
    std::atomic<bool> draft_{false};
    AlignedBuffer draft_copy_;
    std::vector<DraftRows> draft_rows_;  // [pos], empty without a draft copy
};

}  // namespace llamaflash
