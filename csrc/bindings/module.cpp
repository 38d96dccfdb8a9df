// bindings/module.cpp — the thin pybind11 layer over the C++ core (module llamaflash._native).
// Python owns lifetimes: FlashModel is held by shared_ptr (llamaflash.Llama keeps one; the weight
// registry keeps one per llama.cpp buffer bound to it).
#include "../bandwidth.h"
#include "../file_reader.h"
#include "../flash_backend.h"
#include "../flash_model.h"
#include "../ffn_dense_ref.h"
#include "../sparse_ffn.h"
#include "../weight_registry.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;

void bind_flash_io(py::module_ & m);  // bindings/flash_io.cpp
void bind_offload(py::module_ & m);   // bindings/offload.cpp (after FlashModel is bound)

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
    s.base_up_offset = required<uint64_t>(d, "base_up_offset");
    s.base_gate_offset = required<uint64_t>(d, "base_gate_offset");
    if (d.contains("threshold") && !d["threshold"].is_none()) {
        s.threshold = d["threshold"].cast<float>();
    }
    return s;
}

// ---------------------------------------------------------------------------------------------
// sparse FFN kernel (sparse_ffn.h) and ggml dense reference (ffn_dense_ref.h): test/benchmark bindings

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// Read-only bytes of a Python buffer (bytes, bytearray, memoryview, numpy array), kept alive by `owner`.
struct ByteView {
    py::object owner;
    const uint8_t * data = nullptr;
    size_t size = 0;
};

ByteView byte_view(const py::object & obj, const char * what) {
    ByteView v;
    v.owner = obj;
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    for (py::ssize_t i = info.ndim - 1, expect = info.itemsize; i >= 0; --i) {
        if (info.strides[i] != expect) {
            throw py::value_error(std::string(what) + " must be C-contiguous");
        }
        expect *= info.shape[i];
    }
    v.data = static_cast<const uint8_t *>(info.ptr);
    v.size = static_cast<size_t>(info.size * info.itemsize);
    return v;
}

// A reusable barrier for the phase-API test driver (C++17 has no std::barrier).
class Barrier {
public:
    explicit Barrier(int n) : n_(n) {}
    void wait() {
        std::unique_lock<std::mutex> lock(m_);
        const int gen = gen_;
        if (++count_ == n_) {
            count_ = 0;
            ++gen_;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return gen != gen_; });
        }
    }

private:
    std::mutex m_;
    std::condition_variable cv_;
    int n_, count_ = 0, gen_ = 0;
};

// sparse_ffn_begin + the three phases on nth std::threads: what a caller with its own thread pool
// (e.g. ggml custom ops) does; tests check it gives exactly sparse_ffn_forward's result.
void forward_with_phases(const SparseFfnLayer & L, const SparseFfnParams & p, const SparseFfnIo & io,
                         SparseFfnScratch & scratch) {
    sparse_ffn_begin(L, p, io, scratch);
    Barrier barrier(p.n_threads);
    auto work = [&](int ith) {
        sparse_ffn_quantize(scratch, ith, p.n_threads);
        barrier.wait();
        sparse_ffn_accumulate(scratch, ith, p.n_threads);
        barrier.wait();
        sparse_ffn_reduce(scratch, ith, p.n_threads);
    };
    std::vector<std::thread> team;
    for (int i = 1; i < p.n_threads; ++i) team.emplace_back(work, i);
    work(0);
    for (std::thread & t : team) t.join();
}

// One layer's weights (views into Python buffers it keeps alive) plus a reusable scratch.
class SparseFfnKernelPy {
public:
    SparseFfnKernelPy(const py::object & bundles, size_t bundle_stride, int gate_type, int up_type,
                      size_t gate_row_bytes, size_t up_row_bytes, const py::object & down_t, int down_t_type,
                      size_t down_t_row_bytes, int64_t n_embd, int64_t n_ff, const std::string & activation) {
        bundles_ = byte_view(bundles, "bundles");
        down_t_ = byte_view(down_t, "down_t");
        L_.n_embd = n_embd;
        L_.n_ff = n_ff;
        L_.bundles = bundles_.data;
        L_.bundle_stride = bundle_stride;
        L_.gate_type = static_cast<ggml_type>(gate_type);
        L_.up_type = static_cast<ggml_type>(up_type);
        L_.gate_row_bytes = gate_row_bytes;
        L_.up_row_bytes = up_row_bytes;
        L_.down_t = down_t_.data;
        L_.down_t_type = static_cast<ggml_type>(down_t_type);
        L_.down_t_row_bytes = down_t_row_bytes;
        L_.activation = parse_ffn_activation(activation);
        sparse_ffn_validate(L_);
        if (n_ff > 0 && bundles_.size < static_cast<size_t>(n_ff) * bundle_stride) {
            throw py::value_error("bundles holds fewer than n_ff * bundle_stride bytes");
        }
        if (n_ff > 0 && down_t_.size < static_cast<size_t>(n_ff) * down_t_row_bytes) {
            throw py::value_error("down_t holds fewer than n_ff * down_t_row_bytes bytes");
        }
    }

