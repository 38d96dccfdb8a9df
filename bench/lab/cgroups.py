"""Memory-limited child processes (cgroup v1): the memory and blkio groups a run is placed in, and
:func:`run_in_cgroup`, which evicts the files, starts one process inside fresh groups, times it out
and classifies its end (see :mod:`llamaflash.bench.memlimit`)."""

from __future__ import annotations

import itertools
import mmap
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .pagecache import MiB, evict_files

STATUSES = ("ok", "OOM", "timeout", "killed", "error")


class CgroupError(RuntimeError):
    """A cgroup could not be created, configured or joined."""


def _v1_mount(controller: str, mounts: str = "/proc/self/mounts") -> Path | None:
    """Mount point of the cgroup v1 hierarchy holding ``controller``, or None."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and controller in parts[3].split(","):
            return Path(parts[1])
    return None


def _own_group(controller: str) -> str:
    """This process's group (path inside the hierarchy) for a v1 ``controller``; "/" if unknown."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            if controller in ctrls.split(","):
                return path or "/"
    except (OSError, ValueError):
        pass
    return "/"


def _read_kv(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            try:
                out[k] = int(v)
            except ValueError:
                pass
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


_counter = itertools.count()


def _make_child(mount: Path, controller: str, check_file: str, prefix: str) -> Path:
    """mkdir a fresh child group: under this process's own group first, at the hierarchy root otherwise."""
    name = f"{prefix}-{os.getpid()}-{next(_counter)}"
    errors = []
    own = _own_group(controller).lstrip("/")
    for parent in dict.fromkeys([mount / own, mount]):
        if not (parent / check_file).exists():
            continue
        path = parent / name
        try:
            path.mkdir()
            return path
        except OSError as e:
            errors.append(f"{path}: {e.strerror or e}")
    raise CgroupError(f"cannot create a {controller} cgroup ({'; '.join(errors) or 'no writable group'})")


def _remove_group(path: Path, attempts: int = 50) -> bool:
    """rmdir a (v1) group once its processes are gone; True when removed."""
    for _ in range(attempts):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    return False


class MemoryCgroup:
    """A fresh cgroup v1 memory group with a limit on memory (+ swap where memsw exists).

    Use as a context manager (removes the group), join a process with :meth:`join` (from the
    process itself, e.g. in ``preexec_fn``) or :meth:`add_pid`, read :meth:`stats` after the run.
    """

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, limit_bytes: int, prefix: str = "llamaflash-bench") -> "MemoryCgroup":
        mount = _v1_mount("memory")
        if mount is None:
            raise CgroupError("no cgroup v1 memory controller is mounted")
        cg = cls(_make_child(mount, "memory", "memory.limit_in_bytes", prefix))
        try:
            cg.set_limit(limit_bytes)
        except BaseException:
            cg.remove()
            raise
        return cg

    def set_limit(self, limit_bytes: int) -> None:
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # no swapping out of the limit either (memsw >= memory is required)
                memsw.write_text(str(int(limit_bytes)))
        except OSError as e:
            raise CgroupError(f"cannot set the limit of {self.path}: {e}") from e
        got = _read_int(self.path / "memory.limit_in_bytes")
        if got is None or abs(got - limit_bytes) > mmap.PAGESIZE:
            raise CgroupError(f"{self.path}: asked for a limit of {limit_bytes} bytes, the kernel set {got}")

    @property
    def limit_bytes(self) -> int | None:
        return _read_int(self.path / "memory.limit_in_bytes")

    def add_pid(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def join(self) -> None:
        """Move the calling process into the group."""
        self.add_pid(os.getpid())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        return _read_kv(self.path / "memory.oom_control").get("oom_kill", 0)

    def stats(self) -> dict[str, Any]:
        """Limit, usage, peak (``max_usage``: process memory + page cache), limit hits, OOM kills and
        a few memory.stat counters."""
        oom = _read_kv(self.path / "memory.oom_control")
        stat = _read_kv(self.path / "memory.stat")
        return {
            "limit_bytes": self.limit_bytes,
            "usage_bytes": _read_int(self.path / "memory.usage_in_bytes"),
            "max_usage_bytes": _read_int(self.path / "memory.max_usage_in_bytes"),
            "memsw_max_usage_bytes": _read_int(self.path / "memory.memsw.max_usage_in_bytes"),
            "failcnt": _read_int(self.path / "memory.failcnt"),
            "oom_kill": oom.get("oom_kill", 0),
            "under_oom": oom.get("under_oom", 0),
            "stat": {
                k: stat[k]
                for k in ("cache", "rss", "mapped_file", "pgmajfault", "total_cache", "total_rss")
                if k in stat
            },  # fmt: skip
        }

    def remove(self) -> bool:
        return _remove_group(self.path)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _block_device_of(path: str | os.PathLike) -> str | None:
    """ "major:minor" of the whole disk holding ``path`` (throttle rules take disks, not partitions)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / dev
    if not sys_dev.exists():
        return None
    if (sys_dev / "partition").exists():
        try:
            return (sys_dev.resolve().parent / "dev").read_text().strip()
        except OSError:
            return None
    return dev


class BlkioCgroup:
    """A cgroup v1 blkio group that counts the bytes its processes read from one disk.

    The kernel's v1 throttle statistics only count I/O to a device that has a throttle rule, so
    the group gets a rule that never throttles (1 TiB/s)."""

    NO_LIMIT_BPS = 1 << 40

    def __init__(self, path: Path, device: str):
        self.path, self.device = path, device

    @classmethod
    def create(cls, file_on_disk: str | os.PathLike, prefix: str = "llamaflash-bench") -> "BlkioCgroup":
        mount = _v1_mount("blkio")
        if mount is None:
            raise CgroupError("no cgroup v1 blkio controller is mounted")
        device = _block_device_of(file_on_disk)
        if device is None:
            raise CgroupError(f"no block device found for {file_on_disk}")
        path = _make_child(mount, "blkio", "blkio.throttle.read_bps_device", prefix)
        try:
            (path / "blkio.throttle.read_bps_device").write_text(f"{device} {cls.NO_LIMIT_BPS}")
        except OSError as e:
            _remove_group(path)
            raise CgroupError(f"cannot enable blkio accounting on {device}: {e}") from e
        return cls(path, device)

    def add_pid(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def read_bytes(self) -> int | None:
        try:
            for line in (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                    return int(parts[2])
        except OSError:
            return None
        return 0

    def remove(self) -> bool:
        return _remove_group(self.path)


def memory_cgroup_support() -> tuple[bool, str]:
    """(usable, why): can this process create a cgroup v1 memory group, limit it and remove it?"""
    if _v1_mount("memory") is None:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        extra = ""
        try:
            if v2.exists() and "memory" in v2.read_text().split():
                extra = " (a cgroup v2 memory controller exists, but this harness drives cgroup v1 only)"
        except OSError:
            pass
        return False, "no cgroup v1 memory controller is mounted" + extra
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return False, "creating memory cgroups needs root"
    try:
        cg = MemoryCgroup.create(64 * MiB, prefix="llamaflash-probe")
    except (CgroupError, OSError) as e:
        return False, str(e)
    where = str(cg.path.parent)
    if not cg.remove():
        return False, f"created {cg.path} but could not remove it"
    return True, f"cgroup v1 memory controller, groups under {where}"


# --------------------------------------------------------------------------------------------
# one process under a limit


@dataclass
class Outcome:
    """How one process ran under a limit."""

    status: str  # one of STATUSES
    returncode: int | None
    wall_s: float
    stdout: str
    stderr: str
    limit_mb: int | None
    cgroup: dict[str, Any] | None = None  # MemoryCgroup.stats() after the run
    blkio_read_bytes: int | None = None
    eviction: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def signal(self) -> str | None:
        if self.returncode is not None and self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return str(-self.returncode)
        return None


def classify(returncode: int | None, timed_out: bool, oom_kills: int, failed: bool = False) -> str:
    """``timeout`` (we killed it), ``OOM`` (SIGKILL and the group's OOM killer fired), ``killed``
    (another signal, or SIGKILL from elsewhere), ``error`` (exit status != 0 or no result), ``ok``."""
    if timed_out:
        return "timeout"
    if returncode is not None and returncode < 0:
        return "OOM" if (returncode == -signal.SIGKILL and oom_kills > 0) else "killed"
    if failed or returncode != 0:
        return "error"
    return "ok"


def run_in_cgroup(
    argv: Sequence[str],
    limit_mb: int | None,
    *,
    timeout: float,
    evict_paths: Sequence[str | os.PathLike] = (),
    blkio_file: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
) -> Outcome:
    """Evict ``evict_paths`` from the page cache, then run ``argv`` inside a fresh memory cgroup of
    ``limit_mb`` (None: no group, no limit) and, when ``blkio_file`` is given and possible, a blkio
    group counting reads from that file's disk.  The process joins the groups before it executes
    anything, so all of its memory and the page cache it faults in are charged.  Never raises for
    what the process does: a limit it overruns comes back as ``status="OOM"``."""
    notes: list[str] = []
    mem = MemoryCgroup.create(limit_mb * MiB) if limit_mb is not None else None
    blk = None
    try:
        if blkio_file is not None:
            try:
                blk = BlkioCgroup.create(blkio_file)
            except (CgroupError, OSError) as e:
                notes.append(f"blkio accounting unavailable: {e}")
        eviction = evict_files(evict_paths)
        for ev in eviction:
            if not ev["evicted"]:
                notes.append(f"{ev['resident_after'] / MiB:.0f} MB of {ev['path']} stay in the page cache after "
                             f"eviction (mapped by another process?): the group is not charged for them")  # fmt: skip
        groups = [g for g in (mem, blk) if g is not None]

        def enter_groups() -> None:  # in the child, between fork and exec
            for g in groups:
                g.add_pid(os.getpid())

        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, preexec_fn=enter_groups if groups else None)  # fmt: skip
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            out, err = proc.communicate()
        except BaseException:  # interrupted: leave no process behind (and the group removable)
            proc.kill()
            proc.wait()
            raise
        wall = time.perf_counter() - t0
        stats = mem.stats() if mem is not None else None
        status = classify(proc.returncode, timed_out, stats["oom_kill"] if stats else 0)
        if stats and stats["oom_kill"] and status == "ok":
            notes.append(f"the OOM killer fired {stats['oom_kill']} time(s) in the group, the process survived")
        return Outcome(status=status, returncode=proc.returncode, wall_s=wall, stdout=out or "", stderr=err or "",
                       limit_mb=limit_mb, cgroup=stats, blkio_read_bytes=blk.read_bytes() if blk else None,
                       eviction=eviction, notes=notes)  # fmt: skip
    finally:
        for g in (mem, blk):
            if g is not None and not g.remove():
                notes.append(f"could not remove {g.path}")
