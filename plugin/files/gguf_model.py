"""Inspection of a base model GGUF: what llamaflash needs to know about it, and its identity.

:func:`read_base_model` parses a GGUF's header (:mod:`llamaflash.files.gguf_header`) and returns a
:class:`BaseModelInfo`: architecture, sizes, and for every layer llamaflash can serve the
location of its FFN tensors (absolute byte offsets in the file). :func:`base_identity`
fingerprints the file cheaply so a sidecar can be tied to it. :func:`read_tensor_rows`
maps a tensor's raw rows.

Offsets are always absolute file offsets.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamaflash.errors import BaseModelError, BaseModelNotFoundError
from llamaflash.files import ggml_types
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import GGUFHeader, GGUFHeaderError, TensorInfo, ValueType, read_gguf_header

_READ_CHUNK = 1 << 20
_INTEGER_TYPES = frozenset(
    {
        ValueType.UINT8,
        ValueType.INT8,
        ValueType.UINT16,
        ValueType.INT16,
        ValueType.UINT32,
        ValueType.INT32,
        ValueType.UINT64,
        ValueType.INT64,
    }
)


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's raw data lies in a GGUF file.

    ``shape`` is in ggml order (``shape[0]`` = ne0 = elements per row). ``offset`` is the
    absolute byte offset of the first data byte; the data is ``n_rows`` contiguous rows of
    ``row_bytes`` bytes, ``nbytes`` in all.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    row_bytes: int

    @property
    def n_rows(self) -> int:
        """Number of rows (product of ne1, ne2, ...)."""
        return self.nbytes // self.row_bytes


@dataclass(frozen=True)
class FfnLayer:
    """The three FFN weights of one servable layer.

    gate and up have ggml ne = [n_embd, n_ff] (n_ff rows of n_embd), down has
    ne = [n_ff, n_embd] (n_embd rows of n_ff).
    """

    layer: int
    gate: TensorLocation
    up: TensorLocation
    down: TensorLocation

    @property
    def n_embd(self) -> int:
        return self.gate.shape[0]

    @property
    def n_ff(self) -> int:
        return self.gate.shape[1]


@dataclass(frozen=True)
class BaseModelInfo:
    """What llamaflash knows about a base model GGUF.

    ``ffn_layers`` lists the layers llamaflash can serve, in layer order; it is empty when
    the architecture is not supported (``activation`` is then None). ``gate_tensors``
    lists every ``blk.N.ffn_gate.weight`` in the file in layer order, served or not (it
    feeds :func:`base_identity`). ``data_offset`` is the absolute offset of the tensor
    data section (header, metadata and tensor infos lie before it). ``header`` is the parsed
    header itself, for callers that need more of it (the planner) without parsing it again.
    """

    path: Path
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    file_size: int
    data_offset: int
    activation: str | None
    ffn_layers: list[FfnLayer] = field(default_factory=list)
    gate_tensors: list[TensorLocation] = field(default_factory=list)
    header: GGUFHeader | None = field(default=None, repr=False, compare=False)

    @property
    def is_supported(self) -> bool:
        """True when llamaflash can serve at least one FFN layer of this model."""
        return self.activation is not None and bool(self.ffn_layers)


def read_base_model(path: str | os.PathLike[str]) -> BaseModelInfo:
    """Parse the GGUF at ``path`` and describe it.

    Raises :class:`BaseModelNotFoundError` if the file does not exist and
    :class:`BaseModelError` if it is not a GGUF, is truncated (some tensor's data runs
    past the end of the file), cannot be parsed, or is internally inconsistent. A model
    of an unsupported architecture is *not* an error here: its info has
    ``ffn_layers == []``; call :func:`require_supported` to insist.
    """
    path = Path(path)
    header = _read_header(path)
    locations = {t.name: _location(path, t) for t in header.tensors}

    architecture = _string_field(header, fmt.GENERAL_ARCHITECTURE) or ""
    name = _string_field(header, fmt.GENERAL_NAME) or ""
    gate_tensors = _gate_tensors_in_layer_order(locations)
    activation = fmt.SUPPORTED_BASE_ARCHITECTURES.get(architecture)

    n_layer = _int_field(header, fmt.base_block_count_key(architecture))
    n_embd = _int_field(header, fmt.base_embedding_length_key(architecture))
    if activation is not None and (n_layer is None or n_embd is None):
        raise BaseModelError(
            f"{path}: architecture '{architecture}' but the metadata lacks "
            f"'{fmt.base_block_count_key(architecture)}' or "
            f"'{fmt.base_embedding_length_key(architecture)}'; the file is corrupt or was "
            "written by a broken converter. Re-create the GGUF with llama.cpp's tools."
        )

    if n_layer is not None:
        _check_block_count(
            path, header, fmt.base_block_count_key(architecture), n_layer, locations, strict=activation is not None
        )

    ffn_layers: list[FfnLayer] = []
    if activation is not None:
        assert n_layer is not None and n_embd is not None
        ffn_layers = _servable_ffn_layers(path, locations, n_layer, n_embd)

    return BaseModelInfo(
        path=path,
        architecture=architecture,
        name=name,
        n_layer=n_layer if n_layer is not None else _count_blocks(locations),
        n_embd=n_embd if n_embd is not None else 0,
        file_size=header.file_size,
        data_offset=header.data_offset,
        activation=activation,
        ffn_layers=ffn_layers,
        gate_tensors=gate_tensors,
        header=header,
    )


def require_supported(info: BaseModelInfo) -> None:
    """Raise :class:`BaseModelError` unless llamaflash can serve some FFN layer of ``info``."""
    supported = ", ".join(sorted(fmt.SUPPORTED_BASE_ARCHITECTURES))
    if info.activation is None:
        raise BaseModelError(
            f"{info.path}: architecture '{info.architecture}' is not supported by llamaflash "
            f"(supported: {supported}). Use llama_cpp.Llama for this model."
        )
    if not info.ffn_layers:
        raise BaseModelError(
            f"{info.path}: architecture '{info.architecture}' but no layer has a dense gated "
            "FFN (blk.N.ffn_gate/ffn_up/ffn_down.weight without bias or scale tensors); "
            "mixture-of-experts and biased FFNs are not served. "
            "Use llama_cpp.Llama for this model."
        )


def base_identity(path: str | os.PathLike[str], info: BaseModelInfo | None = None) -> str:
    """Fingerprint of a base model file, as a sha256 hex digest.

    Hashed, in order: the file bytes ``[0, data_offset)`` (header, metadata, tensor
    infos), the file size as 8-byte little endian, then the first
    ``min(4096, nbytes)`` data bytes of every ``blk.N.ffn_gate.weight`` in layer order.
    Pass ``info`` (from :func:`read_base_model` on the same path) to skip re-parsing.
    Raises like :func:`read_base_model`.
    """
    path = Path(path)
    if info is None:
        info = read_base_model(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = info.data_offset
        while remaining > 0:
            chunk = f.read(min(_READ_CHUNK, remaining))
            if not chunk:
                raise BaseModelError(f"{path}: the file is truncated inside its header.")
            digest.update(chunk)
            remaining -= len(chunk)
        digest.update(info.file_size.to_bytes(8, "little"))
        for gate in info.gate_tensors:
            f.seek(gate.offset)
            digest.update(f.read(min(fmt.IDENTITY_GATE_PREFIX_BYTES, gate.nbytes)))
    return digest.hexdigest()


def read_tensor_rows(path: str | os.PathLike[str], tensor: TensorLocation) -> np.ndarray:
    """Read-only view of ``tensor``'s raw data: a uint8 array of shape (n_rows, row_bytes).

    The array is memory-mapped from ``path``; rows are the tensor's ggml rows with their
    bytes exactly as stored (any quantization type).
    """
    return np.memmap(
        path,
        dtype=np.uint8,
        mode="r",
        offset=tensor.offset,
        shape=(tensor.n_rows, tensor.row_bytes),
    )


def ggml_row_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes of a row of ``n_elements`` values of ggml type ``ggml_type``.

    Raises ValueError if ``n_elements`` is not a whole number of the type's blocks.
    """
    return ggml_types.row_bytes(ggml_type, n_elements)


