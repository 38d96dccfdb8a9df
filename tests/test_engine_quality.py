"""``--sparsity auto`` measured with the sparse engine: the quality keys name their method, the
curve carries the lane's measured active fractions, the chosen level is within budget, the
temporary measurement sidecar never outlives the conversion (also when the measurement fails),
failures name a way to convert without the measurement, and sidecars written by older converters
(the retired ``emulated`` method's keys only) still read."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from synth import FAST_CONVERT

from llamaflash.cli.cli import main
from llamaflash.converters import convert, engine_quality
from llamaflash.converters.analysis import AnalysisSettings, analyse_layer
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.calibrate import dequantize
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.sparsity import SparsityStage, decide_layer
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import ConversionError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import base_identity, read_base_model
from llamaflash.files.sidecar import read_sidecar


def _keys(path) -> set[str]:
    return set(gguf.GGUFReader(path).fields)


@pytest.fixture(scope="module")
def engine_converted(tiny_model_factory, tmp_path_factory):
    """A synthetic model converted with --sparsity auto (budget +0.5%, so that on this random model
    some levels pass and the sweep is decided by it): (model, its directory, the sidecar)."""
    model = tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192)
    d = tmp_path_factory.mktemp("engine-quality")
    return model, d, convert(model, d / "engine.flash.gguf", progress=False, quality_budget=0.005, **FAST_CONVERT)


def test_engine_quality_keys_curve_and_operating_point(engine_converted):
    model, d, path = engine_converted
    keys = _keys(path)
    q_keys = {k for k in keys if k.startswith(fmt.KEY_PREFIX + "quality.")}
    assert q_keys and all(k.startswith("llamaflash.quality.engine.") for k in q_keys)
    for name in (
        fmt.QUALITY_PPL_DENSE,
        fmt.QUALITY_PPL,
        fmt.QUALITY_GREEDY,
        fmt.QUALITY_ACTIVE_FRACTION,
        fmt.QUALITY_CURVE_SPARSITY,
        fmt.QUALITY_CURVE_ACTIVE_FRACTION,
    ):
        assert fmt.quality_key("engine", name) in keys, name
    sp = read_sidecar(path).sparsity
    q = sp.quality
    assert q["method"] == "engine"
    levels, fractions = q["curve_sparsity"], q["curve_active_fraction"]
    assert levels == pytest.approx([0.25, 0.5, 0.75][: len(levels)]) and len(levels) >= 1
    # the lane's own counters: about 1 - level of the neurons computed, on validation text
    np.testing.assert_allclose(fractions, 1 - np.array(levels), atol=0.06)
    assert np.all(np.diff(fractions) < 0)
    # the highest level within the budget; the sweep stops at stop_factor x budget
    deltas = np.array(q["curve_ppl"]) / q["ppl_dense"] - 1
    within = [s for s, dl in zip(levels, deltas) if dl <= 0.005]
    assert sp.target == pytest.approx(max(within) if within else 0.0)
    assert all(dl <= 2 * 0.005 for dl in deltas[:-1])
    if sp.target > 0:
        assert q["ppl"] == pytest.approx(q["curve_ppl"][levels.index(sp.target)])
        assert q["active_fraction"] == pytest.approx(fractions[levels.index(sp.target)])
    report = json.loads((d / "engine.flash.gguf.report.json").read_text())
    assert report["llamaflash_report"] == 3
    assert report["quality"]["method"] == report["operating_point"]["quality_method"] == "engine"
    assert all(p["method"] == "engine" and 0 < p["active_fraction"] < 1 for p in report["quality"]["curve"])
    assert report["timings_s"]["quality_sidecar_s"] > 0
    # nothing left beside the outputs (the measurement sidecar was hidden and is gone)
    assert sorted(p.name for p in d.iterdir()) == ["engine.flash.gguf", "engine.flash.gguf.report.json"]


def test_inspect_names_the_method(engine_converted):
    result = CliRunner().invoke(main, ["inspect", str(engine_converted[2])])
    assert result.exit_code == 0, result.output
    assert "quality method:   engine (measured with the sparse engine)" in result.output
    assert "active fraction" in result.output


def test_the_removed_emulated_method_is_refused_naming_the_remaining_one(tiny_llama_q8_0, tmp_path):
    result = CliRunner().invoke(
        main, ["convert", str(tiny_llama_q8_0), "-o", str(tmp_path / "x.flash.gguf"), "--quality-method", "emulated"]
    )
    assert result.exit_code == 2 and "'emulated' is not 'engine'" in result.output
    assert list(tmp_path.iterdir()) == []


def test_measurement_sidecar_is_removed_when_the_measurement_fails(tiny_llama_q8_0, tmp_path, monkeypatch):
    seen = []
    real_decode = engine_quality.EngineRunner.decode

    def failing_decode(self, tokens):
        hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        seen.append(hidden)
        if len(seen) == 3:
            raise RuntimeError("boom in the middle of the measurement")
        return real_decode(self, tokens)

    monkeypatch.setattr(engine_quality.EngineRunner, "decode", failing_decode)
    out = tmp_path / "m.flash.gguf"
    with pytest.raises(RuntimeError, match="boom in the middle"):
        convert(tiny_llama_q8_0, out, progress=False, **FAST_CONVERT)
    # while measuring: one hidden file beside the output, never the final name
    assert [len(h) for h in seen] == [1, 1, 1]
    assert seen[0][0].name.startswith(".m.flash.gguf.quality-") and seen[0][0].parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_the_engine_path_refuses_a_measurement_off_the_sparse_lane(tiny_llama_q8_0, tmp_path, monkeypatch):
    """If a batch ran on the dense lane, the numbers would not be the sparse computation: refused."""
    real_stats = engine_quality.EngineRunner.active_fraction

    def dense_too(self):
        self.llm._flash.set_sparse_config(True, max_tokens=1)
        self.llm.eval([3, 4])  # a 2-token batch: dense lane
        return real_stats(self)

    monkeypatch.setattr(engine_quality.EngineRunner, "active_fraction", dense_too)
    with pytest.raises(ConversionError, match="did not run every FFN .* --sparsity 0.3 --no-quality"):
        convert(tiny_llama_q8_0, tmp_path / "m.flash.gguf", progress=False, **dict(FAST_CONVERT, sparsity=0.5))
    assert list(tmp_path.iterdir()) == []


def test_sidecars_with_only_emulated_keys_still_read(tiny_llama_q8_0, tmp_path):
    """A format-2 file from before the engine measurement: the emulated keys spelled literally,
    without active fractions (no converter writes this method any more; readers keep reading it)."""
    model_path = tmp_path / "m.gguf"
    shutil.copy(tiny_llama_q8_0, model_path)
    model = read_base_model(model_path)
    rng = np.random.default_rng(0)
    decisions = {}
    for ffn in model.ffn_layers:
        x = rng.standard_normal((400, ffn.n_embd)).astype(np.float32)
        an = analyse_layer(
            ffn.layer,
            x,
            np.arange(400) % 4 == 3,
            dequantize(model_path, ffn.gate),
            dequantize(model_path, ffn.up),
            dequantize(model_path, ffn.down),
            fmt.ACTIVATION_SILU,
            AnalysisSettings(levels=(0.0, 0.5), n_error_tokens=50),
        )
        decisions[ffn.layer] = decide_layer(an, ffn, 0.5)
    stage = SparsityStage(decisions)
    plan = plan_sidecar(model, base_identity(model_path, model), [BundleStage(stage.orders), stage])
    plan.set_string(fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE)
    plan.set_string(fmt.KEY_SPARSITY_METHOD, fmt.SPARSITY_METHOD_AUTO)
    plan.set_string(fmt.KEY_BUNDLE_ORDER, fmt.BUNDLE_ORDER_BASE)
    plan.set_float32(fmt.KEY_SPARSITY_TARGET, 0.5)
    plan.set_string("llamaflash.quality.emulated.validation", "held-out Shakespeare")
    plan.set_uint32("llamaflash.quality.emulated.validation_tokens", 2044)
    plan.set_float32("llamaflash.quality.emulated.ppl_dense", 33.5)
    plan.set_float32("llamaflash.quality.emulated.ppl", 33.9)
    plan.set_float32("llamaflash.quality.emulated.greedy_agreement", 0.93)
    plan.set_float32_array("llamaflash.quality.emulated.curve_sparsity", [0.1, 0.5])
    plan.set_float32_array("llamaflash.quality.emulated.curve_ppl", [33.4, 33.9])
    plan.set_float32_array("llamaflash.quality.emulated.curve_greedy_agreement", [0.95, 0.93])
    sidecar = write_sidecar_atomically(plan, tmp_path / "old.flash.gguf")
    q = read_sidecar(sidecar).sparsity.quality
    assert q["method"] == "emulated" and q["validation_tokens"] == 2044
    assert q["ppl"] == pytest.approx(33.9) and q["curve_sparsity"] == pytest.approx([0.1, 0.5])
    assert "active_fraction" not in q and "curve_active_fraction" not in q
    result = CliRunner().invoke(main, ["inspect", str(sidecar)])
    assert result.exit_code == 0, result.output
    assert "quality method:   emulated (EMULATED in stock llama.cpp)" in result.output
    assert "curve: sparsity 0.50" in result.output


def test_quality_key_names():
    assert fmt.quality_key("engine", "ppl") == "llamaflash.quality.engine.ppl"
    assert fmt.quality_key("emulated", "curve_ppl") == "llamaflash.quality.emulated.curve_ppl"
    with pytest.raises(ValueError, match="unknown quality method"):
        fmt.quality_key("guessed", "ppl")
    with pytest.raises(ValueError, match="unknown quality field"):
        fmt.quality_key("engine", "perplexity")


def test_operating_point_takes_the_highest_level_within_budget_and_stops_early():
    """The sweep logic, on made-up measurements: +1%, +1.8%, +3%, +5% (stop: over 2 x 2%), never
    measured: 0.5."""
    from types import SimpleNamespace

    from llamaflash.converters.calibrate import _operating_point
    from llamaflash.converters.progress import Progress
    from llamaflash.converters.quality import QualityPoint

    dense = QualityPoint(0.0, 10.0, 0.0, 1.0, 0.0, "dense", "stock")
    ppl = {0.1: 10.1, 0.2: 10.18, 0.3: 10.3, 0.4: 10.5, 0.5: 10.2}
    measured = []

    def measure(level):
        measured.append(level)
        return QualityPoint(level, ppl[level], 0.0, 0.9, level, "gate", "engine")

    result = SimpleNamespace(dense=None, curve=[], target=0.0, chosen=None, notes=[])
    opts = SimpleNamespace(quality_budget=0.02, stop_factor=2.0, sparsity="auto")
    _operating_point(result, dense, measure, [0.1, 0.2, 0.3, 0.4, 0.5], False, opts, Progress(None, 0, ""))
    assert measured == [0.1, 0.2, 0.3, 0.4]
    assert result.target == 0.2 and result.chosen.ppl == 10.18 and result.dense is dense


def test_engine_runner_decode_is_llama_eval_from_an_empty_context(engine_converted):
    model, _, sidecar = engine_converted
    with engine_quality.EngineRunner(model, sidecar, 64, 0.5, n_threads=1) as engine:
        tokens = np.array(engine.llm.tokenize(b"The quick brown fox jumps over the lazy dog again and again"))
        engine.decode(tokens[::-1].copy())  # something else first: must not leak in
        ours = engine.decode(tokens).copy()
        engine.llm.reset()
        engine.llm.eval(tokens.tolist())
        np.testing.assert_array_equal(ours, engine.llm.scores[: tokens.size])
        assert engine.active_fraction() == pytest.approx(0.5, abs=0.1)
