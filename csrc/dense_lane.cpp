// dense_lane.cpp — see dense_lane.h.
#include "dense_lane.h"

#include "ggml-cpu.h"
#include "sparse_lane.h"
#include "weight_registry.h"

#include <chrono>
#include <cstring>
#include <unordered_map>

namespace llamaflash {

namespace {

// A leaf over `t`'s memory: same type, shape and strides, no op, so the private graph never
// recomputes anything that was computed outside the split.
ggml_tensor * leaf_over(ggml_context * ctx, const ggml_tensor * t) {
    ggml_tensor * leaf = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
    std::memcpy(leaf->nb, t->nb, sizeof(leaf->nb));
    leaf->data = t->data;
    leaf->buffer = t->buffer;
    leaf->extra = t->extra;
    std::memcpy(leaf->name, t->name, sizeof(leaf->name));
    return leaf;
}

// Row 2i + parity of z [2·n_ff, T] -> row i of dst [n_ff, T] (parity 0: gate, 1: up).
constexpr int64_t kMaxFusedTokens = 4;
const int kGateParity = 0;
const int kUpParity = 1;

void deinterleave_gate_up(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const int parity = *static_cast<const int *>(userdata);
    const ggml_tensor * z = dst->src[0];
    const int64_t n_ff = dst->ne[0];
    const int64_t n_rows = ggml_nrows(dst);
    // split the rows over threads; a single row (decode) is split by columns
    const int64_t per_row_parts = n_rows >= nth ? 1 : nth;
    for (int64_t task = ith; task < n_rows * per_row_parts; task += nth) {
        const int64_t r = task / per_row_parts;
        const int64_t part = task % per_row_parts;
        const int64_t i0 = n_ff * part / per_row_parts, i1 = n_ff * (part + 1) / per_row_parts;
        const float * zr = reinterpret_cast<const float *>(static_cast<const char *>(z->data) + r * z->nb[1]);
        float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + r * dst->nb[1]);
        for (int64_t i = i0; i < i1; ++i) {
            out[i] = zr[2 * i + parity];
        }
    }
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

}  // namespace

DenseLane::DenseLane() {
    cpu_ = ggml_backend_cpu_init();
    if (cpu_ == nullptr) {
        GGML_ABORT("llamaflash: cannot create the internal ggml CPU backend");
    }
}

DenseLane::~DenseLane() {
    if (cpu_ != nullptr) {
        ggml_backend_free(cpu_);
    }
}

void DenseLane::set_n_threads(int n_threads) {
    ggml_backend_cpu_set_n_threads(cpu_, n_threads);
    n_threads_ = n_threads;
}

ggml_status DenseLane::compute(const ggml_cgraph * split) {
    const auto t_begin = std::chrono::steady_clock::now();
    const int n_nodes = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split));
    if (n_nodes == 0) {
        return GGML_STATUS_SUCCESS;
    }
    const size_t max_tensors = static_cast<size_t>(n_nodes) * (GGML_MAX_SRC + 1);
    const size_t need = max_tensors * ggml_tensor_overhead() + ggml_graph_overhead_custom(max_tensors, false);
    if (arena_.size() < need) {
        arena_.resize(need);
    }
    ggml_init_params params = {arena_.size(), arena_.data(), true};
    ggml_context * ctx = ggml_init(params);

    WeightRegistry & registry = WeightRegistry::instance();
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirror;
    mirror.reserve(max_tensors);
    ggml_cgraph * graph = ggml_new_graph_custom(ctx, max_tensors, false);
    FlashModel * model = nullptr;

    auto map_src = [&](const ggml_tensor * src) -> ggml_tensor * {
        auto it = mirror.find(src);
        if (it != mirror.end()) {
            return it->second;
        }
        ggml_tensor * mapped = nullptr;
        if (const BoundWeight * bound = registry.lookup(src)) {
            mapped = bound->model->dense_weight(bound->layer, bound->kind);
            if (mapped == nullptr) {
                GGML_ABORT("llamaflash: no resident weight for phantom '%s' (dense weights not loaded)", src->name);
            }
            if (!ggml_are_same_shape(mapped, src) || mapped->type != src->type) {
                GGML_ABORT("llamaflash: resident weight for '%s' has another shape/type than llama.cpp expects",
                           src->name);
            }
            model = bound->model.get();
        } else if (src->op == GGML_OP_NONE) {
            mapped = const_cast<ggml_tensor *>(src);  // a weight or input: already a leaf (keeps buffer/extra)
        } else {
            mapped = leaf_over(ctx, src);
        }
        mirror.emplace(src, mapped);
        return mapped;
    };

    // Gate and up projections of a layer whose bundles are one interleaved matrix (fused_gate_up):
    // ONE matmul streams the bundles once, z = [gate_0·x, up_0·x, gate_1·x, ...], and two cheap
    // element-wise ops split z into the memory the scheduler gave the original gate and up nodes.
    // (Two strided matmuls would each drag the other's rows through the cache: ~2x the bytes.) Only
    // for small batches (decode), which are bandwidth bound; batched matmuls are compute bound and a
    // [2·n_ff, T] scratch product would add to peak memory.
    size_t n_fused = 0;
    auto try_fuse = [&](int i, const ggml_tensor * node) -> bool {
        if (node->op != GGML_OP_MUL_MAT || mirror.count(node) || !ggml_is_contiguous(node) ||
            node->src[1]->type != GGML_TYPE_F32 || ggml_nrows(node->src[1]) > kMaxFusedTokens) {
            return false;
        }
        const BoundWeight * bound = registry.lookup(node->src[0]);
        if (bound == nullptr || bound->kind == FfnWeightKind::down) {
            return false;
        }
        ggml_tensor * both = bound->model->fused_gate_up(bound->layer);
        if (both == nullptr) {
            return false;
        }
        const FfnWeightKind other_kind = bound->kind == FfnWeightKind::gate ? FfnWeightKind::up : FfnWeightKind::gate;
        const ggml_tensor * partner = nullptr;
        for (int j = i + 1; j < n_nodes && partner == nullptr; ++j) {
            const ggml_tensor * cand = ggml_graph_node(const_cast<ggml_cgraph *>(split), j);
            const BoundWeight * b = cand->op == GGML_OP_MUL_MAT ? registry.lookup(cand->src[0]) : nullptr;
            if (b != nullptr && b->model == bound->model && b->layer == bound->layer && b->kind == other_kind &&
                cand->src[1] == node->src[1] && ggml_is_contiguous(cand)) {
                partner = cand;
            }
        }
        if (partner == nullptr) {
            return false;
        }
        if (scratch_.size() <= n_fused) {
            scratch_.resize(n_fused + 1);
        }
        ggml_tensor * z = ggml_mul_mat(ctx, both, map_src(node->src[1]));
        std::vector<float> & mem = scratch_[n_fused++];
        mem.resize(static_cast<size_t>(ggml_nelements(z)));
        z->data = mem.data();
        model = bound->model.get();
        for (const ggml_tensor * orig : {node, partner}) {
            const bool is_gate = registry.lookup(orig->src[0])->kind == FfnWeightKind::gate;
            ggml_tensor * args[1] = {z};
            ggml_tensor * m = ggml_custom_4d(ctx, GGML_TYPE_F32, orig->ne[0], orig->ne[1], orig->ne[2], orig->ne[3],
                                             args, 1, deinterleave_gate_up, GGML_N_TASKS_MAX,
                                             const_cast<int *>(is_gate ? &kGateParity : &kUpParity));
            m->data = orig->data;
            m->buffer = orig->buffer;
            std::memcpy(m->name, orig->name, sizeof(m->name));
            mirror.emplace(orig, m);
        }
        return true;
    };

    // a node of the split, computed by the same op over mirrored sources into the same memory
    auto mirror_node = [&](const ggml_tensor * node) -> ggml_tensor * {
        ggml_tensor * m = ggml_new_tensor(ctx, node->type, GGML_MAX_DIMS, node->ne);
        std::memcpy(m->nb, node->nb, sizeof(m->nb));
        m->op = node->op;
        std::memcpy(m->op_params, node->op_params, sizeof(m->op_params));
        m->flags = node->flags;
        m->data = node->data;
        m->buffer = node->buffer;
        m->extra = node->extra;
        std::memcpy(m->name, node->name, sizeof(m->name));
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            m->src[j] = node->src[j] != nullptr ? map_src(node->src[j]) : nullptr;
        }
        if (node->op == GGML_OP_MUL_MAT && model != nullptr) {
            if (const BoundWeight * bound = registry.lookup(node->src[0])) {
                if (bound->kind == FfnWeightKind::down) {
                    model->count_ffn_eval(bound->layer, node->ne[1]);
                }
            }
        }
        mirror.emplace(node, m);
        return m;
    };

    // The sparse lane, when the split is a plain GLU FFN of a layer with a threshold and the batch
    // is decode-sized (sparse_lane.h); everything else runs dense below.
    bool sparse = false;
    bool tuned = false;  // an eligible split: its time goes into the lane choice (per batch size)
    GluFfnPattern ffn;
    if (match_glu_ffn(split, registry, ffn)) {
        const SparseLayerView * view = ffn.model->sparse_layer(ffn.layer);
        const SparseConfig & config = ffn.model->sparse_config();
        tuned = view != nullptr && ffn.x->ne[1] <= config.max_tokens;
        // an eligible split runs sparse unless the lane choice (measured or measuring) says dense
        if (tuned && ffn.model->choose_sparse(ffn.layer, ffn.x->ne[1])) {
            model = ffn.model;
            ggml_tensor * x_leaf = map_src(ffn.x);
            ggml_tensor * gate = nullptr;
            ggml_tensor * up = nullptr;
            const bool offload = ffn.model->neuron_cache() != nullptr;  // gate by ggml, up from the cache
            if ((config.gate_by_ggml || offload) && view->base_order) {
                gate = mirror_node(ffn.gate);
                ggml_build_forward_expand(graph, gate);
                if (config.up_by_ggml && !offload) {
                    up = mirror_node(ffn.up);
                    ggml_build_forward_expand(graph, up);
                }
            }
            try {
                sparse_.append(ctx, graph, ffn, *view, x_leaf, gate, up, n_threads_, config.cluster_size);
            } catch (const std::exception & e) {  // validated at load: a broken invariant, not bad input
                GGML_ABORT("llamaflash: sparse lane for layer %d: %s", ffn.layer, e.what());
            }
            sparse = true;
            // a streamed gate (offload): the next layer's is read while this split computes
            ffn.model->stream_gate_ahead(ffn.model->next_layer(ffn.layer));
        }
    } else if (const BoundWeight * b = first_bound_weight(split, registry)) {
        if (b->model->sparse_layer(b->layer) != nullptr) {
            b->model->count_sparse_fallback();
        }
    }

    for (int i = 0; i < n_nodes && !sparse; ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(split), i);
        if (mirror.count(node)) {
            ggml_build_forward_expand(graph, mirror.at(node));  // produced by a fused gate/up pair
            continue;
        }
        if (try_fuse(i, node)) {
            ggml_build_forward_expand(graph, mirror.at(node));
            continue;
        }
        ggml_build_forward_expand(graph, mirror_node(node));
    }

    const auto t0 = std::chrono::steady_clock::now();
    ggml_status status = ggml_backend_graph_compute(cpu_, graph);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sparse) {
        ffn.model->release_gate(ffn.layer);
        sparse_.account(seconds);
        const std::string failure = sparse_.take_failure();
        if (!failure.empty()) {  // an I/O error in the offload lane: the split's result is not valid
            ffn.model->set_error(failure);
            status = GGML_STATUS_FAILED;
        }
    } else if (const BoundWeight * b = first_bound_weight(split, registry); b != nullptr && b->model->offload_layout()) {
        b->model->release_streamed(b->layer);  // a dense (prefill) split streamed its layer's up/down pages
    }
    if (tuned) {
        ffn.model->record_lane_time(ffn.layer, ffn.x->ne[1], sparse, seconds);
    }
    if (model != nullptr) {
        if (!sparse) {
            model->count_dense_call();
        }
        model->count_split(seconds, std::chrono::duration<double>(t0 - t_begin).count());
    }
    ggml_free(ctx);
    return status;
}

}  // namespace llamaflash
