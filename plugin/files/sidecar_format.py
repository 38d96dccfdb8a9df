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

#: Format version written by this converter. Version 2 adds the sparsity content (per-layer
#: thresholds, neuron statistics, quality record; also a selection mode and activation predictors, since
#: retired and ignored by this reader); version 3
#: makes the integrity section (row checksums, below) required. Version 1 and 2 files are still read.
FORMAT_VERSION = 3

#: Format versions this reader understands. A file with any other version is refused
#: (re-convert it); versions are never guessed or partially read.
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (1, 2, 3)

#: First format version that carries the sparsity content (required keys and tensors below).
SPARSITY_FORMAT_VERSION = 2

#: Version string of the converter, stored in :data:`KEY_CONVERTER_VERSION` (informative only).
CONVERTER_VERSION = "llamaflash-converter 2"

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

#: What the converter may store as ``ffn_down_t`` (its ``down_t_type`` choices): "auto" (the
#: default: Q4_K where its 256-value blocks divide n_embd, else as "q8_0"; measured on
#: Qwen2.5-Coder-1.5B at sparsity 0.3: perplexity +0.5% vs stock against -1.3% for Q8_0, teacher-
#: forced top-1 agreement 83.3% against 87.6%, and 47% fewer down_t bytes: in-memory FFN 7% faster,
#: flash offload 3.1 instead of 2.0 tok/s at 900 MiB; the converter's quality measurement runs with
#: the stored type, and its +2% budget then stops at sparsity 0.2 instead of 0.3), "q8_0" (Q8_0
#: where its blocks divide n_embd, else F16; near-lossless), "base" (the base down's own type when
#: its blocks divide n_embd, e.g. Q4_K/Q6_K), or a ggml type name. Every type but Q8_0 quantizes
#: already quantized weights a second time.
DOWN_T_CHOICES = ("auto", "q8_0", "base", "f16", "q6_k", "q5_k", "q4_k", "q5_0", "q4_1", "q4_0")
DEFAULT_DOWN_T = "auto"

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
#: string: :func:`llamaflash.files.gguf_model.base_identity` of the base model.
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
    return tuple(f"blk.{layer}.ffn_{proj}.{suffix}" for proj in ("gate", "up", "down") for suffix in ("bias", "scale"))


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


# --------------------------------------------------------------------------------------
# Format v2: sparsity content (thresholds, statistics, quality)
# --------------------------------------------------------------------------------------
#
# Neuron k of a served layer (bundle position k, base neuron order[k]) is *inactive* for a
# token with FFN input x when |act(gate_k · x)| <= threshold (criterion
# :data:`CRITERION_ACT_GATE`, CATS). For ReLU models a threshold of 0 is the exact zero
# pattern. Skipping inactive neurons is what the sparse engine does; the converter chose the
# thresholds for the target sparsity and measured what it costs.

#: string: the inactivity criterion; today always :data:`CRITERION_ACT_GATE`.
KEY_SPARSITY_CRITERION = KEY_PREFIX + "sparsity.criterion"
#: float32: target sparsity the thresholds were calibrated for (fraction of neurons inactive).
KEY_SPARSITY_TARGET = KEY_PREFIX + "sparsity.target"
#: string: the order of the bundles: :data:`BUNDLE_ORDER_BASE` (identity ``ffn_order``) or
#: :data:`BUNDLE_ORDER_HOT` (most frequently active neuron first).
KEY_BUNDLE_ORDER = KEY_PREFIX + "bundle_order"
#: string: how the target was chosen: :data:`SPARSITY_METHOD_FIXED` or :data:`SPARSITY_METHOD_AUTO`.
KEY_SPARSITY_METHOD = KEY_PREFIX + "sparsity.method"
#: float32: quality budget of ``--sparsity auto`` (relative perplexity increase allowed, 0.02 = +2%).
KEY_QUALITY_BUDGET = KEY_PREFIX + "sparsity.quality_budget"

#: float32 array (per served layer): threshold on |act(gate·x)|; neuron inactive when <= it.
KEY_THRESHOLDS = KEY_PREFIX + "thresholds"
#: float32 array (per served layer): sparsity reached with that threshold on held-out calibration tokens.
KEY_SPARSITY_REACHED = KEY_PREFIX + "sparsity_reached"
#: float32 array (per served layer): relative L2 error of the FFN output y with inactive neurons
#: skipped (gate-first, exact selection), on held-out calibration tokens.
KEY_FFN_REL_ERROR = KEY_PREFIX + "ffn_rel_error"

