// sparse_ffn.h — the sparse FFN decode kernel: one served layer, computed over its
// active neurons only, straight from the sidecar's neuron-bundled layout (docs/SIDECAR.md).
//
// Dense formula the kernel matches (per token x, n_embd values):
//     g = Gate·x,  u = Up·x              (n_ff values; Gate/Up rows = the base model's rows)
//     h = act(g) ⊙ u
//     y = Down·h = Σ_i h_i · down_t[i]   (down_t[i] = column i of the base Down, n_embd values)
// Sparse: y = Σ_{i ∈ A} h_i · down_t[i], where A (the active set) is
//   A = { i : |act(g_i)| > threshold } over all n_ff neurons (gate-first selection).
//   threshold 0 → every neuron with act(g_i) ≠ 0 (for relu: exactly its nonzero pattern, so the
//   result equals the dense formula); threshold < 0 → every neuron (the dense formula itself).
//   g is computed by the kernel from the bundles' gate rows, or supplied by the caller
//   (SparseFfnParams::gate_values), and likewise u (SparseFfnParams::up_values).
// Neuron indices are positions in the sidecar's bundle order (bundle row k, down_t row k); the
// caller maps them through `ffn_order` when it needs base indices. y does not depend on the order.
//
// Numerics (what "matches" means):
//   * gate/up row dots are ggml-cpu's own `vec_dot` of the weight type, against x quantized once
//     per token to that type's `vec_dot_type` with ggml-cpu's `from_float` (Q4_0/Q8_0 → Q8_0,
//     Q4_1 → Q8_1, K-quants → Q8_K, F16 → F16, F32 → F32): exactly what ggml's MUL_MAT does for one
//     token. `activation_roundtrip()` (ffn_dense_ref.h) returns the x the dots effectively see;
//   * act: silu x/(1+e^-x) (scalar expf; ggml's SIMD silu differs by float rounding);
//     gelu = ggml's GEGLU on CPU: tanh-approximation gelu looked up for x rounded to f16 and the
//     result rounded to f16 (x ≤ -10 → 0, x ≥ 10 → x), reproduced bit for bit without the table;
//     relu max(x, 0);
//   * h_i is f32 and the down_t accumulation is f32 (no quantization of h, unlike ggml's down
//     MUL_MAT, which quantizes h to Q8): down_t row dequantized and scaled by h_i in one pass.
//   * summation order, one of two (the caller picks it, sparse_ffn_by_cluster):
//       by range: the n_ff neurons are split into nth contiguous ranges, one per thread (each
//       thread streams its own part of the weights sequentially), processed in clusters of
//       cluster_size; each thread accumulates a private partial y, partials are summed in thread
//       order. Deterministic for a given thread count; thread counts differ by float rounding.
//       by cluster: each cluster's partial y is its own; y = Σ partials in ascending cluster order.
//       A token's result then depends only on its x, its gate values and the clusters computed:
//       not on the thread count, on how the clusters were split among calls, or on the batch.
//
// Batches: n_tokens > 1 runs every token through a cluster before the next cluster, so a row in
// the union of the tokens' active sets is read from memory once per batch and computed once per
// token that selects it; each token's result is the same as computed alone. The cluster phase
// computes a cluster for all the tokens at once: u_i by kquant_gemm (vec_dot's bits per output) over
// runs of the union's up rows where it computes the up type itself and the rows are contiguous
// (up_rows, cache slots), and the down_t rows of the union into every token's partial by the batched
// axpy (AxpyBatchFn: each row unpacked once for all tokens, h = 0 where a token does not select it)
// where the type has one; the operations per token are those of the token alone.
//
// Threads: the phase API below runs on the caller's threads (the sparse lane: the ggml graph's
// own workers, as custom ops; no thread pool of its own, which would fight ggml's spinning workers).
//
// Memory: the layer is a set of views into memory the caller owns (a mapping of the sidecar, cache
// slots); the kernel allocates nothing once `SparseFfnScratch` has been reserved for the largest
// (n_tokens, n_threads) it will see (sparse_ffn_begin reserves on demand otherwise).
#pragma once

