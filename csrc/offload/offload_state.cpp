// offload_state.cpp — see offload_state.h.
#include "offload/offload_state.h"

#include "model/weight_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace llamaflash {

namespace {

NeuronCacheConfig cache_config(const EngineConfig & config) {
    const OffloadConfig & o = *config.offload;
    NeuronCacheConfig c;
    c.cluster_size = config.sparse.cluster_size;
    c.cold_slots = o.cold_slots;
    c.prefetch_layers = o.prefetch_layers;
    c.prefetch_min_prob = o.prefetch_min_prob;
    c.io.queue_depth = o.queue_depth;
    c.io.direct = o.direct;
    c.io.engine = parse_io_engine(o.engine);
    return c;
}

// The layer stream over every served layer's base rows (gate only when streamed), checked against the
// store's checksums when it verifies.
std::unique_ptr<LayerStream> open_layer_stream(const EngineConfig & config, const WeightStore & store) {
    const OffloadConfig & o = *config.offload;
    std::vector<StreamLayerSource> sources(config.layers.size());
    for (size_t p = 0; p < sources.size(); ++p) {
        const LayerSpec & s = config.layers[p];
        StreamLayerSource & src = sources[p];
        src.layer = s.layer;
        const auto part = [&](StreamPart & dst, RowSet set, uint64_t offset, int64_t rows, uint64_t row_bytes) {
            dst.offset = offset;
            dst.rows = rows;
            dst.row_bytes = row_bytes;
            if (store.verifying()) {
                const LayerChecksums & sums = store.checksums(p);
                dst.crc = set == RowSet::base_gate ? sums.base_gate
                          : set == RowSet::base_up ? sums.base_up
                                                   : sums.base_down;
                dst.source = row_source(s, set, config.sidecar_path, config.base_path);
            }
        };
        if (o.stream_gate) part(src.gate, RowSet::base_gate, s.base_gate_offset, s.n_ff, s.gate_row_bytes);
        part(src.up, RowSet::base_up, s.base_up_offset, s.n_ff, s.up_row_bytes);
        part(src.down, RowSet::base_down, s.base_down_offset, s.n_embd, s.base_down_row_bytes);
    }
    LayerStreamConfig c;
    c.hot = o.hot_layers;
    c.cold_slots = o.cold_slots;
    c.prefetch_layers = o.prefetch_layers;
    c.io = cache_config(config).io;
    return std::make_unique<LayerStream>(config.base_path, std::move(sources), c);
}

}  // namespace

OffloadState::OffloadState(const EngineConfig & config, const WeightStore & store)
    : stream_gate_(config.offload->stream_gate) {
    const std::vector<LayerSpec> & layers = config.layers;
    const OffloadConfig & o = *config.offload;
    const size_t n = layers.size();
    if (o.stream_layers) {
        if (!store.dense_loaded()) {
            throw std::logic_error("llamaflash: the layer stream needs the dense weights loaded");
        }
        stream_ = open_layer_stream(config, store);
        return;
    }
    if (!store.dense_loaded() || !store.sparse_loaded()) {
        throw std::logic_error("llamaflash: the offload state needs the dense weights and sparse views loaded");
    }
    std::vector<CacheLayerSource> sources(n);
    for (size_t p = 0; p < n; ++p) {
        const LayerSpec & s = layers[p];
        if (!store.sparse_view(p).base_order) {
            throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) +
                                        ": flash offload needs a sidecar in base neuron order (the gate values come "
                                        "from the base gate matrix); re-convert without --order hot");
        }
        CacheLayerSource & src = sources[p];
        src.layer = s.layer;
        src.n_ff = s.n_ff;
        src.up_offset = s.base_up_offset;
        src.up_row_bytes = s.up_row_bytes;
        src.down_t_offset = s.down_t_offset;
        src.down_t_row_bytes = s.down_t_row_bytes;
        src.hot = o.hot[p];
        src.cluster_prob = o.cluster_prob[p];
        if (store.verifying()) {  // every read checked before its cluster is computed (neuron_cache.h)
            src.up_crc = store.checksums(p).base_up;
            src.down_t_crc = store.checksums(p).down_t;
            src.up_source = row_source(s, RowSet::base_up, config.sidecar_path, config.base_path);
            src.down_t_source = row_source(s, RowSet::down_t, config.sidecar_path, config.base_path);
        }
    }
    cache_ =
        std::make_unique<NeuronCache>(config.sidecar_path, config.base_path, std::move(sources), cache_config(config));

    // next served layer by layer id, cyclic (after the last comes the first, for the next token)
    std::vector<size_t> by_id(n);
    std::iota(by_id.begin(), by_id.end(), size_t{0});
    std::sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return layers[a].layer < layers[b].layer; });
    next_.assign(n, 0);
    for (size_t k = 0; k < n; ++k) {
        next_[by_id[k]] = static_cast<int>(by_id[(k + 1) % n]);
    }

    // the prefill views of up and down (and gate when streamed), released after every dense split of
    // their layer; a streamed gate is also released after each sparse split
    streamed_.assign(n, {});
    gate_.assign(n, {});
    for (size_t p = 0; p < n; ++p) {
        const LayerSpec & s = layers[p];
        const uint64_t gate_bytes = static_cast<uint64_t>(s.n_ff) * s.gate_row_bytes;
        std::vector<std::pair<uint64_t, uint64_t>> views = {
            {s.base_up_offset, static_cast<uint64_t>(s.n_ff) * s.up_row_bytes},
            {s.base_down_offset, static_cast<uint64_t>(s.n_embd) * s.base_down_row_bytes}};
        if (stream_gate_) {
            views.emplace_back(s.base_gate_offset, gate_bytes);
            streamed_gate_bytes_ += gate_bytes;
        }
        for (auto [offset, length] : views) {
            const MappedFile * map = store.base_region(offset);
            if (map == nullptr) {
                continue;
            }
            Region r{map, offset, length};
            if (store.verifying()) {
                const RowSet set = offset == s.base_up_offset     ? RowSet::base_up
                                   : offset == s.base_down_offset ? RowSet::base_down
                                                                  : RowSet::base_gate;
                const LayerChecksums & c = store.checksums(p);
                r.expected = set == RowSet::base_up     ? &c.base_up
                             : set == RowSet::base_down ? &c.base_down
                                                        : &c.base_gate;
                r.source = row_source(s, set, config.sidecar_path, config.base_path);
            }
            streamed_[p].push_back(r);
            if (stream_gate_ && offset == s.base_gate_offset) {
                gate_[p].push_back(r);
            }
        }
    }
    base_file_ = std::make_unique<FileReader>(config.base_path);
    if (o.draft_copy) {
        load_draft_copy(config, store.verifying());
    }
}

