"""Seeded corruption cases for fuzzing what llamaflash reads: the quick in-process run
(``tests/test_fuzz_sidecar.py``) and the long run in subprocesses (``scripts/fuzz_long.py``).

A :class:`Case` is a label and a mutation of the clean file: byte patches, a truncation, or an
in-place edit of the header's tensor infos (applied to the written file). Patches and truncations
are small to apply and to undo, so a long run mutates one working copy in place. Generators take
the clean file (path and bytes) and yield cases; the same seed yields the same cases. What counts as "the same result" is
:func:`sidecar_summary` (``validate_pair``) and :func:`base_summary` (``read_base_model``): every
field that decides where and how the engine reads weights; measured values are left out
(:data:`VALUE_FIELDS`).

Kinds: header bit flips before the data section; truncations (header and data); targeted edits of
every tensor's info (offset moved by one alignment unit, pointed at another tensor, row count
doubled, type changed); neuron-order edits (two entries swapped, a duplicate, a full shuffle); huge
or zero header counts; the base's block count; and bit flips inside the data section (weights,
orders, statistics), which no structural check can see: those inside the rows the sidecar's
checksums cover (:func:`checked_ranges`; kind "data flip, checked rows") must be caught by
:func:`integrity_summary`, the others (statistics, tensors the engine does not read)
are kind "data flip, other".

Only the standard library, NumPy, gguf and llamaflash's readers are imported (no pytest).
"""

from __future__ import annotations

import signal
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterator

import gguf
import numpy as np

from llamaflash.errors import SidecarIntegrityError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import read_gguf_header
from llamaflash.files.gguf_model import read_base_model
from llamaflash.files.integrity import verify_files
from llamaflash.files.sidecar import read_sidecar, validate_pair

#: LayerLayout fields holding measured or calibrated values, not structure: a flip inside one of
#: them that keeps it within its checked range is a value corruption, like a flip in tensor data.
VALUE_FIELDS = frozenset({"threshold", "sparsity", "ffn_rel_error", "threshold_table"})


@dataclass
class Case:
    label: str
    kind: str
    patches: tuple[tuple[int, bytes], ...] = ()  # (offset, new bytes) over the clean bytes
    size: int | None = None  # truncate to this many bytes
    edit: Callable[[Path], None] | None = None  # in place, header only, after patches and size

    def apply(self, data: bytes) -> bytes:
        """The clean ``data`` with the patches and the truncation (not the edit)."""
        mutated = bytearray(data)
        for offset, new in self.patches:
            mutated[offset : offset + len(new)] = new
        return bytes(mutated if self.size is None else mutated[: self.size])


# --------------------------------------------------------------------------------------
# what a reader's result is compared on
# --------------------------------------------------------------------------------------


def sidecar_summary(model: Path, sidecar: Path) -> tuple:
    info = validate_pair(model, sidecar)
    layers = tuple(
        tuple(sorted((k, v) for k, v in lay.to_dict().items() if k not in VALUE_FIELDS)) for lay in info.layers
    )
    order = info.sparsity.bundle_order if info.sparsity else None
    return info.format_version, info.activation, info.n_embd, info.base_identity, order, layers


def integrity_summary(model: Path, sidecar: Path) -> tuple:
    """:func:`sidecar_summary`, then every checksummed row of both files (``llamaflash verify``):
    a mismatch raises SidecarIntegrityError, as loading the pair in memory would."""
    summary = sidecar_summary(model, sidecar)
    report = verify_files(sidecar, model, max_mismatches=1)
    if not report.ok:
        m = report.mismatches[0] if report.mismatches else None
        raise SidecarIntegrityError(
            f"{report.n_mismatches} rows do not match their checksums"
            + (f", first {m.tensor} row {m.row}" if m else "")
        )
    return summary


