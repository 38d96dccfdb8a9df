// flash_model.cpp — see flash_model.h.
#include "flash_model.h"

#include "file_reader.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace llamaflash {

namespace {

// The buffer type stock llama.cpp would pick for a CPU weight used by MUL_MAT: the first CPU "extra"
// buffer type (repacked layouts such as Q4_K 8x8) whose device accepts the op, else plain CPU memory.
ggml_backend_buffer_type_t pick_cpu_weight_buft(ggml_tensor * w) {
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu_dev == nullptr) {
        throw std::runtime_error("llamaflash: ggml has no CPU device");
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra != nullptr) {
        ggml_init_params params = {ggml_tensor_overhead() * 4, nullptr, true};
        ggml_context * ctx = ggml_init(params);
        ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 512);
        ggml_tensor * op = ggml_mul_mat(ctx, w, b);
        for (ggml_backend_buffer_type_t * p = get_extra(cpu_dev); p != nullptr && *p != nullptr; ++p) {
            w->buffer = ggml_backend_buft_alloc_buffer(*p, 0);
            const bool ok = ggml_backend_dev_supports_op(cpu_dev, op);
            ggml_backend_buffer_free(w->buffer);
            w->buffer = nullptr;
            if (ok) {
                ggml_free(ctx);
                return *p;
            }
        }
        ggml_free(ctx);
    }
    return ggml_backend_cpu_buffer_type();
}

void check_row_bytes(const LayerSpec & s, ggml_type type, int64_t n, uint64_t row_bytes, const char * what) {
    const size_t expect = ggml_row_size(type, n);
    if (expect != row_bytes) {
        throw std::runtime_error("llamaflash: layer " + std::to_string(s.layer) + " " + what + " row is " +
                                 std::to_string(row_bytes) + " bytes in the sidecar, but a " + ggml_type_name(type) +
                                 " row of " + std::to_string(n) + " values is " + std::to_string(expect) +
                                 " bytes; the sidecar does not match this model: re-convert it");
    }
}

}  // namespace

FlashModel::FlashModel(std::vector<LayerSpec> layers, std::string sidecar_path, std::string base_path)
    : layers_(std::move(layers)), sidecar_path_(std::move(sidecar_path)), base_path_(std::move(base_path)) {
    for (size_t i = 0; i < layers_.size(); ++i) {
        const LayerSpec & s = layers_[i];
        if (!index_.emplace(s.layer, i).second) {
            throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) + " listed twice");
        }
        if (s.n_embd <= 0 || s.n_ff <= 0) {
            throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) + " has empty FFN shape");
        }
        for (ggml_type t : {s.gate_type, s.up_type, s.down_type, s.down_t_type}) {
            if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0) {
                throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) + " has unknown ggml type " +
                                            std::to_string(int(t)));
            }
        }
        check_row_bytes(s, s.gate_type, s.n_embd, s.gate_row_bytes, "gate");
        check_row_bytes(s, s.up_type, s.n_embd, s.up_row_bytes, "up");
        check_row_bytes(s, s.down_type, s.n_ff, s.base_down_row_bytes, "base down");
        if (s.bundle_stride < s.gate_row_bytes + s.up_row_bytes) {
            throw std::invalid_argument("llamaflash: layer " + std::to_string(s.layer) + " bundle stride too small");
        }
    }
}

FlashModel::~FlashModel() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    if (ctx_ != nullptr) {
        ggml_free(ctx_);
    }
}

