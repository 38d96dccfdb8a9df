// flash_backend.cpp — see flash_backend.h. Interface slots follow ggml-backend-impl.h
// (GGML_BACKEND_API_VERSION 2); optional slots left null fall back to ggml's defaults.
#include "backend/flash_backend.h"

#include "backend/phantom_buffer.h"
#include "backend/split_executor.h"
#include "backend/weight_registry.h"
#include "ggml-backend-impl.h"

#include <sys/sysinfo.h>
#include <cstring>
#include <mutex>

namespace llamaflash {

namespace {

constexpr const char * kName = "LLAMAFLASH";
constexpr const char * kDescription = "llamaflash sparse FFN engine (sidecar-served FFN layers)";

// ---------------------------------------------------------------------------------------------
// op claiming

// A weight the device serves: bound to a loaded model (by pointer), or — while a model is being
// loaded — a weight in a (dummy) buffer of our type whose name the pending model serves.
// Cheap test first: the scheduler asks about every node of every graph, and only tensors in a buffer
// of our type can be served weights.
bool is_served_weight(const ggml_tensor * w, FfnWeightKind * kind = nullptr) {
    if (w == nullptr || w->buffer == nullptr || !is_phantom_buffer_type(w->buffer->buft)) {
        return false;
    }
    WeightRegistry & registry = WeightRegistry::instance();
    if (const BoundWeight * bound = registry.lookup(w)) {
        if (bound->experts || bound->matmuls) {
            return false;
        }
        if (kind != nullptr) {
            *kind = bound->kind;
        }
        return true;
    }
    int layer;
    FfnWeightKind k;
    if (parse_ffn_weight_name(w->name, &layer, &k) && registry.pending_serves(w->name)) {
        if (kind != nullptr) {
            *kind = k;
        }
        return true;
    }
    return false;
}

// A routed expert tensor (blk.N.ffn_*_exps) the device serves: bound, or named by the pending model.
bool is_served_expert_weight(const ggml_tensor * w, ExpertTensorKind * kind) {
    if (w == nullptr || w->buffer == nullptr || !is_phantom_buffer_type(w->buffer->buft)) {
        return false;
    }
    WeightRegistry & registry = WeightRegistry::instance();
    if (const BoundWeight * bound = registry.lookup(w)) {
        *kind = bound->expert_kind;
        return bound->experts != nullptr && !bound->router;
    }
    int layer;
    return parse_expert_weight_name(w->name, &layer, kind) && registry.pending_serves(w->name);
}

// An MoE layer's router (blk.N.ffn_gate_inp) whose MUL_MAT the device computes row by row
// (ExpertConfig::router_rows): bound, or named by the pending model.
bool is_served_router(const ggml_tensor * w) {
    if (w == nullptr || w->buffer == nullptr || !is_phantom_buffer_type(w->buffer->buft)) {
        return false;
    }
    WeightRegistry & registry = WeightRegistry::instance();
    if (const BoundWeight * bound = registry.lookup(w)) {
        return bound->router;
    }
    int layer;
    return parse_router_weight_name(w->name, &layer) && registry.pending_serves(w->name);
}

// A weight whose MUL_MATs the device computes row by row (matmul_rows.h): bound, or one the pending
// InvariantMatmuls takes.
bool is_invariant_matmul_weight(const ggml_tensor * w) {
    if (w == nullptr || w->buffer == nullptr || !is_phantom_buffer_type(w->buffer->buft)) {
        return false;
    }
    WeightRegistry & registry = WeightRegistry::instance();
    if (const BoundWeight * bound = registry.lookup(w)) {
        return bound->matmuls != nullptr;
    }
    return registry.pending_serves_matmul(w);
}

// An InvariantMatmuls FFN or shared-expert gate or up projection: the element-wise ops after it join
// its split, as for a served FFN.
bool is_invariant_gate_or_up(const ggml_tensor * w) {
    return is_invariant_matmul_weight(w) && invariant_gate_or_up_name(w->name);
}

// The element-wise ops architectures put between the FFN projections: activation, GLU, scaling, bias.
bool is_ffn_elementwise_op(ggml_op op) {
    switch (op) {
        case GGML_OP_GLU:
        case GGML_OP_UNARY:
        case GGML_OP_MUL:
        case GGML_OP_ADD:
        case GGML_OP_SCALE:
        case GGML_OP_CLAMP:
        case GGML_OP_SQR:
        case GGML_OP_DIV:
        case GGML_OP_ADD_ID:  // per-expert biases (gpt-oss)
            return true;
        default: return false;
    }
}

// True if `t` is computed from a served gate/up projection within a few element-wise steps
// (activation, GLU, scaling, bias): the ops between the FFN matmuls. The down projection's output
// and anything after it (residual add, norms) are not claimed.
bool derives_from_ffn_projection(const ggml_tensor * t, int depth) {
    if (t == nullptr || depth > 4) {
        return false;
    }
    if (t->op == GGML_OP_MUL_MAT) {
        FfnWeightKind kind;
        return (is_served_weight(t->src[0], &kind) && kind != FfnWeightKind::down) ||
               is_invariant_gate_or_up(t->src[0]);
    }
    if (t->op == GGML_OP_MUL_MAT_ID) {
        ExpertTensorKind kind;
        return is_served_expert_weight(t->src[0], &kind) && kind != ExpertTensorKind::down;
    }
    if (!is_ffn_elementwise_op(t->op)) {
        return false;
    }
    for (int j = 0; j < GGML_MAX_SRC; ++j) {
        if (derives_from_ffn_projection(t->src[j], depth + 1)) {
            return true;
        }
    }
    return false;
}

bool lives_in_phantom_buffer(const ggml_tensor * t) {
    const ggml_tensor * base = t->view_src != nullptr ? t->view_src : t;
    return base->buffer != nullptr && is_phantom_buffer_type(base->buffer->buft);
}

// The device's claims: the served FFN matmuls and the element-wise ops between them, served routers'
// matmuls, and InvariantMatmuls weights' matmuls (with the element-wise ops between an FFN's gate/up
// and down), nothing else. Each served layer's FFN then arrives as one split (a router: its own).
bool device_supports_op(ggml_backend_dev_t, const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_NONE:  // a weight or tensor stored in our buffers: the scheduler asks for leaves too
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE: return lives_in_phantom_buffer(op);
        case GGML_OP_MUL_MAT:
            return (is_served_weight(op->src[0]) || is_served_router(op->src[0]) ||
                    is_invariant_matmul_weight(op->src[0])) &&
                   op->src[1] != nullptr && op->src[1]->type == GGML_TYPE_F32;
        case GGML_OP_MUL_MAT_ID: {
            ExpertTensorKind kind;
            return is_served_expert_weight(op->src[0], &kind) && op->src[1]->type == GGML_TYPE_F32 &&
                   op->src[2] != nullptr && op->src[2]->type == GGML_TYPE_I32;
        }
        default:
            if (!is_ffn_elementwise_op(op->op) || op->type != GGML_TYPE_F32) {
                return false;
            }
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                if (derives_from_ffn_projection(op->src[j], 1)) {
                    return true;
                }
            }
            return false;
    }
}

