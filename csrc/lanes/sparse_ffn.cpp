// sparse_ffn.cpp — see sparse_ffn.h for the contract, shapes and the dense formula.
//
// Work decomposition (three phases, barriers between them; see the phase API in the header):
//   1. quantize: x_t → xq_gate_t, xq_up_t with ggml-cpu's from_float (tokens over threads);
//   2. accumulate: by range, the n_ff neurons are cut into nth contiguous ranges (thread ith
//      streams range ith: sequential reads per thread), each processed in clusters of
//      `cluster_size` (deterministic); by cluster, each thread takes the clusters it is given. A
//      batch runs every token through a cluster before the next cluster, so each row of the union
//      of the tokens' active sets is read from memory once;
//   3. per cluster: for each neuron i, g = the caller's gate value or vec_dot(gate_i, xq_gate)
//      (gate rows prefetched a few neurons ahead: in a bundle run they are strided), a = act(g); if
//      selected, its up and down_t rows are prefetched; then u = the caller's up value or
//      vec_dot(up_i, xq_up), h_i = a·u for the selected; then their down_t rows are dequantized,
//      scaled by h_i and added into the partial y, up to 4 rows per pass over y (one load/store of
//      y per 4 rows);
//   4. reduce: by range y_t = Σ_threads partial (chunks of n_embd over threads, fixed thread
//      order); by cluster y_t = Σ_clusters partial in ascending cluster order.
#include "lanes/sparse_ffn.h"

#include "kernels/kquant_gemm.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace llamaflash {

namespace {

constexpr int kMaxCluster = 256;
constexpr int kGateAhead = 4;  // gate rows prefetched this many neurons ahead
constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Prefetch [p, p + bytes) into L2 (a down_t row is 26 lines for n_embd 1536 Q8_0: into L1 it would
// evict the partial y and quantized x while a whole cluster's rows are in flight).
inline void prefetch_l2(const uint8_t * p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(p + off, 0, 2);
    }
}

// Selection prefilter (exact). silu and gelu are increasing for g >= 0 and bounded in magnitude by
// a small peak for g < 0 (silu: 0.2785 at g = -1.278; gelu: 0.1700 at g = -0.752). For a threshold
// above that peak, |act(g)| > thr only for g above the positive crossing g*, so every g below a point
// g_lo safely under g* (act(g_lo) = 0.99·thr: far more margin than float and f16 rounding of act
// need) is rejected without evaluating act (expf / tanhf). Returns -inf when no prefilter applies.
float prefilter_bound(FfnActivation act, float thr) {
    double peak = 0.0;
    switch (act) {
        case FfnActivation::silu: peak = 0.27847; break;
        case FfnActivation::gelu: peak = 0.17004; break;
        case FfnActivation::relu: return -INFINITY;  // max(g, 0) is cheaper than the test
    }
    if (!(thr > 1.01 * peak)) return -INFINITY;
    auto f = [act](double g) {
        return act == FfnActivation::silu
                   ? g / (1.0 + std::exp(-g))
                   : 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * g * (1.0 + 0.044715 * g * g)));
    };
    const double target = 0.99 * thr;
    double lo = 0.0, hi = 2.0 * thr + 1.0;  // f(hi) > thr: both are >= g - 0.5 for g >= 0
    for (int it = 0; it < 100; ++it) {
        const double mid = 0.5 * (lo + hi);
        (f(mid) < target ? lo : hi) = mid;
    }
    return static_cast<float>(lo);  // f(lo) < 0.99 thr
}

void ensure_cpu_init() {
    static std::once_flag once;
    std::call_once(once, [] { ggml_cpu_init(); });  // fp16 / gelu tables used by some CPU kernels
}

