// expert_cache.h — routed experts of an MoE model in RAM slots, filled from flash by direct I/O.
//
// Per served layer, n_slots slots; a slot holds one expert: one region per expert tensor (gate, up,
// down, or merged gate_up), each the aligned extent of the file covering that expert's slice, so a
// miss is one direct read per tensor straight into the slot (no bounce copy). Slot memory is one
// aligned allocation per layer, made at open: the cache's RAM is fixed, slot_bytes() × slots.
//
// Policy: `pinned` experts (the most popular on calibration text, chosen by the planner) are read at
// open and never evicted; the other slots are LRU by last use. The experts of the current request
// are never evicted while it is served. A prefetch (the next layer's predicted experts) fills LRU
// victims asynchronously; the next request of that layer waits for those of them it uses.
//
// A request is served in two steps so that reads overlap: begin() finds hits (resident, or still
// being prefetched) and submits the misses (one batch) at once, waiting for the layer's prefetches
// only when their slots are the only victims left; then the caller may prefetch another layer; then
// finish() waits for the reads of the prefetched slots the request uses (a prefetched expert it does
// not use is not waited for), checks every slot the request uses that was read and not yet checked
// while the demand reads are in flight (the CPU is otherwise idle then), and checks each demand
// expert against its CRC-32C as soon as its reads are in, while the later ones are still read. A
// check runs on set_check_threads() threads, each slice cut into that many pieces. A request may not
// hold more experts than capacity(): the expert lane splits larger sets into rounds.
//
// Checked before use: a request's results may be computed from slots usable_now() returned before
// finish() has checked them, but finish() throws on a mismatch before the request is done, so a
// result computed from unchecked bytes is never used (the caller fails the whole computation).
//
// Results never depend on the cache: an expert's bytes are the file's whichever slot holds them.
// Thread safety: one request at a time per cache (the caller serialises; ExpertLane locks).
#pragma once

#include "io/flash_io.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

enum class ExpertTensorKind : int { gate = 0, up = 1, down = 2, gate_up = 3 };
constexpr int kExpertTensorKinds = 4;

// One expert tensor of a layer, as the base GGUF stores it.
struct ExpertTensorSpec {
    ExpertTensorKind kind = ExpertTensorKind::up;
    uint64_t offset = 0;              // absolute offset of the tensor's data in the base file
    int type = 0;                     // ggml_type
    int64_t ne0 = 0;                  // input size (row length)
    int64_t ne1 = 0;                  // output rows of one expert
    uint64_t expert_bytes = 0;        // nb[2]: one expert's slice, ne1 rows of ggml_row_size(type, ne0)
    std::vector<uint32_t> checksums;  // CRC-32C of each expert's slice (n_expert), or empty: unchecked
};

struct ExpertLayerSpec {
    int layer = -1;
    int n_expert = 0;
    int n_used = 0;
    std::vector<ExpertTensorSpec> tensors;  // the layer's expert tensors (2 or 3)
    int n_slots = 0;                        // experts resident at once (>= n_used)
    std::vector<int> pinned;                // never evicted; at most n_slots - n_used
    std::vector<float> router;              // this layer's router [n_expert rows of n_embd] f32, for the
                                            // previous layer's prediction; empty: no prediction
    bool router_exact = false;              // the file stores the router in f32: `router` is its bytes
};

struct ExpertConfig {
    std::string base_path;
    int64_t n_embd = 0;
    std::vector<ExpertLayerSpec> layers;  // served layers, in layer order
    std::string io_engine = "auto";       // FlashReader engine: auto | io_uring | pool
    unsigned queue_depth = 32;
    bool direct = true;    // O_DIRECT reads (falls back to buffered where refused)
    bool verify = true;    // check every read slice against its checksum
    bool prefetch = true;  // predict the next layer's experts and read them early
    bool overlap = true;   // compute a request's usable experts while its misses are still read
    // compute the routers' MUL_MATs too, every row as ggml-cpu computes a row alone (router_rows.h);
    // needs every layer's router_exact
    bool router_rows = false;
};

// Counters since open or the last reset.
struct ExpertCacheStats {
    uint64_t requests = 0;        // layer requests (one per layer per batch round)
    uint64_t experts_needed = 0;  // expert activations requested (distinct per request)
    uint64_t hits = 0;            // already resident (pinned, cached, or prefetched and ready)
    uint64_t pinned_hits = 0;
    uint64_t misses = 0;           // read on demand
    uint64_t prefetched = 0;       // experts read by prefetch
    uint64_t prefetch_used = 0;    // of those, needed before being evicted
    uint64_t prefetch_wasted = 0;  // of those, evicted unused
    uint64_t read_ahead = 0;       // misses read early, while the batch's previous round computed
    uint64_t bytes_read = 0;       // by demand and prefetch
    uint64_t demand_bytes = 0;
    uint64_t verified_bytes = 0;
    double wait_seconds = 0.0;  // blocked waiting for reads (demand and the layer's prefetches)
    double verify_seconds = 0.0;
};

