#!/usr/bin/env python
"""Measure the constants of the RAM-budget planner (``llamaflash.planning.planner``): the Python runtime's
RSS, and llama.cpp's own buffers (compute, output, KV) per n_ubatch, from llama.cpp's verbose log.

Each measurement runs in a fresh process (``--child``): one for the runtime (RSS after
``import llamaflash, llama_cpp``), one per (model, mode, n_ubatch) that loads the model with
``n_ctx``, ``n_batch = n_ubatch`` and ``verbose=True`` and parses the log lines
``<dev> compute buffer size = X MiB``, ``output buffer size``, ``KV buffer size``. Mode ``stock`` is
``llama_cpp.Llama``; ``llamaflash`` is ``llamaflash.Llama`` with the model's sidecar (its FFN ops run
on the LLAMAFLASH device, so their intermediates leave the CPU compute buffer).

    python bench/planner_constants.py [--models smollm2-135m gemma3-270m qwen2.5-coder-1.5b]
        [--ubatch 32 64 128 256 512] [--n-ctx 512] [--modes stock llamaflash]
        [--sidecar-dir DIR | --sidecar FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_BUFFER = re.compile(r"(\w+)\s+(compute|output|KV) buffer size =\s+([0-9.]+) MiB")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(args: argparse.Namespace) -> None:
    """Runs in the measured process; prints one JSON line."""
    if args.child == "runtime":
        import llama_cpp  # noqa: F401

        import llamaflash  # noqa: F401

        print(json.dumps({"rss_bytes": _rss_bytes()}))
        return
    model, mode, ubatch, n_ctx = args.child.split(",")
    from llamaflash.files.assets import fetch_model

    path = str(fetch_model(model, progress=False))
    rss0 = _rss_bytes()
    log = tempfile.TemporaryFile(mode="w+")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        if mode == "stock":
            import llama_cpp

            llm = llama_cpp.Llama(
                model_path=path, n_ctx=int(n_ctx), n_batch=int(ubatch), n_ubatch=int(ubatch), n_threads=2, verbose=True
            )
        else:
            import llamaflash

            sidecar = args.sidecar or (
                args.sidecar_dir and os.path.join(args.sidecar_dir, os.path.basename(path)[:-5] + ".flash.gguf")
            )
            llm = llamaflash.Llama(
                model_path=path,
                sidecar_path=sidecar,
                n_ctx=int(n_ctx),
                n_batch=int(ubatch),
                n_ubatch=int(ubatch),
                n_threads=2,
                verbose=True,
                flash_mode="dense",
            )
        rss1 = _rss_bytes()
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
    log.seek(0)
    buffers: dict[str, float] = {}
    for m in _BUFFER.finditer(log.read()):
        key = f"{m.group(1)} {m.group(2)}"  # summed: Gemma-3 logs a SWA and a non-SWA KV buffer
        buffers[key] = buffers.get(key, 0.0) + float(m.group(3))
    print(
        json.dumps(
            {
                "model": model,
                "mode": mode,
                "n_ubatch": int(ubatch),
                "n_ctx": int(n_ctx),
                "n_vocab": llm.n_vocab(),
                "buffers_mib": buffers,
                "rss_before_load": rss0,
                "rss_after_load": rss1,
            }
        )
    )
    del llm


def _run(child: str, sidecar_dir: str | None = None, sidecar: str | None = None) -> dict:
    extra = ["--sidecar-dir", sidecar_dir] if sidecar_dir else []
    extra += ["--sidecar", sidecar] if sidecar else []
    out = subprocess.run(
        [sys.executable, __file__, "--child", child, *extra], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"])
    ap.add_argument("--ubatch", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    ap.add_argument("--modes", nargs="+", default=["stock", "llamaflash"])
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--runtime-reps", type=int, default=3)
    ap.add_argument(
        "--sidecar-dir",
        default=None,
        help="llamaflash mode: take <model stem>.flash.gguf from this directory (default: beside the model)",
    )
    ap.add_argument(
        "--sidecar", default=None, help="llamaflash mode, one model: this sidecar file (instead of --sidecar-dir)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    if args.sidecar and len(args.models) > 1:
        ap.error("--sidecar names one model's sidecar: give one model in --models")
    runtime = [_run("runtime")["rss_bytes"] for _ in range(args.runtime_reps)]
    print(f"runtime RSS after `import llamaflash, llama_cpp`: {[round(r / 2**20, 1) for r in runtime]} MiB")
    rows = []
    for model in args.models:
        for mode in args.modes:
            for u in args.ubatch:
                r = _run(f"{model},{mode},{u},{args.n_ctx}", args.sidecar_dir, args.sidecar)
                rows.append(r)
                b = r["buffers_mib"]
                print(
                    f"{model:20s} {mode:10s} n_ubatch {u:4d}: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in b.items())
                    + f"; RSS after load {r['rss_after_load'] / 2**20:.0f} MiB (n_vocab {r['n_vocab']})",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runtime_rss_bytes": runtime, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