// Placement of each dense weight, mirroring what stock llama.cpp does with the base GGUF:
//  - the CPU backend has a repacked layout for it (e.g. Q4_K 8x8): an anonymous repacked copy;
//  - otherwise a view into a read-only shared mapping (page cache, nothing copied): down into the
//    base GGUF, gate/up into the sidecar bundles (row stride = bundle stride) when the bundles are in
//    base order and the stride is a whole number of type blocks;
//  - otherwise (hot-first bundle order) a plain copy gathered back into base order.
void FlashModel::load_dense_weights() {
    if (dense_loaded_) {
        return;
    }
    FileReader sidecar(sidecar_path_);
    FileReader base(base_path_);
    ggml_backend_buffer_type_t plain = ggml_backend_cpu_buffer_type();

    std::vector<std::vector<int32_t>> orders(layers_.size());
    std::vector<bool> identity(layers_.size(), true);
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        const size_t n_ff = static_cast<size_t>(s.n_ff);
        std::vector<int32_t> & order = orders[li];
        order.resize(n_ff);
        sidecar.read_exact(order.data(), n_ff * sizeof(int32_t), s.order_offset);
        std::vector<bool> seen(n_ff, false);
        for (size_t k = 0; k < n_ff; ++k) {
            const int32_t o = order[k];
            if (o < 0 || static_cast<size_t>(o) >= n_ff || seen[o]) {
                throw std::runtime_error("llamaflash: '" + sidecar_path_ + "' layer " + std::to_string(s.layer) +
                                         ": neuron order is not a permutation (corrupt sidecar); re-convert it");
            }
            seen[o] = true;
            identity[li] = identity[li] && static_cast<size_t>(o) == k;
        }
        sidecar.check_range(s.bundle_offset, n_ff * s.bundle_stride);
        base.check_range(s.base_down_offset, static_cast<uint64_t>(s.n_embd) * s.base_down_row_bytes);
        if (offload_layout_) {
            base.check_range(s.base_up_offset, n_ff * s.up_row_bytes);
        }
        if (stream_gate_) {
            base.check_range(s.base_gate_offset, n_ff * s.gate_row_bytes);
        }
    }

    ggml_init_params params = {ggml_tensor_overhead() * (4 * layers_.size() + 1), nullptr, true};
    ctx_ = ggml_init(params);
    weights_.clear();
    std::map<ggml_backend_buffer_type_t, std::vector<ggml_tensor *>> copies;
    // (tensor, absolute file offset of its first byte) for tensors used in place from a file mapping
    std::vector<std::pair<ggml_tensor *, uint64_t>> views_sidecar, views_base;
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        ggml_tensor * gate = ggml_new_tensor_2d(ctx_, s.gate_type, s.n_embd, s.n_ff);
        ggml_tensor * up = ggml_new_tensor_2d(ctx_, s.up_type, s.n_embd, s.n_ff);
        ggml_tensor * down = ggml_new_tensor_2d(ctx_, s.down_type, s.n_ff, s.n_embd);
        ggml_format_name(gate, "llamaflash.blk.%d.ffn_gate", s.layer);
        ggml_format_name(up, "llamaflash.blk.%d.ffn_up", s.layer);
        ggml_format_name(down, "llamaflash.blk.%d.ffn_down", s.layer);
        for (int kind = 0; kind < 3; ++kind) {
            ggml_tensor * t = kind == 0 ? gate : kind == 1 ? up : down;
            weights_.push_back(t);
            ggml_backend_buffer_type_t buft = repack_ ? pick_cpu_weight_buft(t) : plain;
            if (offload_layout_) {  // gate resident (or streamed), up and down streamed from the base file
                if (kind == 0 && !stream_gate_) {
                    copies[buft].push_back(t);
                } else {
                    views_base.emplace_back(t, kind == 0 ? s.base_gate_offset : kind == 1 ? s.base_up_offset
                                                                                          : s.base_down_offset);
                }
            } else if (buft != plain) {
                copies[buft].push_back(t);
            } else if (kind == 2) {
                views_base.emplace_back(t, s.base_down_offset);
            } else if (identity[li] && s.bundle_stride % ggml_type_size(t->type) == 0) {
                t->nb[1] = s.bundle_stride;
                t->nb[2] = t->nb[3] = s.bundle_stride * static_cast<size_t>(s.n_ff);
                const uint64_t at = s.bundle_offset + (kind == 1 ? s.gate_row_bytes : 0);
                views_sidecar.emplace_back(t, at);
            } else {
                copies[plain].push_back(t);
            }
        }
        // Both gate and up used in place from unpadded bundles of one type: the bundle region is also
        // one contiguous matrix of 2·n_ff rows (gate_0, up_0, gate_1, up_1, ...), which the dense lane
        // multiplies in a single streaming pass (see DenseLane).
        const bool gate_view = !views_sidecar.empty() && views_sidecar.back().first == up &&
                               views_sidecar.size() >= 2 && views_sidecar[views_sidecar.size() - 2].first == gate;
        fused_.push_back(nullptr);
        if (gate_view && s.gate_type == s.up_type && s.bundle_stride == s.gate_row_bytes + s.up_row_bytes) {
            ggml_tensor * both = ggml_new_tensor_2d(ctx_, s.gate_type, s.n_embd, 2 * s.n_ff);
            ggml_format_name(both, "llamaflash.blk.%d.ffn_gate_up", s.layer);
            fused_.back() = both;
            views_sidecar.emplace_back(both, s.bundle_offset);
        }
    }

    // views: tensors whose data lives in a read-only shared mapping of the file
    // Views map just the byte range they cover (a layer's bundle region is mapped once for both gate
    // and up): a whole-file mapping would let the kernel's fault-around map neighbouring tensors'
    // pages too (measured: +16 MB RSS on SmolLM2-135M), and two mappings of the same pages would
    // count them twice.
    auto place_views = [&](std::vector<std::pair<ggml_tensor *, uint64_t>> & views, int file, auto region_of) {
        std::map<uint64_t, ggml_backend_buffer_t> buffers;  // region offset -> buffer over its mapping
        for (auto & [t, offset] : views) {
            const auto [region_offset, region_bytes] = region_of(t, offset);
            const uint8_t * data = map_region(file, region_offset, region_bytes);
            auto it = buffers.find(region_offset);
            if (it == buffers.end()) {
                const MappedFile * map = regions_.at({file, region_offset});
                ggml_backend_buffer_t buf = ggml_backend_cpu_buffer_from_ptr(map->mapping(), map->mapping_size());
                ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
                buffers_.push_back(buf);
                it = buffers.emplace(region_offset, buf).first;
            }
            ggml_backend_tensor_alloc(it->second, t, const_cast<uint8_t *>(data) + (offset - region_offset));
        }
    };
    std::map<const ggml_tensor *, const LayerSpec *> spec_of;
    for (size_t li = 0; li < layers_.size(); ++li) {
        for (int kind = 0; kind < 3; ++kind) {
            spec_of[weights_[3 * li + kind]] = &layers_[li];
        }
        if (fused_[li] != nullptr) {
            spec_of[fused_[li]] = &layers_[li];
        }
    }
    place_views(views_sidecar, 0, [&](const ggml_tensor * t, uint64_t) {
        const LayerSpec & s = *spec_of.at(t);
        return std::make_pair(s.bundle_offset, static_cast<uint64_t>(s.n_ff) * s.bundle_stride);
    });
    place_views(views_base, 1, [&](const ggml_tensor * t, uint64_t offset) {
        return std::make_pair(offset, static_cast<uint64_t>(ggml_nbytes(t)));
    });

    // copies: one buffer per buffer type, tensors placed with ggml's linear allocator
    for (auto & [buft, tensors] : copies) {
        const size_t align = ggml_backend_buft_get_alignment(buft);
        size_t total = 0;
        for (ggml_tensor * t : tensors) {
            total += GGML_PAD(ggml_backend_buft_get_alloc_size(buft, t), align);
        }
        ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, total + align);
        if (buf == nullptr) {
            throw std::runtime_error("llamaflash: cannot allocate " + std::to_string(total >> 20) + " MiB for FFN weights");
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        buffers_.push_back(buf);
        copied_bytes_ += ggml_backend_buffer_get_size(buf);
        ggml_tallocr alloc = ggml_tallocr_new(buf);
        for (ggml_tensor * t : tensors) {
            if (ggml_tallocr_alloc(&alloc, t) != GGML_STATUS_SUCCESS) {
                throw std::runtime_error("llamaflash: allocation of FFN weight failed");
            }
        }
    }

    auto is_copy = [&](const ggml_tensor * t) {
        for (auto & [buft, tensors] : copies) {
            for (const ggml_tensor * c : tensors) {
                if (c == t) {
                    return true;
                }
            }
        }
        return false;
    };

    std::vector<uint8_t> bundles, matrix;
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        const size_t n_ff = static_cast<size_t>(s.n_ff);
        const std::vector<int32_t> & order = orders[li];
        const bool copy_gate = is_copy(weights_[3 * li]);
        const bool copy_up = is_copy(weights_[3 * li + 1]);
        if (copy_gate || copy_up) {
            bundles.resize(n_ff * s.bundle_stride);
            sidecar.read_exact(bundles.data(), bundles.size(), s.bundle_offset);
            // gather bundle k back to base row order[k]
            for (int part = 0; part < 2; ++part) {
                if (!(part == 0 ? copy_gate : copy_up)) {
                    continue;
                }
                const uint64_t row = part == 0 ? s.gate_row_bytes : s.up_row_bytes;
                const uint64_t skip = part == 0 ? 0 : s.gate_row_bytes;
                matrix.resize(n_ff * row);
                for (size_t k = 0; k < n_ff; ++k) {
                    std::memcpy(matrix.data() + static_cast<size_t>(order[k]) * row,
                                bundles.data() + k * s.bundle_stride + skip, row);
                }
                ggml_backend_tensor_set(weights_[3 * li + part], matrix.data(), 0, matrix.size());
            }
            sidecar.drop_cache(s.bundle_offset, bundles.size());
        }
        if (is_copy(weights_[3 * li + 2])) {
            const size_t down_bytes = static_cast<size_t>(s.n_embd) * s.base_down_row_bytes;
            matrix.resize(down_bytes);
            base.read_exact(matrix.data(), down_bytes, s.base_down_offset);
            ggml_backend_tensor_set(weights_[3 * li + 2], matrix.data(), 0, down_bytes);
        }
    }
    dense_loaded_ = true;
}

