// expert_lane.cpp — see expert_lane.h.
#include "experts/expert_lane.h"

#include "backend/weight_registry.h"
#include "experts/expert_dots.h"
#include "ggml-cpu.h"
#include "io/integrity.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <iterator>

namespace llamaflash {

// The pairs (k, t) of one round at pairs[2p], pairs[2p + 1], grouped by expert in the round's order
// and, within an expert, by token then slot: the order of ggml-cpu's MUL_MAT_ID row table.
struct ExpertLane::RoundPairs {
    std::vector<int32_t> pairs;
    std::vector<int64_t> first;    // per round expert: its first pair; first[size] = the pair count
    std::vector<int32_t> dropped;  // a draft's (k, t) without a resident expert: written as zeros
    std::vector<int32_t> zeros;    // ids [1, n_e] of a per-expert MUL_MAT_ID: its one weight matrix

    void build(const std::vector<int> & round, const std::vector<int32_t> & expert_of, int64_t n_used, int64_t n_tokens,
               int n_expert, bool with_dropped) {
        std::vector<int> at(static_cast<size_t>(n_expert), -1);  // expert -> its place in the round
        for (size_t r = 0; r < round.size(); ++r) {
            at[static_cast<size_t>(round[r])] = static_cast<int>(r);
        }
        first.assign(round.size() + 1, 0);
        for (int32_t e : expert_of) {
            if (e >= 0 && at[static_cast<size_t>(e)] >= 0) {
                ++first[static_cast<size_t>(at[static_cast<size_t>(e)]) + 1];
            }
        }
        for (size_t r = 0; r < round.size(); ++r) {
            first[r + 1] += first[r];
        }
        pairs.assign(static_cast<size_t>(2 * first[round.size()]), 0);
        std::vector<int64_t> next(first.begin(), first.end() - 1);
        dropped.clear();
        for (int64_t p = 0; p < n_used * n_tokens; ++p) {  // by token, then slot
            const int32_t e = expert_of[static_cast<size_t>(p)];
            const int32_t k = static_cast<int32_t>(p % n_used), t = static_cast<int32_t>(p / n_used);
            if (e >= 0 && at[static_cast<size_t>(e)] >= 0) {
                const int64_t q = next[static_cast<size_t>(at[static_cast<size_t>(e)])]++;
                pairs[static_cast<size_t>(2 * q)] = k;
                pairs[static_cast<size_t>(2 * q + 1)] = t;
            } else if (e < 0 && with_dropped) {
                dropped.insert(dropped.end(), {k, t});
            }
        }
        zeros.assign(static_cast<size_t>(first[round.size()]), 0);
    }
};

struct ExpertLane::Matmul {
    ExpertTensorKind kind = ExpertTensorKind::up;
    ggml_type type = GGML_TYPE_F32;      // the weight's
    int64_t ne0 = 0;                     // input length (src1 row, weight row)
    int64_t ne1 = 0;                     // output rows of one expert
    size_t row_bytes = 0;                // one weight row
    const RoundPairs * round = nullptr;  // the round's pairs, shared by the split's MUL_MAT_IDs
    std::vector<float> gathered;         // [ne0, 1, P]: src1's row of each pair
    std::vector<float> products;         // [ne1, 1, P]: each pair's product
    std::vector<float> staged;           // several rounds: every pair's output, kept across rounds
    ExpertDots dots;                     // experts of < 8 rows: the round's pairs in one node
};

namespace {

// gathered [ne0, 1, P] = for each pair p = (k, t): src[0] [ne0, ne11, T] row (k mod ne11, t).
void gather_pairs(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * mm = static_cast<const ExpertLane::Matmul *>(userdata);
    const ggml_tensor * src1 = dst->src[0];
    const int64_t n_pairs = dst->ne[2];
    const size_t row = static_cast<size_t>(src1->ne[0]) * sizeof(float);
    for (int64_t p = n_pairs * ith / nth; p < n_pairs * (ith + 1) / nth; ++p) {
        const int32_t k = mm->round->pairs[static_cast<size_t>(2 * p)];
        const int32_t t = mm->round->pairs[static_cast<size_t>(2 * p + 1)];
        std::memcpy(static_cast<char *>(dst->data) + p * dst->nb[2],
                    static_cast<const char *>(src1->data) + (k % src1->ne[1]) * src1->nb[1] + t * src1->nb[2], row);
    }
}

// dst [ne1, n_used, T] (the node's memory, or its staging) at each pair (k, t) = the pair's product
// column; a dropped draft pair's = 0. The products were computed by the nodes before this one.
void scatter_pairs(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * mm = static_cast<const ExpertLane::Matmul *>(userdata);
    const std::vector<int32_t> &pairs = mm->round->pairs, &dropped = mm->round->dropped;
    const int64_t n_pairs = static_cast<int64_t>(pairs.size() / 2);
    const int64_t n_all = n_pairs + static_cast<int64_t>(dropped.size() / 2);
    const size_t row = static_cast<size_t>(dst->ne[0]) * sizeof(float);
    for (int64_t p = n_all * ith / nth; p < n_all * (ith + 1) / nth; ++p) {
        const int32_t * kt =
            p < n_pairs ? &pairs[static_cast<size_t>(2 * p)] : &dropped[static_cast<size_t>(2 * (p - n_pairs))];
        char * out = static_cast<char *>(dst->data) + kt[0] * dst->nb[1] + kt[1] * dst->nb[2];
        if (p < n_pairs) {
            std::memcpy(out, mm->products.data() + p * dst->ne[0], row);
        } else {
            std::memset(out, 0, row);
        }
    }
}

// dst (the original node's memory) = src[0] (the staged outputs of all pairs so far), rows split
// over threads. In-place element-wise ops after a MUL_MAT_ID (ggml-alloc lets ADD_ID, GLU, ... write
// into their input) then start every round from the exact products, as one pass over all experts would.
void copy_staged(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * src = dst->src[0];
    const int64_t rows = ggml_nrows(dst);
    const size_t row_bytes = static_cast<size_t>(dst->ne[0]) * sizeof(float);
    for (int64_t r = rows * ith / nth; r < rows * (ith + 1) / nth; ++r) {
        const int64_t i1 = r % dst->ne[1], i2 = r / dst->ne[1];
        std::memcpy(static_cast<char *>(dst->data) + i1 * dst->nb[1] + i2 * dst->nb[2],
                    static_cast<const char *>(src->data) + i1 * src->nb[1] + i2 * src->nb[2], row_bytes);
    }
}

// Draft routing (ExpertModel::set_draft): every slot of expert_of [T][n_used] whose expert is not
// resident takes the resident expert, not yet used by its token, that the layer's router scores
// highest for the token's FFN input x [n_embd, 1, T] (x null or no router: the lowest-numbered one);
// with none left, -1. Counts the substituted and the dropped slots.
void route_among_resident(const ExpertModel & model, int position, const ggml_tensor * x, int64_t n_used,
                          int64_t n_tokens, std::vector<int32_t> & expert_of, int64_t & substituted,
                          int64_t & dropped) {
    const int n_expert = model.layer_spec(position).n_expert;
    const std::vector<int> ready = model.cache().resident_experts(position);  // sorted
    std::vector<char> resident(static_cast<size_t>(n_expert), 0);
    for (int e : ready) {
        resident[static_cast<size_t>(e)] = 1;
    }
    for (int64_t t = 0; t < n_tokens; ++t) {
        int32_t * row = expert_of.data() + t * n_used;
        std::vector<char> used(static_cast<size_t>(n_expert), 0);
        bool missing = false;
        for (int64_t k = 0; k < n_used; ++k) {
            missing |= !resident[static_cast<size_t>(row[k])];
            used[static_cast<size_t>(row[k])] = 1;
        }
        if (!missing) {
            continue;
        }
        std::vector<int> candidates;
        for (int e : ready) {
            if (!used[static_cast<size_t>(e)]) {
                candidates.push_back(e);
            }
        }
        if (x != nullptr) {
            const float * xt = reinterpret_cast<const float *>(static_cast<const char *>(x->data) + t * x->nb[2]);
            const std::vector<float> logits = model.router_logits(position, xt);
            if (!logits.empty()) {
                std::stable_sort(candidates.begin(), candidates.end(), [&](int a, int b) {
                    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
                });
            }
        }
        size_t next = 0;
        for (int64_t k = 0; k < n_used; ++k) {
            if (resident[static_cast<size_t>(row[k])]) {
                continue;
            }
            if (next < candidates.size()) {
                row[k] = candidates[next++];
                ++substituted;
            } else {
                row[k] = -1;
                ++dropped;
            }
        }
    }
}

const BoundWeight * bound_expert(const ggml_tensor * node) {
    if (node->op != GGML_OP_MUL_MAT_ID) {
        return nullptr;
    }
    const BoundWeight * b = WeightRegistry::instance().lookup(node->src[0]);
    return b != nullptr && b->experts && !b->router ? b : nullptr;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ExpertSplit match_expert_split(const ggml_cgraph * split) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        if (const BoundWeight * b = bound_expert(ggml_graph_node(g, i))) {
            return ExpertSplit{b->experts.get(), b->experts->position(b->layer)};
        }
    }
    return ExpertSplit{};
}

ExpertLane::ExpertLane() = default;
ExpertLane::~ExpertLane() = default;

ggml_tensor * ExpertLane::mirror(ggml_context * ctx, const ggml_tensor * t) {
    auto it = mirror_.find(t);
    if (it != mirror_.end()) {
        return it->second;
    }
    ggml_tensor * m = t->op == GGML_OP_NONE ? const_cast<ggml_tensor *>(t) : leaf_over(ctx, t);
    mirror_.emplace(t, m);
    return m;
}

ggml_context * ExpertLane::build_round(const ggml_cgraph * split, const ExpertModel & model, int position,
                                       const std::vector<int> & round, const std::vector<int32_t> & expert_of,
                                       int64_t n_used, int64_t n_tokens, bool with_dropped, bool staged,
                                       ggml_cgraph ** graph) {
    const ExpertLayerSpec & spec = model.layer_spec(position);
    const ExpertCache & cache = model.cache();
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const int n_nodes = ggml_graph_n_nodes(g);
    int n_matmuls_in_split = 0;
    for (int i = 0; i < n_nodes; ++i) {
        n_matmuls_in_split += bound_expert(ggml_graph_node(g, i)) != nullptr ? 1 : 0;
    }
    // per MUL_MAT_ID: gather, scatter, staging copy, and per expert its weight, view, ids and product
    const size_t max_tensors = static_cast<size_t>(n_nodes) * (GGML_MAX_SRC + 1) +
                               static_cast<size_t>(n_matmuls_in_split) * (4 + 4 * round.size());
    ggml_context * ctx = arena_.begin_tensors(max_tensors, graph);
    mirror_.clear();
    if (!round_) {
        round_ = std::make_unique<RoundPairs>();
    }
    round_->build(round, expert_of, n_used, n_tokens, spec.n_expert, with_dropped);
    const std::vector<int64_t> & first = round_->first;
    const int64_t n_pairs = first.back();
    size_t n_matmuls = 0;
    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        ggml_tensor * m = nullptr;
        if (const BoundWeight * b = bound_expert(node)) {
            if (b->experts.get() != &model || b->layer != spec.layer) {
                GGML_ABORT("llamaflash: expert split mixes layers or models");
            }
            const ExpertTensorSpec * t = model.tensor(position, b->expert_kind);
            const ggml_tensor * src1 = node->src[1];
            if (t == nullptr || t->type != node->src[0]->type || t->ne0 != node->src[0]->ne[0] ||
                t->ne1 != node->src[0]->ne[1] || src1->type != GGML_TYPE_F32 || src1->nb[0] != sizeof(float) ||
                node->type != GGML_TYPE_F32 || node->nb[0] != sizeof(float)) {
                GGML_ABORT("llamaflash: expert weight '%s' differs from the sidecar's description", node->src[0]->name);
            }
            if (matmuls_.size() <= n_matmuls) {
                matmuls_.push_back(std::make_unique<Matmul>());
            }
            Matmul & mm = *matmuls_[n_matmuls++];
            mm.kind = t->kind;
            mm.type = static_cast<ggml_type>(t->type);
            mm.ne0 = t->ne0;
            mm.ne1 = t->ne1;
            mm.row_bytes = ggml_row_size(mm.type, t->ne0);
            mm.round = round_.get();
            ggml_tensor * src1_m = mirror(ctx, src1);
            ggml_tensor * after = src1_m;  // what the scatter follows
            int64_t most_rows = 0;         // of one expert in the round
            for (size_t r = 0; r < round.size(); ++r) {
                most_rows = std::max(most_rows, first[r + 1] - first[r]);
            }
            // rows as alone (the routers computed so: deterministic answers) take ExpertDots at any
            // row count where kquant_gemm gives it vec_dot's bits fast (K-quants), never ggml's tiled kernel
            const bool rows_alone =
                model.config().router_rows && ggml_get_type_traits_cpu(mm.type)->vec_dot_type == GGML_TYPE_Q8_K;
            if ((most_rows < kTiledMinRows || rows_alone) && expert_dots_supported(mm.type)) {
                // every expert below ggml's tiled kernel: its vec_dots for all pairs in one node
                ExpertDots & d = mm.dots;
                d.type = mm.type;
                d.ne0 = mm.ne0;
                d.ne1 = mm.ne1;
                d.row_bytes = mm.row_bytes;
                d.pairs.assign(round_->pairs.begin(), round_->pairs.end());
                d.weights.clear();
                for (size_t r = 0; r < round.size(); ++r) {
                    const uint8_t * w = cache.slot_data(position, round[r], mm.kind);
                    if (w == nullptr) {
                        GGML_ABORT("llamaflash: expert %d of layer %d is not resident in its round", round[r],
                                   spec.layer);
                    }
                    d.weights.insert(d.weights.end(), static_cast<size_t>(first[r + 1] - first[r]), w);
                }
                d.zero_pairs.assign(round_->dropped.begin(), round_->dropped.end());
                m = ggml_custom_4d(ctx, GGML_TYPE_F32, node->ne[0], node->ne[1], node->ne[2], node->ne[3], &src1_m, 1,
                                   expert_dots, GGML_N_TASKS_MAX, &d);
            } else if (n_pairs > 0) {
                mm.gathered.resize(static_cast<size_t>(mm.ne0 * n_pairs));
                mm.products.resize(static_cast<size_t>(mm.ne1 * n_pairs));
                ggml_tensor * gathered = ggml_custom_4d(ctx, GGML_TYPE_F32, mm.ne0, 1, n_pairs, 1, &src1_m, 1,
                                                        gather_pairs, GGML_N_TASKS_MAX, &mm);
                gathered->data = mm.gathered.data();
                ggml_build_forward_expand(*graph, gathered);
                // each expert: ggml's own MUL_MAT_ID over its slot, its pairs in ggml's row order, so
                // that ggml-cpu picks the kernel it picks in stock for that expert's rows
                for (size_t r = 0; r < round.size(); ++r) {
                    const int64_t n_e = first[r + 1] - first[r];
                    if (n_e == 0) {
                        continue;
                    }
                    ggml_tensor * w = ggml_new_tensor_3d(ctx, mm.type, mm.ne0, mm.ne1, 1);
                    w->nb[1] = mm.row_bytes;
                    w->nb[2] = w->nb[3] = mm.row_bytes * static_cast<size_t>(mm.ne1);
                    w->data = const_cast<uint8_t *>(cache.slot_data(position, round[r], mm.kind));
                    if (w->data == nullptr) {
                        GGML_ABORT("llamaflash: expert %d of layer %d is not resident in its round", round[r],
                                   spec.layer);
                    }
                    ggml_tensor * cols = ggml_view_3d(ctx, gathered, mm.ne0, 1, n_e, gathered->nb[1], gathered->nb[2],
                                                      static_cast<size_t>(first[r]) * gathered->nb[2]);
                    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_e);
                    ids->data = round_->zeros.data();
                    ggml_tensor * product = ggml_mul_mat_id(ctx, w, cols, ids);
                    product->data = mm.products.data() + first[r] * mm.ne1;
                    ggml_build_forward_expand(*graph, product);
                }
                after = gathered;
            }
            if (m == nullptr) {
                m = ggml_custom_4d(ctx, GGML_TYPE_F32, node->ne[0], node->ne[1], node->ne[2], node->ne[3], &after, 1,
                                   scatter_pairs, GGML_N_TASKS_MAX, &mm);
            }
            if (staged) {  // products land in a private buffer, copied into the node's memory each round
                mm.staged.resize(static_cast<size_t>(ggml_nelements(node)));
                m->data = mm.staged.data();
                ggml_tensor * copy_args[1] = {m};
                m = ggml_custom_4d(ctx, GGML_TYPE_F32, node->ne[0], node->ne[1], node->ne[2], node->ne[3], copy_args, 1,
                                   copy_staged, GGML_N_TASKS_MAX, nullptr);
            }
            std::memcpy(m->nb, node->nb, sizeof(m->nb));
            m->data = node->data;
            m->buffer = node->buffer;
            std::memcpy(m->name, node->name, sizeof(m->name));
        } else {
            m = node_copy(ctx, node);
            m->view_src = node->view_src != nullptr ? mirror(ctx, node->view_src) : nullptr;
            m->view_offs = node->view_offs;
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                m->src[j] = node->src[j] != nullptr ? mirror(ctx, node->src[j]) : nullptr;
            }
        }
        mirror_[node] = m;
        ggml_build_forward_expand(*graph, m);
    }
    return ctx;
}

