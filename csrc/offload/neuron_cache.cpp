// neuron_cache.cpp — see neuron_cache.h.
#include "offload/neuron_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <stdexcept>

namespace llamaflash {

namespace {

constexpr size_t kSlotAlign = 4096;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int64_t neuron_cache_min_cold_slots(int prefetch_layers, int64_t max_clusters_per_layer) {
    return (1 + static_cast<int64_t>(prefetch_layers)) * max_clusters_per_layer;
}

size_t neuron_cache_slot_bytes(int64_t cluster_size, uint64_t up_row_bytes, uint64_t down_t_row_bytes) {
    const size_t C = static_cast<size_t>(cluster_size);
    return round_up(C * up_row_bytes, kSlotAlign) + round_up(C * down_t_row_bytes, kSlotAlign);
}

NeuronCache::NeuronCache(const std::string & sidecar_path, const std::string & up_path,
                         std::vector<CacheLayerSource> layers, const NeuronCacheConfig & config)
    : layers_(std::move(layers)), config_(config) {
    auto fail = [](const std::string & msg) { throw std::invalid_argument("llamaflash neuron cache: " + msg); };
    const int64_t C = config_.cluster_size;
    if (C < 1 || C > 256) fail("cluster_size must be in 1..256");
    if (config_.prefetch_layers < 0) fail("prefetch_layers must be >= 0");
    if (layers_.empty()) fail("no layers");
    size_t up_row = 0, down_row = 0;
    int64_t max_clusters = 0, n_hot = 0;
    for (const CacheLayerSource & L : layers_) {
        if (L.n_ff <= 0 || L.up_row_bytes == 0 || L.down_t_row_bytes == 0) {
            fail("layer " + std::to_string(L.layer) + " has an empty shape");
        }
        const int64_t nc = (L.n_ff + C - 1) / C;
        if (!L.cluster_prob.empty() && static_cast<int64_t>(L.cluster_prob.size()) != nc) {
            fail("layer " + std::to_string(L.layer) + ": cluster_prob has " + std::to_string(L.cluster_prob.size()) +
                 " entries, the layer has " + std::to_string(nc) + " clusters");
        }
        std::vector<bool> seen(static_cast<size_t>(nc), false);
        for (int32_t c : L.hot) {
            if (c < 0 || c >= nc || seen[c])
                fail("layer " + std::to_string(L.layer) + ": bad or repeated hot cluster " + std::to_string(c));
            seen[c] = true;
        }
        up_row = std::max<size_t>(up_row, L.up_row_bytes);
        down_row = std::max<size_t>(down_row, L.down_t_row_bytes);
        max_clusters = std::max(max_clusters, nc);
        n_hot += static_cast<int64_t>(L.hot.size());
    }
    const int64_t min_cold = neuron_cache_min_cold_slots(config_.prefetch_layers, max_clusters);
    if (config_.cold_slots < min_cold) {
        fail("the cold region needs at least " + std::to_string(min_cold) + " slots ((1 + prefetch_layers) x " +
             std::to_string(max_clusters) + " clusters), got " + std::to_string(config_.cold_slots));
    }
    up_part_ = round_up(static_cast<size_t>(C) * up_row, kSlotAlign);
    slot_bytes_ = neuron_cache_slot_bytes(C, up_row, down_row);

    sidecar_ = std::make_unique<FlashReader>(sidecar_path, config_.io);
    up_file_ = std::make_unique<FlashReader>(up_path, config_.io);
    for (const CacheLayerSource & L : layers_) {
        const uint64_t n = static_cast<uint64_t>(L.n_ff);
        if (L.up_offset + n * L.up_row_bytes > up_file_->file_size() ||
            L.down_t_offset + n * L.down_t_row_bytes > sidecar_->file_size()) {
            throw IoError("llamaflash neuron cache: layer " + std::to_string(L.layer) +
                          " rows lie beyond the end of the file (truncated model or sidecar?)");
        }
    }

    hot_slots_ = n_hot;
    const int64_t n_slots = n_hot + config_.cold_slots;
    pool_ = AlignedBuffer(static_cast<size_t>(n_slots) * slot_bytes_, kSlotAlign);
    slots_.resize(static_cast<size_t>(n_slots));
    where_.resize(layers_.size());
    batches_.resize(layers_.size());
    int64_t s = 0;
    for (size_t li = 0; li < layers_.size(); ++li) {
        where_[li].assign(static_cast<size_t>(n_clusters(static_cast<int>(li))), -1);
        for (int32_t c : layers_[li].hot) {
            slots_[s] = Slot{static_cast<int32_t>(li), c, true};
            where_[li][c] = s++;
        }
    }
    for (; s < n_slots; ++s) lru_.push_back(s);
    stats_.hot_slots = hot_slots_;
    stats_.cold_slots = config_.cold_slots;
    stats_.slot_bytes = slot_bytes_;
}

NeuronCache::~NeuronCache() = default;  // the readers wait for reads in flight before the pool goes

int64_t NeuronCache::n_clusters(int li) const {
    const int64_t C = config_.cluster_size;
    return (layers_[static_cast<size_t>(li)].n_ff + C - 1) / C;
}

size_t NeuronCache::memory_bytes() const { return pool_.size(); }

void NeuronCache::load_hot() {
    for (size_t li = 0; li < layers_.size(); ++li) {
        std::vector<int32_t> clusters;
        std::vector<int64_t> slots;
        for (int32_t c : layers_[li].hot) {
            clusters.push_back(c);
            slots.push_back(where_[li][c]);
        }
        if (clusters.empty()) continue;
        stats_.hot_bytes_loaded += submit(static_cast<int>(li), clusters, slots, false);
        finish(static_cast<int>(li), true);
    }
}

// Least recently used cold slot that no plan in progress holds and no read is filling. lru_ is kept
// in use order (front = oldest) by plan(); a slot handed out goes to the back.
int64_t NeuronCache::take_cold_slot(bool for_prefetch) {
    for (size_t k = 0; k < lru_.size(); ++k) {
        const int64_t s = lru_[k];
        Slot & slot = slots_[s];
        if (slot.loading || slot.locked == clock_) continue;
        if (for_prefetch && slot.prefetched) return -1;  // never trade one guess for another
        if (slot.layer >= 0) {
            where_[slot.layer][slot.cluster] = -1;
            if (slot.prefetched) ++stats_.prefetch_unused;
        }
        lru_.erase(lru_.begin() + static_cast<std::ptrdiff_t>(k));
        lru_.push_back(s);
        slot = Slot{};
        return s;
    }
    return -1;
}

uint64_t NeuronCache::submit(int li, const std::vector<int32_t> & clusters, const std::vector<int64_t> & slots,
                             bool prefetch) {
    const CacheLayerSource & L = layers_[static_cast<size_t>(li)];
    const int64_t C = config_.cluster_size;
    std::vector<ReadRequest> up_reqs, down_reqs;
    up_reqs.reserve(clusters.size());
    down_reqs.reserve(clusters.size());
    Batch batch;
    uint64_t bytes = 0;
    for (size_t k = 0; k < clusters.size(); ++k) {
        const int64_t c = clusters[k], s = slots[k];
        const uint64_t first = static_cast<uint64_t>(c * C);
        const uint64_t n = static_cast<uint64_t>(std::min<int64_t>(C, L.n_ff - c * C));
        uint8_t * dst = slot_data(s);
        up_reqs.push_back({L.up_offset + first * L.up_row_bytes, n * L.up_row_bytes, dst});
        down_reqs.push_back({L.down_t_offset + first * L.down_t_row_bytes, n * L.down_t_row_bytes, dst + up_part_});
        bytes += n * (L.up_row_bytes + L.down_t_row_bytes);
        Slot & slot = slots_[s];
        slot.layer = li;
        slot.cluster = static_cast<int32_t>(c);
        slot.loading = true;
        slot.unchecked = !L.up_crc.empty();  // checked once its reads are in (finish / check_cluster)
        slot.prefetched = prefetch;
        slot.last_use = clock_;
        where_[li][c] = s;
        batch.slots.push_back(s);
    }
    if (up_reqs.empty()) return 0;
    batch.up = up_file_->submit(up_reqs);
    batch.has_up = true;
    try {
        batch.down = sidecar_->submit(down_reqs);
        batch.has_down = true;
    } catch (...) {
        // the up reads are in flight into these slots: wait for them and drop the slots (finish
        // throws a read failure of its own first), then report the failed submission
        batches_[li].push_back(std::move(batch));
        finish(li, true);
        throw;
    }
    batches_[li].push_back(std::move(batch));
    return bytes;
}

bool NeuronCache::arrived(const Batch & b) const {
    return b.waited || ((!b.has_up || up_file_->poll(b.up)) && (!b.has_down || sidecar_->poll(b.down)));
}

void NeuronCache::await_reads(Batch & b) {
    if (b.waited) return;
    for (int pass = 0; pass < 2; ++pass) {
        if (!(pass == 0 ? b.has_up : b.has_down)) continue;
        try {
            (pass == 0 ? up_file_ : sidecar_)->wait(pass == 0 ? b.up : b.down);
        } catch (const std::exception & e) {
            if (b.error.empty()) b.error = e.what();
        }
    }
    b.waited = true;
}

void NeuronCache::finish(int li, bool check_all) {
    std::vector<Batch> batches;
    batches.swap(batches_[static_cast<size_t>(li)]);
    // In submission order, slot by slot: block until the slot's two reads are in, then check it while
    // the layer's later reads are still in flight. Once every read of the layer is in, the waiting
    // thread stops: what is unchecked is left to the compute threads (check_cluster), or with
    // check_all checked here.
    auto in_flight = [&] {
        for (const Batch & b : batches) {
            if (!arrived(b)) return true;
        }
        return false;
    };
    // slot s of batch b, its reads in: checked, or the mismatch kept in b
    auto check_in = [this](Batch & b, int64_t s) {
        try {
            check_slot(s);
            slots_[s].unchecked = false;
        } catch (const IntegrityError & e) {
            b.error = e.what();
            b.integrity = true;
        }
    };
    bool overlap = true;
    for (Batch & b : batches) {
        for (; overlap && b.next < b.slots.size() && b.error.empty(); ++b.next) {
            const size_t k = b.next;
            const int64_t s = b.slots[k];
            if (!slots_[s].unchecked) continue;
            if (!in_flight()) {
                overlap = false;
                break;
            }
            const bool ok =
                (!b.has_up || up_file_->wait_request(b.up, k)) && (!b.has_down || sidecar_->wait_request(b.down, k));
            if (!ok) break;      // a failed read: wait() below reports it
            if (!in_flight()) {  // that was the layer's last read: nothing left to overlap with
                overlap = false;
                break;
            }
            check_in(b, s);
        }
    }
    std::string error;
    bool integrity = false;  // the error is a failed check, not a failed read
    for (Batch & b : batches) {
        await_reads(b);
        for (size_t k = 0; check_all && b.error.empty() && k < b.slots.size(); ++k) {
            const int64_t s = b.slots[k];
            if (slots_[s].unchecked) check_in(b, s);
        }
        if (error.empty() && !b.error.empty()) {
            error = b.error;
            integrity = b.integrity;
        }
        for (int64_t s : b.slots) {
            Slot & slot = slots_[s];
            slot.loading = false;
            if (!error.empty() && !slot.hot) {  // contents unspecified: forget the cluster
                where_[slot.layer][slot.cluster] = -1;
                slot = Slot{};
            }
        }
    }
    if (integrity) throw IntegrityError(error);
    if (!error.empty()) throw IoError(error);
}

uint64_t NeuronCache::check_slot(int64_t s) {
    const Slot & slot = slots_[s];
    const CacheLayerSource & L = layers_[static_cast<size_t>(slot.layer)];
    if (L.up_crc.empty()) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t C = config_.cluster_size;
    const int64_t first = static_cast<int64_t>(slot.cluster) * C;
    const int64_t n = std::min<int64_t>(C, L.n_ff - first);
    uint64_t bytes = verify_rows(slot_data(s), L.up_row_bytes, first, n, L.up_crc.data(), L.up_source);
    bytes += verify_rows(slot_data(s) + up_part_, L.down_t_row_bytes, first, n, L.down_t_crc.data(), L.down_t_source);
    checked_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    const uint64_t ns = static_cast<uint64_t>(seconds_since(t0) * 1e9);
    check_ns_.fetch_add(ns, std::memory_order_relaxed);
    return ns;
}

void NeuronCache::check_cluster(int li, int32_t cluster) {
    const int64_t s = where_[static_cast<size_t>(li)][static_cast<size_t>(cluster)];
    if (s < 0) return;
    Slot & slot = slots_[s];
    if (!slot.unchecked) return;
    uint64_t ns = 0;
    try {
        ns = check_slot(s);
    } catch (const IntegrityError &) {
        slot.bad = true;
        any_bad_.store(true, std::memory_order_relaxed);
        throw;
    }
    slot.unchecked = false;
    checked_by_compute_.fetch_add(1, std::memory_order_relaxed);
    compute_check_ns_.fetch_add(ns, std::memory_order_relaxed);
}

void NeuronCache::drop_bad_slots() {
    if (!any_bad_.exchange(false)) return;
    for (Slot & slot : slots_) {
        if (!slot.bad) continue;
        where_[slot.layer][slot.cluster] = -1;
        slot = Slot{};
    }
}

void NeuronCache::plan(int li, const uint8_t * needed, LayerPlan & out) {
    const auto t0 = std::chrono::steady_clock::now();
    drop_bad_slots();
    ++clock_;
    ++stats_.plans;
    const int64_t nc = n_clusters(li);
    out.reset(nc);
    std::vector<int32_t> missing;
    for (int64_t c = 0; c < nc; ++c) {
        if (!needed[c]) continue;
        ++stats_.clusters_needed;
        int64_t s = where_[li][c];
        if (s >= 0) {
            Slot & slot = slots_[s];
            if (slot.hot)
                ++stats_.hits_hot;
            else if (slot.prefetched)
                ++stats_.hits_prefetch;
            else
                ++stats_.hits_cold;
            slot.prefetched = false;
            slot.locked = clock_;
            slot.last_use = clock_;
            (slot.loading ? out.pending : out.ready).push_back(static_cast<int32_t>(c));
        } else {
            missing.push_back(static_cast<int32_t>(c));
        }
    }
    // keep lru_ in use order: this plan's cold slots move to the back
    std::stable_partition(lru_.begin(), lru_.end(), [&](int64_t s) { return slots_[s].locked != clock_; });
    std::vector<int64_t> slots;
    for (int32_t c : missing) {
        const int64_t s = take_cold_slot(false);
        if (s < 0) throw std::logic_error("llamaflash neuron cache: no replaceable cold slot (cold region too small)");
        slots_[s].locked = clock_;
        slots.push_back(s);
        out.pending.push_back(c);
    }
    stats_.misses += missing.size();
    stats_.bytes_read += submit(li, missing, slots, false);
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t s = where_[li][c];
        if (needed[c] && s >= 0) {
            out.up[c] = slot_data(s);
            out.down_t[c] = slot_data(s) + up_part_;
        }
    }
    // read-ahead of the next layers (cyclic: the first layer of the next token follows the last)
    const int n_layers = static_cast<int>(layers_.size());
    for (int d = 1; d <= config_.prefetch_layers && d < n_layers + 1; ++d) {
        const int lj = (li + d) % n_layers;
        if (lj == li) break;
        const CacheLayerSource & L = layers_[static_cast<size_t>(lj)];
        std::vector<int32_t> ahead;
        std::vector<int64_t> ahead_slots;
        for (int64_t c = 0; c < n_clusters(lj); ++c) {
            const float p = L.cluster_prob.empty() ? 1.0f : L.cluster_prob[c];
            if (p < config_.prefetch_min_prob || where_[lj][c] >= 0) continue;
            const int64_t s = take_cold_slot(true);
            if (s < 0) break;
            ahead.push_back(static_cast<int32_t>(c));
            ahead_slots.push_back(s);
        }
        stats_.prefetched += ahead.size();
        stats_.bytes_read += submit(lj, ahead, ahead_slots, true);
    }
    stats_.plan_seconds += seconds_since(t0);
}

void NeuronCache::plan_resident(int li, const uint8_t * needed, LayerPlan & out) {
    ++stats_.draft_plans;
    const int64_t nc = n_clusters(li);
    out.reset(nc);
    for (int64_t c = 0; c < nc; ++c) {
        if (!needed[c]) continue;
        ++stats_.draft_clusters_needed;
        const int64_t s = where_[li][c];
        if (s < 0 || slots_[s].loading) continue;
        ++stats_.draft_clusters_resident;
        out.up[c] = slot_data(s);
        out.down_t[c] = slot_data(s) + up_part_;
        out.ready.push_back(static_cast<int32_t>(c));
    }
}

void NeuronCache::wait(int li) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
        finish(li, false);
    } catch (...) {
        stats_.io_wait_seconds += seconds_since(t0);
        throw;
    }
    stats_.io_wait_seconds += seconds_since(t0);
}

