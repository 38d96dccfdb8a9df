"""Calibration: profiling through llama.cpp, thresholds, neuron statistics, decisions, the
reference sparse FFN in stock llama.cpp (tests/sparse_emulation.py), and format-2/3 sidecars
(format 1 and files with the retired predictor content still read)."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from sparse_emulation import SparseFfnEmulator
from synth import FAST_CONVERT, synthetic_text

from llamaflash.converters import convert
from llamaflash.converters.analysis import AnalysisSettings, analyse_layer, hot_first_order
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.calibrate import dequantize
from llamaflash.converters.integrity import IntegrityStage
from llamaflash.converters.llama_runner import LlamaRunner, ProfileHook, activation_fn
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.sparsity import SparsityStage, decide_layer
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import SidecarFormatError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_header import read_gguf_header
from llamaflash.files.gguf_model import base_identity, read_base_model
from llamaflash.files.sidecar import read_layer_vectors, read_sidecar, validate_pair

# --------------------------------------------------------------------------------------
# profiling and the reference sparse FFN through llama.cpp
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
    hook = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: 0.0, 1: 0.0})
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
    hook = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: t})
    sparse = runner.decode(tokens, hook).copy()
    # layer 0's gates do not depend on the masking, so the count is exact
    expected = np.mean(np.abs(act(probe.x[0][0])) <= t)
    assert hook.measured_sparsity == pytest.approx(expected, abs=1e-9)
    assert 0.05 < expected < 0.95
    assert not np.array_equal(dense, sparse)
    everything = SparseFfnEmulator(fmt.ACTIVATION_SILU, {0: np.inf, 1: np.inf})
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


SETTINGS = AnalysisSettings(levels=(0.0, 0.3, 0.5, 0.7), n_error_tokens=200)


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
    assert np.all(an.thresholds[below] == 0.0)  # under the natural sparsity: the zero pattern itself
    assert np.all(an.ffn_error[below] == 0.0)  # skipping exact zeros changes nothing
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


# --------------------------------------------------------------------------------------
# decisions and the sidecar
# --------------------------------------------------------------------------------------


def _analysis_for(model_path: Path, activation=fmt.ACTIVATION_SILU):
    model = read_base_model(model_path)
    rng = np.random.default_rng(0)
    out = {}
    for ffn in model.ffn_layers:
        x = rng.standard_normal((2000, ffn.n_embd)).astype(np.float32)
        heldout = np.arange(2000) % 4 == 3
        out[ffn.layer] = analyse_layer(
            ffn.layer,
            x,
            heldout,
            dequantize(model_path, ffn.gate),
            dequantize(model_path, ffn.up),
            dequantize(model_path, ffn.down),
            activation,
            AnalysisSettings(levels=(0.0, 0.5, 0.8), n_error_tokens=100),
        )
    return model, out


def test_decision_is_in_bundle_order_and_counts_gate_first_bytes(tiny_llama_q8_0):
    model, analyses = _analysis_for(tiny_llama_q8_0)
    ffn, an = model.ffn_layers[0], analyses[0]
    hot = decide_layer(an, ffn, 0.8, bundle_order="hot")
    assert np.all(np.diff(hot.freq) <= 0)
    np.testing.assert_array_equal(hot.freq, an.freq[2][hot.order])
    np.testing.assert_array_equal(hot.mag, an.mag[hot.order])
    base = decide_layer(an, ffn, 0.8)
    np.testing.assert_array_equal(base.order, np.arange(ffn.n_ff))
    # gate rows of every neuron, up and down_t rows (Q8_0 for this model) of the active ones
    down_t_row = ffn.n_embd // 32 * 34
    expected = ffn.n_ff * ffn.gate.row_bytes + (1 - an.sparsity_heldout[2]) * ffn.n_ff * (ffn.up.row_bytes + down_t_row)
    assert base.bytes_gate == pytest.approx(expected)


def _fixed_sidecar(model_path: Path, out: Path, order: str) -> tuple:
    """A format-3 sidecar of the model at ``model_path`` from synthetic analyses (level 0.5, bundles
    in ``order``): (the decisions, the sidecar's path)."""
    model, analyses = _analysis_for(model_path)
    decisions = {f.layer: decide_layer(analyses[f.layer], f, 0.5, bundle_order=order) for f in model.ffn_layers}
    stage = SparsityStage(decisions)
    plan = plan_sidecar(model, base_identity(model_path, model), [BundleStage(stage.orders), stage, IntegrityStage()])
    for key, value in (
        (fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE),
        (fmt.KEY_SPARSITY_METHOD, fmt.SPARSITY_METHOD_FIXED),
        (fmt.KEY_BUNDLE_ORDER, order),
    ):
        plan.set_string(key, value)
    plan.set_float32(fmt.KEY_SPARSITY_TARGET, 0.5)
    return decisions, write_sidecar_atomically(plan, out)


def test_v2_sidecar_round_trips_statistics(tiny_llama_q8_0, tmp_path):
    model_path = tmp_path / "m.gguf"
    shutil.copy(tiny_llama_q8_0, model_path)
    decisions, sidecar = _fixed_sidecar(model_path, tmp_path / "m.flash.gguf", fmt.BUNDLE_ORDER_HOT)
    info = validate_pair(model_path, sidecar)
    assert info.format_version == 3 and info.sparsity.target == 0.5 and info.sparsity.quality == {}
    assert info.integrity == fmt.INTEGRITY_ALGORITHM
    for lay in info.layers:
        d = decisions[lay.layer]
        v = read_layer_vectors(info, lay)
        np.testing.assert_array_equal(v["order"], d.order)
        np.testing.assert_array_equal(v["freq"], d.freq)
        np.testing.assert_array_equal(v["mag"], d.mag)
        assert lay.threshold == pytest.approx(d.threshold, rel=1e-6)
        for offset in (lay.freq_offset, lay.mag_offset):
            assert offset % fmt.SIDECAR_ALIGNMENT == 0
    # the retired selection/predictor arrays are written as "gate-first, no predictor", for older readers
    fields = gguf.GGUFReader(sidecar).fields
    for key, value in fmt.LEGACY_SELECTION_VALUES.items():
        assert fields[key].contents() == [value] * len(info.layers), key
    assert not any("pred" in t.name for t in read_gguf_header(sidecar).tensors)


def _as_an_older_converter_wrote_it(src: Path, dst: Path, rank: int = 8) -> None:
    """``src`` rewritten with gguf-py as converters with activation predictors wrote it: every layer
    recorded predictor-first (selection code 1) with a rank-``rank`` predictor, its threshold, recall
    and precision, and the F16 tensors ``blk.L.ffn_pred_in`` (rank x n_embd) and ``blk.L.ffn_pred_out``
    (n_ff x rank); every other key and tensor copied unchanged."""
    reader = gguf.GGUFReader(src)
    layers = reader.fields[fmt.KEY_LAYERS].contents()
    n_embd = reader.fields[fmt.KEY_N_EMBD].contents()
    n_ffs = reader.fields[fmt.KEY_N_FF].contents()
    old_values = {
        fmt.KEY_SELECTION: 1,
        fmt.KEY_PRED_RANKS: rank,
        fmt.KEY_PRED_THRESHOLDS: 0.25,
        fmt.KEY_PRED_RECALL: 0.95,
        fmt.KEY_PRED_PRECISION: 0.4,
    }
    writer = gguf.GGUFWriter(dst, fmt.SIDECAR_ARCHITECTURE)
    writer.add_custom_alignment(fmt.SIDECAR_ALIGNMENT)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in (fmt.GENERAL_ARCHITECTURE, fmt.GENERAL_ALIGNMENT):
            continue
        value = [old_values[name]] * len(layers) if name in old_values else f.contents()
        sub_type = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, f.types[0], sub_type=sub_type)
    rng = np.random.default_rng(3)
    tensors = [(t.name, np.ascontiguousarray(t.data), t.tensor_type) for t in reader.tensors]
    for layer, n_ff in zip(layers, n_ffs):
        tensors.append(
            (
                f"blk.{layer}.ffn_pred_in",
                rng.standard_normal((rank, n_embd)).astype(np.float16),
                gguf.GGMLQuantizationType.F16,
            )
        )
        tensors.append(
            (
                f"blk.{layer}.ffn_pred_out",
                rng.standard_normal((n_ff, rank)).astype(np.float16),
                gguf.GGMLQuantizationType.F16,
            )
        )
    for name, data, ggml_type in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file(dst)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()


