"""Micro-benchmark of the sparse FFN decode kernel (csrc/lanes/sparse_ffn.h) on one real layer.

Times, per token, one layer's FFN computed by
  * the sparse kernel, gate-first (gate for every neuron, up + down_t for the active ones), with the
    threshold set per token so that exactly the requested fraction of neurons is active (what the
    sparse lane runs on a sidecar whose bundles are not in base order);
  * hybrid: g for every neuron by ggml's repacked dense gate GEMV (a gate-only ggml graph), then the
    kernel with those gate values (SparseFfnParams::gate_values) for up + down_t of the active ones,
    summed by cluster (what the sparse lane runs on a base-order sidecar);
  * ggml's own dense FFN graph (MUL_MAT gate, MUL_MAT up, SWIGLU, MUL_MAT down) on the base
    model's weights, on ggml's CPU backend, repacked as stock llama.cpp repacks them: the speed to
    beat (csrc/testing/ffn_dense_ref.h);
at 1 and 2 threads, and reports microseconds per token (median; p20 = 20th percentile) and effective
GB/s = bytes the lane must read ÷ median time ("MB read": dense = the three base weights; gate-first
and hybrid = every gate row + up and down_t rows of the active neurons). Times are taken in C++ around each call (no Python overhead); the hybrid
time is the gate graph's compute time plus the kernel's. Configurations are interleaved pass by pass
and the share of the CPUs other processes used meanwhile is printed: on a shared machine, rerun
until it is ~0% (2-thread numbers in particular are meaningless when another process competes for
a core: an OpenMP barrier then waits for a descheduled thread).

Inputs x: rows of the model's token embedding matrix (random token ids, fixed seed), RMS-normalized
and scaled by the layer's ffn_norm weight: the right shape and scale for an FFN input, but not the
true residual stream of layer L, so the activation statistics are only roughly those of real decode.

Two cache regimes (the layer's FFN is ~30 MB, about the size of this machine's 32 MB L3):
  * streamed: the timed layer and its neighbours are run in rotation (about 180 MB of weights), so
    every call reads its weights from DRAM, as in real decode. This is the number that matters;
  * hot: the same layer and token repeated, weights partly L3 resident (optimistic).

Usage:  python bench/bench_sparse_ffn.py [--model qwen2.5-coder-1.5b] [--layer 10] [--threads 1,2]
Writes JSON to bench/results/sparse-ffn-<model>-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from llamaflash import _native_testing as N  # noqa: E402
from llamaflash.errors import LlamaflashError  # noqa: E402
from llamaflash.files.sidecar import validate_pair  # noqa: E402


def find_sidecar(model: Path, convert_dir: Path, down_t_type: str | None = None):
    """(sidecar path, SidecarInfo): the sidecar beside the model, else one converted into convert_dir;
    with ``down_t_type``, a bundle-only sidecar of that down_t type in convert_dir (converted once)."""
    candidates = [common.sidecar_path_for(model), convert_dir / (model.stem + ".flash.gguf")]
    if down_t_type is not None:
        candidates = [convert_dir / f"{model.stem}.down_t-{down_t_type}.flash.gguf"]
    for path in candidates:
        if path.exists():
            try:
                return path, validate_pair(model, path)
            except LlamaflashError as e:
                print(f"[bench] {path}: {type(e).__name__}; trying the next candidate", file=sys.stderr)
    from llamaflash.converters import convert

    out = candidates[-1]
    print(f"[bench] converting {model.name} -> {out}", file=sys.stderr)
    convert(
        model,
        out,
        force=True,
        progress=False,
        profile=False,  # bundle-only: what the kernel reads
        down_t_type=down_t_type or "q8_0",
    )  # the default sidecar of earlier runs
    return out, validate_pair(model, out)


def ffn_inputs(reader: gguf.GGUFReader, layer: int, n_tokens: int, seed: int) -> np.ndarray:
    tensors = {t.name: t for t in reader.tensors}
    emb = tensors["token_embd.weight"]
    norm = tensors[f"blk.{layer}.ffn_norm.weight"]
    n_vocab = int(emb.shape[1])
    ids = np.random.default_rng(seed).choice(min(n_vocab, 100_000), size=n_tokens, replace=False)
    rows = np.asarray(emb.data)[np.sort(ids)]
    x = gguf.quants.dequantize(rows, emb.tensor_type).astype(np.float32).reshape(n_tokens, -1)
    x /= np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
    return (x * np.asarray(norm.data, dtype=np.float32)).astype(np.float32)


class Layer:
    def __init__(self, lay, activation, side: np.ndarray, base: np.ndarray):
        self.lay, self.activation = lay, activation
        n_ff, n_embd = lay.n_ff, lay.n_embd
        self.bundles = side[lay.bundle_offset : lay.bundle_offset + n_ff * lay.bundle_stride]
        self.down_t = side[lay.down_t_offset : lay.down_t_offset + n_ff * lay.down_t_row_bytes]
        self.kernel = N.SparseFfnKernel(
            self.bundles,
            lay.bundle_stride,
            lay.gate_type,
            lay.up_type,
            lay.gate_row_bytes,
            lay.up_row_bytes,
            self.down_t,
            lay.down_t_type,
            lay.down_t_row_bytes,
            n_embd,
            n_ff,
            activation,
        )
        gate_bytes = n_ff * lay.gate_row_bytes
        up_bytes = n_ff * lay.up_row_bytes
        down_bytes = n_embd * lay.base_down_row_bytes
        self.dense = N.DenseFfnGraph(
            base[lay.base_gate_offset : lay.base_gate_offset + gate_bytes],
            lay.gate_type,
            base[lay.base_up_offset : lay.base_up_offset + up_bytes],
            lay.up_type,
            base[lay.base_down_offset : lay.base_down_offset + down_bytes],
            lay.base_down_type,
            n_embd,
            n_ff,
            activation,
            n_tokens=1,
            n_threads=1,
            repack=True,
        )
        self.dense_bytes = gate_bytes + up_bytes + down_bytes
        self.gate_graph = N.DenseFfnGraph(
            base[lay.base_gate_offset : lay.base_gate_offset + gate_bytes],
            lay.gate_type,
            None,
            0,
            None,
            0,
            n_embd,
            n_ff,
            activation,
            n_tokens=1,
            n_threads=1,
            repack=True,
            gate_only=True,
        )
        assert np.array_equal(
            np.frombuffer(side[lay.order_offset : lay.order_offset + 4 * n_ff], np.int32), np.arange(n_ff)
        ), "hybrid lane assumes the identity neuron order"

    def abs_act(self, x: np.ndarray) -> np.ndarray:
        """|act(gate · x)| per token [n_tokens, n_ff], as the kernel computes it."""
        lay = self.lay
        b = self.bundles.reshape(lay.n_ff, lay.bundle_stride)
        G = gguf.quants.dequantize(
            np.ascontiguousarray(b[:, : lay.gate_row_bytes]), gguf.GGMLQuantizationType(lay.gate_type)
        )
        xg = np.stack([N.activation_roundtrip(lay.gate_type, r) for r in x])
        g = (xg @ G.T).astype(np.float32)
        return np.abs(np.stack([N.sparse_ffn_activation(self.activation, r) for r in g]))

    def sparse_bytes(self, n_active: int) -> int:
        lay = self.lay
        return lay.n_ff * lay.gate_row_bytes + n_active * (lay.up_row_bytes + lay.down_t_row_bytes)


def selection(abs_act: np.ndarray, fraction: float):
    """(threshold, sorted top list) so that exactly round(fraction·n_ff) neurons are above threshold."""
    n_ff = abs_act.shape[0]
    k = int(round(fraction * n_ff))
    if k >= n_ff:
        return -1.0, np.arange(n_ff, dtype=np.int32)
    order = np.argsort(-abs_act, kind="stable")
    s = abs_act[order]
    return float((s[k - 1] + s[k]) / 2), np.sort(order[:k]).astype(np.int32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=6, help="layers in the streamed rotation (incl. --layer)")
    ap.add_argument("--tokens", type=int, default=4, help="distinct inputs x")
    ap.add_argument("--reps", type=int, default=15, help="rotations (streamed) / repeats (hot) per config")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--fractions", default="1.0,0.5,0.3,0.1")
    ap.add_argument("--convert-dir", default="/tmp")
    ap.add_argument(
        "--down-t-type",
        default=None,
        help="time a bundle-only sidecar with this down_t type (converter --down-t-type), converted "
        "into --convert-dir once, instead of the model's sidecar",
    )
    ap.add_argument(
        "--quiet-wait", type=float, default=120.0, help="seconds to wait for other processes to go quiet before timing"
    )
    args = ap.parse_args()

    model, name, _ = common.resolve_model(args.model)
    sidecar, info = find_sidecar(model, Path(args.convert_dir), args.down_t_type)
    by_layer = {lay.layer: lay for lay in info.layers}
    if args.layer not in by_layer:
        raise SystemExit(f"layer {args.layer} is not served by {sidecar}")
    served = sorted(by_layer)
    i = served.index(args.layer)
    lo = max(0, min(i - args.rotate // 2, len(served) - args.rotate))
    rotation = served[lo : lo + args.rotate]
    print(f"[bench] {model.name}, sidecar {sidecar.name}, layer {args.layer}, rotation {rotation}", file=sys.stderr)

    side = np.memmap(sidecar, np.uint8, mode="r")
    base = np.memmap(model, np.uint8, mode="r")
    reader = gguf.GGUFReader(model)
    layers = {L: Layer(by_layer[L], info.activation, side, base) for L in rotation}
    xs = {L: ffn_inputs(reader, L, args.tokens, seed=1234) for L in rotation}
    acts = {L: layers[L].abs_act(xs[L]) for L in rotation}
    threads = [int(t) for t in args.threads.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    lay0 = by_layer[args.layer]
    print(
        f"[bench] n_embd {lay0.n_embd}, n_ff {lay0.n_ff}, gate/up {gguf.GGMLQuantizationType(lay0.gate_type).name}, "
        f"base down {gguf.GGMLQuantizationType(lay0.base_down_type).name}, "
        f"down_t {gguf.GGMLQuantizationType(lay0.down_t_type).name}, kernel ISA {N.sparse_ffn_best_isa()}",
        file=sys.stderr,
    )
    for L in rotation:  # warm: page cache, scratch, first-touch
        layers[L].kernel.time(xs[L][:1], -1.0, n_threads=max(threads), n_iter=2)
        layers[L].dense.run(xs[L][:1], 2)

    busy_before = common.wait_until_quiet(args.quiet_wait)
    rows = []
    target = args.layer

    def record(lane, fraction, nt, streamed, hot, nbytes, extra):
        row = dict(
            lane=lane,
            active=fraction,
            threads=nt,
            us_streamed=statistics.median(streamed) * 1e6,
            us_streamed_p20=float(np.percentile(streamed, 20)) * 1e6,
            samples=len(streamed),
            us_hot=statistics.median(hot) * 1e6,
            mbytes=nbytes / 1e6,
            gbs_streamed=nbytes / statistics.median(streamed) / 1e9,
            gbs_hot=nbytes / statistics.median(hot) / 1e9,
        )
        row.update(extra)
        rows.append(row)
        print(
            f"[bench] {lane:<26} {fraction:>5.0%} t={nt}  streamed {row['us_streamed']:8.1f} us "
            f"{row['gbs_streamed']:5.1f} GB/s   hot {row['us_hot']:8.1f} us {row['gbs_hot']:5.1f} GB/s",
            file=sys.stderr,
        )

    # every configuration: name, fraction, kernel ("gate-first", "hybrid"; None = ggml dense)
    configs = [("ggml dense (stock)", 1.0, None)]
    for lane in ("gate-first", "hybrid"):
        configs += [(f"sparse {lane}", f, lane) for f in fractions]
    sel = {(L, t, f): selection(acts[L][t], f) for L in rotation for t in range(args.tokens) for f in fractions}

    def call(cfg, L, t, n_iter, nt):
        _, f, kernel = cfg
        x = xs[L][t : t + 1]
        if kernel is None:
            return layers[L].dense.run(x, n_iter)[1]
        thr, _ = sel[(L, t, f)]
        if kernel == "hybrid":  # g by ggml's repacked gate GEMV, then up/down_t of the selected in the kernel
            out = []
            for _ in range(n_iter):
                g, (s_gate,) = layers[L].gate_graph.run(x, 1)
                out.append(s_gate + layers[L].kernel.time(x, thr, n_threads=nt, n_iter=1, gate_values=g)[0])
            return out
        return layers[L].kernel.time(x, thr, n_threads=nt, n_iter=n_iter)

    def cpu_self():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t_wall, b0, s0 = time.monotonic(), common.cpu_busy_seconds(), cpu_self()
    for nt in threads:
        for L in rotation:
            layers[L].dense.set_n_threads(nt)
            layers[L].gate_graph.set_n_threads(nt)
        streamed = {c: [] for c in configs}
        hot = {c: [] for c in configs}
        # Configurations are interleaved one rotation pass at a time, so a disturbance by another
        # process hits all of them alike. In a pass every call on a layer is 5 other layers (~150 MB)
        # after the previous call on it: its weights come from DRAM.
        for _ in range(args.reps):
            for cfg in configs:
                for t in range(args.tokens):
                    for L in rotation:
                        s = call(cfg, L, t, 1, nt)[0]
                        if L == target:
                            streamed[cfg].append(s)
                for t in range(args.tokens):
                    hot[cfg] += call(cfg, target, t, 3, nt)[1:]  # the first of 3 warms the cache
        for cfg in configs:
            cfg_name, f, kernel = cfg
            lay_obj = layers[target]
            if kernel is None:
                nbytes, extra = lay_obj.dense_bytes, dict(repacked=lay_obj.dense.repacked)
            else:
                n_active = int(round(np.mean([len(sel[(target, t, f)][1]) for t in range(args.tokens)])))
                nbytes, extra = lay_obj.sparse_bytes(n_active), dict(n_active=n_active)
                extra["threshold_median"] = float(np.median([sel[(target, t, f)][0] for t in range(args.tokens)]))
            record(cfg_name, f, nt, streamed[cfg], hot[cfg], nbytes, extra)
    wall = time.monotonic() - t_wall
    others_busy = max(0.0, (common.cpu_busy_seconds() - b0) - (cpu_self() - s0)) / (wall * (os.cpu_count() or 1))
    print(f"[bench] {wall:.0f} s; other processes kept {others_busy:.0%} of the CPUs busy meanwhile", file=sys.stderr)

    print()
    print(
        f"{model.name} layer {args.layer}: n_embd {lay0.n_embd}, n_ff {lay0.n_ff}; x from token embeddings; "
        f"streamed = {len(rotation)} layers in rotation (DRAM), hot = same layer repeated (L3-assisted)"
    )
    print(
        f"{'lane':<27}{'active':>7}{'thr':>4}{'MB read':>9}{'us/token':>10}{'p20':>8}{'GB/s':>7}{'x dense':>9}"
        f"{'us hot':>9}{'GB/s hot':>9}"
    )
    dense_us = {r["threads"]: r["us_streamed"] for r in rows if r["lane"].startswith("ggml")}
    for r in rows:
        print(
            f"{r['lane']:<27}{r['active']:>7.0%}{r['threads']:>4}{r['mbytes']:>9.2f}{r['us_streamed']:>10.1f}"
            f"{r['us_streamed_p20']:>8.1f}{r['gbs_streamed']:>7.1f}{dense_us[r['threads']] / r['us_streamed']:>8.2f}x"
            f"{r['us_hot']:>9.1f}{r['gbs_hot']:>9.1f}"
        )
    out = common.RESULTS_DIR / f"sparse-ffn-{name}-{common.timestamp()}.json"
    common.write_json(
        out,
        dict(
            model=str(model),
            sidecar=str(sidecar),
            layer=args.layer,
            rotation=rotation,
            tokens=args.tokens,
            reps=args.reps,
            busy_before=busy_before,
            others_busy=others_busy,
            machine=common.machine_info(),
            rows=rows,
        ),
    )
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
