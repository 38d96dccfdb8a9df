// expert_dots.cpp — see expert_dots.h.
#include "experts/expert_dots.h"

#include "ggml-cpu.h"
#include "kernels/kquant_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace llamaflash {

bool expert_dots_supported(ggml_type type) {
    // ggml-cpu's tiled kernel, forced, takes every batch size (tiled.cpp, ggml_tiled_min_batch)
    static const bool tiled_forced = [] {
        const char * env = std::getenv("GGML_CPU_TILED_MM_FORCE");
        return env != nullptr && std::atoi(env) == 1;
    }();
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(type);
    if (tiled_forced || traits == nullptr || traits->vec_dot == nullptr) {
        return false;
    }
    const ggml_type q = traits->vec_dot_type;
    return q == GGML_TYPE_F32 || ggml_get_type_traits_cpu(q)->from_float != nullptr;
}

namespace {

// One vec_dot per output, the outputs (pairs × rows) split over the threads.
void dots_by_vec_dot(const ExpertDots * d, ggml_tensor * dst, int ith, int nth) {
    const ggml_tensor * src1 = dst->src[0];
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(d->type);
    const ggml_type q_type = traits->vec_dot_type;
    const bool quantize = q_type != GGML_TYPE_F32;  // src1 is f32
    const size_t q_bytes = ggml_row_size(q_type, d->ne0);
    const int64_t ne11 = src1->ne[1], n_rows = src1->ne[1] * src1->ne[2];

    // this thread's quantized src1 rows (j, t) at j + t * ne11, made when its first output needs one
    thread_local std::vector<uint8_t> q_rows;
    thread_local std::vector<char> q_made;
    if (quantize) {
        q_rows.resize(q_bytes * static_cast<size_t>(n_rows));
        q_made.assign(static_cast<size_t>(n_rows), 0);
    }

    const int64_t n_pairs = static_cast<int64_t>(d->pairs.size() / 2);
    const int64_t total = n_pairs * d->ne1;
    const int64_t w_begin = total * ith / nth, w_end = total * (ith + 1) / nth;
    for (int64_t w = w_begin; w < w_end;) {
        const int64_t p = w / d->ne1;
        const int64_t row_end = std::min<int64_t>(d->ne1, w_end - p * d->ne1);
        const int32_t k = d->pairs[static_cast<size_t>(2 * p)], t = d->pairs[static_cast<size_t>(2 * p + 1)];
        const int64_t j = k % ne11;
        const char * x = static_cast<const char *>(src1->data) + j * src1->nb[1] + t * src1->nb[2];
        const void * q = x;
        if (quantize) {
            const size_t at = static_cast<size_t>(j + t * ne11);
            uint8_t * qx = q_rows.data() + q_bytes * at;
            if (!q_made[at]) {
                ggml_get_type_traits_cpu(q_type)->from_float(reinterpret_cast<const float *>(x), qx, d->ne0);
                q_made[at] = 1;
            }
            q = qx;
        }
        const uint8_t * weight = d->weights[static_cast<size_t>(p)];
        float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + k * dst->nb[1] + t * dst->nb[2]);
        for (int64_t i = w - p * d->ne1; i < row_end; ++i) {
            traits->vec_dot(static_cast<int>(d->ne0), out + i, 0, weight + static_cast<size_t>(i) * d->row_bytes, 0, q,
                            0, 1);
        }
        w = p * d->ne1 + row_end;
    }
}

