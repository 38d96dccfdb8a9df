"""The one write path of the converter: a :class:`SidecarPlan`, written atomically.

Converter stages describe what goes into the sidecar by filling a :class:`SidecarPlan`:
metadata keys, per-layer values (collected into per-layer uint32 or float32 arrays) and tensors
whose data is produced lazily, one tensor at a time, in plan order, so that memory use
stays at about one tensor however large the model. :func:`write_sidecar_atomically`
then writes the plan with ``gguf.GGUFWriter`` to a temporary file beside the target,
fsyncs it and renames it into place; on any failure (including KeyboardInterrupt) the
temporary file is removed and nothing appears under the target name.

Temporary files of a conversion into ``out`` (all hidden, beside it, ``PID`` the converting
process): ``.<out name>.tmp-PID`` (the sidecar being written), ``.<out name>.quality-PID`` (the
engine's measurement sidecar) and ``..<out name>.quality-PID.tmp-PID`` (the same while written),
``.<out name>.report.json.tmp-PID`` (the report). While a process writes or uses one it holds a
shared ``flock`` on it. :func:`removing_temporaries_on_signal` removes the current process's on
SIGINT, SIGTERM and SIGHUP; :func:`remove_stale_temporaries` removes those whose process is gone
and whose lock nobody holds (a conversion killed with SIGKILL, or by a power cut).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from llamaflash.errors import ConversionError, OutputExistsError
from llamaflash.files import sidecar_format as fmt

#: Called after each tensor is written: (tensors written so far, total, tensor just written).
ProgressCallback = Callable[[int, int, "PlannedTensor"], None]


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written.

    ``shape`` is the logical shape in numpy order (elements, not bytes; the last axis is
    ggml's ne0). ``produce()`` is called once, when the tensor's turn comes, and must
    return a C-contiguous array of exactly :attr:`nbytes` bytes in the layout of
    ``ggml_type`` (for quantized types: the raw block bytes). ``layer`` is the served
    layer the tensor belongs to, or None.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]
    layer: int | None = None

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return gguf.quant_shape_to_byte_shape(self.shape, self.ggml_type)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.byte_shape))


class SidecarPlan:
    """Metadata and tensors of a sidecar, filled by converter stages, written by
    :func:`write_sidecar_atomically`.

    Keys are written in the order first set; tensors in the order added. Setting a key
    twice is an error (two stages disagreeing about the format is a bug).
    """

    def __init__(self) -> None:
        self._metadata: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = {}
        self._layer_arrays: dict[str, tuple[list[Any], gguf.GGUFValueType]] = {}
        self.tensors: list[PlannedTensor] = []
        self._observers: dict[str, list[Callable[[np.ndarray], None]]] = {}

    # metadata -------------------------------------------------------------------------

    def set_string(self, key: str, value: str) -> None:
        self._set(key, value, gguf.GGUFValueType.STRING)

    def set_uint32(self, key: str, value: int) -> None:
        self._set(key, int(value), gguf.GGUFValueType.UINT32)

    def set_uint64(self, key: str, value: int) -> None:
        self._set(key, int(value), gguf.GGUFValueType.UINT64)

    def set_float32(self, key: str, value: float) -> None:
        self._set(key, float(value), gguf.GGUFValueType.FLOAT32)

    def set_uint32_array(self, key: str, values: Sequence[int]) -> None:
        if not values:
            raise ValueError(f"metadata array '{key}' would be empty; GGUF cannot store that")
        self._set(key, [int(v) for v in values], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)

    def set_float32_array(self, key: str, values: Sequence[float]) -> None:
        if len(values) == 0:
            raise ValueError(f"metadata array '{key}' would be empty; GGUF cannot store that")
        self._set(key, [float(v) for v in values], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)

    def append_layer_value(self, key: str, value: int) -> None:
        """Append ``value`` to the per-served-layer uint32 array ``key``.

        Stages call this once per served layer, in layer order; the arrays are written as
        uint32 arrays with one entry per served layer.
        """
        self._append(key, int(value), gguf.GGUFValueType.UINT32)

    def append_layer_float(self, key: str, value: float) -> None:
        """Like :meth:`append_layer_value` for a per-served-layer float32 array."""
        self._append(key, float(value), gguf.GGUFValueType.FLOAT32)

    def metadata(self) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
        """All keys, in write order, as (key, value, type, array element type)."""
        items = [(k, v, t, s) for k, (v, t, s) in self._metadata.items()]
        items += [(k, v, gguf.GGUFValueType.ARRAY, t) for k, (v, t) in self._layer_arrays.items()]
        return items

    def _append(self, key: str, value: Any, vtype: gguf.GGUFValueType) -> None:
        if key in self._metadata:
            raise ValueError(f"metadata key '{key}' is already set as a whole")
        values, existing = self._layer_arrays.setdefault(key, ([], vtype))
        if existing != vtype:
            raise ValueError(f"per-layer array '{key}' mixes {existing.name} and {vtype.name} values")
        values.append(value)

    def _set(self, key: str, value: Any, vtype: gguf.GGUFValueType, sub_type: gguf.GGUFValueType | None = None) -> None:
        if key in self._metadata or key in self._layer_arrays:
            raise ValueError(f"metadata key '{key}' is set twice")
        self._metadata[key] = (value, vtype, sub_type)

    # tensors --------------------------------------------------------------------------

    def add_tensor(self, tensor: PlannedTensor) -> None:
        if any(t.name == tensor.name for t in self.tensors):
            raise ValueError(f"tensor '{tensor.name}' is planned twice")
        self.tensors.append(tensor)

    def observe_tensor(self, name: str, callback: Callable[[np.ndarray], None]) -> None:
        """Call ``callback(data)`` with the bytes produced for the planned tensor ``name`` when it is
        written (so before any tensor planned after it is produced), e.g. to checksum them."""
        if not any(t.name == name for t in self.tensors):
            raise ValueError(f"tensor '{name}' is not planned (yet)")
        self._observers.setdefault(name, []).append(callback)

    def observers(self, name: str) -> list[Callable[[np.ndarray], None]]:
        return self._observers.get(name, [])


def write_sidecar_atomically(
    plan: SidecarPlan,
    out_path: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: ProgressCallback | None = None,
) -> Path:
    """Write ``plan`` as a GGUF sidecar at ``out_path`` and return the path.

    The file is written as ``.<name>.tmp-<pid>`` in the same directory, fsynced, then
    renamed over ``out_path`` (``os.replace``), and the directory is fsynced. Raises
    :class:`OutputExistsError` if ``out_path`` exists and ``force`` is false, and
    :class:`ConversionError` for an OS-level failure (missing directory, no permission,
    disk full). On any exception the temporary file is removed and ``out_path`` is left
    as it was.
    """
    out_path = Path(out_path)
    if out_path.exists() and not force:
        raise OutputExistsError(f"{out_path}: already exists. Pass --force (force=True) to overwrite it.")
    if not out_path.parent.is_dir():
        raise ConversionError(
            f"{out_path}: the directory {out_path.parent} does not exist. Create it or choose another output path."
        )
    tmp_path = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        tmp_path.write_bytes(b"")  # created first, so that it is locked (in use) while written
        with held(tmp_path):
            _write_gguf(plan, tmp_path, progress)
            _fsync_path(tmp_path)
            os.replace(tmp_path, out_path)
        _fsync_path(out_path.parent)
    except OSError as exc:
        tmp_path.unlink(missing_ok=True)
        raise ConversionError(
            f"{out_path}: writing the sidecar failed ({exc}); nothing was written. "
            "Check free disk space and permissions, then retry."
        ) from exc
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return out_path


def _write_gguf(plan: SidecarPlan, path: Path, progress: ProgressCallback | None) -> None:
    writer = gguf.GGUFWriter(path, fmt.SIDECAR_ARCHITECTURE)
    try:
        writer.add_custom_alignment(fmt.SIDECAR_ALIGNMENT)
        for key, value, vtype, sub_type in plan.metadata():
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
        for t in plan.tensors:
            writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(plan.tensors):
            data = np.ascontiguousarray(t.produce())
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor '{t.name}': produced {data.nbytes} bytes, planned {t.nbytes}")
            for observe in plan.observers(t.name):
                observe(data)
            writer.write_tensor_data(data)
            if progress is not None:
                progress(i + 1, len(plan.tensors), t)
    finally:
        writer.close()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# temporary files
# --------------------------------------------------------------------------------------

#: A hidden temporary of a conversion: one or two dots, the rest, then ``.tmp-PID`` or ``.quality-PID``.
_TEMPORARY_RE = re.compile(r"^\.\.?(?P<rest>.+)\.(?:tmp|quality)-(?P<pid>\d+)$")


@contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold a shared ``flock`` on ``path`` (which must exist) for the block: the file is in use, and
    :func:`remove_stale_temporaries` leaves it alone whatever its name's PID says."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def temporary_pid(name: str, out_name: str) -> int | None:
    """The PID in ``name`` if it is a conversion temporary of ``out_name`` or of any ``*.flash.gguf``
    output (module docstring), else None. Other hidden files are never taken for one."""
    m = _TEMPORARY_RE.match(name)
    if m is None:
        return None
    rest = m.group("rest")
    if rest == out_name or rest.startswith(out_name + ".") or fmt.SIDECAR_SUFFIX in rest:
        return int(m.group("pid"))
    return None


def own_temporaries(out: Path) -> list[Path]:
    """This process's temporaries of a conversion into ``out`` that exist now."""
    pid, found = os.getpid(), []
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    for entry in entries:
        m = _TEMPORARY_RE.match(entry.name)
        if (
            m
            and int(m.group("pid")) == pid
            and (m.group("rest") == out.name or m.group("rest").startswith(out.name + "."))
        ):
            found.append(Path(entry.path))
    return found


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _lock_is_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_stale_temporaries(out: Path) -> tuple[list[tuple[Path, int]], list[tuple[Path, int]]]:
    """Remove the conversion temporaries in ``out``'s directory (of ``out`` or of any ``*.flash.gguf``)
    left by processes that no longer exist and locked by nobody. Returns (removed, kept): each a list
    of (path, PID); kept ones belong to a running process or are locked (in use)."""
    removed: list[tuple[Path, int]] = []
    kept: list[tuple[Path, int]] = []
    try:
        entries = sorted(os.scandir(out.parent), key=lambda e: e.name)
    except OSError:
        return removed, kept
    for entry in entries:
        pid = temporary_pid(entry.name, out.name)
        if pid is None or not entry.is_file(follow_symlinks=False) or pid == os.getpid():
            continue
        path = Path(entry.path)
        if _process_exists(pid) or not _lock_is_free(path):
            kept.append((path, pid))
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append((path, pid))
    return removed, kept


@contextmanager
def removing_temporaries_on_signal(out: Path) -> Iterator[None]:
    """For the block: on SIGINT, SIGTERM or SIGHUP, remove this process's temporaries of a conversion
    into ``out`` first; then SIGINT raises KeyboardInterrupt as usual, and SIGTERM/SIGHUP end the
    process with their default action (status 128 + signal). A handler is installed only for a
    signal whose disposition is Python's default (an application's own handler, or an ignored
    signal, is left alone), and only in the main thread (the only one Python delivers signals to).
    Removing the files in the handler itself, rather than by unwinding, also covers a signal that
    arrives while llama.cpp calls back into Python, where an exception would be swallowed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame) -> None:
        for path in own_temporaries(out):
            path.unlink(missing_ok=True)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    defaults = {
        signal.SIGINT: signal.default_int_handler,
        signal.SIGTERM: signal.SIG_DFL,
        signal.SIGHUP: signal.SIG_DFL,
    }
    installed = []
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            signal.signal(signum, on_signal)
            installed.append((signum, default))
    try:
        yield
    finally:
        for signum, default in installed:
            signal.signal(signum, default)
