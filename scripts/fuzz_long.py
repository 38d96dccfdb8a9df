#!/usr/bin/env python3
"""Long fuzz run of what llamaflash reads: thousands of corrupted copies of a real base model
(SmolLM2-135M-Instruct Q4_1 from the registry) and its sidecar, each case in its own process with a
deadline, outcomes classified and written as JSON.

    .venv/bin/python scripts/fuzz_long.py --cases 10000 --llama-cases 300

Cases come from ``tests/fuzz_cases.py`` (the generators of the quick in-process fuzz test), here at
a larger scale and with data-section bit flips added; tensor-info edits cover the base file too.
Each case mutates a working copy in place (in ``--scratch``, default /dev/shm), a forked child reads
it, and the copy is restored. Readers: ``validate_pair`` for a sidecar case, ``read_base_model`` for
a base case. A seeded subset (``--llama-cases``) is also loaded through ``llamaflash.Llama()`` and
generates a few greedy tokens, alternately on the in-memory sparse lane and under a RAM budget (flash
offload), compared with the clean pair's tokens.

Outcomes: ``clean error`` (a LlamaflashError, or llama.cpp's own refusal to load: ValueError from
llama_cpp), ``crash`` (the child died from a signal or from any other exception), ``hang`` (past the
deadline, killed; time while this process was stopped does not count), ``same output`` (the reader's structure summary, or Llama's tokens, equal the clean
pair's), ``different output`` (accepted without error, with a different result). Data flips are
split by where they land (``fuzz_cases.checked_ranges``): inside the rows the sidecar's checksums
cover ("data flip, checked rows": their reader is ``fuzz_cases.integrity_summary``, the structure
plus every row checksum, and each is expected to be a clean error) or elsewhere ("data flip, other":
statistics and other tensors the engine does not compute with, read structurally).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # children are forked: no BLAS thread pools
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import fuzz_cases as cases  # noqa: E402
import numpy as np  # noqa: E402

from llamaflash.errors import LlamaflashError  # noqa: E402
from llamaflash.files import assets  # noqa: E402
from llamaflash.files.gguf_header import read_gguf_header  # noqa: E402

OUTCOMES = ("clean error", "crash", "hang", "same output", "different output")
SIDECAR_NAME = "SmolLM2-135M-Instruct.Q4_1.v3.flash.gguf"  # where the test fixture keeps it (format 3)
PROMPT = "The capital of France is"
LLAMA_CONFIGS = ({"flash_mode": "sparse"}, {"ram_budget_mb": 400})
#: Base tensors whose infos are edited (gguf's reader takes seconds per edit on the base's header).
BASE_EDITED = (
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_down.weight",
    "blk.29.attn_q.weight",
    "token_embd.weight",
)


class WorkingCopy:
    """A clean file and its working copy: a case is applied in place and undone afterwards."""

    def __init__(self, clean: Path, directory: Path) -> None:
        self.data = clean.read_bytes()
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / clean.name
        self.path.write_bytes(self.data)
        self.data_offset = read_gguf_header(self.path).data_offset

    def apply(self, case: cases.Case) -> None:
        with open(self.path, "r+b") as f:
            for offset, new in case.patches:
                f.seek(offset)
                f.write(new)
            if case.size is not None:
                f.truncate(case.size)
        if case.edit is not None:
            case.edit(self.path)

    def undo(self, case: cases.Case) -> None:
        with open(self.path, "r+b") as f:
            if case.size is not None:
                f.seek(case.size)
                f.write(self.data[case.size :])
            for offset, new in case.patches:
                f.seek(offset)
                f.write(self.data[offset : offset + len(new)])
            if case.edit is not None:  # tensor-info edits change the header only
                f.seek(0)
                f.write(self.data[: self.data_offset])


def child_result(read: Callable[[], Any], expected: Any) -> dict[str, Any]:
    """What a child reports: the read's outcome, and a Llama case's text (runs in the forked child)."""
    try:
        result = read()
    except LlamaflashError as exc:
        return {"outcome": "clean error", "detail": f"{type(exc).__name__}: {str(exc)[:200]}"}
    except ValueError as exc:
        if _raised_in_llama_cpp(exc):  # llama_cpp.Llama refusing a file llama.cpp could not load
            return {"outcome": "clean error", "detail": f"llama.cpp: {str(exc)[:200]}"}
        return {"outcome": "crash", "detail": f"ValueError: {str(exc)[:200]}"}
    except BaseException as exc:  # noqa: BLE001 - any other exception is a failure of the reader
        return {"outcome": "crash", "detail": f"{type(exc).__name__}: {str(exc)[:200]}"}
    text = result if isinstance(result, str) else None
    if result == expected:
        return {"outcome": "same output", "detail": "", "text": text}
    return {"outcome": "different output", "detail": (text or "")[:200], "text": text}


def _raised_in_llama_cpp(exc: BaseException) -> bool:
    tb, last = exc.__traceback__, ""
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return f"{os.sep}llama_cpp{os.sep}" in last


class Runner:
    """Runs cases in forked children, ``slots`` at a time, each slot with its own working copies."""

    def __init__(self, model: Path, sidecar: Path, scratch: Path, slots: int) -> None:
        self.slots = [
            {
                "base": WorkingCopy(model, scratch / f"slot{i}"),
                "sidecar": WorkingCopy(sidecar, scratch / f"slot{i}"),
                "busy": None,
            }
            for i in range(slots)
        ]

    def read_fn(self, slot: dict, target: str, llama_config: dict | None, kind: str = "") -> Callable[[], Any]:
        base, side = slot["base"].path, slot["sidecar"].path
        if llama_config is not None:
            return lambda: llama_tokens(base, side, llama_config)
        if kind == "data flip, checked rows":
            return lambda: cases.integrity_summary(base, side)
        if target == "sidecar":
            return lambda: cases.sidecar_summary(base, side)
        return lambda: cases.base_summary(base)

    def run(self, jobs: list[dict], expected: Callable[[dict], Any], on_done: Callable[[dict], None]) -> None:
        """``jobs``: dicts with case, target, llama_config, timeout; ``on_done(job)`` gets each with
        ``outcome`` and ``detail`` set."""
        pending = list(reversed(jobs))
        running: dict[int, tuple[dict, dict, int, float, bytearray]] = {}  # fd -> (slot, job, pid, deadline, out)
        while pending or running:
            for slot in self.slots:
                if slot["busy"] is None and pending:
                    job = pending.pop()
                    copy = slot[job["target"]]
                    try:
                        copy.apply(job["case"])
                    except Exception as exc:  # noqa: BLE001 - a case the harness could not build
                        copy.undo(job["case"])
                        job.update(outcome="skipped", detail=f"{type(exc).__name__}: {exc}")
                        on_done(job)
                        continue
                    fd, pid = self._fork(
                        self.read_fn(slot, job["target"], job["llama_config"], job["case"].kind), expected(job)
                    )
                    slot["busy"] = job
                    running[fd] = (slot, job, pid, time.monotonic() + job["timeout"], bytearray())
            if not running:
                continue
            before = time.monotonic()
            wait = max(0.0, min(r[3] for r in running.values()) - before)
            ready, _, _ = select.select(list(running), [], [], wait)
            stopped = time.monotonic() - before - wait
            if stopped > 1.0:  # this process was stopped (SIGSTOP): the children's time was not theirs
                running = {
                    fd: (s, j, pid, deadline + stopped, out) for fd, (s, j, pid, deadline, out) in running.items()
                }
            for fd in list(running):
                slot, job, pid, deadline, out = running[fd]
                if fd in ready:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        out += chunk
                        continue
                elif time.monotonic() < deadline:
                    continue
                else:
                    os.kill(pid, signal.SIGKILL)
                del running[fd]
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                job.update(self._classify(status, out, fd in ready))
                slot[job["target"]].undo(job["case"])
                slot["busy"] = None
                on_done(job)

    @staticmethod
    def _fork(read: Callable[[], Any], expected: Any) -> tuple[int, int]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: read, report one JSON object, exit without cleanup
            os.close(r)
            try:
                os.write(w, json.dumps(child_result(read, expected)).encode())
            finally:
                os._exit(0)
        os.close(w)
        return r, pid

    @staticmethod
    def _classify(status: int, out: bytearray, finished: bool) -> dict[str, str]:
        if not finished:
            return {"outcome": "hang", "detail": "killed at the deadline"}
        if os.WIFSIGNALED(status):
            return {"outcome": "crash", "detail": f"signal {signal.Signals(os.WTERMSIG(status)).name}"}
        try:
            return json.loads(out.decode())
        except ValueError:
            return {"outcome": "crash", "detail": f"exit status {os.WEXITSTATUS(status)} without a result"}


def llama_tokens(model: Path, sidecar: Path, config: dict) -> str:
    """Greedy completion of PROMPT, 8 tokens, by llamaflash.Llama on the pair (in the child)."""
    from llamaflash import Llama

    llm = Llama(model_path=str(model), sidecar_path=str(sidecar), n_ctx=256, n_threads=1, verbose=False, **config)
    text = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)["choices"][0]["text"]
    llm.close()
    return text


def build_cases(runner: Runner, n: int, seed: int) -> list[tuple[str, cases.Case]]:
    """The seeded case list for about ``n`` cases: (target, case)."""
    rng = np.random.default_rng(seed)
    slot = runner.slots[0]
    side, base = slot["sidecar"], slot["base"]
    checked = cases.checked_ranges(base.path, side.path)
    out: list[tuple[str, cases.Case]] = []
    for target, copy, header_share, data_share, trunc_share in (
        ("sidecar", side, 0.35, 0.15, 0.02),
        ("base", base, 0.20, 0.05, 0.015),
    ):
        out += [(target, c) for c in cases.header_flips(copy.data, copy.data_offset, int(n * header_share), rng)]
        out += [
            (target, c)
            for c in cases.data_flips(copy.data, copy.data_offset, int(n * data_share), rng, checked[target])
        ]
        out += [(target, c) for c in cases.truncations(copy.data, copy.data_offset, int(n * trunc_share), rng)]
        out += [(target, c) for c in cases.tensor_info_edits(copy.path, None if target == "sidecar" else BASE_EDITED)]
        out += [(target, c) for c in cases.count_edits()]
    out += [("sidecar", c) for c in cases.order_edits(side.path)]
    out += [("base", c) for c in cases.block_count_edits(base.path, base.data)]
    return out


def llama_subset(all_cases: list[tuple[str, cases.Case]], m: int, seed: int) -> list[tuple[str, cases.Case]]:
    """``m`` cases spread evenly over (target, kind) groups, seeded."""
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for target, case in all_cases:
        groups[(target, case.kind)].append((target, case))
    rng = np.random.default_rng(seed + 1)
    per_group = max(1, m // len(groups))
    picked = []
    for key in sorted(groups):
        members = groups[key]
        for i in rng.choice(len(members), size=min(per_group, len(members)), replace=False):
            picked.append(members[int(i)])
    return picked[:m]


def clean_sidecar(model: Path) -> Path:
    """The test fixture's SmolLM2 sidecar (converted with the defaults when missing)."""
    from llamaflash.converters import convert
    from llamaflash.files.sidecar import validate_pair

    sidecar = assets.DEFAULT_CACHE_DIR / "converted" / SIDECAR_NAME
    try:
        validate_pair(model, sidecar)
    except LlamaflashError:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        convert(model, sidecar, force=True, progress=True)
    return sidecar


