// token_products.cpp — see token_products.h.
#include "experts/token_products.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>

namespace llamaflash {

bool token_products_supported(ggml_type type) {
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(type);
    if (traits == nullptr || traits->vec_dot == nullptr) {
        return false;
    }
    const ggml_type q = traits->vec_dot_type;
    return q == GGML_TYPE_F32 || ggml_get_type_traits_cpu(q)->from_float != nullptr;
}

void token_products(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const auto * tp = static_cast<const TokenProducts *>(userdata);
    const ggml_tensor * src1 = dst->src[0];
    const ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(tp->type);
    const ggml_type q_type = traits->vec_dot_type;
    const bool quantize = q_type != GGML_TYPE_F32;  // src1 is f32
    const size_t q_bytes = ggml_row_size(q_type, tp->ne0);
    const int64_t ne11 = src1->ne[1];

    // this thread's quantized src1 columns, made when its first output needs one
    thread_local std::vector<uint8_t> q_cols;
    thread_local std::vector<char> q_made;
    if (quantize) {
        q_cols.resize(q_bytes * static_cast<size_t>(ne11));
        q_made.assign(static_cast<size_t>(ne11), 0);
    }

    const int64_t n_pairs = static_cast<int64_t>(tp->slots.size());
    const int64_t total = n_pairs * tp->ne1;
    const int64_t w_begin = total * ith / nth, w_end = total * (ith + 1) / nth;
    for (int64_t w = w_begin; w < w_end;) {
        const int64_t p = w / tp->ne1;
        const int64_t row_end = std::min<int64_t>(tp->ne1, w_end - p * tp->ne1);
        const int32_t k = tp->slots[static_cast<size_t>(p)];
        const int64_t j = k % ne11;
        const char * x = static_cast<const char *>(src1->data) + j * src1->nb[1];
        const void * q = x;
        if (quantize) {
            uint8_t * qj = q_cols.data() + q_bytes * static_cast<size_t>(j);
            if (!q_made[static_cast<size_t>(j)]) {
                ggml_get_type_traits_cpu(q_type)->from_float(reinterpret_cast<const float *>(x), qj, tp->ne0);
                q_made[static_cast<size_t>(j)] = 1;
            }
            q = qj;
        }
        const uint8_t * weight = tp->weights[static_cast<size_t>(p)];
        float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + k * dst->nb[1]);
        for (int64_t i = w - p * tp->ne1; i < row_end; ++i) {
            traits->vec_dot(static_cast<int>(tp->ne0), out + i, 0, weight + static_cast<size_t>(i) * tp->row_bytes, 0, q,
                            0, 1);
        }
        w = p * tp->ne1 + row_end;
    }
    // slots without an expert (a draft's): zeros, split over the threads by slot
    const int64_t n_zero = static_cast<int64_t>(tp->zero_slots.size());
    for (int64_t z = n_zero * ith / nth; z < n_zero * (ith + 1) / nth; ++z) {
        std::memset(static_cast<char *>(dst->data) + tp->zero_slots[static_cast<size_t>(z)] * dst->nb[1], 0,
                    static_cast<size_t>(dst->ne[0]) * sizeof(float));
    }
}

}  // namespace llamaflash
