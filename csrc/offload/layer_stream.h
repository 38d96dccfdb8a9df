// layer_stream.h — a dense FFN's weights from flash, one whole served layer at a time: what the dense
// lane computes with under a RAM budget when every FFN row must be computed exactly as stock computes
// it (OffloadConfig::stream_layers, deterministic answers).
//
// Units. A slot holds one served layer's base matrices, byte for byte as the base GGUF stores them:
//     gate : n_ff rows of gate_row_bytes        (only when the layer's gate is streamed)
//     up   : n_ff rows of up_row_bytes
//     down : n_embd rows of base_down_row_bytes
// Each part is one direct-I/O request over its file range rounded out to the reader's alignment A
// (max(4096, FlashReader::alignment())), read straight into the slot; the rows then start at
// part + (offset mod A). A range whose rounded end passes the end of the file is read exactly (the
// reader's bounce path). Part sizes: round_up(bytes, A) + A with the largest bytes over the layers
// (layer_stream_slot_bytes, the one formula the planner budgets with).
//
// Slots (the same memory the planner gives a neuron cache): `hot` layers pinned for the model's
// lifetime (read and checked by load_hot), and cold_slots >= 1 + prefetch_layers slots reused along the
// walk. Layers are walked in layer-id order, cyclically (after the last comes the first, for the next
// token), which a cold slot's replacement follows: it goes to the layer that comes up latest (Belady's
// choice for a cyclic walk), never the layer being computed, never one being read.
//
// Per split of the layer at position p (one thread at a time):
//   plan(p)  p resident or being read → nothing to read; else a cold slot is taken and p's reads are
//            submitted. Then read-ahead: the next served layers in walk order that are not resident,
//            up to prefetch_layers of them (pinned ones are skipped, not counted), each into a cold
//            slot whose layer comes up later than it. Never blocks on a read except to reuse a slot
//            whose read-ahead is still in flight (demand only).
//   wait(p)  blocks until p's reads are complete, checks its rows against their checksums once (when
//            given), returns the parts' addresses, valid until the next plan(). Throws IoError (file,
//            offset, cause) or IntegrityError; the slot is dropped, so the layer is read again next time.
//   wait(p, false)  the same without the check: a slot not checked yet comes back with checked false,
//            and the caller checks the rows as it computes with them (one pass over memory; the dense
//            lane's products do, matmul_rows.h CheckedWeight), then reports with checked(p, ok, ...):
//            ok marks the slot checked, a failure drops it.
// Not thread-safe: the backend computes one split at a time per model.
#pragma once

#include "io/flash_io.h"
#include "io/integrity.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace llamaflash {

// One contiguous row set of a layer in the base file, and how its rows are checked.
struct StreamPart {
    uint64_t offset = 0;  // absolute offset of row 0 in the base file
    int64_t rows = 0;
    uint64_t row_bytes = 0;
    std::vector<uint32_t> crc;  // CRC-32C per row (integrity.h); empty: not checked
    RowSource source;           // how a mismatch names the rows
    uint64_t bytes() const { return static_cast<uint64_t>(rows) * row_bytes; }
};

// One served layer as the stream reads it: gate (rows 0 when resident), up, down.
struct StreamLayerSource {
    int layer = -1;
    StreamPart gate, up, down;
};

struct LayerStreamConfig {
    std::vector<int32_t> hot;  // positions (in the sources' order) of the layers to pin
    int64_t cold_slots = 2;    // >= 1 + prefetch_layers
    int prefetch_layers = 1;   // layers read ahead of the one computing (0: demand reads only)
    FlashReaderOptions io;
};

// Bytes of one part of a slot holding `bytes` of rows: round_up(bytes, A) + A, A = max(4096, alignment).
size_t layer_stream_part_bytes(uint64_t bytes, size_t alignment);
// Bytes of one slot: the three parts' sizes for the largest gate (0 when resident), up and down bytes
// over the layers. The planner sizes the stream with it (llamaflash._native.layer_stream_slot_bytes).
size_t layer_stream_slot_bytes(uint64_t gate_bytes, uint64_t up_bytes, uint64_t down_bytes, size_t alignment);

