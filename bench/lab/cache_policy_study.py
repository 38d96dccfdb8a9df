"""The expert cache's policy against the offline optimum, simulated on recorded routing traces.

A trace is, per MoE layer, the experts llama.cpp routed each token to (k = n_used per token, in its
order: descending router probability), recorded with stock llama.cpp by
:func:`llamaflash.bench.predictor_study.capture_text` (router logits only, no FFN inputs). Tokens
are served in order, one after another (decode order); each layer has its own cache of ``n_slots``
slots, and token t's request in layer l is its k experts, all needed at once: a request's experts
never evict each other, and every one of them must be resident after it (no bypass).

Policies, per layer:

* ``engine``: the cache in csrc/experts/expert_cache.cpp without prefetch: P experts pinned, the P
  most selected in the sidecar's calibration counts with P = expert_plan.pinned_count(n_slots, k),
  never evicted; the other n_slots - P slots LRU by last use.
* ``pinned-P``: the same with any P (the sweep), ``lru``: P = 0.
* ``static``: the n_slots most selected experts resident, nothing else ever (an upper bound for a
  static cache: the engine also needs k slots for the misses).
* ``belady``: on a miss, evict the resident experts outside the request whose next use lies
  farthest in the future (never used again: farthest; ties: lower expert first). Optimal for
  single-expert requests of uniform cost; with k experts per request it is the standard
  generalisation, a strong reference rather than a proven optimum.

Hit rate = hits / experts needed, over the tokens after ``warmup`` (the cache is filled from empty
at token 0, except the pinned experts, resident from the start as the engine reads them at open).

LRU as a stack algorithm: a request moves its experts to the top of the recency stack (first-ranked
most recent); at any size s >= k the LRU cache holds the top s of that stack, so an expert is a hit
iff its stack position before the request is < s. With the top-P experts pinned, the LRU part is
the same stack without them, at size s - P. One pass per layer gives every (s, P).

Per-layer allocation: the same total slots (n_slots x layers) split unequally, each layer at least
k and at most n_expert, by (a) exp(entropy) of the layer's calibration counts (proportional,
largest remainder), (b) the planner's model of the engine's hit rate per layer
(expert_plan.lru_miss_rate on the calibration counts), maximised by dynamic programming, and
(c) the trace's own per-layer hit curves of the engine policy (the in-sample optimum allocation).

Usage::

    python -m llamaflash.bench.cache_policy_study TRACE.npz --sidecar MODEL.flash.gguf
        [--slots 18,27,36,50,64] [--warmup 128] [--json OUT]
        [--record MODEL.gguf --tokens 2048 --seq-len 512]   (records TRACE.npz first when missing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INF = np.iinfo(np.int32).max
DEFAULT_SLOTS = (18, 27, 36, 50, 64)


# --------------------------------------------------------------------------- trace


@dataclass(frozen=True)
class Trace:
    """``routed[layer]``: int [n_tokens, k] routed experts per token; ``follows``: bool [n_tokens],
    token i continues token i-1's recorded window (the simulation serves all tokens as one stream)."""

    routed: dict[int, np.ndarray]
    n_expert: int
    follows: np.ndarray

    @property
    def layers(self) -> list[int]:
        return sorted(self.routed)

    @property
    def n_tokens(self) -> int:
        return int(self.follows.size)

    @property
    def k(self) -> int:
        return int(next(iter(self.routed.values())).shape[1])


def load_trace(path: Path, n_expert: int) -> Trace:
    """The routed experts of a capture written by predictor_study.save_capture."""
    from llamaflash.bench import predictor_study as ps

    cap = ps.load_capture(path)
    return Trace({il: cap.routed[il].astype(np.int64) for il in cap.layers}, n_expert, cap.follows)


# --------------------------------------------------------------------------- reference simulators


def simulate_lru(requests: np.ndarray, n_slots: int, pinned=(), warmup: int = 0) -> int:
    """Hits of ``pinned`` (resident from the start) + LRU on the other n_slots - len(pinned) slots,
    counted from token ``warmup``; requests int [n_tokens, k]. Explicit: evicts the least recently
    used expert outside the request for each miss; a request's experts become the most recent, the
    first-ranked most recent of all."""
    pin = set(int(e) for e in pinned)
    cap = n_slots - len(pin)
    lru: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = 0
    for t, req in enumerate(requests):
        req = [int(e) for e in req]
        want = [e for e in req if e not in pin]
        if len(want) > cap:
            raise ValueError(f"token {t}: {len(want)} unpinned experts, {cap} LRU slots")
        missing = [e for e in want if e not in lru]
        if t >= warmup:
            hits += len(req) - len(missing)
        in_req = set(want)
        while len(lru) + len(missing) > cap:
            victim = next(e for e in lru if e not in in_req)
            del lru[victim]
        for e in reversed(want):
            lru[e] = None
            lru.move_to_end(e)
    return hits