class ExpertCache {
public:
    // Opens the base file and allocates every layer's slots; reads the pinned experts.
    // Throws IoError, std::runtime_error (a pinned expert failing its check).
    explicit ExpertCache(const ExpertConfig & config);
    ~ExpertCache();  // waits for reads in flight
    ExpertCache(const ExpertCache &) = delete;
    ExpertCache & operator=(const ExpertCache &) = delete;

    // Experts a request of layer `position` may hold: n_slots minus pinned experts it does not use.
    int capacity(int position, const std::vector<int> & experts) const;

    // Step 1 of a request: `experts` (distinct, size <= capacity) — hits stay (a prefetch in flight
    // counts as a hit, finish() waits for it), misses get victim slots and are submitted as one batch.
    // Waits for this layer's prefetches only when no other victim is left.
    void begin(int position, const std::vector<int> & experts);
    // Step 2: waits for the misses, checks them; then slot_data(position, e, kind) is valid for every
    // requested expert until the next begin() of this layer. Throws IoError, or std::runtime_error
    // prefixed with kIntegrityErrorPrefix on a checksum mismatch (the slot is dropped).
    void finish(int position);
    // Starts reading `experts` of layer `position` that are not resident, into LRU victims (never a
    // pinned slot). Never blocks on the disk, never throws for I/O (errors surface at that layer's
    // next begin()).
    void prefetch(int position, const std::vector<int> & experts);

    // Starts reading `experts` of layer `position` for that layer's next request (the next round of a
    // batch), into LRU victims other than the current request's slots, which stay valid while it is
    // computed. The next begin() counts them as misses (demand reads issued early) and finish() waits
    // for them. Never blocks on the disk, never throws for I/O (errors surface at finish()).
    void read_ahead(int position, const std::vector<int> & experts);

    // How many of a layer's predicted experts are worth prefetching: n_used while prefetches have
    // been used at least half the time (or fewer than kPrefetchWarmup were made), else the share of
    // n_used that the measured precision (used / prefetched, since open) justifies, possibly 0; every
    // kPrefetchProbe-th call n_used again, so that the precision keeps being measured.
    int prefetch_count(int n_used);

    // Bytes of expert e's slice of tensor `kind` in its slot; nullptr when not resident and ready.
    const uint8_t * slot_data(int position, int expert, ExpertTensorKind kind) const;

    size_t slot_bytes(int position) const;  // one slot, all its tensor regions (alignment included)
    size_t resident_bytes() const;          // all slots of all layers
    size_t alignment() const;
    bool direct() const;
    const char * engine_name() const;
    std::vector<int> resident_experts(int position) const;  // ready slots' experts, sorted
    // Between begin() and finish(): of `experts` (the request's), those usable now without waiting
    // for the disk, in the order given: resident, or prefetched by a batch already complete (settled
    // here, checked by finish()). The others become usable at finish(). Throws IoError for a failed
    // prefetch (the request's demand reads then abandoned).
    std::vector<int> usable_now(int position, const std::vector<int> & experts);

    // Threads that checksum what was read (OpenMP; the caller's compute threads, idle meanwhile).
    void set_check_threads(int n) { check_threads_ = std::max(1, n); }

    ExpertCacheStats stats() const { return stats_; }
    void reset_stats() { stats_ = ExpertCacheStats{}; }
    FlashReader & reader() { return *reader_; }

private:
    struct Slot;
    struct Layer;
    void submit_early(int position, const std::vector<int> & experts, bool ahead);  // prefetch / read_ahead
    void settle_early_reads(Layer & layer, bool only_complete);
    void wait_prefetches(Layer & layer);
    // Waits for the early reads of the slots the current request of `position` uses (last used at
    // this clock), marks them ready and leaves the layer's other early reads in flight.
    void wait_used_early_reads(int position);
    void drop_demand_slots(Layer & layer);  // the request's demand slots emptied (failed or abandoned)
    void abandon_demand(Layer & layer);     // waits out the demand reads, then drops their slots
    int take_victim(Layer & layer, const std::vector<char> & keep);
    std::vector<ReadRequest> slot_requests(int position, int slot, int expert);
    // Slot `slot` of `position`'s layer starts reading `expert` (loading, unchecked, used at this
    // clock); its reads are appended to `requests` and counted in bytes_read. Returns their bytes.
    uint64_t start_slot_read(int position, int slot, int expert, std::vector<ReadRequest> & requests);
    void check_slots(int position, const std::vector<int> & slots);

    const ExpertConfig & config_;
    std::unique_ptr<FlashReader> reader_;
    std::vector<std::unique_ptr<Layer>> layers_;
    uint64_t clock_ = 0;
    ExpertCacheStats stats_;
    uint64_t lifetime_prefetched_ = 0;  // not reset with the statistics: the prefetch policy's evidence
    uint64_t lifetime_prefetch_used_ = 0;
    uint64_t prefetch_calls_ = 0;
    int check_threads_ = 1;
};

// Sizes the planner uses, computed as the cache lays slots out: one expert's slot for tensors of
// `expert_bytes` each, with direct-I/O `alignment`.
size_t expert_slot_bytes(const std::vector<uint64_t> & expert_bytes, size_t alignment);

}  // namespace llamaflash
