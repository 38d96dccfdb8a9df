// matmul_rows.h — a model's K-quant weight matmuls computed by llamaflash, every row as ggml-cpu
// computes a row alone, in batches of any size.
//
// ggml-cpu multiplies K-quant weights by a batch of 8 or more rows with its tiled kernel and by fewer
// with one vec_dot per output; the two give a row other bits, so a position's logits depend on the
// batch it was computed in. With `deterministic=True`, llamaflash takes a model's 2-D K-quant
// weights that only MUL_MATs use
//   blk.N.attn_{q,k,v,qkv,output}.weight, blk.N.ffn_{gate,up,down}[_shexp].weight, output.weight
// (types whose vec_dot_type is Q8_K: Q2_K..Q6_K and the IQ types; never token_embd, which GET_ROWS
// reads on the CPU; FFN weights a FlashModel serves stay its lanes') onto its device, with their
// bytes (InvariantMatmuls: one per model; read in place or copied, below), and
// computes every MUL_MAT over them, for T rows of x:
//   q[t]       = from_float(x[:, t])                             Q8_K, as ggml quantizes a row
//   y[r, t]    = kquant_gemm(W, q)[t][r] = vec_dot(ne0, W[r], q[t])   (kernels/kquant_gemm.h)
// the bits of ggml-cpu evaluating the rows one at a time, whatever the batch: with every K-quant
// matmul computed so, batches are row-invariant up to flash attention's tiled size (63 rows)
// without the process switching ggml's tiled kernel off. The element-wise ops between an FFN's
// (or shared expert's) gate/up and down projections join the split (flash_backend.cpp) and run as ggml-cpu's own ops.
#pragma once

#include "lanes/graph_mirror.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace llamaflash {

// One model's weights whose MUL_MATs llamaflash computes (WeightRegistry binds them while the model
// loads), and what was computed. With `read_in_place`, a weight llama.cpp hands in from its mapping
// of the model file is read in place, from this model's own read-only mapping of that file (the same
// page-cache pages: nothing is held twice, and a budget's lock of the file's pages covers them;
// under a memory limit they stay reclaimable as the planner counts them); any other is copied into
// the device's buffer (in memory measured faster to decode from than the file's mapping), and a
// mapped source's pages are then dropped from the process.
struct InvariantMatmuls {
    explicit InvariantMatmuls(bool read_in_place) : read_in_place(read_in_place) {}
    ~InvariantMatmuls();
    InvariantMatmuls(const InvariantMatmuls &) = delete;
    InvariantMatmuls & operator=(const InvariantMatmuls &) = delete;

    // The bytes [offset, offset + size) of the file at `path`, through this model's read-only shared
    // mapping of it (made at the first call per file, kept until the model is freed); nullptr if the
    // file cannot be mapped or is shorter.
    const uint8_t * file_bytes(const std::string & path, uint64_t offset, size_t size);

    const bool read_in_place;
    std::atomic<int64_t> bound{0};     // weights bound
    std::atomic<int64_t> in_place{0};  // of them, read in place from the model file's mapping
    std::atomic<int64_t> matmuls{0};   // MUL_MAT nodes computed
    std::atomic<int64_t> columns{0};   // rows of x (tokens) over all of them

private:
    struct FileMap {
        void * base = nullptr;
        size_t size = 0;
    };
    std::mutex mu_;
    std::map<std::string, FileMap> files_;
};

// Whether `w` is a weight InvariantMatmuls takes: a 2-D tensor of a type whose vec_dot_type is Q8_K,
// named as above.
bool invariant_matmul_weight(const ggml_tensor * w);

// Whether `name` is a gate or up projection (blk.N.ffn_{gate,up}[_shexp].weight): the element-wise
// ops between it and its down projection join its split.
bool invariant_gate_or_up_name(const char * name);

// True if the split's MUL_MATs are all over bound InvariantMatmuls weights (and it has one); the
// model is returned in *model. Aborts on a split that mixes them with other weights' matmuls (an
// unsupported graph pattern, never a silent wrong answer).
bool match_matmul_split(const ggml_cgraph * split, InvariantMatmuls ** model);

// A weight whose rows are checked against their CRC-32C (io/crc32c.h) while the product reads them:
// rows read from flash that no check has covered yet (offload/layer_stream.h). Passed to
// rows_alone_matmul_node as `checked` (with w == checked->weight), the product checksums each block of
// a thread's rows once it has multiplied it (kquant_gemm's RowBlockHook), reading the rows from cache:
// one pass over memory instead of two. A mismatch does not stop the product (its
// values are then unspecified); the lowest failing row is kept, and the caller must fail the
// evaluation when first_bad() >= 0 after the graph.
struct CheckedWeight {
    const ggml_tensor * weight = nullptr;  // [ne00, ne01], data: the rows (nb[1] apart)
    const uint32_t * crc = nullptr;        // [ne01] the rows' expected CRC-32C
    bool attached = false;                 // a product node checks it (set by rows_alone_matmul_node)

