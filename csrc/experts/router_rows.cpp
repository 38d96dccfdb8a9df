// router_rows.cpp — see router_rows.h.
#include "experts/router_rows.h"

#include "backend/weight_registry.h"

namespace llamaflash {

RouterSplit match_router_split(const ggml_cgraph * split) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    if (ggml_graph_n_nodes(g) == 0) {
        return RouterSplit{};
    }
    const ggml_tensor * node = ggml_graph_node(g, 0);
    if (node->op != GGML_OP_MUL_MAT) {
        return RouterSplit{};
    }
    const BoundWeight * b = WeightRegistry::instance().lookup(node->src[0]);
    if (b == nullptr || !b->router) {
        return RouterSplit{};
    }
    return RouterSplit{b->experts.get(), b->experts->position(b->layer), node};
}

ggml_status RouterRows::compute(const ggml_cgraph * split, const RouterSplit & match, ggml_backend_t cpu) {
    const ggml_tensor * node = match.node;
    const ggml_tensor * w = node->src[0];
    const ggml_tensor * x = node->src[1];
    const ExpertLayerSpec & spec = match.model->layer_spec(match.position);
    if (ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split)) != 1) {
        GGML_ABORT("llamaflash: the router '%s' shares its split with other nodes (an unsupported graph pattern)",
                   w->name);
    }
    const int64_t n_embd = w->ne[0], n_expert = w->ne[1], n_tokens = x->ne[1];
    if (w->type != GGML_TYPE_F32 || n_expert != spec.n_expert || n_embd != match.model->config().n_embd ||
        spec.router.size() != static_cast<size_t>(n_embd * n_expert) || x->type != GGML_TYPE_F32 ||
        x->ne[0] != n_embd || x->nb[0] != sizeof(float) || x->ne[2] != 1 || x->ne[3] != 1 ||
        node->type != GGML_TYPE_F32 || node->nb[0] != sizeof(float) || node->ne[1] != n_tokens) {
        GGML_ABORT("llamaflash: router '%s' differs from the engine's copy or its MUL_MAT has another shape", w->name);
    }
    // one "expert" (the router, n_expert rows of n_embd), the pairs (k = 0, t) for every token
    dots_.type = GGML_TYPE_F32;
    dots_.ne0 = n_embd;
    dots_.ne1 = n_expert;
    dots_.row_bytes = static_cast<size_t>(n_embd) * sizeof(float);
    dots_.pairs.resize(static_cast<size_t>(2 * n_tokens));
    for (int64_t t = 0; t < n_tokens; ++t) {
        dots_.pairs[static_cast<size_t>(2 * t)] = 0;
        dots_.pairs[static_cast<size_t>(2 * t + 1)] = static_cast<int32_t>(t);
    }
    dots_.weights.assign(static_cast<size_t>(n_tokens), reinterpret_cast<const uint8_t *>(spec.router.data()));
    dots_.zero_pairs.clear();

    ggml_cgraph * graph = nullptr;
    ggml_context * ctx = arena_.begin_tensors(4, &graph);
    // x as [n_embd, 1, T] (token t at t * nb[1]); the output as [n_expert, 1, T] over the node's memory
    ggml_tensor * rows = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, n_tokens);
    rows->data = x->data;
    rows->nb[2] = rows->nb[3] = x->nb[1];
    ggml_tensor * out =
        ggml_custom_4d(ctx, GGML_TYPE_F32, n_expert, 1, n_tokens, 1, &rows, 1, expert_dots, GGML_N_TASKS_MAX, &dots_);
    out->nb[2] = out->nb[3] = node->nb[1];
    out->data = node->data;
    out->buffer = node->buffer;
    ggml_build_forward_expand(graph, out);
    const ggml_status status = ggml_backend_graph_compute(cpu, graph);
    ggml_free(ctx);
    return status;
}

}  // namespace llamaflash
