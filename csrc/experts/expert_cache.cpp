// expert_cache.cpp — see expert_cache.h: slot layout, checks, requests (begin, usable_now, finish),
// victims. Prefetch and read-ahead: expert_cache_early_reads.cpp.
#include "experts/expert_cache.h"

#include "experts/expert_cache_internal.h"

#include "io/crc32c.h"
#include "io/integrity.h"

#include <algorithm>
#include <stdexcept>

namespace llamaflash {

using expert_cache_detail::region_bytes;
using expert_cache_detail::round_up;
using expert_cache_detail::seconds_since;

size_t expert_slot_bytes(const std::vector<uint64_t> & expert_bytes, size_t alignment) {
    uint64_t total = 0;
    for (uint64_t b : expert_bytes) {
        total += expert_cache_detail::region_bytes(b, alignment);
    }
    return static_cast<size_t>(total);
}

ExpertCache::ExpertCache(const ExpertConfig & config) : config_(config) {
    FlashReaderOptions options;
    options.engine = parse_io_engine(config.io_engine);
    options.queue_depth = config.queue_depth;
    options.direct = config.direct;
    reader_ = std::make_unique<FlashReader>(config.base_path, options);
    const uint64_t a = reader_->alignment();
    for (size_t p = 0; p < config.layers.size(); ++p) {
        const ExpertLayerSpec & spec = config.layers[p];
        auto layer = std::make_unique<Layer>();
        for (const ExpertTensorSpec & t : spec.tensors) {
            layer->region_offset.push_back(layer->slot_stride);
            layer->slot_stride += region_bytes(t.expert_bytes, a);
        }
        layer->memory = AlignedBuffer(layer->slot_stride * static_cast<size_t>(spec.n_slots), a);
        layer->slots.resize(static_cast<size_t>(spec.n_slots));
        layer->slot_of.assign(static_cast<size_t>(spec.n_expert), -1);
        layer->is_pinned.assign(static_cast<size_t>(spec.n_expert), 0);
        layers_.push_back(std::move(layer));
    }
    // pinned experts: read now, one batch for all layers, checked
    std::vector<ReadRequest> requests;
    std::vector<std::vector<int>> filled(config.layers.size());  // per position: its pinned slots
    for (size_t p = 0; p < config.layers.size(); ++p) {
        Layer & layer = *layers_[p];
        int slot = 0;
        for (int e : config.layers[p].pinned) {
            Slot & s = layer.slots[static_cast<size_t>(slot)];
            s.expert = e;
            s.pinned = true;
            s.state = Slot::State::ready;
            s.unchecked = true;
            layer.slot_of[static_cast<size_t>(e)] = slot;
            layer.is_pinned[static_cast<size_t>(e)] = 1;
            for (const ReadRequest & r : slot_requests(static_cast<int>(p), slot, e)) {
                requests.push_back(r);
            }
            filled[p].push_back(slot);
            ++slot;
        }
    }
    if (!requests.empty()) {
        reader_->read(requests);
        for (const ReadRequest & r : requests) {
            stats_.bytes_read += r.length;
        }
        for (size_t p = 0; p < filled.size(); ++p) {
            check_slots(static_cast<int>(p), filled[p]);
        }
    }
}

ExpertCache::~ExpertCache() {
    for (auto & layer : layers_) {
        try {
            wait_prefetches(*layer);
            if (layer->demand_pending) {
                reader_->wait(layer->demand_ticket);
            }
        } catch (...) {  // errors of reads nobody will use
        }
    }
}

uint64_t ExpertCache::start_slot_read(int position, int slot, int expert, std::vector<ReadRequest> & requests) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    Slot & s = layer.slots[static_cast<size_t>(slot)];
    s.expert = expert;
    s.state = Slot::State::loading;
    s.unchecked = true;
    s.last_use = clock_;
    layer.slot_of[static_cast<size_t>(expert)] = slot;
    uint64_t bytes = 0;
    for (const ReadRequest & r : slot_requests(position, slot, expert)) {
        requests.push_back(r);
        bytes += r.length;
    }
    stats_.bytes_read += bytes;
    return bytes;
}