def checked_ranges(model: Path, sidecar: Path) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges [start, end) of each file that the checksums cover: per served layer the sidecar's
    bundle, down_t and checksum tables, the base model's ffn_gate, ffn_up and ffn_down."""
    info = validate_pair(model, sidecar)
    side, base = [], []
    for lay in info.layers:
        side += [
            (lay.bundle_offset, lay.bundle_offset + lay.n_ff * lay.bundle_stride),
            (lay.down_t_offset, lay.down_t_offset + lay.n_ff * lay.down_t_row_bytes),
        ]
        if lay.checksum_offset is not None:
            side += [
                (lay.checksum_offset, lay.checksum_offset + 4 * len(fmt.CHECKSUM_COLUMNS) * lay.n_ff),
                (lay.down_checksum_offset, lay.down_checksum_offset + 4 * lay.n_embd),
            ]
        base += [
            (lay.base_gate_offset, lay.base_gate_offset + lay.n_ff * lay.gate_row_bytes),
            (lay.base_up_offset, lay.base_up_offset + lay.n_ff * lay.up_row_bytes),
            (lay.base_down_offset, lay.base_down_offset + lay.n_embd * lay.base_down_row_bytes),
        ]
    return {"sidecar": sorted(side), "base": sorted(base)}


def base_summary(model: Path) -> tuple:
    info = read_base_model(model)
    layers = tuple((f.layer, f.gate, f.up, f.down) for f in info.ffn_layers)
    return info.architecture, info.n_layer, info.n_embd, info.activation, layers


# --------------------------------------------------------------------------------------
# in-place edits of a GGUF file's tensor infos
# --------------------------------------------------------------------------------------


def edit_tensor_info(
    path: Path,
    name: str,
    *,
    offset: int | None = None,
    dims: list[int] | None = None,
    ggml_type: int | None = None,
    new_name: str | None = None,
) -> None:
    """Overwrite parts of tensor ``name``'s info in place: its data offset (relative to the data
    section), its ggml ne (same number of dimensions), its type, or its name (same length).
    Info parts: name length, name, n_dims, ne, type, offset."""
    reader = gguf.GGUFReader(path, "r+")
    parts = next(t for t in reader.tensors if t.name == name).field.parts
    if offset is not None:
        parts[5][0] = offset
    if dims is not None:
        parts[3][:] = dims
    if ggml_type is not None:
        parts[4][0] = ggml_type
    if new_name is not None:
        assert len(new_name) == len(name)
        parts[1][:] = np.frombuffer(new_name.encode(), dtype=np.uint8)
    reader.data.flush()


def relative_offsets(path: Path) -> dict[str, int]:
    """Every tensor's data offset relative to the data section, as stored."""
    header = read_gguf_header(path)
    return {t.name: t.offset - header.data_offset for t in header.tensors}


# --------------------------------------------------------------------------------------
# case generators
# --------------------------------------------------------------------------------------


def _flip(data: bytes, pos: int, bit: int) -> tuple[tuple[int, bytes]]:
    return ((pos, bytes([data[pos] ^ (1 << bit)])),)


def header_flips(data: bytes, data_offset: int, n: int, rng: np.random.Generator) -> Iterator[Case]:
    for pos, bit in zip(rng.integers(0, data_offset, n), rng.integers(0, 8, n)):
        yield Case(f"flip byte {pos} bit {bit}", "header flip", _flip(data, int(pos), int(bit)))


def data_flips(
    data: bytes, data_offset: int, n: int, rng: np.random.Generator, checked: list[tuple[int, int]] | None = None
) -> Iterator[Case]:
    """Bit flips anywhere in the data section; with ``checked`` (:func:`checked_ranges`) each is kind
    "data flip, checked rows" or "data flip, other" by where it lands."""
    for pos, bit in zip(rng.integers(data_offset, len(data), n), rng.integers(0, 8, n)):
        kind = "data flip"
        if checked is not None:
            inside = any(a <= pos < b for a, b in checked)
            kind = "data flip, checked rows" if inside else "data flip, other"
        yield Case(f"flip data byte {pos} bit {bit}", kind, _flip(data, int(pos), int(bit)))


def checked_flips(data: bytes, ranges: list[tuple[int, int]], n: int, rng: np.random.Generator) -> Iterator[Case]:
    """Bit flips inside the checksummed rows only (``ranges`` from :func:`checked_ranges`), spread over
    the ranges in proportion to their sizes."""
    sizes = np.array([b - a for a, b in ranges], dtype=np.int64)
    for k, bit in zip(rng.integers(0, int(sizes.sum()), n), rng.integers(0, 8, n)):
        i = int(np.searchsorted(np.cumsum(sizes), k, side="right"))
        pos = ranges[i][0] + int(k - (sizes[:i].sum()))
        yield Case(f"flip checked byte {pos} bit {bit}", "data flip, checked rows", _flip(data, pos, int(bit)))