const ggml_type_traits_cpu * dot_traits(ggml_type type, const char * what) {
    const ggml_type_traits_cpu * t = ggml_get_type_traits_cpu(type);
    if (t == nullptr || t->vec_dot == nullptr || ggml_get_type_traits_cpu(t->vec_dot_type)->from_float == nullptr) {
        throw std::invalid_argument(std::string("sparse_ffn: ") + what + " type " + ggml_type_name(type) +
                                    " has no ggml-cpu vec_dot");
    }
    return t;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

FfnActivation parse_ffn_activation(const std::string & name) {
    if (name == "silu") return FfnActivation::silu;
    if (name == "gelu") return FfnActivation::gelu;
    if (name == "relu") return FfnActivation::relu;
    throw std::invalid_argument("sparse_ffn: unknown activation '" + name + "' (expected silu, gelu or relu)");
}

const char * ffn_activation_name(FfnActivation act) {
    switch (act) {
        case FfnActivation::silu: return "silu";
        case FfnActivation::gelu: return "gelu";
        case FfnActivation::relu: return "relu";
    }
    return "?";
}

float ffn_activation(FfnActivation act, float g) {
    switch (act) {
        case FfnActivation::silu: return g / (1.0f + std::exp(-g));
        case FfnActivation::gelu: {
            // ggml-cpu GEGLU (GGML_GELU_FP16): table[f16(g)] with table[v] = f16(gelu_tanh(v))
            if (g <= -10.0f) return 0.0f;
            if (g >= 10.0f) return g;
            const float v = ggml_fp16_to_fp32(ggml_fp32_to_fp16(g));
            const float r =
                0.5f * v * (1.0f + std::tanh(0.79788456080286535587989211986876f * v * (1.0f + 0.044715f * v * v)));
            return ggml_fp16_to_fp32(ggml_fp32_to_fp16(r));
        }
        case FfnActivation::relu: return g > 0.0f ? g : 0.0f;
    }
    return 0.0f;
}

void sparse_ffn_validate(const SparseFfnLayer & L) {
    auto fail = [](const std::string & msg) { throw std::invalid_argument("sparse_ffn: " + msg); };
    if (L.n_embd <= 0 || L.n_ff <= 0) fail("empty layer shape");
    if ((L.up_slots == nullptr) != (L.down_t_slots == nullptr)) fail("up_slots and down_t_slots go together");
    if (L.up_slots == nullptr && (L.bundles == nullptr || L.down_t == nullptr)) fail("null weight view");
    for (ggml_type t : {L.gate_type, L.up_type, L.down_t_type}) {
        if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0)
            fail("unknown ggml type " + std::to_string(int(t)));
    }
    auto check_row = [&](ggml_type t, size_t bytes, const char * what) {
        if (L.n_embd % ggml_blck_size(t) != 0 || ggml_row_size(t, L.n_embd) != bytes) {
            fail(std::string(what) + " row of " + std::to_string(L.n_embd) + " " + ggml_type_name(t) +
                 " values is not " + std::to_string(bytes) + " bytes");
        }
    };
    check_row(L.gate_type, L.gate_row_bytes, "gate");
    check_row(L.up_type, L.up_row_bytes, "up");
    check_row(L.down_t_type, L.down_t_row_bytes, "down_t");
    if (L.bundle_stride < L.gate_row_bytes + L.up_row_bytes) fail("bundle stride smaller than gate + up row");
    if (L.up_rows != nullptr && L.up_stride < L.up_row_bytes) fail("up stride smaller than an up row");
    dot_traits(L.gate_type, "gate");
    dot_traits(L.up_type, "up");
    if (pick_axpy(L.down_t_type, SparseIsa::scalar) == nullptr &&
        ggml_get_type_traits(L.down_t_type)->to_float == nullptr) {
        fail(std::string("down_t type ") + ggml_type_name(L.down_t_type) + " cannot be dequantized");
    }
}

namespace {

// The carve-up of SparseFfnScratch's one buffer for these capacities (bytes of each region, in order).
struct ScratchRegions {
    size_t xq, partial, tmp, counts, cluster_partial, listed, tile, embd_pad;
    size_t total() const { return xq + partial + tmp + counts + cluster_partial + listed + tile + kAlign; }
};

// Floats of one thread's batch tile (cluster phase, several tokens: accumulate_cluster_batch): h and u
// f32 [n_tokens][kMaxCluster], the selection u8 [n_tokens][kMaxCluster], the batched axpy's scratch.
size_t tile_floats(int64_t tokens) {
    const size_t per_token = kMaxCluster;
    return round_up(2 * static_cast<size_t>(tokens) * per_token + static_cast<size_t>(tokens) * per_token / 4 +
                        axpy_batch_scratch_floats(kMaxCluster),
                    kAlign / sizeof(float));
}

ScratchRegions scratch_regions(size_t xq_token_bytes, int64_t tokens, int threads, int64_t embd, int64_t clusters) {
    ScratchRegions r{};
    r.embd_pad = round_up(static_cast<size_t>(embd), kAlign / sizeof(float));
    const size_t row = r.embd_pad * sizeof(float);
    r.xq = static_cast<size_t>(tokens) * xq_token_bytes;
    r.partial = static_cast<size_t>(tokens) * threads * row;
    r.tmp = static_cast<size_t>(threads) * row;
    r.counts = round_up(static_cast<size_t>(tokens) * sizeof(int32_t), kAlign);
    r.cluster_partial = static_cast<size_t>(clusters) * tokens * row;
    r.listed = round_up(static_cast<size_t>(clusters), kAlign);
    r.tile = clusters > 0 && tokens > 1 ? static_cast<size_t>(threads) * tile_floats(tokens) * sizeof(float) : 0;
    return r;
}

// Bytes of one token's activations quantized to the gate's (and, when it differs, the up's) vec_dot type.
void xq_row_bytes(ggml_type gate_type, ggml_type up_type, int64_t n_embd, size_t & gate_bytes, size_t & up_bytes) {
    const ggml_type vg = ggml_get_type_traits_cpu(gate_type)->vec_dot_type;
    const ggml_type vu = ggml_get_type_traits_cpu(up_type)->vec_dot_type;
    gate_bytes = round_up(ggml_row_size(vg, n_embd), kAlign);
    up_bytes = vu == vg ? 0 : round_up(ggml_row_size(vu, n_embd), kAlign);
}

}  // namespace

size_t sparse_ffn_scratch_bytes(ggml_type gate_type, ggml_type up_type, int64_t n_embd, int64_t n_tokens, int n_threads,
                                int64_t n_clusters) {
    size_t gate_bytes = 0, up_bytes = 0;
    xq_row_bytes(gate_type, up_type, n_embd, gate_bytes, up_bytes);
    return scratch_regions(gate_bytes + up_bytes, std::max<int64_t>(n_tokens, 1), std::max(n_threads, 1), n_embd,
                           n_clusters)
        .total();
}

