"""One benchmark run in a fresh process: ``python <path>/llamaflash/bench/worker.py '<json spec>'``.

Run by file path, never imported as part of a model-running process: a "stock" run must not import
the ``llamaflash`` package (its model loading registers the llamaflash ggml backend).  Module level uses
the standard library only; ``llamaflash.bench.benchkit`` imports the constants below from here.

Spec keys: ``mode`` ("run" or "tokenize"), ``model`` (path), ``config`` ("stock", "stock2" or a
llamaflash config name), ``sidecar_path`` (for llamaflash configs), ``prompt_tokens`` (list of ids,
for "run"), ``prompt_text`` and ``n_prompt`` (for "tokenize"), ``n_gen``, ``threads``, ``n_ctx``,
``n_batch``.  Optional: ``flash_mode`` (default: the config name), ``ram_budget_mb`` (passed to
``llamaflash.Llama``: flash offload; the plan is recorded under ``ram_budget``, and a budget below
the planner's minimum fails the run with RamBudgetError), ``max_decode_s`` (stop the
decode loop after this many seconds: ``n_gen_done`` < ``n_gen``), ``progress`` (print
:data:`PROGRESS_MARK` lines, so a parent that sees the process killed knows how far it got).

Prints exactly one line starting with :data:`RESULT_MARK` followed by a JSON object.

"run": load the model (timed); warm up with one eval of 8 prompt tokens, then clear the KV cache;
prefill = one ``llm.eval(prompt_tokens)`` (timed); decode = ``n_gen`` greedy steps, each
``llm.eval([tok])`` (timed individually) followed by an argmax of the last logits.  The returned
``tokens`` are the ``n_gen_done + 1`` greedy tokens: the first comes from the prefill logits, one more
after every decode eval.  EOS does not stop generation (this is a speed benchmark).
``ttft_s`` = prefill eval + argmax of the first token (the model already loaded).

"generate" (``prompts_tokens``: a list of chat-formatted prompts; ``flash_speculative`` optional):
the decode loop a user runs, ``llm.generate`` (greedy, speculative when the Llama drafts), per prompt
after a timed prefill, up to ``n_gen`` tokens or EOS; delivered tok/s = tokens / decode time over all
prompts, with each prompt's tokens and the speculation statistics.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # run by path from inside the package directory: don't let its modules shadow top-level names
    sys.path.pop(0)

RESULT_MARK = "@@BENCH_RESULT@@ "
PROGRESS_MARK = "@@BENCH_PROGRESS@@ "

# Configs that run stock llama-cpp-python.  "stock2" is a second, identical stock config used to
# check the ratio machinery (it should come out at ~1.0x).  Every other config name is a llamaflash
# config (by default its name is the flash_mode: "dense", ...).
STOCK_CONFIGS = ("stock", "stock2", "stock-norepack")
#: stock llama.cpp with plain (not repacked) weights and flash attention: llama-cli's --no-repack, the
#: stock configuration that runs an MoE model file-backed (and the numerics llamaflash's expert offload
#: reproduces bit for bit)
STOCK_NO_REPACK = "stock-norepack"

WARMUP_TOKENS = 8

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_seconds() -> float:
    """Machine-wide busy CPU seconds so far (all cores; /proc/stat, excluding idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _emit(obj: dict, mark: str = RESULT_MARK) -> None:
    sys.stdout.write(mark + json.dumps(obj, default=repr) + "\n")
    sys.stdout.flush()


def _proc_status() -> dict[str, int]:
    """Memory fields of /proc/self/status in KiB."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmSwap"):
                out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _proc_io() -> dict[str, int]:
    """/proc/self/io: rchar (bytes read by syscalls, page cache hits included) and read_bytes
    (bytes this process caused to be fetched from storage)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, val = line.partition(":")
            out[key.strip()] = int(val)
    except OSError:
        pass
    return out


def _majflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class _ForeignCpu:
    """CPU time other processes used while a section ran, as a fraction of all cores.

    (machine busy seconds - this process's CPU seconds) / (wall seconds * cores); 0 on a quiet
    machine, up to ~1 - own share when something else competes for the cores.  Resolution: one
    clock tick (10 ms) per core, so very short sections read coarse."""

    def __init__(self):
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.t, self.busy, self.own = time.perf_counter(), cpu_busy_seconds(), ru.ru_utime + ru.ru_stime

    def fraction(self) -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter() - self.t
        other = (cpu_busy_seconds() - self.busy) - (ru.ru_utime + ru.ru_stime - self.own)
        return max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0


def _load(spec: dict):
    """The Llama for ``spec``; for llamaflash configs also sets ``spec["_ram_budget"]`` (what
    became of a requested ``ram_budget_mb``) and ``spec["_flash_mode"]`` (the mode used)."""
    config = spec["config"]
    common_kwargs = dict(
        model_path=spec["model"],
        n_ctx=spec.get("n_ctx", 512),
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_batch=spec.get("n_batch", 512),
        seed=0,
        verbose=False,
        logits_all=bool(spec.get("logits_all", False)),
    )
    if config == STOCK_NO_REPACK:
        from llama_cpp import Llama

        from llamaflash.runtime.speculative import batch_invariant_weights

        with batch_invariant_weights():
            return Llama(**common_kwargs, flash_attn=True)
    if config in STOCK_CONFIGS or spec.get("mode") == "tokenize":
        from llama_cpp import Llama

        return Llama(**common_kwargs)
    try:
        from llamaflash import Llama as FlashLlama
    except ImportError as e:
        raise RuntimeError(f"config {config!r} needs the llamaflash package (pip install . in the repo): {e}") from e
    # the memory-limit harness passes flash_mode explicitly (None: llamaflash's choice); others name it in config
    flash_mode, level, dense_up = parse_flash_config(spec["flash_mode"] if "flash_mode" in spec else config)
    extra = {"flash_sparsity": level, "flash_dense_up": dense_up}
    if flash_mode == "sparse" and spec.get("mode") == "ppl":
        # every token of the scored batches through the sparse lane, as in decode
        extra["flash_max_sparse_tokens"] = common_kwargs["n_batch"]
    for key in ("flash_speculative", "flash_draft_copy", "flash_expert_slots"):
        if key in spec:
            extra[key] = spec[key]
    if spec.get("n_ubatch"):
        common_kwargs["n_ubatch"] = int(spec["n_ubatch"])
    budget = spec.get("ram_budget_mb")
    spec["_flash_mode"] = flash_mode
    if budget is None:
        return FlashLlama(**common_kwargs, sidecar_path=spec.get("sidecar_path"), flash_mode=flash_mode, **extra)
    # flash offload; a budget below the planner's minimum raises RamBudgetError (reported as "refused")
    llm = FlashLlama(**common_kwargs, sidecar_path=spec.get("sidecar_path"), flash_mode=flash_mode,
                     ram_budget_mb=budget, **extra)  # fmt: skip
    # the budget's decision: flash offload (its plan), or stock llama.cpp where the budget holds the model
    spec["_ram_budget"] = {
        "requested_mb": budget,
        "applied": True,
        "plan": llm.flash_plan.to_dict(arrays=False) if llm.flash_plan else None,
        "decision": llm.flash_stats().get("decision"),
    }
    spec["_flash_mode"] = llm.flash_mode
    return llm


def parse_flash_config(config: str | None):
    """A llamaflash config: "dense", "sparse" (the sidecar's operating point) or "sparse@LEVEL"
    (a calibrated level, e.g. sparse@0.4), optionally with "/kup" (up rows in the kernel) or "/dup"
    (dense up GEMV); returns (flash_mode, flash_sparsity, flash_dense_up)."""
    dense_up = None
    if config is not None and "/" in config:
        config, variant = config.split("/", 1)
        if variant not in ("kup", "dup"):
            raise ValueError(f"config variant {variant!r}: use /kup or /dup")
        dense_up = variant == "dup"
    if config is not None and "@" in config:
        mode, level = config.split("@", 1)
        return mode, float(level), dense_up
    return config, None, dense_up


def _ppl(spec: dict) -> dict:
    """Perplexity of spec["ppl_tokens"] in windows of n_ctx tokens, scoring the second half of each
    window (as llama.cpp's perplexity tool does), the top-1 token at every scored position ("argmax":
    teacher-forced greedy choices, to compare between configs), and the time it took."""
    import numpy as np

    toks = [int(t) for t in spec["ppl_tokens"]]
    n_ctx = spec.get("n_ctx", 512)
    spec = dict(spec, n_batch=n_ctx)
    t0 = time.perf_counter()
    llm = _load(dict(spec, logits_all=True))
    nll, n, top1 = 0.0, 0, []
    for start in range(0, len(toks) - n_ctx + 1, n_ctx):
        window = toks[start : start + n_ctx]
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(window)
        logits = np.array(llm.scores[: len(window)], dtype=np.float64)
        first = n_ctx // 2
        z = logits[first:-1]
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        target = np.array(window[first + 1 :])
        nll -= float(logp[np.arange(len(target)), target].sum())
        top1 += [int(t) for t in z.argmax(axis=1)]
        n += len(target)
    result = {
        "ok": True,
        "config": spec["config"],
        "ppl": float(np.exp(nll / n)) if n else None,
        "scored_tokens": n,
        "argmax": top1,
        "seconds": time.perf_counter() - t0,
    }
    stats = getattr(llm, "flash_stats", None)
    if callable(stats):
        result["flash_stats"] = stats()
    llm.close()
    return result


def _tokenize(spec: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=spec["model"], vocab_only=True, verbose=False)
    if "chat_prompts" in spec:  # one user message each, in the model's own chat template
        return {"ok": True, "prompts_tokens": [_chat_tokens(llm, m) for m in spec["chat_prompts"]]}
    text = spec["prompt_text"]
    n = spec["n_prompt"]
    toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    reps = 1
    while len(toks) < n:  # repeat the text for long prompts
        reps += 1
        toks = llm.tokenize(("\n\n".join([text] * reps)).encode("utf-8"), add_bos=True, special=False)
    toks = toks[:n]
    return {
        "ok": True,
        "prompt_tokens": toks,
        "text_tokens_total": len(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)),
        "n_vocab": llm.n_vocab(),
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
    }


