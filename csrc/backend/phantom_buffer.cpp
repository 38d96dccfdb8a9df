// phantom_buffer.cpp — see phantom_buffer.h.
#include "backend/phantom_buffer.h"

#include "backend/weight_registry.h"
#include "ggml-backend-impl.h"

#include <sys/mman.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace llamaflash {

namespace {

constexpr size_t kAlignment = 64;

struct PhantomBuffer {
    void * base = nullptr;
    size_t mapped = 0;
};

bool is_weights(ggml_backend_buffer_t buffer) { return buffer->usage == GGML_BACKEND_BUFFER_USAGE_WEIGHTS; }

// A weight whose bytes the device keeps (an InvariantMatmuls weight, matmul_rows.h: BoundWeight::bytes_of
// says where), unlike a phantom one; nullptr for a phantom weight.
const BoundWeight * kept_weight(const ggml_tensor * tensor) {
    const BoundWeight * b = WeightRegistry::instance().lookup(tensor);
    return b != nullptr && b->matmuls != nullptr ? b : nullptr;
}

[[noreturn]] void phantom_read_abort(const ggml_tensor * tensor, const char * how) {
    GGML_ABORT(
        "llamaflash: %s of phantom FFN weight '%s': its bytes live in the llamaflash sidecar, not in "
        "this buffer. An op using it was scheduled on a backend other than llamaflash; this is a "
        "llamaflash bug (unsupported graph pattern) - please report it with the model architecture",
        how, tensor->name);
}

void buffer_free(ggml_backend_buffer_t buffer) {
    auto * ctx = static_cast<PhantomBuffer *>(buffer->context);
    WeightRegistry::instance().unbind_buffer(buffer);
    if (ctx->mapped != 0) {
        munmap(ctx->base, ctx->mapped);
    }
    delete ctx;
}

void * buffer_get_base(ggml_backend_buffer_t buffer) { return static_cast<PhantomBuffer *>(buffer->context)->base; }

void buffer_memset_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, uint8_t value, size_t offset,
                          size_t size) {
    if (is_weights(buffer) && kept_weight(tensor) == nullptr) {
        return;  // phantom weights have no bytes here
    }
    std::memset(static_cast<uint8_t *>(tensor->data) + offset, value, size);
}

// True if [begin, end) lies inside one shared, read-only, file-backed mapping (llama.cpp's mmap of
// the GGUF): then, if asked, the file's path and the file offset of `begin`. Anything else (a
// caller's heap staging buffer) must not be madvised.
bool in_shared_file_mapping(uintptr_t begin, uintptr_t end, std::string * path = nullptr,
                            uint64_t * file_offset = nullptr) {
    FILE * maps = std::fopen("/proc/self/maps", "r");
    if (maps == nullptr) {
        return false;
    }
    bool found = false;
    char line[4096 + 128];
    while (std::fgets(line, sizeof line, maps) != nullptr) {
        unsigned long lo = 0, hi = 0, offset = 0, inode = 0;
        char perms[8] = {0};
        int name_at = 0;
        if (std::sscanf(line, "%lx-%lx %7s %lx %*s %lu %n", &lo, &hi, perms, &offset, &inode, &name_at) != 5) {
            continue;
        }
        if (begin >= lo && end <= hi) {
            found = inode != 0 && perms[1] == '-' && perms[3] == 's';
            if (found && path != nullptr) {
                std::string name(line + name_at);
                while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) {
                    name.pop_back();
                }
                *path = name;
                *file_offset = offset + (begin - lo);
                found = !name.empty() && name[0] == '/' && name.find(" (deleted)") == std::string::npos;
            }
            break;
        }
    }
    std::fclose(maps);
    return found;
}

// An InvariantMatmuls weight handed in whole from a shared mapping of the model file: bound to the
// same bytes through the model's own mapping of that file (read in place, nothing copied). False:
// the caller copies it.
bool bind_in_place(const ggml_tensor * tensor, const BoundWeight & b, const void * data, size_t size) {
    const auto begin = reinterpret_cast<uintptr_t>(data);
    std::string path;
    uint64_t offset = 0;
    if (!b.matmuls->read_in_place || !in_shared_file_mapping(begin, begin + size, &path, &offset)) {
        return false;
    }
    const uint8_t * bytes = b.matmuls->file_bytes(path, offset, size);
    if (bytes == nullptr || std::memcmp(bytes, data, std::min<size_t>(size, 4096)) != 0) {
        return false;  // not the same file after all (replaced meanwhile): keep a copy
    }
    WeightRegistry::instance().set_bytes(tensor, bytes);
    b.matmuls->in_place.fetch_add(1, std::memory_order_relaxed);
    return true;
}

// Advises the kernel that a page-aligned interior of [data, data + size) is not needed: llama.cpp
// hands weights in from its own mmap of the GGUF; dropping the page-table entries keeps those FFN
// pages out of this process's RSS (they remain clean, reclaimable page cache). Only done when the
// source is such a read-only shared file mapping; the pointer is not kept.
void release_source_pages(const void * data, size_t size) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) & ~(page - 1);
    if (end > begin && in_shared_file_mapping(begin, end)) {
        (void)madvise(reinterpret_cast<void *>(begin), end - begin, MADV_DONTNEED);
    }
}