#include "ggml.h"
#include "lanes/sparse_axpy.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace llamaflash {

enum class FfnActivation : int { silu = 0, gelu = 1, relu = 2 };

// "silu" | "gelu" | "relu" (the sidecar's llamaflash.ffn.activation values); throws
// std::invalid_argument otherwise.
FfnActivation parse_ffn_activation(const std::string & name);
const char * ffn_activation_name(FfnActivation act);

// The activation exactly as the kernel applies it to g (see Numerics above).
float ffn_activation(FfnActivation act, float g);

// SparseIsa, sparse_ffn_best_isa(), sparse_isa_name(): see sparse_axpy.h.

// One served layer, as views into caller-owned memory, in sidecar bundle order.
struct SparseFfnLayer {
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    // n_ff rows of bundle_stride bytes: [gate row (gate_row_bytes) | up row (up_row_bytes) | pad]
    const uint8_t * bundles = nullptr;
    size_t bundle_stride = 0;
    ggml_type gate_type = GGML_TYPE_COUNT;
    ggml_type up_type = GGML_TYPE_COUNT;
    size_t gate_row_bytes = 0;  // == ggml_row_size(gate_type, n_embd)
    size_t up_row_bytes = 0;    // == ggml_row_size(up_type, n_embd)
    // (optional) the up rows elsewhere, up row k at up_rows + k·up_stride (the base model's
    // row-major ffn_up when the bundles are in base order): with gate values supplied by the caller
    // only up rows are read, and a dense run of them streams better than every other half-bundle.
    // nullptr: the up rows inside the bundles.
    const uint8_t * up_rows = nullptr;
    size_t up_stride = 0;
    // n_ff rows of down_t_row_bytes bytes, type down_t_type (Q8_0, Q4_0, Q4_1 and F16 have fused SIMD
    // paths; F32 a plain loop; any other type with a ggml to_float works through a
    // dequantize-then-axpy fallback)
    const uint8_t * down_t = nullptr;
    ggml_type down_t_type = GGML_TYPE_COUNT;
    size_t down_t_row_bytes = 0;  // == ggml_row_size(down_t_type, n_embd)
    FfnActivation activation = FfnActivation::silu;
    // (optional) rows by cluster, e.g. the neuron cache's slots (neuron_cache.h): with cluster size
    // C = SparseFfnParams::cluster_size, neuron i's up row is at up_slots[i / C] + (i % C)·up_row_bytes
    // and its down_t row at down_t_slots[i / C] + (i % C)·down_t_row_bytes. Only the cluster phase
    // (sparse_ffn_accumulate_clusters) reads them, and only for the clusters it is given; the
    // bundles, up_rows and down_t views may then be null (gate values must come from the caller).
    const uint8_t * const * up_slots = nullptr;
    const uint8_t * const * down_t_slots = nullptr;
};

// Throws std::invalid_argument naming the problem (null views, row sizes that do not match the
// types, a stride too small, a type ggml-cpu cannot dot).
void sparse_ffn_validate(const SparseFfnLayer & layer);

struct SparseFfnParams {
    float threshold = 0.0f;  // see the selection rules above
    // Precomputed gate values (nullptr: the kernel computes g = gate_i·x itself). f32, token t's g_i
    // (bundle order) at gate_values[t·gate_values_stride + i]; stride 0 = n_ff. With them the gate
    // rows are not read at all: e.g. g from ggml's repacked dense GEMV (the fast way to get every
    // g_i for gate-first selection), then up and down_t for the selected neurons only here.
    const float * gate_values = nullptr;
    size_t gate_values_stride = 0;
    // Precomputed up values (nullptr: the kernel computes u = up_i·x for the selected neurons), same
    // layout as gate_values: e.g. u for every neuron from ggml's repacked dense GEMV, which at low
    // sparsity streams the up matrix faster than per-row dots; the kernel then reads down_t only.
    const float * up_values = nullptr;
    size_t up_values_stride = 0;
    int n_threads = 1;                 // threads that run the phases (>= 1); see the phase API below
    int cluster_size = 32;             // neurons per work unit, 1..256
    SparseIsa isa = SparseIsa::auto_;  // tests force scalar/avx2 to compare paths
};

