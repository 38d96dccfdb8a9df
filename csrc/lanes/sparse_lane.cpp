// sparse_lane.cpp — see sparse_lane.h.
#include "lanes/sparse_lane.h"

#include "backend/weight_registry.h"

#include <cstring>
#include <stdexcept>

namespace llamaflash {

namespace {

bool glu_activation(const ggml_tensor * node, FfnActivation & act) {
    switch (ggml_get_glu_op(node)) {
        case GGML_GLU_OP_SWIGLU: act = FfnActivation::silu; return true;
        case GGML_GLU_OP_GEGLU: act = FfnActivation::gelu; return true;
        case GGML_GLU_OP_REGLU: act = FfnActivation::relu; return true;
        default: return false;  // erf/quick gelu, clamped or OAI swiglu: not what the kernel computes
    }
}

bool unary_activation(const ggml_tensor * node, FfnActivation & act) {
    switch (ggml_get_unary_op(node)) {
        case GGML_UNARY_OP_SILU: act = FfnActivation::silu; return true;
        case GGML_UNARY_OP_GELU: act = FfnActivation::gelu; return true;
        case GGML_UNARY_OP_RELU: act = FfnActivation::relu; return true;
        default: return false;
    }
}

bool is_f32_rows(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) && t->ne[2] == 1 && t->ne[3] == 1;
}

// Phase nodes: userdata is the lane's SparseFfnScratch, which sparse_ffn_begin has armed.
void phase_quantize(ggml_tensor *, int ith, int nth, void * userdata) {
    sparse_ffn_quantize(*static_cast<SparseFfnScratch *>(userdata), ith, nth);
}
void phase_accumulate(ggml_tensor *, int ith, int nth, void * userdata) {
    sparse_ffn_accumulate(*static_cast<SparseFfnScratch *>(userdata), ith, nth);
}
void phase_reduce(ggml_tensor *, int ith, int nth, void * userdata) {
    sparse_ffn_reduce(*static_cast<SparseFfnScratch *>(userdata), ith, nth);
}

}  // namespace