// Outputs of pairs that share an expert computed together by kquant_gemm (the same bits as one vec_dot
// each): every thread takes its share of each expert's ne1 rows, for all of that expert's pairs.
void dots_by_expert(const ExpertDots * d, ggml_tensor * dst, int ith, int nth) {
    const ggml_tensor * src1 = dst->src[0];
    const ggml_type_traits_cpu * q_traits = ggml_get_type_traits_cpu(GGML_TYPE_Q8_K);
    const size_t q_bytes = ggml_row_size(GGML_TYPE_Q8_K, d->ne0);
    const int64_t ne11 = src1->ne[1];
    const int64_t n_pairs = static_cast<int64_t>(d->pairs.size() / 2);
    const int64_t r_begin = d->ne1 * ith / nth, r_end = d->ne1 * (ith + 1) / nth;
    if (r_begin == r_end) {
        return;
    }
    // pairs in order of their expert's weights
    thread_local std::vector<int32_t> order;
    order.resize(static_cast<size_t>(n_pairs));
    for (int64_t p = 0; p < n_pairs; ++p) {
        order[static_cast<size_t>(p)] = static_cast<int32_t>(p);
    }
    std::stable_sort(order.begin(), order.end(), [d](int32_t a, int32_t b) {
        return d->weights[static_cast<size_t>(a)] < d->weights[static_cast<size_t>(b)];
    });
    // every src1 row (j, t) at j + t * ne11 in Q8_K, quantized once (gate / up: the n_used slots of a
    // token share one row); one expert's pairs' rows gathered contiguously for kquant_gemm
    thread_local std::vector<uint8_t> q_rows;
    thread_local std::vector<char> q_made;
    const int64_t n_src_rows = src1->ne[1] * src1->ne[2];
    q_rows.resize(q_bytes * static_cast<size_t>(n_src_rows));
    q_made.assign(static_cast<size_t>(n_src_rows), 0);
    thread_local std::vector<uint8_t> q_cols;
    thread_local std::vector<float> out;  // [column][row of this thread's share]
    const int64_t n_rows = r_end - r_begin;
    for (int64_t g = 0; g < n_pairs;) {
        const uint8_t * weight = d->weights[static_cast<size_t>(order[static_cast<size_t>(g)])];
        int64_t g_end = g + 1;
        while (g_end < n_pairs && d->weights[static_cast<size_t>(order[static_cast<size_t>(g_end)])] == weight) {
            ++g_end;
        }
        const int64_t n_cols = g_end - g;
        q_cols.resize(q_bytes * static_cast<size_t>(n_cols));
        out.resize(static_cast<size_t>(n_rows * n_cols));
        for (int64_t c = 0; c < n_cols; ++c) {
            const int64_t p = order[static_cast<size_t>(g + c)];
            const int32_t k = d->pairs[static_cast<size_t>(2 * p)], t = d->pairs[static_cast<size_t>(2 * p + 1)];
            const int64_t j = k % ne11;
            uint8_t * qx = q_rows.data() + q_bytes * static_cast<size_t>(j + t * ne11);
            if (!q_made[static_cast<size_t>(j + t * ne11)]) {
                const char * x = static_cast<const char *>(src1->data) + j * src1->nb[1] + t * src1->nb[2];
                q_traits->from_float(reinterpret_cast<const float *>(x), qx, d->ne0);
                q_made[static_cast<size_t>(j + t * ne11)] = 1;
            }
            std::memcpy(q_cols.data() + static_cast<size_t>(c) * q_bytes, qx, q_bytes);
        }
        kquant_gemm(d->type, d->ne0, weight + static_cast<size_t>(r_begin) * d->row_bytes, d->row_bytes, n_rows,
                    q_cols.data(), q_bytes, n_cols, out.data(), static_cast<size_t>(n_rows));
        for (int64_t c = 0; c < n_cols; ++c) {
            const int64_t p = order[static_cast<size_t>(g + c)];
            const int32_t k = d->pairs[static_cast<size_t>(2 * p)], t = d->pairs[static_cast<size_t>(2 * p + 1)];
            float * o = reinterpret_cast<float *>(static_cast<char *>(dst->data) + k * dst->nb[1] + t * dst->nb[2]);
            std::memcpy(o + r_begin, out.data() + static_cast<size_t>(c * n_rows),
                        sizeof(float) * static_cast<size_t>(n_rows));
        }
        g = g_end;
    }
}

}  // namespace

void expert_dots(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * d = static_cast<const ExpertDots *>(userdata);
    if (ggml_get_type_traits_cpu(d->type)->vec_dot_type == GGML_TYPE_Q8_K) {
        dots_by_expert(d, dst, ith, nth);
    } else {
        dots_by_vec_dot(d, dst, ith, nth);
    }
    // pairs without an expert (a draft's): zeros, split over the threads
    const int64_t n_zero = static_cast<int64_t>(d->zero_pairs.size() / 2);
    for (int64_t z = n_zero * ith / nth; z < n_zero * (ith + 1) / nth; ++z) {
        const int32_t k = d->zero_pairs[static_cast<size_t>(2 * z)], t = d->zero_pairs[static_cast<size_t>(2 * z + 1)];
        std::memset(static_cast<char *>(dst->data) + k * dst->nb[1] + t * dst->nb[2], 0,
                    static_cast<size_t>(dst->ne[0]) * sizeof(float));
    }
}

}  // namespace llamaflash
