"""The llamaflash sidecar format: every constant, key and tensor name, in one place.

This module is the single source of truth for the on-disk format described in
``docs/SIDECAR.md``. No other module spells a metadata key or a tensor name; they
import it from here. It holds constants and pure name-building functions only.

A sidecar (``<model>.flash.gguf``) is a GGUF file whose ``general.architecture`` is
:data:`SIDECAR_ARCHITECTURE`. It belongs to exactly one base model GGUF, identified by
:data:`KEY_BASE_IDENTITY`, and holds, per served layer ``L``, the FFN weights
re-laid out neuron-major (see :func:`bundle_tensor_name`, :func:`down_t_tensor_name`,
:func:`order_tensor_name`).
"""

from __future__ import annotations

import math

import re

# --------------------------------------------------------------------------------------
# Versioning
# --------------------------------------------------------------------------------------

#: Format version written by this converter.
FORMAT_VERSION = 1

#: Format versions this reader understands. A file with any other version is refused
#: (re-convert it); versions are never guessed or partially read.
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1,)

#: Version string of the converter, stored in :data:`KEY_CONVERTER_VERSION` (informative only).
CONVERTER_VERSION = "llamaflash-converter 1"

# --------------------------------------------------------------------------------------
# File-level constants
# --------------------------------------------------------------------------------------

#: ``general.architecture`` of every sidecar.
SIDECAR_ARCHITECTURE = "llamaflash"

#: ``general.alignment`` of every sidecar: each tensor's data starts on a 4 KiB boundary
#: (absolute file offset), so it can be read with O_DIRECT.
SIDECAR_ALIGNMENT = 4096

def bundle_stride(gate_row_bytes: int, up_row_bytes: int, gate_block_bytes: int, up_block_bytes: int) -> int:
    """Bytes per bundle row: gate row + up row, zero padded to a multiple of both types' block sizes.

    A run of bundles viewed with row stride ``bundle_stride`` is then a valid ggml matrix of the gate
    (or up) type: ggml's kernels address row r at ``r * nb[1]`` and its blocked matrix kernels need
    ``nb[1]`` to be a whole number of blocks. With equal gate/up types there is no padding.
    """
    unit = math.lcm(gate_block_bytes, up_block_bytes)
    raw = gate_row_bytes + up_row_bytes
    return (raw + unit - 1) // unit * unit

#: File name suffix of a sidecar; ``model.gguf`` → ``model.flash.gguf``.
SIDECAR_SUFFIX = ".flash.gguf"

#: File name suffix of a base model.
BASE_MODEL_SUFFIX = ".gguf"

#: Number of leading data bytes of each base ``ffn_gate`` tensor hashed into the identity.
IDENTITY_GATE_PREFIX_BYTES = 4096

#: Stored-down requantization: Q8_0 when n_embd is a multiple of this, otherwise F16.
DOWN_T_Q8_0_BLOCK = 32

# --------------------------------------------------------------------------------------
# Standard GGUF keys (read from base models, written to sidecars)
# --------------------------------------------------------------------------------------

GENERAL_ARCHITECTURE = "general.architecture"
GENERAL_ALIGNMENT = "general.alignment"
GENERAL_NAME = "general.name"


def base_block_count_key(arch: str) -> str:
    """Base-model key holding the number of transformer blocks, e.g. ``llama.block_count``."""
    return f"{arch}.block_count"


def base_embedding_length_key(arch: str) -> str:
    """Base-model key holding n_embd, e.g. ``llama.embedding_length``."""
    return f"{arch}.embedding_length"


# --------------------------------------------------------------------------------------
# llamaflash metadata keys
# --------------------------------------------------------------------------------------

KEY_PREFIX = "llamaflash."

#: uint32: the sidecar format version.
KEY_FORMAT_VERSION = KEY_PREFIX + "format_version"
#: string: :func:`llamaflash.gguf_model.base_identity` of the base model.
KEY_BASE_IDENTITY = KEY_PREFIX + "base.identity"
#: string: ``general.architecture`` of the base model.
KEY_BASE_ARCHITECTURE = KEY_PREFIX + "base.architecture"
#: string: ``general.name`` of the base model ("" when it has none).
KEY_BASE_NAME = KEY_PREFIX + "base.name"
#: uint64: size in bytes of the base model file.
KEY_BASE_FILE_SIZE = KEY_PREFIX + "base.file_size"
#: string: one of :data:`ACTIVATIONS`; the gate activation of the gated FFN.
KEY_FFN_ACTIVATION = KEY_PREFIX + "ffn.activation"
#: uint32 array: indices of the served layers, strictly increasing.
KEY_LAYERS = KEY_PREFIX + "layers"
#: uint32: embedding width of the base model.
KEY_N_EMBD = KEY_PREFIX + "n_embd"
#: uint32 array (one per served layer): FFN width.
KEY_N_FF = KEY_PREFIX + "n_ff"
#: uint32 array (one per served layer): ggml type id of the base ``ffn_gate`` (kept in the bundle).
KEY_GATE_TYPES = KEY_PREFIX + "gate_types"
#: uint32 array (one per served layer): ggml type id of the base ``ffn_up`` (kept in the bundle).
KEY_UP_TYPES = KEY_PREFIX + "up_types"
#: uint32 array (one per served layer): ggml type id of the base ``ffn_down``.
KEY_DOWN_TYPES = KEY_PREFIX + "down_types"
#: uint32 array (one per served layer): ggml type id of the stored ``ffn_down_t``.
KEY_DOWN_T_TYPES = KEY_PREFIX + "down_t_types"
#: uint32 array (one per served layer): bytes per bundle row.
KEY_BUNDLE_STRIDES = KEY_PREFIX + "bundle_strides"
#: string: :data:`CONVERTER_VERSION` of the converter that wrote the file.
KEY_CONVERTER_VERSION = KEY_PREFIX + "converter.version"

