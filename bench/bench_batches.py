"""Small decode batches (k = 1, 2, 4, 8 tokens per eval) on stock llama-cpp-python, the dense lane and
the sparse lane, in one process each, one after the other.

Per config: a 64-token prompt, then `--evals` evals of k tokens each (the first 2 not counted), median
milliseconds per eval and per token. The sparse lane runs forced (`flash_mode="sparse"`,
`flash_max_sparse_tokens=8`) at the sidecar's operating point, so every batch of up to 8 tokens goes
through the kernel, which reads each row of the union of the batch's active sets once (csrc/lanes/sparse_ffn.h
"Batches").

Usage:  python bench/bench_batches.py --sidecar SIDECAR [--model qwen2.5-coder-1.5b] [--configs stock,dense,sparse]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1, 2, 4, 8)


def worker(cfg: str, model: str, sidecar: str, evals: int, text_path: str) -> None:
    import llama_cpp

    import llamaflash

    kw = dict(n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False, seed=0)
    if cfg == "stock":
        llm = llama_cpp.Llama(model_path=model, **kw)
    elif cfg == "dense":
        llm = llamaflash.Llama(model_path=model, sidecar_path=sidecar, flash_mode="dense", **kw)
    else:
        llm = llamaflash.Llama(
            model_path=model, sidecar_path=sidecar, flash_mode="sparse", flash_max_sparse_tokens=max(SIZES), **kw
        )
    toks = llm.tokenize(Path(text_path).read_text().encode())
    need = 64 + evals * max(SIZES)
    if len(toks) < need:
        raise SystemExit(f"{text_path}: {len(toks)} tokens, need {need}")
    cells = []
    for k in SIZES:
        llm.reset()
        llm.eval(toks[:64])
        times, pos = [], 64
        for _ in range(evals):
            t0 = time.perf_counter()
            llm.eval(toks[pos : pos + k])
            times.append(time.perf_counter() - t0)
            pos += k
        ms = statistics.median(times[2:]) * 1e3
        cells.append(f"{ms:8.1f} ({ms / k:5.1f}/tok)")
    print(f"{cfg:8s} " + "  ".join(cells), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="registry name or GGUF path")
    ap.add_argument("--sidecar", required=True, help="format-2 sidecar of the model (llamaflash convert)")
    ap.add_argument("--configs", default="stock,dense,sparse")
    ap.add_argument("--evals", type=int, default=12)
    ap.add_argument(
        "--text", default=None, help="text to tokenize for the batches (default: the registry's held-out Shakespeare)"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model
    if not Path(model).exists():
        from llamaflash.files import assets

        model = str(assets.fetch_model(model))
    if args.text is None:
        from llamaflash.files import assets

        args.text = str(assets.fetch_text("shakespeare"))
    if args.worker:
        worker(args.worker, model, args.sidecar, args.evals, args.text)
        return 0
    print(f"ms per eval of k tokens (median of {args.evals - 2}), k = " + ", ".join(map(str, SIZES)))
    for cfg in args.configs.split(","):
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                cfg,
                "--model",
                model,
                "--sidecar",
                args.sidecar,
                "--evals",
                str(args.evals),
                "--text",
                args.text,
            ],
            check=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