// ---------------------------------------------------------------------------------------------
// backend

struct BackendContext {
    SplitExecutor executor;
};

const char * backend_get_name(ggml_backend_t) { return kName; }

void backend_free(ggml_backend_t backend) {
    delete static_cast<BackendContext *>(backend->context);
    delete backend;
}

ggml_status backend_graph_compute(ggml_backend_t backend, ggml_cgraph * cgraph) {
    auto * ctx = static_cast<BackendContext *>(backend->context);
    return ctx->executor.compute(cgraph);
}

const ggml_backend_i kBackendInterface = {
    /* .get_name             = */ backend_get_name,
    /* .free                 = */ backend_free,
    /* .set_tensor_async     = */ nullptr,
    /* .get_tensor_async     = */ nullptr,
    /* .set_tensor_2d_async  = */ nullptr,
    /* .get_tensor_2d_async  = */ nullptr,
    /* .cpy_tensor_async     = */ nullptr,
    /* .synchronize          = */ nullptr,
    /* .graph_plan_create    = */ nullptr,
    /* .graph_plan_free      = */ nullptr,
    /* .graph_plan_update    = */ nullptr,
    /* .graph_plan_compute   = */ nullptr,
    /* .graph_compute        = */ backend_graph_compute,
    /* .event_record         = */ nullptr,
    /* .event_wait           = */ nullptr,
    /* .graph_optimize       = */ nullptr,
};

ggml_guid_t backend_guid() {
    static ggml_guid guid = {0x6c, 0x6c, 0x61, 0x6d, 0x61, 0x66, 0x6c, 0x61,
                             0x73, 0x68, 0x2d, 0x66, 0x66, 0x6e, 0x00, 0x01};
    return &guid;
}

