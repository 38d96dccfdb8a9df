"""The keys of the plan file (docs/TOOLS.md, "The plan file"): the one source of truth for Python
(:mod:`llamaflash.files.plan_file` writes them with gguf-py) and C++ (csrc/backend/plan_reader.cpp
reads them with ggml's gguf.h, through the header this file generates at build time:
``python plan_keys.py OUT.h``). Standard library only, so the build can run it by path.

A plan file is a GGUF with key-value pairs and no tensors. Scalars are one value; per-layer fields are
arrays with one entry per served layer (in the engine configuration's layer order); ragged per-layer
lists are one flat array plus a ``*_counts`` array (entries per layer, in order); GGUF has no empty
arrays, so a flat array whose counts are all 0 is absent.
"""

from __future__ import annotations

import sys

#: Incremented whenever a key's meaning or type changes; the library refuses any other version.
FORMAT_VERSION = 4

P = "llamaflash.plan."

# -- identity: what the plan was made for ---------------------------------------------------------
FORMAT = P + "format_version"  # uint32: FORMAT_VERSION
KIND = P + "kind"  # string: KIND_DENSE | KIND_EXPERTS
MODE = P + "mode"  # string: "dense" | "sparse" | "offload" | "experts" (what flash_stats reports)
REASON = P + "reason"  # string: why this plan (the planner's decision, for the library's log line)
GGML_COMMIT = P + "ggml_commit"  # string: ggml_commit() of the llama_cpp the plan was made with
GGML_VERSION = P + "ggml_version"  # string: ggml_version() of it
MODEL_PATH = P + "model.path"  # string: absolute path of the base model
MODEL_SIZE = P + "model.size"  # uint64: its size in bytes when planned
MODEL_MTIME_NS = P + "model.mtime_ns"  # uint64: its modification time (ns) when planned
SIDECAR_PATH = P + "sidecar.path"  # string: absolute path of the sidecar
SIDECAR_SIZE = P + "sidecar.size"  # uint64
SIDECAR_MTIME_NS = P + "sidecar.mtime_ns"  # uint64
RAM_BUDGET_MB = P + "ram_budget_mb"  # float32: the budget planned for; 0 = in memory
N_CTX = P + "n_ctx"  # uint32: context size the plan counted (the tools' -c)
N_BATCH = P + "n_batch"  # uint32: the tools' -b the plan counted
N_UBATCH = P + "n_ubatch"  # uint32: the tools' -ub the plan counted
TOOL_ARGS = P + "tool_args"  # string: the llama.cpp tool flags the plan assumes (printed by `env`)

KIND_DENSE = "dense"
KIND_EXPERTS = "experts"

# -- dense FFN models: EngineConfig (csrc/model/engine_config.h) ----------------------------------
ENGINE_ACTIVATION = P + "engine.activation"  # string
ENGINE_VERIFY = P + "engine.verify"  # bool
ENGINE_REPACK = P + "engine.repack"  # bool
SPARSE_ENABLED = P + "sparse.enabled"  # bool
SPARSE_MAX_TOKENS = P + "sparse.max_tokens"  # int64
SPARSE_CLUSTER_SIZE = P + "sparse.cluster_size"  # int32
SPARSE_UP_BY_GGML = P + "sparse.up_by_ggml"  # bool
OFFLOAD = P + "offload.enabled"  # bool: the OffloadConfig below is present
OFFLOAD_STREAM_GATE = P + "offload.stream_gate"  # bool
OFFLOAD_COLD_SLOTS = P + "offload.cold_slots"  # int64
OFFLOAD_PREFETCH_LAYERS = P + "offload.prefetch_layers"  # int32
OFFLOAD_PREFETCH_MIN_PROB = P + "offload.prefetch_min_prob"  # float32
OFFLOAD_QUEUE_DEPTH = P + "offload.queue_depth"  # uint32
OFFLOAD_DIRECT = P + "offload.direct"  # bool
OFFLOAD_ENGINE = P + "offload.engine"  # string
OFFLOAD_DRAFT_COPY = P + "offload.draft_copy"  # bool
OFFLOAD_STREAM_LAYERS = P + "offload.stream_layers"  # bool
OFFLOAD_HOT_LAYERS = P + "offload.hot_layers"  # int64 array: the layer positions pinned
OFFLOAD_HOT = P + "offload.hot"  # int32 array, flat
OFFLOAD_HOT_COUNTS = P + "offload.hot_counts"  # int64 array, per layer
OFFLOAD_CLUSTER_PROB = P + "offload.cluster_prob"  # float32 array, flat
OFFLOAD_CLUSTER_PROB_COUNTS = P + "offload.cluster_prob_counts"  # int64 array, per layer

