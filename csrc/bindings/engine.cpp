// bindings/engine.cpp — the engine-open protocol: the typed configuration (engine_config.h) as
// Python classes with named, typed fields, and FlashModel (flash_model.h) opened from it in one call,
// with its run-time settings (thresholds, sparse configuration) and statistics; and open_plan, how
// llamaflash.Llama opens the engine its plan describes, through the entry point the backend library
// of the llama.cpp tools uses (plan_reader.h).
// IoError during open becomes llamaflash.errors.FlashIoError (IntegrityError SidecarIntegrityError);
// std::invalid_argument a ValueError.
#include "backend/plan_reader.h"
#include "backend/prompt_buffers.h"
#include "flash_io_py.h"
#include "io/crc32c.h"
#include "io/integrity.h"
#include "model/engine_config.h"
#include "model/flash_model.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;
using llamaflash_py::raise_flash_io_error;
using llamaflash_py::raise_integrity_error;

namespace {

template <typename T>
std::vector<T> to_vector(const py::handle & obj) {
    if (obj.is_none()) return {};
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!a || a.ndim() != 1) throw py::value_error("expected a 1-D array");
    return std::vector<T>(a.data(), a.data() + a.size());
}

// per-layer vectors: a list of 1-D arrays (or sequences), one per served layer
template <typename T>
std::vector<std::vector<T>> to_vectors(const py::sequence & seq) {
    std::vector<std::vector<T>> out;
    for (const auto & item : seq) out.push_back(to_vector<T>(item));
    return out;
}

// a ggml_type field of LayerSpec as a Python int
#define LAYER_TYPE_FIELD(name)                                               \
    def_property(                                                            \
        #name, [](const LayerSpec & s) { return static_cast<int>(s.name); }, \
        [](LayerSpec & s, int v) { s.name = static_cast<ggml_type>(v); })

