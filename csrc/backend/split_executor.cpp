// split_executor.cpp — see split_executor.h.
#include "backend/split_executor.h"

#include "backend/weight_registry.h"
#include "ggml-cpu.h"
#include "model/flash_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>

namespace llamaflash {

namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
}

// The llamaflash weight of the split's first MUL_MAT over one (its layer and model), or nullptr.
const BoundWeight * first_bound_weight(const ggml_cgraph * split, const WeightRegistry & registry) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        if (const BoundWeight * b = node->op == GGML_OP_MUL_MAT ? registry.lookup(node->src[0]) : nullptr) {
            return b;
        }
    }
    return nullptr;
}

// Where the split's output (its last node: the FFN's y, [n_embd, T] f32) first holds a NaN or an
// infinity, as "token t, value i"; "" when every value is finite (or the output is not f32 rows).
std::string first_non_finite(const ggml_cgraph * split) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const ggml_tensor * y = ggml_graph_node(g, ggml_graph_n_nodes(g) - 1);
    if (y->type != GGML_TYPE_F32 || y->nb[0] != sizeof(float) || y->data == nullptr) {
        return std::string();
    }
    for (int64_t t = 0; t < ggml_nrows(y); ++t) {
        const float * row = reinterpret_cast<const float *>(static_cast<const char *>(y->data) + t * y->nb[1]);
        for (int64_t i = 0; i < y->ne[0]; ++i) {
            if (!std::isfinite(row[i])) {
                return "token " + std::to_string(t) + ", value " + std::to_string(i) + " is " +
                       (std::isnan(row[i]) ? "NaN" : "infinite");
            }
        }
    }
    return std::string();
}

// `status`, or GGML_STATUS_FAILED (kept in the model) where the split's FFN output of `layer` holds a
// NaN or infinity: it would otherwise flow on silently (generation then just stops).
ggml_status checked_finite(const ggml_cgraph * split, FlashModel & model, int layer, ggml_status status) {
    if (status != GGML_STATUS_SUCCESS) {
        return status;
    }
    const std::string where = first_non_finite(split);
    if (where.empty()) {
        return status;
    }
    model.set_non_finite("layer " + std::to_string(layer) + "'s FFN output: " + where);
    return GGML_STATUS_FAILED;
}

// Rows [t0, t0 + n) of `t` (a [ne0, T] f32 tensor of the split, or a node: op, sources and flags
// kept), over the same memory.
ggml_tensor * token_rows(ggml_context * ctx, const ggml_tensor * t, int64_t t0, int64_t n) {
    ggml_tensor * v = t->op == GGML_OP_NONE ? leaf_over(ctx, t) : node_copy(ctx, t);
    if (t->op != GGML_OP_NONE) {
        std::memcpy(v->src, t->src, sizeof(v->src));
    }
    v->ne[1] = n;
    v->nb[2] = v->nb[1] * n;  // ne[2] = ne[3] = 1 (checked by the caller)
    v->nb[3] = v->nb[2];
    v->data = static_cast<char *>(t->data) + t0 * t->nb[1];
    return v;
}

// The split's lane and the served layer it computes.
struct Route {
    FlashModel * model = nullptr;  // nullptr: no served weight in the split
    int layer = -1;
    GluFfnPattern ffn;                         // set when the split is a plain GLU FFN
    const SparseLayerView * sparse = nullptr;  // non-null: the sparse lane runs it
    bool prompt_batch = false;  // a sparse layer's FFN over more tokens than the sparse lane takes (dense lane)
};

Route route(const ggml_cgraph * split, const WeightRegistry & registry) {
    Route r;
    if (match_glu_ffn(split, registry, r.ffn)) {
        r.model = r.ffn.model;
        r.layer = r.ffn.layer;
        const SparseLayerView * view = r.model->sparse_layer(r.layer);
        if (view != nullptr && r.ffn.x->ne[1] <= r.model->sparse_config().max_tokens) {
            r.sparse = view;
        }
        r.prompt_batch = view != nullptr && r.sparse == nullptr;
    } else if (const BoundWeight * b = first_bound_weight(split, registry)) {
        r.model = b->model.get();
        r.layer = b->layer;
        if (r.model->sparse_layer(r.layer) != nullptr) {
            r.model->stats().count_sparse_fallback();  // a sparse layer whose split is not a plain GLU FFN
        }
    }
    return r;
}

}  // namespace

