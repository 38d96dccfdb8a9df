"""The neuron-cluster part of an offload plan: the neuron cache's slots (a slot is one cluster of
``C`` consecutive neurons of one layer, base order: its up rows from the base GGUF and its down_t rows
from the sidecar, each read by O_DIRECT as one page-aligned span), which clusters to pin, and the
flash reads a decoded token is expected to make.

Neuron activation frequencies ``f_i`` come from the sidecar (format 2, at its operating point); with
independent neurons a cluster is needed for a token with probability ``1 - prod(1 - f_i)``. Sizes the
engine allocates come from the engine (``_native.cache_slot_bytes``, ``_native.cache_min_cold_slots``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import _native
from ..files.sidecar import SidecarInfo, read_layer_vectors
from .plan_disk import DiskModel

#: Bytes of the alignment an O_DIRECT read of a cluster's rows is widened to (the sidecar's and the
#: reader's alignment).
READ_ALIGN = 4096
#: Cluster sizes (neurons per slot) the planner tries.
CLUSTER_SIZES = (4, 8, 16, 32, 64, 128, 256)  # 256: the neuron cache's and the kernel's largest unit
#: Read-ahead thresholds tried (P(needed) >= it); 1.01 means no read-ahead.
PREFETCH_MIN_PROBS = (0.25, 0.5, 0.75, 0.9, 1.01)
#: Queue depth: the deepest whose predicted tok/s is within this share of the best. A probe's depth
#: curve is noisy (0.25 s per point: 256 KiB reads measured 1.28 GB/s at depth 4 and 1.14 at depth 32
#: in one probe, the reverse in others), in-flight reads cost io_uring nothing, and the engine's
#: read-ahead keeps more of them busy than the model credits (Qwen2.5-1.5B, 900 MiB limit, alternated
#: runs: 3.34 and 3.62 tok/s at depth 32 against 3.19 and 3.23 at the depth 4 that probe preferred).
DEPTH_NEAR_BEST = 0.85
#: Queue depth the kernel's read-ahead of a streamed gate is timed at (MADV_WILLNEED on 7 MB: a few
#: large requests in flight).
GATE_READ_DEPTH = 4


def neuron_frequencies(info: SidecarInfo) -> list[np.ndarray]:
    """Per served layer, every neuron's activation frequency in base neuron order (float64)."""
    freqs = []
    for lay in info.layers:
        v = read_layer_vectors(info, lay)
        base = np.empty(lay.n_ff, dtype=np.float64)
        base[v["order"]] = v["freq"]  # bundle position k holds base neuron order[k]
        freqs.append(base)
    return freqs


