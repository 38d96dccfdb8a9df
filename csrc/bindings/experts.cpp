// bindings/experts.cpp — the MoE expert engine (expert_model.h, expert_cache.h) as seen from Python:
// the configuration llamaflash.files.experts builds, the model Llama owns, its counters, and the slot size
// the expert planner sizes the budget with. IoError becomes llamaflash.errors.FlashIoError, a failed
// checksum SidecarIntegrityError.
#include "experts/expert_model.h"
#include "flash_io_py.h"
#include "io/integrity.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;

namespace {

py::dict stats_dict(const ExpertModel & model) {
    const ExpertCacheStats c = model.cache().stats();
    const ExpertModel::LaneStats l = model.lane_stats();
    py::dict d;
    d["splits"] = l.splits;
    d["tokens"] = l.tokens;
    d["experts_computed"] = l.experts;
    d["rounds"] = l.rounds;
    d["multi_round_splits"] = l.multi_round_splits;
    d["compute_seconds"] = l.compute_seconds;
    d["split_seconds"] = l.split_seconds;
    d["overlapped_splits"] = l.overlapped_splits;
    d["draft_splits"] = l.draft_splits;
    d["draft_pairs"] = l.draft_pairs;
    d["draft_substituted"] = l.draft_substituted;
    d["draft_dropped"] = l.draft_dropped;
    d["requests"] = c.requests;
    d["experts_needed"] = c.experts_needed;
    d["hits"] = c.hits;
    d["pinned_hits"] = c.pinned_hits;
    d["misses"] = c.misses;
    d["prefetched"] = c.prefetched;
    d["prefetch_used"] = c.prefetch_used;
    d["prefetch_wasted"] = c.prefetch_wasted;
    d["read_ahead"] = c.read_ahead;
    d["bytes_read"] = c.bytes_read;
    d["demand_bytes"] = c.demand_bytes;
    d["verified_bytes"] = c.verified_bytes;
    d["io_wait_seconds"] = c.wait_seconds;
    d["verify_seconds"] = c.verify_seconds;
    return d;
}

}  // namespace

void bind_experts(py::module_ & m) {
    py::enum_<ExpertTensorKind>(m, "ExpertTensorKind")
        .value("gate", ExpertTensorKind::gate)
        .value("up", ExpertTensorKind::up)
        .value("down", ExpertTensorKind::down)
        .value("gate_up", ExpertTensorKind::gate_up);

    py::class_<ExpertTensorSpec>(m, "ExpertTensorSpec")
        .def(py::init<>())
        .def_readwrite("kind", &ExpertTensorSpec::kind)
        .def_readwrite("offset", &ExpertTensorSpec::offset)
        .def_readwrite("type", &ExpertTensorSpec::type)
        .def_readwrite("ne0", &ExpertTensorSpec::ne0)
        .def_readwrite("ne1", &ExpertTensorSpec::ne1)
        .def_readwrite("expert_bytes", &ExpertTensorSpec::expert_bytes)
        .def_readwrite("checksums", &ExpertTensorSpec::checksums);

    py::class_<ExpertLayerSpec>(m, "ExpertLayerSpec")
        .def(py::init<>())
        .def_readwrite("layer", &ExpertLayerSpec::layer)
        .def_readwrite("n_expert", &ExpertLayerSpec::n_expert)
        .def_readwrite("n_used", &ExpertLayerSpec::n_used)
        .def_readwrite("tensors", &ExpertLayerSpec::tensors)
        .def_readwrite("n_slots", &ExpertLayerSpec::n_slots)
        .def_readwrite("pinned", &ExpertLayerSpec::pinned)
        .def_readwrite("router", &ExpertLayerSpec::router)
        .def_readwrite("router_exact", &ExpertLayerSpec::router_exact);

    py::class_<ExpertConfig>(m, "ExpertConfig")
        .def(py::init<>())
        .def_readwrite("base_path", &ExpertConfig::base_path)
        .def_readwrite("n_embd", &ExpertConfig::n_embd)
        .def_readwrite("layers", &ExpertConfig::layers)
        .def_readwrite("io_engine", &ExpertConfig::io_engine)
        .def_readwrite("queue_depth", &ExpertConfig::queue_depth)
        .def_readwrite("direct", &ExpertConfig::direct)
        .def_readwrite("verify", &ExpertConfig::verify)
        .def_readwrite("prefetch", &ExpertConfig::prefetch)
        .def_readwrite("overlap", &ExpertConfig::overlap)
        .def_readwrite("router_rows", &ExpertConfig::router_rows);

    py::class_<ExpertModel, std::shared_ptr<ExpertModel>>(m, "ExpertModel")
        .def_static(
            "open",
            [](ExpertConfig config) {
                return llamaflash_py::opened_without_gil([&] { return ExpertModel::open(std::move(config)); });
            },
            py::arg("config"), "Open the expert engine (reads the pinned experts).")
        .def_property_readonly("bound_count", &ExpertModel::bound_count)
        .def_property("draft", &ExpertModel::draft, &ExpertModel::set_draft,
                      "Draft mode: route among resident experts only, read nothing (self-speculation).")
        .def("stats", [](const ExpertModel & model) { return stats_dict(model); })
        .def("reset_stats", &ExpertModel::reset_stats)
        .def("take_error", &ExpertModel::take_error)
        .def_property_readonly("resident_bytes",
                               [](const ExpertModel & model) { return model.cache().resident_bytes(); })
        .def("slot_bytes", [](const ExpertModel & model, int position) { return model.cache().slot_bytes(position); })
        .def("resident_experts",
             [](const ExpertModel & model, int position) { return model.cache().resident_experts(position); })
        .def_property_readonly("io_engine",
                               [](const ExpertModel & model) { return std::string(model.cache().engine_name()); })
        .def_property_readonly("direct", [](const ExpertModel & model) { return model.cache().direct(); })
        .def_property_readonly("alignment", [](const ExpertModel & model) { return model.cache().alignment(); });

    m.def("expert_slot_bytes", &expert_slot_bytes, py::arg("expert_bytes"), py::arg("alignment"),
          "Bytes of one expert cache slot holding tensors of `expert_bytes` each (direct-I/O alignment).");
}
