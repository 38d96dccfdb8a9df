// testing/testing.cpp — module llamaflash._native_testing: what only the tests (tests/) and the
// benchmarks (bench/) call, never imported by the runtime package. It links the same core library
// as llamaflash._native (one weight registry, one backend per process):
//   read_phantom_weight     reads a bound phantom weight as another backend would (must abort)
//   SparseFfnKernel, sparse_ffn_forward, sparse_ffn_best_isa, sparse_ffn_activation
//                           the sparse FFN kernel (sparse_ffn.h) over Python buffers, its phases
//                           run as the sparse lane runs them
//   activation_roundtrip, DenseFfnGraph
//                           the ggml dense reference (ffn_dense_ref.h)
//   measure_read_bandwidth  DRAM read bandwidth (bandwidth.h)
//   kquant_gemm, kquant_gemm_supported
//                           the K-quant gemm with vec_dot's bits (kquant_gemm_hooks.h)
//   inject_fault, pending_buffers
//                           a FlashReader's fault injection (flash_io.h) and its kept destination buffers
#include "backend/weight_registry.h"
#include "bindings/flash_reader_py.h"
#include "lanes/sparse_ffn.h"
#include "testing/bandwidth.h"
#include "testing/ffn_dense_ref.h"
#include "testing/kquant_gemm_hooks.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;