std::vector<ReadRequest> ExpertCache::slot_requests(int position, int slot, int expert) {
    const ExpertLayerSpec & spec = config_.layers[static_cast<size_t>(position)];
    Layer & layer = *layers_[static_cast<size_t>(position)];
    const uint64_t a = reader_->alignment();
    std::vector<ReadRequest> out;
    uint8_t * base = layer.memory.data() + layer.slot_stride * static_cast<size_t>(slot);
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
        const ExpertTensorSpec & t = spec.tensors[i];
        const uint64_t begin = t.offset + t.expert_bytes * static_cast<uint64_t>(expert);
        const uint64_t aligned = begin / a * a;
        const uint64_t end = std::min<uint64_t>(round_up(begin + t.expert_bytes, a), reader_->file_size());
        // the file's last extent may end before the alignment: read up to the end of the file
        out.push_back(ReadRequest{aligned, end - aligned, base + layer.region_offset[i]});
    }
    return out;
}

const uint8_t * ExpertCache::slot_data(int position, int expert, ExpertTensorKind kind) const {
    const ExpertLayerSpec & spec = config_.layers[static_cast<size_t>(position)];
    const Layer & layer = *layers_[static_cast<size_t>(position)];
    const int slot = layer.slot_of[static_cast<size_t>(expert)];
    if (slot < 0 || layer.slots[static_cast<size_t>(slot)].state != Slot::State::ready) {
        return nullptr;
    }
    const uint64_t a = reader_->alignment();
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
        const ExpertTensorSpec & t = spec.tensors[i];
        if (t.kind == kind) {
            const uint64_t begin = t.offset + t.expert_bytes * static_cast<uint64_t>(expert);
            return layer.memory.data() + layer.slot_stride * static_cast<size_t>(slot) + layer.region_offset[i] +
                   (begin % a);
        }
    }
    return nullptr;
}

// Every unchecked slot of `slots` against its checksums. The work: each checked slice cut into
// check_threads_ pieces of about equal length, the pieces' CRC-32C computed by that many OpenMP
// threads (the runtime ggml-cpu's workers use), then joined per slice (crc32c_combine) and compared
// in slot order on the calling thread. A mismatch drops its slot and throws; the slots after it stay
// unchecked.
void ExpertCache::check_slots(int position, const std::vector<int> & slots) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    std::vector<int> todo;
    for (int slot : slots) {
        Slot & s = layer.slots[static_cast<size_t>(slot)];
        if (s.unchecked && !config_.verify) {
            s.unchecked = false;
        }
        if (s.unchecked) {
            todo.push_back(slot);
        }
    }
    if (todo.empty()) {
        return;
    }
    const ExpertLayerSpec & spec = config_.layers[static_cast<size_t>(position)];
    const auto t0 = std::chrono::steady_clock::now();
    struct Piece {
        const uint8_t * data;
        size_t bytes;
        uint32_t crc;
    };
    const size_t n_pieces = static_cast<size_t>(std::max(1, check_threads_));
    std::vector<Piece> pieces;  // slot-major, then tensor, then piece
    for (int slot : todo) {
        const int expert = layer.slots[static_cast<size_t>(slot)].expert;
        for (const ExpertTensorSpec & t : spec.tensors) {
            if (t.checksums.empty()) {
                continue;
            }
            const uint8_t * data = slot_data(position, expert, t.kind);
            for (size_t k = 0; k < n_pieces; ++k) {
                const size_t from = t.expert_bytes * k / n_pieces, to = t.expert_bytes * (k + 1) / n_pieces;
                pieces.push_back(Piece{data + from, to - from, 0});
            }
        }
    }
    const int64_t n = static_cast<int64_t>(pieces.size());
