"""The budget accounting of an offload plan: which parts a RAM budget is split into and how large
each is for a candidate layout, and the least budget a layout runs in.

Every size is in bytes. The budget covers the whole process: Python and its libraries, llama.cpp's
own share (plan_llama_share), the resident or streamed gate, the draft copy when kept, and the neuron
cache (plan_clusters) with its least cold region and a speculative verify batch's buffers, plus a
margin. A *layout* (:class:`Layout`, a plain value) fixes every part but the cache's pinned slots.

Prompt and decode take turns (``PlanRequest.prompt_pages_freed``, llamaflash.Llama): a prompt batch
computes no cluster, so the engine empties the cold region before it (NeuronCache::release_cold), and
the host frees the compute pages the prompt wrote once it is evaluated
(csrc/backend/prompt_buffers.h). The compute buffers are then counted at a decode batch's size
(DECODE_ROWS tokens) and the rest of the prompt batch's share in the memory the cold region and the
verify buffers hold while decoding: only what exceeds them is a part of its own (``prompt_buffers``).
Without it (the backend library in llama.cpp's tools, which frees no page between evaluations) both
are counted in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _native
from ..files.gguf_header import GGUFHeader
from ..files.sidecar import SidecarInfo
from ..runtime.speculative import BATCH_INVARIANT_MAX
from .plan_clusters import ClusterTable
from .plan_llama_share import MiB, llama_share, vocabulary_size

#: n_ubatch candidates, largest first (plan_search: the one whose plan predicts the shortest request,
#: prefill_speed.request_seconds: TTFT of the stated prompt + decode).
#: UBATCH_BUDGET_SHARE: stock's choice (budget_decision.stock_ubatch), the largest whose compute
#: buffers take at most this share of the budget.
UBATCH_CHOICES = (512, 256, 128, 64, 32)
UBATCH_BUDGET_SHARE = 0.10
#: The largest speculative verify batch (speculative.BATCH_INVARIANT_MAX): its logits rows, and the
#: sparse lane's per-(cluster, token) partial sums for it, are counted. Also the most tokens the lane
#: computes at once under offload (_native.SPARSE_CHUNK_TOKENS; bigger batches go in chunks).
VERIFY_ROWS = BATCH_INVARIANT_MAX
#: The compute buffers a decode step or a verify batch touches once a prompt's pages are freed are
#: counted as those of a batch of this many tokens (an upper bound for VERIFY_ROWS and one token).
DECODE_ROWS = 32
#: RSS of a fresh ``python -c "import llamaflash, llama_cpp"`` (measured: 45.7-46.2 MiB, bench/planner_constants.py).
RUNTIME_RSS_BYTES = 46 * MiB
#: Margin: fixed + a fraction of everything else (allocator slack, thread stacks, page tables, I/O
#: rings, and the page-cache headroom the kernel needs to keep llama.cpp's mmapped weights resident
#: under a cgroup limit). Measured with the engine (Qwen2.5-1.5B, 900 MiB cgroup): 16 MiB thrashed on
#: llama.cpp's mmapped output matrix (0.91 tok/s, pages re-read every token); 116 MiB ran at the
#: I/O bound (2.01 tok/s).
MARGIN_FIXED_BYTES = 112 * MiB
MARGIN_FRACTION = 0.03
#: The fixed part of the margin where stock runs with its weights read into memory (use_mmap=False):
#: nothing it computes from is page cache, so no headroom keeps mapped pages resident; what is left is
#: allocator slack and the libraries' code pages. Measured (Qwen2.5-1.5B Q4_K_M, n_ubatch 512, a
#: 400-token prompt): peak 1192 MiB anonymous + 22 MiB file-backed against 1262 MiB of planned parts.
IN_MEMORY_MARGIN_FIXED_BYTES = 16 * MiB
#: A streamed gate (``stream_gate``) keeps this many layers' gate matrices in the page cache: the layer
#: computing and the next one, read ahead while it computes (each is dropped after its split).
GATE_WINDOW_LAYERS = 2


def draft_copy_bytes(info: SidecarInfo) -> int | None:
    """Bytes the engine allocates for the sidecar's draft copy (both tensors of every layer, by the
    engine's own formula: ``_native.draft_copy_tensor_bytes``); None when a served layer has no draft copy."""
    if any(lay.draft_type is None for lay in info.layers):
        return None
    return sum(2 * int(_native.draft_copy_tensor_bytes(lay.n_ff, lay.draft_row_bytes)) for lay in info.layers)


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for, with the pair already read. ``budget_mb``: the budget as asked (MiB),
    ``budget_bytes`` in bytes; ``runtime_bytes``: the runtime part
    (``runtime_given``: the caller's number, else RUNTIME_RSS_BYTES); ``n_ubatch``, ``cluster_size``,
    ``stream_gate``: None lets the search choose; ``disk``: a disk profile, None for the default."""

    model_path: str
    sidecar_path: Path
    budget_mb: float
    info: SidecarInfo
    header: GGUFHeader
    budget_bytes: int
    runtime_bytes: int
    runtime_given: bool
    n_ctx: int
    n_ubatch: int | None
    cluster_size: int | None
    prefetch_layers: int
    stream_gate: bool | None
    disk: dict[str, Any] | None
    tables: tuple[ClusterTable, ...]
    logits_all: bool = False  # Llama(logits_all=True): every token's logits kept (plan_llama_share)
    prompt_tokens: int = 512  # the prompt length TTFT is predicted for (prefill_speed), weighed in n_ubatch
    flash_attn: bool = True  # the context's flash attention (offload's default): no KQ scores in compute buffers
    prompt_pages_freed: bool = True  # prompt and decode take turns in memory (the module docstring)

    @property
    def gate_layer_bytes(self) -> tuple[int, ...]:
        return tuple(lay.n_ff * lay.gate_row_bytes for lay in self.info.layers)


@dataclass(frozen=True)
class Layout:
    """One candidate layout: ``fixed`` holds every part but the neuron cache's (name → bytes, in the
    order of OffloadPlan.parts)."""

    n_ubatch: int
    stream_gate: bool
    draft_copy: bool
    fixed: dict[str, int]
    #: a prompt batch's compute pages beyond ``fixed["compute_buffers"]`` that share the cold region's
    #: memory (0 unless ``PlanRequest.prompt_pages_freed``)
    prompt_extra: int = 0


def fixed_parts(req: PlanRequest, n_ubatch: int, stream_gate: bool, copy_bytes: int) -> dict[str, int]:
    """The parts besides the neuron cache: runtime, llama.cpp's share, the draft copy (when
    ``copy_bytes``), and the resident gate or the streamed gate's window. With
    ``req.prompt_pages_freed`` the compute buffers are a decode batch's (:func:`prompt_extra_bytes`
    has the rest)."""
    parts = {
        "runtime": int(req.runtime_bytes),
        **llama_share(req.header, req.info, req.n_ctx, n_ubatch, req.logits_all, req.flash_attn),
    }
    if req.prompt_pages_freed and n_ubatch > DECODE_ROWS:
        parts["compute_buffers"] = decode_compute_bytes(req, n_ubatch)
    if copy_bytes:
        parts["draft_copy"] = copy_bytes
    gate = req.gate_layer_bytes
    if stream_gate:
        parts["gate_window"] = GATE_WINDOW_LAYERS * max(gate)
    else:
        parts["gate_rows"] = sum(gate)
    return parts


def decode_compute_bytes(req: PlanRequest, n_ubatch: int) -> int:
    """The compute pages a decode step or verify batch touches: a batch of min(n_ubatch, DECODE_ROWS)."""
    u = min(n_ubatch, DECODE_ROWS)
    return llama_share(req.header, req.info, req.n_ctx, u, req.logits_all, req.flash_attn)["compute_buffers"]


def prompt_extra_bytes(req: PlanRequest, n_ubatch: int) -> int:
    """With ``req.prompt_pages_freed``: a prompt batch's compute pages beyond a decode batch's (they
    take turns with the cold region); else 0 (the full compute buffers are a fixed part)."""
    if not req.prompt_pages_freed or n_ubatch <= DECODE_ROWS:
        return 0
    full = llama_share(req.header, req.info, req.n_ctx, n_ubatch, req.logits_all, req.flash_attn)["compute_buffers"]
    return max(0, full - decode_compute_bytes(req, n_ubatch))


def make_layout(req: PlanRequest, n_ubatch: int, stream_gate: bool, copy_bytes: int) -> Layout:
    return Layout(
        n_ubatch,
        stream_gate,
        bool(copy_bytes),
        fixed_parts(req, n_ubatch, stream_gate, copy_bytes),
        prompt_extra_bytes(req, n_ubatch),
    )


def cold_bytes(req: PlanRequest, table: ClusterTable) -> int:
    """The neuron cache's least cold region."""
    return table.cold_slots(req.prefetch_layers) * table.slot_bytes