void SparseFfnScratch::reserve(const SparseFfnLayer & L, int64_t n_tokens, int n_threads, int64_t n_clusters) {
    size_t gate_bytes = 0, up_bytes = 0;
    xq_row_bytes(L.gate_type, L.up_type, L.n_embd, gate_bytes, up_bytes);
    const size_t token_bytes = gate_bytes + up_bytes;
    n_tokens = std::max<int64_t>(n_tokens, 1);
    n_threads = std::max(n_threads, 1);
    xq_gate_bytes_ = gate_bytes;
    xq_up_bytes_ = up_bytes;
    xq_token_bytes_ = token_bytes;
    if (n_tokens <= cap_tokens_ && n_threads <= cap_threads_ && L.n_embd <= cap_embd_ &&
        token_bytes <= cap_xq_token_bytes_ && n_clusters <= cap_clusters_) {
        return;  // the carve-up for the larger capacity still fits
    }
    cap_tokens_ = std::max(cap_tokens_, n_tokens);
    cap_threads_ = std::max(cap_threads_, n_threads);
    cap_embd_ = std::max(cap_embd_, L.n_embd);
    cap_xq_token_bytes_ = std::max(cap_xq_token_bytes_, token_bytes);
    cap_clusters_ = std::max(cap_clusters_, n_clusters);
    const ScratchRegions r = scratch_regions(cap_xq_token_bytes_, cap_tokens_, cap_threads_, cap_embd_, cap_clusters_);
    embd_pad_ = r.embd_pad;
    buf_.assign(r.total(), 0);
    uint8_t * p = reinterpret_cast<uint8_t *>(round_up(reinterpret_cast<uintptr_t>(buf_.data()), kAlign));
    xq_ = p;
    partial_ = reinterpret_cast<float *>(p += r.xq);
    row_tmp_ = reinterpret_cast<float *>(p += r.partial);
    counts_ = reinterpret_cast<int32_t *>(p += r.tmp);
    cluster_partial_ = reinterpret_cast<float *>(p += r.counts);
    listed_ = p += r.cluster_partial;
    tile_ = reinterpret_cast<float *>(p += r.listed);
    tile_floats_ = r.tile != 0 ? tile_floats(cap_tokens_) : 0;
}

// The selection rule (see sparse_ffn.h): true when neuron with gate value g is active, with a =
// act(g). g_lo is the exact prefilter bound (prefilter_bound); thr < 0 keeps every neuron.
inline bool selected(FfnActivation act, float g, float g_lo, float thr, float & a) {
    if (g < g_lo) return false;  // |act(g)| <= thr for sure
    a = ffn_activation(act, g);
    return thr < 0.0f || std::fabs(a) > thr;
}

// One work unit's selected neurons, handed from pass 1 to pass 2 (UnitPass::run).
struct UnitSelection {
    int n = 0;
    int32_t ids[kMaxCluster];
    float hs[kMaxCluster];              // act(g_i); pass 2 multiplies in u_i
    const uint8_t * rows[kMaxCluster];  // down_t rows
    const uint8_t * up_rows[kMaxCluster];

    // Appends neuron i; prefetches its down_t row (and its up row when pass 2 dots it).
    void add(int32_t i, float a, const uint8_t * down_t_row, size_t down_t_bytes, const uint8_t * up_row,
             size_t up_bytes, bool prefetch_up) {
        ids[n] = i;
        hs[n] = a;
        rows[n] = down_t_row;
        up_rows[n] = up_row;
        if (prefetch_up) prefetch_l2(up_row, up_bytes);
        prefetch_l2(down_t_row, down_t_bytes);
        ++n;
    }
};

// What the two accumulate phases share: pass 2 of a work unit of m selected neurons, h_r = act_r ·
// u_r (u_r from the caller's up values, else vec_dot of up row r against xq_up), then
// acc += Σ_r h_r · down_t row r (fused, or dequantized into tmp first), and the neurons marked in mask.
struct UnitPass {
    ggml_vec_dot_t up_dot;
    AxpyFn axpy;
    ggml_to_float_t down_to_float;
    int n_embd;

    void run(float * acc, float * tmp, UnitSelection & sel, const float * uv, const uint8_t * xq_up,
             uint8_t * mask) const {
        const int m = sel.n;
        for (int r = 0; r < m; ++r) {
            float u;
            if (uv != nullptr) {
                u = uv[sel.ids[r]];
            } else {
                up_dot(n_embd, &u, 0, sel.up_rows[r], 0, xq_up, 0, 1);
            }
            sel.hs[r] *= u;
        }
        add_rows(acc, tmp, sel.rows, sel.hs, m);
        if (mask != nullptr) {
            for (int r = 0; r < m; ++r) mask[sel.ids[r]] = 1;
        }
    }

    // acc += Σ_r hs[r] · down_t row r (fused, or dequantized into tmp first)
    void add_rows(float * acc, float * tmp, const uint8_t * const * rows, const float * hs, int m) const {
        if (axpy != nullptr) {
            axpy(acc, rows, hs, m, n_embd);
            return;
        }
        for (int r = 0; r < m; ++r) {
            down_to_float(rows[r], tmp, n_embd);
            for (int j = 0; j < n_embd; ++j) acc[j] += hs[r] * tmp[j];
        }
    }
};