void set_n_threads(ggml_backend_t backend, int n_threads) {
    if (backend->iface.get_name != backend_get_name) {
        return;
    }
    static_cast<BackendContext *>(backend->context)->executor.set_n_threads(n_threads);
}

// ---------------------------------------------------------------------------------------------
// device

const char * device_get_name(ggml_backend_dev_t) { return kName; }

const char * device_get_description(ggml_backend_dev_t) { return kDescription; }

void device_get_memory(ggml_backend_dev_t, size_t * free, size_t * total) {
    struct sysinfo info{};
    sysinfo(&info);
    *total = static_cast<size_t>(info.totalram) * info.mem_unit;
    *free = static_cast<size_t>(info.freeram + info.bufferram) * info.mem_unit;
}

enum ggml_backend_dev_type device_get_type(ggml_backend_dev_t) { return GGML_BACKEND_DEVICE_TYPE_ACCEL; }

void device_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    props->name = kName;
    props->description = kDescription;
    device_get_memory(dev, &props->memory_free, &props->memory_total);
    props->type = GGML_BACKEND_DEVICE_TYPE_ACCEL;
    props->device_id = nullptr;
    props->caps = {
        /* .async                = */ false,
        /* .host_buffer          = */ false,
        /* .buffer_from_host_ptr = */ false,
        /* .events               = */ false,
    };
}

ggml_backend_t device_init_backend(ggml_backend_dev_t dev, const char *) {
    auto * ctx = new BackendContext();
    return new ggml_backend{backend_guid(), kBackendInterface, dev, ctx};
}

ggml_backend_buffer_type_t device_get_buffer_type(ggml_backend_dev_t dev) { return phantom_buffer_type(dev); }

// Our own buffers, and host memory: inputs computed by the CPU backend (the FFN input x, biases) are
// read in place instead of being copied into a llamaflash buffer.
bool device_supports_buft(ggml_backend_dev_t, ggml_backend_buffer_type_t buft) {
    return is_phantom_buffer_type(buft) || ggml_backend_buft_is_host(buft);
}

bool device_offload_op(ggml_backend_dev_t, const ggml_tensor *) { return false; }

const ggml_backend_device_i kDeviceInterface = {
    /* .get_name             = */ device_get_name,
    /* .get_description      = */ device_get_description,
    /* .get_memory           = */ device_get_memory,
    /* .get_type             = */ device_get_type,
    /* .get_props            = */ device_get_props,
    /* .init_backend         = */ device_init_backend,
    /* .get_buffer_type      = */ device_get_buffer_type,
    /* .get_host_buffer_type = */ nullptr,
    /* .buffer_from_host_ptr = */ nullptr,
    /* .supports_op          = */ device_supports_op,
    /* .supports_buft        = */ device_supports_buft,
    /* .offload_op           = */ device_offload_op,
    /* .event_new            = */ nullptr,
    /* .event_free           = */ nullptr,
    /* .event_synchronize    = */ nullptr,
};

// ---------------------------------------------------------------------------------------------
// registry

const char * reg_get_name(ggml_backend_reg_t) { return kName; }

size_t reg_get_device_count(ggml_backend_reg_t) { return 1; }

ggml_backend_dev_t reg_get_device(ggml_backend_reg_t reg, size_t index);

void * reg_get_proc_address(ggml_backend_reg_t, const char * name) {
    if (std::strcmp(name, "ggml_backend_set_n_threads") == 0) {
        return reinterpret_cast<void *>(&set_n_threads);
    }
    return nullptr;
}

const ggml_backend_reg_i kRegInterface = {
    /* .get_name         = */ reg_get_name,
    /* .get_device_count = */ reg_get_device_count,
    /* .get_device       = */ reg_get_device,
    /* .get_proc_address = */ reg_get_proc_address,
};

ggml_backend_reg kReg = {GGML_BACKEND_API_VERSION, kRegInterface, nullptr};
ggml_backend_device kDevice = {kDeviceInterface, &kReg, nullptr};

ggml_backend_dev_t reg_get_device(ggml_backend_reg_t, size_t index) { return index == 0 ? &kDevice : nullptr; }

}  // namespace

ggml_backend_reg_t register_backend() {
    static std::once_flag once;
    std::call_once(once, [] { ggml_backend_register(&kReg); });
    return &kReg;
}

ggml_backend_reg_t backend_reg() { return &kReg; }

}  // namespace llamaflash
