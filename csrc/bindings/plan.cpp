// bindings/plan.cpp — llamaflash.Llama's side of the plan file: open_plan(path) opens the engine a
// plan describes through the same entry point the backend library uses (backend/plan_engine.h).
// IoError during open becomes llamaflash.errors.FlashIoError, a failed checksum
// SidecarIntegrityError, std::invalid_argument a ValueError, any other error a RuntimeError.
#include "backend/plan_engine.h"
#include "backend/weight_registry.h"
#include "flash_io_py.h"
#include "io/integrity.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>

namespace py = pybind11;
using namespace llamaflash;

void bind_plan(py::module_ & m) {
    py::class_<PlanEngine, std::shared_ptr<PlanEngine>>(
        m, "PlanEngine", "The engine a plan file describes, opened (plan_engine.h): dense or experts.")
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
        [](const std::string & path) {
            try {
                py::gil_scoped_release release;
                return open_plan(path);
            } catch (const IntegrityError & e) {
                llamaflash_py::raise_integrity_error(e.what());
            } catch (const IoError & e) {
                llamaflash_py::raise_flash_io_error(e.what());
            } catch (const std::runtime_error & e) {
                if (std::strncmp(e.what(), kIntegrityErrorPrefix, std::strlen(kIntegrityErrorPrefix)) == 0) {
                    llamaflash_py::raise_integrity_error(e.what());
                }
                throw;
            }
        },
        py::arg("path"),
        "Read the plan file at `path`, check it against this process's ggml and the files it names, and open "
        "its engine (plan_engine.h: the entry point of the backend library the llama.cpp tools load).");
}