#: Optional (written by converters since 0.3; absent in older format-2 files): the thresholds for
#: every analysed sparsity level, so the engine can run any of them (``flash_sparsity=``) and the
#: converter can measure the curve with the real sparse computation.
#: float32 array: the sparsity levels (increasing, each in (0, 1)).
KEY_THRESHOLD_LEVELS = KEY_PREFIX + "threshold_levels"
#: float32 array of len(layers) × len(levels), layer-major (served layers in ``KEY_LAYERS`` order):
#: the threshold of each layer at each level.
KEY_THRESHOLD_TABLE = KEY_PREFIX + "threshold_table"

#: uint32: calibration tokens profiled; string: where the calibration text came from.
KEY_CALIB_TOKENS = KEY_PREFIX + "calibration.tokens"
KEY_CALIB_SOURCE = KEY_PREFIX + "calibration.source"
#: string: sha256 of the calibration text (UTF-8) actually used.
KEY_CALIB_SHA256 = KEY_PREFIX + "calibration.sha256"

# Quality record (all optional): perplexity on validation text and greedy agreement with stock,
# under ``llamaflash.quality.<method>.<field>`` (:func:`quality_key`). The method says what
# computed the sparse model:
#   "engine":   llamaflash's own sparse lane inside llama.cpp (``flash_mode="sparse"``, every
#               token of every evaluated batch through the sparse kernel), i.e. what decode runs;
#   "emulated": stock llama.cpp with an eval callback zeroing the skipped neurons' activations
#               before the down projection (base down weights). Read only: older converters
#               wrote it (all files from before the engine measurement, and the retired
#               ``--quality-method emulated``); this converter writes "engine".
# A converter writes one method's keys; a reader takes the first method present in
# QUALITY_METHODS order.

QUALITY_METHOD_ENGINE = "engine"
#: Read only (see above): kept so that files and reports with this record still read.
QUALITY_METHOD_EMULATED = "emulated"
#: Quality methods, in the order a reader prefers them.
QUALITY_METHODS: tuple[str, ...] = (QUALITY_METHOD_ENGINE, QUALITY_METHOD_EMULATED)
#: How reports and ``llamaflash inspect`` describe each method.
QUALITY_METHOD_LABELS: dict[str, str] = {
    QUALITY_METHOD_ENGINE: "measured with the sparse engine",
    QUALITY_METHOD_EMULATED: "EMULATED in stock llama.cpp",
}

#: string: validation text used for perplexity (never the calibration text).
QUALITY_VALIDATION = "validation"
#: uint32: validation tokens scored.
QUALITY_VALIDATION_TOKENS = "validation_tokens"
#: float32: perplexity of the dense model (stock llama.cpp) on the validation text.
QUALITY_PPL_DENSE = "ppl_dense"
#: float32: perplexity at the chosen operating point.
QUALITY_PPL = "ppl"
#: float32: teacher-forced greedy agreement with stock at the chosen point (fraction of tokens).
QUALITY_GREEDY = "greedy_agreement"
#: float32 (optional, converters since the engine measurement): measured fraction of FFN neurons
#: computed per token at the chosen point (engine: the sparse lane's counters, mean over served
#: layers; emulated: 1 - fraction of activations zeroed).
QUALITY_ACTIVE_FRACTION = "active_fraction"
#: float32 arrays (same length): the sparsity/quality curve (gate-first selection).
QUALITY_CURVE_SPARSITY = "curve_sparsity"
QUALITY_CURVE_PPL = "curve_ppl"
QUALITY_CURVE_GREEDY = "curve_greedy_agreement"
#: float32 array (optional, as QUALITY_ACTIVE_FRACTION): measured active fraction at each level.
QUALITY_CURVE_ACTIVE_FRACTION = "curve_active_fraction"

QUALITY_STRING_FIELDS: tuple[str, ...] = (QUALITY_VALIDATION,)
QUALITY_UINT_FIELDS: tuple[str, ...] = (QUALITY_VALIDATION_TOKENS,)
QUALITY_FLOAT_FIELDS: tuple[str, ...] = (QUALITY_PPL_DENSE, QUALITY_PPL, QUALITY_GREEDY, QUALITY_ACTIVE_FRACTION)
QUALITY_ARRAY_FIELDS: tuple[str, ...] = (
    QUALITY_CURVE_SPARSITY,
    QUALITY_CURVE_PPL,
    QUALITY_CURVE_GREEDY,
    QUALITY_CURVE_ACTIVE_FRACTION,
)


