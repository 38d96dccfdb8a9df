"""RAM-budget planner for the flash-offload engine: how a process's RAM budget is split, which neuron
clusters to pin, and what decode speed the disk allows (``llamaflash plan``; docs/PLANNER.md).

Every size is in bytes; "MiB" is 2**20 bytes, the unit of ``ram_budget_mb`` (as ``llamaflash bench
--ram-limit-mb``). The budget covers the whole process: Python and its libraries, llama.cpp's own share
(vocabulary tables, non-FFN weights, KV cache, compute buffers), the working set of dense prefill, the
resident gate rows, and the neuron cache. The cache holds fixed-size *slots*; a slot is one *cluster*
of ``C`` consecutive neurons (base neuron order) of one layer: its up rows (base GGUF ``ffn_up``) and
down_t rows (sidecar), each read by O_DIRECT as one page-aligned span. Hot slots are pinned (chosen
here); cold slots are an LRU for on-demand reads and read-ahead. Neuron activation frequencies ``f_i``
come from the sidecar (format 2, at its operating point); with independent neurons a cluster is
needed for a token with probability ``1 - prod(1 - f_i)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from . import _native
from . import sidecar_format as fmt
from .errors import RamBudgetError, SidecarError
from .gguf_header import GGUFHeader, read_gguf_header
from .gguf_model import read_base_model
from .speculative import BATCH_INVARIANT_MAX
from .sidecar import SidecarInfo, default_sidecar_path, read_layer_vectors, validate_pair

MiB = 1 << 20
PAGE = 4096
#: Cluster sizes (neurons per slot) the planner tries.
CLUSTER_SIZES = (4, 8, 16, 32, 64, 128, 256)  # 256: the neuron cache's and the kernel's largest unit
#: n_ubatch candidates, largest first: the largest whose compute buffers take at most
#: UBATCH_BUDGET_SHARE of the budget is chosen (dense prefill streams the offloaded FFN weights once
#: per ubatch, so larger is faster), else the smallest.
UBATCH_CHOICES = (512, 256, 128, 64, 32)
UBATCH_BUDGET_SHARE = 0.10
#: Read-ahead thresholds tried (P(needed) >= it); 1.01 means no read-ahead.
PREFETCH_MIN_PROBS = (0.25, 0.5, 0.75, 0.9, 1.01)
#: The largest speculative verify batch (speculative.BATCH_INVARIANT_MAX): its logits rows, and the
#: sparse lane's per-(cluster, token) partial sums for it, are counted.
VERIFY_ROWS = BATCH_INVARIANT_MAX
#: RSS of a fresh ``python -c "import llamaflash, llama_cpp"`` (measured: 45.7-46.2 MiB, bench/planner_constants.py).
RUNTIME_RSS_BYTES = 46 * MiB
#: llama.cpp's tokenizer tables: bytes per vocabulary entry (tokens + BPE merges) + fixed (measured
#: with vocab_only loads: SmolLM2 17.7, Gemma-3 43.4, Qwen2.5 47.5 MiB; the formula gives 18.5, 46.0, 52.9).
VOCAB_BYTES_PER_ENTRY = 176
VOCAB_FIXED_BYTES = 2 * MiB
#: Safety factor on the compute-buffer formula (it matched llama.cpp's log within 1% on three models).
COMPUTE_SAFETY = 1.05
#: Margin: fixed + a fraction of everything else (allocator slack, thread stacks, page tables, I/O
#: rings, and the page-cache headroom the kernel needs to keep llama.cpp's mmapped weights resident
#: under a cgroup limit). Measured with the engine (Qwen2.5-1.5B, 900 MiB cgroup): 16 MiB thrashed on
#: llama.cpp's mmapped output matrix (0.91 tok/s, pages re-read every token); 116 MiB ran at the
#: I/O bound (2.01 tok/s).
MARGIN_FIXED_BYTES = 112 * MiB
MARGIN_FRACTION = 0.03
#: Queue depth: the deepest whose predicted tok/s is within this share of the best. A probe's depth
#: curve is noisy (0.25 s per point: 256 KiB reads measured 1.28 GB/s at depth 4 and 1.14 at depth 32
#: in one probe, the reverse in others), in-flight reads cost io_uring nothing, and the engine's
#: read-ahead keeps more of them busy than the model credits (Qwen2.5-1.5B, 900 MiB limit, alternated
#: runs: 3.34 and 3.62 tok/s at depth 32 against 3.19 and 3.23 at the depth 4 that probe preferred).
DEPTH_NEAR_BEST = 0.85
#: A streamed gate (``stream_gate``) keeps this many layers' gate matrices in the page cache: the layer
#: computing and the next one, read ahead while it computes (each is dropped after its split).
GATE_WINDOW_LAYERS = 2
#: Queue depth the kernel's read-ahead of a streamed gate is timed at (MADV_WILLNEED on 7 MB: a few
#: large requests in flight).
GATE_READ_DEPTH = 4


def default_disk() -> dict[str, Any]:
    """A conservative built-in disk profile, in :func:`~llamaflash.disk_probe.probe_disk`'s format (not
    measured): 150 us per request plus 400 MB/s transfer, at most 25k IOPS and 400 MB/s; about half
    of what the development VM's disk measured (docs/PLANNER.md)."""
    points = []
    for kib in (4, 16, 32, 64, 256):
        for depth in (1, 4, 16, 32):
            size = kib * 1024
            iops = min(depth / (150e-6 + size / 400e6), 25_000.0, 400e6 / size)
            points.append({"request_kib": kib, "depth": depth, "iops": round(iops, 1),
                           "mb_s": round(iops * size / 1e6, 1)})
    return {"source": "built-in default (not measured)", "direct": True, "points": points}