def test_a_sidecar_with_predictors_from_an_older_converter_still_loads(tiny_llama_q8_0, tmp_path):
    """Older converters stored low-rank activation predictors (tensors and per-layer keys); the engine
    never read them. Such a file reads as the same sidecar without them, and the sparse lane computes
    the same logits from it, bit for bit."""
    import llamaflash

    model_path = tmp_path / "m.gguf"
    shutil.copy(tiny_llama_q8_0, model_path)
    _, new = _fixed_sidecar(model_path, tmp_path / "new.flash.gguf", fmt.BUNDLE_ORDER_BASE)
    old = tmp_path / "old.flash.gguf"
    _as_an_older_converter_wrote_it(new, old)
    names = {t.name for t in read_gguf_header(old).tensors}
    assert {"blk.0.ffn_pred_in", "blk.1.ffn_pred_out"} <= names
    assert gguf.GGUFReader(old).fields[fmt.KEY_SELECTION].contents() == [1, 1]
    new_info, old_info = validate_pair(model_path, new), validate_pair(model_path, old)
    assert old_info.format_version == new_info.format_version == 3
    for a, b in zip(new_info.layers, old_info.layers):
        assert (a.threshold, a.sparsity, a.ffn_rel_error) == (b.threshold, b.sparsity, b.ffn_rel_error)
        assert read_layer_vectors(new_info, a).keys() == {"order", "freq", "mag"}
        for k, v in read_layer_vectors(old_info, b).items():
            np.testing.assert_array_equal(v, read_layer_vectors(new_info, a)[k])
    logits = []
    for sidecar in (new, old):
        llm = llamaflash.Llama(
            model_path=str(model_path),
            sidecar_path=str(sidecar),
            flash_mode="sparse",
            flash_max_sparse_tokens=64,
            n_ctx=64,
            n_threads=1,
            logits_all=True,
            verbose=False,
        )
        tokens = llm.tokenize(b"the quick brown fox jumps over the lazy dog")
        llm.eval(tokens)
        logits.append(np.array(llm.scores[: len(tokens)], dtype=np.float32))
        assert llm.flash_stats()["sparse_lane_calls"] > 0
        llm.close()
    assert np.array_equal(logits[0], logits[1])


