// testing/kquant_gemm_hooks.cpp — see kquant_gemm_hooks.h.
#include "testing/kquant_gemm_hooks.h"

#include "backend/matmul_rows.h"
#include "kernels/kquant_gemm.h"
#include "kernels/kquant_gemm_kernels.h"

#include "ggml-cpu.h"
#include "ggml.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace llamaflash_testing {

namespace {

using U8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

// A product's row check (backend/matmul_rows.h CheckedWeight) called through kquant_gemm's
// RowBlockHook, and the blocks it was called with.
struct RowCheck {
    llamaflash::CheckedWeight checked;
    std::vector<std::pair<int64_t, int64_t>> blocks;

    static void visit(void * ctx, int64_t r0, int64_t n) {
        auto * c = static_cast<RowCheck *>(ctx);
        c->blocks.emplace_back(r0, n);
        c->checked.check(r0, n);
    }
};

py::object gemm(const U8Array & weights, int type_id, int64_t ne0, const F32Array & x, bool reference, int repeat,
                const std::string & isa, const py::object & crc) {
    ggml_cpu_init();  // vec_dot's fp16 table, where this build reads fp16 through it
    const auto type = static_cast<ggml_type>(type_id);
    if (type_id < 0 || type_id >= GGML_TYPE_COUNT || ggml_get_type_traits_cpu(type)->vec_dot == nullptr ||
        ggml_get_type_traits_cpu(type)->vec_dot_type != GGML_TYPE_Q8_K) {
        throw std::invalid_argument("kquant_gemm: type " + std::to_string(type_id) + " has no vec_dot with Q8_K");
    }
    if (ne0 <= 0 || ne0 % 256 != 0) {
        throw std::invalid_argument("kquant_gemm: ne0 must be a positive multiple of 256");
    }
    const size_t row_bytes = ggml_row_size(type, ne0);
    if (weights.ndim() != 2 || static_cast<size_t>(weights.shape(1)) != row_bytes) {
        throw std::invalid_argument("kquant_gemm: weights must be [n_rows, " + std::to_string(row_bytes) + "] bytes");
    }
    if (x.ndim() != 2 || x.shape(1) != ne0) {
        throw std::invalid_argument("kquant_gemm: x must be [n_cols, ne0] float32");
    }
    const int64_t n_rows = weights.shape(0), n_cols = x.shape(0);
    const size_t q_bytes = ggml_row_size(GGML_TYPE_Q8_K, ne0);
    std::vector<uint8_t> q(q_bytes * static_cast<size_t>(n_cols));
    for (int64_t c = 0; c < n_cols; ++c) {
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x.data() + c * ne0, q.data() + c * q_bytes, ne0);
    }
    llamaflash::gemm::KernelFn kernel = nullptr;
    if (isa != "auto") {
        kernel = llamaflash::gemm::kernel_for(type_id, isa.c_str());
        if (kernel == nullptr) {
            throw std::invalid_argument("kquant_gemm: no " + isa + " kernel for this type on this CPU");
        }
    }
    F32Array out({n_cols, n_rows});
    float * o = out.mutable_data();
    const uint8_t * w = weights.data();
    U32Array expected;
    ggml_tensor weight{};  // what CheckedWeight reads of the weight: type, ne[0], nb[1], data
    RowCheck check;
    llamaflash::RowBlockHook hook_fn{&RowCheck::visit, &check};
    const llamaflash::RowBlockHook * hook = nullptr;
    if (!crc.is_none()) {
        expected = crc.cast<U32Array>();
        if (expected.ndim() != 1 || expected.shape(0) != n_rows) {
            throw std::invalid_argument("kquant_gemm: crc must be uint32 [n_rows]");
        }
        weight.type = type;
        weight.ne[0] = ne0;
        weight.ne[1] = n_rows;
        weight.nb[1] = row_bytes;
        weight.data = const_cast<uint8_t *>(w);
        check.checked.reset(&weight, expected.data());
        hook = &hook_fn;
    }
    auto run = [&] {
        if (reference) {
            const ggml_vec_dot_t vec_dot = ggml_get_type_traits_cpu(type)->vec_dot;
            for (int64_t c = 0; c < n_cols; ++c) {
                for (int64_t r = 0; r < n_rows; ++r) {
                    vec_dot(static_cast<int>(ne0), o + c * n_rows + r, 0, w + r * row_bytes, 0, q.data() + c * q_bytes,
                            0, 1);
                }
            }
        } else if (kernel != nullptr) {
            kernel(ne0, w, row_bytes, n_rows, q.data(), q_bytes, n_cols, o, static_cast<size_t>(n_rows), hook);
        } else {
            llamaflash::kquant_gemm(type, ne0, w, row_bytes, n_rows, q.data(), q_bytes, n_cols, o,
                                    static_cast<size_t>(n_rows), hook);
        }
    };
    if (repeat <= 0) {
        {
            py::gil_scoped_release release;
            run();
        }
        if (hook != nullptr) {
            return py::make_tuple(out, check.checked.first_bad(), check.blocks);
        }
        return std::move(out);
    }
    std::vector<double> seconds;
    {
        py::gil_scoped_release release;
        for (int i = 0; i < repeat; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            run();
            seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    }
    return py::cast(seconds);
}

}  // namespace

void bind_kquant_gemm_hooks(py::module_ & m) {
    m.def("kquant_gemm", &gemm, py::arg("weights"), py::arg("type"), py::arg("ne0"), py::arg("x"),
          py::arg("reference") = false, py::arg("repeat") = 0, py::arg("isa") = "auto", py::arg("crc") = py::none(),
          "kquant_gemm (csrc/kernels/kquant_gemm.h) of uint8 weights [n_rows, row_bytes] and f32 x [n_cols, ne0] ->\n"
          "f32 [n_cols, n_rows]; reference=True: ggml-cpu's vec_dot per output; repeat > 0: seconds per run;\n"
          "isa='avx2' / 'avx512vnni': that kernel unchecked (ValueError where this CPU has none);\n"
          "crc=uint32 [n_rows]: each row block checked once multiplied (RowBlockHook) -> (out, first bad row\n"
          "or -1, [(r0, n) per hook call]).");
    m.def(
        "kquant_gemm_isas",
        [](int type_id) {
            std::vector<std::string> isas;
            for (const char * isa : {"avx2", "avx512vnni"}) {
                if (llamaflash::gemm::kernel_for(type_id, isa) != nullptr) {
                    isas.emplace_back(isa);
                }
            }
            return isas;
        },
        py::arg("type"), "The kernels this CPU can run for this ggml type.");
    m.def(
        "kquant_gemm_supported",
        [](int type_id) {
            return type_id >= 0 && type_id < GGML_TYPE_COUNT &&
                   llamaflash::kquant_gemm_supported(static_cast<ggml_type>(type_id));
        },
        py::arg("type"), "Whether kquant_gemm computes this ggml type with its own kernel in this process.");
}

}  // namespace llamaflash_testing
