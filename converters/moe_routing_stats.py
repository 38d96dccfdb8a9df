"""Statistics of recorded MoE routing (pure NumPy): how skewed, how persistent, how cacheable.

Inputs are per-layer int arrays ``ids`` [n_tokens, n_used] of selected expert ids (a
:class:`~llamaflash.converters.moe_routing.RoutingTrace` holds one per layer) and, for the
consecutive-token statistics, ``continues`` (bool [n_tokens]: token i follows token i-1 in the same
sequence; default: all but the first).

* :func:`expert_counts`: how often each expert was selected;
* :func:`top_k_share`: share of all selections carried by the k most selected experts;
* :func:`reuse_rate`: of a token's experts, the fraction the previous token also used
  (random routing gives about n_used / n_expert);
* :func:`layer_transitions`: counts of (expert in layer a, expert in layer b) for the same token,
  the basis of next-layer prefetch prediction;
* :func:`lru_hit_rate`: hit rate of a per-layer expert cache of ``slots`` entries, LRU, optionally
  with ``pinned`` experts that never leave it;
* :func:`summarize`: all of it per layer for a trace, as plain values (JSON-ready).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np


def _check(ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"expert ids must be [n_tokens, n_used], got shape {ids.shape}")
    return ids


def _continues(n: int, continues: np.ndarray | None) -> np.ndarray:
    if continues is None:
        out = np.ones(n, dtype=bool)
        if n:
            out[0] = False
        return out
    continues = np.asarray(continues, dtype=bool)
    if continues.shape != (n,):
        raise ValueError(f"continues must be bool [{n}], got shape {continues.shape}")
    return continues


def expert_counts(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """int64 [n_expert]: selections of each expert."""
    ids = _check(ids)
    return np.bincount(ids.ravel(), minlength=n_expert)[:n_expert].astype(np.int64)


def top_k_share(ids: np.ndarray, n_expert: int, k: int = 8) -> float:
    """Share of all selections that went to the ``k`` most selected experts (0 for no tokens)."""
    counts = expert_counts(ids, n_expert)
    total = counts.sum()
    return float(np.sort(counts)[::-1][:k].sum() / total) if total else 0.0


def reuse_rate(ids: np.ndarray, continues: np.ndarray | None = None) -> float:
    """Mean over tokens with a predecessor of |experts(t) ∩ experts(t-1)| / n_used."""
    ids = _check(ids)
    n, n_used = ids.shape
    cont = _continues(n, continues)
    idx = np.flatnonzero(cont)
    idx = idx[idx > 0]
    if idx.size == 0:
        return 0.0
    cur, prev = ids[idx], ids[idx - 1]
    shared = (cur[:, :, None] == prev[:, None, :]).any(axis=2).sum()
    return float(shared / (idx.size * n_used))


def layer_transitions(ids_a: np.ndarray, ids_b: np.ndarray, n_expert: int) -> np.ndarray:
    """int64 [n_expert, n_expert]: M[i, j] = tokens that selected expert i in layer a and expert j
    in layer b (every pair of the token's selections counts once)."""
    ids_a, ids_b = _check(ids_a), _check(ids_b)
    if ids_a.shape[0] != ids_b.shape[0]:
        raise ValueError("both layers must cover the same tokens")
    n_a, n_b = ids_a.shape[1], ids_b.shape[1]
    rows = np.repeat(ids_a, n_b, axis=1).ravel()
    cols = np.tile(ids_b, (1, n_a)).ravel()
    out = np.zeros(n_expert * n_expert, dtype=np.int64)
    np.add.at(out, rows.astype(np.int64) * n_expert + cols, 1)
    return out.reshape(n_expert, n_expert)


def lru_hit_rate(ids: np.ndarray, slots: int, pinned: Iterable[int] = (), continues: np.ndarray | None = None) -> float:
    """Hit rate of a cache of one layer's experts over the token stream.

    The cache holds ``slots`` experts in all, ``pinned`` ones (at most ``slots``) permanently and the
    rest in least-recently-used order. For each token, every selected expert is looked up (a hit
    when cached), then inserted (evicting the least recently used unpinned one when full) and
    marked most recently used. ``continues`` does not reset the cache (a cache outlives sequences);
    it is accepted for symmetry and ignored. The cache starts empty (cold misses count).
    """
    ids = _check(ids)
    pinned = set(int(e) for e in pinned)
    if slots < 0 or len(pinned) > slots:
        raise ValueError(f"{len(pinned)} pinned experts do not fit in {slots} slots")
    capacity = slots - len(pinned)
    lru: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in ids:
        for e in row.tolist():
            total += 1
            if e in pinned:
                hits += 1
                continue
            if e in lru:
                hits += 1
                lru.move_to_end(e)
                continue
            if capacity == 0:
                continue
            if len(lru) >= capacity:
                lru.popitem(last=False)
            lru[e] = None
    return hits / total if total else 0.0


def summarize(trace, k: int = 8, cache_slots: Iterable[int] = (), pin_top: int = 0) -> dict:
    """Per-layer and overall statistics of a RoutingTrace as plain values.

    Per layer: ``top_k_share``, ``reuse``, ``counts``; with ``cache_slots``, ``lru`` (slots -> hit
    rate) and, when ``pin_top`` > 0, ``pinned_lru`` (slots -> hit rate with the layer's ``pin_top``
    most selected experts pinned: an oracle choice, measured on the same trace). Overall: the mean
    and range over layers of ``top_k_share`` and ``reuse``, and the uniform-routing reference
    ``random_reuse`` = n_used / n_expert.
    """
    cont = trace.continues_previous()
    layers = {}
    for layer in trace.layers:
        ids = trace.experts[layer]
        counts = expert_counts(ids, trace.n_expert)
        entry = {
            "top_k_share": top_k_share(ids, trace.n_expert, k),
            "reuse": reuse_rate(ids, cont),
            "counts": counts.tolist(),
        }
        slots = list(cache_slots)
        if slots:
            entry["lru"] = {s: lru_hit_rate(ids, s) for s in slots}
            if pin_top > 0:
                hot = np.argsort(-counts, kind="stable")[:pin_top].tolist()
                entry["pinned_lru"] = {s: lru_hit_rate(ids, s, hot) for s in slots if s >= pin_top}
        layers[layer] = entry
    shares = np.array([v["top_k_share"] for v in layers.values()]) if layers else np.zeros(1)
    reuse = np.array([v["reuse"] for v in layers.values()]) if layers else np.zeros(1)
    return {
        "n_tokens": trace.n_tokens,
        "n_sequences": int(len(trace.sequence_starts)),
        "n_expert": trace.n_expert,
        "n_used": trace.n_used,
        "k": k,
        "random_reuse": trace.n_used / trace.n_expert if trace.n_expert else 0.0,
        "top_k_share": {"mean": float(shares.mean()), "min": float(shares.min()), "max": float(shares.max())},
        "reuse": {"mean": float(reuse.mean()), "min": float(reuse.min()), "max": float(reuse.max())},
        "layers": layers,
    }
