"""The benchmark's bookkeeping (bench/common.py): agreement, medians, ratios, table. No llama.cpp."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402


def test_greedy_agreement():
    assert common.greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, None)
    assert common.greedy_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (0.75, 2)
    assert common.greedy_agreement([1, 2, 3, 4], [1, 2]) == (0.5, 2)
    assert common.greedy_agreement([], []) == (0.0, 0)


def _run(config, rep, prefill, decode, tokens, ok=True):
    return {"ok": ok, "config": config, "rep": rep, "prefill_tps": prefill, "decode_tps": decode,
            "peak_rss_mb": 100.0, "anon_mb": 50.0, "load_s": 0.1, "foreign_cpu": 0.01, "tokens": tokens}  # fmt: skip


def test_summarize_medians_ratios_and_failures():
    runs = [
        _run("stock", 0, 100, 50, [1, 2, 3, 4]),
        _run("dense", 0, 150, 40, [1, 2, 3, 4]),
        _run("stock", 1, 110, 60, [1, 2, 3, 4]),
        _run("dense", 1, 160, 45, [1, 2, 7, 4]),
        _run("stock", 2, 90, 55, [1, 2, 3, 4]),
        {"ok": False, "config": "dense", "rep": 2, "error": "boom"},
    ]
    rows = {r["config"]: r for r in common.summarize(runs, ["stock", "dense"])}
    assert rows["stock"]["prefill_tps"] == 100 and rows["stock"]["decode_tps"] == 55
    assert rows["stock"]["prefill_x"] == 1.0 and rows["stock"]["greedy_agree"] == 1.0
    assert rows["dense"]["prefill_tps"] == 155 and rows["dense"]["n_ok"] == 2 and rows["dense"]["n_failed"] == 1
    assert rows["dense"]["prefill_x"] == pytest.approx(1.55)
    assert rows["dense"]["decode_x"] == pytest.approx(42.5 / 55)
    assert rows["dense"]["greedy_agree"] == pytest.approx(0.875) and rows["dense"]["first_divergence"] == 2
    table = common.format_table(list(rows.values()))
    assert "dense" in table and "1.550" in table and "2+1F" in table
    assert common.format_spread(list(rows.values()))


def test_prompt_text_is_long_enough():
    # ~520 tokens with the SmolLM2 / Gemma-3 / Qwen2.5 tokenisers; 205 is the standard prompt
    assert len(common.PROMPT_TEXT.split()) > 400
