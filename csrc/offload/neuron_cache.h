// neuron_cache.h — the flash-offload neuron cache: the up and down_t rows of the served
// layers live on flash and come into fixed-size RAM slots by direct I/O, one neuron *cluster* per slot.
//
// Units. A cluster is C consecutive neurons of one layer (cluster c = neurons [c·C, min((c+1)·C, n_ff))),
// in the sidecar's bundle order. A slot holds one cluster's
//     up rows     : C rows of up_row_bytes, row-major, read from the up source (the base model's ffn_up)
//     down_t rows : C rows of down_t_row_bytes, read from the sidecar's down_t tensor
//     slot_bytes = round_up(C·max up_row_bytes, 4096) + round_up(C·max down_t_row_bytes, 4096)
// so within a slot neuron i's up row is at up_ptr(cluster) + (i − c·C)·up_row_bytes, likewise down_t.
// A cluster is therefore two contiguous file ranges: one read each (direct I/O, see flash_io.h).
//
// Regions (PowerInfer-2's segmented cache, sized by the planner, plugin/planning/planner.py):
//   hot  : clusters pinned for the model's lifetime (the most frequently needed, chosen by the planner
//          from the sidecar's neuron frequencies), read once by load_hot();
//   cold : slots filled on demand and by read-ahead, replaced least-recently-used. A slot that the
//          layer being computed uses, or that a read is filling, is never replaced.
// Memory: (hot + cold) · slot_bytes of aligned anonymous memory, allocated once by the constructor.
//
// Per token and served layer (the sparse lane's nodes, sparse_lane.h, call these in this order):
//   plan(L, needed)  one thread: for every cluster with needed[c] != 0: resident → `ready`; being read
//                    (by an earlier read-ahead) → `pending`; else a cold slot is taken (LRU) and its
//                    two reads are submitted → `pending`. Then read-ahead: for each of the next
//                    `prefetch_layers` served layers (cyclically: after the last layer comes the first,
//                    for the next token), clusters with cluster_prob ≥ prefetch_min_prob that are
//                    neither resident nor being read are submitted too, while free-able cold slots
//                    remain (a layer's own demand always has room: the constructor checks the cold
//                    region holds (1 + prefetch_layers) layers' clusters). Never blocks on I/O.
//   — the caller computes the `ready` clusters while the reads run —
//   wait(L)          one thread: blocks until every read holding a cluster of L is complete. Slot by
//                    slot in submission order it waits for the slot's two reads (FlashReader::
//                    wait_request) and checks (below) the slot while later reads of L are still in
//                    flight, so checking fills time otherwise spent blocked on flash; once every
//                    read of L is in it stops. What of L is still unchecked then is left to the
//                    threads that compute it (check_cluster): spread over the compute threads, right
//                    before the rows are used (they are then in that core's cache).
//                    Throws IoError (file, offset, cause) on a failed read: the slots involved are
//                    dropped, nothing is served from them.
//   — the caller computes the `pending` clusters —
// Checking (integrity.h): a slot's up and down_t rows are compared with the layer's checksums (when
// it has them) once, after its reads complete and before any cluster is computed from it.
//   check_cluster(L, c)  any thread, for the clusters that thread is about to compute (the threads of
//                    one phase must pass disjoint clusters; no plan/wait runs meanwhile): returns at
//                    once when the slot is checked, else checks it. Throws IntegrityError on a
//                    mismatch; the slot is dropped at the next plan() and read again when needed.
//                    The caller must call it for every cluster of `ready` and `pending` before
//                    computing the cluster: a slot filled by a read may still be unchecked.
// load_hot() checks the pinned clusters itself (they are never unchecked).
// Slot addresses stay valid until the next plan() of any layer. Not thread-safe apart from
// check_cluster: one plan/wait sequence at a time (the backend computes splits one at a time per model).
#pragma once

#include "io/flash_io.h"
#include "io/integrity.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

// One served layer as the cache reads it (absolute file offsets).
struct CacheLayerSource {
    int layer = -1;
    int64_t n_ff = 0;
    uint64_t up_offset = 0;  // row 0 of up in the up file (row k at + k·up_row_bytes)
    uint64_t up_row_bytes = 0;
    uint64_t down_t_offset = 0;  // row 0 of down_t in the sidecar
    uint64_t down_t_row_bytes = 0;
    std::vector<float> cluster_prob;  // P(cluster needed) per cluster (read-ahead); empty = all 1
    std::vector<int32_t> hot;         // clusters to pin (from the planner)
    // CRC-32C of every up row / down_t row (n_ff each; integrity.h) and how a mismatch names them;
    // empty: the rows are not checked
    std::vector<uint32_t> up_crc, down_t_crc;
    RowSource up_source, down_t_source;
};

