"""The page cache side of a memory-limit run: how much of a file is resident (``mincore``), evicting
it (``posix_fadvise(POSIX_FADV_DONTNEED)``, checked), and private copies of files that another
process keeps cached (see :mod:`llamaflash.bench.memlimit`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

MiB = 1 << 20

#: After eviction, more than this much of a file still resident flags the run.
EVICT_TOLERANCE_BYTES = 4 * MiB


_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        _libc = libc
    return _libc


def resident_bytes(path: str | os.PathLike) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` over a fresh read-only mapping; the
    mapping itself faults nothing in)."""
    libc = _c()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path} failed: {os.strerror(err)}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore on {path} failed: {os.strerror(err)}")
            resident_pages = sum(b & 1 for b in bytes(vec))
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
        return min(size, resident_pages * mmap.PAGESIZE)
    finally:
        os.close(fd)


def evict(path: str | os.PathLike) -> None:
    """Drop the clean page-cache pages of ``path`` (pages another process maps stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_files(paths: Iterable[str | os.PathLike], attempts: int = 3) -> list[dict[str, Any]]:
    """Evict every file and measure what stays resident: one dict per file with ``path``,
    ``bytes``, ``resident_before``, ``resident_after``, ``evicted`` (resident_after within
    :data:`EVICT_TOLERANCE_BYTES`)."""
    out = []
    for p in paths:
        before = resident_bytes(p)
        after = before
        for _ in range(attempts):
            evict(p)
            after = resident_bytes(p)
            if after <= EVICT_TOLERANCE_BYTES:
                break
            time.sleep(0.05)
        out.append({"path": str(p), "bytes": os.path.getsize(p), "resident_before": before,
                    "resident_after": after, "evicted": after <= EVICT_TOLERANCE_BYTES})  # fmt: skip
    return out


def private_copies(paths: Sequence[str | os.PathLike], directory: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Copy each file into ``directory`` (synced, so its clean pages can be evicted), reusing a copy
    of the same name and size; returns (the copies in order, the ones this call created).

    A copy no other process maps can always be evicted: benchmark the copy when others may be
    running the same model file."""
    d = Path(directory).expanduser().resolve()
    d.mkdir(parents=True, exist_ok=True)
    copies, created = [], []
    for p in map(Path, paths):
        dst = d / p.name
        if dst.resolve() == p.resolve():
            copies.append(dst)
            continue
        if not (dst.is_file() and dst.stat().st_size == p.stat().st_size):
            tmp = dst.with_name(dst.name + ".part")
            shutil.copyfile(p, tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, dst)
            created.append(dst)
        copies.append(dst)
    return copies, created