def truncations(data: bytes, data_offset: int, n: int, rng: np.random.Generator) -> Iterator[Case]:
    sizes = {0, 3, 4, 8, 24, data_offset - 1, data_offset, len(data) - 1}
    sizes |= {int(s) for s in rng.integers(0, data_offset, n // 2)}
    sizes |= {int(s) for s in rng.integers(data_offset, len(data), n - n // 2)}
    for size in sorted(sizes):
        yield Case(f"truncate to {size}", "truncation", size=size)


def tensor_info_edits(clean: Path, only: Collection[str] | None = None) -> Iterator[Case]:
    """For every tensor (or those named in ``only``): offset moved by +-4096, aliased to the next
    tensor, row count doubled, type changed to F32, I8 and an unknown type."""
    offsets = relative_offsets(clean)
    header = read_gguf_header(clean)
    names = sorted(offsets)
    for i, name in enumerate(names):
        if only is not None and name not in only:
            continue
        t = next(t for t in header.tensors if t.name == name)
        other = names[(i + 1) % len(names)]
        yield Case(
            f"{name} offset +4096",
            "tensor info",
            edit=lambda p, n=name: edit_tensor_info(p, n, offset=offsets[n] + 4096),
        )
        yield Case(
            f"{name} offset -4096",
            "tensor info",
            edit=lambda p, n=name: edit_tensor_info(p, n, offset=max(0, offsets[n] - 4096)),
        )
        yield Case(
            f"{name} aliases {other}",
            "tensor info",
            edit=lambda p, n=name, o=other: edit_tensor_info(p, n, offset=offsets[o]),
        )
        doubled = [t.shape[0]] + [2 * d for d in t.shape[1:]] if len(t.shape) > 1 else [2 * t.shape[0]]
        yield Case(f"{name} doubled", "tensor info", edit=lambda p, n=name, d=doubled: edit_tensor_info(p, n, dims=d))
        for new_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I8, 255):
            yield Case(
                f"{name} type {int(new_type)}",
                "tensor info",
                edit=lambda p, n=name, ty=int(new_type): edit_tensor_info(p, n, ggml_type=ty),
            )


def order_edits(clean: Path) -> Iterator[Case]:
    """Each served layer's neuron order with two entries swapped, a duplicate entry, a shuffle."""
    for lay in read_sidecar(clean).layers:
        n = lay.n_ff
        for label, order in (
            ("swap", np.r_[1, 0, 2:n]),
            ("duplicate", np.r_[0, 0, 2:n]),
            ("shuffle", np.random.default_rng(lay.layer).permutation(n)),
        ):
            patch = (lay.order_offset, order.astype("<i4").tobytes())
            yield Case(f"layer {lay.layer} order {label}", "order", (patch,))


def count_edits() -> Iterator[Case]:
    """The header's u64 tensor and key counts, each made huge or zero."""
    for pos in (8, 16):
        for value in (1 << 63, 0xFFFFFFFF, 0):
            yield Case(f"count at {pos} = {value}", "count", ((pos, struct.pack("<Q", value)),))


def block_count_edits(clean: Path, data: bytes) -> Iterator[Case]:
    """The base model's ``<arch>.block_count``: huge, high byte flipped, one more, zero, one."""
    reader = gguf.GGUFReader(clean)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields[f"{arch}.block_count"]
    pos = int(field.offset) + sum(int(p.nbytes) for p in field.parts[: field.data[0]])
    del reader, field
    value = struct.unpack_from("<I", data, pos)[0]
    for new in (0xFFFFFFFF, value ^ 0xFF000000, value + 1, 0, 1):
        yield Case(f"block_count = {new}", "count", ((pos, struct.pack("<I", new)),))


@contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in the block if it runs longer than ``seconds`` (a Python loop over a
    corrupt count is interrupted by the alarm)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def set_uint_metadata(path: Path, key: str, value: int) -> None:
    """Overwrite the scalar unsigned-integer metadata ``key`` of GGUF ``path`` in place."""
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
