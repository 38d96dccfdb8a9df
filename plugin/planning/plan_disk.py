"""The planner's disk model: device seconds per read request from a disk profile
(:func:`~llamaflash.planning.disk_probe.probe_disk`'s format: IOPS measured per request size and queue depth),
and the built-in conservative profile used when none is given."""

from __future__ import annotations

from typing import Any

import numpy as np


def default_disk() -> dict[str, Any]:
    """A conservative built-in disk profile, in :func:`~llamaflash.planning.disk_probe.probe_disk`'s format (not
    measured): 150 us per request plus 400 MB/s transfer, at most 25k IOPS and 400 MB/s; about half
    of what the development VM's disk measured (docs/PLANNER.md)."""
    points = []
    for kib in (4, 16, 32, 64, 256):
        for depth in (1, 4, 16, 32):
            size = kib * 1024
            iops = min(depth / (150e-6 + size / 400e6), 25_000.0, 400e6 / size)
            points.append(
                {"request_kib": kib, "depth": depth, "iops": round(iops, 1), "mb_s": round(iops * size / 1e6, 1)}
            )
    return {"source": "built-in default (not measured)", "direct": True, "points": points}


class DiskModel:
    """Device time per request from a probe result: 1/IOPS at the measured sizes and depths,
    interpolated linearly in depth and size; beyond the largest size, bandwidth-bound.
    ``depths``: the measured queue depths, ascending."""

    def __init__(self, result: dict[str, Any]) -> None:
        pts = result.get("points") or []
        self.sizes = np.array(sorted({p["request_kib"] * 1024 for p in pts}), dtype=float)
        self.depths = np.array(sorted({p["depth"] for p in pts}), dtype=float)
        if not len(self.sizes):
            raise ValueError("the disk profile has no measured points")
        iops = {(p["request_kib"] * 1024, p["depth"]): float(p["iops"]) for p in pts}
        try:
            self.iops = np.array([[iops[(s, d)] for d in self.depths] for s in self.sizes])
        except KeyError as e:
            raise ValueError(f"the disk profile lacks the point {e.args[0]} (size, depth)") from None

    def seconds(self, nbytes: np.ndarray, depth: float) -> np.ndarray:
        """Device seconds per request of ``nbytes`` with ``depth`` requests in flight."""
        t = 1.0 / np.array([np.interp(depth, self.depths, row) for row in self.iops])
        out = np.interp(nbytes, self.sizes, t)
        big = nbytes > self.sizes[-1]
        out[big] = t[-1] * nbytes[big] / self.sizes[-1]
        return out


def disk_throughput(disk: dict[str, Any], request_bytes: float, depth: int) -> float:
    """Bytes per second a disk profile gives for reads of ``request_bytes`` at ``depth`` in flight."""
    return request_bytes / float(DiskModel(disk).seconds(np.array([float(request_bytes)]), depth)[0])


def disk_source(disk: dict[str, Any] | None) -> str:
    """One line saying where a disk profile came from (None: the built-in default)."""
    if disk is None:
        return default_disk()["source"]
    if disk.get("source"):
        return str(disk["source"])
    saved = f", saved {disk['saved_at']}" if disk.get("saved_at") else ""
    return (
        f"probed {disk.get('directory')} ({disk.get('filesystem')}, {disk.get('engine')}, "
        f"{'direct I/O' if disk.get('direct') else 'page cache: not direct I/O'}{saved})"
    )