UnitPass unit_pass(const SparseFfnLayer & L, SparseIsa isa) {
    return {ggml_get_type_traits_cpu(L.up_type)->vec_dot, pick_axpy(L.down_t_type, isa),
            ggml_get_type_traits(L.down_t_type)->to_float, static_cast<int>(L.n_embd)};
}

// Accessor for the phases (friend of SparseFfnScratch).
struct SparseFfnImpl {
    static void begin(const SparseFfnLayer & L, const SparseFfnParams & P, const SparseFfnBatch & batch,
                      SparseFfnScratch & S);
    static void quantize(SparseFfnScratch & S, int ith, int nth);
    static void accumulate(SparseFfnScratch & S, int ith, int nth);
    static void reduce(SparseFfnScratch & S, int ith, int nth);
    static void accumulate_clusters(SparseFfnScratch & S, int ith, const int32_t * clusters, int64_t n);
    static void accumulate_cluster_batch(SparseFfnScratch & S, int ith, int64_t c);
    static void needed_clusters(const SparseFfnScratch & S, uint8_t * needed);
    static void reduce_clusters(SparseFfnScratch & S, int ith, int nth);
    static float * partial(SparseFfnScratch & S, int64_t t, int th) {
        return S.partial_ + (static_cast<size_t>(t) * S.cap_threads_ + th) * S.embd_pad_;
    }
    static float * cluster_partial(SparseFfnScratch & S, int64_t c, int64_t t) {
        return S.cluster_partial_ + (static_cast<size_t>(c) * S.cap_tokens_ + t) * S.embd_pad_;
    }
    static int64_t n_clusters(const SparseFfnLayer & L, const SparseFfnParams & P) {
        return (L.n_ff + P.cluster_size - 1) / P.cluster_size;
    }
    // Token t's inputs and outputs as the accumulate phases read them.
    struct TokenView {
        const uint8_t * xq_gate;
        const uint8_t * xq_up;
        const float * gv;  // caller's gate values, or nullptr
        const float * uv;  // caller's up values, or nullptr
        uint8_t * mask;    // batch.active_mask row, or nullptr
    };
    static TokenView token(const SparseFfnScratch & S, int64_t t) {
        const SparseFfnLayer & L = S.layer_;
        const SparseFfnParams & P = S.params_;
        const uint8_t * xq_gate = S.xq_ + static_cast<size_t>(t) * S.xq_token_bytes_;
        return {xq_gate, S.xq_up_bytes_ == 0 ? xq_gate : xq_gate + S.xq_gate_bytes_,
                P.gate_values != nullptr
                    ? P.gate_values + t * (P.gate_values_stride != 0 ? P.gate_values_stride : L.n_ff)
                    : nullptr,
                P.up_values != nullptr ? P.up_values + t * (P.up_values_stride != 0 ? P.up_values_stride : L.n_ff)
                                       : nullptr,
                S.batch_.active_mask != nullptr ? S.batch_.active_mask + t * L.n_ff : nullptr};
    }
};

void SparseFfnImpl::begin(const SparseFfnLayer & L, const SparseFfnParams & P, const SparseFfnBatch & batch,
                          SparseFfnScratch & S) {
    sparse_ffn_validate(L);
    auto fail = [](const std::string & msg) { throw std::invalid_argument("sparse_ffn: " + msg); };
    if (batch.n_tokens < 0) fail("negative n_tokens");
    if (batch.n_tokens > 0 && (batch.x == nullptr || batch.y == nullptr)) fail("null x or y");
    if (P.n_threads < 1) fail("n_threads must be >= 1");
    if (P.cluster_size < 1 || P.cluster_size > kMaxCluster) fail("cluster_size must be in 1..256");
    if (std::isnan(P.threshold)) fail("threshold is NaN");
    const SparseIsa isa = P.isa == SparseIsa::auto_ ? sparse_ffn_best_isa() : P.isa;
    if (static_cast<int>(isa) > static_cast<int>(sparse_ffn_best_isa())) {
        fail(std::string("ISA ") + sparse_isa_name(isa) + " is not supported by this CPU");
    }
    const bool by_cluster = sparse_ffn_by_cluster(P);
    if (L.up_slots != nullptr && !by_cluster) fail("rows by cluster need caller gate values and no up values");
    ensure_cpu_init();
    S.reserve(L, batch.n_tokens, P.n_threads, by_cluster ? n_clusters(L, P) : 0);
    if (by_cluster) std::memset(S.listed_, 0, static_cast<size_t>(n_clusters(L, P)));
    S.layer_ = L;
    S.params_ = P;
    S.batch_ = batch;
    if (S.batch_.x_stride == 0) S.batch_.x_stride = L.n_embd * sizeof(float);
    if (S.batch_.y_stride == 0) S.batch_.y_stride = L.n_embd * sizeof(float);
    if (S.batch_.active_counts == nullptr) S.batch_.active_counts = S.counts_;
    S.isa_ = isa;
    S.g_lo_ = prefilter_bound(L.activation, P.threshold);
    if (!by_cluster) {
        for (int64_t t = 0; t < batch.n_tokens; ++t) {
            for (int th = 0; th < P.n_threads; ++th) std::memset(partial(S, t, th), 0, L.n_embd * sizeof(float));
        }
    }
    std::fill(S.batch_.active_counts, S.batch_.active_counts + batch.n_tokens, 0);
    if (batch.active_mask != nullptr) std::memset(batch.active_mask, 0, static_cast<size_t>(batch.n_tokens) * L.n_ff);
}

