// weight_store.cpp — see weight_store.h.
#include "model/weight_store.h"

#include "ggml-alloc.h"
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
    auto get_extra =
        (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
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

}  // namespace

WeightStore::WeightStore(std::vector<LayerSpec> layers, std::string sidecar_path, std::string base_path, bool verify)
    : layers_(std::move(layers)),
      sidecar_path_(std::move(sidecar_path)),
      base_path_(std::move(base_path)),
      verify_(verify) {
    for (const LayerSpec & s : layers_) has_checksums_ = has_checksums_ || s.checksum_offset != 0;
}

bool WeightStore::needs_check(size_t li, RowSet set) const {
    return verify_ && checksums_.at(li).present() && checked_.count({li, static_cast<int>(set)}) == 0;
}

namespace {

const std::vector<uint32_t> & expected_of(const LayerChecksums & c, RowSet set) {
    switch (set) {
        case RowSet::bundle: return c.bundle;
        case RowSet::down_t: return c.down_t;
        case RowSet::base_gate: return c.base_gate;
        case RowSet::base_up: return c.base_up;
        case RowSet::base_down: return c.base_down;
    }
    throw std::logic_error("unknown row set");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Rows of a read buffer, split over the OpenMP threads in runs of kRun rows; the mismatch reported
// is the first row that fails (lowest index), as a serial check would report.
void WeightStore::check_rows(size_t li, RowSet set, const uint8_t * data, size_t stride) {
    if (!needs_check(li, set)) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<uint32_t> & expected = expected_of(checksums_[li], set);
    const RowSource src = row_source(layers_[li], set, sidecar_path_, base_path_);
    constexpr int64_t kRun = 256;
    const int64_t n = static_cast<int64_t>(expected.size()), runs = (n + kRun - 1) / kRun;
    int64_t failed_run = runs;
    std::string error;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t k = 0; k < runs; ++k) {
        const int64_t first = k * kRun, count = std::min(kRun, n - first);
        try {
            verify_rows(data + static_cast<size_t>(first) * stride, stride, first, count, expected.data(), src);
        } catch (const IntegrityError & e) {
#pragma omp critical(llamaflash_weight_store_rows)
            if (k < failed_run) {
                failed_run = k;
                error = e.what();
            }
        }
    }
    if (!error.empty()) throw IntegrityError(error);
    verified_bytes_ += static_cast<uint64_t>(n) * src.row_bytes;
    checked_.insert({li, static_cast<int>(set)});
    verify_seconds_ += seconds_since(t0);
}

void WeightStore::check_mapped(size_t li, RowSet set) {
    if (!needs_check(li, set)) return;
    pending_.push_back({li, set});
    checked_.insert({li, static_cast<int>(set)});
}

// The deferred checks of mapped row sets, spread over the OpenMP threads, each row set one task.
// The rows are read with pread from the file (the page cache pages the mapping shows, as a mapping
// of the file is coherent with it) rather than through the mapping: copying them costs less than
// faulting every page into the process now, and the pages are faulted in when first computed with,
// as without the check. The first mismatch found is thrown after all tasks ran.
void WeightStore::run_checks() {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<PendingCheck> work;
    work.swap(pending_);
    if (work.empty()) return;
    const FileReader sidecar(sidecar_path_), base(base_path_);
    std::string error;
    uint64_t bytes = 0;
    const int64_t n = static_cast<int64_t>(work.size());
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bytes)
    for (int64_t i = 0; i < n; ++i) {
        const PendingCheck & c = work[static_cast<size_t>(i)];
        const std::vector<uint32_t> & expected = expected_of(checksums_[c.li], c.set);
        const bool in_sidecar = c.set == RowSet::bundle || c.set == RowSet::down_t;
        try {
            bytes += verify_file_rows(in_sidecar ? sidecar : base, 0, static_cast<int64_t>(expected.size()),
                                      expected.data(), row_source(layers_[c.li], c.set, sidecar_path_, base_path_),
                                      size_t{1} << 20, /*drop=*/false);
        } catch (const IoError & e) {  // IntegrityError, or a read failure
#pragma omp critical(llamaflash_weight_store_checks)
            if (error.empty()) error = e.what();
        }
    }
    verified_bytes_ += bytes;
    verify_seconds_ += seconds_since(t0);
    if (error.rfind(kIntegrityErrorPrefix, 0) == 0) throw IntegrityError(error);
    if (!error.empty()) throw IoError(error);
}