    // Returns (y [n_tokens, n_embd], active_counts [n_tokens]) or, with return_mask, also the
    // active mask [n_tokens, n_ff] (uint8); with n_iter > 0 instead a list of n_iter wall times (s).
    py::object run(const F32Array & x, float threshold, const py::object & active, int n_threads, int cluster_size,
                   const std::string & isa, bool return_mask, int n_iter, bool prefetch = true,
                   const std::string & driver = "omp", const py::object & gate_values = py::none()) {
        if (driver != "omp" && driver != "phases") throw py::value_error("driver must be 'omp' or 'phases'");
        if (x.ndim() != 2 || x.shape(1) != L_.n_embd) {
            throw py::value_error("x must be float32 [n_tokens, n_embd=" + std::to_string(L_.n_embd) + "]");
        }
        const int64_t n_tokens = x.shape(0);
        SparseFfnParams p;
        p.threshold = threshold;
        p.n_threads = n_threads;
        p.cluster_size = cluster_size;
        p.prefetch = prefetch;
        p.isa = isa == "auto" ? SparseIsa::auto_ : isa == "scalar" ? SparseIsa::scalar : isa == "avx2" ? SparseIsa::avx2
              : isa == "avx512" ? SparseIsa::avx512 : throw py::value_error("isa must be auto, scalar, avx2 or avx512");
        std::vector<int32_t> flat;
        std::vector<int64_t> offsets;
        I32Array shared;
        if (py::isinstance<py::list>(active) || py::isinstance<py::tuple>(active)) {  // one list per token
            py::sequence seq = active;
            if (static_cast<int64_t>(seq.size()) != n_tokens) throw py::value_error("need one active list per token");
            offsets.push_back(0);
            for (const auto & item : seq) {
                I32Array a = item.cast<I32Array>();
                flat.insert(flat.end(), a.data(), a.data() + a.size());
                offsets.push_back(static_cast<int64_t>(flat.size()));
            }
            p.active = flat.data();
            p.active_offsets = offsets.data();
            static const int32_t kNone = 0;
            if (flat.empty()) p.active = &kNone;
        } else if (!active.is_none()) {  // one list for every token
            shared = active.cast<I32Array>();
            static const int32_t kNone = 0;
            p.active = shared.size() > 0 ? shared.data() : &kNone;
            p.n_active = shared.size();
        }
        F32Array gv;
        if (!gate_values.is_none()) {
            gv = gate_values.cast<F32Array>();
            if (gv.ndim() != 2 || gv.shape(0) != n_tokens || gv.shape(1) != L_.n_ff) {
                throw py::value_error("gate_values must be float32 [n_tokens, n_ff]");
            }
            p.gate_values = gv.data();
        }
        F32Array y({n_tokens, L_.n_embd});
        py::array_t<int32_t> counts(n_tokens);
        py::array_t<uint8_t> mask = return_mask ? py::array_t<uint8_t>({n_tokens, L_.n_ff}) : py::array_t<uint8_t>();
        SparseFfnIo io;
        io.x = x.data();
        io.y = y.mutable_data();
        io.n_tokens = n_tokens;
        io.active_counts = counts.mutable_data();
        io.active_mask = return_mask ? mask.mutable_data() : nullptr;
        std::vector<double> seconds;
        {
            py::gil_scoped_release release;
            scratch_.reserve(L_, n_tokens, n_threads);
            for (int it = 0; it < std::max(n_iter, 1); ++it) {
                const auto t0 = std::chrono::steady_clock::now();
                if (driver == "omp") {
                    sparse_ffn_forward(L_, p, io, scratch_);
                } else {
                    forward_with_phases(L_, p, io, scratch_);
                }
                seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
        }
        if (n_iter > 0) return py::cast(seconds);
        if (return_mask) return py::make_tuple(y, counts, mask);
        return py::make_tuple(y, counts);
    }

private:
    ByteView bundles_, down_t_;
    SparseFfnLayer L_;
    SparseFfnScratch scratch_;
};

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "llamaflash native core: ggml backend device, sidecar-served FFN lanes";

