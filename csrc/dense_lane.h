// dense_lane.h — the exact dense FFN lane.
//
// The scheduler hands the llamaflash backend one graph split per served layer, e.g. for SwiGLU
//   up   = MUL_MAT(blk.L.ffn_up.weight,   x)      x    : [n_embd, n_tokens] f32
//   gate = MUL_MAT(blk.L.ffn_gate.weight, x)      gate : [n_ff,   n_tokens] f32
//   h    = GLU(gate, up)                          h    : [n_ff,   n_tokens] f32   (swiglu/geglu/reglu)
//   y    = MUL_MAT(blk.L.ffn_down.weight, h)      y    : [n_embd, n_tokens] f32
// (or unary activation + MUL, scaling, ... whatever the architecture builds). The weights in that
// split are phantom. The dense lane mirrors every node of the split into a private graph in which each
// phantom weight is replaced by the layer's resident weight (FlashModel::dense_weight) and every tensor
// computed outside the split becomes a leaf over the same memory; outputs are written to the memory
// the scheduler allocated for the original nodes. The private graph runs on an internal ggml CPU
// backend: ggml's own (blocked, repacked) kernels on the context's thread count, on the same OpenMP
// workers as llama.cpp's CPU backend. Result: bit-identical to stock llama.cpp for the same weights.
// Decode-sized splits of layers with a sparsity threshold go to the sparse lane instead (sparse_lane.h).
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "sparse_lane.h"

#include <cstdint>
#include <vector>

namespace llamaflash {

class DenseLane {
public:
    DenseLane();
    ~DenseLane();
    DenseLane(const DenseLane &) = delete;
    DenseLane & operator=(const DenseLane &) = delete;

    void set_n_threads(int n_threads);

    // Computes all nodes of `split`. Aborts (loudly) if a phantom weight has no resident copy.
    ggml_status compute(const ggml_cgraph * split);

private:
    ggml_backend_t cpu_ = nullptr;
    std::vector<uint8_t> arena_;  // metadata memory of the private graph, reused across calls
    std::vector<std::vector<float>> scratch_;  // fused gate/up products, one per fused pair of a split
    SparseLane sparse_;                        // the sparse decode lane (sparse_lane.h)
    int n_threads_ = GGML_DEFAULT_N_THREADS;  // the internal CPU backend's, kept in step by set_n_threads
};

}  // namespace llamaflash
