"""A fast reader for the header of a GGUF file: metadata and tensor infos, no tensor data.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array, which
takes 10-20 s on models with large vocabularies (Qwen2.5: 151k tokens, Gemma 3: 262k) —
too slow for something done at every model load. This reader walks the same structure
with ``struct`` over a memory map, decodes scalars, strings and numeric arrays, and
skips string arrays (token lists), recording only their length. It reads little-endian
GGUF versions 2 and 3 (the ones llama.cpp writes).

Layout (all little endian): magic ``GGUF``, version u32, tensor count u64, metadata count
u64; each metadata entry: key (u64 length + UTF-8), value type u32, value; each tensor
info: name, n_dims u32, ne[n_dims] u64, ggml type u32, offset u64 (relative to the data
section). The data section starts at the first multiple of ``general.alignment``
(default 32) after the tensor infos.

Every count in the file is untrusted: a loop or an allocation driven by one is first bounded by
the bytes that are actually there. The structure is checked as strictly as llama.cpp's own reader
(``gguf_init_from_file``) checks it, so a file llama.cpp would refuse is refused here first, with
a message: no duplicate keys or tensor names, tensor names shorter than 64 bytes, 1 to 4
dimensions, element counts below 2**63, a known type whose blocks divide ne0, and each tensor's
offset equal to the running offset — the previous tensor's offset plus its size padded to the
alignment, in header order (so tensors neither overlap nor alias, and none lies outside the data
section) — and its data inside the file.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from llamaflash.files import ggml_types
from llamaflash.files import sidecar_format as fmt

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: GGML_MAX_DIMS and GGML_MAX_NAME of ggml: llama.cpp refuses tensors with more dimensions or
#: with names of GGML_MAX_NAME bytes or more.
_MAX_DIMS = 4
_MAX_NAME_BYTES = 64
#: Smallest encoding of a metadata entry (empty key: u64 length, u32 type, a 1-byte value) and of a
#: tensor info (empty name: u64 length, u32 n_dims, one u64 ne, u32 type, u64 offset); they bound
#: the counts the header declares by the bytes that follow.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_MAX_ELEMENTS = 2**63 - 1


class ValueType(IntEnum):
    """GGUF metadata value types (``gguf_type`` in ggml's gguf.h)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
_NUMPY_TYPES = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "?",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}
UNSIGNED_TYPES = frozenset({ValueType.UINT8, ValueType.UINT16, ValueType.UINT32, ValueType.UINT64})