void bind_config(py::module_ & m) {
    py::class_<LayerSpec>(m, "LayerSpec", "One served layer of the sidecar layout (engine_config.h); offsets absolute.")
        .def(py::init<>())
        .def_readwrite("layer", &LayerSpec::layer)
        .def_readwrite("n_embd", &LayerSpec::n_embd)
        .def_readwrite("n_ff", &LayerSpec::n_ff)
        .LAYER_TYPE_FIELD(gate_type)
        .LAYER_TYPE_FIELD(up_type)
        .LAYER_TYPE_FIELD(down_type)
        .LAYER_TYPE_FIELD(down_t_type)
        .def_readwrite("gate_row_bytes", &LayerSpec::gate_row_bytes)
        .def_readwrite("up_row_bytes", &LayerSpec::up_row_bytes)
        .def_readwrite("bundle_offset", &LayerSpec::bundle_offset)
        .def_readwrite("bundle_stride", &LayerSpec::bundle_stride)
        .def_readwrite("down_t_offset", &LayerSpec::down_t_offset)
        .def_readwrite("down_t_row_bytes", &LayerSpec::down_t_row_bytes)
        .def_readwrite("order_offset", &LayerSpec::order_offset)
        .def_readwrite("base_down_offset", &LayerSpec::base_down_offset)
        .def_readwrite("base_down_row_bytes", &LayerSpec::base_down_row_bytes)
        .def_readwrite("base_up_offset", &LayerSpec::base_up_offset)
        .def_readwrite("base_gate_offset", &LayerSpec::base_gate_offset)
        .def_readwrite("threshold", &LayerSpec::threshold)
        .LAYER_TYPE_FIELD(draft_type)
        .def_readwrite("draft_row_bytes", &LayerSpec::draft_row_bytes)
        .def_readwrite("draft_up_offset", &LayerSpec::draft_up_offset)
        .def_readwrite("draft_down_t_offset", &LayerSpec::draft_down_t_offset)
        .def_readwrite("draft_checksum_offset", &LayerSpec::draft_checksum_offset)
        .def_readwrite("draft_up_name", &LayerSpec::draft_up_name)
        .def_readwrite("draft_down_t_name", &LayerSpec::draft_down_t_name)
        .def_readwrite("checksum_offset", &LayerSpec::checksum_offset)
        .def_readwrite("base_down_checksum_offset", &LayerSpec::base_down_checksum_offset)
        .def_readwrite("bundle_name", &LayerSpec::bundle_name)
        .def_readwrite("down_t_name", &LayerSpec::down_t_name)
        .def_readwrite("base_gate_name", &LayerSpec::base_gate_name)
        .def_readwrite("base_up_name", &LayerSpec::base_up_name)
        .def_readwrite("base_down_name", &LayerSpec::base_down_name);

    py::class_<SparseConfig>(m, "SparseConfig", "How the sparse lane runs (engine_config.h).")
        .def(py::init([](bool enabled, int64_t max_tokens, int cluster_size, bool up_by_ggml) {
                 return SparseConfig{enabled, max_tokens, cluster_size, up_by_ggml};
             }),
             py::arg("enabled") = false, py::arg("max_tokens") = 1, py::arg("cluster_size") = 32,
             py::arg("up_by_ggml") = false)
        .def_readwrite("enabled", &SparseConfig::enabled)
        .def_readwrite("max_tokens", &SparseConfig::max_tokens)
        .def_readwrite("cluster_size", &SparseConfig::cluster_size)
        .def_readwrite("up_by_ggml", &SparseConfig::up_by_ggml);

    py::class_<OffloadConfig>(m, "OffloadConfig", "Flash offload: the neuron cache's sizing (engine_config.h).")
        .def(py::init<>())
        .def_readwrite("stream_gate", &OffloadConfig::stream_gate)
        .def_readwrite("cold_slots", &OffloadConfig::cold_slots)
        .def_readwrite("prefetch_layers", &OffloadConfig::prefetch_layers)
        .def_readwrite("prefetch_min_prob", &OffloadConfig::prefetch_min_prob)
        .def_readwrite("queue_depth", &OffloadConfig::queue_depth)
        .def_readwrite("direct", &OffloadConfig::direct)
        .def_readwrite("engine", &OffloadConfig::engine)
        .def_readwrite("draft_copy", &OffloadConfig::draft_copy)
        .def_readwrite("stream_layers", &OffloadConfig::stream_layers)
        .def_property(
            "hot_layers", [](const OffloadConfig & o) { return o.hot_layers; },
            [](OffloadConfig & o, const std::vector<int32_t> & v) { o.hot_layers = v; },
            "with stream_layers: the positions of the served layers to pin")
        .def_property(
            "hot", [](const OffloadConfig & o) { return o.hot; },
            [](OffloadConfig & o, const py::sequence & v) { o.hot = to_vectors<int32_t>(v); },
            "per served layer: the clusters to pin (int32)")
        .def_property(
            "cluster_prob", [](const OffloadConfig & o) { return o.cluster_prob; },
            [](OffloadConfig & o, const py::sequence & v) { o.cluster_prob = to_vectors<float>(v); },
            "per served layer: P(cluster needed), one per cluster (float32)");

    py::class_<EngineConfig>(m, "EngineConfig",
                             "Everything FlashModel.open needs (engine_config.h): in memory (offload None) or "
                             "flash offload.")
        .def(py::init<>())
        .def_readwrite("layers", &EngineConfig::layers)
        .def_readwrite("sidecar_path", &EngineConfig::sidecar_path)
        .def_readwrite("base_path", &EngineConfig::base_path)
        .def_readwrite("activation", &EngineConfig::activation)
        .def_readwrite("sparse", &EngineConfig::sparse)
        .def_readwrite("offload", &EngineConfig::offload)
        .def_readwrite("repack", &EngineConfig::repack)
        .def_readwrite("verify", &EngineConfig::verify)
        .def("validate", &EngineConfig::validate, "ValueError naming the field unless the configuration is usable.");
}

py::dict stats_dict(const FlashStatsSnapshot & s) {
    py::dict d;
    d["graph_splits"] = s.graph_splits;
    d["ffn_evals"] = s.ffn_evals;
    d["tokens"] = s.tokens;
    d["dense_lane_calls"] = s.dense_lane_calls;
    d["compute_seconds"] = s.compute_seconds;
    d["prepare_seconds"] = s.prepare_seconds;
    d["sparse_lane_calls"] = s.sparse_lane_calls;
    d["sparse_fallbacks"] = s.sparse_fallbacks;
    d["sparse_seconds"] = s.sparse_seconds;
    d["draft_splits"] = s.draft_splits;
    d["draft_tokens"] = s.draft_tokens;
    d["draft_seconds"] = s.draft_seconds;
    d["layer_ids"] = s.layer_ids;
    d["layer_sparse_tokens"] = s.layer_sparse_tokens;
    d["layer_active_neurons"] = s.layer_active;
    return d;
}

}  // namespace

