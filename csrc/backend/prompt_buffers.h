// prompt_buffers.h — the compute memory a prompt batch wrote, given back once the prompt is done.
//
// A context's compute buffers (llama.cpp's CPU buffer and the llamaflash device's, allocated by the
// scheduler for n_ubatch tokens) are written up to the size of the largest batch evaluated. A decode
// step (1 token, or a verify batch of a few) touches only their first pages; the rest stay resident
// after a prompt, holding nothing that is read again (a buffer's contents live for one graph
// evaluation). Under a RAM budget that memory is what the neuron cache's cold region needs while
// decoding, so the planner lets the two take turns (plugin/planning/plan_budget.py): the cold region
// is emptied before a prompt batch (NeuronCache::release_cold), and the prompt's compute pages are
// freed after the prompt (release_prompt_buffers, called by the host between evaluations).
//
// Contract: note() is called by the backend for every prompt batch split it computes (offload only);
// it records, in place of what the previous call recorded, the compute buffers (ggml_backend_buffer
// usage COMPUTE) the split reads and writes, the dense lane's chunk scratch, and the served model. release_prompt_buffers(model), called between two evaluations of that model's
// context (never during one: the pages would be freed under the graph), frees those buffers' whole
// pages (madvise MADV_DONTNEED: they read as zero and are faulted in again by the next graph) and
// forgets them, so a call without a prompt batch since frees nothing. Recorded buffers are those of
// the last graph computed, which the scheduler keeps until its next allocation.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

namespace llamaflash {

class FlashModel;

class PromptBuffers {
public:
    PromptBuffers();   // joins the process's list (release_prompt_buffers walks it)
    ~PromptBuffers();  // leaves it
    PromptBuffers(const PromptBuffers &) = delete;
    PromptBuffers & operator=(const PromptBuffers &) = delete;

    // Records the compute buffers of `split` (a prompt batch of `model`) and `scratch` (bytes of
    // memory the split's lane wrote that no later evaluation reads before writing it).
    void note(const ggml_cgraph * split, const FlashModel * model, void * scratch, size_t scratch_bytes);
    // Frees the recorded buffers' pages when they were written for `model`; returns the bytes.
    size_t release(const FlashModel * model);

private:
    struct Range {
        void * base;
        size_t size;
    };
    std::mutex mutex_;
    std::vector<Range> ranges_;
    const FlashModel * model_ = nullptr;
};

// Frees the prompt compute pages of every context that last computed a prompt batch of `model`
// (see above); returns the bytes of the ranges freed (whole pages; those never written count too).
size_t release_prompt_buffers(const FlashModel * model);

}  // namespace llamaflash