def _chat_tokens(llm, message: str) -> list:
    """`message` as one user turn in the GGUF's chat template (tokenizer.chat_template), ready for
    the assistant's answer, tokenized with special tokens."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template): use the text prompt instead")
    vocab = llm._model
    formatter = Jinja2ChatFormatter(
        template, eos_token=vocab.token_get_text(vocab.token_eos()), bos_token=vocab.token_get_text(vocab.token_bos())
    )
    text = formatter(messages=[{"role": "user", "content": message}]).prompt
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def _io_delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in ("rchar", "read_bytes", "syscr")}


def _run(spec: dict) -> dict:
    import llama_cpp
    import numpy as np

    prompt = [int(t) for t in spec["prompt_tokens"]]
    n_gen = int(spec["n_gen"])
    max_decode_s = spec.get("max_decode_s")
    progress = bool(spec.get("progress"))
    t_start = time.perf_counter()

    def report(phase: str, **kw) -> None:
        if progress:
            _emit({"phase": phase, "t": round(time.perf_counter() - t_start, 3), "VmHWM_kb": _proc_status().get("VmHWM"),
                   **kw}, PROGRESS_MARK)  # fmt: skip

    io0, flt0 = _proc_io(), _majflt()

    t0 = time.perf_counter()
    llm = _load(spec)
    load_s = time.perf_counter() - t0
    mem_after_load = _proc_status()
    io_load = _proc_io()
    report("loaded", load_s=load_s, **{k: spec[f"_{k}"] for k in ("flash_mode", "ram_budget") if f"_{k}" in spec})
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    # warm-up: first-call costs (allocations, repacking, thread start) stay out of the timings
    llm.eval(prompt[:WARMUP_TOKENS])
    llm.reset()
    llm._ctx.kv_cache_clear()
    io_warm = _proc_io()
    report("warmed_up")

    fc_all = fc = _ForeignCpu()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - t0
    tokens = [argmax_last()]
    ttft_s = time.perf_counter() - t0
    foreign_prefill = fc.fraction()
    io_prefill = _proc_io()
    report("prefilled", prefill_s=prefill_s, ttft_s=ttft_s)
    stats_fn = getattr(llm, "flash_stats", None)
    prefill_stats = stats_fn() if callable(stats_fn) else None
    if prefill_stats is not None:
        llm.reset_flash_stats()  # the stats reported below are the decode loop's alone

    step_ms = []
    fc = _ForeignCpu()
    t_loop = time.perf_counter()
    t_report = t_loop
    capped = False
    for _ in range(n_gen):
        if max_decode_s is not None and time.perf_counter() - t_loop >= max_decode_s:
            capped = True
            break
        t = time.perf_counter()
        llm.eval([tokens[-1]])
        step_ms.append((time.perf_counter() - t) * 1e3)
        tokens.append(argmax_last())
        if progress and time.perf_counter() - t_report >= 1.0:
            t_report = time.perf_counter()
            report("decoding", n_gen_done=len(step_ms), decode_s=sum(step_ms) / 1e3)
    loop_s = time.perf_counter() - t_loop
    n_done = len(step_ms)
    decode_s = sum(step_ms) / 1e3
    foreign_decode, foreign_all = fc.fraction(), fc_all.fraction()

    mem_end = _proc_status()
    io1, flt1 = _proc_io(), _majflt()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "ok": True,
        "config": spec["config"],
        "rep": spec.get("rep"),
        "pid": os.getpid(),
        "n_prompt": len(prompt),
        "n_gen": n_gen,
        "n_gen_done": n_done,
        "decode_capped": capped,  # stopped by max_decode_s before n_gen tokens
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tps": len(prompt) / prefill_s,
        "ttft_s": ttft_s,
        "decode_s": decode_s,
        "decode_tps": n_done / decode_s if n_done else None,
        "decode_loop_s": loop_s,  # includes the argmax after every step
        "decode_step_ms": [round(x, 4) for x in step_ms],
        "tokens": tokens,
        "peak_rss_kb": ru.ru_maxrss,
        "peak_rss_mb": ru.ru_maxrss / 1024,
        "vm_hwm_mb": mem_end.get("VmHWM", 0) / 1024,
        "anon_mb": mem_end.get("RssAnon", 0) / 1024,  # after generation
        "file_mb": mem_end.get("RssFile", 0) / 1024,
        "mem_after_load_kb": mem_after_load,
        "mem_end_kb": mem_end,
        "io": _io_delta(io0, io1),
        # bytes fetched from storage per phase (/proc/self/io read_bytes)
        "read_bytes_phases": {
            "load": _io_delta(io0, io_load)["read_bytes"],
            "warmup": _io_delta(io_load, io_warm)["read_bytes"],
            "prefill": _io_delta(io_warm, io_prefill)["read_bytes"],
            "decode": _io_delta(io_prefill, io1)["read_bytes"],
        },
        "major_faults": flt1 - flt0,
        "foreign_cpu": foreign_all,  # share of all cores other processes used while timed
        "foreign_cpu_prefill": foreign_prefill,
        "foreign_cpu_decode": foreign_decode,
        "cpu_user_s": ru.ru_utime,
        "cpu_sys_s": ru.ru_stime,
    }
    if "_flash_mode" in spec:
        result["flash_mode"] = spec["_flash_mode"]
    if "_ram_budget" in spec:
        result["ram_budget"] = spec["_ram_budget"]
    if callable(stats_fn):
        try:
            result["flash_stats"] = stats_fn()  # decode loop only
            result["flash_stats_prefill"] = prefill_stats
        except Exception as e:  # report, don't lose the timings
            result["flash_stats_error"] = repr(e)
    llm.close()
    return result


def _generate(spec: dict) -> dict:
    """The "generate" mode (see the module docstring)."""
    import llama_cpp
    import numpy as np

    prompts = [[int(t) for t in p] for p in spec["prompts_tokens"]]
    n_gen, max_decode_s = int(spec["n_gen"]), spec.get("max_decode_s")
    t0 = time.perf_counter()
    llm = _load(spec)
    load_s = time.perf_counter() - t0
    n_vocab, eos = llm.n_vocab(), llm.token_eos()
    stats_fn = getattr(llm, "flash_stats", None)
    per_prompt, prefill_s, decode_s, n_done, capped, read_decode = [], 0.0, 0.0, 0, False, 0
    if callable(stats_fn):
        llm.reset_flash_stats()
    fc = _ForeignCpu()
    for prompt in prompts:
        if max_decode_s is not None and decode_s >= max_decode_s:
            capped = True
            break
        llm.reset()
        llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        llm.eval(prompt)
        first = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))
        prefill_s += time.perf_counter() - t
        out, t, io_t = [first], time.perf_counter(), _proc_io()
        if first != eos:
            for tok in llm.generate([first], temp=0, top_k=1, reset=False):
                if tok == eos or len(out) >= n_gen:
                    break
                out.append(tok)
                if max_decode_s is not None and decode_s + time.perf_counter() - t >= max_decode_s:
                    capped = True
                    break
        dt = time.perf_counter() - t
        read_decode += _io_delta(io_t, _proc_io())["read_bytes"]
        decode_s += dt
        n_done += len(out) - 1  # the first token came from the prefill
        per_prompt.append({"n_prompt": len(prompt), "tokens": out, "decode_s": dt})
    result = {
        "ok": True,
        "config": spec["config"],
        "rep": spec.get("rep"),
        "mode": "generate",
        "load_s": load_s,
        "n_prompts": len(per_prompt),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "n_gen_done": n_done,
        "prefill_tps": sum(p["n_prompt"] for p in per_prompt) / prefill_s if prefill_s > 0 else None,
        "ttft_s": prefill_s / len(per_prompt) if per_prompt else None,  # mean prefill + first token
        "decode_tps": n_done / decode_s if decode_s > 0 else None,
        "decode_capped": capped,
        "per_prompt": per_prompt,
        "foreign_cpu": fc.fraction(),
        "read_bytes_phases": {"decode": read_decode},  # /proc/self/io during the decode loops
        "tokens": [t for p in per_prompt for t in p["tokens"]],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if "_flash_mode" in spec:
        result["flash_mode"] = spec["_flash_mode"]
    if "_ram_budget" in spec:
        result["ram_budget"] = spec["_ram_budget"]
    if callable(stats_fn):
        result["flash_stats"] = stats_fn()  # the decode loops of all prompts (prefill of the first excluded)
    llm.close()
    return result


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        handler = {"tokenize": _tokenize, "ppl": _ppl, "generate": _generate}.get(spec.get("mode"), _run)
        result = handler(spec)
    except Exception as e:
        _emit({"ok": False, "config": spec.get("config"), "rep": spec.get("rep"),
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})  # fmt: skip
        return 1
    _emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
