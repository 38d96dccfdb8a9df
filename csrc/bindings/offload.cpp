// bindings/offload.cpp — FlashModel's flash-offload state (offload_state.h, neuron_cache.h) as seen
// from Python: cache statistics and the streamed gate, and the cache's slot size, which the planner
// (plugin/planning/planner.py) sizes the budget with. IoError becomes llamaflash.errors.FlashIoError.
#include "flash_io_py.h"
#include "lanes/sparse_ffn.h"
#include "model/flash_model.h"
#include "offload/neuron_cache.h"
#include "offload/offload_state.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;
using llamaflash_py::raise_flash_io_error;

namespace {

using FlashModelClass = py::class_<FlashModel, std::shared_ptr<FlashModel>>;

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
    d["verified_bytes"] = s.verified_bytes;
    d["verify_seconds"] = s.verify_seconds;
    d["clusters_checked_by_compute"] = s.clusters_checked_by_compute;
    d["compute_verify_seconds"] = s.compute_verify_seconds;
    d["cold_releases"] = s.cold_releases;
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

py::dict stream_stats(const LayerStream & stream) {
    const LayerStreamStats s = stream.stats();
    py::dict d;
    d["plans"] = s.plans;
    d["hits_hot"] = s.hits_hot;
    d["hits_cold"] = s.hits_cold;
    d["hits_prefetch"] = s.hits_prefetch;
    d["misses"] = s.misses;
    d["prefetched"] = s.prefetched;
    d["bytes_read"] = s.bytes_read;
    d["hot_bytes_loaded"] = s.hot_bytes_loaded;
    d["verified_bytes"] = s.verified_bytes;
    d["product_verified_bytes"] = s.product_verified_bytes;
    d["io_wait_seconds"] = s.io_wait_seconds;
    d["verify_seconds"] = s.verify_seconds;
    d["hot_slots"] = s.hot_slots;
    d["cold_slots"] = s.cold_slots;
    d["slot_bytes"] = s.slot_bytes;
    d["memory_bytes"] = stream.memory_bytes();
    d["engine"] = s.engine;
    d["direct"] = s.direct;
    d["fallback_reason"] = s.fallback_reason;
    return d;
}

}  // namespace

void bind_offload(py::module_ & m) {
    m.def("layer_stream_slot_bytes", &layer_stream_slot_bytes, py::arg("gate_bytes"), py::arg("up_bytes"),
          py::arg("down_bytes"), py::arg("alignment") = 4096,
          "Bytes of one layer-stream slot (layer_stream.h): for each part round_up(bytes, A) + A (0 for a "
          "part of 0 bytes), A = max(4096, alignment), the bytes being the largest over the served layers.");
    m.def("cache_min_cold_slots", &neuron_cache_min_cold_slots, py::arg("prefetch_layers"),
          py::arg("max_clusters_per_layer"),
          "The fewest cold slots the neuron cache accepts (neuron_cache.h): (1 + prefetch_layers) x the most "
          "clusters of a layer.");
    m.def("cache_slot_bytes", &neuron_cache_slot_bytes, py::arg("cluster_size"), py::arg("up_row_bytes"),
          py::arg("down_t_row_bytes"),
          "Bytes of one neuron-cache slot (neuron_cache.h): round_up(C·up_row_bytes, 4096) + "
          "round_up(C·down_t_row_bytes, 4096), the row sizes being the largest over the served layers.");
    m.def("draft_copy_tensor_bytes", &draft_copy_tensor_bytes, py::arg("n_ff"), py::arg("draft_row_bytes"),
          "Bytes the engine allocates for one tensor (up or down_t) of one layer's resident draft copy "
          "(offload_state.h): round_up(n_ff·draft_row_bytes, 4096).");
    m.def(
        "sparse_scratch_bytes",
        [](int gate_type, int up_type, int64_t n_embd, int64_t n_tokens, int n_threads, int64_t n_clusters) {
            return sparse_ffn_scratch_bytes(static_cast<ggml_type>(gate_type), static_cast<ggml_type>(up_type), n_embd,
                                            n_tokens, n_threads, n_clusters);
        },
        py::arg("gate_type"), py::arg("up_type"), py::arg("n_embd"), py::arg("n_tokens"), py::arg("n_threads"),
        py::arg("n_clusters"),
        "Bytes the sparse lane's scratch takes for a layer of these ggml types and n_embd, up to n_tokens tokens, "
        "n_threads threads and n_clusters clusters of the cluster phase (sparse_ffn.h, SparseFfnScratch::reserve).");
    auto cls = py::reinterpret_borrow<FlashModelClass>(m.attr("FlashModel"));
    cls.def_property_readonly("stream_gate",
                              [](const FlashModel & fm) { return fm.offload() && fm.offload()->stream_gate(); })
        .def_property_readonly(
            "streamed_gate_bytes",
            [](const FlashModel & fm) { return fm.offload() ? fm.offload()->streamed_gate_bytes() : uint64_t{0}; },
            "Gate bytes a decode token reads from flash (every served layer's gate matrix; 0 when resident).")
        .def_property_readonly("offloaded", [](const FlashModel & fm) { return fm.offload() != nullptr; })
        .def_property(
            "draft", [](const FlashModel & fm) { return fm.offload() != nullptr && fm.offload()->draft(); },
            [](FlashModel & fm, bool draft) {
                if (fm.offload() == nullptr) throw py::value_error("draft mode needs flash offload (ram_budget_mb)");
                fm.offload()->set_draft(draft);
            },
            "Draft mode (offload_state.h): decode splits use only the clusters resident in the neuron cache "
            "(no flash read, the cache untouched); an approximation, for drafting tokens.")
        .def_property_readonly(
            "draft_copy_bytes",
            [](const FlashModel & fm) { return fm.offload() ? fm.offload()->draft_copy_bytes() : size_t{0}; },
            "Bytes of the resident draft copy (0: none); draft-mode splits compute from it.")
        .def("cache_stats",
             [](const FlashModel & fm) -> py::object {
                 const NeuronCache * c = fm.offload() != nullptr ? fm.offload()->cache() : nullptr;
                 if (c == nullptr) return py::none();
                 py::dict d = cache_stats(c->stats());
                 d["memory_bytes"] = c->memory_bytes();
                 d["cluster_size"] = c->cluster_size();
                 return d;
             })
        .def(
            "layer_stream_stats",
            [](const FlashModel & fm) -> py::object {
                const LayerStream * s = fm.offload() != nullptr ? fm.offload()->layer_stream() : nullptr;
                if (s == nullptr) return py::none();
                return stream_stats(*s);
            },
            "The layer stream's counters (layer_stream.h; offload with whole layers), else None.")
        .def("reset_cache_stats",
             [](FlashModel & fm) {
                 if (fm.offload() == nullptr) return;
                 if (NeuronCache * c = fm.offload()->cache()) c->reset_stats();
                 if (LayerStream * s = fm.offload()->layer_stream()) s->reset_stats();
             })
        .def(
            "verify_files",
            [](const FlashModel & fm) {
                try {
                    if (fm.offload() != nullptr) fm.offload()->verify_files();
                } catch (const IoError & e) {
                    raise_flash_io_error(e.what());
                }
            },
            "Raise FlashIoError when the model or sidecar changed on disk since the cache opened them.");
}