class GGUFHeaderError(ValueError):
    """The file is not a readable GGUF; ``kind`` says why: :data:`NOT_GGUF`,
    :data:`TRUNCATED`, :data:`UNSUPPORTED` or :data:`MALFORMED`. The message does not
    name the file (callers do)."""

    NOT_GGUF = "not_gguf"
    TRUNCATED = "truncated"
    UNSUPPORTED = "unsupported"
    MALFORMED = "malformed"

    def __init__(self, message: str, kind: str = MALFORMED) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class MetadataValue:
    """One metadata value.

    ``value`` is an int/float/bool for scalars, a str for strings, a 1-D numpy array for
    numeric arrays, and None for string arrays (not decoded; ``count`` says how many).
    ``element_type`` is set for arrays only.
    """

    type: ValueType
    value: Any
    element_type: ValueType | None = None
    count: int = 1


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's description. ``shape`` is in ggml order (ne0 first); ``offset`` is the
    ABSOLUTE file offset of its data, ``nbytes`` its data size."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Header of a GGUF file: everything before the tensor data."""

    path: Path
    version: int
    metadata: dict[str, MetadataValue]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse the header of the GGUF at ``path``.

    Raises FileNotFoundError / IsADirectoryError / PermissionError as ``open`` does, and
    :class:`GGUFHeaderError` if the file is not GGUF, is of an unsupported version or byte
    order, is malformed, or is truncated (header cut short, or some tensor's data running
    past the end of the file; ``truncated`` is then True).
    """
    path = Path(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 4:
            raise GGUFHeaderError(f"not a GGUF file (only {file_size} bytes)", GGUFHeaderError.NOT_GGUF)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(path, buf, file_size).parse()


class _Parser:
    def __init__(self, path: Path, buf: mmap.mmap, size: int) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def parse(self) -> GGUFHeader:
        magic = bytes(self.buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFHeaderError(
                f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})", GGUFHeaderError.NOT_GGUF
            )
        self.pos = 4
        version = self.scalar("<I")
        if version not in SUPPORTED_GGUF_VERSIONS:
            if version & 0xFFFF == 0:
                raise GGUFHeaderError("big-endian GGUF files are not supported", GGUFHeaderError.UNSUPPORTED)
            raise GGUFHeaderError(
                f"GGUF version {version} is not supported (supported: 2, 3)", GGUFHeaderError.UNSUPPORTED
            )
        n_tensors = self.scalar("<Q")
        n_kv = self.scalar("<Q")
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > self.size - self.pos:
            raise GGUFHeaderError(
                f"the file is truncated or its header corrupt: it declares {n_tensors} tensors and "
                f"{n_kv} metadata keys, more than its {self.size} bytes can hold",
                GGUFHeaderError.TRUNCATED,
            )

        metadata: dict[str, MetadataValue] = {}
        for _ in range(n_kv):
            key = self.string()
            if key in metadata:
                raise GGUFHeaderError(f"metadata key '{key}' appears twice")
            vtype = self.value_type()
            metadata[key] = self.value(vtype)

        infos = []
        names: set[str] = set()
        for _ in range(n_tensors):
            info = self.tensor_info()
            if info[0] in names:
                raise GGUFHeaderError(f"tensor '{info[0]}' appears twice")
            names.add(info[0])
            infos.append(info)
        alignment = DEFAULT_ALIGNMENT
        align_field = metadata.get(fmt.GENERAL_ALIGNMENT)
        if align_field is not None:
            if (
                align_field.type != ValueType.UINT32
                or align_field.value <= 0
                or (align_field.value & (align_field.value - 1))
            ):
                raise GGUFHeaderError("general.alignment is not a power of two uint32")
            alignment = int(align_field.value)
        data_offset = -(-self.pos // alignment) * alignment

        tensors = []
        running = 0  # offset (relative to the data section) where the next tensor must start
        for name, ggml_type, shape, rel_offset in infos:
            nbytes = _tensor_nbytes(name, ggml_type, shape)
            if rel_offset != running:
                raise GGUFHeaderError(
                    f"tensor '{name}' has data offset {rel_offset}, expected {running} (the end of "
                    f"the previous tensor's data padded to {alignment} bytes); its data would overlap "
                    "or alias another tensor's, or leave a gap"
                )
            running += -(-nbytes // alignment) * alignment
            offset = data_offset + rel_offset
            if offset + nbytes > self.size:
                raise GGUFHeaderError(
                    f"the file is truncated: tensor '{name}' ends at byte {offset + nbytes} "
                    f"but the file has {self.size} bytes",
                    GGUFHeaderError.TRUNCATED,
                )
            tensors.append(TensorInfo(name, ggml_type, shape, offset, nbytes))
        return GGUFHeader(self.path, version, metadata, tensors, alignment, data_offset, self.size)

    # primitives -----------------------------------------------------------------------

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFHeaderError(
                f"the file is truncated: its header needs {n} bytes at offset {self.pos} "
                f"but the file has {self.size} bytes",
                GGUFHeaderError.TRUNCATED,
            )

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.scalar("<Q")
        self.need(n)
        self.pos += n

    def value_type(self) -> ValueType:
        raw = self.scalar("<I")
        try:
            return ValueType(raw)
        except ValueError:
            raise GGUFHeaderError(f"unknown metadata value type {raw} at offset {self.pos - 4}") from None

    def value(self, vtype: ValueType) -> MetadataValue:
        if vtype == ValueType.STRING:
            return MetadataValue(vtype, self.string())
        if vtype != ValueType.ARRAY:
            return MetadataValue(vtype, self.scalar(_SCALAR_FORMATS[vtype]))
        etype = self.value_type()
        count = self.scalar("<Q")
        if etype == ValueType.STRING:
            if count * 8 > self.size - self.pos:  # each string needs at least its u64 length
                raise GGUFHeaderError(
                    f"the file is truncated or its header corrupt: a string array at offset {self.pos} "
                    f"declares {count} entries, more than the rest of the file can hold",
                    GGUFHeaderError.TRUNCATED,
                )
            for _ in range(count):
                self.skip_string()
            return MetadataValue(vtype, None, etype, count)
        if etype == ValueType.ARRAY:
            raise GGUFHeaderError("nested metadata arrays are not supported")
        dtype = np.dtype(_NUMPY_TYPES[etype])
        self.need(count * dtype.itemsize)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return MetadataValue(vtype, values, etype, count)

    def tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        start = self.pos
        name = self.string()
        if self.pos - start - 8 >= _MAX_NAME_BYTES:
            raise GGUFHeaderError(
                f"tensor name '{name[:80]}' is {self.pos - start - 8} bytes long (at most {_MAX_NAME_BYTES - 1})"
            )
        n_dims = self.scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFHeaderError(f"tensor '{name}' has {n_dims} dimensions (1 to {_MAX_DIMS})")
        shape = tuple(self.scalar("<Q") for _ in range(n_dims))
        if math.prod(shape) > _MAX_ELEMENTS:
            raise GGUFHeaderError(f"tensor '{name}' has ggml shape {list(shape)}, over 2**63 elements")
        ggml_type = self.scalar("<I")
        offset = self.scalar("<Q")
        return name, ggml_type, shape, offset


def _tensor_nbytes(name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    t = ggml_types.GGML_TYPES.get(ggml_type)
    if t is None:
        raise GGUFHeaderError(f"tensor '{name}' has unknown ggml type {ggml_type}")
    if shape[0] % t.block:
        raise GGUFHeaderError(f"tensor '{name}': row of {shape[0]} elements is not a whole number of {t.name} blocks")
    return math.prod(shape) // t.block * t.block_bytes  # Python ints: no wrap-around