void SparseFfnImpl::quantize(SparseFfnScratch & S, int ith, int nth) {
    const SparseFfnLayer & L = S.layer_;
    const ggml_from_float_t gate_q =
        ggml_get_type_traits_cpu(ggml_get_type_traits_cpu(L.gate_type)->vec_dot_type)->from_float;
    const ggml_from_float_t up_q =
        ggml_get_type_traits_cpu(ggml_get_type_traits_cpu(L.up_type)->vec_dot_type)->from_float;
    for (int64_t t = ith; t < S.batch_.n_tokens; t += nth) {
        const float * xt =
            reinterpret_cast<const float *>(reinterpret_cast<const uint8_t *>(S.batch_.x) + t * S.batch_.x_stride);
        uint8_t * q = S.xq_ + static_cast<size_t>(t) * S.xq_token_bytes_;
        gate_q(xt, q, L.n_embd);
        if (S.xq_up_bytes_ != 0) up_q(xt, q + S.xq_gate_bytes_, L.n_embd);
    }
}

void SparseFfnImpl::accumulate(SparseFfnScratch & S, int ith, int nth) {
    const SparseFfnLayer & L = S.layer_;
    const SparseFfnParams & P = S.params_;
    const SparseFfnBatch & batch = S.batch_;
    const ggml_vec_dot_t gate_dot = ggml_get_type_traits_cpu(L.gate_type)->vec_dot;
    const UnitPass pass2 = unit_pass(L, S.isa_);
    const int n_embd = static_cast<int>(L.n_embd);
    const float thr = P.threshold, g_lo = S.g_lo_;
    const int cs = P.cluster_size;
    float * tmp = S.row_tmp_ + static_cast<size_t>(ith) * S.embd_pad_;
    UnitSelection sel;
    const uint8_t * const up_base = L.up_rows != nullptr ? L.up_rows : L.bundles + L.gate_row_bytes;
    const size_t up_stride = L.up_rows != nullptr ? L.up_stride : L.bundle_stride;

    // Neurons [k0, k1) of token t: pass 1, gate and selection, prefetching the selected neurons' up
    // and down_t rows so they arrive while the rest of the cluster's gates are computed; pass 2,
    // h_i = act(g_i) · (up_i · x), then the down_t rows.
    auto cluster = [&](int64_t t, int64_t k0, int64_t k1) {
        const TokenView tv = token(S, t);
        sel.n = 0;
        for (int64_t i = k0; i < k1; ++i) {
            float g, a;
            if (tv.gv != nullptr) {
                g = tv.gv[i];
            } else {
                if (i + kGateAhead < L.n_ff) {  // gate rows are strided (bundles)
                    prefetch_l2(L.bundles + static_cast<size_t>(i + kGateAhead) * L.bundle_stride, L.gate_row_bytes);
                }
                gate_dot(n_embd, &g, 0, L.bundles + static_cast<size_t>(i) * L.bundle_stride, 0, tv.xq_gate, 0, 1);
            }
            if (!selected(L.activation, g, g_lo, thr, a)) continue;
            sel.add(static_cast<int32_t>(i), a, L.down_t + static_cast<size_t>(i) * L.down_t_row_bytes,
                    L.down_t_row_bytes, up_base + static_cast<size_t>(i) * up_stride, L.up_row_bytes, tv.uv == nullptr);
        }
        pass2.run(partial(S, t, ith), tmp, sel, tv.uv, tv.xq_up, tv.mask);  // partial zeroed by begin
        if (sel.n != 0) __atomic_fetch_add(batch.active_counts + t, sel.n, __ATOMIC_RELAXED);
    };

    // cluster by cluster, every token of the batch in turn, so a batch reads each row of the union
    // of its active sets from memory once (the later tokens find it in cache). Each token's
    // summation order is the same as for that token alone.
    const int64_t range_begin = L.n_ff * ith / nth, range_end = L.n_ff * (ith + 1) / nth;
    for (int64_t k0 = range_begin; k0 < range_end; k0 += cs) {
        const int64_t k1 = std::min<int64_t>(k0 + cs, range_end);
        for (int64_t t = 0; t < batch.n_tokens; ++t) cluster(t, k0, k1);
    }
}

