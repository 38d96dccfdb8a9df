// expert_dots.cpp — see expert_dots.h.
#include "experts/expert_dots.h"

#include "ggml-cpu.h"

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

void expert_dots(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * d = static_cast<const ExpertDots *>(userdata);
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
    // pairs without an expert (a draft's): zeros, split over the threads
    const int64_t n_zero = static_cast<int64_t>(d->zero_pairs.size() / 2);
    for (int64_t z = n_zero * ith / nth; z < n_zero * (ith + 1) / nth; ++z) {
        const int32_t k = d->zero_pairs[static_cast<size_t>(2 * z)], t = d->zero_pairs[static_cast<size_t>(2 * z + 1)];
        std::memset(static_cast<char *>(dst->data) + k * dst->nb[1] + t * dst->nb[2], 0,
                    static_cast<size_t>(dst->ne[0]) * sizeof(float));
    }
}

}  // namespace llamaflash
