// matmul_rows.cpp — see matmul_rows.h.
#include "backend/matmul_rows.h"

#include "backend/weight_registry.h"
#include "io/crc32c.h"
#include "kernels/kquant_gemm.h"

#include "ggml-cpu.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <unordered_map>
#include <vector>

namespace llamaflash {

namespace {

// The <kind> of "blk.<N>.<kind>.weight" (kind: lower case and '_', at most 15 characters) in *kind.
bool layer_weight_kind(const char * name, char (&kind)[16]) {
    int layer = -1;
    int consumed = 0;
    return std::sscanf(name, "blk.%d.%15[a-z_].weight%n", &layer, kind, &consumed) == 2 && consumed != 0 &&
           name[consumed] == '\0' && layer >= 0;
}

bool one_of(const char * kind, std::initializer_list<const char *> kinds) {
    for (const char * k : kinds) {
        if (std::strcmp(kind, k) == 0) {
            return true;
        }
    }
    return false;
}

// "blk.<N>.<kind>.weight" with kind one of the attention, dense FFN and shared-expert projections, or
// "output.weight".
bool named_matmul_weight(const char * name) {
    if (std::strcmp(name, "output.weight") == 0) {
        return true;
    }
    char kind[16] = {0};
    return layer_weight_kind(name, kind) &&
           one_of(kind, {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                         "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"});
}

// The custom op quantizing x for the MUL_MATs that multiply it: dst I8 [q_bytes * n_cols] (q_bytes =
// ggml_row_size(Q8_K, ne00)), src[0] = x [ne00, ne11, ne12, ne13] f32 with any row strides; column
// c = i1 + ne11 * (i2 + ne12 * i3) of dst is from_float(x[:, i1, i2, i3]), as ggml-cpu's MUL_MAT
// quantizes a row of src1. Threads take shares of the columns.
void quantize_op(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * x = dst->src[0];
    const int64_t ne00 = x->ne[0], ne11 = x->ne[1], ne12 = x->ne[2];
    const int64_t n_cols = x->ne[1] * x->ne[2] * x->ne[3];
    const size_t q_bytes = ggml_row_size(GGML_TYPE_Q8_K, ne00);
    const auto from_float = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float;
    auto * q = static_cast<uint8_t *>(dst->data);
    for (int64_t c = n_cols * ith / nth; c < n_cols * (ith + 1) / nth; ++c) {
        const int64_t i1 = c % ne11, i2 = (c / ne11) % ne12, i3 = c / (ne11 * ne12);
        const char * row = static_cast<const char *>(x->data) + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3];
        from_float(reinterpret_cast<const float *>(row), q + static_cast<size_t>(c) * q_bytes, ne00);
    }
}

// The product of one MUL_MAT over rows [r0, r1) of w (see matmul_op), hook as kquant_gemm's.
void multiply_rows(ggml_tensor * dst, const ggml_tensor * w, int64_t r0, int64_t r1, const RowBlockHook * hook) {
    const int64_t ne00 = w->ne[0], ne01 = w->ne[1];
    const int64_t n_cols = dst->ne[1] * dst->ne[2] * dst->ne[3];
    kquant_gemm(w->type, ne00, static_cast<const uint8_t *>(w->data) + static_cast<size_t>(r0) * w->nb[1], w->nb[1],
                r1 - r0, static_cast<const uint8_t *>(dst->src[0]->data), ggml_row_size(GGML_TYPE_Q8_K, ne00), n_cols,
                static_cast<float *>(dst->data) + r0, static_cast<size_t>(ne01), hook);
}

// The next run of the task's rows for one of nth threads, in *r0 and *r1; false when none is left.
bool take_rows(MatmulTask & task, int nth, int64_t * r0, int64_t * r1) {
    const int64_t n_rows = task.w->ne[1];
    int64_t first = task.next.load(std::memory_order_relaxed);
    int64_t n = 0;
    do {
        if (first >= n_rows) {
            return false;
        }
        const int64_t quarter = (n_rows - first) / (4 * static_cast<int64_t>(nth));
        n = std::min(n_rows - first,
                     std::max<int64_t>(1, (quarter + kGemmRowBlock - 1) / kGemmRowBlock) * kGemmRowBlock);
    } while (!task.next.compare_exchange_weak(first, first + n, std::memory_order_relaxed));
    *r0 = first;
    *r1 = first + n;
    return true;
}

// The custom op of one MUL_MAT: dst [ne01, ne11, ne12, ne13] f32 contiguous, src[0] = x quantized
// (quantize_op), userdata = its MatmulTask (the weight [ne00, ne01]):
//   dst[c * ne01 + r] = vec_dot(ne00, W[r], q[c])   (kquant_gemm's bits)
// Threads take runs of the weight's rows as they come free. With a CheckedWeight, each block of rows
// is checked once multiplied (its rows then in cache).
void matmul_op(ggml_tensor * dst, int, int nth, void * userdata) {
    auto & task = *static_cast<MatmulTask *>(userdata);
    struct Run {
        CheckedWeight * checked;
        int64_t first;
    } run{task.checked, 0};
    RowBlockHook hook;
    hook.ctx = &run;
    hook.fn = [](void * ctx, int64_t b0, int64_t n) {
        const auto * r = static_cast<const Run *>(ctx);
        r->checked->check(r->first + b0, n);
    };
    int64_t r0 = 0, r1 = 0;
    while (take_rows(task, nth, &r0, &r1)) {
        run.first = r0;
        multiply_rows(dst, task.w, r0, r1, task.checked != nullptr ? &hook : nullptr);
    }
}

bool contiguous_rows(const ggml_tensor * t) {
    return t->nb[0] == sizeof(float) && t->nb[1] == t->ne[0] * sizeof(float) && t->nb[2] == t->nb[1] * t->ne[1] &&
           t->nb[3] == t->nb[2] * t->ne[2];
}

// The bound weight `w` over the memory holding its bytes (BoundWeight::bytes_of): the model file's
// mapping where it is read in place, else the device's buffer (w itself).
const ggml_tensor * weight_bytes(ggml_context * ctx, const ggml_tensor * w, const BoundWeight & b) {
    if (b.bytes == nullptr) {
        return w;
    }
    ggml_tensor * in_place = leaf_over(ctx, w);
    in_place->data = const_cast<uint8_t *>(b.bytes_of(w));
    return in_place;
}

const BoundWeight * bound_matmul(const ggml_tensor * node) {
    if (node->op != GGML_OP_MUL_MAT) {
        return nullptr;
    }
    const BoundWeight * b = WeightRegistry::instance().lookup(node->src[0]);
    return b != nullptr && b->matmuls ? b : nullptr;
}

}  // namespace