// Bytes of one slot: round_up(C·up_row_bytes, 4096) + round_up(C·down_t_row_bytes, 4096), with the
// largest row sizes over the cached layers. The one formula for the slot size: the planner
// (plugin/planning/planner.py, through llamaflash._native.cache_slot_bytes) budgets with it.
size_t neuron_cache_slot_bytes(int64_t cluster_size, uint64_t up_row_bytes, uint64_t down_t_row_bytes);

// The fewest cold slots the cache accepts: (1 + prefetch_layers) · the most clusters of a layer (the
// layer computing and the layers read ahead each have room for all their clusters). The one formula:
// the planner (through llamaflash._native.cache_min_cold_slots) sizes the cold region with it.
int64_t neuron_cache_min_cold_slots(int prefetch_layers, int64_t max_clusters_per_layer);

struct NeuronCacheConfig {
    int cluster_size = 32;           // neurons per cluster (= the kernel's cluster size)
    int64_t cold_slots = 0;          // >= (1 + prefetch_layers) · max clusters per layer
    int prefetch_layers = 1;         // read-ahead depth in served layers (0 = demand reads only)
    float prefetch_min_prob = 0.5f;  // read ahead clusters at least this likely to be needed
    FlashReaderOptions io;           // both files are read with these options
};

struct NeuronCacheStats {
    uint64_t plans = 0;                        // plan() calls (layer-tokens)
    uint64_t clusters_needed = 0;              // Σ needed clusters
    uint64_t hits_hot = 0;                     // needed and pinned
    uint64_t hits_cold = 0;                    // needed and already in a cold slot (reuse across tokens)
    uint64_t hits_prefetch = 0;                // needed and read ahead (complete or still in flight)
    uint64_t misses = 0;                       // needed and read on demand
    uint64_t prefetched = 0;                   // clusters read ahead
    uint64_t prefetch_unused = 0;              // read-ahead clusters replaced or re-planned without being needed
    uint64_t bytes_read = 0;                   // bytes requested from both files (slot payloads)
    uint64_t hot_bytes_loaded = 0;             // by load_hot()
    double io_wait_seconds = 0;                // time blocked in wait()
    double plan_seconds = 0;                   // time in plan()
    uint64_t verified_bytes = 0;               // bytes checked against the checksums (load_hot and reads)
    double verify_seconds = 0;                 // time spent checking them, on every thread (the checks run by
                                               // wait() are part of io_wait_seconds, those of check_cluster not)
    uint64_t clusters_checked_by_compute = 0;  // slots checked by check_cluster (not while waiting)
    double compute_verify_seconds = 0;         // their part of verify_seconds (summed over threads)
    uint64_t cold_releases = 0;                // release_cold() calls that emptied a used cold region
    uint64_t draft_plans = 0;                  // plan_resident() calls (draft layer-tokens)
    uint64_t draft_clusters_needed = 0;        // Σ clusters a draft's tokens select
    uint64_t draft_clusters_resident = 0;      // of those, resident (computed); the rest were skipped
    int64_t hot_slots = 0, cold_slots = 0;
    size_t slot_bytes = 0;
    std::string engine;  // "io_uring" / "pool"
    bool direct = false;
    std::string fallback_reason;  // why direct I/O is off, when it was asked for
};

class NeuronCache {
public:
    // Opens both files (FlashReader each), allocates hot + cold slots. Throws std::invalid_argument
    // (bad sizes, a cold region too small, hot indices out of range) or IoError (files).
    NeuronCache(const std::string & sidecar_path, const std::string & up_path, std::vector<CacheLayerSource> layers,
                const NeuronCacheConfig & config);
    ~NeuronCache();
    NeuronCache(const NeuronCache &) = delete;
    NeuronCache & operator=(const NeuronCache &) = delete;

    // Reads every pinned cluster (blocking). Throws IoError.
    void load_hot();