const uint8_t * FlashModel::map_region(int file, uint64_t offset, uint64_t length) {
    auto it = regions_.find({file, offset});
    if (it != regions_.end()) {
        if (it->second->size() < length) {
            throw std::logic_error("llamaflash: region mapped twice with different lengths");
        }
        return it->second->data();
    }
    maps_.push_back(std::make_unique<MappedFile>(file == 0 ? sidecar_path_ : base_path_, offset, length));
    regions_.emplace(std::make_pair(file, offset), maps_.back().get());
    return maps_.back()->data();
}

// The kernel's views: a layer's bundle region is the same mapping the dense lane's gate/up views use
// (when it has them), so pages are shared, never counted twice; down_t rows get a mapping per layer.
void FlashModel::load_sparse(const std::string & activation) {
    if (!dense_loaded_) {
        throw std::logic_error("llamaflash: load_dense_weights() must run before load_sparse()");
    }
    if (!sparse_.empty()) {
        return;
    }
    activation_ = parse_ffn_activation(activation);
    FileReader sidecar(sidecar_path_);
    std::vector<SparseLayerView> views(layers_.size());
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        SparseLayerView & v = views[li];
        SparseFfnLayer & k = v.kernel;
        check_row_bytes(s, s.down_t_type, s.n_embd, s.down_t_row_bytes, "down_t");
        sidecar.check_range(s.down_t_offset, static_cast<uint64_t>(s.n_ff) * s.down_t_row_bytes);
        k.n_embd = s.n_embd;
        k.n_ff = s.n_ff;
        // offload layout: no mappings; the lane points the kernel at the neuron cache's slots per
        // call (the placeholder only satisfies validation until then)
        static const uint8_t * const kNoSlots[1] = {nullptr};
        if (offload_layout_) {
            k.up_slots = k.down_t_slots = kNoSlots;
        } else {
            k.bundles = map_region(0, s.bundle_offset, static_cast<uint64_t>(s.n_ff) * s.bundle_stride);
        }
        k.bundle_stride = s.bundle_stride;
        k.gate_type = s.gate_type;
        k.up_type = s.up_type;
        k.gate_row_bytes = s.gate_row_bytes;
        k.up_row_bytes = s.up_row_bytes;
        if (!offload_layout_) {
            k.down_t = map_region(0, s.down_t_offset, static_cast<uint64_t>(s.n_ff) * s.down_t_row_bytes);
        }
        k.down_t_type = s.down_t_type;
        k.down_t_row_bytes = s.down_t_row_bytes;
        k.activation = activation_;
        sparse_ffn_validate(k);
        std::vector<int32_t> order(static_cast<size_t>(s.n_ff));
        sidecar.read_exact(order.data(), order.size() * sizeof(int32_t), s.order_offset);
        for (size_t i = 0; i < order.size() && v.base_order; ++i) {
            v.base_order = order[i] == static_cast<int32_t>(i);
        }
        if (v.base_order && !offload_layout_) {
            // the base file's up rows: contiguous, so a thread's run of active neurons is one stream
            // (the bundles interleave gate rows, which the gate-by-ggml path never needs)
            k.up_rows = map_region(1, s.base_up_offset, static_cast<uint64_t>(s.n_ff) * s.up_row_bytes);
            k.up_stride = s.up_row_bytes;
        }
    }
    layer_sparse_tokens_.reset(new std::atomic<uint64_t>[layers_.size()]());
    layer_active_.reset(new std::atomic<uint64_t>[layers_.size()]());
    sparse_ = std::move(views);
}

