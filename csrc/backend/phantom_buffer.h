// phantom_buffer.h — the llamaflash device's buffer type.
//
// llama.cpp uses one buffer type per device for two things: the weights it places on the device and
// the compute (activation) tensors of the device's graph splits. Memory is a lazily committed
// anonymous mapping (MAP_NORESERVE): pages cost RAM only once written.
//  - WEIGHTS buffers: set_tensor copies nothing. The tensor is bound to the model being loaded
//    (WeightRegistry) and its bytes stay "phantom": never committed, never read. The FFN is computed
//    from llamaflash's own copy. Reading a phantom weight (get_tensor / cpy_tensor) aborts with a
//    message: another backend must never compute on it. Exception: an InvariantMatmuls weight
//    (matmul_rows.h) keeps its bytes here, written and read as in a COMPUTE buffer.
//  - COMPUTE buffers: ordinary memory; set/get/memset copy bytes.
// is_host is false on purpose: the CPU backend can then never use a phantom weight directly.
#pragma once

#include "ggml-backend.h"

namespace llamaflash {

ggml_backend_buffer_type_t phantom_buffer_type(ggml_backend_dev_t device);
bool is_phantom_buffer_type(ggml_backend_buffer_type_t buft);

}  // namespace llamaflash
