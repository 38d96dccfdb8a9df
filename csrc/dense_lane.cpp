// dense_lane.cpp — see dense_lane.h.
#include "dense_lane.h"

#include "ggml-cpu.h"
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

    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(split), i);
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
        ggml_build_forward_expand(graph, m);
    }

    const auto t0 = std::chrono::steady_clock::now();
    const ggml_status status = ggml_backend_graph_compute(cpu_, graph);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (model != nullptr) {
        model->count_dense_call();
        model->count_split(seconds, std::chrono::duration<double>(t0 - t_begin).count());
    }
    ggml_free(ctx);
    return status;
}

}  // namespace llamaflash
