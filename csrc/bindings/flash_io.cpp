// bindings/flash_io.cpp — Python access to FlashReader (flash_io.h) for tests, the disk probe and
// benchmarks. Reads go into any writable C-contiguous buffer (numpy uint8 arrays, bytearray); the
// buffer is kept alive by the reader until its ticket is waited for or the reader is closed. The GIL
// is released while waiting. IoError becomes llamaflash.errors.FlashIoError.
#include "../flash_io.h"
#include "flash_io_py.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using namespace llamaflash;
using llamaflash_py::engine_kind;
using llamaflash_py::raise_flash_io_error;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

class PyFlashReader {
public:
    PyFlashReader(const std::string & path, const std::string & engine, unsigned queue_depth, bool direct,
                  uint64_t max_op_bytes) {
        FlashReaderOptions o;
        o.engine = engine_kind(engine);
        o.queue_depth = queue_depth;
        o.direct = direct;
        o.max_op_bytes = max_op_bytes;
        try {
            py::gil_scoped_release nogil;
            reader_ = std::make_shared<FlashReader>(path, o);
        } catch (const IoError & e) {
            raise_flash_io_error(e.what());
        }
    }

    ~PyFlashReader() { close(); }

    // Destroys the native reader (cancels queued reads, waits for those in flight), then lets go of
    // the destination buffers. Idempotent.
    void close() {
        std::shared_ptr<FlashReader> r = std::move(reader_);
        if (r) {
            py::gil_scoped_release nogil;
            r.reset();
        }
        keep_.clear();
    }

    FlashReader & get() const {
        if (!reader_) throw py::value_error("the FlashReader is closed");
        return *reader_;
    }

    uint64_t submit(const I64Array & offsets, const I64Array & lengths, const py::buffer & out,
                    const std::optional<I64Array> & dst_offsets) {
        FlashReader & r = get();
        py::buffer_info info = out.request(true);
        if (!PyBuffer_IsContiguous(reinterpret_cast<Py_buffer *>(info.view()), 'C')) {
            throw py::value_error("out must be a C-contiguous writable buffer");
        }
        const uint64_t out_size = static_cast<uint64_t>(info.size * info.itemsize);
        const py::ssize_t n = offsets.size();
        if (lengths.size() != n || (dst_offsets && dst_offsets->size() != n)) {
            throw py::value_error("offsets, lengths (and dst_offsets) must have the same length");
        }
        auto off = offsets.unchecked<1>();
        auto len = lengths.unchecked<1>();
        std::vector<ReadRequest> reqs(static_cast<size_t>(n));
        uint64_t packed = 0;
        for (py::ssize_t i = 0; i < n; ++i) {
            const int64_t dst = dst_offsets ? dst_offsets->at(i) : static_cast<int64_t>(packed);
            if (off(i) < 0 || len(i) < 0 || dst < 0) throw py::value_error("offsets and lengths must be >= 0");
            if (static_cast<uint64_t>(dst) + static_cast<uint64_t>(len(i)) > out_size) {
                throw py::value_error("request " + std::to_string(i) + " does not fit in out (" +
                                      std::to_string(out_size) + " bytes)");
            }
            reqs[i] = ReadRequest{static_cast<uint64_t>(off(i)), static_cast<uint64_t>(len(i)),
                                  static_cast<uint8_t *>(info.ptr) + dst};
            packed += static_cast<uint64_t>(len(i));
        }
        uint64_t ticket = 0;
        try {
            ticket = r.submit(reqs);
        } catch (const IoError & e) {
            raise_flash_io_error(e.what());
        }
        keep_[ticket] = out;
        return ticket;
    }

    void wait(uint64_t ticket) {
        std::shared_ptr<FlashReader> r = reader_;
        if (!r) throw py::value_error("the FlashReader is closed");
        std::string error;
        {
            py::gil_scoped_release nogil;
            try {
                r->wait(ticket);
            } catch (const IoError & e) {
                error = e.what();
            }
        }
        keep_.erase(ticket);
        if (!error.empty()) raise_flash_io_error(error);
    }

    void read(const I64Array & offsets, const I64Array & lengths, const py::buffer & out,
              const std::optional<I64Array> & dst_offsets) {
        wait(submit(offsets, lengths, out, dst_offsets));
    }

    void verify() const {
        try {
            get().verify();
        } catch (const IoError & e) {
            raise_flash_io_error(e.what());
        }
    }

    py::dict stats() const {
        const FlashReaderStats s = get().stats();
        py::dict d;
        d["batches"] = s.batches;
        d["requests"] = s.requests;
        d["bytes_requested"] = s.bytes_requested;
        d["reads"] = s.reads;
        d["bytes_read"] = s.bytes_read;
        d["bounced"] = s.bounced;
        d["resumed"] = s.resumed;
        d["retried"] = s.retried;
        d["errors"] = s.errors;
        d["wait_calls"] = s.wait_calls;
        d["wait_s"] = static_cast<double>(s.wait_ns) * 1e-9;
        d["engine"] = s.engine;
        d["direct"] = s.direct;
        return d;
    }

