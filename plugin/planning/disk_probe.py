"""Measure a disk's random-read speed the way llamaflash reads bundles: the planner's input.

:func:`probe_disk` writes a scratch file in the directory that will hold the sidecar (default
``~/.cache/llamaflash``), evicts it from the page cache, and times random reads of several request
sizes at several queue depths through :class:`~llamaflash.runtime.flash_io.FlashReader` with direct I/O
(each point a fixed time, ``seconds``), then deletes the file. It returns a plain dict (JSON-ready):

    {"directory", "filesystem", "engine", "direct", "fallback_reason", "alignment", "file_mb",
     "seconds_per_point", "sequential_mb_s",
     "points": [{"request_kib", "depth", "reads", "iops", "mb_s", "latency_us"}, ...]}

``latency_us`` is depth ÷ IOPS (Little's law): the mean time a read spends in flight. Where direct
I/O is unavailable (tmpfs, ...) the numbers are page-cache speeds and ``direct`` is False.

A probe is measured once per disk: :func:`save_profile` keeps it under the cache directory, keyed by
the filesystem's device number, and :func:`saved_profile` finds it again for any path on that
filesystem (``llamaflash plan --probe-disk`` saves; ``llamaflash plan`` and
``Llama(ram_budget_mb=...)`` use a saved profile when there is one).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..errors import FlashIoError

DEFAULT_SIZES_KIB = (4, 16, 32, 64, 256)
DEFAULT_DEPTHS = (1, 4, 16, 32)
#: Large enough that the device's (and a hypervisor's) caches do not serve most reads.
DEFAULT_FILE_MB = 512
#: Cap on seconds per point (the planner probes once; a probe must stay short).
MAX_SECONDS_PER_POINT = 2.0


def default_directory(sidecar: str | os.PathLike | None = None) -> Path:
    """Beside the sidecar when one is given, else ``~/.cache/llamaflash``."""
    if sidecar is not None:
        return Path(sidecar).resolve().parent
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llamaflash"


def _profile_path(path: str | os.PathLike, cache_dir: str | os.PathLike | None) -> Path:
    """Where the saved profile of the filesystem holding ``path`` lives."""
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent
    root = Path(cache_dir) if cache_dir is not None else default_directory()
    return root / "disk-profiles" / f"dev-{os.stat(target).st_dev:x}.json"


def save_profile(result: dict[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """Keeps a :func:`probe_disk` result for the filesystem it measured (its ``directory``); returns
    the file written (replaced atomically: a concurrent reader sees the old or the new profile)."""
    out = _profile_path(result["directory"], cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**result, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    os.replace(tmp, out)
    return out


def saved_profile(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The saved profile of the filesystem holding ``path`` (a file or directory), or None when that
    disk was never probed or its file is unreadable."""
    try:
        data = json.loads(_profile_path(path, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("points") else None


def resolve_profile(
    spec: str | os.PathLike | dict[str, Any] | None,
    sidecar: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
) -> dict[str, Any] | None:
    """The disk profile the planner should use for ``sidecar``: ``spec`` None = the saved profile of
    its filesystem if there is one, else None (the planner's built-in default); "default" = None;
    "probe" = measure now beside the sidecar (a few seconds, a scratch file) and save it; a dict =
    itself; anything else = the path of a saved probe result (JSON). Raises ValueError for a file that
    is not a probe result."""
    if spec is None:
        return saved_profile(sidecar, cache_dir)
    if isinstance(spec, dict):
        return spec
    if str(spec) == "default":
        return None
    if str(spec) == "probe":
        result = probe_disk(default_directory(sidecar), seconds=0.25, file_mb=256)
        save_profile(result, cache_dir)
        return result
    try:
        data = json.loads(Path(spec).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"disk profile {spec!s}: {e}; pass a JSON file written by llamaflash plan --probe-disk "
            "or bench/bench_disk.py, 'probe', 'default' or None"
        ) from e
    if not isinstance(data, dict) or not data.get("points"):
        raise ValueError(f"disk profile {spec!s} has no measured points; pass a disk probe result")
    return data


def _filesystem(path: Path) -> str | None:
    """Type of the filesystem holding ``path`` (longest matching mount point in /proc/mounts)."""
    best, fstype = "", None
    try:
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3:
                mnt = parts[1].replace("\\040", " ")
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        return None
    return fstype


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_scratch(path: Path, nbytes: int) -> None:
    """Incompressible, non-repeating contents (no filesystem compression or dedup helps reads)."""
    chunk = 4 << 20
    block = np.random.default_rng(12345).integers(0, 256, chunk, dtype=np.uint8)
    with open(path, "wb") as f:
        for i in range(0, nbytes, chunk):
            block[:8] = np.frombuffer(np.int64(i).tobytes(), dtype=np.uint8)
            f.write(block[: min(chunk, nbytes - i)].tobytes())
        f.flush()
        os.fsync(f.fileno())


def probe_disk(
    directory: str | os.PathLike | None = None,
    *,
    sizes_kib: Iterable[int] = DEFAULT_SIZES_KIB,
    depths: Iterable[int] = DEFAULT_DEPTHS,
    seconds: float = 0.5,
    file_mb: int = DEFAULT_FILE_MB,
    engine: str = "auto",
    sequential: bool = True,
) -> dict[str, Any]:
    """Random-read throughput of the disk holding ``directory`` (see the module docstring).

    Raises :class:`~llamaflash.errors.FlashIoError` when the scratch file cannot be written (the
    message names the directory) or read.
    """
    from ..runtime.flash_io import io_uring_available, open_reader  # the native reader: loads llama.cpp's ggml

    seconds = min(max(float(seconds), 0.05), MAX_SECONDS_PER_POINT)
    sizes = sorted({int(s) for s in sizes_kib})
    depth_list = sorted({int(d) for d in depths})
    directory = Path(directory) if directory is not None else default_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        free_mb = shutil.disk_usage(directory).free >> 20
    except OSError as e:
        raise FlashIoError(f"cannot use {directory} for the disk probe: {e}; pass another directory") from e
    file_mb = int(min(file_mb, max(free_mb // 4, 0)))
    if file_mb * 1024 < 4 * max(sizes):
        raise FlashIoError(
            f"{directory} has only {free_mb} MB free: too little for the disk probe; "
            "pass a directory on a disk with free space"
        )
    scratch = directory / f".llamaflash-disk-probe-{os.getpid()}.tmp"
    result: dict[str, Any] = {
        "directory": str(directory),
        "filesystem": _filesystem(directory),
        "file_mb": file_mb,
        "seconds_per_point": seconds,
        "io_uring": list(io_uring_available()),
        "points": [],
    }
    try:
        try:
            _write_scratch(scratch, file_mb << 20)
        except OSError as e:
            raise FlashIoError(
                f"cannot write the disk probe's scratch file {scratch}: {e}; pass a writable directory with free space"
            ) from e
        _evict(scratch)
        t_start = time.perf_counter()
        for depth in depth_list:
            reader = open_reader(scratch, engine=engine, queue_depth=depth, warn=False)
            try:
                result.update(
                    engine=reader.engine,
                    direct=reader.direct,
                    fallback_reason=reader.fallback_reason,
                    alignment=reader.alignment,
                )
                for kib in sizes:
                    _evict(scratch)
                    m = reader.measure_random_reads(kib << 10, depth, seconds, seed=depth * 1000 + kib)
                    iops = m["reads"] / m["seconds"]
                    result["points"].append(
                        {
                            "request_kib": kib,
                            "depth": depth,
                            "reads": m["reads"],
                            "iops": round(iops, 1),
                            "mb_s": round(m["bytes"] / m["seconds"] / 1e6, 1),
                            "latency_us": round(depth / iops * 1e6, 1),
                        }
                    )
            finally:
                reader.close()
        if sequential:
            result["sequential_mb_s"] = _sequential_mb_s(scratch, engine, seconds)
        result["probe_seconds"] = round(time.perf_counter() - t_start, 2)
    finally:
        try:
            scratch.unlink()
        except FileNotFoundError:
            pass
    return result


def _sequential_mb_s(path: Path, engine: str, seconds: float) -> float:
    """Streaming throughput: 1 MiB reads in file order, 8 in flight, for about ``seconds``."""
    from ..runtime.flash_io import aligned_empty, open_reader

    _evict(path)
    size = path.stat().st_size
    block, depth = 1 << 20, 8
    reader = open_reader(path, engine=engine, queue_depth=depth, warn=False)
    try:
        out = aligned_empty(block * depth, max(reader.alignment, 4096))
        offsets = np.arange(depth, dtype=np.int64) * block
        lengths = np.full(depth, block, dtype=np.int64)
        done, pos, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds and pos + block * depth <= size:
            reader.read(offsets + pos, lengths, out)
            pos += block * depth
            done += block * depth
        elapsed = time.perf_counter() - t0
    finally:
        reader.close()
    return round(done / elapsed / 1e6, 1) if elapsed > 0 and done else 0.0


def point(result: dict[str, Any], request_kib: int, depth: int) -> dict[str, Any] | None:
    """The measured point of ``result`` for that request size and depth, if it was measured."""
    for p in result.get("points", []):
        if p["request_kib"] == request_kib and p["depth"] == depth:
            return p
    return None


def format_table(result: dict[str, Any]) -> str:
    """Rows: request size; columns: queue depth; cells: ``IOPS / MB/s``."""
    pts = result.get("points", [])
    sizes = sorted({p["request_kib"] for p in pts})
    depths = sorted({p["depth"] for p in pts})
    head = "| request | " + " | ".join(f"QD {d}" for d in depths) + " |"
    lines = [head, "|---" * (len(depths) + 1) + "|"]
    for s in sizes:
        cells = []
        for d in depths:
            p = point(result, s, d)
            cells.append(f"{p['iops']:,.0f} IOPS / {p['mb_s']:,.0f} MB/s" if p else "-")
        lines.append(f"| {s} KiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)
