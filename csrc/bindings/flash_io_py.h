// bindings/flash_io_py.h — what the bindings that read flash share: IoError as Python's
// llamaflash.errors.FlashIoError (a failed checksum as SidecarIntegrityError), and the engine names of
// FlashReaderOptions.
#pragma once

#include "io/flash_io.h"
#include "io/integrity.h"

#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

namespace llamaflash_py {

// Raises llamaflash.errors.FlashIoError(msg) in Python (throws py::error_already_set).
[[noreturn]] inline void raise_flash_io_error(const std::string & msg) {
    pybind11::object cls = pybind11::module_::import("llamaflash.errors").attr("FlashIoError");
    PyErr_SetString(cls.ptr(), msg.c_str());
    throw pybind11::error_already_set();
}

// Raises llamaflash.errors.SidecarIntegrityError(msg) (a row failed its checksum, integrity.h).
[[noreturn]] inline void raise_integrity_error(const std::string & msg) {
    pybind11::object cls = pybind11::module_::import("llamaflash.errors").attr("SidecarIntegrityError");
    PyErr_SetString(cls.ptr(), msg.c_str());
    throw pybind11::error_already_set();
}

// open() with the GIL released: what it returns, or a failed checksum (IntegrityError, or an error
// whose message starts with kIntegrityErrorPrefix) as SidecarIntegrityError, another IoError as
// FlashIoError; any other exception as pybind11 translates it.
template <typename Open>
auto opened_without_gil(Open && open) -> decltype(open()) {
    try {
        pybind11::gil_scoped_release release;
        return open();
    } catch (const llamaflash::IntegrityError & e) {
        raise_integrity_error(e.what());
    } catch (const llamaflash::IoError & e) {
        raise_flash_io_error(e.what());
    } catch (const std::runtime_error & e) {
        if (std::strncmp(e.what(), llamaflash::kIntegrityErrorPrefix, std::strlen(llamaflash::kIntegrityErrorPrefix)) ==
            0) {
            raise_integrity_error(e.what());
        }
        throw;
    }
}

// "auto" | "io_uring" | "pool"; ValueError otherwise.
inline llamaflash::IoEngineKind engine_kind(const std::string & name) {
    try {
        return llamaflash::parse_io_engine(name);
    } catch (const std::invalid_argument & e) {
        throw pybind11::value_error(e.what());
    }
}

}  // namespace llamaflash_py
