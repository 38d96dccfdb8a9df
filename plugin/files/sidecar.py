"""Reading and validating a llamaflash sidecar, alone or against its base model.

:func:`read_sidecar` parses a ``*.flash.gguf`` and checks it against its format version
(1 or 2, see ``docs/SIDECAR.md``), returning a :class:`SidecarInfo` whose :class:`LayerLayout` entries
give absolute byte offsets of every per-layer tensor. :func:`validate_pair` additionally
checks that the sidecar was converted from the given base model and fills in where that
model's own FFN tensors lie; its layouts are what the native engine is opened with
(:func:`llamaflash.runtime.engine.layer_spec`).

All offsets are absolute file offsets.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamaflash.errors import (
    SidecarFormatError,
    SidecarMismatchError,
    SidecarNotFoundError,
    SidecarVersionError,
)
from llamaflash.files import ggml_types
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo, read_gguf_header
from llamaflash.files.gguf_model import (
    BaseModelInfo,
    base_identity,
    ggml_row_bytes,
    read_base_model,
)
from llamaflash.files.sidecar_checks import (
    Fields,
    block_bytes,
    check_layer_floats,
    check_order,
    check_statistics,
    check_threshold_levels,
    check_threshold_table,
    tensor,
)

_I8 = ggml_types.I8
_I32 = ggml_types.I32


@dataclass(frozen=True)
class LayerLayout:
    """Where one served layer's FFN lives, in the sidecar and in the base model.

    Sidecar side (absolute offsets into the sidecar file):
      * bundle at ``bundle_offset``: ``n_ff`` rows of ``bundle_stride`` bytes; row k holds
        the base gate row ``order[k]`` (``gate_row_bytes`` bytes, ggml type ``gate_type``)
        then the base up row ``order[k]`` (``up_row_bytes``, ``up_type``), zero padded;
      * down_t at ``down_t_offset``: ``n_ff`` rows of ``down_t_row_bytes`` bytes of type
        ``down_t_type``; row k = base down column ``order[k]`` (n_embd values);
      * order at ``order_offset``: ``n_ff`` little-endian int32, a permutation of
        ``range(n_ff)``; order[k] = base neuron index stored at position k.

    Base-model side (absolute offsets into the base GGUF): ``base_gate_offset``,
    ``base_up_offset`` (n_ff rows of gate/up row bytes) and ``base_down_offset``
    (n_embd rows of ``base_down_row_bytes`` bytes, type ``base_down_type``). The three
    offsets are None in a layout from :func:`read_sidecar` and set by
    :func:`validate_pair`.

    Integrity (format 3, optional before; None without): ``checksum_offset``, n_ff rows of four
    uint32 CRC-32C (bundle row, down_t row, base gate row, base up row: ``fmt.CHECKSUM_COLUMNS``)
    and ``down_checksum_offset``, n_embd uint32 (base down rows).

    Sparsity (format v2; None/0 in a v1 sidecar, which carries no thresholds and runs dense):
      * ``threshold``: neuron k is inactive for FFN input x when |act(gate_k·x)| <= threshold;
      * ``sparsity``: fraction of neurons inactive at that threshold on held-out calibration tokens;
      * ``freq_offset`` / ``mag_offset``: ``n_ff`` float32 in bundle order, activation frequency
        (non-increasing when the file's bundle order is "hot") and mean |act(gate·x)·(up·x)|.
      The engine selects gate-first (gate·x for all neurons, then the active ones' up/down); the
      retired selection and predictor content of older files is not read
      (``sidecar_format.KEY_SELECTION``).
    """

    layer: int
    n_embd: int
    n_ff: int
    gate_type: int
    up_type: int
    gate_row_bytes: int
    up_row_bytes: int
    bundle_offset: int
    bundle_stride: int
    down_t_type: int
    down_t_offset: int
    down_t_row_bytes: int
    order_offset: int
    base_down_type: int
    base_down_row_bytes: int
    base_gate_offset: int | None = None
    base_up_offset: int | None = None
    base_down_offset: int | None = None
    threshold: float | None = None
    sparsity: float | None = None
    freq_offset: int | None = None
    mag_offset: int | None = None
    ffn_rel_error: float | None = None
    threshold_table: tuple[float, ...] | None = None  # threshold at each SparsityInfo.threshold_levels
    # the draft copy (optional, format 2): n_ff rows of draft_row_bytes of type draft_type each at
    # draft_up_offset (row k = up row order[k]) and draft_down_t_offset (row k = down column order[k])
    draft_type: int | None = None
    draft_row_bytes: int = 0
    draft_up_offset: int | None = None
    draft_down_t_offset: int | None = None
    draft_checksum_offset: int | None = None  # with the integrity section: uint32 (n_ff, 2) draft row checksums
    checksum_offset: int | None = None  # integrity section: uint32 (n_ff, 4) row checksums
    down_checksum_offset: int | None = None  # uint32 (n_embd,) checksums of the base down rows

    @property
    def is_resolved(self) -> bool:
        """True when the base-model offsets are known (layout came from :func:`validate_pair`)."""
        return None not in (self.base_gate_offset, self.base_up_offset, self.base_down_offset)

    def to_dict(self) -> dict[str, int | float | str | None]:
        """All fields as a plain dict, as handed to the native backend (offsets, sizes and type
        ids are ints; ``threshold``, ``sparsity`` and ``ffn_rel_error`` floats; v2 fields are None
        in a v1 sidecar). The backend ignores keys it does not use.

        Raises ValueError if the base-model offsets are not resolved: a layout for the
        backend must come from :func:`validate_pair`.
        """
        if not self.is_resolved:
            raise ValueError(
                f"layer {self.layer}: base-model offsets unknown; use validate_pair() to get "
                "layouts for the native backend"
            )
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SparsityInfo:
    """The file-level sparsity settings and quality record of a v2 sidecar.

    ``quality`` holds the quality measurement: ``"method"`` (``"engine"``: measured with the
    sparse lane; ``"emulated"``: the stock-llama.cpp emulation, written by older converters and
    still read) and the fields as in the file without the ``llamaflash.quality.<method>.``
    prefix (``ppl_dense``, ``ppl``, ``greedy_agreement``, ``active_fraction``, ``curve_sparsity``,
    ``curve_ppl``, ``curve_greedy_agreement``, ``curve_active_fraction``, ``validation``,
    ``validation_tokens``; newer fields may be absent in older files); empty when the conversion
    did not measure quality.
    """

    criterion: str
    method: str
    target: float
    bundle_order: str
    quality_budget: float | None = None
    calibration_tokens: int | None = None
    calibration_source: str | None = None
    quality: dict = field(default_factory=dict)
    threshold_levels: tuple[float, ...] | None = None  # levels of LayerLayout.threshold_table


@dataclass(frozen=True)
class SidecarInfo:
    """Everything a sidecar declares, checked for consistency. ``sparsity`` is None for v1."""

    path: Path
    format_version: int
    base_identity: str
    base_arch: str
    base_name: str
    base_file_size: int
    activation: str
    n_embd: int
    converter_version: str
    layers: list[LayerLayout] = field(default_factory=list)
    sparsity: SparsityInfo | None = None
    #: the checksum algorithm of the integrity section (``fmt.INTEGRITY_ALGORITHM``), None without one
    integrity: str | None = None


def default_sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """The sidecar path that belongs to ``model_path``: ``dir/model.gguf`` → ``dir/model.flash.gguf``.

    The model's name loses a trailing ``.gguf`` (any case) before the sidecar suffix is added.
    """
    model_path = Path(model_path)
    name = model_path.name
    if name.lower().endswith(fmt.BASE_MODEL_SUFFIX):
        name = name[: -len(fmt.BASE_MODEL_SUFFIX)]
    return model_path.with_name(name + fmt.SIDECAR_SUFFIX)


def read_sidecar(path: str | os.PathLike[str], *, model_path: str | os.PathLike[str] | None = None) -> SidecarInfo:
    """Parse and check the sidecar at ``path``.

    ``model_path``, the base model if known, is only used in the command that error
    messages suggest (otherwise it is guessed from the sidecar's name).

    Raises :class:`SidecarNotFoundError` if it does not exist, :class:`SidecarVersionError`
    if its format version is not in :data:`~llamaflash.files.sidecar_format.SUPPORTED_FORMAT_VERSIONS`,
    and :class:`SidecarFormatError` for anything else wrong: not a GGUF, truncated or
    corrupt, not a llamaflash file, missing/mistyped keys, tensors missing, of the wrong
    type or shape, misaligned, or an order that is not a permutation.
    """
    path = Path(path)
    model = Path(model_path) if model_path is not None else None
    hint = f"Re-run {_convert_command(path, model, force=True)} to re-create it."
    damaged = (
        f"Re-create it with {_convert_command(path, model, force=True)}, or, if it is a copy, "
        "copy it again from the original."
    )
    header = _read_header(path, model, damaged)
    fields = Fields(header.metadata, path, damaged)

    arch = fields.optional_string(fmt.GENERAL_ARCHITECTURE)
    if arch != fmt.SIDECAR_ARCHITECTURE:
        raise SidecarFormatError(
            f"{path}: not a llamaflash sidecar (its general.architecture is {arch!r}, not "
            f"{fmt.SIDECAR_ARCHITECTURE!r}; is it the base model?). Pass the "
            f"'*{fmt.SIDECAR_SUFFIX}' file written by `llamaflash convert`."
        )
    version = fields.uint(fmt.KEY_FORMAT_VERSION)
    if version not in fmt.SUPPORTED_FORMAT_VERSIONS:
        supported = ", ".join(str(v) for v in fmt.SUPPORTED_FORMAT_VERSIONS)
        newer = (
            " It was written by a newer llamaflash: upgrade llamaflash, or"
            if version > max(fmt.SUPPORTED_FORMAT_VERSIONS)
            else ""
        )
        raise SidecarVersionError(
            f"{path}: sidecar format version {version} is not supported (this llamaflash "
            f"reads version {supported}).{newer} {hint}"
        )
    alignment = fields.uint(fmt.GENERAL_ALIGNMENT)
    if alignment != fmt.SIDECAR_ALIGNMENT:
        fields.fail(f"general.alignment is {alignment}, expected {fmt.SIDECAR_ALIGNMENT}")

    activation = fields.string(fmt.KEY_FFN_ACTIVATION)
    if activation not in fmt.ACTIVATIONS:
        fields.fail(f"unknown FFN activation {activation!r}")
    n_embd = fields.positive_uint(fmt.KEY_N_EMBD)
    layer_ids = fields.uint_array(fmt.KEY_LAYERS)
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
        fields.fail(f"'{fmt.KEY_LAYERS}' is not strictly increasing: {layer_ids}")
    per_layer: dict[str, list] = {
        key: fields.uint_array(key, length=len(layer_ids)) for key in fmt.PER_LAYER_ARRAY_KEYS
    }
    sparsity = None
    if version >= fmt.SPARSITY_FORMAT_VERSION:
        sparsity = _sparsity_info(fields)
        per_layer.update({key: fields.float_array(key, length=len(layer_ids)) for key in fmt.V2_PER_LAYER_FLOAT_KEYS})
        if fields.has(fmt.KEY_THRESHOLD_LEVELS):
            levels = fields.float_array(fmt.KEY_THRESHOLD_LEVELS)
            check_threshold_levels(fields, levels)
            table = fields.float_array(fmt.KEY_THRESHOLD_TABLE, length=len(layer_ids) * len(levels))
            check_threshold_table(fields, layer_ids, levels, table, per_layer[fmt.KEY_THRESHOLDS], sparsity.target)
            sparsity = dataclasses.replace(sparsity, threshold_levels=tuple(levels))
            per_layer["threshold_table"] = [
                tuple(table[i * len(levels) : (i + 1) * len(levels)]) for i in range(len(layer_ids))
            ]

    draft_types = (
        fields.uint_array(fmt.KEY_DRAFT_TYPES, length=len(layer_ids))
        if sparsity is not None and fields.has(fmt.KEY_DRAFT_TYPES)
        else None
    )
    tensors = {t.name: t for t in header.tensors}
    identity_order = sparsity is not None and sparsity.bundle_order == fmt.BUNDLE_ORDER_BASE
    layers = []
    for i, layer in enumerate(layer_ids):
        meta = {key: values[i] for key, values in per_layer.items()}
        layout = _layer_layout(fields, tensors, layer, n_embd, meta, identity_order)
        if sparsity is not None:
            layout = _sparsity_layout(fields, tensors, layout, meta)
        if draft_types is not None:
            layout = _draft_layout(fields, tensors, layout, draft_types[i])
        layers.append(layout)
    integrity = None
    if version >= fmt.INTEGRITY_FORMAT_VERSION or fields.has(fmt.KEY_INTEGRITY_ALGORITHM):
        integrity = fields.string(fmt.KEY_INTEGRITY_ALGORITHM)
        if integrity != fmt.INTEGRITY_ALGORITHM:
            fields.fail(
                f"unknown checksum algorithm {integrity!r} in '{fmt.KEY_INTEGRITY_ALGORITHM}' "
                f"(this llamaflash knows {fmt.INTEGRITY_ALGORITHM!r})"
            )
        layers = [_integrity_layout(fields, tensors, layout) for layout in layers]

    return SidecarInfo(
        path=path,
        format_version=version,
        base_identity=fields.string(fmt.KEY_BASE_IDENTITY),
        base_arch=fields.string(fmt.KEY_BASE_ARCHITECTURE),
        base_name=fields.optional_string(fmt.KEY_BASE_NAME) or "",
        base_file_size=fields.uint(fmt.KEY_BASE_FILE_SIZE),
        activation=activation,
        n_embd=n_embd,
        converter_version=fields.optional_string(fmt.KEY_CONVERTER_VERSION) or "",
        layers=layers,
        sparsity=sparsity,
        integrity=integrity,
    )


def validate_pair(
    model_path: str | os.PathLike[str],
    sidecar_path: str | os.PathLike[str],
    *,
    model: BaseModelInfo | None = None,
) -> SidecarInfo:
    """Check that ``sidecar_path`` belongs to ``model_path``; return its info with every
    layout's base-model offsets resolved.

    ``model``: :func:`~llamaflash.files.gguf_model.read_base_model` of ``model_path`` if the caller has
    it already (the header is then not parsed again).

    Raises what :func:`~llamaflash.files.gguf_model.read_base_model` raises for a bad model,
    what :func:`read_sidecar` raises for a bad sidecar, and :class:`SidecarMismatchError`
    when the sidecar was converted from a different model.
    """
    model_path = Path(model_path)
    if model is None:
        model = read_base_model(model_path)
    info = read_sidecar(sidecar_path, model_path=model_path)
    identity = base_identity(model_path, model)
    if identity != info.base_identity:
        raise SidecarMismatchError(
            f"{info.path} does not belong to {model_path}: it was converted from "
            f"{_describe_base(info)} (identity {info.base_identity[:16]}…), but "
            f"{model_path} is {_describe_model(model)} (identity {identity[:16]}…). "
            f"Re-run `llamaflash convert {model_path} --force`, or pass the sidecar made "
            "from this model."
        )
    return dataclasses.replace(info, layers=[_resolve(info, model, lay) for lay in info.layers])


# --------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------


def _guess_model_path(sidecar_path: Path) -> Path:
    """The base model a sidecar's name points to: ``m.flash.gguf`` → ``m.gguf``."""
    name = sidecar_path.name
    if name.endswith(fmt.SIDECAR_SUFFIX):
        return sidecar_path.with_name(name[: -len(fmt.SIDECAR_SUFFIX)] + fmt.BASE_MODEL_SUFFIX)
    return Path("<base model>.gguf")


def _convert_command(sidecar_path: Path, model_path: Path | None, force: bool = False) -> str:
    """The `llamaflash convert` command that (re-)creates ``sidecar_path``, quoted."""
    model = model_path if model_path is not None else _guess_model_path(sidecar_path)
    words = ["llamaflash", "convert", str(model)]
    if default_sidecar_path(model) != sidecar_path:
        words += ["-o", str(sidecar_path)]
    if force:
        words.append("--force")
    return "`" + " ".join(words) + "`"


def _read_header(path: Path, model_path: Path | None, hint: str) -> GGUFHeader:
    """Parse ``path``'s GGUF header, turning every failure into a user-facing error
    (ending with ``hint`` when the file exists)."""
    if not path.exists():
        raise SidecarNotFoundError(
            f"{path}: no such sidecar file. Create it with {_convert_command(path, model_path)}."
        )
    if not path.is_file():
        raise SidecarFormatError(f"{path}: not a regular file. Pass the path of a '*{fmt.SIDECAR_SUFFIX}' file.")
    try:
        return read_gguf_header(path)
    except OSError as exc:
        raise SidecarFormatError(f"{path}: cannot be read ({exc.strerror or exc}).") from exc
    except GGUFHeaderError as exc:
        what = "so not a llamaflash sidecar" if exc.kind == GGUFHeaderError.NOT_GGUF else "unusable sidecar"
        raise SidecarFormatError(f"{path}: {exc}, {what}. {hint}") from exc


def _layer_layout(
    fields: Fields,
    tensors: dict[str, TensorInfo],
    layer: int,
    n_embd: int,
    meta: dict[str, int],
    identity_order: bool,
) -> LayerLayout:
    n_ff = meta[fmt.KEY_N_FF]
    if n_ff < 1:
        fields.fail(f"layer {layer}: '{fmt.KEY_N_FF}' is {n_ff}, expected at least 1")
    stride = meta[fmt.KEY_BUNDLE_STRIDES]
    gate_type, up_type = meta[fmt.KEY_GATE_TYPES], meta[fmt.KEY_UP_TYPES]
    down_type, down_t_type = meta[fmt.KEY_DOWN_TYPES], meta[fmt.KEY_DOWN_T_TYPES]
    try:
        gate_row = ggml_row_bytes(gate_type, n_embd)
        up_row = ggml_row_bytes(up_type, n_embd)
        down_row = ggml_row_bytes(down_type, n_ff)
        down_t_row = ggml_row_bytes(down_t_type, n_embd)
    except (ValueError, KeyError) as exc:
        fields.fail(f"layer {layer}: bad ggml type or size ({exc})")
    expected_stride = fmt.bundle_stride(gate_row, up_row, block_bytes(gate_type), block_bytes(up_type))
    if stride != expected_stride:
        fields.fail(
            f"layer {layer}: bundle stride {stride} does not match the v1 rule for {gate_row}+{up_row} "
            f"byte rows (expected {expected_stride})"
        )

    bundle = tensor(fields, tensors, fmt.bundle_tensor_name(layer), _I8, (stride, n_ff))
    down_t = tensor(fields, tensors, fmt.down_t_tensor_name(layer), down_t_type, (n_embd, n_ff))
    order = tensor(fields, tensors, fmt.order_tensor_name(layer), _I32, (n_ff,))
    check_order(fields, order, layer, n_ff, identity_order)

    return LayerLayout(
        layer=layer,
        n_embd=n_embd,
        n_ff=n_ff,
        gate_type=gate_type,
        up_type=up_type,
        gate_row_bytes=gate_row,
        up_row_bytes=up_row,
        bundle_offset=bundle.offset,
        bundle_stride=stride,
        down_t_type=down_t_type,
        down_t_offset=down_t.offset,
        down_t_row_bytes=down_t_row,
        order_offset=order.offset,
        base_down_type=down_type,
        base_down_row_bytes=down_row,
    )


_F32 = ggml_types.F32


def _quality_record(fields: Fields) -> dict:
    """The quality record of the first method (``fmt.QUALITY_METHODS`` order) with any key in the
    file: its fields by name, plus ``"method"``; {} when the file has none."""
    readers = (
        (fmt.QUALITY_FLOAT_FIELDS, fields.real),
        (fmt.QUALITY_ARRAY_FIELDS, fields.float_array),
        (fmt.QUALITY_STRING_FIELDS, fields.string),
        (fmt.QUALITY_UINT_FIELDS, fields.uint),
    )
    for method in fmt.QUALITY_METHODS:
        quality = {
            name: read(fmt.quality_key(method, name))
            for names, read in readers
            for name in names
            if fields.has(fmt.quality_key(method, name))
        }
        if quality:
            return {**quality, "method": method}
    return {}


def _sparsity_info(fields: Fields) -> SparsityInfo:
    """The file-level v2 keys, checked."""
    criterion = fields.string(fmt.KEY_SPARSITY_CRITERION)
    if criterion not in fmt.CRITERIA:
        fields.fail(f"unknown sparsity criterion {criterion!r}")
    method = fields.string(fmt.KEY_SPARSITY_METHOD)
    if method not in fmt.SPARSITY_METHODS:
        fields.fail(f"unknown sparsity method {method!r}")
    target = fields.real(fmt.KEY_SPARSITY_TARGET)
    bundle_order = fields.string(fmt.KEY_BUNDLE_ORDER)
    if bundle_order not in fmt.BUNDLE_ORDERS:
        fields.fail(f"unknown bundle order {bundle_order!r}")
    if not 0.0 <= target < 1.0:
        fields.fail(f"sparsity target {target} is not in [0, 1)")
    quality = _quality_record(fields)
    return SparsityInfo(
        criterion=criterion,
        method=method,
        target=target,
        bundle_order=bundle_order,
        quality_budget=fields.real(fmt.KEY_QUALITY_BUDGET) if fields.has(fmt.KEY_QUALITY_BUDGET) else None,
        calibration_tokens=fields.uint(fmt.KEY_CALIB_TOKENS) if fields.has(fmt.KEY_CALIB_TOKENS) else None,
        calibration_source=fields.optional_string(fmt.KEY_CALIB_SOURCE),
        quality=quality,
    )


def _sparsity_layout(fields: Fields, tensors: dict[str, TensorInfo], layout: LayerLayout, meta: dict) -> LayerLayout:
    """``layout`` with its v2 fields read and checked (the retired selection and predictor content
    of older files is not read)."""
    layer, n_ff = layout.layer, layout.n_ff
    check_layer_floats(fields, layer, meta)
    threshold = meta[fmt.KEY_THRESHOLDS]
    freq = tensor(fields, tensors, fmt.freq_tensor_name(layer), _F32, (n_ff,))
    mag = tensor(fields, tensors, fmt.magnitude_tensor_name(layer), _F32, (n_ff,))
    check_statistics(fields, layer, freq, mag, n_ff)
    return dataclasses.replace(
        layout,
        threshold=threshold,
        sparsity=meta[fmt.KEY_SPARSITY_REACHED],
        freq_offset=freq.offset,
        mag_offset=mag.offset,
        ffn_rel_error=meta[fmt.KEY_FFN_REL_ERROR],
        threshold_table=meta.get("threshold_table"),
    )


def _draft_layout(fields: Fields, tensors: dict[str, TensorInfo], layout: LayerLayout, dtype: int) -> LayerLayout:
    """``layout`` with its draft copy's tensors found and checked."""
    try:
        row = ggml_row_bytes(dtype, layout.n_embd)
    except (ValueError, KeyError) as exc:
        fields.fail(f"layer {layout.layer}: bad draft copy type ({exc})")
    shape = (layout.n_embd, layout.n_ff)
    up = tensor(fields, tensors, fmt.draft_up_tensor_name(layout.layer), dtype, shape)
    down_t = tensor(fields, tensors, fmt.draft_down_t_tensor_name(layout.layer), dtype, shape)
    return dataclasses.replace(
        layout, draft_type=dtype, draft_row_bytes=row, draft_up_offset=up.offset, draft_down_t_offset=down_t.offset
    )


def _integrity_layout(fields: Fields, tensors: dict[str, TensorInfo], layout: LayerLayout) -> LayerLayout:
    """``layout`` with its checksum tables located (both required once the file has the section)."""
    rows = tensor(
        fields, tensors, fmt.checksum_tensor_name(layout.layer), _I32, (len(fmt.CHECKSUM_COLUMNS), layout.n_ff)
    )
    down = tensor(fields, tensors, fmt.base_down_checksum_tensor_name(layout.layer), _I32, (layout.n_embd,))
    draft = None
    if layout.draft_type is not None:
        draft = tensor(fields, tensors, fmt.draft_checksum_tensor_name(layout.layer), _I32, (2, layout.n_ff)).offset
    return dataclasses.replace(
        layout, checksum_offset=rows.offset, down_checksum_offset=down.offset, draft_checksum_offset=draft
    )


def read_layer_vectors(info: SidecarInfo, layout: LayerLayout) -> dict[str, np.ndarray]:
    """The per-neuron arrays of one layer of a v2 sidecar, in bundle order: ``order`` (int32),
    ``freq`` and ``mag`` (float32). A v1 layout gives only ``order``."""
    path, n_ff = info.path, layout.n_ff
    out = {"order": np.fromfile(path, dtype="<i4", count=n_ff, offset=layout.order_offset)}
    if layout.freq_offset is not None:
        out["freq"] = np.fromfile(path, dtype="<f4", count=n_ff, offset=layout.freq_offset)
        out["mag"] = np.fromfile(path, dtype="<f4", count=n_ff, offset=layout.mag_offset)
    return out


def _describe_base(info: SidecarInfo) -> str:
    name = f"'{info.base_name}'" if info.base_name else "an unnamed model"
    return f"{name} ({info.base_arch}, {info.base_file_size} bytes)"


def _describe_model(model: BaseModelInfo) -> str:
    name = f"'{model.name}'" if model.name else "an unnamed model"
    return f"{name} ({model.architecture}, {model.file_size} bytes)"


def _resolve(info: SidecarInfo, model: BaseModelInfo, layout: LayerLayout) -> LayerLayout:
    """``layout`` with the base-model offsets filled in, after checking the model agrees."""
    ffn = {f.layer: f for f in model.ffn_layers}.get(layout.layer)
    expected = None if ffn is None else (ffn.n_embd, ffn.n_ff, ffn.gate.ggml_type, ffn.up.ggml_type, ffn.down.ggml_type)
    actual = (layout.n_embd, layout.n_ff, layout.gate_type, layout.up_type, layout.base_down_type)
    if expected != actual:
        raise SidecarMismatchError(
            f"{info.path}: layer {layout.layer} (n_embd, n_ff, gate/up/down types) = {actual} "
            f"but {model.path} has {expected}. Re-run `llamaflash convert {model.path} --force`."
        )
    return dataclasses.replace(
        layout,
        base_gate_offset=ffn.gate.offset,
        base_up_offset=ffn.up.offset,
        base_down_offset=ffn.down.offset,
    )
