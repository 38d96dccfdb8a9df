// flash_backend.h — the llamaflash ggml backend: registry, one ACCEL device, backend.
//
// Registered at runtime with ggml_backend_register() (from Python, on `import llamaflash`), before
// any model is loaded. Because the device type is ACCEL, llama.cpp offers the device's buffer type
// first for every CPU-resident weight and creates a llamaflash backend in every context; the device
// accepts only the FFN weights of layers a loaded sidecar serves (see supports_op), so everything
// else stays exactly where stock llama.cpp puts it.
#pragma once

#include "ggml-backend.h"

namespace llamaflash {

// Registers the backend with ggml once per process; later calls are no-ops. Returns the registry.
ggml_backend_reg_t register_backend();

// The registry itself, not registered: the loadable backend library (dl_backend.cpp) hands it to
// ggml's loader, which registers it.
ggml_backend_reg_t backend_reg();

}  // namespace llamaflash
