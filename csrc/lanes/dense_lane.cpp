// dense_lane.cpp — see dense_lane.h.
#include "lanes/dense_lane.h"

#include "backend/weight_registry.h"
#include "lanes/graph_mirror.h"
#include "model/flash_model.h"

#include <cstring>

namespace llamaflash {

namespace {

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

}  // namespace

void DenseLane::begin(ggml_context * ctx, const ggml_cgraph * split) {
    ctx_ = ctx;
    split_ = split;
    n_nodes_ = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split));
    mirror_.clear();
    mirror_.reserve(static_cast<size_t>(n_nodes_) * (GGML_MAX_SRC + 1));
    n_fused_ = 0;
    model_ = nullptr;
    evaluations_.clear();
}

ggml_tensor * DenseLane::map_src(const ggml_tensor * src) {
    auto it = mirror_.find(src);
    if (it != mirror_.end()) {
        return it->second;
    }
    ggml_tensor * mapped = nullptr;
    if (const BoundWeight * bound = WeightRegistry::instance().lookup(src)) {
        mapped = bound->model->dense_weight(bound->layer, bound->kind);
        if (mapped == nullptr) {
            GGML_ABORT("llamaflash: no resident weight for phantom '%s' (dense weights not loaded)", src->name);
        }
        if (!ggml_are_same_shape(mapped, src) || mapped->type != src->type) {
            GGML_ABORT("llamaflash: resident weight for '%s' has another shape/type than llama.cpp expects", src->name);
        }
        model_ = bound->model.get();
    } else if (src->op == GGML_OP_NONE) {
        mapped = const_cast<ggml_tensor *>(src);  // a weight or input: already a leaf (keeps buffer/extra)
    } else {
        mapped = leaf_over(ctx_, src);
    }
    mirror_.emplace(src, mapped);
    return mapped;
}

ggml_tensor * DenseLane::mirror_node(const ggml_tensor * node) {
    ggml_tensor * m = node_copy(ctx_, node);
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        m->src[j] = node->src[j] != nullptr ? map_src(node->src[j]) : nullptr;
    }
    if (node->op == GGML_OP_MUL_MAT && model_ != nullptr) {
        if (const BoundWeight * bound = WeightRegistry::instance().lookup(node->src[0])) {
            if (bound->kind == FfnWeightKind::down) {
                evaluations_.emplace_back(bound->layer, node->ne[1]);
            }
        }
    }
    mirror_.emplace(node, m);
    return m;
}

// Gate and up projections of a layer whose bundles are one interleaved matrix (see dense_lane.h).
// Two strided matmuls would each drag the other's rows through the cache: ~2x the bytes. Only for
// small batches (decode), which are bandwidth bound; batched matmuls are compute bound and a
// [2·n_ff, T] scratch product would add to peak memory.
bool DenseLane::try_fuse(int i, const ggml_tensor * node) {
    const WeightRegistry & registry = WeightRegistry::instance();
    if (node->op != GGML_OP_MUL_MAT || mirror_.count(node) || !ggml_is_contiguous(node) ||
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
    for (int j = i + 1; j < n_nodes_ && partner == nullptr; ++j) {
        const ggml_tensor * cand = ggml_graph_node(const_cast<ggml_cgraph *>(split_), j);
        const BoundWeight * b = cand->op == GGML_OP_MUL_MAT ? registry.lookup(cand->src[0]) : nullptr;
        if (b != nullptr && b->model == bound->model && b->layer == bound->layer && b->kind == other_kind &&
            cand->src[1] == node->src[1] && ggml_is_contiguous(cand)) {
            partner = cand;
        }
    }
    if (partner == nullptr) {
        return false;
    }
    if (scratch_.size() <= n_fused_) {
        scratch_.resize(n_fused_ + 1);
    }
    ggml_tensor * z = ggml_mul_mat(ctx_, both, map_src(node->src[1]));
    std::vector<float> & mem = scratch_[n_fused_++];
    mem.resize(static_cast<size_t>(ggml_nelements(z)));
    z->data = mem.data();
    model_ = bound->model.get();
    for (const ggml_tensor * orig : {node, partner}) {
        const bool is_gate = registry.lookup(orig->src[0])->kind == FfnWeightKind::gate;
        ggml_tensor * args[1] = {z};
        ggml_tensor * m = ggml_custom_4d(ctx_, GGML_TYPE_F32, orig->ne[0], orig->ne[1], orig->ne[2], orig->ne[3], args,
                                         1, deinterleave_gate_up, GGML_N_TASKS_MAX,
                                         const_cast<int *>(is_gate ? &kGateParity : &kUpParity));
        m->data = orig->data;
        m->buffer = orig->buffer;
        std::memcpy(m->name, orig->name, sizeof(m->name));
        mirror_.emplace(orig, m);
    }
    return true;
}

void DenseLane::append_all(ggml_cgraph * graph) {
    for (int i = 0; i < n_nodes_; ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(split_), i);
        if (mirror_.count(node)) {
            ggml_build_forward_expand(graph, mirror_.at(node));  // produced by a fused gate/up pair
            continue;
        }
        if (try_fuse(i, node)) {
            ggml_build_forward_expand(graph, mirror_.at(node));
            continue;
        }
        ggml_build_forward_expand(graph, mirror_node(node));
    }
}

}  // namespace llamaflash
