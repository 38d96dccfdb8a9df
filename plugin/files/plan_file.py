"""The plan file: one served model's engine configuration as data, for hosts without Python.

``llamaflash env`` plans a model as :class:`llamaflash.Llama` does and stores the outcome here; the
backend library (csrc/backend/dl_backend.cpp) that stock llama.cpp tools load reads it at start and opens
the same engine. The served part of a plan, :class:`EnginePlan`, is the native engine configuration itself:
``_native.EngineConfig`` (dense FFN models) or ``_native.ExpertConfig`` (MoE models), plus a
:class:`PlanIdentity` saying what it was made for (the C++ ``Plan`` of csrc/backend/plan_reader.h).
:mod:`llamaflash.runtime.model_plan` makes it for both hosts; ``llamaflash.Llama`` opens it through
:func:`in_memory` and ``_native.open_plan``, the entry point the library uses
(csrc/backend/plan_reader.h). Format: a GGUF file with key-value pairs only; the keys and their types
are :mod:`llamaflash.files.plan_keys` (the one definition both languages use), documented in
docs/TOOLS.md. Written here (key-value pairs are all a plan has, and loading a model never imports gguf-py): to a
path atomically (temporary file, fsync, rename), or to an anonymous in-memory file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import plan_keys as K
from .gguf_header import _NUMPY_TYPES, _SCALAR_FORMATS, GGUF_MAGIC
from .gguf_header import ValueType as T

#: the GGUF version written
GGUF_VERSION = 3
#: general.architecture of a plan file (gguf-py writes one)
PLAN_ARCHITECTURE = "llamaflash-plan"


@dataclass(frozen=True)
class PlanIdentity:
    """What a plan was made for and with (the library refuses a plan whose identity does not hold)."""

    kind: str  # K.KIND_DENSE | K.KIND_EXPERTS
    mode: str  # "dense" | "sparse" | "offload" | "experts"
    reason: str
    model_path: str
    sidecar_path: str
    ram_budget_mb: float  # 0: in memory
    n_ctx: int
    n_batch: int
    n_ubatch: int
    tool_args: str
    ggml_commit: str = ""
    ggml_version: str = ""


@dataclass
class EnginePlan:
    """One served model's plan: its identity and exactly one engine configuration. ``routers``: MoE
    layer -> the router's TensorInfo in the base file (or None); the reader loads each as float32 from
    there, so ``experts`` carries no router matrices. ``lock_ranges``: required with ``experts``."""

    identity: PlanIdentity
    dense: Any = None  # _native.EngineConfig
    experts: Any = None  # _native.ExpertConfig
    routers: Optional[Dict[int, Any]] = None
    #: experts: the dense part's file ranges [start, end), locked in RAM after load (expert_runtime.dense_ranges)
    lock_ranges: Sequence[Tuple[int, int]] = ()


def ggml_identity() -> tuple[str, str]:
    """ggml_commit() and ggml_version() of the libggml llama_cpp loads (the library checks both)."""
    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so.0"))
    lib.ggml_commit.restype = lib.ggml_version.restype = ctypes.c_char_p
    return lib.ggml_commit().decode(), lib.ggml_version().decode()


def default_plan_path(sidecar: str | os.PathLike) -> Path:
    """``<sidecar without .gguf>.plan.gguf`` beside the sidecar."""
    sidecar = Path(sidecar)
    stem = sidecar.name[: -len(".gguf")] if sidecar.name.endswith(".gguf") else sidecar.name
    return sidecar.with_name(stem + K.PLAN_SUFFIX)


def library_path() -> Path:
    """The installed backend library (libllamaflash_backend.so beside the package)."""
    return Path(__file__).resolve().parent.parent / "libllamaflash_backend.so"


class _Kv:
    """Collects typed key-value pairs in order."""

    def __init__(self) -> None:
        self.items: List[tuple] = []

    def add(self, key: str, value: Any, vtype: T, sub_type: Optional[T] = None) -> None:
        self.items.append((key, value, vtype, sub_type))

    def ints(self, key: str, values: Sequence[int]) -> None:
        self.add(key, [int(v) for v in values], T.ARRAY, T.INT64)

    def ragged(self, key: str, counts_key: str, rows: Sequence[Sequence[Any]], sub_type) -> None:
        rows = [list(np.asarray(r).ravel().tolist()) for r in rows]
        self.ints(counts_key, [len(r) for r in rows])
        flat = [v for r in rows for v in r]
        if flat:  # GGUF has no empty arrays: all counts 0 = the flat key is absent
            self.add(key, flat, T.ARRAY, sub_type)


def _identity_kv(kv: _Kv, ident: PlanIdentity) -> None:
    commit, version = (ident.ggml_commit, ident.ggml_version) if ident.ggml_commit else ggml_identity()
    kv.add(K.FORMAT, K.FORMAT_VERSION, T.UINT32)
    kv.add(K.KIND, ident.kind, T.STRING)
    kv.add(K.MODE, ident.mode, T.STRING)
    kv.add(K.REASON, ident.reason, T.STRING)
    kv.add(K.GGML_COMMIT, commit, T.STRING)
    kv.add(K.GGML_VERSION, version, T.STRING)
    for path_key, size_key, mtime_key, path in (
        (K.MODEL_PATH, K.MODEL_SIZE, K.MODEL_MTIME_NS, ident.model_path),
        (K.SIDECAR_PATH, K.SIDECAR_SIZE, K.SIDECAR_MTIME_NS, ident.sidecar_path),
    ):
        st = os.stat(path)
        kv.add(path_key, os.path.abspath(path), T.STRING)
        kv.add(size_key, st.st_size, T.UINT64)
        kv.add(mtime_key, st.st_mtime_ns, T.UINT64)
    kv.add(K.RAM_BUDGET_MB, float(ident.ram_budget_mb), T.FLOAT32)
    kv.add(K.N_CTX, int(ident.n_ctx), T.UINT32)
    kv.add(K.N_BATCH, int(ident.n_batch), T.UINT32)
    kv.add(K.N_UBATCH, int(ident.n_ubatch), T.UINT32)
    kv.add(K.TOOL_ARGS, ident.tool_args, T.STRING)


def _dense_kv(kv: _Kv, config) -> None:
    """A ``_native.EngineConfig``."""
    kv.add(K.ENGINE_ACTIVATION, config.activation, T.STRING)
    kv.add(K.ENGINE_VERIFY, bool(config.verify), T.BOOL)
    kv.add(K.ENGINE_REPACK, bool(config.repack), T.BOOL)
    s = config.sparse
    kv.add(K.SPARSE_ENABLED, bool(s.enabled), T.BOOL)
    kv.add(K.SPARSE_MAX_TOKENS, int(s.max_tokens), T.INT64)
    kv.add(K.SPARSE_CLUSTER_SIZE, int(s.cluster_size), T.INT32)
    kv.add(K.SPARSE_UP_BY_GGML, bool(s.up_by_ggml), T.BOOL)
    layers = list(config.layers)
    for field in K.LAYER_INT_FIELDS:
        kv.ints(K.LAYER + field, [getattr(spec, field) for spec in layers])
    for field in K.LAYER_FLOAT_FIELDS:
        kv.add(K.LAYER + field, [float(getattr(spec, field)) for spec in layers], T.ARRAY, T.FLOAT32)
    for field in K.LAYER_STR_FIELDS:
        kv.add(K.LAYER + field, [str(getattr(spec, field)) for spec in layers], T.ARRAY, T.STRING)
    o = config.offload
    kv.add(K.OFFLOAD, o is not None, T.BOOL)
    if o is None:
        return
    kv.add(K.OFFLOAD_STREAM_GATE, bool(o.stream_gate), T.BOOL)
    kv.add(K.OFFLOAD_COLD_SLOTS, int(o.cold_slots), T.INT64)
    kv.add(K.OFFLOAD_PREFETCH_LAYERS, int(o.prefetch_layers), T.INT32)
    kv.add(K.OFFLOAD_PREFETCH_MIN_PROB, float(o.prefetch_min_prob), T.FLOAT32)
    kv.add(K.OFFLOAD_QUEUE_DEPTH, int(o.queue_depth), T.UINT32)
    kv.add(K.OFFLOAD_DIRECT, bool(o.direct), T.BOOL)
    kv.add(K.OFFLOAD_ENGINE, str(o.engine), T.STRING)
    kv.add(K.OFFLOAD_DRAFT_COPY, bool(o.draft_copy), T.BOOL)
    kv.add(K.OFFLOAD_STREAM_LAYERS, bool(o.stream_layers), T.BOOL)
    if o.hot_layers:  # GGUF has no empty arrays: none pinned = the key is absent
        kv.ints(K.OFFLOAD_HOT_LAYERS, list(o.hot_layers))
    kv.ragged(K.OFFLOAD_HOT, K.OFFLOAD_HOT_COUNTS, o.hot, T.INT32)
    kv.ragged(K.OFFLOAD_CLUSTER_PROB, K.OFFLOAD_CLUSTER_PROB_COUNTS, o.cluster_prob, T.FLOAT32)


def _experts_kv(kv: _Kv, config, routers: Dict[int, Any], lock_ranges: Sequence[Tuple[int, int]]) -> None:
    """A ``_native.ExpertConfig``; ``routers``: layer -> the router's TensorInfo in the base file (or
    None): the library reads it from there as float32 instead of storing the matrix; ``lock_ranges``:
    the dense part's file ranges [start, end) the library locks after load."""
    kv.add(K.EXPERTS_N_EMBD, int(config.n_embd), T.INT64)
    kv.add(K.EXPERTS_IO_ENGINE, str(config.io_engine), T.STRING)
    kv.add(K.EXPERTS_QUEUE_DEPTH, int(config.queue_depth), T.UINT32)
    kv.add(K.EXPERTS_DIRECT, bool(config.direct), T.BOOL)
    kv.add(K.EXPERTS_VERIFY, bool(config.verify), T.BOOL)
    kv.add(K.EXPERTS_PREFETCH, bool(config.prefetch), T.BOOL)
    kv.add(K.EXPERTS_OVERLAP, bool(config.overlap), T.BOOL)
    kv.add(K.EXPERTS_ROUTER_ROWS, bool(config.router_rows), T.BOOL)
    layers = list(config.layers)
    kv.ints(K.EXPERTS_LAYER, [s.layer for s in layers])
    kv.ints(K.EXPERTS_N_EXPERT, [s.n_expert for s in layers])
    kv.ints(K.EXPERTS_N_USED, [s.n_used for s in layers])
    kv.ints(K.EXPERTS_N_SLOTS, [s.n_slots for s in layers])
    kv.ragged(K.EXPERTS_PINNED, K.EXPERTS_PINNED_COUNTS, [list(s.pinned) for s in layers], T.INT32)
    router = [routers.get(s.layer) for s in layers]
    kv.ints(K.EXPERTS_ROUTER_OFFSET, [-1 if r is None else r.offset for r in router])
    kv.ints(K.EXPERTS_ROUTER_TYPE, [-1 if r is None else r.ggml_type for r in router])
    tensors = [t for s in layers for t in s.tensors]
    kv.ints(K.EXPERTS_TENSOR_COUNTS, [len(s.tensors) for s in layers])
    kv.ints(K.EXPERTS_TENSOR_KIND, [int(t.kind) for t in tensors])
    kv.ints(K.EXPERTS_TENSOR_OFFSET, [t.offset for t in tensors])
    kv.ints(K.EXPERTS_TENSOR_TYPE, [t.type for t in tensors])
    kv.ints(K.EXPERTS_TENSOR_NE0, [t.ne0 for t in tensors])
    kv.ints(K.EXPERTS_TENSOR_NE1, [t.ne1 for t in tensors])
    kv.ints(K.EXPERTS_TENSOR_EXPERT_BYTES, [t.expert_bytes for t in tensors])
    kv.ragged(
        K.EXPERTS_TENSOR_CHECKSUMS, K.EXPERTS_TENSOR_CHECKSUM_COUNTS, [list(t.checksums) for t in tensors], T.UINT32
    )
    if not lock_ranges or any(not 0 <= a < b for a, b in lock_ranges):
        raise ValueError(f"write_plan: lock_ranges must be non-empty [start, end) file ranges, got {lock_ranges!r}")
    kv.ints(K.EXPERTS_LOCK_OFFSET, [a for a, _ in lock_ranges])
    kv.ints(K.EXPERTS_LOCK_SIZE, [b - a for a, b in lock_ranges])


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _value(value: Any, vtype: T, sub_type: Optional[T]) -> bytes:
    if vtype == T.STRING:
        return _string(value)
    if vtype != T.ARRAY:
        return struct.pack(_SCALAR_FORMATS[vtype], value)
    head = struct.pack("<IQ", sub_type, len(value))
    if sub_type == T.STRING:
        return head + b"".join(_string(v) for v in value)
    return head + np.asarray(value, dtype=_NUMPY_TYPES[sub_type]).tobytes()