uint64_t draft_copy_tensor_bytes(int64_t n_ff, uint64_t draft_row_bytes) {
    return (static_cast<uint64_t>(n_ff) * draft_row_bytes + kDraftCopyAlign - 1) / kDraftCopyAlign * kDraftCopyAlign;
}

void OffloadState::load_draft_copy(const EngineConfig & config, bool verify) {
    size_t total = 0;
    for (const LayerSpec & s : config.layers) {
        total += 2 * draft_copy_tensor_bytes(s.n_ff, s.draft_row_bytes);
    }
    draft_copy_ = AlignedBuffer(total, kDraftCopyAlign);
    FileReader sidecar(config.sidecar_path);
    size_t at = 0;
    draft_rows_.resize(config.layers.size());
    for (size_t p = 0; p < config.layers.size(); ++p) {
        const LayerSpec & s = config.layers[p];
        const uint64_t bytes = static_cast<uint64_t>(s.n_ff) * s.draft_row_bytes;
        DraftRows & r = draft_rows_[p];
        r.type = s.draft_type;
        r.row_bytes = s.draft_row_bytes;
        std::vector<uint32_t> table;  // [n_ff][2]: draft up, draft down_t row checksums
        if (verify && s.draft_checksum_offset != 0) {
            table.resize(2 * static_cast<size_t>(s.n_ff));
            sidecar.read_exact(table.data(), table.size() * sizeof(uint32_t), s.draft_checksum_offset);
        }
        const RowSet sets[2] = {RowSet::draft_up, RowSet::draft_down_t};
        const uint8_t ** dsts[2] = {&r.up, &r.down_t};
        for (int col = 0; col < 2; ++col) {
            const RowSource src = row_source(s, sets[col], config.sidecar_path, config.base_path);
            sidecar.read_exact(draft_copy_.data() + at, bytes, src.offset);  // IoError: truncated or unreadable
            sidecar.drop_cache(src.offset, bytes);  // resident once, in the copy, not also in the page cache
            if (!table.empty()) {                   // IntegrityError: a draft never computes from unverified bytes
                std::vector<uint32_t> expected(static_cast<size_t>(s.n_ff));
                for (size_t k = 0; k < expected.size(); ++k) expected[k] = table[2 * k + col];
                verify_rows(draft_copy_.data() + at, s.draft_row_bytes, 0, s.n_ff, expected.data(), src);
            }
            *dsts[col] = draft_copy_.data() + at;
            at += draft_copy_tensor_bytes(s.n_ff, s.draft_row_bytes);
        }
    }
}

OffloadState::~OffloadState() = default;

void OffloadState::load_hot() {
    if (cache_) cache_->load_hot();
    if (stream_) stream_->load_hot();
}

void OffloadState::verify_files() const {
    if (cache_) cache_->verify();
    if (stream_) stream_->verify();
}

void OffloadState::release(const Region & r) const {
    (void)madvise(r.map->mapping(), r.map->mapping_size(), MADV_DONTNEED);
    base_file_->drop_cache(r.offset, r.length);  // advice: pages mapped elsewhere stay
}

bool OffloadState::check(const Region & r) {
    if (r.expected == nullptr || r.expected->empty()) return true;
    try {
        verify_rows(r.map->data(), r.source.row_bytes, 0, static_cast<int64_t>(r.expected->size()), r.expected->data(),
                    r.source);
    } catch (const IntegrityError & e) {
        set_error(e.what());
        return false;
    }
    return true;
}

bool OffloadState::before_split(int pos, bool sparse, bool prompt_batch) {
    if (pos < 0) {
        return true;
    }
    if (prompt_batch && cache_) {
        cache_->release_cold();
    }
    bool ok = true;
    for (const Region & r : sparse ? gate_[pos] : streamed_[pos]) {
        ok = ok && check(r);
    }
    if (sparse) {
        for (const Region & r : gate_[next_[pos]]) {
            (void)madvise(r.map->mapping(), r.map->mapping_size(), MADV_WILLNEED);
        }
    }
    return ok;
}

bool OffloadState::after_split(int pos, bool sparse, const std::string & failure) {
    if (pos >= 0) {
        for (const Region & r : sparse ? gate_[pos] : streamed_[pos]) {
            release(r);
        }
    }
    if (!failure.empty()) {
        set_error(failure);
        return false;
    }
    return true;
}

void OffloadState::set_error(const std::string & message) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_.empty()) {
        error_ = message;
    }
}

std::string OffloadState::take_error() {
    std::lock_guard<std::mutex> lock(error_mutex_);
    std::string out;
    out.swap(error_);
    return out;
}

}  // namespace llamaflash