#: LayerSpec fields stored as int64 arrays, one entry per served layer: key LAYER + field
LAYER = P + "layer."
#: the LayerSpec fields a sidecar's LayerLayout gives (plugin/runtime/engine.py fills them from it)
LAYER_LAYOUT_FIELDS = (
    "layer",
    "n_embd",
    "n_ff",
    "gate_type",
    "up_type",
    "down_type",
    "down_t_type",
    "gate_row_bytes",
    "up_row_bytes",
    "bundle_offset",
    "bundle_stride",
    "down_t_offset",
    "down_t_row_bytes",
    "order_offset",
    "base_down_offset",
    "base_down_row_bytes",
    "base_up_offset",
    "base_gate_offset",
)
LAYER_INT_FIELDS = LAYER_LAYOUT_FIELDS + (
    "draft_type",
    "draft_row_bytes",
    "draft_up_offset",
    "draft_down_t_offset",
    "draft_checksum_offset",
    "checksum_offset",
    "base_down_checksum_offset",
)
#: LayerSpec fields stored as float32 arrays
LAYER_FLOAT_FIELDS = ("threshold",)
#: LayerSpec fields stored as string arrays
LAYER_STR_FIELDS = (
    "draft_up_name",
    "draft_down_t_name",
    "bundle_name",
    "down_t_name",
    "base_gate_name",
    "base_up_name",
    "base_down_name",
)

# -- MoE models: ExpertConfig (csrc/experts/expert_cache.h) ---------------------------------------
EXPERTS_N_EMBD = P + "experts.n_embd"  # int64
EXPERTS_IO_ENGINE = P + "experts.io_engine"  # string
EXPERTS_QUEUE_DEPTH = P + "experts.queue_depth"  # uint32
EXPERTS_DIRECT = P + "experts.direct"  # bool
EXPERTS_VERIFY = P + "experts.verify"  # bool
EXPERTS_PREFETCH = P + "experts.prefetch"  # bool
EXPERTS_OVERLAP = P + "experts.overlap"  # bool
EXPERTS_ROUTER_ROWS = P + "experts.router_rows"  # bool: the library computes the routers' MUL_MATs row by row
# per served MoE layer (int64 arrays)
EXPERTS_LAYER = P + "experts.layer"
EXPERTS_N_EXPERT = P + "experts.n_expert"
EXPERTS_N_USED = P + "experts.n_used"
EXPERTS_N_SLOTS = P + "experts.n_slots"
EXPERTS_PINNED = P + "experts.pinned"  # int32, flat
EXPERTS_PINNED_COUNTS = P + "experts.pinned_counts"
# the layer's router ffn_gate_inp in the base file (read as f32 by the library); offset -1: none
EXPERTS_ROUTER_OFFSET = P + "experts.router_offset"
EXPERTS_ROUTER_TYPE = P + "experts.router_type"
EXPERTS_TENSOR_COUNTS = P + "experts.tensor_counts"  # tensors per layer (2 or 3)
# per expert tensor, flat over layers in order (int64 arrays)
EXPERTS_TENSOR_KIND = P + "experts.tensor.kind"  # ExpertTensorKind: gate 0, up 1, down 2, gate_up 3
EXPERTS_TENSOR_OFFSET = P + "experts.tensor.offset"
EXPERTS_TENSOR_TYPE = P + "experts.tensor.type"
EXPERTS_TENSOR_NE0 = P + "experts.tensor.ne0"
EXPERTS_TENSOR_NE1 = P + "experts.tensor.ne1"
EXPERTS_TENSOR_EXPERT_BYTES = P + "experts.tensor.expert_bytes"
EXPERTS_TENSOR_CHECKSUMS = P + "experts.tensor.checksums"  # uint32, flat: n_expert per tensor, or none
EXPERTS_TENSOR_CHECKSUM_COUNTS = P + "experts.tensor.checksum_counts"
# the dense part locked in RAM after load (expert_runtime.dense_ranges): file ranges [offset,
# offset + size) of the base model, page-aligned, sorted (int64 arrays, one entry per range)
EXPERTS_LOCK_OFFSET = P + "experts.lock.offset"
EXPERTS_LOCK_SIZE = P + "experts.lock.size"

# -- environment variables the library reads ------------------------------------------------------
ENV_PLAN = "LLAMAFLASH_PLAN"  # path of the plan file
#: tests only: the ggml commit the library expects instead of the one it was compiled against
ENV_EXPECT_GGML_COMMIT = "LLAMAFLASH_EXPECT_GGML_COMMIT"

#: the plan file's name beside the sidecar: <sidecar name without .gguf>.plan.gguf
PLAN_SUFFIX = ".plan.gguf"


def _constants() -> list[tuple[str, object]]:
    return [(k, v) for k, v in globals().items() if k.isupper() and not k.startswith("_")]


def cxx_header() -> str:
    """The C++ header with every constant above (namespace llamaflash::plan_keys)."""
    lines = [
        "// Generated by plugin/files/plan_keys.py at build time: do not edit.",
        "#pragma once",
        "#include <cstdint>",
        "namespace llamaflash::plan_keys {",
    ]
    for name, value in _constants():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            lines.append(f"constexpr int64_t {name} = {value};")
        elif isinstance(value, str):
            lines.append(f'constexpr const char * {name} = "{value}";')
        elif isinstance(value, tuple):
            items = ", ".join(f'"{v}"' for v in value)
            lines.append(f"constexpr const char * {name}[] = {{{items}}};")
    lines.append("}  // namespace llamaflash::plan_keys")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = cxx_header()
    try:
        with open(sys.argv[1]) as f:
            if f.read() == text:
                sys.exit(0)  # unchanged: keep its timestamp, nothing recompiles
    except OSError:
        pass
    with open(sys.argv[1], "w") as f:
        f.write(text)
