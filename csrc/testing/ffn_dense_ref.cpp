// ffn_dense_ref.cpp — see ffn_dense_ref.h.
#include "testing/ffn_dense_ref.h"

#include "ggml-cpu.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

namespace llamaflash {

namespace {

// The first CPU extra (repacked) buffer type whose device accepts MUL_MAT(w, f32 activations), as
// llama.cpp's weight placement picks it; nullptr if none.
ggml_backend_buffer_type_t repack_buft_for(ggml_tensor * w) {
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu_dev == nullptr) return nullptr;
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_dev_get_extra_bufts");
    if (get_extra == nullptr) return nullptr;
    ggml_init_params params = {ggml_tensor_overhead() * 4, nullptr, true};
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * op = ggml_mul_mat(ctx, w, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[0], 512));
    ggml_backend_buffer_type_t found = nullptr;
    for (ggml_backend_buffer_type_t * p = get_extra(cpu_dev); p != nullptr && *p != nullptr && found == nullptr; ++p) {
        w->buffer = ggml_backend_buft_alloc_buffer(*p, 0);
        if (ggml_backend_dev_supports_op(cpu_dev, op)) found = *p;
        ggml_backend_buffer_free(w->buffer);
        w->buffer = nullptr;
    }
    ggml_free(ctx);
    return found;
}

float read_f16(const uint8_t * p) {
    ggml_fp16_t h;
    std::memcpy(&h, p, sizeof(h));
    return ggml_fp16_to_fp32(h);
}

}  // namespace

DenseFfnGraph::DenseFfnGraph(const DenseFfnRefWeights & w, int64_t n_tokens, int n_threads, bool repack, bool gate_only)
    : n_embd_(w.n_embd), n_tokens_(n_tokens) {
    if (w.gate == nullptr || (!gate_only && (w.up == nullptr || w.down == nullptr)) || n_tokens < 1 || n_threads < 1 ||
        w.n_embd < 1 || w.n_ff < 1) {
        throw std::runtime_error("DenseFfnGraph: bad arguments");
    }
    cpu_ = ggml_backend_cpu_init();
    if (cpu_ == nullptr) throw std::runtime_error("DenseFfnGraph: no CPU backend");
    ggml_backend_cpu_set_n_threads(cpu_, n_threads);
    try {
        wctx_ = ggml_init({ggml_tensor_overhead() * 4, nullptr, true});
        ggml_tensor * gate = ggml_new_tensor_2d(wctx_, w.gate_type, w.n_embd, w.n_ff);
        ggml_tensor * up = ggml_new_tensor_2d(wctx_, w.up_type, w.n_embd, w.n_ff);
        ggml_tensor * down = ggml_new_tensor_2d(wctx_, w.down_type, w.n_ff, w.n_embd);
        const std::pair<ggml_tensor *, const uint8_t *> weights[] = {{gate, w.gate}, {up, w.up}, {down, w.down}};
        for (const auto & [t, data] : weights) {
            if (gate_only && t != gate) continue;
            ggml_backend_buffer_type_t buft = repack ? repack_buft_for(t) : nullptr;
            repacked_ = repacked_ || buft != nullptr;
            if (buft == nullptr) buft = ggml_backend_cpu_buffer_type();
            const size_t size = ggml_backend_buft_get_alloc_size(buft, t) + ggml_backend_buft_get_alignment(buft);
            ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, size);
            if (buf == nullptr) throw std::runtime_error("DenseFfnGraph: weight allocation failed");
            buffers_.push_back(buf);
            ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            ggml_tallocr alloc = ggml_tallocr_new(buf);
            if (ggml_tallocr_alloc(&alloc, t) != GGML_STATUS_SUCCESS)
                throw std::runtime_error("DenseFfnGraph: tallocr");
            ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
            weight_bytes_ += ggml_nbytes(t);
        }

        gctx_ = ggml_init({ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true});
        x_ = ggml_new_tensor_2d(gctx_, GGML_TYPE_F32, w.n_embd, n_tokens);
        ggml_set_input(x_);
        ggml_tensor * g = ggml_mul_mat(gctx_, gate, x_);
        if (gate_only) {
            y_ = g;
        } else {
            ggml_tensor * u = ggml_mul_mat(gctx_, up, x_);
            ggml_tensor * h = w.activation == FfnActivation::silu   ? ggml_swiglu_split(gctx_, g, u)
                              : w.activation == FfnActivation::gelu ? ggml_geglu_split(gctx_, g, u)
                                                                    : ggml_reglu_split(gctx_, g, u);
            y_ = ggml_mul_mat(gctx_, down, h);
        }
        ggml_set_output(y_);
        graph_ = ggml_new_graph(gctx_);
        ggml_build_forward_expand(graph_, y_);
        galloc_ = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
        if (!ggml_gallocr_alloc_graph(galloc_, graph_)) throw std::runtime_error("DenseFfnGraph: graph allocation");
    } catch (...) {
        release();
        throw;
    }
}

