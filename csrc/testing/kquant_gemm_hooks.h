// testing/kquant_gemm_hooks.h — llamaflash._native_testing's hooks for kquant_gemm (kernels/kquant_gemm.h).
#pragma once

#include <pybind11/pybind11.h>

namespace llamaflash_testing {

//   kquant_gemm(weights, type, ne0, x, reference=False, repeat=0, isa="auto", crc=None)
//       weights: uint8 [n_rows, row_bytes] in ggml type `type`; x: f32 [n_cols, ne0]
//       → f32 [n_cols, n_rows]: kquant_gemm's outputs (reference: ggml's vec_dot, one per output);
//         with repeat > 0, the seconds of each of `repeat` runs instead (the quantization of x excluded);
//         isa "avx2" / "avx512vnni": that kernel itself, unchecked; crc (uint32 [n_rows]): the rows
//         checked by a CheckedWeight through the RowBlockHook as they are multiplied → (out, first bad
//         row or -1, hook's blocks)
//   kquant_gemm_isas(type) → the kernels this CPU can run for `type`
//   kquant_gemm_supported(type) → whether the kernel (not vec_dot) computes `type` in this process
void bind_kquant_gemm_hooks(pybind11::module_ & m);

}  // namespace llamaflash_testing