struct LayerStreamStats {
    uint64_t plans = 0;          // plan() calls (layer evaluations)
    uint64_t hits_hot = 0;       // the layer was pinned
    uint64_t hits_cold = 0;      // in a cold slot already (read for an earlier evaluation)
    uint64_t hits_prefetch = 0;  // read ahead (complete or still in flight)
    uint64_t misses = 0;         // read on demand
    uint64_t prefetched = 0;     // layers read ahead
    uint64_t bytes_read = 0;     // bytes requested (the parts' file ranges, rounding included)
    uint64_t hot_bytes_loaded = 0;
    uint64_t verified_bytes = 0;          // checked: in wait(), or by the caller's products (checked())
    uint64_t product_verified_bytes = 0;  // of those, by the products as they multiplied them
    double io_wait_seconds = 0;           // time blocked in wait() (checking included)
    double verify_seconds = 0;            // wait()'s checks (the products' are not timed)
    int64_t hot_slots = 0, cold_slots = 0;
    size_t slot_bytes = 0;
    std::string engine;  // "io_uring" / "pool"
    bool direct = false;
    std::string fallback_reason;
};

class LayerStream {
public:
    // Opens the base file (FlashReader), allocates (hot + cold) slots. Throws std::invalid_argument
    // (no layers, a part outside the file, too few cold slots, a hot position out of range or listed
    // twice) or IoError (the file).
    LayerStream(const std::string & base_path, std::vector<StreamLayerSource> layers, const LayerStreamConfig & config);
    ~LayerStream();
    LayerStream(const LayerStream &) = delete;
    LayerStream & operator=(const LayerStream &) = delete;

    void load_hot();  // reads and checks every pinned layer (blocking); IoError / IntegrityError

    struct Rows {
        const uint8_t * gate = nullptr;  // nullptr when the gate is resident
        const uint8_t * up = nullptr;
        const uint8_t * down = nullptr;
        bool checked = true;  // every part with checksums was checked (false only after wait(pos, false))
    };
    void plan(int pos);
    Rows wait(int pos, bool check = true);
    // After wait(pos, false) returned rows not checked: the caller's products checked every part with
    // checksums (`bytes` of rows, not timed) and found them right (ok: the slot counts as checked) or
    // not (the slot is dropped). Nothing for a layer no longer held.
    void checked(int pos, bool ok, uint64_t bytes);
    // The layer at `pos` as the stream reads it (its parts' checksums and names).
    const StreamLayerSource & source(int pos) const { return layers_.at(static_cast<size_t>(pos)); }

    size_t slot_bytes() const { return slot_bytes_; }
    size_t memory_bytes() const { return pool_.size(); }
    LayerStreamStats stats() const;
    void reset_stats();
    void verify() const;  // IoError when the base file changed on disk since it was opened

private:
    struct Slot {
        int pos = -1;  // layer position held, -1 free
        bool hot = false;
        bool loading = false;     // reads submitted, not yet waited for
        bool checked = false;     // rows compared with their checksums (or nothing to compare)
        bool prefetched = false;  // read ahead and not yet planned
        FlashReader::Ticket ticket = 0;
    };
    uint8_t * slot_data(int64_t s) const { return pool_.data() + static_cast<size_t>(s) * slot_bytes_; }
    // the parts' read requests of layer `pos` into slot `s`
    std::vector<ReadRequest> requests(int pos, int64_t s) const;
    void submit(int pos, int64_t s, bool prefetch);
    // a cold slot for a layer `dist` steps ahead in the walk from `from`: free, or holding the layer
    // that comes up latest, later than `dist`; -1 when none (read-ahead only: demand always gets one)
    int64_t take_cold_slot(int from, int dist, bool demand);
    void await(int64_t s);  // waits for the slot's reads (IoError: the slot is freed, rethrown)
    void check(int64_t s);  // the slot's rows against their checksums (IntegrityError: freed, rethrown)
    void drop(int64_t s);   // forgets the slot's layer
    Rows rows_of(int64_t s) const;
    int distance(int from, int to) const;  // steps from `from` to `to` in the walk (0..n-1)

    std::vector<StreamLayerSource> layers_;
    LayerStreamConfig config_;
    size_t align_ = 4096, gate_part_ = 0, up_part_ = 0, slot_bytes_ = 0;
    AlignedBuffer pool_;  // before reader_: the reader (waiting for reads in flight) goes first
    std::unique_ptr<FlashReader> reader_;
    std::vector<Slot> slots_;
    int64_t hot_slots_ = 0;
    std::vector<int64_t> where_;  // [pos] -> slot or -1
    std::vector<int> walk_;       // positions in walk (layer-id) order
    std::vector<int> rank_;       // [pos] -> index in walk_
    int current_ = -1;            // the layer planned last (its slot is not replaced)
    LayerStreamStats stats_;
};

}  // namespace llamaflash