void buffer_set_tensor(ggml_backend_buffer_t buffer, ggml_tensor * tensor, const void * data, size_t offset,
                       size_t size) {
    if (is_weights(buffer)) {
        if (!WeightRegistry::instance().bind(tensor, buffer)) {
            GGML_ABORT(
                "llamaflash: weight '%s' was placed on the llamaflash device but no sidecar being loaded "
                "serves it",
                tensor->name);
        }
        const bool whole = offset == 0 && size == ggml_nbytes(tensor);
        const BoundWeight * kept = kept_weight(tensor);
        if (kept == nullptr) {
            if (whole) {
                release_source_pages(data, size);
            }
            return;
        }
        // a weight whose bytes the device keeps: read in place from the model file where llama.cpp
        // maps it, else copied into this buffer
        if (!(whole && bind_in_place(tensor, *kept, data, size))) {
            std::memcpy(static_cast<uint8_t *>(tensor->data) + offset, data, size);
            if (whole) {
                release_source_pages(data, size);  // the copy replaces them (they stay clean page cache)
            }
        }
        return;
    }
    std::memcpy(static_cast<uint8_t *>(tensor->data) + offset, data, size);
}

void buffer_get_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * tensor, void * data, size_t offset,
                       size_t size) {
    if (is_weights(buffer)) {
        const BoundWeight * kept = kept_weight(tensor);
        if (kept == nullptr) {
            phantom_read_abort(tensor, "read");
        }
        std::memcpy(data, kept->bytes_of(tensor) + offset, size);
        return;
    }
    std::memcpy(data, static_cast<const uint8_t *>(tensor->data) + offset, size);
}

bool buffer_cpy_tensor(ggml_backend_buffer_t buffer, const ggml_tensor * src, ggml_tensor * dst) {
    const BoundWeight * kept = nullptr;  // src: a weight of ours that has bytes
    if (src->buffer != nullptr && is_phantom_buffer_type(src->buffer->buft) && is_weights(src->buffer)) {
        kept = kept_weight(src);
        if (kept == nullptr) {
            phantom_read_abort(src, "copy");
        }
    }
    if (is_weights(buffer)) {
        return false;
    }
    if (kept != nullptr) {
        std::memcpy(dst->data, kept->bytes_of(src), ggml_nbytes(src));
        return true;
    }
    if (src->buffer != nullptr && ggml_backend_buffer_is_host(src->buffer)) {
        std::memcpy(dst->data, src->data, ggml_nbytes(src));
        return true;
    }
    return false;
}

void buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    if (is_weights(buffer)) {
        return;
    }
    auto * ctx = static_cast<PhantomBuffer *>(buffer->context);
    std::memset(ctx->base, value, buffer->size);
}

const ggml_backend_buffer_i kBufferInterface = {
    /* .free_buffer   = */ buffer_free,
    /* .get_base      = */ buffer_get_base,
    /* .init_tensor   = */ nullptr,
    /* .memset_tensor = */ buffer_memset_tensor,
    /* .set_tensor    = */ buffer_set_tensor,
    /* .get_tensor    = */ buffer_get_tensor,
    /* .set_tensor_2d = */ nullptr,
    /* .get_tensor_2d = */ nullptr,
    /* .cpy_tensor    = */ buffer_cpy_tensor,
    /* .clear         = */ buffer_clear,
    /* .reset         = */ nullptr,
};

const char * buft_get_name(ggml_backend_buffer_type_t) { return "LLAMAFLASH"; }

ggml_backend_buffer_t buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    auto * ctx = new PhantomBuffer();
    if (size != 0) {
        const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        ctx->mapped = (size + page - 1) & ~(page - 1);
        ctx->base =
            mmap(nullptr, ctx->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (ctx->base == MAP_FAILED) {
            delete ctx;
            return nullptr;
        }
    } else {
        ctx->base = reinterpret_cast<void *>(kAlignment);  // never dereferenced: zero-sized buffer
    }
    return ggml_backend_buffer_init(buft, kBufferInterface, ctx, size);
}

size_t buft_get_alignment(ggml_backend_buffer_type_t) { return kAlignment; }

bool buft_is_host(ggml_backend_buffer_type_t) { return false; }

ggml_backend_buffer_type kBufferType = {
    /* .iface = */ {
        /* .get_name       = */ buft_get_name,
        /* .alloc_buffer   = */ buft_alloc_buffer,
        /* .get_alignment  = */ buft_get_alignment,
        /* .get_max_size   = */ nullptr,
        /* .get_alloc_size = */ nullptr,
        /* .is_host        = */ buft_is_host,
    },
    /* .device  = */ nullptr,
    /* .context = */ nullptr,
};

}  // namespace

ggml_backend_buffer_type_t phantom_buffer_type(ggml_backend_dev_t device) {
    kBufferType.device = device;
    return &kBufferType;
}

bool is_phantom_buffer_type(ggml_backend_buffer_type_t buft) { return buft == &kBufferType; }

}  // namespace llamaflash
