// layer_stream.cpp — see layer_stream.h.
#include "offload/layer_stream.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>

namespace llamaflash {

namespace {

size_t round_up(uint64_t v, size_t a) { return static_cast<size_t>((v + a - 1) / a * a); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

[[noreturn]] void fail(const std::string & what) { throw std::invalid_argument("llamaflash: layer stream: " + what); }

size_t unit(size_t alignment) { return std::max<size_t>(4096, alignment); }

}  // namespace

size_t layer_stream_part_bytes(uint64_t bytes, size_t alignment) {
    const size_t a = unit(alignment);
    return bytes == 0 ? 0 : round_up(bytes, a) + a;
}

size_t layer_stream_slot_bytes(uint64_t gate_bytes, uint64_t up_bytes, uint64_t down_bytes, size_t alignment) {
    return layer_stream_part_bytes(gate_bytes, alignment) + layer_stream_part_bytes(up_bytes, alignment) +
           layer_stream_part_bytes(down_bytes, alignment);
}

LayerStream::LayerStream(const std::string & base_path, std::vector<StreamLayerSource> layers,
                         const LayerStreamConfig & config)
    : layers_(std::move(layers)), config_(config) {
    const int n = static_cast<int>(layers_.size());
    if (n == 0) fail("no layers");
    if (config_.prefetch_layers < 0) fail("prefetch_layers must be >= 0");
    if (config_.cold_slots < 1 + config_.prefetch_layers) {
        fail("cold_slots must be >= 1 + prefetch_layers (" + std::to_string(1 + config_.prefetch_layers) + "), got " +
             std::to_string(config_.cold_slots));
    }
    reader_ = std::make_unique<FlashReader>(base_path, config_.io);
    align_ = unit(reader_->alignment());
    uint64_t gate = 0, up = 0, down = 0;
    for (const StreamLayerSource & L : layers_) {
        for (const StreamPart * p : {&L.gate, &L.up, &L.down}) {
            if (p->offset + p->bytes() > reader_->file_size()) {
                fail("layer " + std::to_string(L.layer) + ": rows past the end of '" + base_path + "'");
            }
            if (!p->crc.empty() && static_cast<int64_t>(p->crc.size()) != p->rows) {
                fail("layer " + std::to_string(L.layer) + ": a checksum per row expected");
            }
        }
        if (L.up.rows <= 0 || L.down.rows <= 0) fail("layer " + std::to_string(L.layer) + ": empty up or down");
        gate = std::max(gate, L.gate.bytes());
        up = std::max(up, L.up.bytes());
        down = std::max(down, L.down.bytes());
    }
    gate_part_ = layer_stream_part_bytes(gate, align_);
    up_part_ = layer_stream_part_bytes(up, align_);
    slot_bytes_ = layer_stream_slot_bytes(gate, up, down, align_);

    where_.assign(static_cast<size_t>(n), -1);
    std::vector<int> by_id(static_cast<size_t>(n));
    std::iota(by_id.begin(), by_id.end(), 0);
    std::sort(by_id.begin(), by_id.end(), [&](int a, int b) { return layers_[a].layer < layers_[b].layer; });
    walk_ = by_id;
    rank_.assign(static_cast<size_t>(n), 0);
    for (int k = 0; k < n; ++k) rank_[static_cast<size_t>(by_id[static_cast<size_t>(k)])] = k;

    std::vector<bool> pinned(static_cast<size_t>(n), false);
    for (int32_t p : config_.hot) {
        if (p < 0 || p >= n) fail("hot layer position " + std::to_string(p) + " out of range");
        if (pinned[static_cast<size_t>(p)]) fail("hot layer position " + std::to_string(p) + " listed twice");
        pinned[static_cast<size_t>(p)] = true;
    }
    hot_slots_ = static_cast<int64_t>(config_.hot.size());
    const int64_t total = hot_slots_ + config_.cold_slots;
    pool_ = AlignedBuffer(static_cast<size_t>(total) * slot_bytes_, align_);
    slots_.assign(static_cast<size_t>(total), Slot{});
    for (int64_t s = 0; s < hot_slots_; ++s) {
        slots_[static_cast<size_t>(s)].hot = true;
    }
    stats_.hot_slots = hot_slots_;
    stats_.cold_slots = config_.cold_slots;
    stats_.slot_bytes = slot_bytes_;
    stats_.engine = reader_->engine_name();
    stats_.direct = reader_->direct();
    stats_.fallback_reason = reader_->fallback_reason();
}

LayerStream::~LayerStream() = default;

int LayerStream::distance(int from, int to) const {
    const int n = static_cast<int>(layers_.size());
    return (rank_[static_cast<size_t>(to)] - rank_[static_cast<size_t>(from)] + n) % n;
}

std::vector<ReadRequest> LayerStream::requests(int pos, int64_t s) const {
    const StreamLayerSource & L = layers_[static_cast<size_t>(pos)];
    std::vector<ReadRequest> out;
    uint8_t * part = slot_data(s);
    const size_t sizes[3] = {gate_part_, up_part_, 0};
    const StreamPart * parts[3] = {&L.gate, &L.up, &L.down};
    for (int i = 0; i < 3; ++i) {
        const StreamPart & p = *parts[i];
        if (p.bytes() > 0) {
            const uint64_t first = p.offset / align_ * align_;
            const uint64_t end = round_up(p.offset + p.bytes(), align_);
            if (end <= reader_->file_size()) {  // the rounded range: straight into the slot
                out.push_back({first, end - first, part});
            } else {  // the file's last bytes: exactly the rows, through the reader's bounce buffer
                out.push_back({p.offset, p.bytes(), part + (p.offset - first)});
            }
        }
        part += sizes[i];
    }
    return out;
}

LayerStream::Rows LayerStream::rows_of(int64_t s) const {
    const StreamLayerSource & L = layers_[static_cast<size_t>(slots_[static_cast<size_t>(s)].pos)];
    const uint8_t * base = slot_data(s);
    Rows r;
    if (L.gate.bytes() > 0) r.gate = base + L.gate.offset % align_;
    r.up = base + gate_part_ + L.up.offset % align_;
    r.down = base + gate_part_ + up_part_ + L.down.offset % align_;
    return r;
}

void LayerStream::submit(int pos, int64_t s, bool prefetch) {
    Slot & slot = slots_[static_cast<size_t>(s)];
    const std::vector<ReadRequest> reqs = requests(pos, s);
    slot.ticket = reader_->submit(reqs);
    slot.pos = pos;
    slot.loading = true;
    slot.checked = false;
    slot.prefetched = prefetch;
    where_[static_cast<size_t>(pos)] = s;
    for (const ReadRequest & r : reqs) stats_.bytes_read += r.length;
}

void LayerStream::drop(int64_t s) {
    Slot & slot = slots_[static_cast<size_t>(s)];
    if (slot.pos >= 0) where_[static_cast<size_t>(slot.pos)] = -1;
    slot.pos = -1;
    slot.loading = slot.checked = slot.prefetched = false;
}

void LayerStream::await(int64_t s) {
    Slot & slot = slots_[static_cast<size_t>(s)];
    if (!slot.loading) return;
    slot.loading = false;
    try {
        reader_->wait(slot.ticket);
    } catch (...) {
        drop(s);
        throw;
    }
}

void LayerStream::check(int64_t s) {
    Slot & slot = slots_[static_cast<size_t>(s)];
    if (slot.checked) return;
    const auto t0 = std::chrono::steady_clock::now();
    const Rows r = rows_of(s);
    const StreamLayerSource & L = layers_[static_cast<size_t>(slot.pos)];
    const auto check_part = [](const uint8_t * data, const StreamPart & p) -> uint64_t {
        return data != nullptr && !p.crc.empty() ? verify_rows(data, p.row_bytes, 0, p.rows, p.crc.data(), p.source)
                                                 : 0;
    };
    try {
        stats_.verified_bytes += check_part(r.gate, L.gate) + check_part(r.up, L.up) + check_part(r.down, L.down);
    } catch (...) {
        drop(s);
        throw;
    }
    slot.checked = true;
    stats_.verify_seconds += seconds_since(t0);
}

void LayerStream::load_hot() {
    for (size_t k = 0; k < config_.hot.size(); ++k) {
        const int pos = config_.hot[k];
        if (where_[static_cast<size_t>(pos)] >= 0) continue;
        submit(pos, static_cast<int64_t>(k), false);
    }
    for (int64_t s = 0; s < hot_slots_; ++s) {
        if (slots_[static_cast<size_t>(s)].pos < 0) continue;
        await(s);
        check(s);
    }
    stats_.hot_bytes_loaded = stats_.bytes_read;
    stats_.bytes_read = 0;
}

int64_t LayerStream::take_cold_slot(int from, int dist, bool demand) {
    int64_t best = -1;
    int best_dist = -1;
    for (int64_t s = hot_slots_; s < static_cast<int64_t>(slots_.size()); ++s) {
        const Slot & slot = slots_[static_cast<size_t>(s)];
        if (slot.pos < 0) return s;  // free
        if (slot.pos == current_ || slot.pos == from) continue;
        if (slot.loading && !demand) continue;  // read-ahead never waits
        const int d = distance(from, slot.pos);
        if (d > best_dist) {
            best = s;
            best_dist = d;
        }
    }
    if (best < 0 || (!demand && best_dist <= dist)) return -1;
    try {
        await(best);  // demand may reuse a slot whose read-ahead is still in flight
    } catch (const IoError &) {
        // a read-ahead's failure: nothing is served from the slot (freed); its layer fails when demanded
    }
    drop(best);
    return best;
}

void LayerStream::plan(int pos) {
    if (pos < 0 || pos >= static_cast<int>(layers_.size())) fail("layer position out of range");
    ++stats_.plans;
    const int64_t s = where_[static_cast<size_t>(pos)];
    if (s >= 0) {
        Slot & slot = slots_[static_cast<size_t>(s)];
        if (slot.hot) {
            ++stats_.hits_hot;
        } else if (slot.prefetched) {
            ++stats_.hits_prefetch;
        } else {
            ++stats_.hits_cold;
        }
        slot.prefetched = false;
    } else {
        ++stats_.misses;
        current_ = -1;  // the layer computed before may give its slot
        submit(pos, take_cold_slot(pos, 0, true), false);
    }
    current_ = pos;
    // read-ahead along the walk
    const int n = static_cast<int>(layers_.size());
    int ahead = 0;
    for (int d = 1; d < n && ahead < config_.prefetch_layers; ++d) {
        const int q = walk_[static_cast<size_t>((rank_[static_cast<size_t>(pos)] + d) % n)];
        const int64_t held = where_[static_cast<size_t>(q)];
        if (held >= 0) {
            ahead += slots_[static_cast<size_t>(held)].hot ? 0 : 1;
            continue;
        }
        const int64_t free_slot = take_cold_slot(pos, d, false);
        if (free_slot < 0) break;
        submit(q, free_slot, true);
        ++stats_.prefetched;
        ++ahead;
    }
}

LayerStream::Rows LayerStream::wait(int pos, bool check_rows) {
    const int64_t s = where_[static_cast<size_t>(pos)];
    if (s < 0) fail("wait() for a layer not planned");
    const auto t0 = std::chrono::steady_clock::now();
    try {
        await(s);
        if (check_rows) check(s);
    } catch (...) {
        stats_.io_wait_seconds += seconds_since(t0);
        throw;
    }
    stats_.io_wait_seconds += seconds_since(t0);
    Rows rows = rows_of(s);
    rows.checked = slots_[static_cast<size_t>(s)].checked;
    return rows;
}

void LayerStream::checked(int pos, bool ok, uint64_t bytes) {
    const int64_t s = pos >= 0 && pos < static_cast<int>(layers_.size()) ? where_[static_cast<size_t>(pos)] : -1;
    if (s < 0) return;  // dropped already (wait()'s own check failed)
    stats_.verified_bytes += bytes;
    stats_.product_verified_bytes += bytes;
    if (ok) {
        slots_[static_cast<size_t>(s)].checked = true;
    } else {
        drop(s);
    }
}

LayerStreamStats LayerStream::stats() const { return stats_; }

void LayerStream::reset_stats() {
    const LayerStreamStats keep = stats_;
    stats_ = LayerStreamStats{};
    stats_.hot_slots = keep.hot_slots;
    stats_.cold_slots = keep.cold_slots;
    stats_.slot_bytes = keep.slot_bytes;
    stats_.hot_bytes_loaded = keep.hot_bytes_loaded;
    stats_.engine = keep.engine;
    stats_.direct = keep.direct;
    stats_.fallback_reason = keep.fallback_reason;
}

void LayerStream::verify() const { reader_->verify(); }

}  // namespace llamaflash