void FlashModel::set_sparse_config(const SparseConfig & config) {
    std::lock_guard<std::mutex> lock(tuning_mutex_);
    sparse_config_ = config;
    tuning_.assign(layers_.size() * kBatchBuckets, LaneTuning{});  // a new configuration is measured afresh
}

int batch_bucket(int64_t n_tokens) {
    int b = 0;
    for (int64_t cap = 1; n_tokens > cap && b < kBatchBuckets - 1; cap *= 2) ++b;
    return b;
}

std::string batch_bucket_name(int bucket) {
    if (bucket <= 0) return "1";
    if (bucket == 1) return "2";
    const int64_t lo = (int64_t{1} << (bucket - 1)) + 1, hi = int64_t{1} << bucket;
    if (bucket >= kBatchBuckets - 1) return std::to_string(lo) + "+";
    return std::to_string(lo) + "-" + std::to_string(hi);
}

bool FlashModel::choose_sparse(int layer, int64_t n_tokens) {
    if (!sparse_config_.autotune) {
        return true;
    }
    auto it = index_.find(layer);
    std::lock_guard<std::mutex> lock(tuning_mutex_);
    const size_t slot = it == index_.end() ? tuning_.size() : it->second * kBatchBuckets + batch_bucket(n_tokens);
    if (slot >= tuning_.size()) {
        return true;
    }
    const LaneTuning & t = tuning_[slot];
    if (t.decided >= 0) {
        return t.decided == 1;
    }
    return t.n[1] <= t.n[0];  // alternate, sparse first
}