#: Per-served-layer uint32 array keys; each has exactly ``len(layers)`` entries.
PER_LAYER_ARRAY_KEYS: tuple[str, ...] = (
    KEY_N_FF,
    KEY_GATE_TYPES,
    KEY_UP_TYPES,
    KEY_DOWN_TYPES,
    KEY_DOWN_T_TYPES,
    KEY_BUNDLE_STRIDES,
)

# --------------------------------------------------------------------------------------
# Activations and supported base architectures
# --------------------------------------------------------------------------------------

ACTIVATION_SILU = "silu"
#: ggml's ``gelu`` (tanh approximation), as used by llama.cpp's GeGLU FFNs.
ACTIVATION_GELU = "gelu"
ACTIVATION_RELU = "relu"
ACTIVATIONS = frozenset({ACTIVATION_SILU, ACTIVATION_GELU, ACTIVATION_RELU})

#: Base architectures whose dense FFN llama.cpp builds as ``down(act(gate(x)) * up(x))``
#: from tensors ``blk.N.ffn_gate.weight``, ``blk.N.ffn_up.weight``, ``blk.N.ffn_down.weight``
#: (checked against llama.cpp's ``src/models/*.cpp`` shipped with llama-cpp-python 0.3.36),
#: mapped to the gate activation. Mistral-7B-style models use arch "llama".
SUPPORTED_BASE_ARCHITECTURES: dict[str, str] = {
    "llama": ACTIVATION_SILU,
    "mistral3": ACTIVATION_SILU,
    "qwen2": ACTIVATION_SILU,
    "qwen3": ACTIVATION_SILU,
    "gemma": ACTIVATION_GELU,
    "gemma2": ACTIVATION_GELU,
    "gemma3": ACTIVATION_GELU,
}

# --------------------------------------------------------------------------------------
# Base-model tensor names
# --------------------------------------------------------------------------------------


def base_ffn_gate_name(layer: int) -> str:
    """Name of the base model's gate projection of ``layer`` (ggml ne = [n_embd, n_ff])."""
    return f"blk.{layer}.ffn_gate.weight"


def base_ffn_up_name(layer: int) -> str:
    """Name of the base model's up projection of ``layer`` (ggml ne = [n_embd, n_ff])."""
    return f"blk.{layer}.ffn_up.weight"


def base_ffn_down_name(layer: int) -> str:
    """Name of the base model's down projection of ``layer`` (ggml ne = [n_ff, n_embd])."""
    return f"blk.{layer}.ffn_down.weight"


def base_ffn_extra_names(layer: int) -> tuple[str, ...]:
    """Names of optional FFN bias/scale tensors of ``layer``.

    A layer carrying any of these is not served by format v1 (the sidecar has no place
    for them); it stays with llama.cpp.
    """
    return tuple(
        f"blk.{layer}.ffn_{proj}.{suffix}"
        for proj in ("gate", "up", "down")
        for suffix in ("bias", "scale")
    )


#: Matches a base ``ffn_gate`` weight name; group 1 is the layer index.
BASE_FFN_GATE_NAME_RE = re.compile(r"^blk\.(\d+)\.ffn_gate\.weight$")

# --------------------------------------------------------------------------------------
# Sidecar tensor names
# --------------------------------------------------------------------------------------


def bundle_tensor_name(layer: int) -> str:
    """Name of layer ``layer``'s bundle: GGUF type I8, numpy shape (n_ff, bundle_stride).

    Row k = bytes of base gate row order[k], then bytes of base up row order[k], zero
    padded to bundle_stride.
    """
    return f"blk.{layer}.ffn_bundle"


def down_t_tensor_name(layer: int) -> str:
    """Name of layer ``layer``'s transposed down: logical numpy shape (n_ff, n_embd).

    Row k = base down column order[k], requantized to Q8_0 (or F16).
    """
    return f"blk.{layer}.ffn_down_t"


def order_tensor_name(layer: int) -> str:
    """Name of layer ``layer``'s neuron order: I32, shape (n_ff,); order[k] = base neuron index."""
    return f"blk.{layer}.ffn_order"