void CheckedWeight::check(int64_t r0, int64_t n) {
    constexpr int64_t kRows = 64;
    uint32_t got[kRows];
    const auto * rows = static_cast<const uint8_t *>(weight->data);
    const size_t row_bytes = ggml_row_size(weight->type, weight->ne[0]);
    for (int64_t b = r0; b < r0 + n; b += kRows) {
        const int64_t m = std::min(kRows, r0 + n - b);
        crc32c_rows(rows + static_cast<size_t>(b) * weight->nb[1], m, row_bytes, weight->nb[1], got);
        for (int64_t i = 0; i < m; ++i) {
            if (got[i] != crc[b + i]) {
                int64_t seen = bad_.load(std::memory_order_relaxed);
                while (b + i < seen && !bad_.compare_exchange_weak(seen, b + i, std::memory_order_relaxed)) {
                }
                return;
            }
        }
    }
}

InvariantMatmuls::~InvariantMatmuls() {
    for (auto & [path, map] : files_) {
        munmap(map.base, map.size);
    }
}

const uint8_t * InvariantMatmuls::file_bytes(const std::string & path, uint64_t offset, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(path);
    if (it == files_.end()) {
        FileMap map;
        const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        struct stat st{};
        if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 0) {
            void * base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
            if (base != MAP_FAILED) {
                map.base = base;
                map.size = static_cast<size_t>(st.st_size);
            }
        }
        if (fd >= 0) {
            close(fd);
        }
        if (map.base == nullptr) {
            return nullptr;
        }
        it = files_.emplace(path, map).first;
    }
    if (offset > it->second.size || size > it->second.size - offset) {
        return nullptr;
    }
    return static_cast<const uint8_t *>(it->second.base) + offset;
}

size_t quantized_x_bytes(const ggml_tensor * x) {
    return ggml_row_size(GGML_TYPE_Q8_K, x->ne[0]) * static_cast<size_t>(ggml_nrows(x));
}

ggml_tensor * quantize_x_node(ggml_context * ctx, ggml_tensor * x, void * q_data) {
    ggml_tensor * args[1] = {x};
    ggml_tensor * q = ggml_custom_4d(ctx, GGML_TYPE_I8, static_cast<int64_t>(quantized_x_bytes(x)), 1, 1, 1, args, 1,
                                     quantize_op, GGML_N_TASKS_MAX, nullptr);
    q->data = q_data;
    return q;
}