def next_uses(requests: np.ndarray, n_expert: int) -> np.ndarray:
    """int64 [n_tokens, n_expert]: entry [t, e] the first token after t that requests e (n_tokens:
    none)."""
    n = len(requests)
    used = np.zeros((n + 1, n_expert), dtype=bool)
    used[np.repeat(np.arange(n), requests.shape[1]), requests.ravel()] = True
    at = np.where(used, np.arange(n + 1)[:, None], n)
    at[n] = n
    return np.minimum.accumulate(at[::-1], axis=0)[::-1][1:]


def simulate_belady(requests: np.ndarray, n_slots: int, n_expert: int, warmup: int = 0) -> int:
    """Hits of Belady's policy (see the module doc) on ``n_slots`` slots from an empty cache,
    counted from token ``warmup``."""
    nxt = next_uses(requests, n_expert)
    resident = np.zeros(n_expert, dtype=bool)
    n_resident = hits = 0
    for t, req in enumerate(requests):
        if len(req) > n_slots:
            raise ValueError(f"token {t}: {len(req)} experts, {n_slots} slots")
        missing = req[~resident[req]]
        if t >= warmup:
            hits += len(req) - len(missing)
        evict = n_resident + len(missing) - n_slots
        if evict > 0:
            score = np.where(resident, nxt[t], -1)
            score[req] = -1
            victims = np.argsort(-score, kind="stable")[:evict]
            resident[victims] = False
            n_resident -= evict
        resident[missing] = True
        n_resident += len(missing)
    return hits


def static_hits(requests: np.ndarray, resident, warmup: int = 0) -> int:
    """Hits of a cache that only ever holds ``resident``."""
    keep = np.asarray(list(resident), dtype=np.int64)
    mask = np.zeros(max(int(requests.max(initial=0)), int(keep.max(initial=0))) + 1, dtype=bool)
    mask[keep] = True
    return int(mask[requests[warmup:]].sum())


def simulate_prefetch(
    requests: np.ndarray, predicted: np.ndarray, n_slots: int, pinned=(), warmup: int = 0
) -> tuple[int, int, int]:
    """The engine's policy with its next-layer prefetch: before token t's request, the experts of
    ``predicted[t]`` (best first) that are not resident are read into LRU victims other than the
    predicted experts (never a pinned slot) and become the most recent, best first most recent
    (ExpertCache::prefetch); then the request as in :func:`simulate_lru`. Returns (demand hits,
    experts prefetched, prefetched experts the request used), counted from token ``warmup``."""
    pin = set(int(e) for e in pinned)
    cap = n_slots - len(pin)
    lru: OrderedDict[int, None] = OrderedDict()  # least recent first
    hits = fetched = used = 0
    for t, (req, guess) in enumerate(zip(requests, predicted)):
        want = [int(e) for e in req if int(e) not in pin]
        new = [int(e) for e in guess if int(e) not in pin and int(e) not in lru]
        keep = set(int(e) for e in guess)
        for e in reversed(new):
            if len(lru) >= cap:
                del lru[next(v for v in lru if v not in keep)]
            lru[e] = None
        missing = [e for e in want if e not in lru]
        if t >= warmup:
            hits += len(req) - len(missing)
            fetched += len(new)
            used += len(set(new) & set(want))
        in_req = set(want)
        while len(lru) + len(missing) > cap:
            del lru[next(e for e in lru if e not in in_req)]
        for e in reversed(want):
            lru[e] = None
            lru.move_to_end(e)
    return hits, fetched, used


