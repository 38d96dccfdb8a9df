"""Offline check of a sidecar (and its base model) against the sidecar's row checksums.

The integrity section of a sidecar (``docs/SIDECAR.md``, "Integrity") holds the CRC-32C of every row
the engine can read: per served layer the bundle rows and ``ffn_down_t`` rows of the sidecar and the
base model's ``ffn_gate``, ``ffn_up`` and ``ffn_down`` rows. :func:`verify_files` recomputes all of
them (the sidecar's own rows always; the base model's when it is given, after the checks of
:func:`~llamaflash.sidecar.validate_pair`) and reports every mismatch. ``llamaflash verify`` prints the
report. The engine runs the same checks on what it reads (csrc/integrity.h).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llamaflash import sidecar_format as fmt
from llamaflash.sidecar import LayerLayout, SidecarInfo, read_sidecar, validate_pair


@dataclass(frozen=True)
class Mismatch:
    """A row whose bytes do not have the stored checksum: ``offset`` is its absolute byte offset."""

    file: Path
    tensor: str
    row: int
    offset: int
    length: int


@dataclass
class VerifyReport:
    """What :func:`verify_files` checked: per (file, tensor kind) the rows and bytes, and the first
    ``max_mismatches`` mismatches of ``n_mismatches`` in all. ``algorithm`` None: the sidecar has no
    checksums (nothing could be checked)."""

    sidecar: Path
    model: Optional[Path]
    algorithm: Optional[str]
    format_version: int
    checked: dict = field(default_factory=dict)  # "file: tensor kind" -> [rows, bytes]
    mismatches: list = field(default_factory=list)
    n_mismatches: int = 0

    @property
    def ok(self) -> bool:
        return self.algorithm is not None and self.n_mismatches == 0


def _crc_rows(path: Path, offset: int, n_rows: int, row_bytes: int) -> np.ndarray:
    from llamaflash import _native

    rows = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(n_rows * row_bytes,))
    try:
        return _native.crc32c_rows(rows, row_bytes)
    finally:
        del rows


def _row_sets(info: SidecarInfo, layout: LayerLayout, model: Optional[Path]):
    """(file, tensor name, kind, offset, n_rows, row_bytes, expected) of every checked row set."""
    n_ff = layout.n_ff
    table = np.fromfile(info.path, dtype="<u4", count=n_ff * len(fmt.CHECKSUM_COLUMNS),
                        offset=layout.checksum_offset).reshape(n_ff, len(fmt.CHECKSUM_COLUMNS))
    col = {name: table[:, i] for i, name in enumerate(fmt.CHECKSUM_COLUMNS)}
    L = layout.layer
    yield (info.path, fmt.bundle_tensor_name(L), "ffn_bundle", layout.bundle_offset, n_ff, layout.bundle_stride,
           col["bundle"])
    yield (info.path, fmt.down_t_tensor_name(L), "ffn_down_t", layout.down_t_offset, n_ff, layout.down_t_row_bytes,
           col["down_t"])
    if layout.draft_checksum_offset is not None:  # the draft copy: (n_ff, 2) table, up then down_t
        draft = np.fromfile(info.path, dtype="<u4", count=2 * n_ff, offset=layout.draft_checksum_offset).reshape(n_ff, 2)
        yield (info.path, fmt.draft_up_tensor_name(L), "ffn_draft_up", layout.draft_up_offset, n_ff,
               layout.draft_row_bytes, draft[:, 0])
        yield (info.path, fmt.draft_down_t_tensor_name(L), "ffn_draft_down_t", layout.draft_down_t_offset, n_ff,
               layout.draft_row_bytes, draft[:, 1])
    if model is None:
        return
    yield (model, fmt.base_ffn_gate_name(L), "ffn_gate.weight", layout.base_gate_offset, n_ff,
           layout.gate_row_bytes, col["base_gate"])
    yield (model, fmt.base_ffn_up_name(L), "ffn_up.weight", layout.base_up_offset, n_ff, layout.up_row_bytes,
           col["base_up"])
    down = np.fromfile(info.path, dtype="<u4", count=layout.n_embd, offset=layout.down_checksum_offset)
    yield (model, fmt.base_ffn_down_name(L), "ffn_down.weight", layout.base_down_offset, layout.n_embd,
           layout.base_down_row_bytes, down)


def verify_files(sidecar: str | os.PathLike, model: str | os.PathLike | None = None, *,
                 max_mismatches: int = 20, progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Check every row the sidecar has checksums for: the sidecar's bundle and down_t rows, and with
    ``model`` its FFN gate, up and down rows. Raises what :func:`~llamaflash.sidecar.read_sidecar` /
    :func:`~llamaflash.sidecar.validate_pair` raise for a file that is malformed or does not belong;
    a row whose checksum differs is reported, never raised. ``progress(layers done, layers)``."""
    if max_mismatches < 0:
        raise ValueError(f"max_mismatches={max_mismatches} must be >= 0")
    model_path = Path(model) if model is not None else None
    info = validate_pair(model_path, sidecar) if model_path is not None else read_sidecar(sidecar)
    report = VerifyReport(sidecar=Path(sidecar), model=model_path, algorithm=info.integrity,
                          format_version=info.format_version)
    if info.integrity is None:
        return report
    for i, layout in enumerate(info.layers):
        for path, tensor, kind, offset, n_rows, row_bytes, expected in _row_sets(info, layout, model_path):
            got = _crc_rows(path, offset, n_rows, row_bytes)
            key = f"{path.name}: {kind}"
            rows_bytes = report.checked.setdefault(key, [0, 0])
            rows_bytes[0] += n_rows
            rows_bytes[1] += n_rows * row_bytes
            for row in np.flatnonzero(got != expected):
                report.n_mismatches += 1
                if len(report.mismatches) < max_mismatches:
                    report.mismatches.append(Mismatch(path, tensor, int(row), offset + int(row) * row_bytes,
                                                      row_bytes))
        if progress is not None:
            progress(i + 1, len(info.layers))
    return report