def quality_key(method: str, name: str) -> str:
    """The key of quality field ``name`` measured by ``method``, e.g.
    ``quality_key("engine", "ppl")`` → ``llamaflash.quality.engine.ppl``."""
    if method not in QUALITY_METHODS:
        raise ValueError(f"unknown quality method {method!r}; use one of {', '.join(QUALITY_METHODS)}")
    if name not in QUALITY_STRING_FIELDS + QUALITY_UINT_FIELDS + QUALITY_FLOAT_FIELDS + QUALITY_ARRAY_FIELDS:
        raise ValueError(f"unknown quality field {name!r}")
    return f"{KEY_PREFIX}quality.{method}.{name}"


#: Keys a version-2 sidecar must have (scalars and per-layer arrays).
V2_REQUIRED_STRING_KEYS: tuple[str, ...] = (KEY_SPARSITY_CRITERION, KEY_SPARSITY_METHOD, KEY_BUNDLE_ORDER)
V2_REQUIRED_FLOAT_KEYS: tuple[str, ...] = (KEY_SPARSITY_TARGET,)
V2_PER_LAYER_FLOAT_KEYS: tuple[str, ...] = (KEY_THRESHOLDS, KEY_SPARSITY_REACHED, KEY_FFN_REL_ERROR)

# Retired: selection mode and low-rank activation predictors. Formats 2 and 3 require these
# per-layer arrays, and older converters stored predictor tensors ``blk.L.ffn_pred_in`` /
# ``blk.L.ffn_pred_out`` beside them. The engine selects gate-first and never read either.
# This converter writes the arrays with the values of "gate-first, no predictor"
# (:data:`LEGACY_SELECTION_VALUES`), so that older llamaflash versions read its files, and no
# predictor tensors; this reader ignores the arrays and the tensors, whatever they hold.
#: uint32 array (per served layer): selection code (0 = gate-first, 1 = predictor-first).
KEY_SELECTION = KEY_PREFIX + "selection"
#: uint32 array (per served layer): predictor rank r (0 = no predictor).
KEY_PRED_RANKS = KEY_PREFIX + "pred_ranks"
#: float32 arrays (per served layer): predictor threshold, recall and precision.
KEY_PRED_THRESHOLDS = KEY_PREFIX + "pred_thresholds"
KEY_PRED_RECALL = KEY_PREFIX + "pred_recall"
KEY_PRED_PRECISION = KEY_PREFIX + "pred_precision"
LEGACY_PER_LAYER_UINT_KEYS: tuple[str, ...] = (KEY_SELECTION, KEY_PRED_RANKS)
#: What this converter writes into each served layer's entry of the retired arrays.
LEGACY_SELECTION_VALUES: dict[str, int | float] = {
    KEY_SELECTION: 0,
    KEY_PRED_RANKS: 0,
    KEY_PRED_THRESHOLDS: 0.0,
    KEY_PRED_RECALL: 0.0,
    KEY_PRED_PRECISION: 0.0,
}

#: The criterion: neuron k inactive when |act(gate_k·x)| <= threshold (CATS, arXiv 2404.08763).
CRITERION_ACT_GATE = "act_gate"
CRITERIA = frozenset({CRITERION_ACT_GATE})

#: Bundle orders. "base": bundle k = base neuron k (the dense lane maps such bundles in place).
#: "hot": hot-first, ``ffn_freq`` non-increasing (the flash engine's hot set is a prefix; the dense
#: lane of this version must copy gate/up back into base order for it).
BUNDLE_ORDER_BASE = "base"
BUNDLE_ORDER_HOT = "hot"
BUNDLE_ORDERS = frozenset({BUNDLE_ORDER_BASE, BUNDLE_ORDER_HOT})

SPARSITY_METHOD_FIXED = "fixed"
SPARSITY_METHOD_AUTO = "auto"
SPARSITY_METHODS = frozenset({SPARSITY_METHOD_FIXED, SPARSITY_METHOD_AUTO})

#: Gate-first selection, the engine's only one: compute gate·x for every neuron (gate rows
#: resident), then up/down of the active ones only (exact).
SELECTION_GATE = "gate"


def freq_tensor_name(layer: int) -> str:
    """Per-neuron activation frequency, F32 shape (n_ff,), in bundle order (non-increasing when the
    bundle order is "hot").

    Entry k = fraction of calibration tokens for which neuron order[k] is active at the layer's threshold.
    """
    return f"blk.{layer}.ffn_freq"


def magnitude_tensor_name(layer: int) -> str:
    """Per-neuron mean activation magnitude, F32 shape (n_ff,), in bundle order:
    mean over calibration tokens of |act(gate_k·x) · (up_k·x)| (the neuron's coefficient on its down column)."""
    return f"blk.{layer}.ffn_mag"


