#!/usr/bin/env python
"""`llamaflash convert` of an MoE model inside a memory cgroup: does it finish, how long, how much memory.

    python bench/bench_moe_convert.py --model moe.gguf --limit-mb 8192 --json out.json

The model's files are evicted from the page cache, then `llamaflash convert MODEL -o OUT --force`
runs in a fresh cgroup v1 memory group of ``--limit-mb`` (page cache included; bench/lab/cgroups.py),
pinned to ``--threads`` llama.cpp threads. Reported: status (ok / OOM / timeout / error), wall time,
the group's peak usage (process memory + page cache), bytes read from the model's disk, the converter's progress lines, and the routing statistics it measured
(previous-token reuse and top-8 share per layer, from the sidecar). The sidecar is written to a
temporary name beside ``--out`` and renamed only when the run succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401

MiB = 1024 * 1024


def sidecar_routing(path: Path, k: int = 8) -> dict:
    """Routing statistics the sidecar holds: mean/min/max over layers of the previous-token reuse and
    of the top-``k`` share of selections."""
    import numpy as np

    from llamaflash.files import expert_sidecar

    info = expert_sidecar.read_expert_sidecar(path)
    shares = [float(np.sort(x.counts)[::-1][:k].sum() / x.counts.sum()) for x in info.layers if x.counts.sum() > 0]
    reuse = [x.reuse for x in info.layers if x.reuse == x.reuse]

    def span(v):
        return {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v))} if v else None

    return {"calib_tokens": info.routing_tokens, f"top_{k}_share": span(shares), "reuse": span(reuse)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", type=Path, default=None, help="sidecar path (default: beside the model)")
    p.add_argument("--limit-mb", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calib-tokens", type=int, default=None, help="passed to convert (default: convert's)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    from llamaflash.bench.cgroups import run_in_cgroup
    from llamaflash.files.sidecar import default_sidecar_path

    out = a.out or default_sidecar_path(a.model)
    staged = out.with_name(f".{out.name}.bench.{os.getpid()}.tmp")
    exe = Path(sys.executable).with_name("llamaflash")
    argv_ = [str(exe), "convert", str(a.model), "-o", str(staged), "--force", "--threads", str(a.threads)]
    if a.calib_tokens:
        argv_ += ["--calib-tokens", str(a.calib_tokens)]
    print(f"[bench_moe_convert] {' '.join(argv_)} in a {a.limit_mb} MiB cgroup", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        r = run_in_cgroup(argv_, a.limit_mb, timeout=a.timeout, evict_paths=[a.model], blkio_file=a.model)
        if r.status == "ok":
            os.replace(staged, out)
    finally:
        staged.unlink(missing_ok=True)
    cg = r.cgroup or {}
    result = {
        "model": str(a.model),
        "model_bytes": a.model.stat().st_size,
        "label": "synthetic (random weights)",
        "limit_mb": a.limit_mb,
        "threads": a.threads,
        "started_unix": t0,
        "status": r.status,
        "wall_s": r.wall_s,
        "peak_mb": (cg.get("max_usage_bytes") or 0) / MiB,
        "oom_kill": cg.get("oom_kill"),
        "read_gb": (r.blkio_read_bytes or 0) / 1e9,
        "progress": [ln for ln in r.stderr.splitlines() if ln.startswith("[convert")],
        "stderr_tail": r.stderr.splitlines()[-5:],
        "notes": r.notes,
    }
    if r.status == "ok":
        result["routing"] = sidecar_routing(out)
    print(json.dumps({k: v for k, v in result.items() if k != "progress"}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0 if r.status == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