def plan_bytes(plan: EnginePlan) -> bytes:
    """The plan as a GGUF (version 3): its key-value pairs after ``general.architecture``, no tensors."""
    if (plan.dense is None) == (plan.experts is None):
        raise ValueError("an EnginePlan has exactly one of dense (EngineConfig) or experts (ExpertConfig)")
    kv = _Kv()
    kv.add("general.architecture", PLAN_ARCHITECTURE, T.STRING)
    _identity_kv(kv, plan.identity)
    if plan.dense is not None:
        _dense_kv(kv, plan.dense)
    else:
        _experts_kv(kv, plan.experts, plan.routers or {}, plan.lock_ranges)
    out = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, 0, len(kv.items))]
    for key, value, vtype, sub_type in kv.items:
        out += [_string(key), struct.pack("<I", vtype), _value(value, vtype, sub_type)]
    return b"".join(out)


def _write(path: str | os.PathLike, plan: EnginePlan) -> None:
    """The plan at ``path`` (created or truncated)."""
    with open(path, "wb") as f:
        f.write(plan_bytes(plan))


def write_plan(path: str | os.PathLike, plan: EnginePlan) -> Path:
    """Writes ``plan`` to ``path`` atomically (for the tools: ``llamaflash env``); returns the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write(tmp, plan)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


@contextlib.contextmanager
def in_memory(plan: EnginePlan) -> Iterator[str]:
    """``plan`` in an anonymous in-memory file (memfd) for the duration of the block: yields a path
    (``/proc/self/fd/N``) that this process, and only it, can open; nothing touches a disk."""
    data = plan_bytes(plan)
    fd = os.memfd_create("llamaflash-plan", os.MFD_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def read_plan_values(path: str | os.PathLike) -> Dict[str, Any]:
    """Every key of a plan file with its value (scalars as Python values, arrays as lists): for tests
    and `llamaflash env --show`; the library has its own reader."""
    import gguf  # gguf-py: tests and the command line only

    reader = gguf.GGUFReader(path)
    out: Dict[str, Any] = {}
    for field in reader.fields.values():
        if not field.name.startswith(K.P):
            continue
        out[field.name] = field.contents()
    return out
