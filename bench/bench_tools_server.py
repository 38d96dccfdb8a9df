"""llama-server with llamaflash's backend library, side by side with stock llama-server and with
llamaflash.Llama, under a memory cgroup of the RAM budget (docs/BENCHMARKS.md, "llama-server with the
library under a memory limit").

Every run is one fresh process in a fresh memory cgroup of the budget (process + the page cache it
faults in) and a blkio group counting what it reads from the disk, with the model and the sidecar
evicted from the page cache first: llama-server (one streamed `/v1/completions` request over its
OpenAI HTTP API, then SIGTERM) or a Python worker running llamaflash.Llama in-process. Every config
gets the same prompt token ids (`PROMPT_TEXT` cut to --prompt-tokens), greedy, 2 threads, the same
n_ctx; configs alternate within each repetition (reversed every other one); medians over repetitions.

Configs:
  server-stock          llama-server -c N -np 1: stock's defaults (repacked weights, -b 2048 -ub 512)
  server-stock-flags    llama-server with the plan's flags and no library ($LLAMAFLASH_TOOL_ARGS:
                        -fa on --no-repack -cram 0, the plan's -b/-ub): stock in the numerics the
                        library runs (for an MoE model: llama-cli's --no-repack variant)
  server-llamaflash     llama-server with the library: eval "$(llamaflash env MODEL --ram-budget-mb N)"
  llama-nospec          llamaflash.Llama(MODEL, ram_budget_mb=N, flash_speculative=False): what the
                        library runs, in Python (the tools have no speculation)
  llama                 llamaflash.Llama(MODEL, ram_budget_mb=N): its default (speculative decoding
                        where a token reads from flash)

Measured, wall-clock on the client: TTFT (request sent -> first token; prefill tok/s = prompt tokens /
TTFT) and decode tok/s = (tokens - 1) / (last token - first token), the server's tokens counted by
its per-token `timings`; also llama-server's own `timings`, the bytes read from the disk while loading
and while answering (blkio), the group's peak usage and OOM kills, the machine's other load during the
request, the library's `llamaflash:` lines (flash reads) and the worker's flash_stats.

    python bench/bench_tools_server.py MODEL --budget-mb 900 [--sidecar S] [--configs a,b] [--reps 2]
        [--prompt-tokens 200] [--n-gen 64] [--n-ctx 1024] [--tools DIR] [--json OUT]

Run it under the exclusive timing lock (flock -x /tmp/llamaflash-quiet.lock ...); it needs root and
cgroup v1 (memory, blkio).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    RESULTS_DIR,
    cpu_busy_seconds,
    machine_info,
    median,
    timestamp,
    wait_until_quiet,
    write_json,
)

from llamaflash.bench.benchkit import prompt_tokens
from llamaflash.bench.cgroups import BlkioCgroup, MemoryCgroup
from llamaflash.bench.pagecache import evict_files

CONFIGS = ("server-stock", "server-stock-flags", "server-llamaflash", "llama-nospec", "llama")
MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The in-process config: llamaflash.Llama in a fresh interpreter, timed as the client times the server.
LLAMA_WORKER = textwrap.dedent("""
    import json, os, sys, time
    spec = json.loads(sys.argv[1])

    def busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")

    def read_bytes():
        for line in open(spec["blkio_stat"]).read().splitlines():
            p = line.split()
            if len(p) == 3 and p[0] == spec["blkio_device"] and p[1] == "Read":
                return int(p[2])
        return 0

    t0 = time.perf_counter()
    import llama_cpp
    from llamaflash import Llama
    kw = dict(n_ctx=spec["n_ctx"], n_threads=2, n_threads_batch=2, seed=0, verbose=False,
              ram_budget_mb=spec["budget_mb"], sidecar_path=spec["sidecar"])
    if spec["config"] == "llama-nospec":
        kw["flash_speculative"] = False
    if spec["flash_mode"] != "auto":
        kw["flash_mode"] = spec["flash_mode"]
    llm = Llama(spec["model"], **kw)
    load_s = time.perf_counter() - t0
    r0, b0, c0, t_req = read_bytes(), busy(), sum(os.times()[:2]), time.perf_counter()
    times, out = [], []
    for tok in llm.generate(spec["prompt"], top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        out.append(int(tok))
        if (len(out) >= spec["n_gen"] or llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok)
                or times[-1] - times[0] > spec["max_decode_s"]):
            break
    r1, b1, c1, t_end = read_bytes(), busy(), sum(os.times()[:2]), time.perf_counter()
    st = llm.flash_stats()
    keep = {}
    for part in ("offload", "experts", "speculative"):
        if isinstance(st.get(part), dict):
            keep[part] = {k: v for k, v in st[part].items() if isinstance(v, (int, float, str, bool)) or v is None}
    with open("/proc/self/status") as f:
        vm = {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("VmLck", "VmRSS", "VmHWM"))}
    print("RESULT " + json.dumps({
        "load_s": load_s, "t_first": times[0] - t_req if times else None, "t_last": times[-1] - t_req if times else None,
        "n_tokens": len(out), "tokens": out, "text": llm.detokenize(out).decode(errors="replace"),
        "read_load": r0, "read_request": r1 - r0, "cpu_machine": b1 - b0, "cpu_own": c1 - c0, "wall": t_end - t_req,
        "mode": llm.flash_mode, "n_batch": llm.n_batch, "n_ubatch": llm.context_params.n_ubatch,
        "flash_stats": keep, "proc_kb": vm}), flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmLck", "VmRSS", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


def llamaflash_env(
    model: Path, sidecar: Path, budget_mb: int, n_ctx: int, flash_mode: str, plan: Path
) -> dict[str, str]:
    """The variables `llamaflash env` exports for the budget (parsed as the shell would)."""
    args = [sys.executable, "-m", "llamaflash", "env", str(model), "--ram-budget-mb", str(budget_mb)]
    args += ["--n-ctx", str(n_ctx), "--sidecar", str(sidecar), "-o", str(plan)]
    args += ["--flash-mode", flash_mode] if flash_mode != "auto" else []
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"llamaflash env failed:\n{r.stderr}")
    out = {}
    for line in r.stdout.splitlines():
        if line.startswith("export "):
            name, value = line[len("export ") :].split("=", 1)
            out[name] = subprocess.run(["sh", "-c", f"printf %s {value}"], capture_output=True, text=True).stdout
    if "LLAMAFLASH_PLAN" not in out:
        raise SystemExit(f"llamaflash env decided stock at this budget, nothing to compare:\n{r.stdout}")
    return out


