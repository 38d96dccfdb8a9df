// prompt_buffers.cpp — see prompt_buffers.h.
#include "backend/prompt_buffers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <set>

namespace llamaflash {

namespace {

std::mutex & registry_mutex() {
    static std::mutex m;
    return m;
}

std::set<PromptBuffers *> & registry() {
    static std::set<PromptBuffers *> all;
    return all;
}

ggml_backend_buffer_t compute_buffer_of(const ggml_tensor * t) {
    if (t == nullptr) return nullptr;
    const ggml_tensor * base = t->view_src != nullptr ? t->view_src : t;
    ggml_backend_buffer_t b = base->buffer;
    return b != nullptr && ggml_backend_buffer_get_usage(b) == GGML_BACKEND_BUFFER_USAGE_COMPUTE ? b : nullptr;
}

}  // namespace

PromptBuffers::PromptBuffers() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().insert(this);
}

PromptBuffers::~PromptBuffers() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
}

void PromptBuffers::note(const ggml_cgraph * split, const FlashModel * model, void * scratch, size_t scratch_bytes) {
    ggml_cgraph * g = const_cast<ggml_cgraph *>(split);
    std::lock_guard<std::mutex> lock(mutex_);
    // only what this split uses: an earlier split's buffer may have been freed since
    ranges_.clear();
    model_ = model;
    if (scratch != nullptr && scratch_bytes > 0) ranges_.push_back({scratch, scratch_bytes});
    auto add = [&](const ggml_tensor * t) {
        ggml_backend_buffer_t b = compute_buffer_of(t);
        if (b == nullptr) return;
        void * base = ggml_backend_buffer_get_base(b);
        for (const Range & r : ranges_) {
            if (r.base == base) return;
        }
        ranges_.push_back({base, ggml_backend_buffer_get_size(b)});
    };
    for (int i = 0; i < ggml_graph_n_nodes(g); ++i) {
        const ggml_tensor * node = ggml_graph_node(g, i);
        add(node);
        for (int j = 0; j < GGML_MAX_SRC; ++j) add(node->src[j]);
    }
}

size_t PromptBuffers::release(const FlashModel * model) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (model_ != model || ranges_.empty()) return 0;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    size_t freed = 0;
    for (const Range & r : ranges_) {
        const uintptr_t begin = (reinterpret_cast<uintptr_t>(r.base) + page - 1) / page * page;
        const uintptr_t end = (reinterpret_cast<uintptr_t>(r.base) + r.size) / page * page;
        if (end > begin && madvise(reinterpret_cast<void *>(begin), end - begin, MADV_DONTNEED) == 0) {
            freed += end - begin;
        }
    }
    ranges_.clear();
    model_ = nullptr;
    return freed;
}

size_t release_prompt_buffers(const FlashModel * model) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    size_t freed = 0;
    for (PromptBuffers * p : registry()) freed += p->release(model);
    return freed;
}

}  // namespace llamaflash