void bind_engine(py::module_ & m) {
    bind_config(m);
    py::class_<FlashModel, std::shared_ptr<FlashModel>>(m, "FlashModel")
        .def_static(
            "open",
            [](const EngineConfig & config) {
                return llamaflash_py::opened_without_gil([&] { return FlashModel::open(config); });
            },
            py::arg("config"),
            "Validate `config` and open the model: dense weights, the sparse lane's views, for offload the "
            "neuron cache with its pinned clusters read.")
        .def_property_readonly("dense_loaded", [](const FlashModel & fm) { return fm.weights().dense_loaded(); })
        .def_property_readonly("sparse_loaded", &FlashModel::sparse_loaded)
        .def_property_readonly("bound_count", &FlashModel::bound_count,
                               "llama.cpp weight tensors bound to this model (3 per served layer once loaded)")
        .def_property_readonly("resident_bytes", [](const FlashModel & fm) { return fm.weights().resident_bytes(); })
        .def_property_readonly("served_layers",
                               [](const FlashModel & fm) {
                                   std::vector<int> out;
                                   for (const auto & s : fm.layers()) out.push_back(s.layer);
                                   return out;
                               })
        .def("stats", [](const FlashModel & fm) { return stats_dict(fm.stats().snapshot()); })
        .def("reset_stats", [](FlashModel & fm) { fm.stats().reset(); })
        .def(
            "set_sparse_config",
            [](FlashModel & fm, bool enabled, int64_t max_tokens, int cluster_size, bool up_by_ggml) {
                fm.set_sparse_config(SparseConfig{enabled, max_tokens, cluster_size, up_by_ggml});
            },
            py::arg("enabled"), py::arg("max_tokens") = 1, py::arg("cluster_size") = 32, py::arg("up_by_ggml") = false,
            "Route decode batches of up to max_tokens tokens of layers with a threshold to the sparse lane "
            "(loaded at open).")
        .def_property_readonly("sparse_config",
                               [](const FlashModel & fm) {
                                   const SparseConfig & c = fm.sparse_config();
                                   py::dict d;
                                   d["enabled"] = c.enabled;
                                   d["max_tokens"] = c.max_tokens;
                                   d["cluster_size"] = c.cluster_size;
                                   d["up_by_ggml"] = c.up_by_ggml;
                                   return d;
                               })
        .def_property("thresholds", &FlashModel::thresholds, &FlashModel::set_thresholds,
                      "Per served layer (in served_layers order): skip neuron k when |act(gate_k·x)| <= "
                      "threshold; a negative threshold runs that layer dense.")
        .def("take_non_finite", &FlashModel::take_non_finite,
             "Which served FFN produced a NaN or an infinity in the last failed compute, cleared; '' if none.")
        .def(
            "check_files",
            [](FlashModel & fm) {
                try {
                    fm.check_files();
                } catch (const IntegrityError & e) {
                    raise_integrity_error(e.what());
                } catch (const IoError & e) {
                    raise_flash_io_error(e.what());
                }
            },
            "Raise FlashIoError when the sidecar or the base model changed size on disk since the model was "
            "opened, or was modified in place without checksums to check it against; SidecarIntegrityError "
            "when a row modified in place no longer matches its checksum (flash_model.h).")
        .def_property_readonly(
            "integrity",
            [](const FlashModel & fm) {
                const WeightStore & w = fm.weights();
                py::dict d;
                d["checksums"] = w.has_checksums();
                d["verifying"] = w.verifying();
                d["load_verified_bytes"] = w.verified_bytes();
                d["load_verify_seconds"] = w.verify_seconds();
                d["crc32c"] = std::string(crc32c_implementation());
                return d;
            },
            "The sidecar has checksums; they are checked; bytes and time checked at load; the CRC-32C code in use.")
        .def("take_error", &FlashModel::take_error,
             "The error that failed the last graph compute (an I/O error in the offload lane), cleared; '' if none.")
        .def(
            "release_prompt_buffers", [](const FlashModel & fm) { return release_prompt_buffers(&fm); },
            "Between evaluations: free the pages of the compute buffers a prompt batch under a budget wrote "
            "(prompt_buffers.h); returns the bytes of the ranges freed (0 when no prompt batch ran since the last "
            "call).");
}

void bind_plan(py::module_ & m) {
    py::class_<PlanEngine, std::shared_ptr<PlanEngine>>(
        m, "PlanEngine", "The engine a plan file describes, opened (plan_reader.h): dense or experts.")
        .def_property_readonly("mode", [](const PlanEngine & e) { return e.identity.mode; })
        .def_property_readonly(
            "dense", [](const PlanEngine & e) { return e.dense; }, "The FlashModel (kind 'dense'), else None.")
        .def_property_readonly(
            "experts", [](const PlanEngine & e) { return e.experts; }, "The ExpertModel (kind 'experts'), else None.")
        .def_property_readonly(
            "expected_weights", [](const PlanEngine & e) { return e.expected_weights; },
            "Weights llama.cpp must place on the device for the model to be served.")
        .def_property_readonly("bound_count", &PlanEngine::bound_count, "Weights bound to the engine so far.")
        .def("begin_model_load", &PlanEngine::begin_model_load,
             "Make this engine the one whose weights llama.cpp's next model load places on the device; "
             "end_model_load() ends it.");

    m.def(
        "open_plan",
        [](const std::string & path) { return llamaflash_py::opened_without_gil([&] { return open_plan(path); }); },
        py::arg("path"),
        "Read the plan file at `path`, check it against this process's ggml and the files it names, and open "
        "its engine (plan_reader.h: the entry point of the backend library the llama.cpp tools load).");
}