def test_v2_sidecar_missing_a_statistics_tensor_is_refused(tiny_llama_q8_0, tmp_path):
    model, analyses = _analysis_for(tiny_llama_q8_0)
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
        assert d["threshold"] is None and d["freq_offset"] is None
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
    assert set(q) >= {
        "ppl_dense",
        "ppl",
        "greedy_agreement",
        "curve_sparsity",
        "curve_ppl",
        "curve_greedy_agreement",
        "validation",
        "validation_tokens",
        "active_fraction",
        "curve_active_fraction",
        "method",
    }
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


def test_conversion_stores_no_predictors_and_samples_the_last_layer_less(tiny_llama_q8_0, tmp_path):
    """The engine selects gate-first: the converter stores no predictor tensors, writes the retired
    arrays as "gate-first, no predictor", and its report has no predictor fields."""
    import json

    out = convert(tiny_llama_q8_0, tmp_path / "g.flash.gguf", progress=False, **dict(FAST_CONVERT, sparsity=0.5))
    assert not any("pred" in t.name for t in read_gguf_header(out).tensors)
    assert gguf.GGUFReader(out).fields[fmt.KEY_SELECTION].contents() == [0, 0]
    report = json.loads((tmp_path / "g.flash.gguf.report.json").read_text())
    assert report["llamaflash_report"] == 3
    assert not any(k.startswith("pred") or "predictor" in k for entry in report["layers"] for k in entry)
    assert "predictors" not in report["layers"][0]["curve"]
    assert report["quality"]["method"] == "engine" and report["quality"]["chosen"]["selection"] == "gate"
    # llama.cpp's last layer only computes the rows whose logits are asked for: every 4th while profiling
    first, last = report["layers"][0], report["layers"][-1]
    assert first["samples"] >= FAST_CONVERT["calib_tokens"]
    assert last["samples"] == pytest.approx(first["samples"] / 4, rel=0.1)