def prefetch_study(
    trace: Trace, x: dict[int, np.ndarray], routers: dict[int, np.ndarray], counts, slots, pins, warmup: int
) -> dict:
    """Per slot count and pinned count (``pins(s)``: the P values tried), the engine with the
    lookahead prefetch (predicted = top k of R_{l+1} · x_l, predictor_study.top_k): demand hit
    rate, experts read per expert needed (demand misses + prefetches) and prefetch precision; the
    first layer is never prefetched. Layers without a previous layer's input are left out."""
    from llamaflash.bench.predictor_study import top_k

    layers = [il for il in trace.layers if il - 1 in x and il in routers]
    n_eval = (trace.n_tokens - warmup) * trace.k * len(layers)
    guesses = {il: top_k(x[il - 1] @ routers[il].T.astype(np.float32), trace.k) for il in layers}
    out = {}
    for s in slots:
        row = {}
        for p in pins(s):
            hits = fetched = used = 0
            for il in layers:
                rank = np.argsort(-np.asarray(counts[il]), kind="stable")
                h, f, u = simulate_prefetch(trace.routed[il], guesses[il], s, rank[:p], warmup)
                hits, fetched, used = hits + h, fetched + f, used + u
            row[str(p)] = {
                "hit_rate": hits / n_eval,
                "reads_per_needed": (n_eval - hits + fetched) / n_eval,
                "prefetch_precision": used / max(1, fetched),
            }
        out[str(s)] = row
    return {"layers": len(layers), "tokens": trace.n_tokens, "by_slots": out}


def reuse_by_lag(trace: Trace, lags=(1, 2, 4, 8, 16, 64, 256)) -> dict:
    """Mean share of token t's experts also routed at token t - d (within one recorded window),
    against independent routing with the trace's own per-layer selection rates q_e: sum q_e^2 / k."""
    k = trace.k
    out = {}
    starts = np.cumsum(~trace.follows) - 1  # window index of each token
    for d in lags:
        same = starts[d:] == starts[:-d]
        if not same.any():
            continue
        shares = []
        for il in trace.layers:
            r = trace.routed[il]
            hit = np.zeros((len(r), trace.n_expert), dtype=bool)
            hit[np.repeat(np.arange(len(r)), k), r.ravel()] = True
            shares.append((hit[d:] & hit[:-d]).sum(1)[same].mean() / k)
        out[str(d)] = float(np.mean(shares))
    q = [np.bincount(trace.routed[il].ravel(), minlength=trace.n_expert) / trace.n_tokens for il in trace.layers]
    out["independent"] = float(np.mean([np.sum(qq**2) / k for qq in q]))
    return out


# --------------------------------------------------------------------------- LRU stack positions


