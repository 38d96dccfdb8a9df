// row_invariance.cpp — see row_invariance.h.
#include "model/row_invariance.h"

#include "ggml-cpu.h"
#include "ggml.h"

#include <cstring>
#include <random>
#include <vector>

namespace llamaflash {

namespace {

constexpr int64_t kProbeK = 256;   // one K-quant super-block per row
constexpr int64_t kProbeOut = 16;  // output rows of W

// Y = W · X for `rows` rows of X starting at `first`, computed as one MUL_MAT: [kProbeOut, rows].
std::vector<float> matmul(ggml_type type, const std::vector<uint8_t> & w, const std::vector<float> & x, int64_t first,
                          int64_t rows, int n_threads) {
    // the tensors, the graph, and the work buffer ggml_graph_compute_with_ctx takes from the context
    // (src1 in the weights' vec_dot_type, the tiled kernel's scratch)
    const size_t mem = ggml_row_size(type, kProbeK) * kProbeOut +
                       static_cast<size_t>(kProbeK * rows + kProbeOut * rows) * sizeof(float) * 4 +
                       8 * ggml_tensor_overhead() + ggml_graph_overhead() + (16u << 20);
    ggml_init_params params = {mem, nullptr, false};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * W = ggml_new_tensor_2d(ctx, type, kProbeK, kProbeOut);
    std::memcpy(W->data, w.data(), w.size());
    ggml_tensor * X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, kProbeK, rows);
    std::memcpy(X->data, x.data() + first * kProbeK, static_cast<size_t>(kProbeK * rows) * sizeof(float));
    ggml_tensor * Y = ggml_mul_mat(ctx, W, X);
    ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, Y);
    ggml_graph_compute_with_ctx(ctx, graph, n_threads);
    std::vector<float> out(static_cast<size_t>(kProbeOut * rows));
    std::memcpy(out.data(), Y->data, out.size() * sizeof(float));
    ggml_free(ctx);
    return out;
}

bool type_rows_invariant(ggml_type type, int max_rows, int n_threads) {
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> wf(static_cast<size_t>(kProbeK * kProbeOut));
    for (float & v : wf) v = normal(rng);
    std::vector<uint8_t> w(ggml_row_size(type, kProbeK) * kProbeOut);
    ggml_quantize_chunk(type, wf.data(), w.data(), 0, kProbeOut, kProbeK, nullptr);
    std::vector<float> x(static_cast<size_t>(kProbeK * max_rows));
    for (float & v : x) v = normal(rng);
    std::vector<float> alone(static_cast<size_t>(kProbeOut * max_rows));
    for (int64_t r = 0; r < max_rows; ++r) {
        const std::vector<float> y = matmul(type, w, x, r, 1, n_threads);
        std::memcpy(alone.data() + r * kProbeOut, y.data(), y.size() * sizeof(float));
    }
    for (int64_t rows : {kTiledMinRows, static_cast<int64_t>(max_rows)}) {
        const std::vector<float> y = matmul(type, w, x, 0, rows, n_threads);
        if (std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)) != 0) {
            return false;
        }
    }
    return true;
}

}  // namespace

bool kquant_rows_invariant(int max_rows, int n_threads) {
    if (max_rows < kTiledMinRows) {
        return true;  // below the tiled kernel: vec_dot for every row
    }
    for (ggml_type type : {GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q3_K, GGML_TYPE_Q2_K}) {
        if (!type_rows_invariant(type, max_rows, n_threads)) {
            return false;
        }
    }
    return true;
}

}  // namespace llamaflash
