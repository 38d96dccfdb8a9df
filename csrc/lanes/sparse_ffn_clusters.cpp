// sparse_ffn_clusters.cpp — the sparse kernel's cluster phase (sparse_ffn.h, "By cluster"): whole
// clusters into their own partial sums, one token at a time or a batch's tokens together
// (accumulate_cluster_batch, the same bits per token), the clusters a call needs, and the reduction of
// the partials in ascending cluster order.
#include "kernels/kquant_gemm.h"
#include "lanes/sparse_ffn_internal.h"

#include <algorithm>
#include <cstring>

namespace llamaflash {

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

}  // namespace llamaflash