size_t NeuronCache::release_cold() {
    bool used = false;
    for (int64_t s = hot_slots_; s < static_cast<int64_t>(slots_.size()); ++s) used = used || slots_[s].layer >= 0;
    for (std::vector<Batch> & layer_batches : batches_) {
        for (Batch & b : layer_batches) await_reads(b);  // a failed read-ahead is dropped with its slots
        used = used || !layer_batches.empty();
        layer_batches.clear();
    }
    if (!used) return 0;
    for (int64_t s = hot_slots_; s < static_cast<int64_t>(slots_.size()); ++s) {
        Slot & slot = slots_[s];
        if (slot.layer >= 0) {
            where_[slot.layer][slot.cluster] = -1;
            if (slot.prefetched) ++stats_.prefetch_unused;
        }
        slot = Slot{};
    }
    const size_t bytes = static_cast<size_t>(config_.cold_slots) * slot_bytes_;
    if (bytes > 0) (void)madvise(slot_data(hot_slots_), bytes, MADV_DONTNEED);
    ++stats_.cold_releases;
    return bytes;
}

NeuronCacheStats NeuronCache::stats() const {
    NeuronCacheStats s = stats_;
    s.verified_bytes = checked_bytes_.load(std::memory_order_relaxed);
    s.verify_seconds = static_cast<double>(check_ns_.load(std::memory_order_relaxed)) * 1e-9;
    s.clusters_checked_by_compute = checked_by_compute_.load(std::memory_order_relaxed);
    s.compute_verify_seconds = static_cast<double>(compute_check_ns_.load(std::memory_order_relaxed)) * 1e-9;
    const FlashReaderStats io = sidecar_->stats();
    s.engine = io.engine;
    s.direct = io.direct && up_file_->direct();
    s.fallback_reason =
        !sidecar_->fallback_reason().empty() ? sidecar_->fallback_reason() : up_file_->fallback_reason();
    return s;
}

void NeuronCache::reset_stats() {
    NeuronCacheStats fresh;
    fresh.hot_slots = stats_.hot_slots;
    fresh.cold_slots = stats_.cold_slots;
    fresh.slot_bytes = stats_.slot_bytes;
    fresh.hot_bytes_loaded = stats_.hot_bytes_loaded;
    stats_ = fresh;
    checked_bytes_ = 0;
    check_ns_ = 0;
    checked_by_compute_ = 0;
    compute_check_ns_ = 0;
}

void NeuronCache::verify() const {
    sidecar_->verify();
    up_file_->verify();
}

}  // namespace llamaflash