// The tokens of one call: their inputs and outputs. x and y are f32 [n_tokens, n_embd] with the
// given row strides in bytes (0 = contiguous). y is overwritten.
struct SparseFfnBatch {
    const float * x = nullptr;
    size_t x_stride = 0;
    float * y = nullptr;
    size_t y_stride = 0;
    int64_t n_tokens = 1;
    int32_t * active_counts = nullptr;  // optional out [n_tokens]: |A| per token
    uint8_t * active_mask = nullptr;    // optional out [n_tokens, n_ff]: 1 where neuron is in A
};

// Bytes SparseFfnScratch::reserve allocates for a layer of these types and n_embd, up to n_tokens
// tokens, n_threads threads and n_clusters clusters of the cluster phase (its one buffer, alignment
// included). The planner counts a speculative verify batch's scratch with it
// (llamaflash._native.sparse_scratch_bytes).
size_t sparse_ffn_scratch_bytes(ggml_type gate_type, ggml_type up_type, int64_t n_embd, int64_t n_tokens, int n_threads,
                                int64_t n_clusters);

// Caller-owned working memory; reuse it across calls (one per concurrently running FFN). Also
// holds the plan of the call in progress between sparse_ffn_begin and the last phase.
class SparseFfnScratch {
public:
    // Size for this layer shape, up to n_tokens tokens and n_threads threads. Allocates only when
    // the current capacity is too small.
    // n_clusters > 0: also room for the cluster phase's per-cluster partials.
    void reserve(const SparseFfnLayer & layer, int64_t n_tokens, int n_threads, int64_t n_clusters = 0);
    size_t capacity_bytes() const { return buf_.size(); }

private:
    friend struct SparseFfnImpl;
    friend void sparse_ffn_rebind_cluster_rows(SparseFfnScratch &, ggml_type, ggml_type, const uint8_t * const *,
                                               const uint8_t * const *);
    std::vector<uint8_t> buf_;
    // carved out of buf_ by reserve()
    uint8_t * xq_ = nullptr;  // [n_tokens][xq_gate_bytes + xq_up_bytes] quantized activations
    size_t xq_gate_bytes_ = 0, xq_up_bytes_ = 0, xq_token_bytes_ = 0;
    float * partial_ = nullptr;          // [n_tokens][cap_threads][embd_pad] per-thread partial y
    float * row_tmp_ = nullptr;          // [cap_threads][embd_pad] dequantized down_t row (generic path)
    int32_t * counts_ = nullptr;         // [n_tokens] when the caller wants no counts
    float * cluster_partial_ = nullptr;  // cluster phase: [n_clusters][n_tokens][embd_pad] partial y
    uint8_t * listed_ = nullptr;         // cluster phase: [n_clusters] 1 once listed in this call
    float * tile_ = nullptr;             // cluster phase, several tokens: [cap_threads] batch tiles
    size_t tile_floats_ = 0;             // floats of one thread's tile
    int64_t cap_clusters_ = 0;
    size_t embd_pad_ = 0;
    int64_t cap_tokens_ = 0;
    int cap_threads_ = 0;
    int64_t cap_embd_ = 0;
    size_t cap_xq_token_bytes_ = 0;
    // plan of the current call (set by sparse_ffn_begin)
    SparseFfnLayer layer_;
    SparseFfnParams params_;
    SparseFfnBatch batch_;
    SparseIsa isa_ = SparseIsa::scalar;
    float g_lo_ = 0.0f;  // selection prefilter bound (see sparse_ffn.cpp)
};