void FlashModel::record_lane_time(int layer, int64_t n_tokens, bool sparse, double seconds) {
    if (!sparse_config_.autotune) {
        return;
    }
    auto it = index_.find(layer);
    std::lock_guard<std::mutex> lock(tuning_mutex_);
    const size_t slot = it == index_.end() ? tuning_.size() : it->second * kBatchBuckets + batch_bucket(n_tokens);
    if (slot >= tuning_.size()) {
        return;
    }
    LaneTuning & t = tuning_[slot];
    if (t.decided >= 0) {
        return;
    }
    if (!t.warmed[sparse]) {  // the first split of each lane warms caches and allocations: not counted
        t.warmed[sparse] = true;
        return;
    }
    t.n[sparse] += 1;
    t.seconds[sparse] += seconds;
    const int steps = std::max(1, sparse_config_.autotune_steps);
    if (t.n[0] >= steps && t.n[1] >= steps) {
        const double dense = t.seconds[0] / t.n[0], sp = t.seconds[1] / t.n[1];
        t.decided = sp < 0.97 * dense ? 1 : 0;
    }
}

std::vector<LaneTuning> FlashModel::lane_tuning() const {
    std::lock_guard<std::mutex> lock(tuning_mutex_);
    return tuning_;
}

void FlashModel::set_thresholds(const std::vector<float> & thresholds) {
    if (thresholds.size() != layers_.size()) {
        throw std::invalid_argument("llamaflash: " + std::to_string(thresholds.size()) + " thresholds for " +
                                    std::to_string(layers_.size()) + " served layers");
    }
    for (size_t li = 0; li < layers_.size(); ++li) {
        layers_[li].threshold = thresholds[li];
    }
}

float FlashModel::threshold(int layer) const {
    auto it = index_.find(layer);
    return it == index_.end() ? -1.0f : layers_[it->second].threshold;
}

std::vector<float> FlashModel::thresholds() const {
    std::vector<float> out;
    for (const LayerSpec & s : layers_) {
        out.push_back(s.threshold);
    }
    return out;
}