// The cluster phase nodes (userdata: the lane), in memory and offload. Thread 0 plans (and, in
// offload, talks to the cache); the graph's barriers between nodes order that with the other
// threads' work.
struct ClusterPhases {
    static void quantize_plan(ggml_tensor *, int ith, int nth, void * userdata) {
        SparseLane & lane = *static_cast<SparseLane *>(userdata);
        sparse_ffn_quantize(lane.scratch_, ith, nth);
        if (ith != 0) return;
        try {
            sparse_ffn_needed_clusters(lane.scratch_, lane.needed_.data());
            if (lane.cache_ == nullptr || lane.draft_ == DraftMode::copy) {  // every needed cluster is ready
                lane.plan_.ready.clear();
                lane.plan_.pending.clear();
                for (size_t c = 0; c < lane.needed_.size(); ++c) {
                    if (lane.needed_[c]) lane.plan_.ready.push_back(static_cast<int32_t>(c));
                }
            } else if (lane.draft_ == DraftMode::none) {
                lane.cache_->plan(lane.cache_layer_, lane.needed_.data(), lane.plan_);
            } else {
                lane.cache_->plan_resident(lane.cache_layer_, lane.needed_.data(), lane.plan_);
                if (lane.draft_ == DraftMode::mixed) {  // the needed clusters not resident: from the draft copy
                    for (int32_t c : lane.plan_.ready) lane.needed_[static_cast<size_t>(c)] = 0;
                    for (size_t c = 0; c < lane.needed_.size(); ++c) {
                        if (lane.needed_[c]) lane.plan_.pending.push_back(static_cast<int32_t>(c));
                    }
                }
            }
        } catch (const std::exception & e) {
            lane.fail(e.what());
        }
    }
    // the listed clusters of the plan, unless an earlier phase failed: thread ith takes a contiguous
    // part of the list and, when the rows are the cache's, checks each cluster's slot right before
    // computing it (NeuronCache::check_cluster: a no-op for a checked slot; the rows are then in this
    // core's cache for the computation). A failed check fails the compute before the cluster is used.
    static void accumulate(SparseLane & lane, const std::vector<int32_t> & clusters, int ith, int nth,
                           bool cache_rows) {
        if (lane.failed_.load(std::memory_order_acquire)) return;
        const int64_t n = static_cast<int64_t>(clusters.size());
        const int64_t begin = n * ith / nth, end = n * (ith + 1) / nth;
        if (!cache_rows) {
            sparse_ffn_accumulate_clusters(lane.scratch_, ith, clusters.data() + begin, end - begin);
            return;
        }
        for (int64_t k = begin; k < end; ++k) {
            try {
                lane.cache_->check_cluster(lane.cache_layer_, clusters[static_cast<size_t>(k)]);
            } catch (const std::exception & e) {
                lane.fail(e.what());
                return;
            }
            sparse_ffn_accumulate_clusters(lane.scratch_, ith, clusters.data() + k, 1);
        }
    }
    static void accumulate_ready(ggml_tensor *, int ith, int nth, void * userdata) {
        SparseLane & lane = *static_cast<SparseLane *>(userdata);
        accumulate(lane, lane.plan_.ready, ith, nth, lane.ready_from_cache());
    }
    // offload, an exact pass: thread 0 waits for the layer's reads; a mixed draft: thread 0 points
    // the kernel's rows at the draft copy for the pending clusters
    static void wait_reads(ggml_tensor *, int ith, int, void * userdata) {
        SparseLane & lane = *static_cast<SparseLane *>(userdata);
        if (ith != 0 || lane.cache_ == nullptr) return;
        if (lane.draft_ == DraftMode::mixed) {
            sparse_ffn_rebind_cluster_rows(lane.scratch_, lane.copy_type_, lane.copy_type_, lane.copy_up_.data(),
                                           lane.copy_down_t_.data());
            return;
        }
        if (lane.draft_ != DraftMode::none || lane.failed_.load(std::memory_order_acquire)) return;
        try {
            lane.cache_->wait(lane.cache_layer_);
        } catch (const std::exception & e) {
            lane.fail(e.what());
        }
    }
    static void accumulate_pending(ggml_tensor *, int ith, int nth, void * userdata) {
        SparseLane & lane = *static_cast<SparseLane *>(userdata);
        accumulate(lane, lane.plan_.pending, ith, nth, lane.pending_from_cache());
    }
    static void reduce(ggml_tensor *, int ith, int nth, void * userdata) {
        sparse_ffn_reduce_clusters(static_cast<SparseLane *>(userdata)->scratch_, ith, nth);
    }
};

void SparseLane::fail(const std::string & message) {
    if (!failed_.exchange(true)) {
        failure_ = message;
    }
}

std::string SparseLane::take_failure() {
    std::string out;
    if (failed_.exchange(false)) {
        out.swap(failure_);
    }
    return out;
}

bool match_glu_ffn(const ggml_cgraph * split, const WeightRegistry & registry, GluFfnPattern & out) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const int n = ggml_graph_n_nodes(g);
    GluFfnPattern p;
    const ggml_tensor * act_node = nullptr;  // GLU, or the UNARY of MUL(UNARY(gate), up)
    const ggml_tensor * mul_node = nullptr;
    const ggml_tensor * h = nullptr;  // the input of down
    for (int i = 0; i < n; ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        switch (node->op) {
            case GGML_OP_MUL_MAT: {
                const BoundWeight * b = registry.lookup(node->src[0]);
                if (b == nullptr || (p.model != nullptr && (b->model.get() != p.model || b->layer != p.layer))) {
                    return false;
                }
                p.model = b->model.get();
                p.layer = b->layer;
                const ggml_tensor *& slot = b->kind == FfnWeightKind::gate ? p.gate
                                            : b->kind == FfnWeightKind::up ? p.up
                                                                           : p.down;
                if (slot != nullptr) {
                    return false;
                }
                slot = node;
                break;
            }
            case GGML_OP_GLU:
            case GGML_OP_UNARY:
                if (act_node != nullptr) {
                    return false;
                }
                act_node = node;
                break;
            case GGML_OP_MUL:
                if (mul_node != nullptr) {
                    return false;
                }
                mul_node = node;
                break;
            default: return false;
        }
    }
    if (p.gate == nullptr || p.up == nullptr || p.down == nullptr || act_node == nullptr) {
        return false;
    }
    p.x = p.gate->src[1];
    if (p.up->src[1] != p.x || !is_f32_rows(p.x) || !is_f32_rows(p.down) || !is_f32_rows(p.gate) ||
        p.x->ne[0] != p.gate->src[0]->ne[0] || p.down->ne[1] != p.x->ne[1]) {
        return false;
    }
    if (act_node->op == GGML_OP_GLU) {
        const bool swapped = act_node->op_params[1] != 0;  // ggml_glu: op_params = {op, swapped}
        const ggml_tensor * a = swapped ? act_node->src[1] : act_node->src[0];
        const ggml_tensor * b = swapped ? act_node->src[0] : act_node->src[1];
        if (mul_node != nullptr || a != p.gate || b != p.up || !glu_activation(act_node, p.activation)) {
            return false;
        }
        h = act_node;
    } else {
        if (mul_node == nullptr || act_node->src[0] != p.gate || !unary_activation(act_node, p.activation)) {
            return false;
        }
        const bool ordered = (mul_node->src[0] == act_node && mul_node->src[1] == p.up) ||
                             (mul_node->src[1] == act_node && mul_node->src[0] == p.up);
        if (!ordered) {
            return false;
        }
        h = mul_node;
    }
    if (p.down->src[1] != h) {
        return false;
    }
    out = p;
    return true;
}

