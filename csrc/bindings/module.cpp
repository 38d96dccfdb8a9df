// bindings/module.cpp — the thin pybind11 layer over the C++ core (module llamaflash._native).
// Python owns lifetimes: FlashModel is held by shared_ptr (llamaflash.Llama keeps one; the weight
// registry keeps one per llama.cpp buffer bound to it).
#include "../file_reader.h"
#include "../flash_backend.h"
#include "../flash_model.h"
#include "../weight_registry.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

namespace py = pybind11;
using namespace llamaflash;

namespace {

template <typename T>
T required(const py::dict & d, const char * key) {
    if (!d.contains(key)) {
        throw py::key_error(std::string("layer layout is missing '") + key + "'");
    }
    return d[key].cast<T>();
}

LayerSpec layer_from_dict(const py::dict & d) {
    LayerSpec s;
    s.layer = required<int>(d, "layer");
    s.n_embd = required<int64_t>(d, "n_embd");
    s.n_ff = required<int64_t>(d, "n_ff");
    s.gate_type = static_cast<ggml_type>(required<int>(d, "gate_type"));
    s.up_type = static_cast<ggml_type>(required<int>(d, "up_type"));
    s.down_type = static_cast<ggml_type>(required<int>(d, "base_down_type"));
    s.down_t_type = static_cast<ggml_type>(required<int>(d, "down_t_type"));
    s.gate_row_bytes = required<uint64_t>(d, "gate_row_bytes");
    s.up_row_bytes = required<uint64_t>(d, "up_row_bytes");
    s.bundle_offset = required<uint64_t>(d, "bundle_offset");
    s.bundle_stride = required<uint64_t>(d, "bundle_stride");
    s.down_t_offset = required<uint64_t>(d, "down_t_offset");
    s.down_t_row_bytes = required<uint64_t>(d, "down_t_row_bytes");
    s.order_offset = required<uint64_t>(d, "order_offset");
    s.base_down_offset = required<uint64_t>(d, "base_down_offset");
    s.base_down_row_bytes = required<uint64_t>(d, "base_down_row_bytes");
    return s;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "llamaflash native core: ggml backend device, sidecar-served FFN lanes";

    py::register_exception<IoError>(m, "IoError", PyExc_OSError);

    m.def("register_backend", [] { register_backend(); },
          "Register the llamaflash ggml backend with ggml (idempotent). Must run before a model loads.");
    m.def("set_whole_graph_claims", &set_whole_graph_claims, py::arg("enabled"),
          "Claim policy for graphs scheduled afterwards: True = whole graphs of served models run on the "
          "llamaflash backend (default); False = only FFN ops of served layers (one split per layer).");
    m.def("whole_graph_claims", &whole_graph_claims);
    m.def("backend_name", [] { return std::string(ggml_backend_reg_name(backend_reg())); });

    py::class_<FlashModel, std::shared_ptr<FlashModel>>(m, "FlashModel")
        .def(py::init([](const py::list & layers, const std::string & sidecar_path, const std::string & base_path) {
                 std::vector<LayerSpec> specs;
                 for (const auto & item : layers) {
                     specs.push_back(layer_from_dict(item.cast<py::dict>()));
                 }
                 return std::make_shared<FlashModel>(std::move(specs), sidecar_path, base_path);
             }),
             py::arg("layers"), py::arg("sidecar_path"), py::arg("base_path"))
        .def("load_dense_weights", &FlashModel::load_dense_weights, py::call_guard<py::gil_scoped_release>(),
             "Read the served layers' FFN weights (sidecar gate/up bundles, base down) into CPU buffers.")
        .def_property_readonly("dense_loaded", &FlashModel::dense_loaded)
        .def_property_readonly("bound_count", &FlashModel::bound_count,
                               "llama.cpp weight tensors bound to this model (3 per served layer once loaded)")
        .def_property_readonly("resident_bytes", &FlashModel::resident_bytes)
        .def_property_readonly("served_layers", [](const FlashModel & fm) {
            std::vector<int> out;
            for (const auto & s : fm.layers()) {
                out.push_back(s.layer);
            }
            return out;
        })
        .def("stats", [](const FlashModel & fm) {
            const FlashStatsSnapshot s = fm.stats();
            py::dict d;
            d["graph_splits"] = s.graph_splits;
            d["ffn_evals"] = s.ffn_evals;
            d["tokens"] = s.tokens;
            d["dense_lane_calls"] = s.dense_lane_calls;
            d["compute_seconds"] = s.compute_seconds;
            d["prepare_seconds"] = s.prepare_seconds;
            return d;
        })
        .def("reset_stats", &FlashModel::reset_stats);

    m.def("begin_model_load", [](std::shared_ptr<FlashModel> model) {
        WeightRegistry::instance().set_pending(std::move(model));
    }, "Make `model` the one whose FFN weights llama.cpp's next model load places on the device.");
    m.def("end_model_load", [] { WeightRegistry::instance().clear_pending(); });
    m.def("bound_weight_count", [] { return WeightRegistry::instance().bound_count(); });

    // Test hook: reads the bytes of a bound phantom weight the way another backend would have to
    // (ggml_backend_tensor_get). The safety net must abort the process with a message; the test
    // suite runs this in a subprocess.
    m.def("_read_phantom_weight_for_tests", [] {
        const ggml_tensor * t = WeightRegistry::instance().any_bound();
        if (t == nullptr) {
            throw std::runtime_error("no phantom weight is bound");
        }
        std::vector<uint8_t> bytes(ggml_nbytes(t));
        ggml_backend_tensor_get(t, bytes.data(), 0, bytes.size());
    });
}