namespace {

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

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

// A reusable barrier for the phase driver (C++17 has no std::barrier).
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

// sparse_ffn_begin and the phases on n_threads std::threads, in the summation order the sparse lane
// takes for the same parameters (sparse_ffn_by_cluster; sparse_lane.h): by range, or by cluster with
// thread 0 listing the needed clusters and each thread computing a contiguous part of the list.
void run_phases(const SparseFfnLayer & L, const SparseFfnParams & p, const SparseFfnBatch & batch,
                SparseFfnScratch & scratch) {
    sparse_ffn_begin(L, p, batch, scratch);
    if (batch.n_tokens == 0) return;
    const int nth = p.n_threads;
    const bool by_cluster = sparse_ffn_by_cluster(p);
    std::vector<uint8_t> needed(static_cast<size_t>((L.n_ff + p.cluster_size - 1) / p.cluster_size));
    std::vector<int32_t> clusters;
    Barrier barrier(nth);
    auto work = [&](int ith) {
        sparse_ffn_quantize(scratch, ith, nth);
        barrier.wait();
        if (!by_cluster) {
            sparse_ffn_accumulate(scratch, ith, nth);
            barrier.wait();
            sparse_ffn_reduce(scratch, ith, nth);
            return;
        }
        if (ith == 0) {
            sparse_ffn_needed_clusters(scratch, needed.data());
            for (size_t c = 0; c < needed.size(); ++c) {
                if (needed[c]) clusters.push_back(static_cast<int32_t>(c));
            }
        }
        barrier.wait();
        const int64_t n = static_cast<int64_t>(clusters.size());
        const int64_t begin = n * ith / nth, end = n * (ith + 1) / nth;
        sparse_ffn_accumulate_clusters(scratch, ith, clusters.data() + begin, end - begin);
        barrier.wait();
        sparse_ffn_reduce_clusters(scratch, ith, nth);
    };
    std::vector<std::thread> team;
    for (int i = 1; i < nth; ++i) team.emplace_back(work, i);
    work(0);
    for (std::thread & t : team) t.join();
}

// float32 [n_tokens, n_ff] values a caller supplies (gate_values, up_values), or none
F32Array per_neuron_values(const py::object & values, int64_t n_tokens, int64_t n_ff, const char * what) {
    if (values.is_none()) return F32Array();
    F32Array a = values.cast<F32Array>();
    if (a.ndim() != 2 || a.shape(0) != n_tokens || a.shape(1) != n_ff) {
        throw py::value_error(std::string(what) + " must be float32 [n_tokens, n_ff]");
    }
    return a;
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

    // The up rows from a separate [n_ff, up_row_bytes] array (SparseFfnLayer::up_rows: the base model's
    // row-major ffn_up), not from the bundles.
    void use_up_rows(const py::object & up_rows) {
        up_rows_ = byte_view(up_rows, "up_rows");
        if (up_rows_.size < static_cast<size_t>(L_.n_ff) * L_.up_row_bytes) {
            throw py::value_error("up_rows holds fewer than n_ff * up_row_bytes bytes");
        }
        L_.up_rows = up_rows_.data;
        L_.up_stride = L_.up_row_bytes;
    }

    // Returns (y [n_tokens, n_embd], active_counts [n_tokens]) or, with return_mask, also the
    // active mask [n_tokens, n_ff] (uint8); with n_iter > 0 instead a list of n_iter wall times (s).
    py::object run(const F32Array & x, float threshold, int n_threads, int cluster_size, const std::string & isa,
                   bool return_mask, int n_iter, const py::object & gate_values, const py::object & up_values) {
        if (x.ndim() != 2 || x.shape(1) != L_.n_embd) {
            throw py::value_error("x must be float32 [n_tokens, n_embd=" + std::to_string(L_.n_embd) + "]");
        }
        const int64_t n_tokens = x.shape(0);
        SparseFfnParams p;
        p.threshold = threshold;
        p.n_threads = n_threads;
        p.cluster_size = cluster_size;
        p.isa = isa == "auto"     ? SparseIsa::auto_
                : isa == "scalar" ? SparseIsa::scalar
                : isa == "avx2"   ? SparseIsa::avx2
                : isa == "avx512" ? SparseIsa::avx512
                                  : throw py::value_error("isa must be auto, scalar, avx2 or avx512");
        const F32Array gv = per_neuron_values(gate_values, n_tokens, L_.n_ff, "gate_values");
        const F32Array uv = per_neuron_values(up_values, n_tokens, L_.n_ff, "up_values");
        p.gate_values = gate_values.is_none() ? nullptr : gv.data();
        p.up_values = up_values.is_none() ? nullptr : uv.data();
        F32Array y({n_tokens, L_.n_embd});
        py::array_t<int32_t> counts(n_tokens);
        py::array_t<uint8_t> mask = return_mask ? py::array_t<uint8_t>({n_tokens, L_.n_ff}) : py::array_t<uint8_t>();
        SparseFfnBatch batch;
        batch.x = x.data();
        batch.y = y.mutable_data();
        batch.n_tokens = n_tokens;
        batch.active_counts = counts.mutable_data();
        batch.active_mask = return_mask ? mask.mutable_data() : nullptr;
        std::vector<double> seconds;
        {
            py::gil_scoped_release release;
            for (int it = 0; it < std::max(n_iter, 1); ++it) {
                const auto t0 = std::chrono::steady_clock::now();
                run_phases(L_, p, batch, scratch_);
                seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
        }
        if (n_iter > 0) return py::cast(seconds);
        if (return_mask) return py::make_tuple(y, counts, mask);
        return py::make_tuple(y, counts);
    }

private:
    ByteView bundles_, down_t_, up_rows_;
    SparseFfnLayer L_;
    SparseFfnScratch scratch_;
};

}  // namespace

PYBIND11_MODULE(_native_testing, m) {
    m.doc() = "llamaflash test and benchmark hooks (not used by the runtime package)";
    llamaflash_testing::bind_kquant_gemm_hooks(m);

    m.def(
        "inject_fault",
        [](llamaflash_py::PyFlashReader & r, uint64_t offset, int err) {
            r.get().inject_fault_for_testing(offset, err);
        },
        py::arg("reader"), py::arg("offset"), py::arg("errno"),
        "Make reads of `reader` (a llamaflash._native.FlashReader) covering `offset` fail with `errno` (0: stop).");
    m.def(
        "pending_buffers", [](const llamaflash_py::PyFlashReader & r) { return r.pending(); }, py::arg("reader"),
        "Destination buffers `reader` keeps alive for tickets not yet waited for.");

    // Reads the bytes of a bound phantom weight the way another backend would have to
    // (ggml_backend_tensor_get). The safety net must abort the process with a message; the test
    // suite runs this in a subprocess.
    m.def("read_phantom_weight", [] {
        const ggml_tensor * t = WeightRegistry::instance().any_bound();
        if (t == nullptr) {
            throw std::runtime_error("no phantom weight is bound");
        }
        std::vector<uint8_t> bytes(ggml_nbytes(t));
        ggml_backend_tensor_get(t, bytes.data(), 0, bytes.size());
    });

    py::class_<SparseFfnKernelPy>(m, "SparseFfnKernel",
                                  "One layer's sparse FFN kernel over bundles/down_t buffers it keeps alive.")
        .def(py::init<const py::object &, size_t, int, int, size_t, size_t, const py::object &, int, size_t, int64_t,
                      int64_t, const std::string &>(),
             py::arg("bundles"), py::arg("bundle_stride"), py::arg("gate_type"), py::arg("up_type"),
             py::arg("gate_row_bytes"), py::arg("up_row_bytes"), py::arg("down_t"), py::arg("down_t_type"),
             py::arg("down_t_row_bytes"), py::arg("n_embd"), py::arg("n_ff"), py::arg("activation"))
        .def("use_up_rows", &SparseFfnKernelPy::use_up_rows, py::arg("up_rows"),
             "read the up rows from this uint8 [n_ff, up_row_bytes] array instead of the bundles")
        .def(
            "forward",
            [](SparseFfnKernelPy & k, const F32Array & x, float threshold, int n_threads, int cluster_size,
               const std::string & isa, bool return_mask, const py::object & gate_values,
               const py::object & up_values) {
                return k.run(x, threshold, n_threads, cluster_size, isa, return_mask, 0, gate_values, up_values);
            },
            py::arg("x"), py::arg("threshold") = 0.0f, py::arg("n_threads") = 1, py::arg("cluster_size") = 32,
            py::arg("isa") = "auto", py::arg("return_mask") = false, py::arg("gate_values") = py::none(),
            py::arg("up_values") = py::none(),
            "(y, active_counts[, active_mask]); see csrc/lanes/sparse_ffn.h for the contract. The phases run on\n"
            "n_threads std::threads in the order the sparse lane takes: by cluster with gate_values and\n"
            "no up_values, else by range.")
        .def(
            "time",
            [](SparseFfnKernelPy & k, const F32Array & x, float threshold, int n_threads, int cluster_size,
               const std::string & isa, int n_iter, const py::object & gate_values, const py::object & up_values) {
                return k.run(x, threshold, n_threads, cluster_size, isa, false, std::max(n_iter, 1), gate_values,
                             up_values);
            },
            py::arg("x"), py::arg("threshold") = 0.0f, py::arg("n_threads") = 1, py::arg("cluster_size") = 32,
            py::arg("isa") = "auto", py::arg("n_iter") = 10, py::arg("gate_values") = py::none(),
            py::arg("up_values") = py::none(),
            "wall time in seconds of each of n_iter forward calls (scratch reused, GIL released)");
    m.def(
        "sparse_ffn_forward",
        [](const py::object & bundles, size_t bundle_stride, int gate_type, int up_type, size_t gate_row_bytes,
           size_t up_row_bytes, const py::object & down_t, int down_t_type, size_t down_t_row_bytes, int64_t n_embd,
           int64_t n_ff, const std::string & activation, const F32Array & x, float threshold, int n_threads,
           int cluster_size, const std::string & isa, bool return_mask, const py::object & gate_values,
           const py::object & up_values, const py::object & up_rows) {
            SparseFfnKernelPy k(bundles, bundle_stride, gate_type, up_type, gate_row_bytes, up_row_bytes, down_t,
                                down_t_type, down_t_row_bytes, n_embd, n_ff, activation);
            if (!up_rows.is_none()) k.use_up_rows(up_rows);
            return k.run(x, threshold, n_threads, cluster_size, isa, return_mask, 0, gate_values, up_values);
        },
        py::arg("bundles"), py::arg("bundle_stride"), py::arg("gate_type"), py::arg("up_type"),
        py::arg("gate_row_bytes"), py::arg("up_row_bytes"), py::arg("down_t"), py::arg("down_t_type"),
        py::arg("down_t_row_bytes"), py::arg("n_embd"), py::arg("n_ff"), py::arg("activation"), py::arg("x"),
        py::arg("threshold") = 0.0f, py::arg("n_threads") = 1, py::arg("cluster_size") = 32, py::arg("isa") = "auto",
        py::arg("return_mask") = false, py::arg("gate_values") = py::none(), py::arg("up_values") = py::none(),
        py::arg("up_rows") = py::none(),
        "Sparse FFN of one layer (csrc/lanes/sparse_ffn.h) -> (y [n_tokens, n_embd], active_counts [n_tokens])\n"
        "(+ active_mask [n_tokens, n_ff] with return_mask). gate_values / up_values: optional float32\n"
        "[n_tokens, n_ff] precomputed g / u (bundle order); the gate / up rows are then not read. up_rows:\n"
        "optional uint8 [n_ff, up_row_bytes], the up rows apart from the bundles (SparseFfnLayer::up_rows).");
    m.def(
        "measure_read_bandwidth",
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
    m.def("sparse_ffn_best_isa", [] { return std::string(sparse_isa_name(sparse_ffn_best_isa())); });
    m.def(
        "sparse_ffn_activation",
        [](const std::string & act, const F32Array & g) {
            const FfnActivation a = parse_ffn_activation(act);
            F32Array out(g.size());
            for (py::ssize_t i = 0; i < g.size(); ++i) out.mutable_data()[i] = ffn_activation(a, g.data()[i]);
            return out;
        },
        py::arg("activation"), py::arg("g"), "the activation exactly as the sparse kernel applies it");
    m.def(
        "activation_roundtrip",
        [](int weight_type, const F32Array & x) {
            std::vector<float> v = activation_roundtrip(static_cast<ggml_type>(weight_type), x.data(), x.size());
            return F32Array(static_cast<py::ssize_t>(v.size()), v.data());
        },
        py::arg("weight_type"), py::arg("x"),
        "x quantized to vec_dot_type(weight_type) by ggml-cpu and decoded: what a row dot multiplies with");
    py::class_<DenseFfnGraph>(
        m, "DenseFfnGraph",
        "One layer's dense FFN as a ggml CPU graph (csrc/testing/ffn_dense_ref.h), weights copied in.")
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
                     if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0)
                         throw py::value_error("bad ggml type");
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
        .def(
            "run",
            [](DenseFfnGraph & gr, const F32Array & x, int n_iter) {
                if (x.ndim() != 2 || x.shape(0) != gr.n_tokens() || x.shape(1) != gr.n_embd()) {
                    throw py::value_error("x must be float32 [n_tokens, n_embd] as given at construction");
                }
                F32Array y({static_cast<py::ssize_t>(x.shape(0)), static_cast<py::ssize_t>(gr.out_width())});
                std::vector<double> seconds;
                {
                    py::gil_scoped_release release;
                    for (int it = 0; it < std::max(n_iter, 1); ++it)
                        seconds.push_back(gr.run(x.data(), y.mutable_data()));
                }
                return py::make_tuple(y, seconds);
            },
            py::arg("x"), py::arg("n_iter") = 1, "(y, [graph compute seconds per run]); x shape fixed at construction")
        .def("set_n_threads", &DenseFfnGraph::set_n_threads, py::arg("n_threads"))
        .def_property_readonly("repacked", &DenseFfnGraph::repacked)
        .def_property_readonly("weight_bytes", &DenseFfnGraph::weight_bytes);
}