#pragma omp parallel for num_threads(check_threads_) schedule(static) if (check_threads_ > 1 && n > 1)
    for (int64_t i = 0; i < n; ++i) {
        Piece & piece = pieces[static_cast<size_t>(i)];
        crc32c_rows(piece.data, 1, piece.bytes, piece.bytes, &piece.crc);
    }
    size_t next = 0;
    for (int slot : todo) {
        Slot & s = layer.slots[static_cast<size_t>(slot)];
        s.unchecked = false;
        for (const ExpertTensorSpec & t : spec.tensors) {
            if (t.checksums.empty()) {
                continue;
            }
            uint32_t got = pieces[next++].crc;
            for (size_t k = 1; k < n_pieces; ++k, ++next) {
                got = crc32c_combine(got, pieces[next].crc, pieces[next].bytes);
            }
            stats_.verified_bytes += t.expert_bytes;
            if (got != t.checksums[static_cast<size_t>(s.expert)]) {
                const uint64_t offset = t.offset + t.expert_bytes * static_cast<uint64_t>(s.expert);
                layer.slot_of[static_cast<size_t>(s.expert)] = -1;
                const int expert = s.expert;
                s = Slot{};
                stats_.verify_seconds += seconds_since(t0);
                throw std::runtime_error(std::string(kIntegrityErrorPrefix) + "'" + config_.base_path + "': layer " +
                                         std::to_string(spec.layer) + " expert " + std::to_string(expert) +
                                         " (tensor kind " + std::to_string(static_cast<int>(t.kind)) + ", " +
                                         std::to_string(t.expert_bytes) + " bytes at offset " + std::to_string(offset) +
                                         ") does not match its checksum: the model file differs from the one "
                                         "the sidecar was made for; re-copy it or re-run `llamaflash convert --force`");
            }
        }
    }
    stats_.verify_seconds += seconds_since(t0);
}

int ExpertCache::capacity(int position, const std::vector<int> & experts) const {
    const ExpertLayerSpec & spec = config_.layers[static_cast<size_t>(position)];
    const Layer & layer = *layers_[static_cast<size_t>(position)];
    int pinned_unused = static_cast<int>(spec.pinned.size());
    for (int e : experts) {
        pinned_unused -= layer.is_pinned[static_cast<size_t>(e)] ? 1 : 0;
    }
    return spec.n_slots - pinned_unused;
}

// The least recently used slot that is neither pinned, nor loading, nor holding an expert in `keep`
// (expert → 1); empty slots first. -1 when none.
int ExpertCache::take_victim(Layer & layer, const std::vector<char> & keep) {
    int best = -1;
    for (size_t i = 0; i < layer.slots.size(); ++i) {
        const Slot & s = layer.slots[i];
        if (s.pinned || s.state == Slot::State::loading || (s.expert >= 0 && keep[static_cast<size_t>(s.expert)])) {
            continue;
        }
        if (s.state == Slot::State::empty) {
            return static_cast<int>(i);
        }
        if (best < 0 || s.last_use < layer.slots[static_cast<size_t>(best)].last_use) {
            best = static_cast<int>(i);
        }
    }
    if (best >= 0) {
        Slot & s = layer.slots[static_cast<size_t>(best)];
        if (s.prefetched) {
            ++stats_.prefetch_wasted;
        }
        layer.slot_of[static_cast<size_t>(s.expert)] = -1;
        s = Slot{};
    }
    return best;
}

void ExpertCache::drop_demand_slots(Layer & layer) {
    for (int slot : layer.demand_slots) {
        Slot & s = layer.slots[static_cast<size_t>(slot)];
        if (s.expert >= 0) {
            layer.slot_of[static_cast<size_t>(s.expert)] = -1;
        }
        s = Slot{};
    }
    layer.demand_slots.clear();
}

void ExpertCache::begin(int position, const std::vector<int> & experts) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    ++clock_;
    ++stats_.requests;
    stats_.experts_needed += experts.size();
    std::vector<char> keep(layer.slot_of.size(), 0);
    for (int e : experts) {
        keep[static_cast<size_t>(e)] = 1;
    }
    std::vector<ReadRequest> requests;
    layer.demand_slots.clear();
    for (int e : experts) {
        int slot = layer.slot_of[static_cast<size_t>(e)];
        if (slot >= 0) {
            Slot & s = layer.slots[static_cast<size_t>(slot)];
            if (s.ahead) {  // read early for this request: a miss whose read is already under way
                s.ahead = false;
                ++stats_.misses;
                ++stats_.read_ahead;
                stats_.demand_bytes += layer.slot_stride;
                s.last_use = clock_;
                continue;
            }
            ++stats_.hits;
            stats_.pinned_hits += s.pinned ? 1 : 0;
            if (s.prefetched) {
                ++stats_.prefetch_used;
                ++lifetime_prefetch_used_;
                s.prefetched = false;
            }
            s.last_use = clock_;
            continue;
        }
        slot = take_victim(layer, keep);
        if (slot < 0 && !layer.early_reads.empty()) {  // victims still loading: their reads first
            try {
                wait_prefetches(layer);
            } catch (...) {
                drop_demand_slots(layer);
                throw;
            }
            slot = take_victim(layer, keep);
        }
        if (slot < 0) {
            drop_demand_slots(layer);
            throw std::logic_error("expert cache: request larger than the layer's capacity");
        }
        ++stats_.misses;
        stats_.demand_bytes += start_slot_read(position, slot, e, requests);
        layer.demand_slots.push_back(slot);
    }
    layer.demand_pending = false;
    if (!requests.empty()) {
        try {
            layer.demand_ticket = reader_->submit(requests);
            for (int slot : layer.demand_slots) {
                layer.slots[static_cast<size_t>(slot)].read_ticket = layer.demand_ticket;
            }
        } catch (...) {
            drop_demand_slots(layer);
            throw;
        }
        layer.demand_pending = true;
    }
}