def verify_bytes(req: PlanRequest, table: ClusterTable) -> int:
    """A speculative verify batch of VERIFY_ROWS tokens: the logits of its other rows (llama.cpp's
    output buffer), and the sparse lane's scratch for it (its per-(cluster, token) partial sums and
    quantized activations, one thread's partials: the engine's own formula,
    ``_native.sparse_scratch_bytes``)."""
    scratch = max(
        int(
            _native.sparse_scratch_bytes(
                lay.gate_type, lay.up_type, lay.n_embd, VERIFY_ROWS, 1, table.max_clusters_per_layer
            )
        )
        for lay in req.info.layers
    )
    return (VERIFY_ROWS - 1) * vocabulary_size(req.header) * 4 + scratch


def cache_floor_bytes(req: PlanRequest, table: ClusterTable, layout: Layout | None = None) -> int:
    """What the neuron cache needs with nothing pinned: its least cold region and the verify buffers,
    plus :func:`prompt_bytes` of ``layout``."""
    floor = cold_bytes(req, table) + verify_bytes(req, table)
    return floor + (prompt_bytes(req, table, layout) if layout is not None else 0)


def prompt_bytes(req: PlanRequest, table: ClusterTable, layout: Layout) -> int:
    """The part ``prompt_buffers``: what a prompt batch's extra compute pages (``layout.prompt_extra``)
    need beyond the cold region and the verify buffers they take turns with."""
    return max(0, layout.prompt_extra - cold_bytes(req, table) - verify_bytes(req, table))


def margin_bytes(rest: int) -> int:
    return MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * rest)


def minimum_bytes(req: PlanRequest, layout: Layout, table: ClusterTable) -> int:
    """The least budget of ``layout`` with clusters of ``table``: every part, no pinned slot, plus the margin."""
    rest = sum(layout.fixed.values()) + cache_floor_bytes(req, table, layout)
    return rest + margin_bytes(rest)


def least_minimum(req: PlanRequest, layout: Layout) -> int:
    """The least minimum of ``layout`` over the cluster sizes tried."""
    return min(minimum_bytes(req, layout, t) for t in req.tables)