// Same selection and arithmetic as accumulate() (gate values from the caller), over whole clusters:
// clusters[0, n) on thread ith's scratch; rows from the cluster slots when the layer has them.
void SparseFfnImpl::accumulate_clusters(SparseFfnScratch & S, int ith, const int32_t * clusters, int64_t n) {
    const SparseFfnLayer & L = S.layer_;
    const SparseFfnParams & P = S.params_;
    const SparseFfnBatch & batch = S.batch_;
    const UnitPass pass2 = unit_pass(L, S.isa_);
    const float thr = P.threshold, g_lo = S.g_lo_;
    const int64_t cs = P.cluster_size;
    float * tmp = S.row_tmp_ + static_cast<size_t>(ith) * S.embd_pad_;
    UnitSelection sel;
    const bool slotted = L.up_slots != nullptr;
    const uint8_t * const up_base = L.up_rows != nullptr ? L.up_rows : L.bundles + L.gate_row_bytes;
    const size_t up_stride = L.up_rows != nullptr ? L.up_stride : L.bundle_stride;

    // as in accumulate(): cluster by cluster, the batch's tokens in turn (one read of each row),
    // each (cluster, token) into its own partial (see reduce_clusters); several tokens together where
    // the scratch has their tile (accumulate_cluster_batch: the same bits)
    for (int64_t k = 0; k < n; ++k) {
        const int64_t c = clusters[k];
        S.listed_[c] = 1;
        if (batch.n_tokens > 1 && S.tile_floats_ != 0) {
            accumulate_cluster_batch(S, ith, c);
            continue;
        }
        const int64_t i0 = c * cs, i1 = std::min<int64_t>(i0 + cs, L.n_ff);
        for (int64_t t = 0; t < batch.n_tokens; ++t) {
            float * acc = cluster_partial(S, c, t);
            std::memset(acc, 0, static_cast<size_t>(L.n_embd) * sizeof(float));
            const TokenView tv = token(S, t);
            sel.n = 0;
            for (int64_t i = i0; i < i1; ++i) {
                float a;
                if (!selected(L.activation, tv.gv[i], g_lo, thr, a)) continue;
                const size_t r = static_cast<size_t>(slotted ? i - i0 : i);  // row within its view
                sel.add(static_cast<int32_t>(i), a, (slotted ? L.down_t_slots[c] : L.down_t) + r * L.down_t_row_bytes,
                        L.down_t_row_bytes, slotted ? L.up_slots[c] + r * L.up_row_bytes : up_base + r * up_stride,
                        L.up_row_bytes, tv.uv == nullptr);
            }
            pass2.run(acc, tmp, sel, tv.uv, tv.xq_up, tv.mask);
            if (sel.n != 0) __atomic_fetch_add(batch.active_counts + t, sel.n, __ATOMIC_RELAXED);
        }
    }
}

