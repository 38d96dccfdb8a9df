// bindings/flash_reader_py.h — PyFlashReader, the Python object over a FlashReader (flash_io.h):
// reads go into any writable C-contiguous buffer (numpy uint8 arrays, bytearray), which the reader
// keeps alive until its ticket is waited for or the reader is closed. The GIL is released while
// waiting; IoError becomes llamaflash.errors.FlashIoError. Bound as llamaflash._native.FlashReader
// (bindings/flash_io.cpp); llamaflash._native_testing reaches its fault injection and pending
// buffers (testing/testing.cpp).
#pragma once

#include "flash_io_py.h"
#include "io/flash_io.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace llamaflash_py {

namespace py = pybind11;
using namespace llamaflash;

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

}  // namespace llamaflash_py