const SparseLayerView * FlashModel::sparse_layer(int layer) const {
    if (!sparse_config_.enabled || sparse_.empty()) {
        return nullptr;
    }
    auto it = index_.find(layer);
    if (it == index_.end() || layers_[it->second].threshold < 0.0f) {
        return nullptr;
    }
    return &sparse_[it->second];
}

void FlashModel::count_sparse_call(int layer, const int32_t * active_counts, int64_t n_tokens, double seconds) {
    sparse_calls_.fetch_add(1, std::memory_order_relaxed);
    sparse_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
    auto it = index_.find(layer);
    if (it == index_.end() || !layer_active_) {
        return;
    }
    uint64_t active = 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        active += static_cast<uint64_t>(active_counts[t]);
    }
    layer_sparse_tokens_[it->second].fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    layer_active_[it->second].fetch_add(active, std::memory_order_relaxed);
}

void FlashModel::count_draft_split(int layer, int64_t n_tokens, double seconds) {
    draft_splits_.fetch_add(1, std::memory_order_relaxed);
    draft_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
    if (layer == first_layer()) {
        draft_tokens_.fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    }
}

ggml_tensor * FlashModel::dense_weight(int layer, FfnWeightKind kind) const {
    auto it = index_.find(layer);
    if (it == index_.end() || !dense_loaded_) {
        return nullptr;
    }
    return weights_[3 * it->second + static_cast<int>(kind)];
}

ggml_tensor * FlashModel::fused_gate_up(int layer) const {
    auto it = index_.find(layer);
    if (it == index_.end() || !dense_loaded_) {
        return nullptr;
    }
    return fused_[it->second];
}

size_t FlashModel::resident_bytes() const {
    return copied_bytes_;
}

void FlashModel::count_split(double compute_seconds, double prepare_seconds) {
    splits_.fetch_add(1, std::memory_order_relaxed);
    compute_ns_.fetch_add(static_cast<uint64_t>(compute_seconds * 1e9), std::memory_order_relaxed);
    prepare_ns_.fetch_add(static_cast<uint64_t>(prepare_seconds * 1e9), std::memory_order_relaxed);
}

void FlashModel::count_ffn_eval(int layer, int64_t n_tokens) {
    ffn_evals_.fetch_add(1, std::memory_order_relaxed);
    if (layer == first_layer()) {
        tokens_.fetch_add(static_cast<uint64_t>(n_tokens), std::memory_order_relaxed);
    }
}

FlashStatsSnapshot FlashModel::stats() const {
    FlashStatsSnapshot s;
    s.graph_splits = splits_.load();
    s.ffn_evals = ffn_evals_.load();
    s.tokens = tokens_.load();
    s.dense_lane_calls = dense_calls_.load();
    s.compute_seconds = static_cast<double>(compute_ns_.load()) * 1e-9;
    s.prepare_seconds = static_cast<double>(prepare_ns_.load()) * 1e-9;
    s.sparse_lane_calls = sparse_calls_.load();
    s.sparse_fallbacks = sparse_fallbacks_.load();
    s.sparse_seconds = static_cast<double>(sparse_ns_.load()) * 1e-9;
    s.draft_splits = draft_splits_.load();
    s.draft_tokens = draft_tokens_.load();
    s.draft_seconds = static_cast<double>(draft_ns_.load()) * 1e-9;
    for (size_t li = 0; li < layers_.size(); ++li) {
        s.layer_ids.push_back(layers_[li].layer);
        s.layer_sparse_tokens.push_back(layer_active_ ? layer_sparse_tokens_[li].load() : 0);
        s.layer_active.push_back(layer_active_ ? layer_active_[li].load() : 0);
    }
    return s;
}

void FlashModel::reset_stats() {
    splits_ = 0;
    ffn_evals_ = 0;
    tokens_ = 0;
    dense_calls_ = 0;
    compute_ns_ = 0;
    prepare_ns_ = 0;
    sparse_calls_ = 0;
    sparse_fallbacks_ = 0;
    sparse_ns_ = 0;
    draft_splits_ = 0;
    draft_tokens_ = 0;
    draft_ns_ = 0;
    for (size_t li = 0; layer_active_ && li < layers_.size(); ++li) {
        layer_sparse_tokens_[li] = 0;
        layer_active_[li] = 0;
    }
}

}  // namespace llamaflash