ggml_tensor * rows_alone_matmul_node(ggml_context * ctx, const ggml_tensor * node, const ggml_tensor * w,
                                     ggml_tensor * q, InvariantMatmuls * model, MatmulTasks & tasks,
                                     CheckedWeight * checked) {
    const ggml_tensor * x = node->src[1];
    if (x->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float) || node->type != GGML_TYPE_F32 ||
        !contiguous_rows(node) || node->ne[0] != w->ne[1] || x->ne[0] != w->ne[0] || w->type != node->src[0]->type ||
        w->ne[2] != 1 || w->ne[3] != 1) {
        GGML_ABORT("llamaflash: MUL_MAT '%s' over '%s' has a layout the row-invariant matmul does not take", node->name,
                   node->src[0]->name);
    }
    if (checked != nullptr && (checked->weight != w || checked->crc == nullptr)) {
        GGML_ABORT("llamaflash: MUL_MAT '%s': the rows to check are not the weight multiplied", node->name);
    }
    ggml_tensor * args[1] = {q};
    ggml_tensor * m = ggml_custom_4d(ctx, GGML_TYPE_F32, node->ne[0], node->ne[1], node->ne[2], node->ne[3], args, 1,
                                     matmul_op, GGML_N_TASKS_MAX, tasks.add(w, checked));
    if (checked != nullptr) {
        checked->attached = true;
    }
    std::memcpy(m->nb, node->nb, sizeof(m->nb));
    m->data = node->data;
    m->buffer = node->buffer;
    model->matmuls.fetch_add(1, std::memory_order_relaxed);
    model->columns.fetch_add(ggml_nrows(x), std::memory_order_relaxed);
    return m;
}

bool invariant_matmul_weight(const ggml_tensor * w) {
    if (w == nullptr || w->ne[2] != 1 || w->ne[3] != 1 || w->ne[0] % 256 != 0 || !named_matmul_weight(w->name)) {
        return false;
    }
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(w->type);
    return traits != nullptr && traits->vec_dot != nullptr && traits->vec_dot_type == GGML_TYPE_Q8_K;
}

bool invariant_gate_or_up_name(const char * name) {
    char kind[16] = {0};
    return layer_weight_kind(name, kind) && one_of(kind, {"ffn_gate", "ffn_up", "ffn_gate_shexp", "ffn_up_shexp"});
}

bool match_matmul_split(const ggml_cgraph * split, InvariantMatmuls ** model) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    InvariantMatmuls * found = nullptr;
    const ggml_tensor * other = nullptr;  // a MUL_MAT / MUL_MAT_ID over another weight
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        if (node->op != GGML_OP_MUL_MAT && node->op != GGML_OP_MUL_MAT_ID) {
            continue;
        }
        if (const BoundWeight * b = bound_matmul(node)) {
            found = b->matmuls.get();
        } else {
            other = node;
        }
    }
    if (found != nullptr && other != nullptr) {
        // another lane would compute the bound weights with ggml-cpu's kernels (other bits from 8 rows)
        GGML_ABORT("llamaflash: split mixes row-invariant matmuls with '%s' over '%s'; unsupported graph pattern",
                   other->name, other->src[0]->name);
    }
    *model = found;
    return found != nullptr;
}

ggml_status MatmulRows::compute(const ggml_cgraph * split, InvariantMatmuls * model, ggml_backend_t cpu) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    const int n_nodes = ggml_graph_n_nodes(g);
    ggml_cgraph * graph = nullptr;
    ggml_context * ctx = arena_.begin(2 * n_nodes, &graph);
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mirror;
    quantized_.begin();
    tasks_.begin();
    auto map = [&](const ggml_tensor * src) -> ggml_tensor * {
        if (src == nullptr) {
            return nullptr;
        }
        auto it = mirror.find(src);
        if (it != mirror.end()) {
            return it->second;
        }
        ggml_tensor * leaf = leaf_over(ctx, src);  // computed outside the split (or a weight)
        mirror.emplace(src, leaf);
        return leaf;
    };
    for (int i = 0; i < n_nodes; ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        ggml_tensor * m = nullptr;
        if (const BoundWeight * b = bound_matmul(node)) {
            const ggml_tensor * x = node->src[1];
            ggml_tensor * q = quantized_.of(ctx, x, [&] { return map(x); });
            m = rows_alone_matmul_node(ctx, node, weight_bytes(ctx, node->src[0], *b), q, model, tasks_);
        } else {
            m = node_copy(ctx, node);
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                m->src[j] = map(node->src[j]);
            }
        }
        mirror[node] = m;
        ggml_build_forward_expand(graph, m);
    }
    const ggml_status status = ggml_backend_graph_compute(cpu, graph);
    ggml_free(ctx);
    return status;
}

}  // namespace llamaflash
