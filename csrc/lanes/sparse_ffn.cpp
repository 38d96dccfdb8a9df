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
// The cluster phase (and its reduction) is in sparse_ffn_clusters.cpp; what both files share in
// sparse_ffn_internal.h.
#include "lanes/sparse_ffn.h"

#include "lanes/sparse_ffn_internal.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace llamaflash {

namespace {

constexpr int kGateAhead = 4;  // gate rows prefetched this many neurons ahead
constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

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
