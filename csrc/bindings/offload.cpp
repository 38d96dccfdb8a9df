// bindings/offload.cpp — FlashModel's flash-offload methods (flash_model.h "Flash offload",
// neuron_cache.h). IoError becomes llamaflash.errors.FlashIoError; the GIL is released while reading.
#include "../flash_model.h"
#include "../neuron_cache.h"
#include "flash_io_py.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;
using llamaflash_py::engine_kind;
using llamaflash_py::raise_flash_io_error;

namespace {

using FlashModelClass = py::class_<FlashModel, std::shared_ptr<FlashModel>>;

template <typename T>
std::vector<T> to_vector(const py::handle & obj) {
    if (obj.is_none()) return {};
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!a || a.ndim() != 1) throw py::value_error("expected a 1-D array");
    return std::vector<T>(a.data(), a.data() + a.size());
}

py::dict cache_stats(const NeuronCacheStats & s) {
    py::dict d;
    d["plans"] = s.plans;
    d["clusters_needed"] = s.clusters_needed;
    d["hits_hot"] = s.hits_hot;
    d["hits_cold"] = s.hits_cold;
    d["hits_prefetch"] = s.hits_prefetch;
    d["misses"] = s.misses;
    d["prefetched"] = s.prefetched;
    d["prefetch_unused"] = s.prefetch_unused;
    d["bytes_read"] = s.bytes_read;
    d["hot_bytes_loaded"] = s.hot_bytes_loaded;
    d["io_wait_seconds"] = s.io_wait_seconds;
    d["plan_seconds"] = s.plan_seconds;
    d["draft_plans"] = s.draft_plans;
    d["draft_clusters_needed"] = s.draft_clusters_needed;
    d["draft_clusters_resident"] = s.draft_clusters_resident;
    d["hot_slots"] = s.hot_slots;
    d["cold_slots"] = s.cold_slots;
    d["slot_bytes"] = s.slot_bytes;
    d["engine"] = s.engine;
    d["direct"] = s.direct;
    d["fallback_reason"] = s.fallback_reason;
    return d;
}

}  // namespace

void bind_offload(py::module_ & m) {
    auto cls = py::reinterpret_borrow<FlashModelClass>(m.attr("FlashModel"));
    cls.def("set_offload_layout", &FlashModel::set_offload_layout, py::arg("offload"), py::arg("stream_gate") = false,
            "Before load_dense_weights: gate resident (stream_gate: read from the base file every token, one "
            "layer ahead), up/down streamed from the base file (flash offload).")
        .def_property_readonly("offload_layout", &FlashModel::offload_layout)
        .def_property_readonly("stream_gate", &FlashModel::stream_gate)
        .def_property_readonly(
            "streamed_gate_bytes",
            [](const FlashModel & fm) {
                uint64_t total = 0;
                for (const LayerSpec & s : fm.layers()) {
                    total += fm.stream_gate() ? static_cast<uint64_t>(s.n_ff) * s.gate_row_bytes : 0;
                }
                return total;
            },
            "Gate bytes a decode token reads from flash (every served layer's gate matrix; 0 when resident).")
        .def(
            "enable_offload",
            [](FlashModel & fm, const py::list & hot, const py::list & cluster_prob, int cluster_size,
               int64_t cold_slots, int prefetch_layers, float prefetch_min_prob, unsigned queue_depth, bool direct,
               const std::string & engine) {
                const size_t n = fm.layers().size();
                if (hot.size() != n || cluster_prob.size() != n) {
                    throw py::value_error("hot and cluster_prob need one entry per served layer (" + std::to_string(n) + ")");
                }
                std::vector<CacheLayerSource> sources(n);
                for (size_t li = 0; li < n; ++li) {
                    sources[li].hot = to_vector<int32_t>(hot[li]);
                    sources[li].cluster_prob = to_vector<float>(cluster_prob[li]);
                }
                NeuronCacheConfig config;
                config.cluster_size = cluster_size;
                config.cold_slots = cold_slots;
                config.prefetch_layers = prefetch_layers;
                config.prefetch_min_prob = prefetch_min_prob;
                config.io.queue_depth = queue_depth;
                config.io.direct = direct;
                config.io.engine = engine_kind(engine);
                try {
                    py::gil_scoped_release release;
                    fm.enable_offload(std::move(sources), config);
                } catch (const IoError & e) {
                    raise_flash_io_error(e.what());
                }
            },
            py::arg("hot"), py::arg("cluster_prob"), py::arg("cluster_size"), py::arg("cold_slots"),
            py::arg("prefetch_layers") = 1, py::arg("prefetch_min_prob") = 0.5f, py::arg("queue_depth") = 32,
            py::arg("direct") = true, py::arg("engine") = "auto",
            "Open the neuron cache (neuron_cache.h): per served layer the clusters to pin and P(cluster needed).")
        .def("load_hot",
             [](FlashModel & fm) {
                 try {
                     py::gil_scoped_release release;
                     fm.load_hot();
                 } catch (const IoError & e) {
                     raise_flash_io_error(e.what());
                 }
             },
             "Read the pinned clusters into the cache (blocking).")
        .def_property_readonly("offloaded", [](const FlashModel & fm) { return fm.neuron_cache() != nullptr; })
        .def("cache_stats",
             [](const FlashModel & fm) -> py::object {
                 const NeuronCache * c = fm.neuron_cache();
                 if (c == nullptr) return py::none();
                 py::dict d = cache_stats(c->stats());
                 d["memory_bytes"] = c->memory_bytes();
                 d["cluster_size"] = c->cluster_size();
                 return d;
             })
        .def("reset_cache_stats",
             [](FlashModel & fm) {
                 if (fm.neuron_cache() != nullptr) fm.neuron_cache()->reset_stats();
             })
        .def("verify_files",
             [](const FlashModel & fm) {
                 try {
                     if (fm.neuron_cache() != nullptr) fm.neuron_cache()->verify();
                 } catch (const IoError & e) {
                     raise_flash_io_error(e.what());
                 }
             },
             "Raise FlashIoError when the model or sidecar changed on disk since the cache opened them.")
        .def_property("repack", &FlashModel::repack, &FlashModel::set_repack,
                      "Before load_dense_weights: False keeps every weight in plain (not repacked) CPU memory.")
        .def_property("draft", &FlashModel::draft, &FlashModel::set_draft,
                      "Draft mode (offload): decode splits use only the clusters resident in the neuron cache "
                      "(no flash read, the cache untouched); an approximation, for drafting tokens.")
        .def("take_error", &FlashModel::take_error,
             "The error that failed the last graph compute (an I/O error in the offload lane), cleared; '' if none.");
}