DenseFfnGraph::~DenseFfnGraph() { release(); }

void DenseFfnGraph::release() {
    if (galloc_ != nullptr) ggml_gallocr_free(galloc_);
    if (gctx_ != nullptr) ggml_free(gctx_);
    for (ggml_backend_buffer_t b : buffers_) ggml_backend_buffer_free(b);
    if (wctx_ != nullptr) ggml_free(wctx_);
    if (cpu_ != nullptr) ggml_backend_free(cpu_);
    galloc_ = nullptr;
    gctx_ = nullptr;
    buffers_.clear();
    wctx_ = nullptr;
    cpu_ = nullptr;
}

void DenseFfnGraph::set_n_threads(int n_threads) {
    ggml_backend_cpu_set_n_threads(cpu_, n_threads < 1 ? 1 : n_threads);
}

double DenseFfnGraph::run(const float * x, float * y) {
    ggml_backend_tensor_set(x_, x, 0, ggml_nbytes(x_));
    const auto t0 = std::chrono::steady_clock::now();
    if (ggml_backend_graph_compute(cpu_, graph_) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("DenseFfnGraph: graph compute failed");
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (y != nullptr) ggml_backend_tensor_get(y_, y, 0, ggml_nbytes(y_));
    return seconds;
}

std::vector<float> activation_roundtrip(ggml_type weight_type, const float * x, int64_t n) {
    if (weight_type < 0 || weight_type >= GGML_TYPE_COUNT)
        throw std::invalid_argument("activation_roundtrip: bad type");
    ggml_cpu_init();
    const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(weight_type);
    if (tr == nullptr || tr->vec_dot == nullptr)
        throw std::invalid_argument("activation_roundtrip: no vec_dot for this type");
    const ggml_type vt = tr->vec_dot_type;
    if (n % ggml_blck_size(vt) != 0)
        throw std::invalid_argument("activation_roundtrip: n is not a whole number of blocks");
    std::vector<uint8_t> q(ggml_row_size(vt, n));
    ggml_get_type_traits_cpu(vt)->from_float(x, q.data(), n);
    std::vector<float> out(n);
    const int64_t nb = n / ggml_blck_size(vt);
    switch (vt) {
        case GGML_TYPE_F32: std::memcpy(out.data(), q.data(), n * sizeof(float)); break;
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q8_1: {  // {f16 d, [f16 s,] int8 qs[32]}
            const size_t head = vt == GGML_TYPE_Q8_0 ? 2 : 4, bs = ggml_type_size(vt);
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t * blk = q.data() + b * bs;
                const float d = read_f16(blk);
                for (int j = 0; j < 32; ++j)
                    out[b * 32 + j] = d * static_cast<float>(static_cast<int8_t>(blk[head + j]));
            }
            break;
        }
        case GGML_TYPE_Q8_K: {  // {f32 d, int8 qs[256], int16 bsums[16]}
            const size_t bs = ggml_type_size(vt);
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t * blk = q.data() + b * bs;
                float d;
                std::memcpy(&d, blk, sizeof(d));
                for (int j = 0; j < 256; ++j)
                    out[b * 256 + j] = d * static_cast<float>(static_cast<int8_t>(blk[4 + j]));
            }
            break;
        }
        default: {
            const ggml_to_float_t to_float = ggml_get_type_traits(vt)->to_float;
            if (to_float == nullptr) {
                throw std::invalid_argument(std::string("activation_roundtrip: cannot decode ") + ggml_type_name(vt));
            }
            to_float(q.data(), out.data(), n);
        }
    }
    return out;
}

}  // namespace llamaflash