def lru_stack(requests: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """int32 [n_tokens, k, n_expert + 1]: entry [t, j, P] is the stack position (0 = most recent)
    of expert requests[t, j] before token t in the LRU stack without the P most popular experts
    (``rank``: expert ids, most popular first), INF for an expert not used before. The LRU part of
    a cache with those P pinned and s - P other slots holds it iff the position is < s - P."""
    n, k = requests.shape
    n_expert = rank.size
    key = np.full((n, n_expert), -1, dtype=np.int64)  # recency key of each expert's use at token t
    rows = np.repeat(np.arange(n), k)
    key[rows, requests.ravel()] = (np.arange(n)[:, None] * k + (k - 1 - np.arange(k))[None, :]).ravel()
    last = np.maximum.accumulate(key, axis=0)
    before = np.vstack([np.full((1, n_expert), -1, dtype=np.int64), last[:-1]])  # keys before token t
    by_rank = before[:, rank]  # [n, n_expert] in popularity order
    mine = np.take_along_axis(before, requests, axis=1)  # [n, k]
    newer = by_rank[:, None, :] > mine[:, :, None]  # [n, k, n_expert]
    out = np.zeros((n, k, n_expert + 1), dtype=np.int32)
    out[:, :, :-1] = np.cumsum(newer[:, :, ::-1], axis=2, dtype=np.int32)[:, :, ::-1]
    out[mine < 0] = INF
    return out


def pinned_lru_hits(stack: np.ndarray, requests: np.ndarray, rank_of: np.ndarray, n_slots: int, n_pin: int) -> int:
    """Hits (all tokens of ``stack``) of the top-``n_pin`` pinned + LRU on n_slots - n_pin slots."""
    pinned = rank_of[requests] < n_pin
    lru_hit = stack[:, :, n_pin] < n_slots - n_pin
    return int((pinned | lru_hit).sum())


# --------------------------------------------------------------------------- per-layer allocation


def allocate_proportional(weights: np.ndarray, total: int, lo: int, hi: int) -> np.ndarray:
    """Slots per layer summing to ``total``, each in [lo, hi], the part above lo proportional to
    ``weights`` (largest remainder; a layer capped at hi gives its share to the others)."""
    w = np.asarray(weights, dtype=float)
    n = w.size
    if not n * lo <= total <= n * hi:
        raise ValueError(f"{total} slots cannot be split over {n} layers within [{lo}, {hi}]")
    out = np.full(n, lo, dtype=np.int64)
    free = np.ones(n, dtype=bool)
    while True:
        left = total - out[~free].sum() - lo * free.sum()
        share = w * free / max(float((w * free).sum()), 1e-300) * left
        cand = lo + share
        over = free & (cand > hi)
        if not over.any():
            base = np.floor(share).astype(np.int64)
            rem = int(left - base[free].sum())
            order = np.argsort(-(share - base) * free, kind="stable")[:rem]
            out[free] = lo + base[free]
            out[order] += 1
            return out
        out[over] = hi
        free &= ~over


def allocate_best(curves: list[np.ndarray], total: int, lo: int) -> np.ndarray:
    """Slots per layer summing to ``total`` maximising sum_l curves[l][s_l - lo] (curves[l][i]: the
    layer's hits at lo + i slots), by dynamic programming over the layers."""
    n = len(curves)
    spare = total - n * lo
    best = np.full(spare + 1, -np.inf)  # best[c]: the layers so far with exactly c spare slots
    best[0] = 0.0
    choice = []
    for c in curves:
        c = np.asarray(c, dtype=float)
        new = np.full(spare + 1, -np.inf)
        arg = np.zeros(spare + 1, dtype=np.int64)
        for i in range(min(len(c), spare + 1)):
            cand = np.full(spare + 1, -np.inf)
            cand[i:] = best[: spare + 1 - i] + c[i]
            better = cand > new
            new[better], arg[better] = cand[better], i
        best = new
        choice.append(arg)
    out, at = np.zeros(n, dtype=np.int64), spare
    for li in range(n - 1, -1, -1):
        out[li] = lo + choice[li][at]
        at -= choice[li][at]
    return out


def entropy_size(counts: np.ndarray) -> float:
    """exp(entropy) of the selection shares: the number of equally popular experts with the same
    spread (1 .. n_expert)."""
    p = np.asarray(counts, dtype=float)
    p = p[p > 0] / p.sum()
    return float(np.exp(-(p * np.log(p)).sum()))


# --------------------------------------------------------------------------- the study


def study(trace: Trace, counts: dict[int, np.ndarray], slots: list[int], warmup: int, log=print) -> dict:
    """Every policy at every slot count (see the module doc); hit rates over the tokens >= warmup."""
    from llamaflash.planning import expert_plan as ep

    k, n_expert, layers = trace.k, trace.n_expert, trace.layers
    n_eval = trace.n_tokens - warmup
    if n_eval <= 0:
        raise ValueError(f"warmup {warmup} leaves no tokens of {trace.n_tokens}")
    needed = n_eval * k  # per layer
    slots = [s for s in slots if k <= s <= n_expert]
    sizes = np.arange(k, n_expert + 1)
    rank_of, engine_curve, pin_grid = {}, {}, {}
    t0 = time.perf_counter()
    for il in layers:
        req = trace.routed[il]
        rank = np.argsort(-np.asarray(counts[il]), kind="stable")
        rank_of[il] = np.argsort(rank, kind="stable")
        stack = lru_stack(req, rank)[warmup:]
        r_eval = req[warmup:]
        pinned = rank_of[il][r_eval]
        # hits[s, P] for every size and pinned count P <= s - k
        grid = np.full((n_expert + 1, n_expert + 1), -1, dtype=np.int64)
        for p in range(0, n_expert - k + 1):
            pos = stack[:, :, p]
            pin_hits = int((pinned < p).sum())
            free = (pinned >= p).ravel()
            hist = np.bincount(np.minimum(pos.ravel()[free], n_expert), minlength=n_expert + 1)
            cum = np.cumsum(hist)  # cum[c]: LRU hits at capacity c + 1
            for s in range(k + p, n_expert + 1):
                grid[s, p] = pin_hits + (int(cum[s - p - 1]) if s - p >= 1 else 0)
        pin_grid[il] = grid
        engine_curve[il] = np.array([grid[s, ep.pinned_count(s, k)] for s in sizes])
    log(f"LRU stacks of {len(layers)} layers in {time.perf_counter() - t0:.0f} s")

    per_size = {}
    for s in slots:
        t1 = time.perf_counter()
        n_pin = ep.pinned_count(s, k)
        rows: dict[str, list[float]] = {"engine": [], "lru": [], "static": [], "belady": []}
        predicted = []
        for il in layers:
            req = trace.routed[il]
            top = np.argsort(-np.asarray(counts[il]), kind="stable")
            grid = pin_grid[il]
            rows["engine"].append(grid[s, n_pin] / needed)
            rows["lru"].append(grid[s, 0] / needed)
            rows["static"].append(static_hits(req, top[:s], warmup) / needed)
            rows["belady"].append(simulate_belady(req, s, n_expert, warmup) / needed)
            predicted.append(1 - ep.lru_miss_rate(counts[il], k, s, n_pin))
        total_by_p = sum(pin_grid[il][s, : s - k + 1] for il in layers) / (needed * len(layers))
        best_p = int(np.argmax(total_by_p))
        per_layer_best = [int(np.argmax(pin_grid[il][s, : s - k + 1])) for il in layers]
        mean = {m: float(np.mean(v)) for m, v in rows.items()}
        per_size[str(s)] = {
            "n_slots": s,
            "planner_pinned": n_pin,
            "hit_rate": mean,
            "gap_engine_to_belady": mean["belady"] - mean["engine"],
            "planner_predicted_hit_rate": float(np.mean(predicted)),
            "per_layer": {m: [round(float(x), 5) for x in v] for m, v in rows.items()},
            "spread": {
                m: {"min": float(np.min(v)), "median": float(np.median(v)), "max": float(np.max(v))}
                for m, v in rows.items()
            },
            "pinned_sweep": {
                "hit_rate_by_p": [round(float(x), 5) for x in total_by_p],
                "best_p": best_p,
                "best_p_hit_rate": float(total_by_p[best_p]),
                "planner_p_hit_rate": float(total_by_p[n_pin]),
                "per_layer_best_p": per_layer_best,
            },
            "allocation": _allocations(trace, counts, engine_curve, s, needed, k, n_expert),
        }
        log(
            f"{s} slots ({n_pin} pinned): engine {mean['engine']:.3f} lru {mean['lru']:.3f} "
            f"static {mean['static']:.3f} belady {mean['belady']:.3f}; best P {best_p} "
            f"{total_by_p[best_p]:.3f} ({time.perf_counter() - t1:.0f} s)"
        )
    return {
        "n_tokens": trace.n_tokens,
        "warmup_tokens": warmup,
        "eval_tokens": n_eval,
        "n_layers": len(layers),
        "n_expert": n_expert,
        "n_used": k,
        "windows": int((~trace.follows).sum()),
        "slots": per_size,
        "engine_hit_curve": {
            "sizes": sizes.tolist(),
            "hit_rate": [
                float(sum(engine_curve[il][i] for il in layers) / (needed * len(layers))) for i in range(len(sizes))
            ],
        },
    }


def _allocations(trace: Trace, counts, engine_curve, s: int, needed: int, k: int, n_expert: int) -> dict:
    """The engine policy's hit rate at the same total slots, split per layer by each rule."""
    from llamaflash.planning import expert_plan as ep

    layers = trace.layers
    total = s * len(layers)
    model = [
        np.array([1 - ep.lru_miss_rate(counts[il], k, x, ep.pinned_count(x, k)) for x in range(k, n_expert + 1)])
        for il in layers
    ]
    splits = {
        "equal": np.full(len(layers), s),
        "entropy": allocate_proportional([entropy_size(counts[il]) for il in layers], total, k, n_expert),
        "planner_model": allocate_best(model, total, k),
        "trace_optimum": allocate_best([engine_curve[il] for il in layers], total, k),
    }
    out = {}
    for name, split in splits.items():
        hits = sum(engine_curve[il][int(x) - k] for il, x in zip(layers, split))
        out[name] = {
            "hit_rate": float(hits / (needed * len(layers))),
            "min_slots": int(split.min()),
            "max_slots": int(split.max()),
        }
    return out


def table(result: dict) -> str:
    """Hit rates per slot count and policy, the gap to Belady and the best pinned count."""
    head = (
        f"{'slots':>5} {'P':>3} {'engine':>7} {'lru':>7} {'static':>7} {'belady':>7} {'gap':>6} "
        f"{'best P':>6} {'at P':>6} {'alloc':>6} {'model':>6}"
    )
    lines = [head]
    for r in result["slots"].values():
        h, sw = r["hit_rate"], r["pinned_sweep"]
        lines.append(
            f"{r['n_slots']:>5} {r['planner_pinned']:>3} {h['engine']:7.3f} {h['lru']:7.3f} {h['static']:7.3f} "
            f"{h['belady']:7.3f} {r['gap_engine_to_belady']:6.3f} {sw['best_p']:>6} {sw['best_p_hit_rate']:6.3f} "
            f"{r['allocation']['trace_optimum']['hit_rate']:6.3f} {r['planner_predicted_hit_rate']:6.3f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llamaflash.bench.cache_policy_study", description=__doc__.split("\n")[0]
    )
    p.add_argument("trace", type=Path, help="routing capture (.npz of predictor_study.save_capture)")
    p.add_argument("--sidecar", type=Path, required=True, help="the model's expert sidecar (calibration counts)")
    p.add_argument("--slots", default=",".join(map(str, DEFAULT_SLOTS)), help="slot counts per layer, comma-separated")
    p.add_argument("--warmup", type=int, default=128, help="tokens served before hits are counted")
    p.add_argument("--record", type=Path, default=None, help="model to record TRACE from when TRACE is missing")
    p.add_argument("--tokens", type=int, default=2048, help="tokens to record (held-out calibration text)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per recorded window")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--prefetch-trace",
        type=Path,
        default=None,
        help="a capture with the FFN inputs (predictor_study.save_capture of capture_text(inputs=True)): "
        "also simulate the lookahead prefetch (needs --model for the routers)",
    )
    p.add_argument("--model", type=Path, default=None, help="the model the traces were recorded from")
    p.add_argument("--label", default="", help="what the model is, recorded in the JSON (e.g. SYNTHETIC ...)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    from llamaflash.files.expert_sidecar import read_expert_sidecar

    try:
        slots = sorted({int(x) for x in a.slots.split(",") if x.strip()})
        info = read_expert_sidecar(a.sidecar)
        if info.routing_tokens <= 0:
            raise ValueError(f"{a.sidecar} has no routing counts")
        counts = {ly.layer: np.asarray(ly.counts) for ly in info.layers}
        if not a.trace.is_file():
            if a.record is None:
                raise OSError(f"{a.trace}: no such file (give --record MODEL to record it)")
            from llamaflash.bench import predictor_study as ps
            from llamaflash.converters import texts
            from llamaflash.files import assets

            text = assets.held_out_text(texts.DEFAULT_CALIBRATION_TEXT, 150_000)
            t0 = time.perf_counter()
            cap = ps.capture_text(a.record, text, a.tokens, a.seq_len, a.threads, inputs=False)
            print(f"recorded {cap.follows.size} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
            a.trace.parent.mkdir(parents=True, exist_ok=True)
            ps.save_capture(cap, a.trace)
        trace = load_trace(a.trace, info.n_expert)
        missing = [il for il in trace.layers if il not in counts]
        if missing:
            raise ValueError(f"the sidecar has no counts for layers {missing}")
        result = study(trace, counts, slots, a.warmup, log=lambda m: print(m, flush=True))
        result["reuse_by_lag"] = reuse_by_lag(trace)
        if a.prefetch_trace is not None:
            if a.model is None:
                raise ValueError("--prefetch-trace needs --model (the routers)")
            from llamaflash.bench import predictor_study as ps
            from llamaflash.planning.expert_plan import pinned_count

            cap = ps.load_capture(a.prefetch_trace)
            if not cap.x:
                raise ValueError(f"{a.prefetch_trace} holds no FFN inputs")
            k = trace.k
            ptrace = Trace({il: cap.routed[il].astype(np.int64) for il in cap.layers}, info.n_expert, cap.follows)
            result["prefetch"] = prefetch_study(
                ptrace,
                cap.x,
                ps.router_matrices(a.model),
                counts,
                slots,
                lambda s: sorted({0, pinned_count(s, k), max(0, s - 2 * k), s - k}),
                min(a.warmup, ptrace.n_tokens // 4),
            )
            result["prefetch"]["trace"] = os.fspath(a.prefetch_trace)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"cache_policy_study: {e}", file=sys.stderr)
        return 1
    result.update(
        trace=os.fspath(a.trace),
        sidecar=os.fspath(a.sidecar),
        sidecar_routing_tokens=int(info.routing_tokens),
        label=a.label,
        text="registry:calibration held-out document tails (evenly spaced windows)",
    )
    print(table(result))
    print("reuse by lag:", ", ".join(f"{d} {v:.3f}" for d, v in result["reuse_by_lag"].items()))
    for sl, row in result.get("prefetch", {}).get("by_slots", {}).items():
        print(
            f"prefetch, {sl} slots: "
            + "; ".join(
                f"P {p}: hits {v['hit_rate']:.3f} reads {v['reads_per_needed']:.3f} "
                f"precision {v['prefetch_precision']:.2f}"
                for p, v in row.items()
            )
        )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
