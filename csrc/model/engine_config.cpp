// engine_config.cpp — see engine_config.h.
#include "model/engine_config.h"

#include "lanes/sparse_ffn.h"

#include <set>
#include <stdexcept>

namespace llamaflash {

namespace {

[[noreturn]] void invalid(const std::string & message) { throw std::invalid_argument("llamaflash: " + message); }

std::string layer_name(const LayerSpec & s) { return "layer " + std::to_string(s.layer); }

void validate_layer(const LayerSpec & s) {
    if (s.n_embd <= 0 || s.n_ff <= 0) {
        invalid(layer_name(s) + " has empty FFN shape");
    }
    for (ggml_type t : {s.gate_type, s.up_type, s.down_type, s.down_t_type}) {
        if (t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) <= 0) {
            invalid(layer_name(s) + " has unknown ggml type " + std::to_string(int(t)));
        }
    }
    check_row_bytes(s, s.gate_type, s.n_embd, s.gate_row_bytes, "gate");
    check_row_bytes(s, s.up_type, s.n_embd, s.up_row_bytes, "up");
    check_row_bytes(s, s.down_type, s.n_ff, s.base_down_row_bytes, "base down");
    if (s.bundle_stride < s.gate_row_bytes + s.up_row_bytes) {
        invalid(layer_name(s) + " bundle stride too small");
    }
}

void validate_offload(const EngineConfig & c) {
    const OffloadConfig & o = *c.offload;
    const size_t n = c.layers.size();
    if (o.stream_layers) {
        if (c.sparse.enabled) {
            invalid("offload.stream_layers runs every FFN split on the dense lane: sparse.enabled must be false");
        }
        std::vector<bool> seen(n, false);
        for (int32_t p : o.hot_layers) {
            if (p < 0 || static_cast<size_t>(p) >= n || seen[static_cast<size_t>(p)]) {
                invalid("offload.hot_layers: position " + std::to_string(p) + " is out of range or listed twice");
            }
            seen[static_cast<size_t>(p)] = true;
        }
        if (o.draft_copy) {
            invalid("offload.draft_copy serves the sparse lane's self-drafts: not with stream_layers");
        }
        if (o.cold_slots < 1 + o.prefetch_layers) {
            invalid("offload.cold_slots must be >= 1 + prefetch_layers with stream_layers, got " +
                    std::to_string(o.cold_slots));
        }
    } else if (!c.sparse.enabled) {
        invalid(
            "flash offload needs the sparse lane (sparse.enabled) or whole layers (offload.stream_layers): the "
            "dense lane alone would stream every layer from flash");
    }
    if (o.hot.size() != n || o.cluster_prob.size() != n) {
        invalid("offload.hot and offload.cluster_prob need one entry per served layer (" + std::to_string(n) +
                "), got " + std::to_string(o.hot.size()) + " and " + std::to_string(o.cluster_prob.size()));
    }
    if (o.prefetch_layers < 0) {
        invalid("offload.prefetch_layers must be >= 0, got " + std::to_string(o.prefetch_layers));
    }
    if (o.cold_slots < 1) {
        invalid("offload.cold_slots must be >= 1, got " + std::to_string(o.cold_slots));
    }
    if (o.draft_copy) {
        for (const LayerSpec & s : c.layers) {
            if (s.draft_type == GGML_TYPE_COUNT) {
                invalid("offload.draft_copy: layer " + std::to_string(s.layer) +
                        " has no draft copy in the sidecar "
                        "(convert with --draft-type auto)");
            }
            check_row_bytes(s, s.draft_type, s.n_embd, s.draft_row_bytes, "draft copy");
        }
    }
    if (o.queue_depth < 1) {
        invalid("offload.queue_depth must be >= 1");
    }
    if (o.engine != "auto" && o.engine != "io_uring" && o.engine != "pool") {
        invalid("offload.engine must be 'auto', 'io_uring' or 'pool', got '" + o.engine + "'");
    }
}

}  // namespace

void check_row_bytes(const LayerSpec & s, ggml_type type, int64_t n, uint64_t row_bytes, const char * what) {
    const size_t expect = ggml_row_size(type, n);
    if (expect != row_bytes) {
        invalid(layer_name(s) + " " + what + " row is " + std::to_string(row_bytes) + " bytes in the sidecar, but a " +
                ggml_type_name(type) + " row of " + std::to_string(n) + " values is " + std::to_string(expect) +
                " bytes; the sidecar does not match this model: re-convert it");
    }
}

void validate_sparse_config(const SparseConfig & c) {
    if (c.max_tokens < 1 || c.cluster_size < 1 || c.cluster_size > 256) {
        invalid("sparse max_tokens must be >= 1 and cluster_size in 1..256, got " + std::to_string(c.max_tokens) +
                " and " + std::to_string(c.cluster_size));
    }
}

void EngineConfig::validate() const {
    if (sidecar_path.empty() || base_path.empty()) {
        invalid("sidecar_path and base_path must be set");
    }
    if (layers.empty()) {
        invalid("no served layers");
    }
    std::set<int> seen;
    for (const LayerSpec & s : layers) {
        if (!seen.insert(s.layer).second) {
            invalid(layer_name(s) + " listed twice");
        }
        validate_layer(s);
    }
    try {
        (void)parse_ffn_activation(activation);
    } catch (const std::exception &) {
        invalid("activation must be 'silu', 'gelu' or 'relu', got '" + activation + "'");
    }
    validate_sparse_config(sparse);
    if (offload) {
        validate_offload(*this);
    }
}

}  // namespace llamaflash