class _Disk:
    """Device time per request from a probe result: 1/IOPS at the measured sizes and depths,
    interpolated linearly in depth and size; beyond the largest size, bandwidth-bound."""

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
    return request_bytes / float(_Disk(disk).seconds(np.array([float(request_bytes)]), depth)[0])


def _meta(header: GGUFHeader, key: str, default: Any = None) -> Any:
    v = header.metadata.get(key)
    if v is None:
        return default
    return v.count if v.value is None else v.value


def llama_share(header: GGUFHeader, info: SidecarInfo, n_ctx: int, n_ubatch: int) -> dict[str, int]:
    """llama.cpp's memory in offload mode (bytes): ``llama_vocab``, ``llama_weights`` (every tensor
    but the served layers' ffn_gate/up/down: mmapped or repacked, resident either way), ``kv_cache``
    (f16 K and V for every layer and cell; n_ctx rounded up to 256), ``compute_buffers`` (CPU:
    n_ubatch x 4 x max(n_vocab + 3 n_embd, (n_head + 2) n_ctx + 6 n_embd), fitted to llama.cpp's log;
    LLAMAFLASH device: n_ubatch x 3 n_ff x 4; logits output: n_vocab x 4; all x COMPUTE_SAFETY),
    ``prefill_window`` (one served layer's base up + down bytes, page cache during dense prefill).
    ``header``: the base model's (:func:`~llamaflash.gguf_header.read_gguf_header`)."""
    h = header
    arch = _meta(h, "general.architecture", "")
    n_layer, n_embd = int(_meta(h, f"{arch}.block_count")), int(_meta(h, f"{arch}.embedding_length"))
    n_head = int(np.max(_meta(h, f"{arch}.attention.head_count", 1)))
    kv_heads = np.broadcast_to(np.asarray(_meta(h, f"{arch}.attention.head_count_kv", n_head)), (n_layer,))
    k_len = int(_meta(h, f"{arch}.attention.key_length", n_embd // n_head))
    v_len = int(_meta(h, f"{arch}.attention.value_length", k_len))
    n_vocab = int(_meta(h, "tokenizer.ggml.tokens", 0) or _meta(h, f"{arch}.vocab_size", 0))
    entries = n_vocab + int(_meta(h, "tokenizer.ggml.merges", 0))
    served = {fmt.base_ffn_gate_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_up_name(lay.layer) for lay in info.layers}
    served |= {fmt.base_ffn_down_name(lay.layer) for lay in info.layers}
    size = {t.name: t.nbytes for t in h.tensors}
    # token_embd is only read by rows (get_rows) when the model has its own output matrix: count the
    # pages of n_ctx rows, not the whole table (tied embeddings are the output matmul: whole)
    if "output.weight" in size and "token_embd.weight" in size:
        emb = size["token_embd.weight"]
        size["token_embd.weight"] = min(emb, n_ctx * (-(-(emb // max(1, n_vocab)) // PAGE) + 1) * PAGE)
    cells = -(-n_ctx // 256) * 256
    n_ff = max(lay.n_ff for lay in info.layers)
    cpu = n_ubatch * 4 * max(n_vocab + 3 * n_embd, (n_head + 2) * cells + 6 * n_embd)
    return {
        "llama_vocab": VOCAB_FIXED_BYTES + VOCAB_BYTES_PER_ENTRY * entries,
        "llama_weights": sum(b for name, b in size.items() if name not in served),
        "kv_cache": int(kv_heads.sum()) * cells * (k_len + v_len) * 2,
        "compute_buffers": int(COMPUTE_SAFETY * (cpu + n_ubatch * 3 * n_ff * 4 + n_vocab * 4)),
        "prefill_window": max(size[fmt.base_ffn_up_name(lay.layer)] + size[fmt.base_ffn_down_name(lay.layer)]
                              for lay in info.layers),
    }


def _span(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Bytes of the page-aligned range covering [start, start + length)."""
    return -(-(start + length) // PAGE) * PAGE - start // PAGE * PAGE


@dataclass
class _Clusters:
    """Per served layer, for one cluster size: P(needed), sum of f, bytes of the two reads (page-aligned
    spans, as the disk serves them). ``slot_bytes``: one cache slot, by the neuron cache's own formula
    (``_native.cache_slot_bytes``)."""

    size: int
    prob: list[np.ndarray]
    sumf: list[np.ndarray]
    up: list[np.ndarray]
    down_t: list[np.ndarray]
    slot_bytes: int = 0


def _clusters(info: SidecarInfo, freqs: list[np.ndarray], size: int) -> _Clusters:
    cl = _Clusters(size, [], [], [], [])
    for lay, f in zip(info.layers, freqs):
        k = -(-lay.n_ff // size)
        m = np.zeros(k * size)
        m[:lay.n_ff] = np.clip(f, 0.0, 1.0)
        m = m.reshape(k, size)
        with np.errstate(divide="ignore"):
            cl.prob.append((-np.expm1(np.log1p(-m).sum(axis=1))).astype(np.float32))
        cl.sumf.append(m.sum(axis=1))
        first = np.arange(k, dtype=np.int64) * size
        count = np.minimum(size, lay.n_ff - first)
        cl.up.append(_span(lay.base_up_offset + first * lay.up_row_bytes, count * lay.up_row_bytes))
        cl.down_t.append(_span(lay.down_t_offset + first * lay.down_t_row_bytes, count * lay.down_t_row_bytes))
    cl.slot_bytes = int(_native.cache_slot_bytes(size, max(lay.up_row_bytes for lay in info.layers),
                                                 max(lay.down_t_row_bytes for lay in info.layers)))
    return cl


def _hot(cl: _Clusters, n_slots: int) -> list[np.ndarray]:
    """Boolean pin masks: the n_slots clusters of highest P(needed), then highest sum of f, over all layers."""
    prob, sumf = np.concatenate(cl.prob), np.concatenate(cl.sumf)
    chosen = np.zeros(len(prob), dtype=bool)
    chosen[np.lexsort((-sumf, -prob))[:n_slots]] = True
    return np.split(chosen, np.cumsum([len(p) for p in cl.prob])[:-1])


def _io(cl: _Clusters, hot: list[np.ndarray], disk: _Disk, pmin: float, depth: int,
        prefetch_layers: int) -> tuple[float, float, float]:
    """(flash bytes per token, device seconds per token, demand-stall seconds per token). Unpinned
    clusters with P >= pmin are read ahead (always read); the others on demand (read with probability
    P) after the layer's gate. Time = max(device busy time at the queue depth the reads can fill, sum
    of per-layer demand stalls)."""
    n, total_bytes, stall = len(cl.prob), 0.0, 0.0
    weights, sizes, spec_req, demand_req = [], [], np.zeros(n), np.zeros(n)
    for i in range(n):
        miss = ~hot[i]
        p, up, dt = cl.prob[i][miss].astype(float), cl.up[i][miss], cl.down_t[i][miss]
        spec = p >= pmin if prefetch_layers else np.zeros(len(p), dtype=bool)
        w = np.where(spec, 1.0, p)
        total_bytes += float((w * (up + dt)).sum())
        spec_req[i], demand_req[i] = 2 * spec.sum(), 2 * p[~spec].sum()
        d = min(max(demand_req[i], 1.0), depth)
        stall += float((p[~spec] * (disk.seconds(up[~spec], d) + disk.seconds(dt[~spec], d))).sum())
        weights.append(np.concatenate([w, w]))
        sizes.append(np.concatenate([up, dt]))
    window = np.mean([demand_req[i] + sum(spec_req[(i + j) % n] for j in range(1, prefetch_layers + 1))
                      for i in range(n)])
    w, s = np.concatenate(weights), np.concatenate(sizes)
    busy = float((w * disk.seconds(s, min(max(window, 1.0), depth))).sum()) if len(s) else 0.0
    return total_bytes, max(busy, stall), stall


@dataclass
class OffloadPlan:
    """A RAM plan for the flash-offload engine; sizes in bytes. ``parts`` (name → bytes, in order)
    sums to ``budget_bytes``; ``reasons`` says why each part has its size. ``minimum_bytes`` is every
    part but ``hot_slots`` with the cold region at its minimum, at this plan's n_ubatch and gate
    placement; ``least_budget_bytes`` the least budget the planner accepts for the model and settings
    (the smallest n_ubatch, the gate streamed when allowed): one number whatever budget was asked. ``hot_clusters[i]`` / ``cluster_prob[i]``
    belong to ``layers[i]`` (the sidecar's layer order). ``hit_rate``: share of the cluster reads a
    token needs that the hot slots serve; ``neuron_hit_rate``: the same weighted by active neurons;
    ``flash_bytes_per_token``: expected bytes read per decoded token (read-ahead included);
    ``io_bound_tok_s``: decode speed if only the disk limited it (None: nothing is read)."""

    model_path: str
    sidecar_path: str
    budget_bytes: int
    minimum_bytes: int
    least_budget_bytes: int  # the one minimum of the model and settings (smallest n_ubatch, gate streamed if allowed)
    parts: dict[str, int]
    reasons: dict[str, str]
    cluster_size: int
    slot_bytes: int
    hot_slots: int
    cold_slots: int
    total_clusters: int
    queue_depth: int
    prefetch_layers: int
    prefetch_min_prob: float
    n_ctx: int
    n_batch: int
    n_ubatch: int
    layers: list[int]
    hot_clusters: list[np.ndarray]
    cluster_prob: list[np.ndarray]
    hit_rate: float
    neuron_hit_rate: float
    flash_bytes_per_token: float
    io_bound_tok_s: float | None
    disk_source: str
    candidates: list[dict[str, Any]] = field(default_factory=list)
    #: the gate is read from flash every token (one layer ahead) instead of resident
    stream_gate: bool = False
    notes: list[str] = field(default_factory=list)
    #: the sidecar's draft copy is kept resident (part ``draft_copy``) for speculative self-drafts
    draft_copy: bool = False
    #: the predicted decode speeds the draft-copy choice compared (draft_plan.DraftChoice.to_dict); {} when
    #: there was no choice to make
    draft_choice: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, arrays: bool = True) -> dict[str, Any]:
        """Plain JSON-able dict; ``arrays=False`` replaces the per-layer arrays by per-layer pin counts."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("hot_clusters", "cluster_prob")}
        out["hot_per_layer"] = [int(len(h)) for h in self.hot_clusters]
        if arrays:
            out["hot_clusters"] = [h.tolist() for h in self.hot_clusters]
            out["cluster_prob"] = [np.round(p.astype(float), 6).tolist() for p in self.cluster_prob]
        return out

    def explain(self) -> str:
        """A human-readable table: every part and why, the minimum, the choices, the predictions."""
        mib = lambda b: f"{b / MiB:9.1f}"  # noqa: E731
        lines = [f"llamaflash offload plan: {self.model_path}", f"  sidecar {self.sidecar_path}",
                 f"  RAM budget {self.budget_bytes / MiB:.0f} MiB, n_ctx {self.n_ctx}, n_batch {self.n_batch}, "
                 f"n_ubatch {self.n_ubatch}", "", f"  {'part':<16}{'MiB':>9}  why"]
        lines += [f"  {name:<16}{mib(b)}  {self.reasons[name]}" for name, b in self.parts.items()]
        lines += [f"  {'total':<16}{mib(sum(self.parts.values()))}  = the budget",
                  f"  {'minimum':<16}{mib(self.least_budget_bytes)}  the least budget this model and these settings "
                  "run in (smallest n_ubatch, gate streamed if allowed, no hot_slots, cold region at its minimum)", "",
                  f"cluster size {self.cluster_size} neurons, slot {self.slot_bytes / 1024:.0f} KiB; "
                  f"{self.hot_slots} of {self.total_clusters} clusters pinned, {self.cold_slots} cold slots; "
                  f"queue depth {self.queue_depth}; gate {'streamed from flash, one layer ahead' if self.stream_gate else 'resident'}; read-ahead: "
                  + (f"next {self.prefetch_layers} layer(s), clusters with P(needed) >= {self.prefetch_min_prob:g}"
                     if self.prefetch_min_prob <= 1 else "off"),
                  f"disk: {self.disk_source}", "candidates (the best predicted tok/s is chosen):",
                  f"  {'C':>4} {'slot KiB':>8} {'min MiB':>8} {'hot':>7} {'hit':>6} {'MB/token':>9} {'tok/s':>7}"]
        for c in self.candidates:
            if c.get("hot_slots") is None:
                lines.append(f"  {c['cluster_size']:>4} {c['slot_bytes'] / 1024:>8.0f} "
                             f"{c['minimum_bytes'] / MiB:>8.0f}  (budget below its minimum)")
                continue
            tok = "inf" if c["io_bound_tok_s"] is None else f"{c['io_bound_tok_s']:.1f}"
            lines.append(f"  {c['cluster_size']:>4} {c['slot_bytes'] / 1024:>8.0f} {c['minimum_bytes'] / MiB:>8.0f} "
                         f"{c['hot_slots']:>7} {c['hit_rate']:>6.3f} {c['flash_bytes_per_token'] / 1e6:>9.1f} "
                         f"{tok:>7}")
        tok = "unbounded (nothing read)" if self.io_bound_tok_s is None else f"{self.io_bound_tok_s:.1f} tok/s"
        lines += ["", f"predicted: hit rate {self.hit_rate:.3f} (neuron-weighted {self.neuron_hit_rate:.3f}), "
                      f"{self.flash_bytes_per_token / 1e6:.1f} MB read from flash per token, I/O-bound decode {tok}"]
        lines += self._speculation_lines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _speculation_lines(self) -> list:
        """What speculative decoding (docs/SPECULATIVE.md) gets under this plan."""
        draft = ("off: the gate is streamed from flash, a draft would wait for it" if self.stream_gate else
                 f"the same model over the resident clusters only: the hot slots hold "
                 f"{self.neuron_hit_rate:.0%} of the active neurons (frequency-weighted); no memory of its own "
                 f"(same context, KV cache rolled back)")
        lines = ["", f"speculation: verify batches up to {VERIFY_ROWS} tokens read the union of their clusters once "
                     f"(their logits are in compute_buffers); self-draft: {draft}"]
        if self.io_bound_tok_s is None:
            return lines
        pass_s = 1.0 / self.io_bound_tok_s  # a verify pass reads what one token reads
        rates = []
        for a in (0.2, 0.4, 0.6, 0.8):
            best = max((1 - a ** (k + 1)) / (1 - a) for k in range(VERIFY_ROWS))
            rates.append(f"a={a:.1f}: {best / pass_s:.1f}")
        lines.append("predicted delivered tok/s at draft acceptance a, I/O bound, free drafts (prompt lookup; a "
                     "self-draft step costs compute on top): " + ", ".join(rates))
        return lines


def _disk_source(disk: dict[str, Any] | None) -> str:
    if disk is None:
        return default_disk()["source"]
    if disk.get("source"):
        return str(disk["source"])
    saved = f", saved {disk['saved_at']}" if disk.get("saved_at") else ""
    return (f"probed {disk.get('directory')} ({disk.get('filesystem')}, {disk.get('engine')}, "
            f"{'direct I/O' if disk.get('direct') else 'page cache: not direct I/O'}{saved})")


def plan_offload(model_path: str | os.PathLike, sidecar_path: str | os.PathLike | None, ram_budget_mb: float, *,
                 n_ctx: int = 512, n_ubatch: int | None = None, disk: dict[str, Any] | None = None,
                 runtime_rss_bytes: int | None = None, cluster_size: int | None = None,
                 prefetch_layers: int = 2, stream_gate: bool | None = None, info: SidecarInfo | None = None,
                 header: GGUFHeader | None = None, draft_copy: bool | None = None) -> OffloadPlan:
    """Plan the RAM of the flash-offload engine for ``model_path`` + its format-2 sidecar under
    ``ram_budget_mb`` MiB (see the module docstring and :class:`OffloadPlan`).

    ``n_ubatch`` None: the largest of UBATCH_CHOICES whose compute buffers fit UBATCH_BUDGET_SHARE of
    the budget; ``disk`` None: :func:`default_disk`; ``runtime_rss_bytes`` None: RUNTIME_RSS_BYTES;
    ``cluster_size`` None: the CLUSTER_SIZES entry with the best predicted tok/s; ``stream_gate`` None:
    the gate matrices stay resident when that fits the budget, else they are streamed from flash
    every token (GATE_WINDOW_LAYERS layers in memory; every gate row read per token). Raises
    :class:`RamBudgetError` below the minimum, :class:`SidecarError` for a sidecar without neuron
    statistics, and what :func:`~llamaflash.sidecar.validate_pair` raises for a bad pair.

    ``draft_copy``: keep the sidecar's draft copy resident for speculative self-drafts (True; the gate
    then stays resident, SidecarError without a copy), not (False), or None: plan both ways and keep
    the one with the higher predicted delivered decode speed (:mod:`llamaflash.draft_plan`).

    ``info`` / ``header``: the pair's :func:`~llamaflash.sidecar.validate_pair` result and the base
    model's parsed header, when the caller has them (``llamaflash.Llama``), so that one load parses
    the base header once and checks the pair's identity once; None: read here."""
    if n_ctx < 1 or prefetch_layers < 0 or (cluster_size is not None and cluster_size < 1) or (
            n_ubatch is not None and n_ubatch < 1):
        raise ValueError(f"n_ctx {n_ctx}, n_ubatch {n_ubatch} and cluster_size {cluster_size} must be positive, "
                         f"prefetch_layers {prefetch_layers} non-negative")
    sidecar = Path(sidecar_path) if sidecar_path is not None else default_sidecar_path(model_path)
    if info is None:
        model = read_base_model(model_path)
        info, header = validate_pair(model_path, sidecar, model=model), model.header
    if draft_copy is None:
        from .draft_plan import choose_draft_copy

        def plan(copy: bool, ubatch: int | None = n_ubatch) -> OffloadPlan:
            return plan_offload(model_path, sidecar, ram_budget_mb, n_ctx=n_ctx, n_ubatch=ubatch, disk=disk,
                                runtime_rss_bytes=runtime_rss_bytes, cluster_size=cluster_size,
                                prefetch_layers=prefetch_layers, stream_gate=stream_gate, info=info, header=header,
                                draft_copy=copy)
        return choose_draft_copy(info, plan)
    copy_bytes = draft_copy_bytes(info) if draft_copy else 0
    if draft_copy:
        if copy_bytes is None:
            raise SidecarError(f"{sidecar}: no draft copy in this sidecar; re-create it with `llamaflash convert "
                               f"{model_path} --force` (--draft-type auto), or plan without one")
        if stream_gate:
            raise ValueError("draft_copy needs the gate resident (a self-draft never waits for flash): "
                             "stream_gate must not be True")
        stream_gate = False
        if n_ubatch is None:
            # the n_ubatch of the plan without the copy: prefill numerics depend on the ubatch size, and
            # the copy (used by drafts only) must not change a token
            n_ubatch = plan_offload(model_path, sidecar, ram_budget_mb, n_ctx=n_ctx, disk=disk,
                                    runtime_rss_bytes=runtime_rss_bytes, cluster_size=cluster_size,
                                    prefetch_layers=prefetch_layers, info=info, header=header,
                                    draft_copy=False).n_ubatch
    if info.sparsity is None:
        raise SidecarError(f"{sidecar}: format-{info.format_version} sidecar without neuron statistics; the planner "
                           f"needs per-neuron activation frequencies. Re-create it with `llamaflash convert "
                           f"{model_path} --force` (without --no-calibration).")
    budget = int(ram_budget_mb * MiB)
    # the runtime is a measured constant, not this process's RSS: a plan depends on the model, the
    # budget and the settings only (docs/PLANNER.md, "Accounting rule")
    runtime = runtime_rss_bytes if runtime_rss_bytes is not None else RUNTIME_RSS_BYTES
    freqs = []
    for lay in info.layers:
        v = read_layer_vectors(info, lay)
        base = np.empty(lay.n_ff, dtype=np.float64)
        base[v["order"]] = v["freq"]  # bundle position k holds base neuron order[k]
        freqs.append(base)
    sizes = [c for c in CLUSTER_SIZES if c <= max(lay.n_ff for lay in info.layers)] or [CLUSTER_SIZES[0]]
    tables = [_clusters(info, freqs, c) for c in ([cluster_size] if cluster_size else sizes)]
    gate_layers = [lay.n_ff * lay.gate_row_bytes for lay in info.layers]
    gate = sum(gate_layers)
    gate_window = GATE_WINDOW_LAYERS * max(gate_layers)
    if header is None:
        header = read_gguf_header(model_path)

    def fixed_parts(u: int, streamed: bool) -> dict[str, int]:
        share = {"runtime": int(runtime), **llama_share(header, info, n_ctx, u)}
        if copy_bytes:
            share["draft_copy"] = copy_bytes
        return {**share, "gate_window": gate_window} if streamed else {**share, "gate_rows": gate}

    n_embd_max = max(lay.n_embd for lay in info.layers)

    def cold_bytes(cl: _Clusters) -> int:
        return int(_native.cache_min_cold_slots(prefetch_layers, max(len(p) for p in cl.prob))) * cl.slot_bytes

    def partial_bytes(cl: _Clusters) -> int:
        # a speculative verify batch: the logits of its other rows (llama.cpp's output buffer), and
        # the sparse lane's per-(cluster, token) partial sums (sparse_ffn.h, cluster phase)
        n_vocab = int(_meta(header, "tokenizer.ggml.tokens", 0) or 0)
        return (VERIFY_ROWS - 1) * n_vocab * 4 + VERIFY_ROWS * max(len(p) for p in cl.prob) * n_embd_max * 4

    def minimum(fixed: dict[str, int], cl: _Clusters) -> int:
        rest = sum(fixed.values()) + cold_bytes(cl) + partial_bytes(cl)
        return rest + MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * rest)

    ubatches = [u for u in UBATCH_CHOICES if u <= n_ctx] or [n_ctx] if n_ubatch is None else [min(n_ubatch, n_ctx)]
    for streamed in ([False, True] if stream_gate is None else [bool(stream_gate)]):
        for u in ubatches:
            fixed = fixed_parts(u, streamed)
            if min(minimum(fixed, cl) for cl in tables) <= budget and (
                    fixed["compute_buffers"] <= UBATCH_BUDGET_SHARE * budget or u == ubatches[-1]):
                break
        least = min(minimum(fixed, cl) for cl in tables)
        if least <= budget:
            break
    # the one minimum of this model and settings: smallest n_ubatch, streamed gate if allowed
    lowest = min(minimum(fixed_parts(u, s), cl) for s in ([False, True] if stream_gate is None else [bool(stream_gate)])
                 for u in ubatches for cl in tables)
    if budget < least:
        need = math.ceil(least / MiB)
        big = ", ".join(f"{k} {v / MiB:.0f}" for k, v in sorted(fixed.items(), key=lambda kv: -kv[1])[:4])
        raise RamBudgetError(
            f"RAM budget {ram_budget_mb:g} MiB is below the minimum of {need} MiB that the flash-offload engine "
            f"needs for {Path(model_path).name} at n_ctx {n_ctx} (n_ubatch {u}; largest parts in MiB: {big}). "
            f"Raise the budget to at least {need} MiB (--ram-budget-mb {need}), or use a smaller n_ctx "
            f"(the KV cache takes {fixed['kv_cache'] / MiB:.1f} MiB at n_ctx {n_ctx}).")
    d = _Disk(disk if disk is not None else default_disk())
    best, candidates = None, []
    for cl in tables:
        low = minimum(fixed, cl)
        row: dict[str, Any] = {"cluster_size": cl.size, "slot_bytes": cl.slot_bytes, "minimum_bytes": low}
        candidates.append(row)
        if low > budget:
            row["hot_slots"] = None
            continue
        n_total = sum(len(p) for p in cl.prob)
        n_hot = min(n_total, (budget - low) // cl.slot_bytes)
        hot = _hot(cl, n_hot)
        options = []
        for pmin in (PREFETCH_MIN_PROBS if prefetch_layers else (1.01,)):
            for depth in d.depths.astype(int):
                nbytes, secs, stall = _io(cl, hot, d, pmin, int(depth), prefetch_layers)
                if streamed:  # every gate row, one large sequential read per layer on the same disk
                    nbytes += gate
                    secs += float(d.seconds(np.array(gate_layers, dtype=float), GATE_READ_DEPTH).sum())
                tok_s = 1.0 / secs if secs > 0 else math.inf
                # ties: fewer bytes, then less demand stall (read-ahead that costs nothing hides latency
                # behind compute, which this I/O bound leaves out), then less read-ahead, shallower queue
                # deeper queue last: io_uring keeps requests in flight for free, and the engine's
                # read-ahead measured faster at depth 32 than 4 on this VM
                key = (round(tok_s, 2), -round(nbytes), -round(stall, 6), pmin, depth)
                options.append((key, nbytes, tok_s, pmin, int(depth)))
        best_tok = max(o[2] for o in options)
        near = [o for o in options if o[2] >= DEPTH_NEAR_BEST * best_tok]
        key, nbytes, tok_s, pmin, depth = max(near, key=lambda o: (o[4], o[0]))
        needed = sum(float(p.sum()) for p in cl.prob)
        mass = sum(float(s.sum()) for s in cl.sumf)
        hit = sum(float(p[h].sum()) for p, h in zip(cl.prob, hot))
        hit_mass = sum(float(s[h].sum()) for s, h in zip(cl.sumf, hot))
        row.update(hot_slots=int(n_hot), hit_rate=hit / needed if needed else 1.0,
                   neuron_hit_rate=hit_mass / mass if mass else 1.0,
                   flash_bytes_per_token=nbytes, io_bound_tok_s=None if math.isinf(tok_s) else tok_s,
                   prefetch_min_prob=pmin, queue_depth=depth)
        if best is None or (key, -low) > best[0]:
            best = ((key, -low), cl, hot, row)
    _, cl, hot, row = best
    cold = cold_bytes(cl)
    parts = {**fixed, "cold_slots": cold, "verify_buffers": partial_bytes(cl),
             "hot_slots": row["hot_slots"] * cl.slot_bytes}
    parts["margin"] = budget - sum(parts.values())
    spare = parts["margin"] - (minimum(fixed, cl) - sum(fixed.values()) - cold - partial_bytes(cl))
    max_clusters = max(len(p) for p in cl.prob)
    lay0 = info.layers[0]
    reasons = {
        "runtime": ("given by the caller" if runtime_rss_bytes is not None else
                    "Python + libraries, measured constant (import llamaflash, llama_cpp)"),
        "llama_vocab": f"llama.cpp tokenizer tables, {VOCAB_BYTES_PER_ENTRY} B per token/merge + 2 MiB (measured)",
        "llama_weights": "non-FFN tensors (attention, norms, token_embd, output) + unserved FFNs, mmapped/repacked",
        "kv_cache": f"f16 K+V, every layer, n_ctx {n_ctx} rounded up to 256 cells",
        "compute_buffers": f"llama.cpp CPU + LLAMAFLASH compute at n_ubatch {u}, logits output; +5% (fit, measured)",
        "prefill_window": "one layer's base up + down, mmapped page cache during dense prefill",
        "draft_copy": (f"the sidecar's draft copy ({gguf.GGMLQuantizationType(lay0.draft_type).name}): every "
                       "neuron's up and down_t rows at low bit width, resident, for speculative self-drafts"
                       ) if copy_bytes else "",
        "gate_rows": f"resident gate matrices, {len(info.layers)} layers x {lay0.n_ff} x {lay0.gate_row_bytes} B",
        "gate_window": f"streamed gate: {GATE_WINDOW_LAYERS} layers x {lay0.n_ff} x {lay0.gate_row_bytes} B in the page "
                       f"cache (the layer computing, the next read ahead); {gate / 1e6:.0f} MB of gate rows read "
                       "from flash per token",
        "cold_slots": f"{1 + prefetch_layers} layers x {max_clusters} clusters: current layer + read-ahead",
        "verify_buffers": f"a {VERIFY_ROWS}-token speculative verify batch: {VERIFY_ROWS - 1} more logits rows, and the "
                          f"sparse lane's partial sums ({VERIFY_ROWS} tokens x {max_clusters} clusters x n_embd floats)",
        "hot_slots": f"{row['hot_slots']} pinned clusters x {cl.slot_bytes // 1024} KiB, by P(needed) then sum f",
        "margin": f"{MARGIN_FIXED_BYTES // MiB} MiB + {MARGIN_FRACTION:.0%} of the rest, + {spare / MiB:.1f} MiB "
                  "left over (slot rounding, or more than all clusters need)",
    }
    notes = [] if disk is not None else ["no disk profile given: built-in conservative default; pass "
                                         "--probe-disk (or disk=probe_disk(...)) for this machine's numbers"]
    if info.sparsity.bundle_order != fmt.BUNDLE_ORDER_BASE:
        notes.append(f"bundle order '{info.sparsity.bundle_order}': a cluster's down_t rows are not contiguous "
                     "in the sidecar; convert with --order base for one read per cluster")
    if "output.weight" in {t.name for t in header.tensors}:
        notes.append("token_embd is read by rows (get_rows): llama_weights counts the pages of n_ctx of its "
                     "rows, not the whole table")
    if streamed and stream_gate is None:
        notes.append(f"the resident gate ({gate / MiB:.0f} MiB) does not fit this budget: it is streamed from flash "
                     f"instead, {gate / 1e6:.0f} MB more read per token")
    notes.append("cluster probabilities assume independent neurons at the sidecar's operating point "
                 f"(sparsity target {info.sparsity.target:g}); the I/O bound ignores compute and cross-token reuse")
    return OffloadPlan(
        model_path=str(model_path), sidecar_path=str(sidecar), budget_bytes=budget,
        minimum_bytes=minimum(fixed, cl), least_budget_bytes=lowest, parts=parts, reasons={k: reasons[k] for k in parts}, cluster_size=cl.size,
        slot_bytes=cl.slot_bytes, hot_slots=row["hot_slots"], cold_slots=int(_native.cache_min_cold_slots(prefetch_layers, max_clusters)),
        total_clusters=sum(len(p) for p in cl.prob), queue_depth=row["queue_depth"],
        prefetch_layers=prefetch_layers, prefetch_min_prob=row["prefetch_min_prob"], n_ctx=n_ctx, n_batch=u,
        n_ubatch=u, layers=[lay.layer for lay in info.layers],
        hot_clusters=[np.flatnonzero(h).astype(np.int32) for h in hot], cluster_prob=cl.prob,
        hit_rate=row["hit_rate"], neuron_hit_rate=row["neuron_hit_rate"],
        flash_bytes_per_token=row["flash_bytes_per_token"], io_bound_tok_s=row["io_bound_tok_s"],
        disk_source=_disk_source(disk),
        candidates=candidates, notes=notes, stream_gate=streamed, draft_copy=bool(copy_bytes))


def draft_copy_bytes(info: SidecarInfo) -> int | None:
    """Bytes the engine allocates for the sidecar's draft copy (csrc/offload_state.cpp: both tensors of
    every layer, each rounded up to a page); None when a served layer has no draft copy."""
    if any(lay.draft_type is None for lay in info.layers):
        return None
    return sum(2 * (-(-lay.n_ff * lay.draft_row_bytes // PAGE) * PAGE) for lay in info.layers)

