// sparse_ffn_internal.h — what the sparse kernel's two source files share (sparse_ffn.h is the
// contract): sparse_ffn.cpp holds validation, the scratch, quantization and the by-range phases;
// sparse_ffn_clusters.cpp the cluster phase (one token at a time, or a batch's tokens together) and its
// reduction. Not part of any public interface.
#pragma once

#include "kernels/row_prefetch.h"  // prefetch_l2
#include "lanes/sparse_ffn.h"

#include "ggml-cpu.h"

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace llamaflash {

constexpr int kMaxCluster = 256;  // neurons per work unit, at most (SparseFfnParams::cluster_size)

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

inline UnitPass unit_pass(const SparseFfnLayer & L, SparseIsa isa) {
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

}  // namespace llamaflash