// Phase API: the computation cut at its barriers, run on the caller's threads, e.g. as ggml custom
// ops with n_tasks = nth (ggml's graph executor puts a barrier between consecutive nodes), so the
// FFN runs inside one ggml graph compute without a fork/join.
//   sparse_ffn_begin       one thread, before the others: validates (throws std::invalid_argument
//                          before any work starts), reserves the scratch for params.n_threads,
//                          zeroes the outputs, records the plan in `scratch` (layer, params and
//                          batch must stay valid until the last phase returns);
//   then every thread ith in [0, nth), nth <= params.n_threads, the same nth throughout:
//   sparse_ffn_quantize    x → activations in vec_dot types (tokens split over threads)
//   -- barrier --
// then, by range (sparse_ffn_by_cluster false):
//   sparse_ffn_accumulate  range ith of nth of the n_ff neurons, every token, into thread ith's
//                          partial y
//   -- barrier --
//   sparse_ffn_reduce      y = Σ partials in thread order (chunks of n_embd split over threads)
// or by cluster (sparse_ffn_by_cluster true): any number of
//   sparse_ffn_accumulate_clusters(scratch, ith, clusters, n)
// calls (barriers between them), thread ith computing exactly the clusters it lists (cluster c =
// neurons [c·C, min((c+1)·C, n_ff)), C = params.cluster_size) into each cluster's own partial y,
// e.g. one at a time, each right after the caller has done something to its rows; then
//   sparse_ffn_reduce_clusters(scratch, ith, nth)
// y_t = Σ over the listed clusters in ascending cluster order of partial_c,t. So token t's result
// depends only on its x, its gate values and the set of clusters listed: not on how the clusters
// were split among threads and calls (resident now vs read later), the thread count, or the other
// tokens of the batch. No cluster may be listed twice in one call of the FFN. Exact (the sparse
// formula) when the lists cover every cluster holding an active neuron; a caller may list fewer on
// purpose (a draft that uses only resident clusters), which drops the missing clusters' terms.
// Rows come from layer.up_slots / down_t_slots when set, else from the flat views. Scratch:
// n_tokens · ceil(n_ff / C) · n_embd floats more.
// The phases never throw and never allocate.
void sparse_ffn_begin(const SparseFfnLayer & layer, const SparseFfnParams & params, const SparseFfnBatch & batch,
                      SparseFfnScratch & scratch);
void sparse_ffn_quantize(SparseFfnScratch & scratch, int ith, int nth);
void sparse_ffn_accumulate(SparseFfnScratch & scratch, int ith, int nth);
void sparse_ffn_reduce(SparseFfnScratch & scratch, int ith, int nth);
void sparse_ffn_accumulate_clusters(SparseFfnScratch & scratch, int ith, const int32_t * clusters, int64_t n_clusters);
void sparse_ffn_reduce_clusters(SparseFfnScratch & scratch, int ith, int nth);

// The summation order a call takes: by cluster exactly when the caller supplies the gate values and
// not the up values (the cluster phase needs g before any row is read, to plan the clusters; with
// u for every neuron from the caller, by range streams only down_t rows, in one pass).
bool sparse_ffn_by_cluster(const SparseFfnParams & params);

// For the cluster phase: needed[c] = 1 when cluster c holds a neuron that the kernel's selection rule
// makes active for at least one token of the call, else 0 (ceil(n_ff / C) entries). One thread, after
// sparse_ffn_begin, once the gate values are final.
void sparse_ffn_needed_clusters(const SparseFfnScratch & scratch, uint8_t * needed);

// Cluster phase only: rows of other types for the clusters listed from now on. Between two
// sparse_ffn_accumulate_clusters calls (one thread, barriers around it), the clusters listed after it
// take their up and down_t rows from up_slots[c] / down_t_slots[c] (rows of n_embd values of
// up_type / down_t_type, row i − c·C of the cluster at + (i − c·C)·row bytes), e.g. a draft computing
// the clusters not resident from a low-bit copy. Partials computed so far stay; the reduction is the
// same. Allowed only when sparse_ffn_can_rebind(layer, up_type, down_t_type): x is quantized once per
// call, so the new up type must dot against the same vec_dot type. Never throws, never allocates.
bool sparse_ffn_can_rebind(const SparseFfnLayer & layer, ggml_type up_type, ggml_type down_t_type);
void sparse_ffn_rebind_cluster_rows(SparseFfnScratch & scratch, ggml_type up_type, ggml_type down_t_type,
                                    const uint8_t * const * up_slots, const uint8_t * const * down_t_slots);

}  // namespace llamaflash