void WeightStore::check_file_rows(size_t li, RowSet set, const FileReader & file) {
    if (!needs_check(li, set)) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<uint32_t> & expected = expected_of(checksums_[li], set);
    const RowSource src = row_source(layers_[li], set, sidecar_path_, base_path_);
    verified_bytes_ += verify_file_rows(file, 0, static_cast<int64_t>(expected.size()), expected.data(), src);
    checked_.insert({li, static_cast<int>(set)});
    verify_seconds_ += seconds_since(t0);
}

WeightStore::~WeightStore() {
    for (ggml_backend_buffer_t b : buffers_) {
        ggml_backend_buffer_free(b);
    }
    if (ctx_ != nullptr) {
        ggml_free(ctx_);
    }
}

std::vector<std::vector<int32_t>> WeightStore::read_orders(const FileReader & sidecar,
                                                           std::vector<bool> & identity) const {
    std::vector<std::vector<int32_t>> orders(layers_.size());
    identity.assign(layers_.size(), true);
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
    }
    return orders;
}

void WeightStore::load_dense(bool offload, bool stream_gate, bool repack, bool views_used) {
    if (dense_loaded()) {
        throw std::logic_error("llamaflash: dense weights loaded twice");
    }
    FileReader sidecar(sidecar_path_);
    FileReader base(base_path_);
    ggml_backend_buffer_type_t plain = ggml_backend_cpu_buffer_type();

    std::vector<bool> identity;
    const std::vector<std::vector<int32_t>> orders = read_orders(sidecar, identity);
    checksums_ = verify_ ? read_checksums(sidecar, layers_) : std::vector<LayerChecksums>(layers_.size());
    for (const LayerSpec & s : layers_) {
        const uint64_t n_ff = static_cast<uint64_t>(s.n_ff);
        sidecar.check_range(s.bundle_offset, n_ff * s.bundle_stride);
        base.check_range(s.base_down_offset, static_cast<uint64_t>(s.n_embd) * s.base_down_row_bytes);
        if (offload) {
            base.check_range(s.base_up_offset, n_ff * s.up_row_bytes);
        }
        if (stream_gate) {
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
            ggml_backend_buffer_type_t buft = repack ? pick_cpu_weight_buft(t) : ggml_backend_cpu_buffer_type();
            if (offload) {  // gate resident (or streamed), up and down streamed from the base file
                if (kind == 0 && !stream_gate) {
                    copies[buft].push_back(t);
                } else {
                    views_base.emplace_back(t, kind == 0   ? s.base_gate_offset
                                               : kind == 1 ? s.base_up_offset
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
            const uint8_t * data = map_region(static_cast<File>(file), region_offset, region_bytes);
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
    place_views(views_sidecar, kSidecar, [&](const ggml_tensor * t, uint64_t) {
        const LayerSpec & s = *spec_of.at(t);
        return std::make_pair(s.bundle_offset, static_cast<uint64_t>(s.n_ff) * s.bundle_stride);
    });
    place_views(views_base, kBase, [&](const ggml_tensor * t, uint64_t offset) {
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
            throw std::runtime_error("llamaflash: cannot allocate " + std::to_string(total >> 20) +
                                     " MiB for FFN weights");
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
            check_rows(li, RowSet::bundle, bundles.data(), s.bundle_stride);
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
            check_rows(li, RowSet::base_down, matrix.data(), s.base_down_row_bytes);
            ggml_backend_tensor_set(weights_[3 * li + 2], matrix.data(), 0, down_bytes);
        }
        // what is used in place: in memory the mappings (their pages are read now, as computing would);
        // offload the base file's prefill views, read in chunks without keeping their pages
        if (offload) {
            if (views_used) {
                check_file_rows(li, RowSet::base_up, base);
                check_file_rows(li, RowSet::base_down, base);
                if (stream_gate) check_file_rows(li, RowSet::base_gate, base);
            }
            continue;
        }
        auto bundle_map = regions_.find({kSidecar, s.bundle_offset});
        if (bundle_map != regions_.end()) check_mapped(li, RowSet::bundle);
        auto down_map = regions_.find({kBase, s.base_down_offset});
        if (down_map != regions_.end()) {
            check_mapped(li, RowSet::base_down);
        }
    }
    run_checks();
}

const uint8_t * WeightStore::map_region(File file, uint64_t offset, uint64_t length) {
    auto it = regions_.find({file, offset});
    if (it != regions_.end()) {
        if (it->second->size() < length) {
            throw std::logic_error("llamaflash: region mapped twice with different lengths");
        }
        return it->second->data();
    }
    maps_.push_back(std::make_unique<MappedFile>(file == kSidecar ? sidecar_path_ : base_path_, offset, length));
    regions_.emplace(std::make_pair(file, offset), maps_.back().get());
    return maps_.back()->data();
}

// The kernel's views: a layer's bundle region is the same mapping the dense lane's gate/up views use
// (when it has them), so pages are shared, never counted twice; down_t rows get a mapping per layer.
void WeightStore::load_sparse(FfnActivation activation, bool offload) {
    if (!dense_loaded() || sparse_loaded()) {
        throw std::logic_error("llamaflash: load_sparse() needs load_dense() first, and runs once");
    }
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
        if (offload) {
            k.up_slots = k.down_t_slots = kNoSlots;
        } else {
            k.bundles = map_region(kSidecar, s.bundle_offset, static_cast<uint64_t>(s.n_ff) * s.bundle_stride);
        }
        k.bundle_stride = s.bundle_stride;
        k.gate_type = s.gate_type;
        k.up_type = s.up_type;
        k.gate_row_bytes = s.gate_row_bytes;
        k.up_row_bytes = s.up_row_bytes;
        if (!offload) {
            k.down_t = map_region(kSidecar, s.down_t_offset, static_cast<uint64_t>(s.n_ff) * s.down_t_row_bytes);
            check_mapped(li, RowSet::bundle);
            check_mapped(li, RowSet::down_t);
        }
        k.down_t_type = s.down_t_type;
        k.down_t_row_bytes = s.down_t_row_bytes;
        k.activation = activation;
        sparse_ffn_validate(k);
        std::vector<int32_t> order(static_cast<size_t>(s.n_ff));
        sidecar.read_exact(order.data(), order.size() * sizeof(int32_t), s.order_offset);
        for (size_t i = 0; i < order.size() && v.base_order; ++i) {
            v.base_order = order[i] == static_cast<int32_t>(i);
        }
        if (v.base_order && !offload) {
            // the base file's up rows: contiguous, so a thread's run of active neurons is one stream
            // (the bundles interleave gate rows, which the kernel never reads when g comes from ggml)
            k.up_rows = map_region(kBase, s.base_up_offset, static_cast<uint64_t>(s.n_ff) * s.up_row_bytes);
            k.up_stride = s.up_row_bytes;
            check_mapped(li, RowSet::base_up);
        }
    }
    run_checks();
    sparse_ = std::move(views);
}

ggml_tensor * WeightStore::dense_weight(size_t pos, FfnWeightKind kind) const {
    return pos < layers_.size() && dense_loaded() ? weights_[3 * pos + static_cast<size_t>(kind)] : nullptr;
}

ggml_tensor * WeightStore::fused_gate_up(size_t pos) const { return pos < fused_.size() ? fused_[pos] : nullptr; }

void WeightStore::recheck_mapped() {
    if (!verifying()) return;
    for (size_t li = 0; li < layers_.size(); ++li) {
        const LayerSpec & s = layers_[li];
        const struct {
            RowSet set;
            File file;
            uint64_t offset;
        } sets[] = {{RowSet::bundle, kSidecar, s.bundle_offset},
                    {RowSet::down_t, kSidecar, s.down_t_offset},
                    {RowSet::base_gate, kBase, s.base_gate_offset},
                    {RowSet::base_up, kBase, s.base_up_offset},
                    {RowSet::base_down, kBase, s.base_down_offset}};
        for (const auto & r : sets) {
            auto it = regions_.find({r.file, r.offset});
            if (it == regions_.end()) continue;
            checked_.erase({li, static_cast<int>(r.set)});
            check_mapped(li, r.set);
        }
    }
    run_checks();
}

const MappedFile * WeightStore::base_region(uint64_t offset) const {
    auto it = regions_.find({kBase, offset});
    return it == regions_.end() ? nullptr : it->second;
}

}  // namespace llamaflash