SplitExecutor::SplitExecutor() {
    cpu_ = ggml_backend_cpu_init();
    if (cpu_ == nullptr) {
        GGML_ABORT("llamaflash: cannot create the internal ggml CPU backend");
    }
}

SplitExecutor::~SplitExecutor() {
    if (cpu_ != nullptr) {
        ggml_backend_free(cpu_);
    }
}

void SplitExecutor::set_n_threads(int n_threads) {
    ggml_backend_cpu_set_n_threads(cpu_, n_threads);
    n_threads_ = n_threads;
}

// The sparse lane's nodes: g = gate·x by ggml's GEMV when the bundles are in base order (and u = up·x
// too when the configuration asks for it, in memory), then the kernel's phases (sparse_lane.h).
void SplitExecutor::append_sparse(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn,
                                  const SparseLayerView & view) {
    const SparseConfig & config = ffn.model->sparse_config();
    const bool offload = ffn.model->offload() != nullptr;
    ggml_tensor * x_leaf = dense_.map_src(ffn.x);
    ggml_tensor * gate = nullptr;
    ggml_tensor * up = nullptr;
    if (view.base_order) {
        gate = dense_.mirror_node(ffn.gate);
        ggml_build_forward_expand(graph, gate);
        if (config.up_by_ggml && !offload) {
            up = dense_.mirror_node(ffn.up);
            ggml_build_forward_expand(graph, up);
        }
    }
    try {
        sparse_.append(ctx, graph, ffn, view, x_leaf, gate, up, n_threads_, config.cluster_size);
    } catch (const std::exception & e) {  // validated at open: a broken invariant, not bad input
        GGML_ABORT("llamaflash: sparse lane for layer %d: %s", ffn.layer, e.what());
    }
}

ggml_status SplitExecutor::compute(const ggml_cgraph * split) {
    const auto t_begin = std::chrono::steady_clock::now();
    const int n_nodes = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split));
    if (n_nodes == 0) {
        return GGML_STATUS_SUCCESS;
    }
    // an MoE layer's router, computed row by row (router_rows.h)
    const RouterSplit router_split = match_router_split(split);
    if (router_split.model != nullptr) {
        return routers_.compute(split, router_split, cpu_);
    }
    // a model's K-quant matmuls, every row as alone (matmul_rows.h)
    InvariantMatmuls * matmuls = nullptr;
    if (match_matmul_split(split, &matmuls)) {
        return matmul_rows_.compute(split, matmuls, cpu_);
    }
    // an MoE layer's routed experts: the expert lane (expert_lane.h)
    const ExpertSplit expert_split = match_expert_split(split);
    if (expert_split.model != nullptr) {
        return experts_.compute(split, expert_split, cpu_, n_threads_);
    }
    // 1. lane
    const Route r = route(split, WeightRegistry::instance());
    if (r.model != nullptr && r.model->offload() != nullptr && r.model->offload()->layer_stream() != nullptr) {
        return compute_streamed(split, *r.model, r.layer, t_begin);
    }
    const bool sparse = r.sparse != nullptr;
    if (sparse && r.model->offload() != nullptr && r.ffn.x->ne[1] > kSparseChunkTokens) {
        return compute_sparse_chunks(split, r.ffn, *r.sparse, t_begin);
    }
    // 2. build
    ggml_cgraph * graph = nullptr;
    ggml_context * ctx = arena_.begin(n_nodes, &graph);
    dense_.begin(ctx, split);
    if (sparse) {
        append_sparse(ctx, graph, r.ffn, *r.sparse);
    } else {
        dense_.append_all(graph);
    }
    OffloadState * offload = r.model != nullptr ? r.model->offload() : nullptr;
    const int pos = r.model != nullptr ? r.model->layer_position(r.layer) : -1;

    // 3. run
    // false: a view this split reads failed its checksums (the error is kept): nothing is computed
    const bool runnable = offload == nullptr || offload->before_split(pos, sparse, r.prompt_batch);
    const auto t0 = std::chrono::steady_clock::now();
    ggml_status status = runnable ? ggml_backend_graph_compute(cpu_, graph) : GGML_STATUS_FAILED;
    const double seconds = seconds_between(t0, std::chrono::steady_clock::now());
    const std::string failure = sparse ? sparse_.take_failure() : std::string();
    const bool ok = offload != nullptr ? offload->after_split(pos, sparse, failure) : failure.empty();
    if (offload != nullptr && r.prompt_batch) {
        prompt_buffers_.note(split, r.model, dense_.chunk_scratch_data(), dense_.chunk_scratch_bytes());
    }
    if (!ok || !runnable) {  // an I/O or checksum error in the offload lane: the split's result is not valid
        status = GGML_STATUS_FAILED;
    }
    if (r.model != nullptr) {
        status = checked_finite(split, *r.model, r.layer, status);
    }

    // 4. count
    FlashModel * counted = sparse ? r.model : dense_.model();
    if (sparse) {
        count_sparse_call(*r.model, pos, seconds);
    } else {
        for (const auto & [layer, n_tokens] : dense_.evaluations()) {
            counted->stats().count_ffn_eval(counted->layer_position(layer), n_tokens);
        }
    }
    if (counted != nullptr) {
        if (!sparse) {
            counted->stats().count_dense_call();
        }
        counted->stats().count_split(seconds, seconds_between(t_begin, t0));
    }
    ggml_free(ctx);
    return status;
}