void ExpertCache::finish(int position) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    try {
        // the reads of this layer's prefetched slots that this request uses (started while the previous
        // layer computed), then those slots, checked while its demand reads are still in flight
        wait_used_early_reads(position);
        std::vector<int> used;
        for (size_t i = 0; i < layer.slots.size(); ++i) {
            const Slot & s = layer.slots[i];
            if (s.unchecked && s.state == Slot::State::ready && s.last_use == clock_) {
                used.push_back(static_cast<int>(i));
            }
        }
        check_slots(position, used);
    } catch (...) {
        abandon_demand(layer);
        throw;
    }
    if (!layer.demand_pending) {
        return;
    }
    // the demand reads: each expert checked as soon as its reads are in, while later ones are read
    const size_t per_slot = config_.layers[static_cast<size_t>(position)].tensors.size();
    size_t request = 0;
    bool failed = false;
    try {
        for (int slot : layer.demand_slots) {
            const auto t0 = std::chrono::steady_clock::now();
            for (size_t k = 0; k < per_slot && !failed; ++k) {
                failed = !reader_->wait_request(layer.demand_ticket, request++);
            }
            stats_.wait_seconds += seconds_since(t0);
            if (failed) {
                break;
            }
            layer.slots[static_cast<size_t>(slot)].state = Slot::State::ready;
            check_slots(position, {slot});
        }
        const auto t0 = std::chrono::steady_clock::now();
        layer.demand_pending = false;
        reader_->wait(layer.demand_ticket);  // forgets the ticket; throws IoError for a failed read
        stats_.wait_seconds += seconds_since(t0);
    } catch (...) {
        abandon_demand(layer);
        throw;
    }
}

void ExpertCache::abandon_demand(Layer & layer) {
    if (layer.demand_pending) {
        layer.demand_pending = false;
        try {
            reader_->wait(layer.demand_ticket);  // the kernel must be done writing into the slots
        } catch (...) {
        }
    }
    drop_demand_slots(layer);
}

size_t ExpertCache::slot_bytes(int position) const { return layers_[static_cast<size_t>(position)]->slot_stride; }

size_t ExpertCache::resident_bytes() const {
    size_t total = 0;
    for (const auto & layer : layers_) {
        total += layer->memory.size();
    }
    return total;
}

size_t ExpertCache::alignment() const { return reader_->alignment(); }

bool ExpertCache::direct() const { return reader_->direct(); }

const char * ExpertCache::engine_name() const { return reader_->engine_name(); }

std::vector<int> ExpertCache::resident_experts(int position) const {
    std::vector<int> out;
    for (const Slot & s : layers_[static_cast<size_t>(position)]->slots) {
        if (s.state == Slot::State::ready) {
            out.push_back(s.expert);
        }
    }
    std::sort(out.begin(), out.end());
    return out;
}

std::vector<int> ExpertCache::usable_now(int position, const std::vector<int> & experts) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    std::vector<int> out;
    try {
        // prefetches already complete (no waiting), then the request's ready slots
        settle_early_reads(layer, true);
        for (int e : experts) {
            const int slot = layer.slot_of[static_cast<size_t>(e)];
            if (slot >= 0 && layer.slots[static_cast<size_t>(slot)].state == Slot::State::ready) {
                out.push_back(e);
            }
        }
    } catch (...) {
        abandon_demand(layer);
        throw;
    }
    return out;
}

}  // namespace llamaflash
