#!/usr/bin/env python
"""Flash-offload planning bound from a sidecar's neuron statistics.

For a static hot-neuron cache of a given size (split evenly over the served layers, each layer
keeping its most frequently active neurons' up + down_t rows), the expected hit rate is the share
of the layer's activations that fall on cached neurons (the sidecar's per-neuron frequencies at the
operating point), and the bytes that must come from flash per token are the misses. Dividing a disk
throughput by them bounds decode speed under gate-first selection (gate rows resident). No
windowing/LRU reuse across tokens is modelled: a real cache can only do better than this static
one if activity is correlated across consecutive tokens.

    python bench/cache_bound.py SIDECAR [--cache-mb 100 200 400] [--disk-gbps 1.2 2.0]
"""

from __future__ import annotations

import argparse

import numpy as np

from llamaflash.sidecar import read_layer_vectors, read_sidecar


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sidecar")
    ap.add_argument("--cache-mb", type=float, nargs="+", default=[100, 200, 270, 400, 500])
    ap.add_argument("--disk-gbps", type=float, nargs="+", default=[1.2, 2.0])
    args = ap.parse_args(argv)
    info = read_sidecar(args.sidecar)
    if info.sparsity is None:
        raise SystemExit(f"{args.sidecar} is format {info.format_version}: no neuron statistics")
    freqs = {layer.layer: read_layer_vectors(info, layer)["freq"] for layer in info.layers}
    rows = {layer.layer: layer.up_row_bytes + layer.down_t_row_bytes for layer in info.layers}
    need = sum(float(f.sum()) * rows[layer] for layer, f in freqs.items())  # bytes per token
    print(f"{args.sidecar}: {len(freqs)} layers, mean active fraction "
          f"{np.mean([f.mean() for f in freqs.values()]):.3f}, up + down_t rows needed per token {need / 1e6:.0f} MB, "
          f"all rows {sum(len(f) * rows[l] for l, f in freqs.items()) / 1e6:.0f} MB")
    for cache_mb in args.cache_mb:
        per_layer_bytes = cache_mb * 1e6 / len(freqs)
        hit_bytes = 0.0
        for layer, f in freqs.items():
            k = int(per_layer_bytes // rows[layer])
            hit_bytes += float(np.sort(f)[::-1][:k].sum()) * rows[layer]
        miss = need - hit_bytes
        speeds = ", ".join(f"{g:g} GB/s: {g * 1e9 / miss:.1f} tok/s" for g in args.disk_gbps) if miss > 0 else "no misses"
        print(f"  static hot cache {cache_mb:6.0f} MB: hit rate {hit_bytes / need:.3f}, misses {miss / 1e6:6.0f} MB/token; "
              f"I/O bound at {speeds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
