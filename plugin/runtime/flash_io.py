"""Asynchronous reads of sidecar byte ranges from flash (the native ``FlashReader``, csrc/io/flash_io.h).

    reader = open_reader("model.flash.gguf", queue_depth=32)
    out = aligned_empty(total_bytes, reader.alignment)
    ticket = reader.submit(offsets, lengths, out)   # returns at once
    ...                                             # compute meanwhile
    reader.wait(ticket)                             # FlashIoError if a read failed

Reads use direct I/O (``O_DIRECT``, bypassing the page cache so they do not count against the memory
budget) where the filesystem allows it; elsewhere they fall back to buffered reads and
:func:`open_reader` warns with :class:`DirectIoFallbackWarning`. Requests need not be aligned:
unaligned ones go through a bounce buffer (one extra copy), see docs/FLASH_IO.md.
"""

from __future__ import annotations

import os
import warnings

from .. import _native
from ..errors import FlashIoError

FlashReader = _native.FlashReader
aligned_empty = _native.aligned_empty

#: Engines a reader can be asked for; "auto" = io_uring when the kernel allows it, else "pool".
ENGINES = ("auto", "io_uring", "pool")

__all__ = [
    "ENGINES",
    "DirectIoFallbackWarning",
    "FlashIoError",
    "FlashReader",
    "aligned_empty",
    "io_uring_available",
    "open_reader",
]


class DirectIoFallbackWarning(UserWarning):
    """Direct I/O was asked for but the file's filesystem does not offer it: reads go through the page
    cache, whose pages count against a memory limit and make flash timings optimistic."""


def io_uring_available() -> tuple[bool, str]:
    """``(True, "")`` when this process can use io_uring, else ``(False, reason)``."""
    ok, why = _native.io_uring_available()
    return bool(ok), str(why)


def open_reader(
    path: str | os.PathLike,
    *,
    engine: str = "auto",
    queue_depth: int = 32,
    direct: bool = True,
    max_op_bytes: int = 1 << 20,
    warn: bool = True,
) -> FlashReader:
    """Open ``path`` for asynchronous range reads.

    Raises :class:`~llamaflash.errors.FlashIoError` when the file cannot be opened or is not a
    file, or when ``engine="io_uring"`` is asked for and unavailable; ``ValueError`` for a bad
    ``engine`` or ``queue_depth``. Warns :class:`DirectIoFallbackWarning` (unless ``warn=False``)
    when ``direct`` was asked for and the reader had to fall back to buffered reads.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    reader = FlashReader(
        os.fspath(path),
        engine=engine,
        queue_depth=int(queue_depth),
        direct=bool(direct),
        max_op_bytes=int(max_op_bytes),
    )
    if direct and not reader.direct and warn:
        warnings.warn(
            f"{os.fspath(path)}: no direct I/O ({reader.fallback_reason}); reading through the page cache, "
            "which counts against the memory budget and hides the disk's real speed. Keep the sidecar on a "
            "disk filesystem (ext4, xfs, btrfs) to read it directly.",
            DirectIoFallbackWarning,
            stacklevel=2,
        )
    return reader
