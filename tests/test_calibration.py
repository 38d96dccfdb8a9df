"""Calibration: profiling through llama.cpp, thresholds, neuron statistics, predictors, selection,
the sparse-FFN emulation, and format-2 sidecars (with format 1 still read)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from synth import FAST_CONVERT
from llamaflash import sidecar_format as fmt
from llamaflash.converters import convert
from llamaflash.converters.analysis import (
    AnalysisSettings,
    analyse_layer,
    hot_first_order,
    predictor_quality,
    train_predictor,
)
from llamaflash.converters.integrity import IntegrityStage
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.calibrate import dequantize
from llamaflash.converters.llama_runner import (
    EmulatedLayer,
    LlamaRunner,
    ProfileHook,
    SparseFfnEmulator,
    activation_fn,
)
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.sparsity import SparsityStage, decide_layer
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import SidecarFormatError
from llamaflash.gguf_header import read_gguf_header
from llamaflash.gguf_model import base_identity, read_base_model
from llamaflash.sidecar import read_layer_vectors, read_sidecar, validate_pair
from synth import synthetic_text

# --------------------------------------------------------------------------------------
# profiling and emulation through llama.cpp
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_llama_q8_0):
    r = LlamaRunner(tiny_llama_q8_0, 128, n_threads=1)
    yield r
    r.close()


@pytest.fixture(scope="module")
def tokens(runner) -> np.ndarray:
    return runner.with_bos(runner.tokenize(synthetic_text(400, seed=5)))[:128]


def test_profile_hook_sees_every_token_of_every_layer(runner, tokens, tiny_llama_q8_0):
    hook = ProfileHook([0, 1], n_gate_check=8)
    hook.keep = slice(1, None)  # leave out the BOS position
    logits = runner.decode(tokens, hook)
    assert logits.shape == (tokens.size, runner.n_vocab)
    model = read_base_model(tiny_llama_q8_0)
    for ffn in model.ffn_layers:
        (x,) = hook.x[ffn.layer]
        assert x.dtype == np.float16 and x.shape == (tokens.size - 1, 64)  # last layer too: all logits asked
        # llama.cpp's gate·x (quantized activations) against the NumPy recomputation from the profiled x
        xc, gc = hook.x_check[ffn.layer], hook.gate_check[ffn.layer]
        assert xc.shape == (8, 64) and gc.shape == (8, 128)
        ref = xc @ dequantize(tiny_llama_q8_0, ffn.gate).T
        assert np.linalg.norm(ref - gc) / np.linalg.norm(gc) < 0.02


def test_emulation_with_zero_threshold_is_the_dense_model(runner, tokens):
    dense = runner.decode(tokens).copy()
    hook = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: EmulatedLayer(0.0), 1: EmulatedLayer(0.0)})
    same = runner.decode(tokens, hook).copy()
    assert np.array_equal(dense, same)
    assert hook.measured_sparsity == 0.0 and hook.total == 2 * tokens.size * 128


def test_emulation_skips_exactly_the_neurons_under_the_threshold(runner, tokens):
    # the gate pre-activations llama.cpp computes, captured by a probe hook
    class Probe(ProfileHook):
        def wants(self, kind, layer):
            return kind == "ffn_gate"

        def seen(self, kind, layer, data):
            self.x[layer].append(data.copy())

    probe = Probe([0, 1])
    dense = runner.decode(tokens, probe).copy()
    act = activation_fn(fmt.ACTIVATION_SILU)
    t = 0.3
    hook = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: EmulatedLayer(t)})
    sparse = runner.decode(tokens, hook).copy()
    # layer 0's gates do not depend on the masking, so the count is exact
    expected = np.mean(np.abs(act(probe.x[0][0])) <= t)
    assert hook.measured_sparsity == pytest.approx(expected, abs=1e-9)
    assert 0.05 < expected < 0.95
    assert not np.array_equal(dense, sparse)
    everything = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: EmulatedLayer(np.inf), 1: EmulatedLayer(np.inf)})
    runner.decode(tokens, everything)
    assert everything.measured_sparsity == 1.0


def test_callback_errors_are_raised_not_swallowed(runner, tokens):
    class Broken(ProfileHook):
        def seen(self, kind, layer, data):
            raise ValueError("boom in the hook")

    with pytest.raises(ValueError, match="boom in the hook"):
        runner.decode(tokens, Broken([0]))
    runner.decode(tokens)  # the runner still works


# --------------------------------------------------------------------------------------
# analysis (NumPy) on synthetic data
# --------------------------------------------------------------------------------------


def _layer_data(n_tokens=3000, n_embd=32, n_ff=96, seed=0):
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)
    x = (rng.standard_normal((n_tokens, n_embd)) @ mix).astype(np.float32)  # correlated inputs
    gate = (rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    up = (rng.standard_normal((n_ff, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
    down = (rng.standard_normal((n_embd, n_ff)) / np.sqrt(n_ff)).astype(np.float32)
    heldout = np.zeros(n_tokens, dtype=bool)
    heldout[::4] = True
    return x, heldout, gate, up, down


SETTINGS = AnalysisSettings(levels=(0.0, 0.3, 0.5, 0.7), ranks=(4, 8, 16), n_error_tokens=200)


@pytest.mark.parametrize("activation", [fmt.ACTIVATION_SILU, fmt.ACTIVATION_GELU])
def test_thresholds_hit_the_target_sparsity_on_held_out_tokens(activation):
    x, heldout, gate, up, down = _layer_data()
    an = analyse_layer(3, x, heldout, gate, up, down, activation, SETTINGS)
    assert an.thresholds[0] == 0.0 and np.all(np.diff(an.thresholds) > 0)
    np.testing.assert_allclose(an.sparsity_heldout[1:], [0.3, 0.5, 0.7], atol=0.02)
    np.testing.assert_allclose(an.sparsity_heldout_gate_up[1:], [0.3, 0.5, 0.7], atol=0.02)
    # output error grows with sparsity and is measured against a NumPy reference
    assert np.all(np.diff(an.ffn_error) > 0)
    act = activation_fn(activation)
    xe = x[heldout][:200]
    a = act(xe @ gate.T)
    h = a * (xe @ up.T)
    skipped = np.abs(a) <= an.thresholds[2]
    ref = np.linalg.norm((h * skipped) @ down.T) / np.linalg.norm(h @ down.T)
    assert an.ffn_error[2] == pytest.approx(ref, rel=1e-4)
    # frequencies: the fraction of all tokens active at each threshold, in base order
    np.testing.assert_allclose(an.freq[2], np.mean(np.abs(act(x @ gate.T)) > an.thresholds[2], axis=0), atol=1e-6)
    np.testing.assert_allclose(an.mag, np.mean(np.abs(act(x @ gate.T) * (x @ up.T)), axis=0), rtol=1e-4)


def test_relu_keeps_the_exact_zero_pattern():
    x, heldout, gate, up, down = _layer_data()
    an = analyse_layer(0, x, heldout, gate, up, down, fmt.ACTIVATION_RELU, SETTINGS)
    assert 0.4 < an.natural_sparsity < 0.6  # random gates: about half negative
    below = an.levels < an.natural_sparsity - 0.05
    assert np.all(an.thresholds[below] == 0.0)       # under the natural sparsity: the zero pattern itself
    assert np.all(an.ffn_error[below] == 0.0)        # skipping exact zeros changes nothing
    assert an.thresholds[-1] > 0.0 and an.ffn_error[-1] > 0.0  # 0.7 > natural: a real threshold
    g = x @ gate.T
    np.testing.assert_allclose(an.freq[0], np.mean(g > 0, axis=0), atol=1e-6)


def test_hot_first_order_is_a_permutation_sorted_by_frequency():
    rng = np.random.default_rng(1)
    freq = rng.choice([0.1, 0.5, 0.9], size=200).astype(np.float32)
    mag = rng.random(200).astype(np.float32)
    order = hot_first_order(freq, mag)
    assert sorted(order.tolist()) == list(range(200))
    assert np.all(np.diff(freq[order]) <= 0)
    for level in (0.1, 0.5, 0.9):  # ties broken by larger magnitude
        run = order[freq[order] == level]
        assert np.all(np.diff(mag[run]) <= 0)


def test_predictor_quality_matches_a_direct_count():
    rng = np.random.default_rng(2)
    active = rng.random((50, 40)) < 0.3
    predicted = rng.random((50, 40)) < 0.4
    h2 = rng.random((50, 40))
    recall, precision, mass, frac = predictor_quality(predicted, active, h2)
    tp = sum(1 for i in range(50) for j in range(40) if predicted[i, j] and active[i, j])
    assert recall == pytest.approx(tp / active.sum())
    assert precision == pytest.approx(tp / predicted.sum())
    assert frac == pytest.approx(predicted.sum() / predicted.size)
    assert mass == pytest.approx(h2[predicted & active].sum() / h2[active].sum())


def test_full_rank_predictor_reproduces_the_gate_and_low_rank_is_optimal():
    x, heldout, gate, up, down = _layer_data(n_embd=24, n_ff=64)
    b, a = train_predictor(x, gate, 24)
    np.testing.assert_allclose(x @ b.T @ a.T, x @ gate.T, atol=2e-4)
    # rank r: better (in the covariance-weighted sense) than the plain truncated SVD of the gate
    b8, a8 = train_predictor(x, gate, 8)
    u, s, vt = np.linalg.svd(gate, full_matrices=False)
    plain = (u[:, :8] * s[:8]) @ vt[:8]
    err_ours = np.linalg.norm(x @ (a8 @ b8).T - x @ gate.T)
    err_plain = np.linalg.norm(x @ plain.T - x @ gate.T)
    assert err_ours <= err_plain * 1.0001


def test_predictor_recall_and_precision_agree_with_a_numpy_reference():
    x, heldout, gate, up, down = _layer_data()
    an = analyse_layer(0, x, heldout, gate, up, down, fmt.ACTIVATION_SILU, SETTINGS)
    act = activation_fn(fmt.ACTIVATION_SILU)
    xh = x[np.flatnonzero(heldout)[:SETTINGS.n_predictor_tokens]]
    for q in an.predictors:
        for i in (1, 2, 3):
            est = xh @ an.pred_in[:q.rank].T @ an.pred_out[:, :q.rank].T
            predicted = np.abs(act(est)) > q.tau[i]
            active = np.abs(act(xh @ gate.T)) > an.thresholds[i]
            tp = np.count_nonzero(predicted & active)
            assert q.recall[i] == pytest.approx(tp / np.count_nonzero(active), abs=1e-6)
            assert q.precision[i] == pytest.approx(tp / np.count_nonzero(predicted), abs=1e-6)
    # tau is calibrated for the recall target on train tokens; held out it lands close
    best = an.predictor(16)
    assert np.all(np.abs(best.recall[1:] - SETTINGS.recall_target) < 0.05)
    assert an.predictor(16).precision[2] >= an.predictor(4).precision[2]  # more rank, fewer false positives


# --------------------------------------------------------------------------------------
# decisions and the sidecar
# --------------------------------------------------------------------------------------


def _analysis_for(model_path: Path, activation=fmt.ACTIVATION_SILU, ranks=(4, 8, 16)):
    model = read_base_model(model_path)
    rng = np.random.default_rng(0)
    out = {}
    for ffn in model.ffn_layers:
        x = rng.standard_normal((2000, ffn.n_embd)).astype(np.float32)
        heldout = np.arange(2000) % 4 == 3
        out[ffn.layer] = analyse_layer(
            ffn.layer, x, heldout, dequantize(model_path, ffn.gate), dequantize(model_path, ffn.up),
            dequantize(model_path, ffn.down), activation,
            AnalysisSettings(levels=(0.0, 0.5, 0.8), ranks=ranks, n_error_tokens=100))
    return model, out


def test_selection_rule_prefers_fewer_bytes_under_a_recall_floor(tiny_llama_q8_0):
    model, analyses = _analysis_for(tiny_llama_q8_0)
    ffn = model.ffn_layers[0]
    an = analyses[0]
    auto = decide_layer(an, ffn, 0.8, "auto", min_recall=0.5, bundle_order="hot")
    assert auto.rank in (4, 8, 16)
    expected = "predictor" if auto.bytes_predictor < auto.bytes_gate else "gate"
    assert auto.selection == expected
    assert decide_layer(an, ffn, 0.8, "gate").rank == 0
    forced = decide_layer(an, ffn, 0.8, "predictor", min_recall=0.999)
    assert forced.selection == "predictor" and forced.rank > 0
    none_good = decide_layer(an, ffn, 0.8, "auto", min_recall=1.01)
    assert none_good.selection == "gate" and none_good.rank == 0
    # everything is in bundle order
    assert np.all(np.diff(auto.freq) <= 0)
    np.testing.assert_array_equal(auto.freq, an.freq[2][auto.order])
    np.testing.assert_array_equal(auto.pred_out, an.pred_out[auto.order, :auto.rank])


def test_v2_sidecar_round_trips_statistics_and_predictors(tiny_llama_q8_0, tmp_path):
    model_path = tmp_path / "m.gguf"
    shutil.copy(tiny_llama_q8_0, model_path)
    model, analyses = _analysis_for(model_path)
    decisions = {f.layer: decide_layer(analyses[f.layer], f, 0.5, "predictor", bundle_order="hot")
                 for f in model.ffn_layers}
    stage = SparsityStage(decisions)
    plan = plan_sidecar(model, base_identity(model_path, model), [BundleStage(stage.orders), stage, IntegrityStage()])
    for key, value in ((fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE),
                       (fmt.KEY_SPARSITY_METHOD, fmt.SPARSITY_METHOD_FIXED),
                       (fmt.KEY_BUNDLE_ORDER, fmt.BUNDLE_ORDER_HOT)):
        plan.set_string(key, value)
    plan.set_float32(fmt.KEY_SPARSITY_TARGET, 0.5)
    sidecar = write_sidecar_atomically(plan, tmp_path / "m.flash.gguf")
    info = validate_pair(model_path, sidecar)
    assert info.format_version == 3 and info.sparsity.target == 0.5 and info.sparsity.quality == {}
    assert info.integrity == fmt.INTEGRITY_ALGORITHM
    for lay in info.layers:
        d = decisions[lay.layer]
        v = read_layer_vectors(info, lay)
        np.testing.assert_array_equal(v["order"], d.order)
        np.testing.assert_array_equal(v["freq"], d.freq)
        np.testing.assert_array_equal(v["mag"], d.mag)
        np.testing.assert_allclose(v["pred_in"], d.pred_in, rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(v["pred_out"], d.pred_out, rtol=1e-3, atol=1e-4)
        assert lay.selection == "predictor" and lay.pred_rank == d.rank
        assert lay.threshold == pytest.approx(d.threshold, rel=1e-6)
        assert lay.pred_threshold == pytest.approx(d.pred_threshold, rel=1e-6)
        layout = lay.to_dict()
        for key in ("threshold", "selection", "freq_offset", "pred_in_offset", "pred_out_offset", "pred_rank"):
            assert layout[key] is not None, key
        for offset in (lay.freq_offset, lay.mag_offset, lay.pred_in_offset, lay.pred_out_offset):
            assert offset % fmt.SIDECAR_ALIGNMENT == 0


def test_v2_sidecar_missing_a_statistics_tensor_is_refused(tiny_llama_q8_0, tmp_path):
    model, analyses = _analysis_for(tiny_llama_q8_0, ranks=())
    decisions = {f.layer: decide_layer(analyses[f.layer], f, 0.5) for f in model.ffn_layers}
    stage = SparsityStage(decisions)
    plan = plan_sidecar(model, base_identity(tiny_llama_q8_0, model), [BundleStage(stage.orders), stage])
    plan.set_string(fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE)
    plan.set_string(fmt.KEY_SPARSITY_METHOD, fmt.SPARSITY_METHOD_FIXED)
    plan.set_string(fmt.KEY_BUNDLE_ORDER, fmt.BUNDLE_ORDER_BASE)
    plan.set_float32(fmt.KEY_SPARSITY_TARGET, 0.5)
    plan.tensors = [t for t in plan.tensors if t.name != fmt.freq_tensor_name(1)]
    sidecar = write_sidecar_atomically(plan, tmp_path / "broken.flash.gguf")
    with pytest.raises(SidecarFormatError, match="blk.1.ffn_freq' is missing"):
        read_sidecar(sidecar)


def test_format_1_sidecars_are_still_read(tiny_llama_q8_0, tmp_path):
    model = read_base_model(tiny_llama_q8_0)
    plan = plan_sidecar(model, base_identity(tiny_llama_q8_0, model), [BundleStage()])
    sidecar = write_sidecar_atomically(plan, tmp_path / "v1.flash.gguf")
    assert gguf.GGUFReader(sidecar).fields[fmt.KEY_FORMAT_VERSION].contents() == 1
    info = validate_pair(tiny_llama_q8_0, sidecar)
    assert info.format_version == 1 and info.sparsity is None
    for lay in info.layers:
        d = lay.to_dict()
        assert d["selection"] is None and d["threshold"] is None and d["pred_rank"] == 0
        assert read_layer_vectors(info, lay).keys() == {"order"}


# --------------------------------------------------------------------------------------
# end to end on a synthetic model
# --------------------------------------------------------------------------------------


def test_convert_records_the_operating_point_and_quality(tiny_llama_q8_0, tmp_path):
    out = convert(tiny_llama_q8_0, tmp_path / "a.flash.gguf", progress=False, order="hot", **FAST_CONVERT)
    info = read_sidecar(out)
    sp = info.sparsity
    assert sp.method == "auto" and sp.criterion == "act_gate" and sp.quality_budget == pytest.approx(0.02)
    assert sp.bundle_order == "hot"
    q = sp.quality
    assert set(q) >= {"ppl_dense", "ppl", "greedy_agreement", "curve_sparsity", "curve_ppl",
                      "curve_greedy_agreement", "validation", "validation_tokens", "active_fraction",
                      "curve_active_fraction", "method"}
    assert q["method"] == "engine"
    assert q["validation"] == "text given to convert()" and q["validation_tokens"] >= 500
    assert len(q["curve_sparsity"]) == len(q["curve_ppl"]) == len(q["curve_greedy_agreement"]) >= 1
    within = [s for s, p in zip(q["curve_sparsity"], q["curve_ppl"]) if p / q["ppl_dense"] - 1 <= 0.02]
    assert sp.target == pytest.approx(max(within) if within else 0.0)
    for lay in info.layers:
        assert lay.sparsity == pytest.approx(sp.target, abs=0.05)
        v = read_layer_vectors(info, lay)
        assert np.all(np.diff(v["freq"]) <= 0)
        assert np.mean(v["freq"]) == pytest.approx(1 - sp.target, abs=0.05)


def test_default_conversion_trains_no_predictors(tiny_llama_q8_0, tmp_path):
    """The engine selects gate-first: by default the converter neither trains nor stores predictors,
    and the report measures none."""
    import json

    out = convert(tiny_llama_q8_0, tmp_path / "g.flash.gguf", progress=False, **dict(FAST_CONVERT, sparsity=0.5))
    info = read_sidecar(out)
    assert all(lay.selection == "gate" and lay.pred_rank == 0 and lay.pred_recall == 0 for lay in info.layers)
    assert not any("pred" in t.name for t in read_gguf_header(out).tensors)
    report = json.loads((tmp_path / "g.flash.gguf.report.json").read_text())
    assert all(entry["pred_rank"] == 0 and entry["pred_recall"] is None and entry["curve"]["predictors"] == []
               for entry in report["layers"])
    assert report["operating_point"]["layers_predictor"] == 0


@pytest.mark.parametrize("method", ["emulated", "engine"])
def test_forced_predictor_selection_is_recorded_and_measured_as_run(tiny_llama_q8_0, tmp_path, method):
    """The emulation measures predictor-first selection as recorded ("mixed"); the engine runs every
    layer gate-first in this version, measures that, and says so in the notes."""
    import json

    out = convert(tiny_llama_q8_0, tmp_path / "p.flash.gguf", progress=False,
                  **dict(FAST_CONVERT, sparsity=0.5, selection="predictor", quality=method))
    info = read_sidecar(out)
    assert all(lay.selection == "predictor" and lay.pred_rank > 0 for lay in info.layers)
    report = json.loads((tmp_path / "p.flash.gguf.report.json").read_text())
    # llama.cpp's last layer only computes the rows whose logits are asked for: every 4th while profiling
    first, last = report["layers"][0], report["layers"][-1]
    assert first["samples"] >= FAST_CONVERT["calib_tokens"]
    assert last["samples"] == pytest.approx(first["samples"] / 4, rel=0.1)
    assert report["operating_point"]["layers_predictor"] == 2
    assert report["quality"]["method"] == info.sparsity.quality["method"] == method
    if method == "emulated":
        assert report["quality"]["chosen"]["selection"] == "mixed"
        assert "EMULATION" in report["quality"]["note"]
    else:
        assert report["quality"]["chosen"]["selection"] == "gate"
        assert any("2 layers are recorded for predictor-first" in n and "gate-first" in n for n in report["notes"])


def test_predictor_fit_survives_fewer_samples_than_dimensions():
    # llama.cpp's last layer gets 1/4 of the profiled tokens: its covariance can be singular
    x, heldout, gate, up, down = _layer_data(n_tokens=40, n_embd=32, n_ff=64)
    x[:, 5] = x[:, 4]  # and exactly collinear inputs
    b, a = train_predictor(x, gate, 16)
    assert np.all(np.isfinite(b)) and np.all(np.isfinite(a))
    np.testing.assert_allclose(a.T @ a, np.eye(16), atol=1e-3)
