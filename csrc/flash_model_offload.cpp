// flash_model_offload.cpp — FlashModel's flash-offload part (see "Flash offload" in flash_model.h):
// the neuron cache that serves the sparse lane, prefill streaming, and errors raised inside computes.
#include "flash_model.h"

#include <sys/mman.h>

#include <stdexcept>
#include <vector>

namespace llamaflash {

void FlashModel::set_offload_layout(bool offload, bool stream_gate) {
    if (dense_loaded_ && (offload != offload_layout_ || stream_gate != stream_gate_)) {
        throw std::logic_error("llamaflash: the offload layout must be chosen before load_dense_weights()");
    }
    if (stream_gate && !offload) {
        throw std::invalid_argument("llamaflash: stream_gate needs the offload layout");
    }
    offload_layout_ = offload;
    stream_gate_ = stream_gate;
}

int FlashModel::next_layer(int layer) const {
    auto it = index_.upper_bound(layer);
    if (it == index_.end()) {
        it = index_.begin();
    }
    return it == index_.end() ? -1 : it->first;
}

void FlashModel::stream_gate_ahead(int layer) {
    auto it = gate_streamed_.find(layer);
    if (it != gate_streamed_.end()) {
        (void) madvise(it->second.map->mapping(), it->second.map->mapping_size(), MADV_WILLNEED);
    }
}

void FlashModel::release_gate(int layer) {
    auto it = gate_streamed_.find(layer);
    if (it != gate_streamed_.end()) {
        (void) madvise(it->second.map->mapping(), it->second.map->mapping_size(), MADV_DONTNEED);
        base_file_->drop_cache(it->second.offset, it->second.length);
    }
}

int FlashModel::layer_position(int layer) const {
    auto it = index_.find(layer);
    return it == index_.end() ? -1 : static_cast<int>(it->second);
}

void FlashModel::enable_offload(std::vector<CacheLayerSource> sources, const NeuronCacheConfig & config) {
    if (!offload_layout_ || !dense_loaded_ || sparse_.empty()) {
        throw std::logic_error("llamaflash: enable_offload() needs set_offload_layout(true), load_dense_weights() "
                               "and load_sparse() first");
    }
    if (sources.size() != layers_.size()) {
        throw std::invalid_argument("llamaflash: " + std::to_string(sources.size()) + " cache sources for " +
                                    std::to_string(layers_.size()) + " served layers");
    }
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        if (!sparse_[li].base_order) {
            throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) +
                                        ": flash offload needs a sidecar in base neuron order (the gate values come "
                                        "from the base gate matrix); re-convert without --order hot");
        }
        CacheLayerSource & src = sources[li];
        src.layer = s.layer;
        src.n_ff = s.n_ff;
        src.up_offset = s.base_up_offset;
        src.up_row_bytes = s.up_row_bytes;
        src.down_t_offset = s.down_t_offset;
        src.down_t_row_bytes = s.down_t_row_bytes;
    }
    std::unique_ptr<NeuronCache> cache = std::make_unique<NeuronCache>(sidecar_path_, base_path_, std::move(sources), config);
    // the prefill views of up and down (and gate when streamed), released after every dense split of
    // their layer; a streamed gate is also released after each decode split (release_gate)
    streamed_.clear();
    gate_streamed_.clear();
    for (const LayerSpec & s : layers_) {
        const uint64_t up_bytes = static_cast<uint64_t>(s.n_ff) * s.up_row_bytes;
        const uint64_t down_bytes = static_cast<uint64_t>(s.n_embd) * s.base_down_row_bytes;
        std::vector<std::pair<uint64_t, uint64_t>> views = {{s.base_up_offset, up_bytes}, {s.base_down_offset, down_bytes}};
        if (stream_gate_) {
            views.emplace_back(s.base_gate_offset, static_cast<uint64_t>(s.n_ff) * s.gate_row_bytes);
        }
        for (auto [offset, length] : views) {
            auto it = regions_.find({1, offset});
            if (it == regions_.end()) {
                continue;
            }
            streamed_[s.layer].push_back({it->second, offset, length});
            if (stream_gate_ && offset == s.base_gate_offset) {
                gate_streamed_[s.layer] = {it->second, offset, length};
            }
        }
    }
    base_file_ = std::make_unique<FileReader>(base_path_);
    cache_ = std::move(cache);
}

void FlashModel::load_hot() {
    if (!cache_) {
        throw std::logic_error("llamaflash: load_hot() without a neuron cache (enable_offload first)");
    }
    cache_->load_hot();
}

void FlashModel::release_streamed(int layer) {
    auto it = streamed_.find(layer);
    if (it == streamed_.end()) {
        return;
    }
    for (const StreamedRegion & r : it->second) {
        (void) madvise(r.map->mapping(), r.map->mapping_size(), MADV_DONTNEED);
        base_file_->drop_cache(r.offset, r.length);  // advice: pages mapped elsewhere stay
    }
}

void FlashModel::set_error(const std::string & message) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_.empty()) {
        error_ = message;
    }
}

std::string FlashModel::take_error() {
    std::lock_guard<std::mutex> lock(error_mutex_);
    std::string out;
    out.swap(error_);
    return out;
}

}  // namespace llamaflash