// Cluster c for every token of the call at once, each token with exactly the operations it gets alone
// (the loop in accumulate_clusters): the selection per token; u_i for the union U of the selected rows
// by kquant_gemm over runs of U's rows × all the tokens where it computes the up type itself (each
// output has vec_dot's bits: the u a token alone gets), else vec_dot per selected (token, row);
// h_i = act(g_i) · u_i; then the down_t rows of U into every token's partial by the batched axpy, with
// h = 0 where a token does not select a row (AxpyBatchFn: the bits of the token's own rows alone), or
// the plain axpy per token over its own rows where the type has no batched kernel.
void SparseFfnImpl::accumulate_cluster_batch(SparseFfnScratch & S, int ith, int64_t c) {
    const SparseFfnLayer & L = S.layer_;
    const SparseFfnParams & P = S.params_;
    const SparseFfnBatch & batch = S.batch_;
    const int64_t T = batch.n_tokens, cs = P.cluster_size;
    const int64_t i0 = c * cs, i1 = std::min<int64_t>(i0 + cs, L.n_ff);
    const int m = static_cast<int>(i1 - i0);
    const int n_embd = static_cast<int>(L.n_embd);
    const float thr = P.threshold, g_lo = S.g_lo_;
    const bool slotted = L.up_slots != nullptr;
    const uint8_t * const up_base = L.up_rows != nullptr ? L.up_rows : L.bundles + L.gate_row_bytes;
    const size_t up_stride = L.up_rows != nullptr ? L.up_stride : L.bundle_stride;
    // row r of the cluster (neuron i0 + r)
    const uint8_t * up0 = slotted ? L.up_slots[c] : up_base + static_cast<size_t>(i0) * up_stride;
    const size_t up_step = slotted ? L.up_row_bytes : up_stride;
    const uint8_t * down0 = slotted ? L.down_t_slots[c] : L.down_t + static_cast<size_t>(i0) * L.down_t_row_bytes;

    float * const hs = S.tile_ + static_cast<size_t>(ith) * S.tile_floats_;      // [T][kMaxCluster]
    float * const us = hs + T * kMaxCluster;                                     // [T][kMaxCluster]
    uint8_t * const picked = reinterpret_cast<uint8_t *>(us + T * kMaxCluster);  // [T][kMaxCluster]
    float * const axpy_scratch = us + T * kMaxCluster + T * kMaxCluster / 4;

    uint8_t in_union[kMaxCluster] = {};
    for (int64_t t = 0; t < T; ++t) {
        const TokenView tv = token(S, t);
        float * h = hs + t * kMaxCluster;
        uint8_t * pk = picked + t * kMaxCluster;
        int count = 0;
        for (int r = 0; r < m; ++r) {
            float a;
            pk[r] = selected(L.activation, tv.gv[i0 + r], g_lo, thr, a) ? 1 : 0;
            h[r] = pk[r] ? a : 0.0f;
            in_union[r] |= pk[r];
            count += pk[r];
            if (pk[r] && tv.mask != nullptr) tv.mask[i0 + r] = 1;
        }
        if (count != 0) __atomic_fetch_add(batch.active_counts + t, count, __ATOMIC_RELAXED);
    }

    // u for the union's rows (the union's down_t rows on their way to L2 meanwhile)
    for (int r = 0; r < m; ++r) {
        if (in_union[r]) prefetch_l2(down0 + static_cast<size_t>(r) * L.down_t_row_bytes, L.down_t_row_bytes);
    }
    const uint8_t * xq_up0 = token(S, 0).xq_up;
    if (up_step == L.up_row_bytes && kquant_gemm_supported(L.up_type)) {
        for (int r = 0; r < m;) {
            if (!in_union[r]) {
                ++r;
                continue;
            }
            int e = r;
            while (e < m && in_union[e]) ++e;
            kquant_gemm(L.up_type, L.n_embd, up0 + static_cast<size_t>(r) * up_step, L.up_row_bytes, e - r, xq_up0,
                        S.xq_token_bytes_, T, us + r, kMaxCluster);
            r = e;
        }
    } else {
        const ggml_vec_dot_t up_dot = ggml_get_type_traits_cpu(L.up_type)->vec_dot;
        for (int64_t t = 0; t < T; ++t) {
            const uint8_t * xq = token(S, t).xq_up;
            for (int r = 0; r < m; ++r) {
                if (picked[t * kMaxCluster + r]) {
                    up_dot(n_embd, us + t * kMaxCluster + r, 0, up0 + static_cast<size_t>(r) * up_step, 0, xq, 0, 1);
                }
            }
        }
    }
    for (int64_t t = 0; t < T; ++t) {
        for (int r = 0; r < m; ++r) {
            if (picked[t * kMaxCluster + r]) hs[t * kMaxCluster + r] *= us[t * kMaxCluster + r];
        }
    }

    // down_t rows
    const AxpyBatchFn axpy_batch = pick_axpy_batch(L.down_t_type, S.isa_);
    const uint8_t * rows[kMaxCluster];
    if (axpy_batch != nullptr) {
        int nu = 0;
        int32_t union_rows[kMaxCluster];
        for (int r = 0; r < m; ++r) {
            if (in_union[r]) {
                union_rows[nu] = r;
                rows[nu++] = down0 + static_cast<size_t>(r) * L.down_t_row_bytes;
            }
        }
        constexpr int kGroup = 8;
        for (int64_t t0 = 0; t0 < T; t0 += kGroup) {
            const int nt = static_cast<int>(std::min<int64_t>(kGroup, T - t0));
            float * acc[kGroup];
            const float * h[kGroup];
            for (int j = 0; j < nt; ++j) {
                const int64_t t = t0 + j;
                acc[j] = cluster_partial(S, c, t);  // written whole by the kernel
                float * hu = us + t * kMaxCluster;  // h over the union's rows, in place of u
                for (int k = 0; k < nu; ++k) hu[k] = hs[t * kMaxCluster + union_rows[k]];
                h[j] = hu;
            }
            if (nu != 0) {
                axpy_batch(acc, nt, rows, h, nu, L.n_embd, axpy_scratch);
            } else {
                for (int j = 0; j < nt; ++j) std::memset(acc[j], 0, static_cast<size_t>(n_embd) * sizeof(float));
            }
        }
        return;
    }
    const UnitPass pass = unit_pass(L, S.isa_);
    float * tmp = S.row_tmp_ + static_cast<size_t>(ith) * S.embd_pad_;
    float h_sel[kMaxCluster];
    for (int64_t t = 0; t < T; ++t) {
        float * acc = cluster_partial(S, c, t);
        std::memset(acc, 0, static_cast<size_t>(n_embd) * sizeof(float));
        int n_sel = 0;
        for (int r = 0; r < m; ++r) {
            if (!picked[t * kMaxCluster + r]) continue;
            rows[n_sel] = down0 + static_cast<size_t>(r) * L.down_t_row_bytes;
            h_sel[n_sel++] = hs[t * kMaxCluster + r];
        }
        pass.add_rows(acc, tmp, rows, h_sel, n_sel);
    }
}

// y_t = Σ_{c listed, ascending} partial_c,t: each token's n_embd values in nth pieces over the threads,
// a piece summed cluster by cluster (each partial read sequentially, the piece of y in L1); the order of
// the sum is fixed by the cluster index alone (see the cluster phase in sparse_ffn.h).
void SparseFfnImpl::reduce_clusters(SparseFfnScratch & S, int ith, int nth) {
    const int64_t n_embd = S.layer_.n_embd;
    const int64_t nc = n_clusters(S.layer_, S.params_);
    const int64_t piece = ((n_embd + nth - 1) / nth + 15) & ~int64_t{15};  // whole 64-byte lines
    const int64_t per_token = (n_embd + piece - 1) / piece;
    for (int64_t q = ith; q < S.batch_.n_tokens * per_token; q += nth) {
        const int64_t t = q / per_token, j0 = (q % per_token) * piece, j1 = std::min(j0 + piece, n_embd);
        float * yt = reinterpret_cast<float *>(reinterpret_cast<uint8_t *>(S.batch_.y) + t * S.batch_.y_stride);
        for (int64_t j = j0; j < j1; ++j) yt[j] = 0.0f;
        for (int64_t c = 0; c < nc; ++c) {
            if (!S.listed_[c]) continue;
            const float * part = cluster_partial(S, c, t);
            for (int64_t j = j0; j < j1; ++j) yt[j] += part[j];
        }
    }
}

