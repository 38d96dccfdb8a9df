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


def test_decode_bytes_bound(tiny_model_factory, tmp_path):
    """Stock bytes per token = every weight once, one embedding row unless the output is tied; the
    sparse lane's = stock − up − down + active rows of up and down_t."""
    import shutil

    from bound import decode_bytes

    from llamaflash.converters import convert
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.files.sidecar import read_sidecar

    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q8_0"), model)
    sidecar = read_sidecar(convert(model, progress=False, profile=False))
    tensors = {t.name: t for t in read_gguf_header(model).tensors}
    everything = sum(t.nbytes for t in tensors.values())
    b = decode_bytes(model)
    emb = tensors["token_embd.weight"]
    expected = everything if "output.weight" not in tensors else everything - emb.nbytes + emb.nbytes // emb.shape[1]
    assert b.stock == expected
    assert b.ffn == sum(
        t.nbytes
        for n, t in tensors.items()
        if ".ffn_" in n and n.endswith(".weight") and n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down")
    )
    half = decode_bytes(model, sidecar, {layer.layer: 0.5 for layer in sidecar.layers})
    saved = sum(
        tensors[f"blk.{lay.layer}.ffn_up.weight"].nbytes
        + tensors[f"blk.{lay.layer}.ffn_down.weight"].nbytes
        - int(0.5 * lay.n_ff * (lay.up_row_bytes + lay.down_t_row_bytes))
        for lay in sidecar.layers
    )
    assert half.sparse == b.stock - saved
    assert half.bound_tps(1e9, sparse=True) > b.bound_tps(1e9)