# --------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------


def _read_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s GGUF header, turning every failure into a user-facing error."""
    if not path.exists():
        raise BaseModelNotFoundError(f"{path}: no such file. Check the path of the base model (.gguf).")
    if not path.is_file():
        raise BaseModelError(f"{path}: not a regular file. Pass the path of a .gguf model file.")
    try:
        return read_gguf_header(path)
    except OSError as exc:
        raise BaseModelError(f"{path}: cannot be read ({exc.strerror or exc}).") from exc
    except GGUFHeaderError as exc:
        way_out = {
            GGUFHeaderError.NOT_GGUF: "Pass a llama.cpp .gguf model file.",
            GGUFHeaderError.UNSUPPORTED: "Convert it with a current llama.cpp.",
        }.get(exc.kind, "The file is damaged; download or copy the model again.")
        raise BaseModelError(f"{path}: {exc}. {way_out}") from exc


def _location(path: Path, tensor: TensorInfo) -> TensorLocation:
    try:
        row_bytes = ggml_row_bytes(tensor.ggml_type, tensor.shape[0])
    except ValueError as exc:
        raise BaseModelError(f"{path}: tensor '{tensor.name}' is malformed: {exc}.") from exc
    return TensorLocation(
        name=tensor.name,
        ggml_type=tensor.ggml_type,
        shape=tensor.shape,
        offset=tensor.offset,
        nbytes=tensor.nbytes,
        row_bytes=row_bytes,
    )


def _string_field(header: GGUFHeader, key: str) -> str | None:
    f = header.metadata.get(key)
    return f.value if f is not None and f.type == ValueType.STRING else None


def _int_field(header: GGUFHeader, key: str) -> int | None:
    f = header.metadata.get(key)
    if f is None or f.type not in _INTEGER_TYPES:
        return None
    return int(f.value)


def _gate_tensors_in_layer_order(locations: dict[str, TensorLocation]) -> list[TensorLocation]:
    found = []
    for name, loc in locations.items():
        m = fmt.BASE_FFN_GATE_NAME_RE.match(name)
        if m:
            found.append((int(m.group(1)), loc))
    return [loc for _, loc in sorted(found, key=lambda item: item[0])]


def _block_indices(locations: dict[str, TensorLocation]) -> set[int]:
    """The N of every ``blk.N.*`` tensor present."""
    return {int(name.split(".")[1]) for name in locations if name.startswith("blk.") and name.split(".")[1].isdigit()}


def _count_blocks(locations: dict[str, TensorLocation]) -> int:
    indices = _block_indices(locations)
    return max(indices) + 1 if indices else 0


def _check_block_count(
    path: Path, header: GGUFHeader, key: str, n_layer: int, locations: dict[str, TensorLocation], strict: bool
) -> None:
    """Refuse a block count the tensors present cannot back.

    Every block has at least one tensor, so no file has more blocks than tensors. With ``strict``
    (an architecture llamaflash serves: every block has ``blk.N.*`` tensors and every tensor is
    used, as llama.cpp's loader requires) the count must equal the highest block index present plus
    one, and be at least 1. The bounds keep later per-layer work proportional to the file's
    contents.
    """
    present = _count_blocks(locations)
    if strict:
        bad = n_layer != present or present == 0
        have = f"tensors for blocks 0..{present - 1}" if present else "no blk.N tensors"
    else:
        bad = n_layer > len(header.tensors)
        have = f"only {len(header.tensors)} tensors"
    if bad:
        raise BaseModelError(
            f"{path}: metadata '{key}' = {n_layer}, but the file has {have}; the metadata is "
            "corrupt (a flipped byte?). Download or copy the model again, or re-create the GGUF "
            "with llama.cpp's tools."
        )


def _servable_ffn_layers(path: Path, locations: dict[str, TensorLocation], n_layer: int, n_embd: int) -> list[FfnLayer]:
    """Layers with plain gate/up/down weights of consistent shapes and no bias/scale, among the
    blocks below ``n_layer`` that have a gate tensor (the loop follows the tensors present, never
    the declared count)."""
    gate_layers = sorted(int(m.group(1)) for m in map(fmt.BASE_FFN_GATE_NAME_RE.match, locations) if m)
    layers = []
    for layer in (i for i in gate_layers if i < n_layer):
        gate = locations.get(fmt.base_ffn_gate_name(layer))
        up = locations.get(fmt.base_ffn_up_name(layer))
        down = locations.get(fmt.base_ffn_down_name(layer))
        if gate is None or up is None or down is None:
            continue
        if any(extra in locations for extra in fmt.base_ffn_extra_names(layer)):
            continue
        n_ff = gate.shape[1] if len(gate.shape) == 2 else -1
        expected = {gate.name: (n_embd, n_ff), up.name: (n_embd, n_ff), down.name: (n_ff, n_embd)}
        for loc in (gate, up, down):
            if loc.shape != expected[loc.name] or n_ff <= 0:
                raise BaseModelError(
                    f"{path}: tensor '{loc.name}' has ggml shape {list(loc.shape)}, expected "
                    f"{list(expected[loc.name])} for n_embd={n_embd}; the file is corrupt. "
                    "Re-create the GGUF with llama.cpp's tools."
                )
        layers.append(FfnLayer(layer=layer, gate=gate, up=up, down=down))
    return layers