class Groups:
    """A fresh memory cgroup of the budget and a blkio group counting reads from the model's disk."""

    def __init__(self, budget_mb: int, disk_file: Path) -> None:
        self.mem = MemoryCgroup.create(budget_mb * MiB)
        try:
            self.blk = BlkioCgroup.create(disk_file)
        except BaseException:
            self.mem.remove()
            raise

    def enter(self) -> None:  # in the child, between fork and exec
        for g in (self.mem, self.blk):
            g.add_pid(os.getpid())

    def stats(self) -> dict[str, Any]:
        s = self.mem.stats()
        return {"peak_mb": (s["max_usage_bytes"] or 0) / MiB, "oom_kills": s["oom_kill"], "stat": s["stat"]}

    def remove(self) -> None:
        self.mem.remove()
        self.blk.remove()


def stream_completion(port: int, prompt: list, n_gen: int, max_decode_s: float, timeout: float) -> dict[str, Any]:
    """One streamed /v1/completions request (greedy, prompt as token ids, per-token timings); the client's
    clock for each chunk that carries text. Stops reading after ``max_decode_s`` of decode."""
    body = {"model": "m", "prompt": prompt, "max_tokens": n_gen, "temperature": 0, "stream": True, "seed": 0}
    body["timings_per_token"] = True  # llama.cpp: every chunk carries `timings` (exact token counts)
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t_req = time.perf_counter()
    times, pieces, timings, truncated = [], [], None, False
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            timings = chunk.get("timings", timings)
            text = chunk["choices"][0].get("text") if chunk.get("choices") else None
            if text:
                times.append(time.perf_counter() - t_req)
                pieces.append(text)
                if times[-1] - times[0] > max_decode_s:
                    truncated = True
                    break
    return {"times": times, "text": "".join(pieces), "timings": timings, "truncated": truncated}


