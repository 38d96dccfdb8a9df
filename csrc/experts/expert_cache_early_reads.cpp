// expert_cache_early_reads.cpp — the expert cache's reads started before a request needs them
// (expert_cache.h): prefetch() of the next layer's predicted experts, read_ahead() of a batch's next
// round, settling and waiting for them, and how many predictions the measured precision pays for.
#include "experts/expert_cache.h"

#include "experts/expert_cache_internal.h"

namespace llamaflash {

using expert_cache_detail::seconds_since;

// Waits for the early reads of `layer` (all, or only those already complete), marks their slots
// ready, or empty where their batch failed; then throws IoError for the first failure.
void ExpertCache::settle_early_reads(Layer & layer, bool only_complete) {
    std::string failure;
    std::vector<Layer::EarlyRead> pending;
    for (Layer::EarlyRead & r : layer.early_reads) {
        if (only_complete && !reader_->poll(r.ticket)) {
            pending.push_back(std::move(r));
            continue;
        }
        bool ok = true;
        try {
            reader_->wait(r.ticket);
        } catch (const IoError & e) {
            ok = false;
            if (failure.empty()) {
                failure = e.what();
            }
        }
        for (int slot : r.slots) {
            Slot & s = layer.slots[static_cast<size_t>(slot)];
            if (s.state != Slot::State::loading || s.read_ticket != r.ticket) {
                continue;  // made ready by wait_used_early_reads, or refilled by a later batch since
            }
            if (ok) {
                s.state = Slot::State::ready;
            } else {
                layer.slot_of[static_cast<size_t>(s.expert)] = -1;
                s = Slot{};
            }
        }
    }
    layer.early_reads = std::move(pending);
    if (!failure.empty()) {
        throw IoError(failure);
    }
}

void ExpertCache::wait_prefetches(Layer & layer) {
    if (layer.early_reads.empty()) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
        settle_early_reads(layer, false);
    } catch (...) {
        stats_.wait_seconds += seconds_since(t0);
        throw;
    }
    stats_.wait_seconds += seconds_since(t0);
}

void ExpertCache::wait_used_early_reads(int position) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    if (layer.early_reads.empty()) {
        return;
    }
    const size_t per_slot = config_.layers[static_cast<size_t>(position)].tensors.size();
    const auto t0 = std::chrono::steady_clock::now();
    bool failed = false;
    try {
        for (const Layer::EarlyRead & r : layer.early_reads) {
            for (size_t j = 0; j < r.slots.size() && !failed; ++j) {
                Slot & s = layer.slots[static_cast<size_t>(r.slots[j])];
                if (s.state != Slot::State::loading || s.read_ticket != r.ticket || s.last_use != clock_) {
                    continue;  // not this request's
                }
                for (size_t k = 0; k < per_slot && !failed; ++k) {
                    failed = !reader_->wait_request(r.ticket, j * per_slot + k);
                }
                if (!failed) {
                    s.state = Slot::State::ready;
                }
            }
        }
        // a failed read: settle every batch (its slots dropped, the IoError thrown); else forget the
        // batches already complete and leave the others reading
        settle_early_reads(layer, !failed);
    } catch (...) {
        stats_.wait_seconds += seconds_since(t0);
        throw;
    }
    stats_.wait_seconds += seconds_since(t0);
}

void ExpertCache::prefetch(int position, const std::vector<int> & experts) { submit_early(position, experts, false); }

void ExpertCache::read_ahead(int position, const std::vector<int> & experts) { submit_early(position, experts, true); }

void ExpertCache::submit_early(int position, const std::vector<int> & experts, bool ahead) {
    Layer & layer = *layers_[static_cast<size_t>(position)];
    std::vector<char> keep(layer.slot_of.size(), 0);
    for (int e : experts) {
        keep[static_cast<size_t>(e)] = 1;
    }
    if (ahead) {  // the current request's experts stay: it is computed while these are read
        for (const Slot & s : layer.slots) {
            if (s.expert >= 0 && s.last_use == clock_) {
                keep[static_cast<size_t>(s.expert)] = 1;
            }
        }
    }
    std::vector<ReadRequest> requests;
    std::vector<int> slots;
    for (int e : experts) {
        if (layer.slot_of[static_cast<size_t>(e)] >= 0) {
            continue;
        }
        const int slot = take_victim(layer, keep);
        if (slot < 0) {
            break;
        }
        start_slot_read(position, slot, e, requests);
        Slot & s = layer.slots[static_cast<size_t>(slot)];
        s.prefetched = !ahead;
        s.ahead = ahead;
        slots.push_back(slot);
        if (!ahead) {
            ++stats_.prefetched;
            ++lifetime_prefetched_;
        }
    }
    if (requests.empty()) {
        return;
    }
    try {
        const FlashReader::Ticket ticket = reader_->submit(requests);
        for (int slot : slots) {
            layer.slots[static_cast<size_t>(slot)].read_ticket = ticket;
        }
        layer.early_reads.push_back(Layer::EarlyRead{ticket, std::move(slots)});
    } catch (const std::exception &) {  // not started: forget the slots; a demand read will retry
        for (int slot : slots) {
            Slot & s = layer.slots[static_cast<size_t>(slot)];
            layer.slot_of[static_cast<size_t>(s.expert)] = -1;
            s = Slot{};
        }
    }
}

int ExpertCache::prefetch_count(int n_used) {
    constexpr uint64_t kPrefetchWarmup = 64;
    constexpr uint64_t kPrefetchProbe = 16;
    ++prefetch_calls_;
    if (lifetime_prefetched_ < kPrefetchWarmup || prefetch_calls_ % kPrefetchProbe == 0) {
        return n_used;
    }
    const double precision = static_cast<double>(lifetime_prefetch_used_) / static_cast<double>(lifetime_prefetched_);
    return precision >= 0.5 ? n_used : static_cast<int>(n_used * precision);
}

}  // namespace llamaflash
