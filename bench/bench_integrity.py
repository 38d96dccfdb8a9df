#!/usr/bin/env python3
"""What checking the sidecar's row checksums costs: load time in memory and offload decode speed, with
and without the checks (``flash_verify``), plus the CRC-32C throughput of this machine.

    .venv/bin/python bench/bench_integrity.py --reps 7 --budget-mb 300

Every run is a fresh subprocess (this script with ``--worker``); runs with and without the checks
alternate, each rep starts when the machine is quiet (or after --max-wait), and medians are reported
(timings on a shared 2-core machine are noisy), also of the per-rep paired ratios. The engine's own
time spent checking (``read_verify_seconds``) bounds what the checks can add to decode. Runs:

* load: ``Llama(flash_mode="sparse")`` in memory, files in the page cache (read once before each
  run, as stock's load reads the whole model), the time of the constructor; the checks read every
  bundle, down_t, base up and base down row once (the engine's own ``load_verify_seconds`` is reported
  beside the wall time);
* default load: ``Llama()`` (the in-memory default, which runs stock unless ``llamaflash tune``
  stored a measurement for the sidecar), likewise: the checks read the base model's FFN rows on a
  thread of their own while llama.cpp loads;
* offload: ``Llama(ram_budget_mb=B, flash_speculative=False)``, a fixed prompt, then N greedy tokens
  one at a time; decode tok/s over those tokens. Every flash read is checked before its cluster is
  used. The tokens of both settings must be identical (checked).
* offload, interleaved: both settings loaded in one process and decoding token by token in turn
  (on/off, then off/on): the ratio of their decode times is the least exposed to the machine's
  drifting load and the disk's run-to-run spread (the headline decode cost).

Writes bench/results/integrity-<model>.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N_THREADS = 2
PROMPT = "The history of the printing press begins with"
SIDECAR_NAME = "SmolLM2-135M-Instruct.Q4_1.v3.flash.gguf"  # converted on first use (--sidecar: another)


def worker(spec: dict) -> dict:
    import numpy as np

    import llamaflash

    common = dict(
        model_path=spec["model"],
        sidecar_path=spec["sidecar"],
        n_ctx=256,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        verbose=False,
        flash_verify=spec["verify"],
    )
    if spec["run"] in ("load", "default_load"):
        t0 = time.perf_counter()
        llm = llamaflash.Llama(flash_mode="sparse" if spec["run"] == "load" else None, **common)
        load_s = time.perf_counter() - t0
        integrity = llm.flash_stats()["integrity"]
        llm.close()
        return {
            "load_s": load_s,
            "load_verify_s": integrity.get("load_verify_seconds", 0.0),
            "load_verified_bytes": integrity.get("load_verified_bytes", 0),
        }
    if spec["run"] == "offload_pair":
        return offload_pair(spec, common)
    llm = llamaflash.Llama(ram_budget_mb=spec["budget_mb"], flash_speculative=False, **common)
    llm.eval(llm.tokenize(PROMPT.encode()))
    llm.reset_flash_stats()
    tokens = []
    t0 = time.perf_counter()
    for _ in range(spec["n_gen"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(tok)
        llm.eval([tok])
    decode_s = time.perf_counter() - t0
    stats = llm.flash_stats()
    off, integrity = stats["offload"], stats["integrity"]
    llm.close()
    return {
        "tok_s": spec["n_gen"] / decode_s,
        "tokens": tokens,
        "bytes_read": off["bytes_read"],
        "io_wait_s": off["io_wait_seconds"],
        "read_verify_s": integrity.get("read_verify_seconds", 0.0),
        "read_verified_bytes": integrity.get("read_verified_bytes", 0),
        "read_clusters_checked_by_compute": integrity.get("read_clusters_checked_by_compute", 0),
        "read_compute_verify_s": integrity.get("read_compute_verify_seconds", 0.0),
    }


def offload_pair(spec: dict, common: dict) -> dict:
    """Both settings in one process, token by token in turn (on, off; then off, on): drifting load on
    a shared machine hits both alike. Each model decodes its own greedy tokens (the same ones)."""
    import numpy as np

    import llamaflash

    models = {
        key: llamaflash.Llama(
            ram_budget_mb=spec["budget_mb"], flash_speculative=False, **{**common, "flash_verify": key == "on"}
        )
        for key in ("on", "off")
    }
    for llm in models.values():
        llm.eval(llm.tokenize(PROMPT.encode()))
        llm.reset_flash_stats()
    seconds = {key: [] for key in models}
    tokens = {key: [] for key in models}
    for i in range(spec["n_gen"]):
        for key in ("on", "off") if i % 2 == 0 else ("off", "on"):
            llm = models[key]
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            tokens[key].append(tok)
            t0 = time.perf_counter()
            llm.eval([tok])
            seconds[key].append(time.perf_counter() - t0)
    integrity = models["on"].flash_stats()["integrity"]
    for llm in models.values():
        llm.close()
    return {
        "decode_s_on": sum(seconds["on"]),
        "decode_s_off": sum(seconds["off"]),
        "token_ratio_median": statistics.median(a / b for a, b in zip(seconds["on"], seconds["off"])),
        "same_tokens": tokens["on"] == tokens["off"],
        "tokens": tokens["on"],
        "read_verify_s": integrity.get("read_verify_seconds", 0.0),
        "read_clusters_checked_by_compute": integrity.get("read_clusters_checked_by_compute", 0),
        "read_compute_verify_s": integrity.get("read_compute_verify_seconds", 0.0),
    }


def run_worker(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def crc_throughput() -> dict:
    import numpy as np

    from llamaflash import _native

    row = 720  # a SmolLM2 Q4_1 bundle row
    data = np.random.default_rng(0).integers(0, 256, size=row * ((64 << 20) // row), dtype=np.uint8)
    out = {"implementation": _native.crc32c_implementation()}
    impls = ("hardware", "table") if out["implementation"] == "sse4.2" else ("table",)
    for impl in impls:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            _native.crc32c_rows(data, row, impl)
            times.append(time.perf_counter() - t0)
        out[f"{impl}_gb_s"] = round(data.nbytes / statistics.median(times) / 1e9, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m", help="registry name or path")
    p.add_argument("--sidecar", type=Path, default=None, help="default: the test fixture's cached sidecar")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--budget-mb", type=float, default=300.0)
    p.add_argument("--n-gen", type=int, default=48)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for a quiet machine before a rep")
    p.add_argument("--load-only", action="store_true", help="only the load runs (in memory and the default)")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    from llamaflash.files import assets
    from llamaflash.files.integrity import verify_files

    model = Path(args.model) if Path(args.model).exists() else assets.fetch_model(args.model, progress=True)
    sidecar = args.sidecar or assets.DEFAULT_CACHE_DIR / "converted" / SIDECAR_NAME
    if not sidecar.exists():
        from llamaflash.converters import convert

        sidecar.parent.mkdir(parents=True, exist_ok=True)
        convert(model, sidecar, progress=True)
    t0 = time.perf_counter()
    offline = verify_files(sidecar, model)
    offline_s = time.perf_counter() - t0
    assert offline.ok, "the sidecar does not match its checksums"
    runs: dict[str, list] = {"load_on": [], "load_off": [], "default_load_on": [], "default_load_off": []}
    if not args.load_only:
        runs.update(offload_on=[], offload_off=[], offload_pair=[])
    base = {"model": str(model), "sidecar": str(sidecar), "budget_mb": args.budget_mb, "n_gen": args.n_gen}
    from llamaflash.bench.benchkit import wait_until_quiet, warm_page_cache

    busy = []
    for rep in range(args.reps):
        busy.append(round(wait_until_quiet(args.max_wait), 3))  # another process's load ruins a pair
        for verify in (True, False) if rep % 2 == 0 else (False, True):  # alternated order
            key = "on" if verify else "off"
            for path in (model, sidecar):  # in memory the files are in the page cache (stock's load reads
                warm_page_cache(path)  # the whole model); the offload runs drop pages of both
            runs[f"load_{key}"].append(run_worker({**base, "run": "load", "verify": verify}))
            for path in (model, sidecar):
                warm_page_cache(path)
            runs[f"default_load_{key}"].append(run_worker({**base, "run": "default_load", "verify": verify}))
            if not args.load_only:
                runs[f"offload_{key}"].append(run_worker({**base, "run": "offload", "verify": verify}))
        if not args.load_only:
            runs["offload_pair"].append(run_worker({**base, "run": "offload_pair", "verify": True}))
        print(f"rep {rep + 1}/{args.reps} (machine busy {busy[-1]:.2f} before it)", file=sys.stderr, flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if f != "tokens"} for k, v in runs.items()}
    paired_load = [100 * (a["load_s"] / b["load_s"] - 1) for a, b in zip(runs["load_on"], runs["load_off"])]
    paired_default = [
        100 * (a["load_s"] / b["load_s"] - 1) for a, b in zip(runs["default_load_on"], runs["default_load_off"])
    ]
    summary = {
        "load_s_off": med["load_off"]["load_s"],
        "load_s_on": med["load_on"]["load_s"],
        "load_cost_pct": 100 * (med["load_on"]["load_s"] / med["load_off"]["load_s"] - 1),
        "load_cost_pct_paired_median": statistics.median(paired_load),
        "load_verify_s": med["load_on"]["load_verify_s"],
        "load_verified_bytes": med["load_on"]["load_verified_bytes"],
        # the default running stock: the base model's FFN rows checked beside llama.cpp's load
        "default_load_s_off": med["default_load_off"]["load_s"],
        "default_load_s_on": med["default_load_on"]["load_s"],
        "default_load_cost_pct": 100 * (med["default_load_on"]["load_s"] / med["default_load_off"]["load_s"] - 1),
        "default_load_cost_pct_paired_median": statistics.median(paired_default),
        "default_load_verify_s": med["default_load_on"]["load_verify_s"],
        "default_load_verified_bytes": med["default_load_on"]["load_verified_bytes"],
        "offline_verify_s": offline_s,
    }
    if not args.load_only:
        summary.update(offload_summary(runs, med, args.n_gen))
    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "settings": {**base, "reps": args.reps, "order": "alternated, medians"},
        "machine_busy_before_rep": busy,
        "crc32c": crc_throughput(),
        "summary": summary,
        "medians": med,
        "runs": {k: [{f: x for f, x in r.items() if f != "tokens"} for r in v] for k, v in runs.items()},
    }
    out = args.json or REPO / "bench" / "results" / f"integrity-{model.stem.split('.')[0].lower()}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps({"crc32c": payload["crc32c"], **summary}, indent=1))
    print(f"written: {out}")
    return 0


def offload_summary(runs: dict, med: dict, n_gen: int) -> dict:
    """The decode-cost part of the summary (the offload runs)."""
    tokens = {tuple(r["tokens"]) for k in ("offload_on", "offload_off", "offload_pair") for r in runs[k]}
    pair_ratio = [100 * (r["decode_s_on"] / r["decode_s_off"] - 1) for r in runs["offload_pair"]]
    # per rep, the two settings ran back to back: their ratio is less exposed to drifting load
    paired_decode = [100 * (1 - a["tok_s"] / b["tok_s"]) for a, b in zip(runs["offload_on"], runs["offload_off"])]
    return {
        "decode_cost_pct_paired_median": statistics.median(paired_decode),
        # one process, both models, token by token in turn: median over reps of (time on / time off − 1)
        "decode_cost_pct_interleaved_median": statistics.median(pair_ratio),
        "decode_cost_pct_interleaved_runs": [round(x, 2) for x in pair_ratio],
        "decode_cost_pct_interleaved_token_median": 100
        * (statistics.median(r["token_ratio_median"] for r in runs["offload_pair"]) - 1),
        # the engine's own account of the check time no read hides: the compute threads' checks,
        # spread over N_THREADS (the waiting thread's checks run while reads of its layer are in
        # flight, one slot at a time), as a share of the decode time without checks
        "checks_on_critical_path_pct_of_decode": statistics.median(
            100 * r["read_compute_verify_s"] / N_THREADS / r["decode_s_off"] for r in runs["offload_pair"]
        ),
        "read_verify_share_of_decode_time_pct": 100
        * med["offload_on"]["read_verify_s"]
        / n_gen
        * med["offload_off"]["tok_s"],
        "decode_tok_s_off": med["offload_off"]["tok_s"],
        "decode_tok_s_on": med["offload_on"]["tok_s"],
        "decode_cost_pct": 100 * (1 - med["offload_on"]["tok_s"] / med["offload_off"]["tok_s"]),
        "read_verify_s_per_token": med["offload_on"]["read_verify_s"] / n_gen,
        "bytes_read_per_token": med["offload_on"]["bytes_read"] / n_gen,
        "io_wait_s_per_token_on": med["offload_on"]["io_wait_s"] / n_gen,
        "same_tokens": len(tokens) == 1 and all(r["same_tokens"] for r in runs["offload_pair"]),
    }


if __name__ == "__main__":
    sys.exit(main())