def tally(jobs: list[dict]) -> dict[str, Any]:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, list[str]] = defaultdict(list)
    for job in jobs:
        key = f"{job['target']} {job['case'].kind}"
        by_kind[key][job["outcome"]] += 1
        if job["outcome"] in ("crash", "hang", "different output") and len(examples[job["outcome"]]) < 25:
            examples[job["outcome"]].append(f"{key}: {job['case'].label}: {job['detail']}")
    totals = Counter(job["outcome"] for job in jobs)
    return {
        "cases": len(jobs),
        "totals": {o: totals.get(o, 0) for o in (*OUTCOMES, "skipped")},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "examples": dict(examples),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000, help="about this many reader cases")
    p.add_argument("--llama-cases", type=int, default=300, help="cases also loaded through llamaflash.Llama()")
    p.add_argument("--slots", type=int, default=2, help="cases run at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per reader case")
    p.add_argument("--llama-timeout", type=float, default=120.0, help="seconds per Llama() case")
    p.add_argument("--scratch", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp"))
    p.add_argument("--json", type=Path, default=None, help="default bench/results/fuzz-long-<time>.json")
    args = p.parse_args()

    model = assets.fetch_model("smollm2-135m", progress=True)
    sidecar = clean_sidecar(model)
    scratch = args.scratch / f"llamaflash-fuzz-{os.getpid()}"
    runner = Runner(model, sidecar, scratch, args.slots)
    t0 = time.perf_counter()
    try:
        all_cases = build_cases(runner, args.cases, args.seed)
        slot = runner.slots[0]
        clean = {
            "sidecar": cases.sidecar_summary(slot["base"].path, slot["sidecar"].path),
            "base": cases.base_summary(slot["base"].path),
        }
        reader_jobs = [{"target": t, "case": c, "llama_config": None, "timeout": args.timeout} for t, c in all_cases]
        llama_jobs = []
        if args.llama_cases:
            import llamaflash.runtime.llama  # noqa: F401  (loaded once, before the children fork)

            for i, (t, c) in enumerate(llama_subset(all_cases, args.llama_cases, args.seed)):
                llama_jobs.append(
                    {
                        "target": t,
                        "case": c,
                        "llama_config": LLAMA_CONFIGS[i % len(LLAMA_CONFIGS)],
                        "timeout": args.llama_timeout,
                    }
                )
            # the clean pair's outputs, in children like every case (the parent never starts llama.cpp)
            references = [
                {
                    "target": "sidecar",
                    "case": cases.Case("clean", "clean"),
                    "llama_config": config,
                    "timeout": args.llama_timeout,
                }
                for config in LLAMA_CONFIGS
            ]
            runner.run(references, lambda job: None, lambda job: None)
            for job in references:
                if job.get("text") is None:
                    raise SystemExit(f"the clean pair failed under {job['llama_config']}: {job['detail']}")
                clean[json.dumps(job["llama_config"])] = job["text"]
        done = [0]

        def progress(job: dict) -> None:
            done[0] += 1
            if done[0] % 500 == 0:
                print(f"{done[0]} cases, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

        def expected(job: dict) -> Any:
            if job["llama_config"]:
                return clean[json.dumps(job["llama_config"])]
            return clean["sidecar"] if job["case"].kind == "data flip, checked rows" else clean[job["target"]]

        print(f"{len(reader_jobs)} reader cases, {len(llama_jobs)} Llama() cases", file=sys.stderr)
        runner.run(reader_jobs, expected, progress)
        reader_s = time.perf_counter() - t0
        runner.run(llama_jobs, expected, progress)
    finally:
        for slot in runner.slots:
            for copy in (slot["base"], slot["sidecar"]):
                copy.path.unlink(missing_ok=True)
        for d in sorted(scratch.glob("slot*")):
            d.rmdir()
        scratch.rmdir()
    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": str(model),
        "sidecar": str(sidecar),
        "seed": args.seed,
        "slots": args.slots,
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "reader_elapsed_s": round(reader_s, 1),
        "clean_llama_outputs": {k: v for k, v in clean.items() if k.startswith("{")},
        "readers": tally(reader_jobs),
        "llama": tally(llama_jobs),
    }
    out = args.json or REPO / "bench" / "results" / f"fuzz-long-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    for name in ("readers", "llama"):
        print(f"{name}: {payload[name]['cases']} cases: {payload[name]['totals']}")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