void SparseLane::append(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn,
                        const SparseLayerView & view, ggml_tensor * x_leaf, ggml_tensor * gate, ggml_tensor * up,
                        int n_threads, int cluster_size) {
    const int64_t n_tokens = ffn.x->ne[1];
    layer_ = view.kernel;
    params_ = SparseFfnParams{};
    params_.threshold = ffn.model->threshold(ffn.layer);
    params_.n_threads = n_threads;
    params_.cluster_size = cluster_size;
    if (gate != nullptr) {
        params_.gate_values = static_cast<const float *>(gate->data);
        params_.gate_values_stride = gate->nb[1] / sizeof(float);
    }
    if (up != nullptr) {
        params_.up_values = static_cast<const float *>(up->data);
        params_.up_values_stride = up->nb[1] / sizeof(float);
    }
    batch_ = SparseFfnBatch{};
    batch_.x = static_cast<const float *>(ffn.x->data);
    batch_.x_stride = ffn.x->nb[1];
    batch_.y = static_cast<float *>(ffn.down->data);
    batch_.y_stride = ffn.down->nb[1];
    batch_.n_tokens = n_tokens;
    counts_.assign(static_cast<size_t>(n_tokens), 0);
    batch_.active_counts = counts_.data();
    // With gate values from ggml (and u from the kernel) the split runs cluster by cluster and y is
    // reduced in cluster order, in memory as in offload: the same bits whether the rows come from
    // the mapping or from the neuron cache (sparse_ffn.h, cluster phase).
    const bool by_cluster = sparse_ffn_by_cluster(params_);
    OffloadState * offload = ffn.model->offload();
    cache_ = offload != nullptr ? offload->cache() : nullptr;
    draft_ = DraftMode::none;
    const size_t nc = static_cast<size_t>((layer_.n_ff + cluster_size - 1) / cluster_size);
    if (by_cluster) {
        needed_.assign(nc, 0);
    }
    if (cache_ != nullptr) {
        if (!by_cluster) {
            throw std::invalid_argument("flash offload needs the gate values from ggml and the up rows from the cache");
        }
        cache_layer_ = ffn.model->layer_position(ffn.layer);
        if (params_.cluster_size != cache_->cluster_size() ||
            cache_->n_clusters(cache_layer_) != static_cast<int64_t>(nc)) {
            throw std::invalid_argument(
                "the neuron cache's clusters differ from the kernel's (cluster size, layer shape)");
        }
        plan_.reset(static_cast<int64_t>(nc));  // plan() refills it in place: the kernel keeps these pointers
        layer_.up_slots = plan_.up.data();
        layer_.down_t_slots = plan_.down_t.data();
        if (offload->draft()) {
            draft_ = DraftMode::resident;
            if (const OffloadState::DraftRows * copy = offload->draft_rows(cache_layer_)) {
                use_draft_copy(*copy, nc, cluster_size);
            }
        }
    }
    sparse_ffn_begin(layer_, params_, batch_, scratch_);
    if (by_cluster) {
        append_by_cluster(ctx, graph, ffn, x_leaf, gate);
    } else {
        append_by_range(ctx, graph, ffn, x_leaf, gate, up);
    }
}

