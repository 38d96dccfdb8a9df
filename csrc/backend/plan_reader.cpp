// plan_reader.cpp — see plan_reader.h. Every key is read through one typed accessor that names the
// key and the file in its error; arrays are checked for the count their layer list implies.
#include "backend/plan_reader.h"

#include "backend/weight_registry.h"

#include "plan_keys.h"

#include "ggml.h"
#include "gguf.h"

#include <sys/stat.h>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

namespace llamaflash {

namespace pk = plan_keys;

namespace {

struct GgufDeleter {
    void operator()(gguf_context * ctx) const { gguf_free(ctx); }
};

// Typed access to one plan file's keys; every failure names the file and the key.
class PlanKeys {
public:
    explicit PlanKeys(const std::string & path) : path_(path) {
        struct stat st{};
        if (::stat(path.c_str(), &st) != 0) {
            throw std::runtime_error("the plan file '" + path + "' does not exist");
        }
        gguf_init_params params{/*no_alloc =*/true, /*ctx =*/nullptr};
        ctx_.reset(gguf_init_from_file(path.c_str(), params));
        if (!ctx_) {
            throw std::runtime_error("cannot read the plan file '" + path + "' (missing, or not a GGUF file)");
        }
    }

    bool has(const char * key) const { return gguf_find_key(ctx_.get(), key) >= 0; }

    std::string str(const char * key) const { return gguf_get_val_str(ctx_.get(), id(key, GGUF_TYPE_STRING)); }
    bool boolean(const char * key) const { return gguf_get_val_bool(ctx_.get(), id(key, GGUF_TYPE_BOOL)); }
    uint32_t u32(const char * key) const { return gguf_get_val_u32(ctx_.get(), id(key, GGUF_TYPE_UINT32)); }
    uint64_t u64(const char * key) const { return gguf_get_val_u64(ctx_.get(), id(key, GGUF_TYPE_UINT64)); }
    int64_t i64(const char * key) const { return gguf_get_val_i64(ctx_.get(), id(key, GGUF_TYPE_INT64)); }
    int32_t i32(const char * key) const { return gguf_get_val_i32(ctx_.get(), id(key, GGUF_TYPE_INT32)); }
    float f32(const char * key) const { return gguf_get_val_f32(ctx_.get(), id(key, GGUF_TYPE_FLOAT32)); }

    template <typename T>
    std::vector<T> array(const char * key, gguf_type type, int64_t expect = -1) const {
        const int64_t k = id(key, GGUF_TYPE_ARRAY);
        if (gguf_get_arr_type(ctx_.get(), k) != type) {
            fail(key, std::string("an array of ") + gguf_type_name(type));
        }
        const size_t n = gguf_get_arr_n(ctx_.get(), k);
        if (expect >= 0 && static_cast<int64_t>(n) != expect) {
            fail(key, std::to_string(expect) + " entries (it has " + std::to_string(n) + ")");
        }
        const T * data = n ? static_cast<const T *>(gguf_get_arr_data(ctx_.get(), k)) : nullptr;
        return std::vector<T>(data, data + n);
    }
    std::vector<int64_t> ints(const char * key, int64_t expect = -1) const {
        return array<int64_t>(key, GGUF_TYPE_INT64, expect);
    }

    std::vector<std::string> strings(const char * key, int64_t expect) const {
        const int64_t k = id(key, GGUF_TYPE_ARRAY);
        if (gguf_get_arr_type(ctx_.get(), k) != GGUF_TYPE_STRING) {
            fail(key, "an array of strings");
        }
        const size_t n = gguf_get_arr_n(ctx_.get(), k);
        if (static_cast<int64_t>(n) != expect) {
            fail(key, std::to_string(expect) + " entries");
        }
        std::vector<std::string> out;
        for (size_t i = 0; i < n; ++i) out.emplace_back(gguf_get_arr_str(ctx_.get(), k, i));
        return out;
    }

    // A flat array split into per-layer pieces by a counts array of `n_layers` entries.
    template <typename T>
    std::vector<std::vector<T>> ragged(const char * key, gguf_type type, const char * counts_key,
                                       int64_t n_layers) const {
        const std::vector<int64_t> counts = ints(counts_key, n_layers);
        int64_t total = 0;
        for (int64_t c : counts) {
            if (c < 0) fail(counts_key, "counts >= 0");
            total += c;
        }
        // GGUF has no empty arrays: when every count is 0 the flat key is absent
        const std::vector<T> flat = total == 0 && !has(key) ? std::vector<T>() : array<T>(key, type, total);
        std::vector<std::vector<T>> out;
        size_t at = 0;
        for (int64_t c : counts) {
            out.emplace_back(flat.begin() + at, flat.begin() + at + c);
            at += c;
        }
        return out;
    }