    void reset(const ggml_tensor * w, const uint32_t * expected) {
        weight = w;
        crc = expected;
        attached = false;
        bad_.store(kNone, std::memory_order_relaxed);
    }
    // rows [r0, r0 + n) against their checksums; records the first failing one (any thread)
    void check(int64_t r0, int64_t n);
    int64_t first_bad() const {
        const int64_t b = bad_.load(std::memory_order_relaxed);
        return b == kNone ? -1 : b;
    }

private:
    static constexpr int64_t kNone = INT64_MAX;
    std::atomic<int64_t> bad_{kNone};
};

// The work of one row-invariant product node: its weight, its row check (nullptr: none) and the next
// row no thread has taken yet. Each thread takes runs of whole kGemmRowBlock-row blocks, a quarter of
// what is left per thread (at least one block), until none is left: a thread slowed down (by another
// process, an interrupt, a colder cache) takes fewer rows instead of holding the others at the node's
// barrier. Every output is one row's vec_dot, so no split changes a bit.
struct MatmulTask {
    const ggml_tensor * w = nullptr;
    CheckedWeight * checked = nullptr;
    std::atomic<int64_t> next{0};
};

// The tasks of one private graph: begin() per split; each lives until the next begin().
class MatmulTasks {
public:
    void begin() { tasks_.clear(); }
    MatmulTask * add(const ggml_tensor * w, CheckedWeight * checked) {
        MatmulTask & t = tasks_.emplace_back();
        t.w = w;
        t.checked = checked;
        return &t;
    }

private:
    std::deque<MatmulTask> tasks_;
};

// The nodes a private graph computes a row-invariant MUL_MAT with, for MatmulRows and the FFN lanes
// (dense_lane.h) of a model whose load armed InvariantMatmuls:
//   q = quantize_x_node(ctx, x, q_data)        x f32 [ne0, ne1, ne2, ne3] (any row strides) → its
//       rows as Q8_K columns at q_data (quantized_x_bytes(x) bytes, caller-owned, live through the
//       compute); threads take shares of the columns
//   y = rows_alone_matmul_node(ctx, node, w, q, model, tasks)
//       the MUL_MAT `node` (W·x) computed from q into node's memory, y[c·ne01 + r] = vec_dot(W[r],
//       q[c]) (kquant_gemm); `w` holds the weight's bytes (the bound weight, or a lane's resident
//       copy of it), same type and shape as node->src[0]. Threads take runs of W's rows as they come
//       free (its MatmulTask, kept in `tasks` through the compute). Counts the
//       MUL_MAT and its columns in `model`. Aborts on a layout it does not take (an unsupported
//       graph pattern, never a silent wrong answer). With `checked`, the rows are checked as they are
//       multiplied (CheckedWeight).
size_t quantized_x_bytes(const ggml_tensor * x);
ggml_tensor * quantize_x_node(ggml_context * ctx, ggml_tensor * x, void * q_data);
ggml_tensor * rows_alone_matmul_node(ggml_context * ctx, const ggml_tensor * node, const ggml_tensor * w,
                                     ggml_tensor * q, InvariantMatmuls * model, MatmulTasks & tasks,
                                     CheckedWeight * checked = nullptr);

// One private graph's quantize_x_node per distinct x (gate and up share theirs), with the memory for
// them: blocks reused from split to split, each handed out once per split (begin()).
class QuantizedX {
public:
    void begin() {
        nodes_.clear();
        used_ = 0;
    }
    // The quantize node of the split's tensor `x`, made at the first call per x over mirror() (its
    // mirror in ctx, asked for only then).
    template <class Mirror>
    ggml_tensor * of(ggml_context * ctx, const ggml_tensor * x, Mirror mirror) {
        ggml_tensor *& q = nodes_[x];
        if (q == nullptr) {
            if (used_ == blocks_.size()) {
                blocks_.emplace_back();
            }
            std::vector<uint8_t> & block = blocks_[used_++];
            block.resize(std::max(block.size(), quantized_x_bytes(x)));
            q = quantize_x_node(ctx, mirror(), block.data());
        }
        return q;
    }

private:
    std::unordered_map<const ggml_tensor *, ggml_tensor *> nodes_;
    std::vector<std::vector<uint8_t>> blocks_;  // moving the outer vector keeps each block's memory
    size_t used_ = 0;
};

class MatmulRows {
public:
    // Computes the split on `cpu` (its thread count): its MUL_MATs by kquant_gemm, its other nodes as
    // ggml-cpu's own ops. Aborts on a MUL_MAT whose output is not contiguous rows (an unsupported
    // graph pattern, never a silent wrong answer).
    ggml_status compute(const ggml_cgraph * split, InvariantMatmuls * model, ggml_backend_t cpu);

private:
    GraphArena arena_;
    QuantizedX quantized_;
    MatmulTasks tasks_;
};

}  // namespace llamaflash