void SparseLane::use_draft_copy(const OffloadState::DraftRows & copy, size_t n_clusters, int cluster_size) {
    // every cluster's rows are in the resident low-bit copy (cluster c = rows [c·C, (c+1)·C) of the
    // copy); nothing is read, the cache untouched
    const size_t span = static_cast<size_t>(cluster_size) * copy.row_bytes;
    copy_up_.resize(n_clusters);
    copy_down_t_.resize(n_clusters);
    for (size_t c = 0; c < n_clusters; ++c) {
        copy_up_[c] = copy.up + c * span;
        copy_down_t_[c] = copy.down_t + c * span;
    }
    copy_type_ = copy.type;
    if (sparse_ffn_can_rebind(layer_, copy.type, copy.type)) {
        draft_ = DraftMode::mixed;
        return;
    }
    draft_ = DraftMode::copy;
    layer_.up_type = layer_.down_t_type = copy.type;
    layer_.up_row_bytes = layer_.down_t_row_bytes = copy.row_bytes;
    layer_.up_slots = copy_up_.data();
    layer_.down_t_slots = copy_down_t_.data();
}

ggml_tensor * SparseLane::phase_node(ggml_context * ctx, ggml_tensor ** args, int n_args, ggml_custom_op_t op,
                                     void * userdata, float * output, const char * name, int layer) {
    ggml_tensor * node = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, n_args, op, GGML_N_TASKS_MAX, userdata);
    node->data = output;
    ggml_format_name(node, "llamaflash.sparse.%s-%d", name, layer);
    return node;
}

void SparseLane::append_output(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn, ggml_tensor * prev,
                               ggml_custom_op_t op, void * userdata) {
    ggml_tensor * args[1] = {prev};
    ggml_tensor * y = ggml_custom_4d(ctx, GGML_TYPE_F32, ffn.down->ne[0], ffn.down->ne[1], 1, 1, args, 1, op,
                                     GGML_N_TASKS_MAX, userdata);
    y->data = ffn.down->data;
    y->buffer = ffn.down->buffer;
    std::memcpy(y->nb, ffn.down->nb, sizeof(y->nb));
    std::memcpy(y->name, ffn.down->name, sizeof(y->name));
    ggml_build_forward_expand(graph, y);
}

// Each phase node depends on the previous one, so the graph keeps them in order; the first depends
// on x (and g, u), so it runs after them.
void SparseLane::append_by_range(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn,
                                 ggml_tensor * x_leaf, ggml_tensor * gate, ggml_tensor * up) {
    ggml_tensor * args[3] = {x_leaf, nullptr, nullptr};
    int n_args = 1;
    for (ggml_tensor * t : {gate, up}) {
        if (t != nullptr) args[n_args++] = t;
    }
    ggml_tensor * prev =
        phase_node(ctx, args, n_args, phase_quantize, &scratch_, phase_outputs_, "quantize", ffn.layer);
    ggml_tensor * args_a[1] = {prev};
    prev = phase_node(ctx, args_a, 1, phase_accumulate, &scratch_, phase_outputs_ + 4, "accumulate", ffn.layer);
    append_output(ctx, graph, ffn, prev, phase_reduce, &scratch_);
}

void SparseLane::append_by_cluster(ggml_context * ctx, ggml_cgraph * graph, const GluFfnPattern & ffn,
                                   ggml_tensor * x_leaf, ggml_tensor * gate) {
    const ggml_custom_op_t phases[4] = {ClusterPhases::accumulate_ready, ClusterPhases::wait_reads,
                                        ClusterPhases::accumulate_pending, nullptr};
    const char * names[4] = {"accumulate-ready", "wait", "accumulate-pending", nullptr};
    ggml_tensor * args_q[2] = {x_leaf, gate};
    ggml_tensor * prev =
        phase_node(ctx, args_q, 2, ClusterPhases::quantize_plan, this, phase_outputs_, "quantize-plan", ffn.layer);
    for (int k = 0; phases[k] != nullptr; ++k) {
        ggml_tensor * args[1] = {prev};
        prev = phase_node(ctx, args, 1, phases[k], this, phase_outputs_ + 4 + 2 * k, names[k], ffn.layer);
    }
    append_output(ctx, graph, ffn, prev, ClusterPhases::reduce, this);
}

}  // namespace llamaflash
