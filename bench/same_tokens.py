"""Greedy tokens of one model in memory and under a RAM budget (with and without speculation), as JSON,
so that two builds of llamaflash can be compared token for token (a refactor must not change them).

    .venv/bin/python bench/same_tokens.py --model MODEL.gguf --json before.json   # with the old build
    .venv/bin/python bench/same_tokens.py --model MODEL.gguf --json after.json    # with the new build
    .venv/bin/python bench/same_tokens.py --compare before.json after.json

The sidecar must sit beside the model (``llamaflash convert MODEL``). n_batch = n_ubatch is fixed
(default 32), so that a planner that picks another prefill batch does not change the prefill's
numerics; the budget is given explicitly (default 900 MiB)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
)


def generate(model: str, budget_mb: int, n_ubatch: int, n_gen: int) -> dict:
    from llamaflash import Llama

    out = {}
    configs = (
        ("in_memory", {}),
        (f"budget_{budget_mb}_nospec", {"ram_budget_mb": budget_mb, "flash_speculative": False}),
        (f"budget_{budget_mb}_spec", {"ram_budget_mb": budget_mb}),
    )
    for label, kw in configs:
        llm = Llama(
            model_path=model, n_ctx=512, n_batch=n_ubatch, n_ubatch=n_ubatch, n_threads=2, verbose=False, seed=0, **kw
        )
        tokens = []
        for prompt in PROMPTS:
            llm.reset()
            ids = llm.tokenize(prompt.encode())
            tokens.append([int(t) for t, _ in zip(llm.generate(ids, temp=0.0), range(n_gen))])
        out[label] = {"mode": llm.flash_mode, "tokens": tokens}
        llm.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--json", type=Path)
    p.add_argument("--budget-mb", type=int, default=900)
    p.add_argument("--n-ubatch", type=int, default=32)
    p.add_argument("--n-gen", type=int, default=24)
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    a = p.parse_args()
    if a.compare:
        before, after = (json.loads(f.read_text()) for f in a.compare)
        same = True
        for label in before:
            equal = before[label]["tokens"] == after.get(label, {}).get("tokens")
            same &= equal
            print(f"{label:<22} {before[label]['mode']:>8} -> {after.get(label, {}).get('mode', '-'):<8} "
                  f"{'same tokens' if equal else 'DIFFERENT tokens'}")  # fmt: skip
        return 0 if same else 1
    if not a.model or not a.json:
        p.error("--model and --json (or --compare BEFORE AFTER)")
    result = generate(a.model, a.budget_mb, a.n_ubatch, a.n_gen)
    a.json.write_text(json.dumps(result))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
