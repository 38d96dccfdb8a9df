"""Offline check of a sidecar (and its base model) against the sidecar's row checksums.

The integrity section of a sidecar (``docs/SIDECAR.md``, "Integrity") holds the CRC-32C of every row
the engine can read: per served layer the bundle rows and ``ffn_down_t`` rows of the sidecar and the
base model's ``ffn_gate``, ``ffn_up`` and ``ffn_down`` rows. :func:`verify_files` recomputes all of
them (the sidecar's own rows always; the base model's when it is given, after the checks of
:func:`~llamaflash.files.sidecar.validate_pair`) and reports every mismatch. ``llamaflash verify`` prints the
report. The engine runs the same checks on what it reads (csrc/io/integrity.h).

A model that runs as stock although it has a sidecar (the in-memory default, lane_decision) reads its
FFN weights through llama.cpp, not the engine: :class:`BaseRowCheck` checks the base model's FFN rows
against the sidecar's checksums on a thread of its own while llama.cpp loads the model, so a damaged
base model is refused in every mode.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from llamaflash.errors import SidecarIntegrityError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.sidecar import LayerLayout, SidecarInfo, read_sidecar, validate_pair


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
    table = np.fromfile(
        info.path, dtype="<u4", count=n_ff * len(fmt.CHECKSUM_COLUMNS), offset=layout.checksum_offset
    ).reshape(n_ff, len(fmt.CHECKSUM_COLUMNS))
    col = {name: table[:, i] for i, name in enumerate(fmt.CHECKSUM_COLUMNS)}
    L = layout.layer
    yield (
        info.path,
        fmt.bundle_tensor_name(L),
        "ffn_bundle",
        layout.bundle_offset,
        n_ff,
        layout.bundle_stride,
        col["bundle"],
    )
    yield (
        info.path,
        fmt.down_t_tensor_name(L),
        "ffn_down_t",
        layout.down_t_offset,
        n_ff,
        layout.down_t_row_bytes,
        col["down_t"],
    )
    if layout.draft_checksum_offset is not None:  # the draft copy: (n_ff, 2) table, up then down_t
        draft = np.fromfile(info.path, dtype="<u4", count=2 * n_ff, offset=layout.draft_checksum_offset).reshape(
            n_ff, 2
        )
        yield (
            info.path,
            fmt.draft_up_tensor_name(L),
            "ffn_draft_up",
            layout.draft_up_offset,
            n_ff,
            layout.draft_row_bytes,
            draft[:, 0],
        )
        yield (
            info.path,
            fmt.draft_down_t_tensor_name(L),
            "ffn_draft_down_t",
            layout.draft_down_t_offset,
            n_ff,
            layout.draft_row_bytes,
            draft[:, 1],
        )
    if model is None:
        return
    yield (
        model,
        fmt.base_ffn_gate_name(L),
        "ffn_gate.weight",
        layout.base_gate_offset,
        n_ff,
        layout.gate_row_bytes,
        col["base_gate"],
    )
    yield (
        model,
        fmt.base_ffn_up_name(L),
        "ffn_up.weight",
        layout.base_up_offset,
        n_ff,
        layout.up_row_bytes,
        col["base_up"],
    )
    down = np.fromfile(info.path, dtype="<u4", count=layout.n_embd, offset=layout.down_checksum_offset)
    yield (
        model,
        fmt.base_ffn_down_name(L),
        "ffn_down.weight",
        layout.base_down_offset,
        layout.n_embd,
        layout.base_down_row_bytes,
        down,
    )


def verify_files(
    sidecar: str | os.PathLike,
    model: str | os.PathLike | None = None,
    *,
    max_mismatches: int = 20,
    progress: Optional[Callable[[int, int], None]] = None,
) -> VerifyReport:
    """Check every row the sidecar has checksums for: the sidecar's bundle and down_t rows, and with
    ``model`` its FFN gate, up and down rows. Raises what :func:`~llamaflash.files.sidecar.read_sidecar` /
    :func:`~llamaflash.files.sidecar.validate_pair` raise for a file that is malformed or does not belong;
    a row whose checksum differs is reported, never raised. ``progress(layers done, layers)``."""
    if max_mismatches < 0:
        raise ValueError(f"max_mismatches={max_mismatches} must be >= 0")
    model_path = Path(model) if model is not None else None
    info = validate_pair(model_path, sidecar) if model_path is not None else read_sidecar(sidecar)
    report = VerifyReport(
        sidecar=Path(sidecar), model=model_path, algorithm=info.integrity, format_version=info.format_version
    )
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
                    report.mismatches.append(Mismatch(path, tensor, int(row), offset + int(row) * row_bytes, row_bytes))
        if progress is not None:
            progress(i + 1, len(info.layers))
    return report


#: Rows checksummed per read while checking the base model in the background (bounds the memory a
#: mapping's chunk keeps resident on the checking thread: about 8 MiB of rows).
_CHUNK_BYTES = 8 << 20


class BaseRowCheck:
    """The base model's FFN rows (every served layer's ``ffn_gate``, ``ffn_up``, ``ffn_down``) checked
    against the sidecar's CRC-32C checksums on a daemon thread, started at construction. ``wait()``
    joins it and raises :class:`SidecarIntegrityError` for the first damaged row (file, tensor, row,
    byte range, way out: the engine's message); ``checked_bytes`` / ``seconds`` say what it did.
    ``info`` must have checksums (``info.integrity`` not None)."""

    def __init__(self, info: SidecarInfo, model: str | os.PathLike) -> None:
        if info.integrity is None:
            raise ValueError(f"{info.path}: the sidecar has no checksums to check the base model against")
        self._info, self._model = info, Path(model)
        self.checked_bytes = 0
        self.seconds = 0.0
        self._failure: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="llamaflash-base-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            for layout in self._info.layers:
                for path, tensor, _, offset, n_rows, row_bytes, expected in _row_sets(self._info, layout, self._model):
                    if path != self._model:
                        continue
                    if self._check(tensor, offset, n_rows, row_bytes, expected):
                        return
        except BaseException as e:  # an unreadable file: raised by wait()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - start

    def _check(self, tensor: str, offset: int, n_rows: int, row_bytes: int, expected: np.ndarray) -> bool:
        """Checks one tensor's rows in chunks; True (and the failure recorded) at the first mismatch."""
        per_chunk = max(1, _CHUNK_BYTES // row_bytes)
        for first in range(0, n_rows, per_chunk):
            n = min(per_chunk, n_rows - first)
            got = _crc_rows(self._model, offset + first * row_bytes, n, row_bytes)
            self.checked_bytes += n * row_bytes
            bad = np.flatnonzero(got != expected[first : first + n])
            if len(bad):
                row = first + int(bad[0])
                at = offset + row * row_bytes
                from llamaflash import _native

                self._failure = (
                    f"{_native.INTEGRITY_ERROR_PREFIX} in '{self._model}': tensor {tensor} row {row} (bytes {at}.."
                    f"{at + row_bytes}) does not hold what was written (CRC-32C {int(got[bad[0]]):08x}, expected "
                    f"{int(expected[row]):08x}); the base model file is damaged: copy or download it again (a "
                    f"sidecar converted from a damaged model would carry the damage)"
                )
                return True
        return False

    def wait(self) -> None:
        """Joins the check; raises SidecarIntegrityError at a damaged row, or what reading the file raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._failure is not None:
            raise SidecarIntegrityError(f"llamaflash: {self._failure}")
