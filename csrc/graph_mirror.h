// graph_mirror.h — what the lanes share to rebuild a graph split as a private ggml graph.
//
// A lane mirrors the nodes of a split into a private graph (no_alloc metadata in an arena reused
// across splits) whose nodes write into the memory the scheduler allocated for the split's nodes.
// Tensors computed outside the split become leaves over their memory, so nothing is recomputed.
#pragma once

#include "ggml.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace llamaflash {

// A leaf over `t`'s memory: same type, shape and strides, no op.
inline ggml_tensor * leaf_over(ggml_context * ctx, const ggml_tensor * t) {
    ggml_tensor * leaf = ggml_new_tensor(ctx, t->type, GGML_MAX_DIMS, t->ne);
    std::memcpy(leaf->nb, t->nb, sizeof(leaf->nb));
    leaf->data = t->data;
    leaf->buffer = t->buffer;
    leaf->extra = t->extra;
    std::memcpy(leaf->name, t->name, sizeof(leaf->name));
    return leaf;
}

// A node of the private graph computing `node`'s op into `node`'s memory (type, shape, strides, op
// and its parameters, flags, data, buffer, name); the caller sets its sources.
inline ggml_tensor * node_copy(ggml_context * ctx, const ggml_tensor * node) {
    ggml_tensor * m = ggml_new_tensor(ctx, node->type, GGML_MAX_DIMS, node->ne);
    std::memcpy(m->nb, node->nb, sizeof(m->nb));
    m->op = node->op;
    std::memcpy(m->op_params, node->op_params, sizeof(m->op_params));
    m->flags = node->flags;
    m->data = node->data;
    m->buffer = node->buffer;
    m->extra = node->extra;
    std::memcpy(m->name, node->name, sizeof(m->name));
    return m;
}

// Metadata memory for the private graph of a split of n_nodes nodes (each with up to GGML_MAX_SRC
// sources mirrored), grown as needed and reused. begin() returns a no_alloc context over it and the
// empty graph in it; the caller frees the context (ggml_free) when the split is done.
class GraphArena {
public:
    ggml_context * begin(int n_nodes, ggml_cgraph ** graph) {
        return begin_tensors(static_cast<size_t>(n_nodes) * (GGML_MAX_SRC + 1), graph);
    }
    // The same for a private graph of up to max_tensors tensors (nodes and leaves).
    ggml_context * begin_tensors(size_t max_tensors, ggml_cgraph ** graph) {
        const size_t need = max_tensors * ggml_tensor_overhead() + ggml_graph_overhead_custom(max_tensors, false);
        if (memory_.size() < need) {
            memory_.resize(need);
        }
        ggml_init_params params = {memory_.size(), memory_.data(), true};
        ggml_context * ctx = ggml_init(params);
        *graph = ggml_new_graph_custom(ctx, max_tensors, false);
        return ctx;
    }

private:
    std::vector<uint8_t> memory_;
};

}  // namespace llamaflash
