// dense_lane.cpp — see dense_lane.h.
#include "lanes/dense_lane.h"

#include "backend/matmul_rows.h"
#include "backend/weight_registry.h"
#include "lanes/graph_mirror.h"
#include "lanes/sparse_lane.h"
#include "model/flash_model.h"

#include <algorithm>
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

int64_t dense_chunk_tokens(int64_t n_tokens) {
    if (n_tokens <= kDenseChunkTokens) {
        return n_tokens;
    }
    const int64_t spread = (n_tokens + kDenseMaxChunks - 1) / kDenseMaxChunks;
    return std::max(kDenseChunkTokens, (spread + 7) / 8 * 8);
}

size_t dense_chunk_scratch_bytes(int64_t n_ff, int64_t n_ubatch) {
    if (n_ubatch <= kDenseChunkTokens) {
        return 0;
    }
    return 3 * static_cast<size_t>(n_ff) * static_cast<size_t>(dense_chunk_tokens(n_ubatch) + 7) * sizeof(float);
}

void DenseLane::begin(ggml_context * ctx, const ggml_cgraph * split) {
    ctx_ = ctx;
    split_ = split;
    n_nodes_ = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(split));
    mirror_.clear();
    mirror_.reserve(static_cast<size_t>(n_nodes_) * (GGML_MAX_SRC + 1));
    checked_.clear();
    n_fused_ = 0;
    model_ = nullptr;
    evaluations_.clear();
    quantized_.begin();
    tasks_.begin();
}

InvariantMatmuls * DenseLane::rows_alone(const ggml_tensor * node) {
    if (node->op != GGML_OP_MUL_MAT) {
        return nullptr;
    }
    const BoundWeight * bound = WeightRegistry::instance().lookup(node->src[0]);
    InvariantMatmuls * matmuls =
        bound != nullptr && bound->model != nullptr ? bound->model->invariant_matmuls() : nullptr;
    return matmuls != nullptr && invariant_matmul_weight(node->src[0]) ? matmuls : nullptr;
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

void DenseLane::use_weight(const ggml_tensor * phantom, ggml_tensor * weight, CheckedWeight * checked) {
    const BoundWeight * bound = WeightRegistry::instance().lookup(phantom);
    if (bound == nullptr || !ggml_are_same_shape(weight, phantom) || weight->type != phantom->type) {
        GGML_ABORT("llamaflash: the streamed weight for '%s' is not the served weight llama.cpp expects",
                   phantom->name);
    }
    model_ = bound->model.get();
    mirror_[phantom] = weight;
    if (checked != nullptr) {
        checked_[phantom] = checked;
    }
}

ggml_tensor * DenseLane::mirror_node(const ggml_tensor * node) {
    ggml_tensor * m = nullptr;
    if (InvariantMatmuls * matmuls = rows_alone(node)) {
        ggml_tensor * q = quantized_.of(ctx_, node->src[1], [&] { return map_src(node->src[1]); });
        const auto checked = checked_.find(node->src[0]);
        m = rows_alone_matmul_node(ctx_, node, map_src(node->src[0]), q, matmuls, tasks_,
                                   checked != checked_.end() ? checked->second : nullptr);
        std::memcpy(m->name, node->name, sizeof(m->name));
    } else {
        m = node_copy(ctx_, node);
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            m->src[j] = node->src[j] != nullptr ? map_src(node->src[j]) : nullptr;
        }
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

// Node `node` of a plain GLU FFN split over tokens [t0, t0 + n): the down projection writes rows t0..
// of its own memory; the others write contiguous [ne0, n] rows at `scratch`. Sources are the chunk's
// mirrors (mirror_ holds the current chunk's) or the mapped weights.
ggml_tensor * DenseLane::chunk_node(const ggml_tensor * node, int64_t t0, int64_t n, float * scratch) {
    ggml_tensor * m = node_copy(ctx_, node);
    m->ne[1] = n;
    if (scratch != nullptr) {
        m->nb[1] = m->nb[0] * static_cast<size_t>(m->ne[0]);
        m->nb[2] = m->nb[3] = m->nb[1] * static_cast<size_t>(n);
        m->data = scratch;
        m->buffer = nullptr;
    } else {
        m->data = static_cast<char *>(node->data) + t0 * node->nb[1];
    }
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        m->src[j] = node->src[j] != nullptr ? mirror_.at(node->src[j]) : nullptr;
    }
    return m;
}

bool DenseLane::try_chunks(ggml_cgraph * graph) {
    GluFfnPattern ffn;
    const WeightRegistry & registry = WeightRegistry::instance();
    if (!match_glu_ffn(split_, registry, ffn)) {
        return false;
    }
    const int64_t n_tokens = ffn.x->ne[1];
    if (n_tokens <= kDenseChunkTokens || ffn.x->ne[2] != 1 || ffn.x->ne[3] != 1 ||
        ffn.model->invariant_matmuls() != nullptr) {
        return false;  // row-invariant matmuls: the whole batch at once (mirror_node)
    }
    std::vector<const ggml_tensor *> inner;  // every node but down, in split order
    for (int i = 0; i < n_nodes_; ++i) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(split_), i);
        if (node->ne[1] != n_tokens || node->ne[2] != 1 || node->ne[3] != 1 || node->type != GGML_TYPE_F32) {
            return false;
        }
        if (node != ffn.down) {
            inner.push_back(node);
        }
    }
    // chunk boundaries: `chunk` tokens each, the last taking the rest; a rest under 8 tokens joins
    // the chunk before it (so no chunk changes ggml's kernel choice, which is made at 8 rows)
    const int64_t chunk = dense_chunk_tokens(n_tokens);
    std::vector<int64_t> starts;
    for (int64_t t0 = 0; t0 < n_tokens; t0 += chunk) {
        starts.push_back(t0);
    }
    if (starts.size() > 1 && n_tokens - starts.back() < 8) {
        starts.pop_back();
    }
    starts.push_back(n_tokens);
    const int64_t widest = chunk + 7;
    int64_t scratch_floats = 0;
    for (const ggml_tensor * node : inner) {
        scratch_floats += node->ne[0] * widest;
    }
    if (chunk_scratch_.size() < static_cast<size_t>(scratch_floats)) {
        chunk_scratch_.assign(static_cast<size_t>(scratch_floats), 0.0f);
    }
    // the weights, mapped once for every chunk
    for (const ggml_tensor * node : inner) {
        if (node->op == GGML_OP_MUL_MAT) {
            (void)map_src(node->src[0]);
        }
    }
    (void)map_src(ffn.down->src[0]);
    for (size_t c = 0; c + 1 < starts.size(); ++c) {
        const int64_t t0 = starts[c], n = starts[c + 1] - starts[c];
        ggml_tensor * x = leaf_over(ctx_, ffn.x);
        x->ne[1] = n;
        x->data = static_cast<char *>(ffn.x->data) + t0 * ffn.x->nb[1];
        mirror_[ffn.x] = x;
        float * at = chunk_scratch_.data();
        for (const ggml_tensor * node : inner) {
            mirror_[node] = chunk_node(node, t0, n, at);
            at += node->ne[0] * n;
        }
        ggml_build_forward_expand(graph, chunk_node(ffn.down, t0, n, nullptr));
    }
    evaluations_.emplace_back(ffn.layer, n_tokens);
    return true;
}

void DenseLane::append_all(ggml_cgraph * graph) {
    if (try_chunks(graph)) {
        return;
    }
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