    [[noreturn]] void fail(const char * key, const std::string & want) const {
        throw std::runtime_error("the plan file '" + path_ + "' is damaged or from another llamaflash version: key '" +
                                 key + "' should be " + want + "; re-create it with `llamaflash env`");
    }

private:
    int64_t id(const char * key, gguf_type type) const {
        const int64_t k = gguf_find_key(ctx_.get(), key);
        if (k < 0) fail(key, "present");
        if (gguf_get_kv_type(ctx_.get(), k) != type) fail(key, gguf_type_name(type));
        return k;
    }

    std::string path_;
    std::unique_ptr<gguf_context, GgufDeleter> ctx_;
};

PlanIdentity read_identity(const PlanKeys & k) {
    PlanIdentity id;
    id.format = k.u32(pk::FORMAT);
    if (id.format != pk::FORMAT_VERSION) {
        k.fail(pk::FORMAT,
               "format version " + std::to_string(pk::FORMAT_VERSION) + " (it is " + std::to_string(id.format) + ")");
    }
    id.kind = k.str(pk::KIND);
    id.mode = k.str(pk::MODE);
    id.reason = k.str(pk::REASON);
    id.ggml_commit = k.str(pk::GGML_COMMIT);
    id.ggml_version = k.str(pk::GGML_VERSION);
    id.model_path = k.str(pk::MODEL_PATH);
    id.model_size = k.u64(pk::MODEL_SIZE);
    id.model_mtime_ns = k.u64(pk::MODEL_MTIME_NS);
    id.sidecar_path = k.str(pk::SIDECAR_PATH);
    id.sidecar_size = k.u64(pk::SIDECAR_SIZE);
    id.sidecar_mtime_ns = k.u64(pk::SIDECAR_MTIME_NS);
    id.ram_budget_mb = k.f32(pk::RAM_BUDGET_MB);
    id.n_ctx = k.u32(pk::N_CTX);
    id.n_batch = k.u32(pk::N_BATCH);
    id.n_ubatch = k.u32(pk::N_UBATCH);
    id.tool_args = k.str(pk::TOOL_ARGS);
    return id;
}

EngineConfig read_dense(const PlanKeys & k, const PlanIdentity & id) {
    EngineConfig c;
    c.sidecar_path = id.sidecar_path;
    c.base_path = id.model_path;
    c.activation = k.str(pk::ENGINE_ACTIVATION);
    c.verify = k.boolean(pk::ENGINE_VERIFY);
    c.repack = k.boolean(pk::ENGINE_REPACK);
    c.sparse.enabled = k.boolean(pk::SPARSE_ENABLED);
    c.sparse.max_tokens = k.i64(pk::SPARSE_MAX_TOKENS);
    c.sparse.cluster_size = k.i32(pk::SPARSE_CLUSTER_SIZE);
    c.sparse.up_by_ggml = k.boolean(pk::SPARSE_UP_BY_GGML);

    const std::string layer_key = std::string(pk::LAYER) + "layer";
    const int64_t n = static_cast<int64_t>(k.ints(layer_key.c_str()).size());
    c.layers.resize(n);
    for (const char * field : pk::LAYER_INT_FIELDS) {
        const std::string key = std::string(pk::LAYER) + field;
        const std::vector<int64_t> v = k.ints(key.c_str(), n);
        for (int64_t i = 0; i < n; ++i) {
            LayerSpec & s = c.layers[i];
            const int64_t x = v[i];
            const std::string f = field;
            // the field list is plan_keys.LAYER_INT_FIELDS; each maps to one LayerSpec member
            if (f == "layer")
                s.layer = static_cast<int>(x);
            else if (f == "n_embd")
                s.n_embd = x;
            else if (f == "n_ff")
                s.n_ff = x;
            else if (f == "gate_type")
                s.gate_type = static_cast<ggml_type>(x);
            else if (f == "up_type")
                s.up_type = static_cast<ggml_type>(x);
            else if (f == "down_type")
                s.down_type = static_cast<ggml_type>(x);
            else if (f == "down_t_type")
                s.down_t_type = static_cast<ggml_type>(x);
            else if (f == "gate_row_bytes")
                s.gate_row_bytes = x;
            else if (f == "up_row_bytes")
                s.up_row_bytes = x;
            else if (f == "bundle_offset")
                s.bundle_offset = x;
            else if (f == "bundle_stride")
                s.bundle_stride = x;
            else if (f == "down_t_offset")
                s.down_t_offset = x;
            else if (f == "down_t_row_bytes")
                s.down_t_row_bytes = x;
            else if (f == "order_offset")
                s.order_offset = x;
            else if (f == "base_down_offset")
                s.base_down_offset = x;
            else if (f == "base_down_row_bytes")
                s.base_down_row_bytes = x;
            else if (f == "base_up_offset")
                s.base_up_offset = x;
            else if (f == "base_gate_offset")
                s.base_gate_offset = x;
            else if (f == "draft_type")
                s.draft_type = static_cast<ggml_type>(x);
            else if (f == "draft_row_bytes")
                s.draft_row_bytes = x;
            else if (f == "draft_up_offset")
                s.draft_up_offset = x;
            else if (f == "draft_down_t_offset")
                s.draft_down_t_offset = x;
            else if (f == "draft_checksum_offset")
                s.draft_checksum_offset = x;
            else if (f == "checksum_offset")
                s.checksum_offset = x;
            else if (f == "base_down_checksum_offset")
                s.base_down_checksum_offset = x;
            else
                k.fail(key.c_str(), "a LayerSpec field this library knows");
        }
    }
    const std::string threshold_key = std::string(pk::LAYER) + "threshold";
    const std::vector<float> thresholds = k.array<float>(threshold_key.c_str(), GGUF_TYPE_FLOAT32, n);
    for (int64_t i = 0; i < n; ++i) c.layers[i].threshold = thresholds[i];
    for (const char * field : pk::LAYER_STR_FIELDS) {
        const std::string key = std::string(pk::LAYER) + field;
        const std::vector<std::string> v = k.strings(key.c_str(), n);
        for (int64_t i = 0; i < n; ++i) {
            LayerSpec & s = c.layers[i];
            const std::string f = field;
            if (f == "draft_up_name")
                s.draft_up_name = v[i];
            else if (f == "draft_down_t_name")
                s.draft_down_t_name = v[i];
            else if (f == "bundle_name")
                s.bundle_name = v[i];
            else if (f == "down_t_name")
                s.down_t_name = v[i];
            else if (f == "base_gate_name")
                s.base_gate_name = v[i];
            else if (f == "base_up_name")
                s.base_up_name = v[i];
            else if (f == "base_down_name")
                s.base_down_name = v[i];
            else
                k.fail(key.c_str(), "a LayerSpec field this library knows");
        }
    }

    if (k.boolean(pk::OFFLOAD)) {
        OffloadConfig o;
        o.stream_gate = k.boolean(pk::OFFLOAD_STREAM_GATE);
        o.cold_slots = k.i64(pk::OFFLOAD_COLD_SLOTS);
        o.prefetch_layers = k.i32(pk::OFFLOAD_PREFETCH_LAYERS);
        o.prefetch_min_prob = k.f32(pk::OFFLOAD_PREFETCH_MIN_PROB);
        o.queue_depth = k.u32(pk::OFFLOAD_QUEUE_DEPTH);
        o.direct = k.boolean(pk::OFFLOAD_DIRECT);
        o.engine = k.str(pk::OFFLOAD_ENGINE);
        o.draft_copy = k.boolean(pk::OFFLOAD_DRAFT_COPY);
        o.stream_layers = k.boolean(pk::OFFLOAD_STREAM_LAYERS);
        if (k.has(pk::OFFLOAD_HOT_LAYERS)) {  // absent: none pinned
            for (int64_t p : k.ints(pk::OFFLOAD_HOT_LAYERS)) o.hot_layers.push_back(static_cast<int32_t>(p));
        }
        o.hot = k.ragged<int32_t>(pk::OFFLOAD_HOT, GGUF_TYPE_INT32, pk::OFFLOAD_HOT_COUNTS, n);
        o.cluster_prob =
            k.ragged<float>(pk::OFFLOAD_CLUSTER_PROB, GGUF_TYPE_FLOAT32, pk::OFFLOAD_CLUSTER_PROB_COUNTS, n);
        c.offload = std::move(o);
    }
    return c;
}

// A router [n_expert rows of n_embd] as float32, read from the base file at `offset` in `type`.
std::vector<float> read_router(const std::string & base_path, uint64_t offset, ggml_type type, int64_t n_embd,
                               int64_t n_expert) {
    const ggml_type_traits * traits = ggml_get_type_traits(type);
    if (traits == nullptr || (type != GGML_TYPE_F32 && traits->to_float == nullptr)) {
        throw std::runtime_error("router of ggml type " + std::to_string(type) + " cannot be read as float32");
    }
    const size_t row_bytes = ggml_row_size(type, n_embd);
    std::vector<uint8_t> raw(row_bytes * n_expert);
    std::unique_ptr<FILE, int (*)(FILE *)> f(std::fopen(base_path.c_str(), "rb"), &std::fclose);
    if (!f || fseeko(f.get(), static_cast<off_t>(offset), SEEK_SET) != 0 ||
        std::fread(raw.data(), 1, raw.size(), f.get()) != raw.size()) {
        throw std::runtime_error("cannot read the expert router at offset " + std::to_string(offset) + " of '" +
                                 base_path + "'");
    }
    std::vector<float> out(static_cast<size_t>(n_embd * n_expert));
    for (int64_t e = 0; e < n_expert; ++e) {
        const uint8_t * src = raw.data() + e * row_bytes;
        if (type == GGML_TYPE_F32) {
            std::memcpy(out.data() + e * n_embd, src, row_bytes);
        } else {
            traits->to_float(src, out.data() + e * n_embd, n_embd);
        }
    }
    return out;
}

ExpertConfig read_experts(const PlanKeys & k, const PlanIdentity & id) {
    ExpertConfig c;
    c.base_path = id.model_path;
    c.n_embd = k.i64(pk::EXPERTS_N_EMBD);
    c.io_engine = k.str(pk::EXPERTS_IO_ENGINE);
    c.queue_depth = k.u32(pk::EXPERTS_QUEUE_DEPTH);
    c.direct = k.boolean(pk::EXPERTS_DIRECT);
    c.verify = k.boolean(pk::EXPERTS_VERIFY);
    c.prefetch = k.boolean(pk::EXPERTS_PREFETCH);
    c.overlap = k.boolean(pk::EXPERTS_OVERLAP);
    c.router_rows = k.boolean(pk::EXPERTS_ROUTER_ROWS);
    const std::vector<int64_t> layers = k.ints(pk::EXPERTS_LAYER);
    const int64_t n = static_cast<int64_t>(layers.size());
    const std::vector<int64_t> n_expert = k.ints(pk::EXPERTS_N_EXPERT, n);
    const std::vector<int64_t> n_used = k.ints(pk::EXPERTS_N_USED, n);
    const std::vector<int64_t> n_slots = k.ints(pk::EXPERTS_N_SLOTS, n);
    const auto pinned = k.ragged<int32_t>(pk::EXPERTS_PINNED, GGUF_TYPE_INT32, pk::EXPERTS_PINNED_COUNTS, n);
    const std::vector<int64_t> router_offset = k.ints(pk::EXPERTS_ROUTER_OFFSET, n);
    const std::vector<int64_t> router_type = k.ints(pk::EXPERTS_ROUTER_TYPE, n);
    const std::vector<int64_t> tensor_counts = k.ints(pk::EXPERTS_TENSOR_COUNTS, n);
    int64_t n_tensors = 0;
    for (int64_t t : tensor_counts) n_tensors += t;
    const std::vector<int64_t> kind = k.ints(pk::EXPERTS_TENSOR_KIND, n_tensors);
    const std::vector<int64_t> offset = k.ints(pk::EXPERTS_TENSOR_OFFSET, n_tensors);
    const std::vector<int64_t> type = k.ints(pk::EXPERTS_TENSOR_TYPE, n_tensors);
    const std::vector<int64_t> ne0 = k.ints(pk::EXPERTS_TENSOR_NE0, n_tensors);
    const std::vector<int64_t> ne1 = k.ints(pk::EXPERTS_TENSOR_NE1, n_tensors);
    const std::vector<int64_t> expert_bytes = k.ints(pk::EXPERTS_TENSOR_EXPERT_BYTES, n_tensors);
    const auto checksums = k.ragged<uint32_t>(pk::EXPERTS_TENSOR_CHECKSUMS, GGUF_TYPE_UINT32,
                                              pk::EXPERTS_TENSOR_CHECKSUM_COUNTS, n_tensors);
    int64_t t = 0;
    for (int64_t i = 0; i < n; ++i) {
        ExpertLayerSpec s;
        s.layer = static_cast<int>(layers[i]);
        s.n_expert = static_cast<int>(n_expert[i]);
        s.n_used = static_cast<int>(n_used[i]);
        s.n_slots = static_cast<int>(n_slots[i]);
        s.pinned.assign(pinned[i].begin(), pinned[i].end());
        for (int64_t j = 0; j < tensor_counts[i]; ++j, ++t) {
            ExpertTensorSpec ts;
            ts.kind = static_cast<ExpertTensorKind>(kind[t]);
            ts.offset = static_cast<uint64_t>(offset[t]);
            ts.type = static_cast<int>(type[t]);
            ts.ne0 = ne0[t];
            ts.ne1 = ne1[t];
            ts.expert_bytes = static_cast<uint64_t>(expert_bytes[t]);
            ts.checksums = checksums[t];
            s.tensors.push_back(std::move(ts));
        }
        if (router_offset[i] >= 0) {
            s.router = read_router(c.base_path, static_cast<uint64_t>(router_offset[i]),
                                   static_cast<ggml_type>(router_type[i]), c.n_embd, s.n_expert);
            s.router_exact = router_type[i] == GGML_TYPE_F32;
        }
        c.layers.push_back(std::move(s));
    }
    return c;
}

}  // namespace

Plan read_plan(const std::string & path) {
    PlanKeys k(path);
    Plan plan;
    plan.identity = read_identity(k);
    if (plan.identity.kind == pk::KIND_DENSE) {
        plan.dense = read_dense(k, plan.identity);
    } else if (plan.identity.kind == pk::KIND_EXPERTS) {
        plan.experts = read_experts(k, plan.identity);
        const std::vector<int64_t> offset = k.ints(pk::EXPERTS_LOCK_OFFSET);
        const std::vector<int64_t> size = k.ints(pk::EXPERTS_LOCK_SIZE, static_cast<int64_t>(offset.size()));
        for (size_t i = 0; i < offset.size(); ++i) {
            if (offset[i] < 0 || size[i] <= 0 || (i > 0 && offset[i] < offset[i - 1] + size[i - 1])) {
                k.fail(pk::EXPERTS_LOCK_OFFSET, "sorted, disjoint ranges of positive size");
            }
            plan.lock_ranges.emplace_back(static_cast<uint64_t>(offset[i]), static_cast<uint64_t>(size[i]));
        }
    } else {
        k.fail(pk::KIND, std::string("'") + pk::KIND_DENSE + "' or '" + pk::KIND_EXPERTS + "'");
    }
    return plan;
}

std::string file_changed(const std::string & path, uint64_t size, uint64_t mtime_ns) {
    struct stat st{};
    if (::stat(path.c_str(), &st) != 0) {
        return "'" + path + "' is gone";
    }
    const uint64_t now_ns = static_cast<uint64_t>(st.st_mtim.tv_sec) * 1000000000ull + st.st_mtim.tv_nsec;
    if (static_cast<uint64_t>(st.st_size) != size || now_ns != mtime_ns) {
        return "'" + path + "' changed since the plan was made (size " + std::to_string(st.st_size) + ", was " +
               std::to_string(size) + ")";
    }
    return "";
}

int PlanEngine::bound_count() const { return dense ? dense->bound_count() : experts->bound_count(); }

void PlanEngine::begin_model_load() const {
    if (dense) {
        WeightRegistry::instance().set_pending(dense);
    } else {
        WeightRegistry::instance().set_pending_experts(experts);
    }
}

std::shared_ptr<PlanEngine> open_plan(const std::string & path) {
    Plan plan = read_plan(path);
    auto engine = std::make_shared<PlanEngine>();
    engine->identity = plan.identity;
    const PlanIdentity & id = engine->identity;
    if (id.ggml_commit != ggml_commit() || id.ggml_version != ggml_version()) {
        throw std::runtime_error("the plan '" + path + "' was made with ggml " + id.ggml_version + " (commit " +
                                 id.ggml_commit + "), this process runs ggml " + ggml_version() + " (commit " +
                                 ggml_commit() +
                                 "); run `llamaflash env` again from the llamaflash installed beside "
                                 "these tools");
    }
    for (auto [file, size, mtime] : {std::tuple{id.model_path, id.model_size, id.model_mtime_ns},
                                     std::tuple{id.sidecar_path, id.sidecar_size, id.sidecar_mtime_ns}}) {
        const std::string changed = file_changed(file, size, mtime);
        if (!changed.empty()) {
            throw std::runtime_error(changed + "; run `llamaflash env " + id.model_path + " ...` again");
        }
    }
    if (plan.dense) {
        engine->expected_weights = 3 * static_cast<int>(plan.dense->layers.size());
        engine->dense = FlashModel::open(std::move(*plan.dense));
    } else {
        for (const ExpertLayerSpec & s : plan.experts->layers) {
            engine->expected_weights += static_cast<int>(s.tensors.size()) + (plan.experts->router_rows ? 1 : 0);
        }
        engine->experts = ExpertModel::open(std::move(*plan.experts));
        engine->lock_ranges = std::move(plan.lock_ranges);
    }
    return engine;
}

}  // namespace llamaflash
