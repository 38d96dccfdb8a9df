// bindings/module.cpp — the thin pybind11 layer over the C++ core (module llamaflash._native): what
// the runtime package (plugin/, converters/) calls. Test and benchmark hooks live in
// llamaflash._native_testing (testing/testing.cpp). Python owns lifetimes: FlashModel is held by
// shared_ptr (llamaflash.Llama keeps one; the weight registry keeps one per llama.cpp buffer bound to it).
#include "backend/flash_backend.h"
#include "backend/split_executor.h"
#include "backend/weight_registry.h"
#include "io/crc32c.h"
#include "io/file_reader.h"
#include "io/integrity.h"
#include "model/flash_model.h"
#include "model/row_invariance.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;

void bind_flash_io(py::module_ & m);  // bindings/flash_io.cpp
void bind_engine(py::module_ & m);    // bindings/engine.cpp
void bind_plan(py::module_ & m);      // bindings/engine.cpp (after bind_experts: open_plan returns both models)
void bind_offload(py::module_ & m);   // bindings/offload.cpp (after FlashModel is bound)
void bind_experts(py::module_ & m);   // bindings/experts.cpp

namespace {

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "llamaflash native core: ggml backend device, sidecar-served FFN lanes";

    py::register_exception<IoError>(m, "IoError", PyExc_OSError);
    bind_flash_io(m);

    m.def(
        "register_backend", [] { register_backend(); },
        "Register the llamaflash ggml backend with ggml (idempotent). Must run before a model loads.");

    bind_engine(m);
    bind_offload(m);
    bind_experts(m);
    bind_plan(m);

    py::class_<InvariantMatmuls, std::shared_ptr<InvariantMatmuls>>(
        m, "InvariantMatmuls",
        "One model's K-quant weights whose MUL_MATs llamaflash computes row by row (csrc/backend/matmul_rows.h).")
        .def_property_readonly(
            "bound", [](const InvariantMatmuls & m) { return m.bound.load(); },
            "Weights llama.cpp placed on the device for it.")
        .def_property_readonly(
            "in_place", [](const InvariantMatmuls & m) { return m.in_place.load(); },
            "Of them, read in place from the model file's mapping (the others were copied).")
        .def_property_readonly(
            "matmuls", [](const InvariantMatmuls & m) { return m.matmuls.load(); }, "MUL_MAT nodes computed.")
        .def_property_readonly(
            "columns", [](const InvariantMatmuls & m) { return m.columns.load(); },
            "Rows of x (tokens) multiplied, over all of them.");
    m.def(
        "invariant_matmul_weight",
        [](const std::string & name, int type_id, const std::vector<int64_t> & shape) {
            if (type_id < 0 || type_id >= GGML_TYPE_COUNT || shape.empty() || shape.size() > GGML_MAX_DIMS ||
                name.size() >= GGML_MAX_NAME) {
                return false;
            }
            ggml_tensor t{};
            t.type = static_cast<ggml_type>(type_id);
            for (int i = 0; i < GGML_MAX_DIMS; ++i) {
                t.ne[i] = i < static_cast<int>(shape.size()) ? shape[static_cast<size_t>(i)] : 1;
            }
            std::memcpy(t.name, name.c_str(), name.size() + 1);
            return invariant_matmul_weight(&t);
        },
        py::arg("name"), py::arg("type"), py::arg("shape"),
        "Whether begin_matmul_rows takes a weight of this GGUF name, ggml type and shape (ne0 first).");
    m.def(
        "begin_matmul_rows",
        [](bool read_in_place) {
            register_backend();
            auto model = std::make_shared<InvariantMatmuls>(read_in_place);
            WeightRegistry::instance().set_pending_matmuls(model);
            return model;
        },
        py::arg("read_in_place"),
        "Arm the next model load: its K-quant matmul weights (attention, dense FFN, output; never the token\n"
        "embedding) go to the llamaflash device, which computes every row of their MUL_MATs as ggml-cpu\n"
        "computes a row alone. read_in_place: weights llama.cpp maps from the model file are read there\n"
        "(under a memory limit), else copied. end_model_load ends it. Returns the model's InvariantMatmuls.");
    m.def(
        "end_model_load", [] { WeightRegistry::instance().clear_pending(); },
        "End the load PlanEngine.begin_model_load began: no later model's weights are offered to its engine.");