ggml_status ExpertLane::compute(const ggml_cgraph * split, const ExpertSplit & match, ggml_backend_t cpu,
                                int n_threads) {
    ExpertModel & model = *match.model;
    const ExpertLayerSpec & spec = model.layer_spec(match.position);
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const int n_nodes = ggml_graph_n_nodes(g);
    const auto t_begin = std::chrono::steady_clock::now();

    // the routing: ids [n_used, T] i32, shared by the split's MUL_MAT_IDs
    const ggml_tensor * ids = nullptr;
    const ggml_tensor * x = nullptr;  // the FFN input [n_embd, 1, T], when computed before the split
    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        if (bound_expert(node) == nullptr) {
            continue;
        }
        if (ids != nullptr && node->src[2] != ids) {
            GGML_ABORT("llamaflash: expert split of layer %d uses two routings", spec.layer);
        }
        ids = node->src[2];
        if (x == nullptr && node->src[1]->ne[1] == 1) {
            x = node->src[1];
        }
    }
    const int64_t n_used = ids->ne[0], n_tokens = ids->ne[1];
    std::vector<char> needed(static_cast<size_t>(spec.n_expert), 0);
    std::vector<int32_t> expert_of(static_cast<size_t>(n_used * n_tokens));
    for (int64_t t = 0; t < n_tokens; ++t) {
        const int32_t * row = reinterpret_cast<const int32_t *>(static_cast<const char *>(ids->data) + t * ids->nb[1]);
        for (int64_t k = 0; k < n_used; ++k) {
            if (row[k] < 0 || row[k] >= spec.n_expert) {
                GGML_ABORT("llamaflash: expert id %d out of range in layer %d", row[k], spec.layer);
            }
            expert_of[static_cast<size_t>(t * n_used + k)] = row[k];
            needed[static_cast<size_t>(row[k])] = 1;
        }
    }
    for (int i = 0; i < n_nodes && x != nullptr; ++i) {
        if (ggml_graph_node(g, i) == x) {
            x = nullptr;  // computed inside the split: not known before it runs
        }
    }

    std::lock_guard<std::mutex> lock(model.lane_mutex());
    ExpertCache & cache = model.cache();
    cache.set_check_threads(n_threads);
    const bool draft = model.draft();
    int64_t substituted = 0, dropped = 0;
    if (draft) {  // resident experts only: one round, nothing read
        route_among_resident(model, match.position, x, n_used, n_tokens, expert_of, substituted, dropped);
        std::fill(needed.begin(), needed.end(), 0);
        for (int32_t e : expert_of) {
            if (e >= 0) {
                needed[static_cast<size_t>(e)] = 1;
            }
        }
    }

    // the rounds: resident experts first, then the misses, at most capacity() per round (a draft: one)
    std::vector<int> order;
    std::vector<char> placed(static_cast<size_t>(spec.n_expert), 0);
    for (int e : cache.resident_experts(match.position)) {
        if (needed[static_cast<size_t>(e)]) {
            order.push_back(e);
            placed[static_cast<size_t>(e)] = 1;
        }
    }
    for (int e = 0; e < spec.n_expert; ++e) {
        if (needed[static_cast<size_t>(e)] && !placed[static_cast<size_t>(e)]) {
            order.push_back(e);
        }
    }
    std::vector<std::vector<int>> rounds_of;
    if (draft) {
        rounds_of.push_back(order);
        std::sort(rounds_of[0].begin(), rounds_of[0].end());
    }
    // more than one round: half the capacity each, so that the next round is read while one computes
    const int ways = draft || static_cast<int>(order.size()) <= cache.capacity(match.position, order) ? 1 : 2;
    for (size_t next = draft ? order.size() : 0; next < order.size();) {
        std::vector<int> round;
        while (next < order.size()) {
            round.push_back(order[next]);
            if (static_cast<int>(round.size()) > std::max(1, cache.capacity(match.position, round) / ways)) {
                round.pop_back();
                break;
            }
            ++next;
        }
        std::sort(round.begin(), round.end());
        rounds_of.push_back(std::move(round));
    }
    // Overlap (one round, not a draft): the experts usable before the misses arrive
    // (ExpertCache::usable_now) are computed in a first pass while the misses are read, the others in
    // a second pass after finish(). Both passes stage their products, like rounds, so the result is one pass's.
    const bool may_overlap = model.config().overlap && !draft && rounds_of.size() == 1;
    bool overlapped = false;

    ggml_status status = GGML_STATUS_SUCCESS;
    int rounds = 0;
    double compute_seconds = 0.0;
    auto run_pass = [&](const std::vector<int> & experts, bool staged) {
        ggml_cgraph * graph = nullptr;
        ggml_context * ctx = build_round(g, model, match.position, experts, expert_of, n_used, n_tokens,
                                         draft && rounds == 0, staged, &graph);
        const auto t0 = std::chrono::steady_clock::now();
        status = ggml_backend_graph_compute(cpu, graph);
        compute_seconds += seconds_since(t0);
        ggml_free(ctx);
        ++rounds;
        return status == GGML_STATUS_SUCCESS;
    };
    for (size_t r = 0; r < rounds_of.size(); ++r) {
        const std::vector<int> & round = rounds_of[r];
        std::vector<int> late = round;  // computed after finish()
        try {
            if (!draft) {  // a draft's experts are all resident and ready
                cache.begin(match.position, round);
                if (r == 0 && n_tokens == 1 && x != nullptr) {
                    std::vector<int> predicted =
                        model.predict_next(match.position, static_cast<const float *>(x->data));
                    // best first: keep as many as the measured precision pays for (a wrong one costs bandwidth)
                    predicted.resize(
                        std::min(predicted.size(), static_cast<size_t>(cache.prefetch_count(spec.n_used))));
                    if (!predicted.empty()) {
                        cache.prefetch(match.position + 1, predicted);
                    }
                }
                if (may_overlap) {
                    const std::vector<int> early = cache.usable_now(match.position, round);
                    if (!early.empty() && early.size() < round.size()) {
                        overlapped = true;
                        late.clear();
                        std::set_difference(round.begin(), round.end(), early.begin(), early.end(),
                                            std::back_inserter(late));
                        if (!run_pass(early, true)) {
                            cache.finish(match.position);  // the misses' reads must end before their slots are reused
                            break;
                        }
                    }
                }
                cache.finish(match.position);
                if (r + 1 < rounds_of.size()) {
                    cache.read_ahead(match.position, rounds_of[r + 1]);
                }
            }
        } catch (const std::exception & e) {
            model.set_error(e.what());
            status = GGML_STATUS_FAILED;
            break;
        }
        if (!run_pass(late, rounds_of.size() > 1 || overlapped)) {
            break;
        }
    }
    if (draft) {
        model.count_draft_split(n_used * n_tokens, substituted, dropped);
    } else {
        model.count_split(match.position, n_tokens, static_cast<int64_t>(order.size()), rounds, overlapped,
                          compute_seconds, seconds_since(t_begin));
    }
    return status;
}

}  // namespace llamaflash