    struct LayerPlan {
        std::vector<const uint8_t *> up;  // per cluster of the layer: slot address of its up rows (nullptr: not needed)
        std::vector<const uint8_t *> down_t;  // likewise down_t rows
        std::vector<int32_t> ready;           // needed clusters resident now
        std::vector<int32_t> pending;         // needed clusters resident after wait()
        // n_clusters null row addresses, no cluster listed (the vectors keep their memory, so
        // pointers to up.data() and down_t.data() stay valid while the size does not change)
        void reset(int64_t n_clusters) {
            up.assign(static_cast<size_t>(n_clusters), nullptr);
            down_t.assign(static_cast<size_t>(n_clusters), nullptr);
            ready.clear();
            pending.clear();
        }
    };
    // li: position of the layer in the constructor's list; needed: n_clusters(li) bytes.
    void plan(int li, const uint8_t * needed, LayerPlan & out);
    // A draft's plan: the needed clusters resident now (pinned, or in a cold slot whose reads are
    // complete) go to `ready`; the rest are left out (`pending` stays empty). No read is submitted,
    // no slot changes hands, the LRU order and the statistics above are untouched: a draft never
    // waits for flash and never evicts what the exact passes use. Counted in draft_clusters_*.
    void plan_resident(int li, const uint8_t * needed, LayerPlan & out);
    void wait(int li);
    // Empties the cold region and gives its memory back (madvise MADV_DONTNEED: the pages are freed
    // now and fault in again, zeroed, when a later read fills them). Waits for every read in flight
    // first (read-ahead included; their data and any error are dropped: nothing is served from those
    // slots). Pinned slots are untouched. For a phase that computes no cluster (a prompt batch on the
    // dense lane): the memory the cold region held serves that phase's buffers. Returns the bytes
    // released (0 when the cold region was already empty). Not concurrent with plan/wait.
    size_t release_cold();
    // See "Checking" above. Thread-safe for distinct clusters while no plan/wait runs.
    void check_cluster(int li, int32_t cluster);

    int cluster_size() const { return config_.cluster_size; }
    int64_t n_clusters(int li) const;
    size_t slot_bytes() const { return slot_bytes_; }
    size_t memory_bytes() const;
    NeuronCacheStats stats() const;
    void reset_stats();
    // Throws IoError when either file changed on disk since it was opened (FlashReader::verify).
    void verify() const;

private:
    struct Slot {
        int32_t layer = -1;  // position in layers_, -1 free
        int32_t cluster = -1;
        bool hot = false;
        bool loading = false;     // reads submitted, not yet waited for
        bool prefetched = false;  // filled by read-ahead and not yet needed
        bool unchecked = false;   // reads complete, rows not yet checked (check_cluster checks them)
        bool bad = false;         // a check failed: dropped at the next plan()
        uint64_t last_use = 0;    // plan counter of the last use (LRU)
        uint64_t locked = 0;      // plan counter of the plan that uses it (not replaceable then)
    };
    struct Batch {  // one layer's outstanding reads
        FlashReader::Ticket up = 0, down = 0;
        bool has_up = false, has_down = false;
        std::vector<int64_t> slots;
        bool waited = false;     // its reads waited for (complete)
        size_t next = 0;         // slots[0, next) were checked by the waiting thread (or skipped)
        std::string error;       // its read or check failure, kept until its layer's finish
        bool integrity = false;  // the error is a failed check
    };

    uint8_t * slot_data(int64_t s) const { return pool_.data() + static_cast<size_t>(s) * slot_bytes_; }
    int64_t take_cold_slot(bool for_prefetch);
    // starts the reads of `clusters` of layer li into `slots`; returns the payload bytes requested
    uint64_t submit(int li, const std::vector<int32_t> & clusters, const std::vector<int64_t> & slots, bool prefetch);
    // wait for li's batches, checking each slot as its reads come in while others are in flight;
    // then check the rest (check_all) or leave it unchecked. Throws IoError / IntegrityError after
    // dropping the slots of li involved.
    void finish(int li, bool check_all);
    // the slot's rows against its layer's checksums; throws IntegrityError; returns the nanoseconds taken
    uint64_t check_slot(int64_t s);
    bool arrived(const Batch & b) const;  // every read of the batch complete (poll, no blocking)
    void await_reads(Batch & b);          // block until the batch's reads are complete (a failure kept in b.error)
    void drop_bad_slots();                // forget the slots whose check failed (plan())

    std::vector<CacheLayerSource> layers_;
    NeuronCacheConfig config_;
    std::unique_ptr<FlashReader> sidecar_, up_file_;
    size_t up_part_ = 0, slot_bytes_ = 0;
    AlignedBuffer pool_;
    std::vector<Slot> slots_;
    int64_t hot_slots_ = 0;
    std::vector<std::vector<int64_t>> where_;  // [layer][cluster] -> slot or -1
    std::vector<std::vector<Batch>> batches_;  // [layer] outstanding batches
    std::vector<int64_t> lru_;                 // cold slot ids (scan order for replacement)
    uint64_t clock_ = 0;
    NeuronCacheStats stats_;
    // updated by check_cluster on any thread
    std::atomic<uint64_t> checked_bytes_{0}, check_ns_{0}, checked_by_compute_{0}, compute_check_ns_{0};
    std::atomic<bool> any_bad_{false};
};

}  // namespace llamaflash