    py::register_exception<IoError>(m, "IoError", PyExc_OSError);
    bind_flash_io(m);

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
        })
        .def("load_sparse", &FlashModel::load_sparse, py::arg("activation"),
             "Map the sidecar bundles and down_t rows for the sparse lane (after load_dense_weights).")
        .def_property_readonly("sparse_loaded", &FlashModel::sparse_loaded)
        .def("set_sparse_config",
             [](FlashModel & fm, bool enabled, int64_t max_tokens, int cluster_size, bool gate_by_ggml,
                bool up_by_ggml, bool autotune, int autotune_steps) {
                 if (enabled && !fm.sparse_loaded()) {
                     throw py::value_error("the sparse lane is not loaded (call load_sparse first)");
                 }
                 if (max_tokens < 1 || cluster_size < 1 || cluster_size > 256) {
                     throw py::value_error("max_tokens must be >= 1 and cluster_size in 1..256");
                 }
                 SparseConfig c;
                 c.enabled = enabled;
                 c.max_tokens = max_tokens;
                 c.cluster_size = cluster_size;
                 c.gate_by_ggml = gate_by_ggml;
                 c.up_by_ggml = up_by_ggml && gate_by_ggml;
                 c.autotune = autotune;
                 c.autotune_steps = std::max(1, autotune_steps);
                 fm.set_sparse_config(c);
             },
             py::arg("enabled"), py::arg("max_tokens") = 1, py::arg("cluster_size") = 32, py::arg("gate_by_ggml") = true,
             py::arg("up_by_ggml") = false, py::arg("autotune") = false, py::arg("autotune_steps") = 8,
             "Route decode batches of up to max_tokens tokens of layers with a threshold to the sparse lane.")
        .def_property_readonly("sparse_config", [](const FlashModel & fm) {
            const SparseConfig & c = fm.sparse_config();
            py::dict d;
            d["enabled"] = c.enabled;
            d["max_tokens"] = c.max_tokens;
            d["cluster_size"] = c.cluster_size;
            d["gate_by_ggml"] = c.gate_by_ggml;
            d["up_by_ggml"] = c.up_by_ggml;
            d["autotune"] = c.autotune;
            d["autotune_steps"] = c.autotune_steps;
            return d;
        })
        .def_property_readonly("lane_choice", [](const FlashModel & fm) {
            // per served layer: the choice for single-token batches (None while measuring, else
            // "sparse"/"dense", with the mean split times), and under "by_batch" every batch-size
            // bucket that has run ("1", "2", "3-4", ...)
            auto entry = [](const LaneTuning & t) {
                py::dict d;
                d["lane"] = t.decided < 0 ? py::object(py::none()) : py::object(py::str(t.decided ? "sparse" : "dense"));
                d["dense_ms"] = t.n[0] ? py::object(py::float_(1e3 * t.seconds[0] / t.n[0])) : py::object(py::none());
                d["sparse_ms"] = t.n[1] ? py::object(py::float_(1e3 * t.seconds[1] / t.n[1])) : py::object(py::none());
                return d;
            };
            py::dict out;
            const std::vector<LaneTuning> tuning = fm.lane_tuning();
            for (size_t i = 0; i < fm.layers().size() && (i + 1) * kBatchBuckets <= tuning.size(); ++i) {
                py::dict d = entry(tuning[i * kBatchBuckets]);
                py::dict by_batch;
                for (int b = 0; b < kBatchBuckets; ++b) {
                    const LaneTuning & t = tuning[i * kBatchBuckets + b];
                    if (t.warmed[0] || t.warmed[1]) by_batch[py::str(batch_bucket_name(b))] = entry(t);
                }
                d["by_batch"] = by_batch;
                out[py::int_(fm.layers()[i].layer)] = d;
            }
            return out;
        })
        .def_property("thresholds", &FlashModel::thresholds, &FlashModel::set_thresholds,
                      "Per served layer (in served_layers order): skip neuron k when |act(gate_k·x)| <= "
                      "threshold; a negative threshold runs that layer dense.")
        .def("reset_stats", &FlashModel::reset_stats);
    bind_offload(m);

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

    // ---------------------------------------------------------------------------------------------
    // sparse FFN kernel: test and benchmark bindings; the backend does not go through these
    py::class_<SparseFfnKernelPy>(m, "SparseFfnKernel",
                                  "One layer's sparse FFN kernel over bundles/down_t buffers it keeps alive.")
        .def(py::init<const py::object &, size_t, int, int, size_t, size_t, const py::object &, int, size_t, int64_t,
                      int64_t, const std::string &>(),
             py::arg("bundles"), py::arg("bundle_stride"), py::arg("gate_type"), py::arg("up_type"),
             py::arg("gate_row_bytes"), py::arg("up_row_bytes"), py::arg("down_t"), py::arg("down_t_type"),
             py::arg("down_t_row_bytes"), py::arg("n_embd"), py::arg("n_ff"), py::arg("activation"))
        .def("forward", [](SparseFfnKernelPy & k, const F32Array & x, float threshold, const py::object & active,
                           int n_threads, int cluster_size, const std::string & isa, bool return_mask, bool prefetch,
                           const std::string & driver, const py::object & gate_values) {
                 return k.run(x, threshold, active, n_threads, cluster_size, isa, return_mask, 0, prefetch, driver,
                              gate_values);
             },
             py::arg("x"), py::arg("threshold") = 0.0f, py::arg("active") = py::none(), py::arg("n_threads") = 1,
             py::arg("cluster_size") = 32, py::arg("isa") = "auto", py::arg("return_mask") = false,
             py::arg("prefetch") = true, py::arg("driver") = "omp", py::arg("gate_values") = py::none(),
             "(y, active_counts[, active_mask]); see csrc/sparse_ffn.h for the contract. driver 'phases' runs\n"
             "sparse_ffn_begin + the phase functions on n_threads std::threads instead of OpenMP.")
        .def("time", [](SparseFfnKernelPy & k, const F32Array & x, float threshold, const py::object & active,
                        int n_threads, int cluster_size, const std::string & isa, int n_iter, bool prefetch,
                        const py::object & gate_values) {
                 return k.run(x, threshold, active, n_threads, cluster_size, isa, false, std::max(n_iter, 1), prefetch,
                              "omp", gate_values);
             },
             py::arg("x"), py::arg("threshold") = 0.0f, py::arg("active") = py::none(), py::arg("n_threads") = 1,
             py::arg("cluster_size") = 32, py::arg("isa") = "auto", py::arg("n_iter") = 10, py::arg("prefetch") = true,
             py::arg("gate_values") = py::none(),
             "wall time in seconds of each of n_iter forward calls (scratch reused, GIL released)");
    m.def("sparse_ffn_forward",
          [](const py::object & bundles, size_t bundle_stride, int gate_type, int up_type, size_t gate_row_bytes,
             size_t up_row_bytes, const py::object & down_t, int down_t_type, size_t down_t_row_bytes, int64_t n_embd,
             int64_t n_ff, const std::string & activation, const F32Array & x, float threshold,
             const py::object & active, int n_threads, int cluster_size, const std::string & isa, bool return_mask,
             const py::object & gate_values) {
              SparseFfnKernelPy k(bundles, bundle_stride, gate_type, up_type, gate_row_bytes, up_row_bytes, down_t,
                                  down_t_type, down_t_row_bytes, n_embd, n_ff, activation);
              return k.run(x, threshold, active, n_threads, cluster_size, isa, return_mask, 0, true, "omp", gate_values);
          },
          py::arg("bundles"), py::arg("bundle_stride"), py::arg("gate_type"), py::arg("up_type"),
          py::arg("gate_row_bytes"), py::arg("up_row_bytes"), py::arg("down_t"), py::arg("down_t_type"),
          py::arg("down_t_row_bytes"), py::arg("n_embd"), py::arg("n_ff"), py::arg("activation"), py::arg("x"),
          py::arg("threshold") = 0.0f, py::arg("active") = py::none(), py::arg("n_threads") = 1,
          py::arg("cluster_size") = 32, py::arg("isa") = "auto", py::arg("return_mask") = false,
          py::arg("gate_values") = py::none(),
          "Sparse FFN of one layer (csrc/sparse_ffn.h) -> (y [n_tokens, n_embd], active_counts [n_tokens])\n"
          "(+ active_mask [n_tokens, n_ff] with return_mask). active: None (gate-first), an int32 array of\n"
          "bundle-order indices for every token, or a list of one array per token. gate_values: optional\n"
          "float32 [n_tokens, n_ff] precomputed g (bundle order); the gate rows are then not read.");
    m.def("measure_read_bandwidth",
          [](size_t buffer_bytes, int n_threads, int repetitions) {
              BandwidthResult r;
              {
                  py::gil_scoped_release release;
                  r = measure_read_bandwidth(buffer_bytes, n_threads, repetitions);
              }
              py::dict d;
              d["bytes_per_second"] = r.bytes_per_second;
              d["median_bytes_per_second"] = r.median_bytes_per_second;
              d["buffer_bytes"] = r.buffer_bytes;
              d["n_threads"] = r.n_threads;
              d["repetitions"] = r.repetitions;
              return d;
          },
          py::arg("buffer_bytes") = size_t(1) << 30, py::arg("n_threads") = 2, py::arg("repetitions") = 5,
          "DRAM read bandwidth: n_threads stream a buffer of buffer_bytes (best and median of the repetitions).");
    m.def("quantize_rows",
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
    m.def("sparse_ffn_best_isa", [] { return std::string(sparse_isa_name(sparse_ffn_best_isa())); });
    m.def("sparse_ffn_activation", [](const std::string & act, const F32Array & g) {
              const FfnActivation a = parse_ffn_activation(act);
              F32Array out(g.size());
              for (py::ssize_t i = 0; i < g.size(); ++i) out.mutable_data()[i] = ffn_activation(a, g.data()[i]);
              return out;
          }, py::arg("activation"), py::arg("g"), "the activation exactly as the sparse kernel applies it");
    m.def("activation_roundtrip", [](int weight_type, const F32Array & x) {
              std::vector<float> v = activation_roundtrip(static_cast<ggml_type>(weight_type), x.data(), x.size());
              return F32Array(static_cast<py::ssize_t>(v.size()), v.data());
          }, py::arg("weight_type"), py::arg("x"),
          "x quantized to vec_dot_type(weight_type) by ggml-cpu and decoded: what a row dot multiplies with");
    py::class_<DenseFfnGraph>(m, "DenseFfnGraph",
                              "One layer's dense FFN as a ggml CPU graph (csrc/ffn_dense_ref.h), weights copied in.")
        .def(py::init([](const py::object & gate, int gate_type, const py::object & up, int up_type,
                         const py::object & down, int down_type, int64_t n_embd, int64_t n_ff,
                         const std::string & activation, int64_t n_tokens, int n_threads, bool repack, bool gate_only) {
                 ByteView g = byte_view(gate, "gate");
                 ByteView u = gate_only && up.is_none() ? g : byte_view(up, "up");
                 ByteView d = gate_only && down.is_none() ? g : byte_view(down, "down");
                 DenseFfnRefWeights w;
                 w.n_embd = n_embd;
                 w.n_ff = n_ff;
                 w.gate = g.data;
                 w.up = u.data;
                 w.down = d.data;
                 w.gate_type = static_cast<ggml_type>(gate_type);
                 w.up_type = static_cast<ggml_type>(up_type);
                 w.down_type = static_cast<ggml_type>(down_type);
                 w.activation = parse_ffn_activation(activation);
                 for (ggml_type t : {w.gate_type, w.up_type, w.down_type}) {
                     if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0) throw py::value_error("bad ggml type");
                 }
                 if (g.size < ggml_row_size(w.gate_type, n_embd) * n_ff ||
                     (!gate_only && (u.size < ggml_row_size(w.up_type, n_embd) * n_ff ||
                                     d.size < ggml_row_size(w.down_type, n_ff) * n_embd))) {
                     throw py::value_error("DenseFfnGraph: a weight buffer is too small");
                 }
                 return std::make_unique<DenseFfnGraph>(w, n_tokens, n_threads, repack, gate_only);
             }),
             py::arg("gate"), py::arg("gate_type"), py::arg("up"), py::arg("up_type"), py::arg("down"),
             py::arg("down_type"), py::arg("n_embd"), py::arg("n_ff"), py::arg("activation"), py::arg("n_tokens") = 1,
             py::arg("n_threads") = 1, py::arg("repack") = true, py::arg("gate_only") = false)
        .def("run", [](DenseFfnGraph & gr, const F32Array & x, int n_iter) {
                 if (x.ndim() != 2 || x.shape(0) != gr.n_tokens() || x.shape(1) != gr.n_embd()) {
                     throw py::value_error("x must be float32 [n_tokens, n_embd] as given at construction");
                 }
                 F32Array y({static_cast<py::ssize_t>(x.shape(0)), static_cast<py::ssize_t>(gr.out_width())});
                 std::vector<double> seconds;
                 {
                     py::gil_scoped_release release;
                     for (int it = 0; it < std::max(n_iter, 1); ++it) seconds.push_back(gr.run(x.data(), y.mutable_data()));
                 }
                 return py::make_tuple(y, seconds);
             },
             py::arg("x"), py::arg("n_iter") = 1, "(y, [graph compute seconds per run]); x shape fixed at construction")
        .def("set_n_threads", &DenseFfnGraph::set_n_threads, py::arg("n_threads"))
        .def_property_readonly("repacked", &DenseFfnGraph::repacked)
        .def_property_readonly("weight_bytes", &DenseFfnGraph::weight_bytes);
}
