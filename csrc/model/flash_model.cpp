// flash_model.cpp — see flash_model.h.
#include "model/flash_model.h"

#include <stdexcept>

namespace llamaflash {

namespace {

std::vector<int> layer_ids(const std::vector<LayerSpec> & layers) {
    std::vector<int> out;
    for (const LayerSpec & s : layers) {
        out.push_back(s.layer);
    }
    return out;
}

}  // namespace

FlashModel::FlashModel(const EngineConfig & config)
    : layers_(config.layers),
      store_(config.layers, config.sidecar_path, config.base_path, config.verify),
      stats_(layer_ids(config.layers)),
      activation_(parse_ffn_activation(config.activation)) {
    for (size_t p = 0; p < layers_.size(); ++p) {
        index_.emplace(layers_[p].layer, p);
    }
}

FlashModel::~FlashModel() = default;

std::shared_ptr<FlashModel> FlashModel::open(EngineConfig config) {
    config.validate();
    std::shared_ptr<FlashModel> model(new FlashModel(config));
    // opened first: check_files compares against the files as they were when loading began
    model->sidecar_watch_ = std::make_unique<FileReader>(config.sidecar_path);
    model->base_watch_ = std::make_unique<FileReader>(config.base_path);
    const bool offload = config.offload.has_value();
    model->store_.load_dense(offload, offload && config.offload->stream_gate, config.repack,
                             !(offload && config.offload->stream_layers));
    if (config.sparse.enabled) {
        model->store_.load_sparse(model->activation_, offload);
    }
    if (offload) {
        model->offload_ = std::make_unique<OffloadState>(config, model->store_);
        model->offload_->load_hot();
    }
    model->set_sparse_config(config.sparse);
    return model;
}

int FlashModel::layer_position(int layer) const {
    auto it = index_.find(layer);
    return it == index_.end() ? -1 : static_cast<int>(it->second);
}

ggml_tensor * FlashModel::dense_weight(int layer, FfnWeightKind kind) const {
    const int pos = layer_position(layer);
    return pos < 0 ? nullptr : store_.dense_weight(static_cast<size_t>(pos), kind);
}

ggml_tensor * FlashModel::fused_gate_up(int layer) const {
    const int pos = layer_position(layer);
    return pos < 0 ? nullptr : store_.fused_gate_up(static_cast<size_t>(pos));
}

void FlashModel::set_thresholds(const std::vector<float> & thresholds) {
    if (thresholds.size() != layers_.size()) {
        throw std::invalid_argument("llamaflash: " + std::to_string(thresholds.size()) + " thresholds for " +
                                    std::to_string(layers_.size()) + " served layers");
    }
    for (size_t p = 0; p < layers_.size(); ++p) {
        layers_[p].threshold = thresholds[p];
    }
}

std::vector<float> FlashModel::thresholds() const {
    std::vector<float> out;
    for (const LayerSpec & s : layers_) {
        out.push_back(s.threshold);
    }
    return out;
}

float FlashModel::threshold(int layer) const {
    const int pos = layer_position(layer);
    return pos < 0 ? -1.0f : layers_[static_cast<size_t>(pos)].threshold;
}

void FlashModel::set_sparse_config(const SparseConfig & config) {
    validate_sparse_config(config);
    if (config.enabled && !store_.sparse_loaded()) {
        throw std::invalid_argument("llamaflash: the sparse lane is not loaded (open the model with sparse.enabled)");
    }
    sparse_config_ = config;
}

const SparseLayerView * FlashModel::sparse_layer(int layer) const {
    if (!sparse_config_.enabled || !store_.sparse_loaded()) {
        return nullptr;
    }
    const int pos = layer_position(layer);
    if (pos < 0 || layers_[static_cast<size_t>(pos)].threshold < 0.0f) {
        return nullptr;
    }
    return &store_.sparse_view(static_cast<size_t>(pos));
}

void FlashModel::check_files() {
    sidecar_watch_->check_size();
    base_watch_->check_size();
    for (FileReader * f : {sidecar_watch_.get(), base_watch_.get()}) {
        if (!f->modified()) continue;
        if (!store_.verifying()) {
            throw IoError("'" + f->path() +
                          "' changed while in use: it was modified (its bytes are not checked: the "
                          "sidecar has no checksums, or flash_verify is off); restore the file or re-create it "
                          "(llamaflash convert --force), then load the model again");
        }
        if (!offload_) store_.recheck_mapped();
        f->accept_modified();
    }
}

std::string FlashModel::take_error() { return offload_ ? offload_->take_error() : std::string(); }

void FlashModel::set_non_finite(const std::string & message) {
    std::lock_guard<std::mutex> lock(non_finite_mutex_);
    if (non_finite_.empty()) non_finite_ = message;
}

std::string FlashModel::take_non_finite() {
    std::lock_guard<std::mutex> lock(non_finite_mutex_);
    std::string out;
    out.swap(non_finite_);
    return out;
}

}  // namespace llamaflash