    m.def(
        "kquant_rows_invariant",
        [](int max_rows, int n_threads) {
            py::gil_scoped_release release;
            return kquant_rows_invariant(max_rows, n_threads);
        },
        py::arg("max_rows"), py::arg("n_threads") = 2,
        "Whether this process's ggml-cpu gives every row of a K-quant MUL_MAT of up to max_rows rows the "
        "bits of that row alone (false while its tiled kernel is on: GGML_CPU_TILED_MM unset or not 0 when "
        "the process's first K-quant matmul ran). See csrc/model/row_invariance.h.");

    m.attr("INTEGRITY_ERROR_PREFIX") = std::string(kIntegrityErrorPrefix);
    // the most tokens the sparse lane computes at once under flash offload (split_executor.h); the
    // planner counts the lane's scratch for as many (plan_budget.VERIFY_ROWS)
    m.attr("SPARSE_CHUNK_TOKENS") = kSparseChunkTokens;
    m.def("crc32c_implementation", &crc32c_implementation,
          "What computes CRC-32C on this machine: 'sse4.2' (the crc32 instruction) or 'table' (portable).");
    m.def(
        "crc32c_rows",
        [](py::buffer data, size_t row_bytes, const std::string & impl) {
            const py::buffer_info info = data.request();
            if (row_bytes == 0) throw py::value_error("row_bytes must be positive");
            const size_t n = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
            bool contiguous = true;
            for (py::ssize_t d = info.ndim - 1, expect = info.itemsize; d >= 0; --d) {
                contiguous = contiguous && info.strides[d] == expect;
                expect *= info.shape[d];
            }
            if (!contiguous) throw py::value_error("data must be C-contiguous");
            if (n % row_bytes != 0) {
                throw py::value_error(std::to_string(n) + " bytes are not a whole number of " +
                                      std::to_string(row_bytes) + "-byte rows");
            }
            const Crc32cImpl which = impl == "auto"    ? Crc32cImpl::automatic
                                     : impl == "table" ? Crc32cImpl::table
                                     : impl == "hardware"
                                         ? Crc32cImpl::hardware
                                         : throw py::value_error("impl must be 'auto', 'table' or 'hardware'");
            const int64_t rows = static_cast<int64_t>(n / row_bytes);
            py::array_t<uint32_t> out(rows);
            const auto * p = static_cast<const uint8_t *>(info.ptr);
            uint32_t * o = out.mutable_data();
            try {
                py::gil_scoped_release release;
                crc32c_rows(p, rows, row_bytes, row_bytes, o, which);
            } catch (const std::invalid_argument & e) {
                throw py::value_error(e.what());
            }
            return out;
        },
        py::arg("data"), py::arg("row_bytes"), py::arg("impl") = "auto",
        "CRC-32C (Castagnoli) of each `row_bytes`-byte row of a C-contiguous buffer, as uint32 (crc32c.h). "
        "impl: 'auto', 'table' (portable) or 'hardware' (SSE4.2; ValueError without it).");

    m.def("crc32c_combine", &crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
          "CRC-32C of A followed by B from CRC-32C(A), CRC-32C(B) and B's length in bytes (crc32c.h).");

    m.def(
        "quantize_rows",
        [](int type, const F32Array & values) {
            if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(static_cast<ggml_type>(type)) <= 0) {
                throw py::value_error("unknown ggml type " + std::to_string(type));
            }
            const ggml_type t = static_cast<ggml_type>(type);
            if (values.ndim() != 2) {
                throw py::value_error("values must be 2-D (rows, n)");
            }
            const int64_t rows = values.shape(0), n = values.shape(1);
            if (n % ggml_blck_size(t) != 0) {
                throw py::value_error(std::string("rows of ") + std::to_string(n) + " values do not split into " +
                                      ggml_type_name(t) + " blocks of " + std::to_string(ggml_blck_size(t)));
            }
            if (ggml_quantize_requires_imatrix(t)) {
                throw py::value_error(std::string(ggml_type_name(t)) + " needs an importance matrix");
            }
            const size_t row_bytes = ggml_row_size(t, n);
            py::array_t<uint8_t> out({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(row_bytes)});
            {
                py::gil_scoped_release release;
                ggml_quantize_init(t);
                ggml_quantize_chunk(t, values.data(), out.mutable_data(), 0, rows, n, nullptr);
            }
            return out;
        },
        py::arg("type"), py::arg("values"),
        "ggml's own quantization (ggml_quantize_chunk, no importance matrix) of f32 rows: raw block bytes "
        "(rows, row_bytes).");
}