void SparseFfnImpl::needed_clusters(const SparseFfnScratch & S, uint8_t * needed) {
    const SparseFfnLayer & L = S.layer_;
    const SparseFfnParams & P = S.params_;
    const int64_t cs = P.cluster_size, nc = (L.n_ff + cs - 1) / cs;
    const float thr = P.threshold, g_lo = S.g_lo_;
    std::memset(needed, 0, static_cast<size_t>(nc));
    for (int64_t t = 0; t < S.batch_.n_tokens; ++t) {
        const float * gv = P.gate_values + t * (P.gate_values_stride != 0 ? P.gate_values_stride : L.n_ff);
        for (int64_t c = 0; c < nc; ++c) {
            if (needed[c]) continue;
            const int64_t i1 = std::min<int64_t>((c + 1) * cs, L.n_ff);
            for (int64_t i = c * cs; i < i1; ++i) {
                float a;
                if (selected(L.activation, gv[i], g_lo, thr, a)) {
                    needed[c] = 1;
                    break;
                }
            }
        }
    }
}

void SparseFfnImpl::reduce(SparseFfnScratch & S, int ith, int nth) {
    constexpr int64_t kChunk = 64;
    const int64_t n_embd = S.layer_.n_embd;
    const int64_t per_token = (n_embd + kChunk - 1) / kChunk;
    for (int64_t q = ith; q < S.batch_.n_tokens * per_token; q += nth) {
        const int64_t t = q / per_token, j0 = (q % per_token) * kChunk, j1 = std::min(j0 + kChunk, n_embd);
        float * yt = reinterpret_cast<float *>(reinterpret_cast<uint8_t *>(S.batch_.y) + t * S.batch_.y_stride);
        const float * p0 = partial(S, t, 0);
        for (int64_t j = j0; j < j1; ++j) yt[j] = p0[j];
        for (int p = 1; p < nth; ++p) {  // fixed order: deterministic for a given nth
            const float * part = partial(S, t, p);
            for (int64_t j = j0; j < j1; ++j) yt[j] += part[j];
        }
    }
}

void sparse_ffn_begin(const SparseFfnLayer & layer, const SparseFfnParams & params, const SparseFfnBatch & batch,
                      SparseFfnScratch & scratch) {
    SparseFfnImpl::begin(layer, params, batch, scratch);
}

void sparse_ffn_quantize(SparseFfnScratch & scratch, int ith, int nth) { SparseFfnImpl::quantize(scratch, ith, nth); }

void sparse_ffn_accumulate(SparseFfnScratch & scratch, int ith, int nth) {
    SparseFfnImpl::accumulate(scratch, ith, nth);
}

void sparse_ffn_reduce(SparseFfnScratch & scratch, int ith, int nth) { SparseFfnImpl::reduce(scratch, ith, nth); }

void sparse_ffn_accumulate_clusters(SparseFfnScratch & scratch, int ith, const int32_t * clusters, int64_t n_clusters) {
    SparseFfnImpl::accumulate_clusters(scratch, ith, clusters, n_clusters);
}

bool sparse_ffn_by_cluster(const SparseFfnParams & params) {
    return params.gate_values != nullptr && params.up_values == nullptr;
}

void sparse_ffn_reduce_clusters(SparseFfnScratch & scratch, int ith, int nth) {
    SparseFfnImpl::reduce_clusters(scratch, ith, nth);
}

void sparse_ffn_needed_clusters(const SparseFfnScratch & scratch, uint8_t * needed) {
    SparseFfnImpl::needed_clusters(scratch, needed);
}

bool sparse_ffn_can_rebind(const SparseFfnLayer & layer, ggml_type up_type, ggml_type down_t_type) {
    for (ggml_type t : {up_type, down_t_type}) {
        if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0 || layer.n_embd % ggml_blck_size(t) != 0) {
            return false;
        }
    }
    const auto * up = ggml_get_type_traits_cpu(up_type);
    if (up->vec_dot == nullptr || up->vec_dot_type != ggml_get_type_traits_cpu(layer.up_type)->vec_dot_type) {
        return false;
    }
    return pick_axpy(down_t_type, SparseIsa::scalar) != nullptr ||
           ggml_get_type_traits(down_t_type)->to_float != nullptr;
}

void sparse_ffn_rebind_cluster_rows(SparseFfnScratch & scratch, ggml_type up_type, ggml_type down_t_type,
                                    const uint8_t * const * up_slots, const uint8_t * const * down_t_slots) {
    SparseFfnLayer & L = scratch.layer_;
    L.up_type = up_type;
    L.up_row_bytes = ggml_row_size(up_type, L.n_embd);
    L.down_t_type = down_t_type;
    L.down_t_row_bytes = ggml_row_size(down_t_type, L.n_embd);
    L.up_slots = up_slots;
    L.down_t_slots = down_t_slots;
}

}  // namespace llamaflash