# --------------------------------------------------------------------------------------
# Optional: the draft copy (a compact low-bit copy of every neuron's up and down_t rows)
# --------------------------------------------------------------------------------------
#
# Under a RAM budget most up/down_t rows live on flash, so a speculative self-draft that must never
# wait for flash can use only what is resident. The draft copy gives it every neuron, at fewer bits:
# per served layer, the up rows and the down_t rows requantized to a compact type (Q2_K by
# default), in bundle order, kept resident by the engine when the planner gives it room. Drafting
# with it selects neurons with the resident gate exactly as the exact lane does (|act(gate_k·x)| >
# threshold), then computes h_k = act(g_k)·(up'_k·x) and y = Σ h_k·down_t'_k from the copy. Only
# drafts use it: verified tokens never do, so it costs no quality, only memory and conversion time.
# Present in a file of format 2 or later exactly when KEY_DRAFT_TYPES is.

#: uint32 array (per served layer): ggml type id of the draft copy's rows (both tensors).
KEY_DRAFT_TYPES = KEY_PREFIX + "draft_types"

#: What the converter may store as the draft copy (``--draft-type``): "auto" (Q2_K where its
#: 256-value blocks divide n_embd, else Q4_0 where 32 does, else none), "none" (no draft copy), or a
#: type name. K-quants need n_embd divisible by 256, Q4_0 by 32; a type that does not divide n_embd
#: is refused by name.
DRAFT_CHOICES = ("auto", "none", "q2_k", "q3_k", "q4_k", "q4_0")
DEFAULT_DRAFT = "auto"


def draft_up_tensor_name(layer: int) -> str:
    """Name of layer ``layer``'s draft up rows: type ``draft_types[L]``, logical numpy shape
    (n_ff, n_embd); row k = base up row order[k], dequantized and requantized."""
    return f"blk.{layer}.ffn_draft_up"


def draft_checksum_tensor_name(layer: int) -> str:
    """Row checksums of layer ``layer``'s draft copy (with the integrity section): I32, ggml ne = [2, n_ff]
    (numpy (n_ff, 2)); row k = CRC-32C of draft up row k, then of draft down_t row k."""
    return f"blk.{layer}.ffn_draft_crc"


def draft_down_t_tensor_name(layer: int) -> str:
    """Name of layer ``layer``'s draft down_t rows: type ``draft_types[L]``, logical numpy shape
    (n_ff, n_embd); row k = base down column order[k], dequantized and requantized."""
    return f"blk.{layer}.ffn_draft_down_t"


# Integrity section: row checksums (required in format 3, optional in formats 1 and 2)
# --------------------------------------------------------------------------------------
#
# The CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF;
# crc32c(b"123456789") = 0xE3069283) of every row the engine can read, one checksum per row, so any
# cluster (a run of whole rows, whatever its size) is checked by its own rows' checksums. Present
# when :data:`KEY_INTEGRITY_ALGORITHM` is; then every served layer has both tensors below.

#: First format version in which the integrity section is required.
INTEGRITY_FORMAT_VERSION = 3

#: string: the checksum algorithm; :data:`INTEGRITY_ALGORITHM`.
KEY_INTEGRITY_ALGORITHM = KEY_PREFIX + "integrity.algorithm"
INTEGRITY_ALGORITHM = "crc32c"

#: Columns of :func:`checksum_tensor_name`, in order: which rows each checksums (n_ff rows each;
#: "bundle" and "down_t" in bundle order, the base rows in base neuron order).
CHECKSUM_COLUMNS: tuple[str, ...] = ("bundle", "down_t", "base_gate", "base_up")


def checksum_tensor_name(layer: int) -> str:
    """Row checksums of layer ``layer``: I32 (uint32 bit patterns), ggml ne = [4, n_ff] (numpy (n_ff, 4)).

    Row k: CRC-32C of bundle row k (all ``bundle_stride`` bytes, padding included), of ``ffn_down_t``
    row k, of the base ``ffn_gate`` row k and of the base ``ffn_up`` row k (:data:`CHECKSUM_COLUMNS`).
    """
    return f"blk.{layer}.ffn_crc"


def base_down_checksum_tensor_name(layer: int) -> str:
    """Row checksums of the base model's ``ffn_down`` of ``layer``: I32, ggml ne = [n_embd]; entry r =
    CRC-32C of down row r (ggml ne = [n_ff, n_embd]: n_embd rows of n_ff values)."""
    return f"blk.{layer}.ffn_down_crc"