def _span(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Bytes of the READ_ALIGN-aligned range covering [start, start + length)."""
    return -(-(start + length) // READ_ALIGN) * READ_ALIGN - start // READ_ALIGN * READ_ALIGN


@dataclass
class ClusterTable:
    """Per served layer, for one cluster size: P(needed), sum of f, bytes of the two reads (aligned
    spans, as the disk serves them). ``slot_bytes``: one cache slot, by the neuron cache's own formula
    (``_native.cache_slot_bytes``)."""

    size: int
    prob: list[np.ndarray]
    sumf: list[np.ndarray]
    up: list[np.ndarray]
    down_t: list[np.ndarray]
    slot_bytes: int

    @property
    def total_clusters(self) -> int:
        return sum(len(p) for p in self.prob)

    @property
    def max_clusters_per_layer(self) -> int:
        return max(len(p) for p in self.prob)

    def cold_slots(self, prefetch_layers: int) -> int:
        """The fewest cold slots the neuron cache accepts (its own formula)."""
        return int(_native.cache_min_cold_slots(prefetch_layers, self.max_clusters_per_layer))


def cluster_table(info: SidecarInfo, freqs: list[np.ndarray], size: int) -> ClusterTable:
    """The :class:`ClusterTable` of clusters of ``size`` neurons."""
    prob, sumf, up, down_t = [], [], [], []
    for lay, f in zip(info.layers, freqs):
        k = -(-lay.n_ff // size)
        m = np.zeros(k * size)
        m[: lay.n_ff] = np.clip(f, 0.0, 1.0)
        m = m.reshape(k, size)
        with np.errstate(divide="ignore"):
            prob.append((-np.expm1(np.log1p(-m).sum(axis=1))).astype(np.float32))
        sumf.append(m.sum(axis=1))
        first = np.arange(k, dtype=np.int64) * size
        count = np.minimum(size, lay.n_ff - first)
        up.append(_span(lay.base_up_offset + first * lay.up_row_bytes, count * lay.up_row_bytes))
        down_t.append(_span(lay.down_t_offset + first * lay.down_t_row_bytes, count * lay.down_t_row_bytes))
    slot = int(
        _native.cache_slot_bytes(
            size, max(lay.up_row_bytes for lay in info.layers), max(lay.down_t_row_bytes for lay in info.layers)
        )
    )
    return ClusterTable(size, prob, sumf, up, down_t, slot)


def cluster_tables(info: SidecarInfo, cluster_size: int | None) -> list[ClusterTable]:
    """The tables of every cluster size tried: ``cluster_size`` alone when given, else every
    CLUSTER_SIZES entry up to the largest n_ff."""
    freqs = neuron_frequencies(info)
    sizes = [c for c in CLUSTER_SIZES if c <= max(lay.n_ff for lay in info.layers)] or [CLUSTER_SIZES[0]]
    return [cluster_table(info, freqs, c) for c in ([cluster_size] if cluster_size else sizes)]


def pin_hottest(table: ClusterTable, n_slots: int) -> list[np.ndarray]:
    """Boolean pin masks: the n_slots clusters of highest P(needed), then highest sum of f, over all layers."""
    prob, sumf = np.concatenate(table.prob), np.concatenate(table.sumf)
    chosen = np.zeros(len(prob), dtype=bool)
    chosen[np.lexsort((-sumf, -prob))[:n_slots]] = True
    return np.split(chosen, np.cumsum([len(p) for p in table.prob])[:-1])


def flash_reads_per_token(
    table: ClusterTable, pinned: list[np.ndarray], disk: DiskModel, pmin: float, depth: int, prefetch_layers: int
) -> tuple[float, float, float]:
    """(flash bytes per token, device seconds per token, demand-stall seconds per token). Unpinned
    clusters with P >= pmin are read ahead (always read); the others on demand (read with probability
    P) after the layer's gate. Time = max(device busy time at the queue depth the reads can fill, sum
    of per-layer demand stalls)."""
    n, total_bytes, stall = len(table.prob), 0.0, 0.0
    weights, sizes, spec_req, demand_req = [], [], np.zeros(n), np.zeros(n)
    for i in range(n):
        miss = ~pinned[i]
        p, up, dt = table.prob[i][miss].astype(float), table.up[i][miss], table.down_t[i][miss]
        spec = p >= pmin if prefetch_layers else np.zeros(len(p), dtype=bool)
        w = np.where(spec, 1.0, p)
        total_bytes += float((w * (up + dt)).sum())
        spec_req[i], demand_req[i] = 2 * spec.sum(), 2 * p[~spec].sum()
        d = min(max(demand_req[i], 1.0), depth)
        stall += float((p[~spec] * (disk.seconds(up[~spec], d) + disk.seconds(dt[~spec], d))).sum())
        weights.append(np.concatenate([w, w]))
        sizes.append(np.concatenate([up, dt]))
    window = np.mean(
        [demand_req[i] + sum(spec_req[(i + j) % n] for j in range(1, prefetch_layers + 1)) for i in range(n)]
    )
    w, s = np.concatenate(weights), np.concatenate(sizes)
    busy = float((w * disk.seconds(s, min(max(window, 1.0), depth))).sum()) if len(s) else 0.0
    return total_bytes, max(busy, stall), stall


def layers_reading(table: ClusterTable, pinned: list[np.ndarray], pmin: float, prefetch_layers: int) -> float:
    """Expected served layers per token that read at least one cluster: a layer with an unpinned
    cluster read ahead (P >= pmin) always reads; else with probability 1 - prod(1 - P) over its
    unpinned clusters (independent, as P(needed) assumes)."""
    total = 0.0
    for p, h in zip(table.prob, pinned):
        q = p[~h].astype(float)
        if prefetch_layers and bool((q >= pmin).any()):
            total += 1.0
        else:
            total += float(-np.expm1(np.log1p(-np.clip(q, 0.0, 1.0 - 1e-12)).sum())) if len(q) else 0.0
    return total


@dataclass(frozen=True)
class StreamedGate:
    """A gate read from flash every token: its bytes, and one sequential read per layer of these sizes."""

    bytes_per_token: int
    layer_bytes: tuple[int, ...]


@dataclass(frozen=True)
class CacheChoice:
    """The neuron cache for one cluster table under a budget: which clusters are pinned, the read-ahead
    threshold and queue depth chosen, and what they predict. ``rank``: the order choices compare in
    (higher is better)."""

    table: ClusterTable
    pinned: list[np.ndarray]
    prefetch_min_prob: float
    queue_depth: int
    flash_bytes_per_token: float
    tok_s: float
    hit_rate: float
    neuron_hit_rate: float
    rank: tuple
    read_layers: float = 0.0  # expected served layers per token that read a cluster (layers_reading)

    @property
    def hot_slots(self) -> int:
        return int(sum(int(h.sum()) for h in self.pinned))

    @property
    def io_bound_tok_s(self) -> float | None:
        return None if math.isinf(self.tok_s) else self.tok_s


def all_resident(table: ClusterTable, n_hot: int, prefetch_layers: int) -> bool:
    """Whether the cold region (``table.cold_slots``) holds every cluster not pinned. The engine's cold
    slots are one LRU over every layer; a token needs the layers in turn, so where the unpinned clusters
    outnumber the cold slots LRU keeps nothing for the next token (measured, Qwen2.5-1.5B at 1200 MiB:
    869 pinned + 105 cold of 980, 15 cold hits in 282 tokens), and where they fit every one stays after
    its first read (910 pinned + 105 cold: hit rate 0.9998, 0.1 MB read per token)."""
    return n_hot + table.cold_slots(prefetch_layers) >= table.total_clusters


def _all_resident_choice(
    table: ClusterTable, pinned: list[np.ndarray], disk: DiskModel, gate: StreamedGate | None
) -> CacheChoice:
    """The choice where every cluster stays resident: only a streamed gate is read per token."""
    nbytes, secs = 0.0, 0.0
    if gate is not None:
        nbytes = float(gate.bytes_per_token)
        secs = float(disk.seconds(np.array(gate.layer_bytes, dtype=float), GATE_READ_DEPTH).sum())
    tok_s = 1.0 / secs if secs > 0 else math.inf
    return CacheChoice(
        table=table,
        pinned=pinned,
        prefetch_min_prob=1.01,
        queue_depth=int(disk.depths.astype(int).max()),
        flash_bytes_per_token=nbytes,
        tok_s=tok_s,
        hit_rate=1.0,
        neuron_hit_rate=1.0,
        rank=(round(tok_s, 2), -round(nbytes), 0.0, 1.01, int(disk.depths.astype(int).max())),
    )


def choose_cache(
    table: ClusterTable, n_hot: int, disk: DiskModel, prefetch_layers: int, gate: StreamedGate | None
) -> CacheChoice:
    """Pin the ``n_hot`` hottest clusters; of every read-ahead threshold and queue depth, the deepest
    queue whose predicted tok/s is within DEPTH_NEAR_BEST of the best (then the best). ``gate``: the
    gate streamed on the same disk every token (None: resident).

    Where the cold region holds every unpinned cluster (:func:`all_resident`), nothing is read after
    each cluster's first use: hit rate 1, no cluster bytes per token (the gate's, where streamed)."""
    pinned = pin_hottest(table, n_hot)
    if all_resident(table, n_hot, prefetch_layers):
        return _all_resident_choice(table, pinned, disk, gate)
    options = []
    for pmin in PREFETCH_MIN_PROBS if prefetch_layers else (1.01,):
        for depth in disk.depths.astype(int):
            nbytes, secs, stall = flash_reads_per_token(table, pinned, disk, pmin, int(depth), prefetch_layers)
            if gate is not None:  # every gate row, one large sequential read per layer on the same disk
                nbytes += gate.bytes_per_token
                secs += float(disk.seconds(np.array(gate.layer_bytes, dtype=float), GATE_READ_DEPTH).sum())
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
    read_layers = layers_reading(table, pinned, pmin, prefetch_layers)
    needed = sum(float(p.sum()) for p in table.prob)
    mass = sum(float(s.sum()) for s in table.sumf)
    hit = sum(float(p[h].sum()) for p, h in zip(table.prob, pinned))
    hit_mass = sum(float(s[h].sum()) for s, h in zip(table.sumf, pinned))
    return CacheChoice(
        table=table,
        pinned=pinned,
        prefetch_min_prob=pmin,
        queue_depth=depth,
        flash_bytes_per_token=nbytes,
        tok_s=tok_s,
        hit_rate=hit / needed if needed else 1.0,
        neuron_hit_rate=hit_mass / mass if mass else 1.0,
        rank=key,
        read_layers=read_layers,
    )