ggml_status SplitExecutor::compute_streamed(const ggml_cgraph * split, FlashModel & model, int layer,
                                            std::chrono::steady_clock::time_point t_begin) {
    OffloadState & offload = *model.offload();
    LayerStream & stream = *offload.layer_stream();
    const int pos = model.layer_position(layer);
    LayerStream::Rows rows;
    try {
        stream.plan(pos);
        rows = stream.wait(pos, false);   // rows not checked yet: checked below, as they are multiplied
    } catch (const std::exception & e) {  // IoError: nothing is computed from the slot
        offload.set_error(e.what());
        return GGML_STATUS_FAILED;
    }
    const StreamLayerSource & source = stream.source(pos);
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const int n_nodes = ggml_graph_n_nodes(g);
    ggml_cgraph * graph = nullptr;
    ggml_context * ctx = arena_.begin(n_nodes + 1, &graph);
    dense_.begin(ctx, split);
    const WeightRegistry & registry = WeightRegistry::instance();
    const StreamPart * parts[3] = {};  // the parts checks_[k] checks
    int n_checks = 0;
    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        const BoundWeight * b = node->op == GGML_OP_MUL_MAT ? registry.lookup(node->src[0]) : nullptr;
        if (b == nullptr || b->model.get() != &model || b->layer != layer) {
            continue;
        }
        const bool gate = b->kind == FfnWeightKind::gate, up = b->kind == FfnWeightKind::up;
        const uint8_t * data = gate ? rows.gate : up ? rows.up : rows.down;
        const StreamPart & part = gate ? source.gate : up ? source.up : source.down;
        if (data == nullptr) {
            continue;  // a resident gate: the model's own weight
        }
        const ggml_tensor * phantom = node->src[0];
        ggml_tensor * w = ggml_new_tensor(ctx, phantom->type, GGML_MAX_DIMS, phantom->ne);
        w->data = const_cast<uint8_t *>(data);
        CheckedWeight * checked = nullptr;
        if (!rows.checked && !part.crc.empty() && n_checks < static_cast<int>(checks_.size())) {
            checked = &checks_[static_cast<size_t>(n_checks)];
            checked->reset(w, part.crc.data());
            parts[n_checks++] = &part;
        }
        dense_.use_weight(phantom, w, checked);
    }
    dense_.append_all(graph);

    // A slot's rows are checked once, before anything computed from them is used: by the products that
    // multiply them where every part with checksums has one, else all of them here, before computing
    // (parts ggml-cpu multiplies itself; a split that does not multiply every part)
    const auto fail = [&](const std::exception & e) {
        stream.checked(pos, false, 0);  // the slot is dropped: the layer is read again next time
        offload.set_error(e.what());
        ggml_free(ctx);
        return GGML_STATUS_FAILED;
    };
    if (!rows.checked) {
        int needed = 0, attached = 0;
        for (const StreamPart * p : {&source.gate, &source.up, &source.down}) {
            needed += p->rows > 0 && !p->crc.empty() ? 1 : 0;
        }
        for (int k = 0; k < n_checks; ++k) {
            attached += checks_[static_cast<size_t>(k)].attached ? 1 : 0;
        }
        if (attached < needed) {
            try {
                stream.wait(pos, true);  // IntegrityError, or the slot is checked
            } catch (const std::exception & e) {
                return fail(e);
            }
            n_checks = 0;  // what the products check besides is not looked at
        }
    }

    const auto t0 = std::chrono::steady_clock::now();
    ggml_status status = ggml_backend_graph_compute(cpu_, graph);
    const double seconds = seconds_between(t0, std::chrono::steady_clock::now());
    uint64_t checked_bytes = 0;
    try {
        for (int k = 0; k < n_checks; ++k) {
            const CheckedWeight & c = checks_[static_cast<size_t>(k)];
            const StreamPart & p = *parts[k];
            if (const int64_t bad = c.first_bad(); bad >= 0) {  // named as the check before computing names it
                const auto * row =
                    static_cast<const uint8_t *>(c.weight->data) + static_cast<size_t>(bad) * p.row_bytes;
                verify_rows(row, p.row_bytes, bad, 1, p.crc.data(), p.source);
                throw IntegrityError(std::string(kIntegrityErrorPrefix) + " in '" + p.source.file + "': tensor " +
                                     p.source.tensor + ", row " + std::to_string(bad) +
                                     " (it changed in memory while it was multiplied)");
            }
            checked_bytes += p.bytes();
        }
    } catch (const std::exception & e) {
        return fail(e);
    }
    if (n_checks > 0) {
        stream.checked(pos, true, checked_bytes);
    }
    status = checked_finite(split, model, layer, status);
    for (const auto & [l, n_tokens] : dense_.evaluations()) {
        model.stats().count_ffn_eval(model.layer_position(l), n_tokens);
    }
    model.stats().count_dense_call();
    model.stats().count_split(seconds, seconds_between(t_begin, t0));
    ggml_free(ctx);
    return status;
}

