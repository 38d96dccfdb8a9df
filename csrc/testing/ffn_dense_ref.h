// ffn_dense_ref.h — the dense FFN of one layer computed by ggml's own CPU backend, as stock llama.cpp
// computes it: a small ggml graph
//     g = MUL_MAT(gate, x); u = MUL_MAT(up, x); h = {SWIGLU|GEGLU|REGLU}_SPLIT(g, u); y = MUL_MAT(down, h)
// over the base model's weights, on ggml_backend_cpu with n_threads (ggml's OpenMP workers). Weights
// are copied into the buffer type stock llama.cpp would pick for them (the CPU "extra" repacked
// buffer, e.g. Q4_K 8x8, when the CPU backend offers one and `repack` is set; plain CPU memory
// otherwise). For tests (reference for the sparse kernel) and benchmarks (the speed to beat); not
// used by the backend. Also activation_roundtrip(), the activations a row dot multiplies with.
#pragma once

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "lanes/sparse_ffn.h"

#include <cstdint>
#include <vector>

namespace llamaflash {

struct DenseFfnRefWeights {
    int64_t n_embd = 0, n_ff = 0;
    const uint8_t * gate = nullptr;  // ggml ne [n_embd, n_ff]: n_ff contiguous rows (base order)
    const uint8_t * up = nullptr;    // ggml ne [n_embd, n_ff]
    const uint8_t * down = nullptr;  // ggml ne [n_ff, n_embd]: n_embd contiguous rows
    ggml_type gate_type = GGML_TYPE_COUNT, up_type = GGML_TYPE_COUNT, down_type = GGML_TYPE_COUNT;
    FfnActivation activation = FfnActivation::silu;
};

// The graph for a fixed n_tokens, with its own copy of the weights (the caller's memory is not
// referenced after construction). gate_only: the graph is just g = MUL_MAT(gate, x) (output
// [n_tokens, n_ff]; up/down unused and may be null), i.e. the dense half of a hybrid "gate by ggml,
// up/down sparse" lane. Throws std::runtime_error.
class DenseFfnGraph {
public:
    DenseFfnGraph(const DenseFfnRefWeights & w, int64_t n_tokens, int n_threads, bool repack, bool gate_only = false);
    ~DenseFfnGraph();
    DenseFfnGraph(const DenseFfnGraph &) = delete;
    DenseFfnGraph & operator=(const DenseFfnGraph &) = delete;

    // x: f32 [n_tokens, n_embd]; y (may be null): f32 [n_tokens, out_width()]. Returns the wall time of
    // the graph computation alone (seconds), x upload and y download excluded.
    double run(const float * x, float * y);
    void set_n_threads(int n_threads);
    int64_t n_tokens() const { return n_tokens_; }
    int64_t n_embd() const { return n_embd_; }
    int64_t out_width() const { return y_->ne[0]; }  // n_embd, or n_ff for a gate-only graph
    bool repacked() const { return repacked_; }
    size_t weight_bytes() const { return weight_bytes_; }  // bytes of the three weights as stored

private:
    void release();

    int64_t n_embd_, n_tokens_;
    ggml_backend_t cpu_ = nullptr;
    ggml_context * wctx_ = nullptr;
    ggml_context * gctx_ = nullptr;
    std::vector<ggml_backend_buffer_t> buffers_;
    ggml_gallocr_t galloc_ = nullptr;
    ggml_cgraph * graph_ = nullptr;
    ggml_tensor * x_ = nullptr;
    ggml_tensor * y_ = nullptr;
    bool repacked_ = false;
    size_t weight_bytes_ = 0;
};

// For references and tests: x (n values) quantized to vec_dot_type(weight_type) with ggml-cpu's
// from_float and decoded back to f32 (Q8_0, Q8_1, Q8_K, F16, F32 and any type with to_float), i.e.
// the x a `weight_type` row dot effectively multiplies with.
std::vector<float> activation_roundtrip(ggml_type weight_type, const float * x, int64_t n);

}  // namespace llamaflash