def run_server(cfg: str, a, prompt: list, env_vars: dict[str, str], rep: int) -> dict[str, Any]:
    """One llama-server run of ``cfg``; "server-llamaflash:NAME" is server-llamaflash with the flags of
    --variant NAME appended."""
    flags = ["-c", str(a.n_ctx), "-np", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_BACKEND_PATH", "LLAMAFLASH_PLAN")}
    if cfg != "server-stock":
        flags = env_vars["LLAMAFLASH_TOOL_ARGS"].split()
    if cfg.split(":")[0] == "server-llamaflash":
        env.update({k: env_vars[k] for k in ("GGML_BACKEND_PATH", "LLAMAFLASH_PLAN")})
        flags += a.variants.get(cfg.partition(":")[2], "").split()
    port = free_port()
    argv = [str(a.tools / "llama-server"), "-m", str(a.model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", "2", "-tb", "2", *flags]
    out: dict[str, Any] = {"config": cfg, "rep": rep, "argv": argv[1:], "status": "ok"}
    out["eviction"] = evict_files([a.model] + ([a.sidecar] if a.sidecar else []))
    groups = Groups(a.budget_mb, a.model)
    log = Path(tempfile.mkstemp(prefix=f"{cfg}-", suffix=".log")[1])
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=groups.enter)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode} while loading")
            if time.perf_counter() - t0 > a.timeout:
                raise RuntimeError("llama-server not ready within the timeout")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        out["load_s"] = time.perf_counter() - t0
        out["read_load_mb"] = groups.blk.read_bytes() / MiB
        r0, b0, c0, w0 = groups.blk.read_bytes(), cpu_busy_seconds(), proc_cpu_seconds(proc.pid), time.perf_counter()
        s = stream_completion(port, prompt, a.n_gen, a.max_decode_s, a.timeout)
        r1, b1, c1, w1 = groups.blk.read_bytes(), cpu_busy_seconds(), proc_cpu_seconds(proc.pid), time.perf_counter()
        out["proc_kb"] = proc_status_kb(proc.pid)
        out["cpu_request_s"] = c1 - c0
        t = s["timings"] or {}
        n = int(t.get("predicted_n", len(s["times"])))
        out.update(times_summary(len(prompt), s["times"], n))
        out.update(text=s["text"], truncated=s["truncated"], server_timings=t, read_request_mb=(r1 - r0) / MiB)
        out["other_load"] = max(0.0, (b1 - b0) - (c1 - c0)) / ((w1 - w0) * (os.cpu_count() or 1))
    except (RuntimeError, OSError, ValueError) as e:
        out["status"], out["error"] = "error", str(e)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        out.update(groups.stats())
        groups.remove()
    if out["status"] != "ok" and out["oom_kills"]:
        out["status"] = "OOM-killed in " + ("load" if "load_s" not in out else "the request")
    text = log.read_text(errors="replace")
    log.unlink()
    out["llamaflash_lines"] = [line for line in text.splitlines() if line.startswith("llamaflash:")]
    if out["status"] != "ok":
        out["log_tail"] = text[-3000:]
    return out


def run_llama(cfg: str, a, prompt: list, rep: int) -> dict[str, Any]:
    out: dict[str, Any] = {"config": cfg, "rep": rep, "status": "ok"}
    out["eviction"] = evict_files([a.model] + ([a.sidecar] if a.sidecar else []))
    groups = Groups(a.budget_mb, a.model)
    spec = {"config": cfg, "model": str(a.model), "sidecar": str(a.sidecar) if a.sidecar else None}
    spec.update(
        budget_mb=a.budget_mb,
        flash_mode=a.flash_mode,
        n_ctx=a.n_ctx,
        n_gen=a.n_gen,
        max_decode_s=a.max_decode_s,
        prompt=prompt,
    )
    spec.update(blkio_stat=str(groups.blk.path / "blkio.throttle.io_service_bytes"), blkio_device=groups.blk.device)
    argv = [sys.executable, "-c", LLAMA_WORKER, json.dumps(spec)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout, preexec_fn=groups.enter)
        result = next((json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if result is None:
            out["status"], out["error"] = "error", f"exit {proc.returncode}: {proc.stderr[-3000:]}"
        else:
            out.update(times_summary(len(prompt), [result["t_first"], result["t_last"]], result["n_tokens"]))
            out["read_load_mb"] = result.pop("read_load") / MiB  # interpreter start and imports included
            out["read_request_mb"] = result.pop("read_request") / MiB
            out["cpu_request_s"] = result.pop("cpu_own")
            cpu_other = max(0.0, result.pop("cpu_machine") - out["cpu_request_s"])
            out["other_load"] = cpu_other / (result["wall"] * (os.cpu_count() or 1))
            for k in ("t_first", "t_last", "n_tokens"):
                result.pop(k)
            out.update(result)
    except subprocess.TimeoutExpired:
        out["status"] = "timeout"
    finally:
        out.update(groups.stats())
        groups.remove()
    if out["status"] != "ok" and out["oom_kills"]:
        out["status"] = "OOM-killed"
    return out


def times_summary(n_prompt: int, times: list, n_tokens: int) -> dict[str, Any]:
    """TTFT, prefill and decode rates from the first and last token's arrival (seconds after the
    request) and the token count."""
    if not times or times[0] is None:
        return {"n_tokens": n_tokens, "ttft_s": None, "prefill_tps": None, "decode_tps": None}
    ttft, span = times[0], times[-1] - times[0]
    decode = (n_tokens - 1) / span if n_tokens > 1 and span > 0 else None
    return {"n_tokens": n_tokens, "ttft_s": ttft, "prefill_tps": n_prompt / ttft, "decode_tps": decode}


def summarize(runs: list[dict[str, Any]], configs: list[str]) -> list[dict[str, Any]]:
    """Per-config medians over the runs that finished, and ratios of decode tok/s against each config."""
    rows = []
    for cfg in configs:
        rs = [r for r in runs if r["config"] == cfg]
        ok = [r for r in rs if r["status"] == "ok"]
        row: dict[str, Any] = {"config": cfg, "ok": len(ok), "failed": [r["status"] for r in rs if r["status"] != "ok"]}
        keys = (
            "decode_tps",
            "prefill_tps",
            "ttft_s",
            "load_s",
            "read_request_mb",
            "peak_mb",
            "other_load",
            "cpu_request_s",
        )
        for key in keys:
            vals = [r.get(key) for r in ok if r.get(key) is not None]
            row[key] = median(vals)
            row[key + "_all"] = vals
        tokens = [r["n_tokens"] for r in ok]
        row["read_mb_per_token"] = (
            median([r["read_request_mb"] / r["n_tokens"] for r in ok if r["n_tokens"]]) if ok else None
        )
        row["n_tokens"] = tokens
        row["texts_same"] = len({r["text"].rstrip("\ufffd") for r in ok}) <= 1
        rows.append(row)
    by = {row["config"]: row for row in rows}
    for row in rows:
        row["decode_x"] = {
            other: row["decode_tps"] / o["decode_tps"]
            for other, o in by.items()
            if other != row["config"] and row["decode_tps"] and o["decode_tps"]
        }
    # llama-server holds back a trailing incomplete UTF-8 sequence that detokenize(errors="replace") shows
    text_of = {
        cfg: next((r["text"].rstrip("\ufffd") for r in runs if r["config"] == cfg and r["status"] == "ok"), None)
        for cfg in configs
    }
    for row in rows:
        row["same_text_as"] = sorted(
            c for c, t in text_of.items() if c != row["config"] and t and t == text_of[row["config"]]
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        "| config | status | decode tok/s | x server-llamaflash | prefill tok/s (TTFT s) | MB read per token | peak MiB |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = r["decode_x"].get("server-llamaflash")
        status = f"ok {r['ok']}/{r['ok'] + len(r['failed'])}" + (f" ({', '.join(r['failed'])})" if r["failed"] else "")
        lines.append(
            f"| {r['config']} | {status} | {f(r['decode_tps'], '.2f')} | {f(vs, '.3f')} | "
            f"{f(r['prefill_tps'], '.1f')} ({f(r['ttft_s'], '.2f')}) | {f(r['read_mb_per_token'], '.0f')} | "
            f"{f(r['peak_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--budget-mb", type=int, required=True, help="RAM budget = the memory cgroup's limit, MiB")
    p.add_argument("--sidecar", type=Path, default=None, help="default: MODEL's .flash.gguf beside it")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument(
        "--flash-mode",
        choices=("auto", "sparse"),
        default="auto",
        help="dense models: sparse = offload even where auto would run stock (env --flash-mode, Llama flash_mode)",
    )
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--max-decode-s", type=float, default=120.0, help="stop a run's decode after this long")
    p.add_argument(
        "--quiet-wait", type=float, default=30.0, help="before each run, wait up to this long for <10%% machine load"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="per run (load + request)")
    p.add_argument(
        "--tools", type=Path, default=None, help="llama-server's directory (default: scripts/build_llama_tools.sh)"
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="adds config server-llamaflash:NAME, server-llamaflash with FLAGS appended (e.g. poll0='--poll 0')",
    )
    p.add_argument("--label", default="", help="a note stored in the JSON (e.g. SYNTHETIC)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    a.model = a.model.absolute()
    a.variants = dict(v.split("=", 1) for v in a.variant if "=" in v)
    if len(a.variants) != len(a.variant):
        raise SystemExit("--variant takes NAME=FLAGS")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()] + [f"server-llamaflash:{n}" for n in a.variants]
    unknown = [c for c in configs if c not in CONFIGS and c.partition(":")[2] not in a.variants]
    if unknown or not configs or a.reps < 1:
        raise SystemExit(f"--configs: unknown {unknown} (choose from {', '.join(CONFIGS)}); --reps >= 1")
    if a.sidecar is None:
        a.sidecar = a.model.with_name(a.model.name[: -len(".gguf")] + ".flash.gguf")
    if not a.model.is_file() or not a.sidecar.is_file():
        raise SystemExit(f"model '{a.model}' and sidecar '{a.sidecar}' must both exist (llamaflash convert MODEL)")
    if a.tools is None:
        r = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SystemExit(f"scripts/build_llama_tools.sh failed:\n{r.stderr}")
        a.tools = Path(r.stdout.strip().splitlines()[-1])
    if not (a.tools / "llama-server").is_file():
        raise SystemExit(f"no llama-server in '{a.tools}'")
    work = Path(tempfile.mkdtemp(prefix="bench-tools-"))
    env_vars = llamaflash_env(a.model, a.sidecar, a.budget_mb, a.n_ctx, a.flash_mode, work / "plan.gguf")
    prompt = prompt_tokens(a.model, a.prompt_tokens)
    print(f"# {a.model.name} at {a.budget_mb} MiB: {env_vars['LLAMAFLASH_TOOL_ARGS']}", flush=True)
    runs = []
    for rep in range(a.reps):
        for cfg in configs if rep % 2 == 0 else configs[::-1]:
            busy_before = wait_until_quiet(a.quiet_wait) if a.quiet_wait > 0 else None
            run = (
                run_server(cfg, a, prompt, env_vars, rep)
                if cfg.startswith("server-")
                else run_llama(cfg, a, prompt, rep)
            )
            run["busy_before"] = busy_before
            runs.append(run)
            shown = {
                k: run.get(k)
                for k in (
                    "config",
                    "rep",
                    "status",
                    "decode_tps",
                    "prefill_tps",
                    "n_tokens",
                    "read_request_mb",
                    "peak_mb",
                    "other_load",
                )
            }
            print(json.dumps(shown), flush=True)
    rows = summarize(runs, configs)
    payload = {
        "bench": "tools_server",
        "label": a.label,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": {"path": str(a.model), "bytes": a.model.stat().st_size},
        "sidecar": {"path": str(a.sidecar), "bytes": a.sidecar.stat().st_size},
        "budget_mb": a.budget_mb,
        "flash_mode": a.flash_mode,
        "n_ctx": a.n_ctx,
        "prompt_tokens": len(prompt),
        "n_gen": a.n_gen,
        "threads": 2,
        "tool_args": env_vars["LLAMAFLASH_TOOL_ARGS"],
        "variants": a.variants,
        "machine": machine_info(),
        "summary": rows,
        "runs": runs,
    }
    out = a.json or RESULTS_DIR / f"tools-server-{a.model.stem}-{a.budget_mb}-{timestamp()}.json"
    write_json(out, payload)
    print(format_table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