ggml_status SplitExecutor::compute_sparse_chunks(const ggml_cgraph * split, const GluFfnPattern & ffn,
                                                 const SparseLayerView & view,
                                                 std::chrono::steady_clock::time_point t_begin) {
    FlashModel * model = ffn.model;
    OffloadState * offload = model->offload();
    const int pos = model->layer_position(ffn.layer);
    const int64_t n_tokens = ffn.x->ne[1];
    const int n_nodes = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split));
    const auto rows_only = [&](const ggml_tensor * t) {
        return t->ne[1] == n_tokens && t->ne[2] == 1 && t->ne[3] == 1;
    };
    if (!rows_only(ffn.x) || !rows_only(ffn.gate) || !rows_only(ffn.up) || !rows_only(ffn.down)) {
        GGML_ABORT("llamaflash: layer %d's FFN split has a layout the sparse lane's token chunks do not take",
                   ffn.layer);
    }
    ggml_status status = GGML_STATUS_SUCCESS;
    double seconds = 0.0;
    const auto t_build = std::chrono::steady_clock::now();
    for (int64_t t0 = 0; t0 < n_tokens && status == GGML_STATUS_SUCCESS; t0 += kSparseChunkTokens) {
        const int64_t n = std::min(kSparseChunkTokens, n_tokens - t0);
        ggml_cgraph * graph = nullptr;
        ggml_context * ctx = arena_.begin(n_nodes + 4, &graph);
        dense_.begin(ctx, split);
        GluFfnPattern chunk = ffn;
        chunk.x = token_rows(ctx, ffn.x, t0, n);
        ggml_tensor * gate = token_rows(ctx, ffn.gate, t0, n);
        gate->src[1] = const_cast<ggml_tensor *>(chunk.x);
        chunk.gate = gate;
        chunk.up = token_rows(ctx, ffn.up, t0, n);
        chunk.down = token_rows(ctx, ffn.down, t0, n);
        append_sparse(ctx, graph, chunk, view);
        const bool runnable = offload->before_split(pos, true, false);
        const auto t0_run = std::chrono::steady_clock::now();
        status = runnable ? ggml_backend_graph_compute(cpu_, graph) : GGML_STATUS_FAILED;
        const double s = seconds_between(t0_run, std::chrono::steady_clock::now());
        seconds += s;
        if (!offload->after_split(pos, true, sparse_.take_failure()) || !runnable) {
            status = GGML_STATUS_FAILED;
        }
        count_sparse_call(*model, pos, s);
        ggml_free(ctx);
    }
    status = checked_finite(split, *model, ffn.layer, status);
    model->stats().count_split(seconds, seconds_between(t_begin, t_build));
    return status;
}

void SplitExecutor::count_sparse_call(FlashModel & model, int pos, double seconds) {
    const std::vector<int32_t> & counts = sparse_.active_counts();
    const int64_t n_tokens = static_cast<int64_t>(counts.size());
    if (sparse_.draft()) {
        model.stats().count_draft_split(pos, n_tokens, seconds);
    } else {
        model.stats().count_sparse_call(pos, counts.data(), n_tokens, seconds);
        model.stats().count_ffn_eval(pos, n_tokens);
    }
}

}  // namespace llamaflash
