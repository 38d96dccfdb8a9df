// bindings/flash_io.cpp — Python access to FlashReader (flash_io.h) for the disk probe, the
// benchmarks and the tests: the FlashReader class (bindings/flash_reader_py.h), aligned buffers for
// direct reads, and whether io_uring is usable here.
#include "flash_reader_py.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;
using namespace llamaflash;
using llamaflash_py::PyFlashReader;

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
        .def(
            "poll", [](const PyFlashReader & r, uint64_t t) { return r.get().poll(t); }, py::arg("ticket"))
        .def(
            "wait_request", [](const PyFlashReader & r, uint64_t t, size_t i) { return r.get().wait_request(t, i); },
            py::arg("ticket"), py::arg("request"), py::call_guard<py::gil_scoped_release>(),
            "Block until range `request` of the batch has finished; True when it was read, False when it "
            "failed (wait(ticket) reports why and must still be called).")
        .def("read", &PyFlashReader::read, py::arg("offsets"), py::arg("lengths"), py::arg("out"),
             py::arg("dst_offsets") = py::none(), "submit() + wait()")
        .def("verify", &PyFlashReader::verify)
        .def("stats", &PyFlashReader::stats)
        .def("close", &PyFlashReader::close)
        .def("measure_random_reads", &PyFlashReader::measure, py::arg("request_bytes"), py::arg("depth"),
             py::arg("seconds"), py::arg("region_offset") = 0, py::arg("region_bytes") = 0, py::arg("seed") = 1)
        .def_property_readonly("path", [](const PyFlashReader & r) { return r.get().path(); })
        .def_property_readonly("size", [](const PyFlashReader & r) { return r.get().file_size(); })
        .def_property_readonly("alignment", [](const PyFlashReader & r) { return r.get().alignment(); })
        .def_property_readonly("direct", [](const PyFlashReader & r) { return r.get().direct(); })
        .def_property_readonly("fallback_reason", [](const PyFlashReader & r) { return r.get().fallback_reason(); })
        .def_property_readonly("engine", [](const PyFlashReader & r) { return std::string(r.get().engine_name()); })
        .def_property_readonly("engine_note", [](const PyFlashReader & r) { return r.get().engine_note(); })
        .def_property_readonly("queue_depth", [](const PyFlashReader & r) { return r.get().queue_depth(); });

    m.def(
        "aligned_empty",
        [](size_t nbytes, size_t alignment) {
            if (alignment == 0 || (alignment & (alignment - 1)) != 0)
                throw py::value_error("alignment must be a power of two");
            auto * buf = new AlignedBuffer(nbytes, alignment);
            py::capsule owner(buf, [](void * p) { delete static_cast<AlignedBuffer *>(p); });
            return py::array_t<uint8_t>({static_cast<py::ssize_t>(nbytes)}, {1}, buf->data(), owner);
        },
        py::arg("nbytes"), py::arg("alignment") = 4096,
        "An uninitialised uint8 array whose data is aligned to `alignment` bytes (for direct reads).");

    m.def(
        "io_uring_available",
        [] {
            std::string why;
            const bool ok = io_uring_available(&why);
            return py::make_tuple(ok, why);
        },
        "(available, reason it is not)");
}