    py::dict measure(uint64_t request_bytes, unsigned depth, double seconds, uint64_t region_offset,
                     uint64_t region_bytes, uint64_t seed) {
        FlashReader & r = get();
        if (region_bytes == 0) region_bytes = r.file_size() - std::min(region_offset, r.file_size());
        RandomReadResult res;
        std::string error;
        {
            py::gil_scoped_release nogil;
            try {
                res = measure_random_reads(r, request_bytes, depth, seconds, region_offset, region_bytes, seed);
            } catch (const IoError & e) {
                error = e.what();
            }
        }
        if (!error.empty()) raise_flash_io_error(error);
        py::dict d;
        d["reads"] = res.reads;
        d["bytes"] = res.bytes;
        d["seconds"] = res.seconds;
        return d;
    }

    size_t pending() const { return keep_.size(); }

private:
    std::shared_ptr<FlashReader> reader_;
    std::unordered_map<uint64_t, py::object> keep_;  // destination buffers of unwaited tickets
};

}  // namespace

void bind_flash_io(py::module_ & m) {
    py::class_<PyFlashReader>(m, "FlashReader",
                              "Asynchronous reads of byte ranges of one file (direct I/O where possible).")
        .def(py::init<const std::string &, const std::string &, unsigned, bool, uint64_t>(), py::arg("path"),
             py::arg("engine") = "auto", py::arg("queue_depth") = 32, py::arg("direct") = true,
             py::arg("max_op_bytes") = 1 << 20)
        .def("submit", &PyFlashReader::submit, py::arg("offsets"), py::arg("lengths"), py::arg("out"),
             py::arg("dst_offsets") = py::none(),
             "Start reading range i into out[dst_offsets[i]:][:lengths[i]] (default: packed one after the "
             "other); returns a ticket. `out` must not be touched until wait(ticket).")
        .def("wait", &PyFlashReader::wait, py::arg("ticket"))
        .def("poll", [](const PyFlashReader & r, uint64_t t) { return r.get().poll(t); }, py::arg("ticket"))
        .def("read", &PyFlashReader::read, py::arg("offsets"), py::arg("lengths"), py::arg("out"),
             py::arg("dst_offsets") = py::none(), "submit() + wait()")
        .def("verify", &PyFlashReader::verify)
        .def("stats", &PyFlashReader::stats)
        .def("close", &PyFlashReader::close)
        .def("measure_random_reads", &PyFlashReader::measure, py::arg("request_bytes"), py::arg("depth"),
             py::arg("seconds"), py::arg("region_offset") = 0, py::arg("region_bytes") = 0, py::arg("seed") = 1)
        .def("_inject_fault", [](PyFlashReader & r, uint64_t off, int err) { r.get().inject_fault_for_testing(off, err); },
             py::arg("offset"), py::arg("errno"))
        .def_property_readonly("_pending", &PyFlashReader::pending)
        .def_property_readonly("path", [](const PyFlashReader & r) { return r.get().path(); })
        .def_property_readonly("size", [](const PyFlashReader & r) { return r.get().file_size(); })
        .def_property_readonly("alignment", [](const PyFlashReader & r) { return r.get().alignment(); })
        .def_property_readonly("direct", [](const PyFlashReader & r) { return r.get().direct(); })
        .def_property_readonly("fallback_reason", [](const PyFlashReader & r) { return r.get().fallback_reason(); })
        .def_property_readonly("engine", [](const PyFlashReader & r) { return std::string(r.get().engine_name()); })
        .def_property_readonly("engine_note", [](const PyFlashReader & r) { return r.get().engine_note(); })
        .def_property_readonly("queue_depth", [](const PyFlashReader & r) { return r.get().queue_depth(); });

    m.def("aligned_empty", [](size_t nbytes, size_t alignment) {
        if (alignment == 0 || (alignment & (alignment - 1)) != 0) throw py::value_error("alignment must be a power of two");
        auto * buf = new AlignedBuffer(nbytes, alignment);
        py::capsule owner(buf, [](void * p) { delete static_cast<AlignedBuffer *>(p); });
        return py::array_t<uint8_t>({static_cast<py::ssize_t>(nbytes)}, {1}, buf->data(), owner);
    }, py::arg("nbytes"), py::arg("alignment") = 4096,
       "An uninitialised uint8 array whose data is aligned to `alignment` bytes (for direct reads).");

    m.def("io_uring_available", [] {
        std::string why;
        const bool ok = io_uring_available(&why);
        return py::make_tuple(ok, why);
    }, "(available, reason it is not)");
}
