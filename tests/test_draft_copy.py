"""The draft copy (converters/draft_copy.py, the draft mode of csrc/offload/offload_state.* and
csrc/lanes/sparse_lane.cpp, plugin/planning/draft_plan.py): a low-bit copy of every neuron's up and down_t rows that a
speculative self-draft computes from under a RAM budget.

What must hold: the converter writes exactly ggml's requantization of the base rows in bundle order;
the reader finds and checks it; the engine keeps it resident and a draft computes every needed cluster
from it (so it drafts better than the resident clusters alone); verified tokens never use it (greedy
output equals non-speculative decoding); the planner counts it and chooses it only when it predicts
faster delivered decode."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from offload_helpers import PROMPT, SELF_DRAFT, greedy, make_plan
from synth import FAST_CONVERT

import llamaflash
from llamaflash import _native
from llamaflash.converters import convert
from llamaflash.converters.draft_copy import draft_type
from llamaflash.errors import SidecarError
from llamaflash.files.gguf_model import read_base_model, read_tensor_rows
from llamaflash.files.sidecar import read_sidecar, validate_pair
from llamaflash.planning import draft_plan, planner

Q = gguf.GGMLQuantizationType
KW = dict(n_ctx=256, n_threads=2, n_threads_batch=2, verbose=False, seed=0)


@pytest.fixture(scope="module")
def pair(converted):
    """conftest's Q8_0 pair (n_embd 96: the auto draft type is Q4_0): its sidecar has a draft copy."""
    return converted


def test_draft_type_choices():
    assert draft_type(1536) == Q.Q2_K and draft_type(576) == Q.Q4_0 and draft_type(100) is None
    assert draft_type(1536, "none") is None and draft_type(1536, "q3_k") == Q.Q3_K
    with pytest.raises(ValueError, match="do not divide n_embd 576"):
        draft_type(576, "q2_k")
    with pytest.raises(ValueError, match="use one of"):
        draft_type(576, "q8")


def test_the_copy_is_ggmls_requantization_of_the_base_rows(pair):
    model, sidecar = pair
    base = read_base_model(model)
    info = validate_pair(model, sidecar)
    for lay, ffn in zip(info.layers, base.ffn_layers):
        assert lay.draft_type == int(Q.Q4_0) and lay.draft_row_bytes == 96 // 32 * 18
        up = gguf.quants.dequantize(np.asarray(read_tensor_rows(model, ffn.up)), Q(ffn.up.ggml_type))
        down = gguf.quants.dequantize(np.asarray(read_tensor_rows(model, ffn.down)), Q(ffn.down.ggml_type))
        n = lay.n_ff * lay.draft_row_bytes
        got_up = np.fromfile(sidecar, dtype=np.uint8, count=n, offset=lay.draft_up_offset)
        got_down = np.fromfile(sidecar, dtype=np.uint8, count=n, offset=lay.draft_down_t_offset)
        want_up = _native.quantize_rows(int(Q.Q4_0), np.ascontiguousarray(up.reshape(lay.n_ff, lay.n_embd)))
        want_down = _native.quantize_rows(int(Q.Q4_0), np.ascontiguousarray(down.reshape(lay.n_embd, lay.n_ff).T))
        assert np.array_equal(got_up, want_up.reshape(-1)) and np.array_equal(got_down, want_down.reshape(-1))
        # and it is close to the base rows: Q4_0 of the dequantized base, within one quantization step
        back = gguf.quants.dequantize(got_up.reshape(lay.n_ff, -1), Q.Q4_0)
        step = np.abs(up.reshape(lay.n_ff, -1)).reshape(lay.n_ff, -1, 32).max(-1, keepdims=True) / 7
        assert np.all(np.abs(back - up.reshape(lay.n_ff, -1)).reshape(lay.n_ff, -1, 32) <= step * 1.01 + 1e-6)


def test_no_copy_when_asked_for_none(pair, tmp_path):
    model, _ = pair
    out = convert(
        model,
        tmp_path / "none.flash.gguf",
        progress=False,
        sparsity=0.5,
        measure_quality=False,
        draft_type="none",
        **FAST_CONVERT,
    )
    info = read_sidecar(out)
    assert all(lay.draft_type is None for lay in info.layers)
    assert planner.draft_copy_bytes(info) is None
    with pytest.raises(SidecarError, match="no draft copy"):
        planner.plan_offload(model, out, 4096, draft_copy=True)
    with pytest.raises(ValueError, match="do not divide n_embd 96"):
        convert(model, tmp_path / "bad.flash.gguf", progress=False, draft_type="q2_k", **FAST_CONVERT)
    assert not (tmp_path / "bad.flash.gguf").exists()


def test_a_draft_from_the_copy_is_exact_and_drafts_better(pair, forced_plan):  # noqa: F811
    """No cluster pinned: a resident-only self-draft sees no FFN at all; the copy sees every neuron.
    Either way the verified tokens are the non-speculative ones."""
    model, sidecar = pair
    runs = {}
    for name, copy, spec in (("reference", False, False), ("resident", False, SELF_DRAFT), ("copy", True, SELF_DRAFT)):
        plan = make_plan(sidecar, 0, prefetch_layers=1)
        plan.draft_copy = copy
        forced_plan(plan)
        llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=spec, **KW)
        try:
            runs[name] = (greedy(llm), llm.flash_stats()["speculative"])
            if copy:
                assert llm._flash.draft_copy_bytes == planner.draft_copy_bytes(read_sidecar(sidecar)) > 0
        finally:
            llm.close()
    ref = runs["reference"][0]
    assert runs["resident"][0] == ref and runs["copy"][0] == ref
    resident, copy = runs["resident"][1], runs["copy"][1]
    assert copy["self_draft_source"] == "draft_copy" and resident["self_draft_source"] == "resident_clusters"
    assert copy["drafted"] > 0 and copy["accepted"] > 0 and copy["draft_copy_bytes"] > 0


def _last_logits(model, sidecar, forced_plan, copy: bool, draft: bool, hot: int = 0) -> np.ndarray:  # noqa: F811
    """The logits of the prompt's last token, evaluated alone (in draft mode or not) after the rest of
    the prompt, under a forced offload plan with `hot` clusters pinned per layer."""
    plan = make_plan(sidecar, hot, prefetch_layers=1)
    plan.draft_copy = copy
    forced_plan(plan)
    llm = llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=False, logits_all=True, **KW)
    try:
        toks = llm.tokenize(PROMPT.encode())
        llm.eval(toks[:-1])
        llm._flash.draft = draft
        llm.eval(toks[-1:])
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    finally:
        llm._flash.draft = False
        llm.close()


def test_a_draft_from_the_copy_is_close_to_the_model(pair, forced_plan):  # noqa: F811
    """The draft's logits for one token, after the same prompt: with the copy (every neuron, Q4_0 rows)
    within 15% (relative L2) of the exact logits; from the resident clusters only (none pinned, none
    cached after a dense prefill: the FFN skipped) several times further off."""
    model, sidecar = pair

    def last_logits(copy: bool, draft: bool, hot: int = 0) -> np.ndarray:
        return _last_logits(model, sidecar, forced_plan, copy, draft, hot)

    exact = last_logits(False, False)
    off = {
        name: np.linalg.norm(last_logits(copy, True) - exact) / np.linalg.norm(exact)
        for name, copy in (("copy", True), ("resident", False))
    }
    assert off["copy"] < 0.15 and off["resident"] > 3 * off["copy"], off
    # resident clusters are computed from their exact rows, only the others from the copy: with every
    # cluster pinned the draft is the model, bit for bit; with half pinned it lies between
    assert np.array_equal(last_logits(True, True, hot=6), last_logits(False, False, hot=6))
    half = np.linalg.norm(last_logits(True, True, hot=3) - exact) / np.linalg.norm(exact)
    assert 0 < half < off["copy"], (half, off)


def test_the_planner_counts_the_copy_and_explains_the_choice(pair):
    model, sidecar = pair
    info = validate_pair(model, sidecar)
    copy_bytes = planner.draft_copy_bytes(info)
    without = planner.plan_offload(model, sidecar, 4096, draft_copy=False)
    with_copy = planner.plan_offload(model, sidecar, 4096, draft_copy=True)
    assert with_copy.parts["draft_copy"] == copy_bytes and "draft_copy" not in without.parts
    # prefill numerics depend on n_ubatch: the copy (drafts only) keeps the plan's, even where a
    # smaller one would have let it fit
    tight = planner.plan_offload(model, sidecar, 200, draft_copy=False)
    assert planner.plan_offload(model, sidecar, 200, draft_copy=True).n_ubatch == tight.n_ubatch
    assert sum(with_copy.parts.values()) == with_copy.budget_bytes and with_copy.draft_copy
    margin = planner.MARGIN_FRACTION * copy_bytes  # the copy also raises the margin's proportional part
    assert abs(with_copy.minimum_bytes - (without.minimum_bytes + copy_bytes + margin)) <= 1
    auto = planner.plan_offload(model, sidecar, 4096)
    assert auto.least_budget_bytes == without.least_budget_bytes


def test_the_choice_follows_the_predicted_speed():
    """More memory as pinned clusters shortens every pass; the copy raises acceptance: the model keeps
    whichever delivers more tokens per second."""
    slow_pass = draft_plan.predict(pass_s=0.3, step_s=0.03, acceptance=0.7)
    assert slow_pass.draft > 0 and slow_pass.tok_s > 1 / 0.3
    no_draft = draft_plan.predict(pass_s=0.3, step_s=0.03, acceptance=0.0)
    assert no_draft.draft == 0 and no_draft.tok_s == pytest.approx(1 / 0.3)
    fast_pass = draft_plan.predict(pass_s=0.05, step_s=0.05, acceptance=0.3)
    assert fast_pass.draft == 0


def test_command_line_plan_and_inspect(pair):
    from click.testing import CliRunner

    from llamaflash.cli.cli import main

    model, sidecar = pair
    run = lambda *a: CliRunner().invoke(main, [str(x) for x in a])  # noqa: E731
    on = run("plan", model, "--sidecar", sidecar, "--ram-budget-mb", 4096, "--draft-copy", "on")
    assert on.exit_code == 0, on.output
    assert "draft_copy" in on.output and "low bit width" in on.output
    auto = run("plan", model, "--sidecar", sidecar, "--ram-budget-mb", 4096)
    assert auto.exit_code == 0 and "draft copy" in auto.output, auto.output
    shown = run("inspect", sidecar)
    assert shown.exit_code == 0 and "draft copy:       Q4_0" in shown.output, shown.output


def test_a_damaged_draft_copy_is_refused_at_load(pair, forced_plan, tmp_path):  # noqa: F811
    """The copy is checked row by row against the sidecar's draft checksums when it is read: a flipped
    byte in one draft row is a SidecarIntegrityError naming the tensor, before any token."""
    from llamaflash.errors import SidecarIntegrityError

    model, sidecar = pair
    damaged = tmp_path / "m.flash.gguf"
    shutil.copy(sidecar, damaged)
    lay = read_sidecar(damaged).layers[1]
    assert lay.draft_checksum_offset is not None
    with open(damaged, "r+b") as f:
        f.seek(lay.draft_down_t_offset + 5 * lay.draft_row_bytes + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    plan = make_plan(damaged, 0, prefetch_layers=1)
    plan.draft_copy = True
    forced_plan(plan)
    with pytest.raises(SidecarIntegrityError, match=f"blk.{lay.layer}.ffn_draft_down_t"):
        llamaflash.Llama(model_path=str(model), sidecar_path=str(damaged), ram_budget_mb=64, **KW)
    # `llamaflash verify` checks the copy's rows too, and names the damaged one
    from llamaflash.files.integrity import verify_files

    assert verify_files(sidecar).ok
    report = verify_files(damaged)
    assert [(m.tensor, m.row) for m in report.mismatches] == [(f"blk.{lay.layer}.ffn_draft_down_t", 5)]


def test_a_draft_takes_every_cluster_from_the_copy_when_x_serves_one_type(tiny_model_factory, tmp_path, forced_plan):  # noqa: F811
    """Q4_1 up rows dot against Q8_1 activations, the Q4_0 copy against Q8_0, and x is quantized once
    per split: a draft then computes every cluster from the copy, the resident ones too. With every
    cluster pinned the draft differs from the model (the Q8_0 fixture's draft equals it), and stays
    as close to it as a draft from the copy is."""
    model = tmp_path / "m.gguf"
    shutil.copy(tiny_model_factory(weight_type="Q4_1", n_embd=96, n_ff=192), model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    assert all(lay.up_type == int(Q.Q4_1) and lay.draft_type == int(Q.Q4_0) for lay in read_sidecar(sidecar).layers)
    exact = _last_logits(model, sidecar, forced_plan, False, False, hot=6)
    draft = _last_logits(model, sidecar, forced_plan, True, True, hot=6)
    off = np.linalg.norm(draft - exact) / np.linalg.norm(exact)
    assert 0 < off < 0.15, off
    assert np.array_equal(_last_logits(model, sidecar, forced_plan, True, False, hot=6), exact)  # exact passes exact


@pytest.mark.parametrize("spec", [False, {"self_draft": False}], ids=["speculation-off", "no-self-draft"])
def test_without_self_drafts_the_plan_is_the_one_without_speculation(pair, forced_plan, spec):
    """The draft copy serves self-drafts only: where there are none, the planner is asked for the plan
    without it (the same request as flash_draft_copy=False), and forcing the copy is refused."""
    model, sidecar = pair
    asked = []
    forced_plan(make_plan(sidecar, 3), asked)
    for kw in ({"flash_speculative": spec}, {"flash_speculative": True, "flash_draft_copy": False}):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=64, **kw, **KW).close()
    llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=True, **KW).close()
    off, copy_refused, default = asked

    def settings(request):  # the request's settings (the parsed files it also gets are the same objects' kin)
        return {k: v for k, v in request.items() if v is None or isinstance(v, (bool, int, float, str))}

    assert off["draft_copy"] is False and off.keys() == copy_refused.keys()
    assert settings(off) == settings(copy_refused) and "n_ctx" in settings(off)
    assert default["draft_copy"] is None  # with self-drafts: the planner weighs the copy
    with pytest.raises(ValueError, match="flash_draft_copy=True keeps the draft copy for speculative self-drafts"):
        llamaflash.Llama(model_path=str(model), ram_budget_mb=64, flash_speculative=spec, flash_draft_copy=True, **KW)


def test_a_verify_row_costs_a_tokens_compute_in_the_prediction():
    """Measured on Qwen2.5-Coder-1.5B under a budget (one verify row +59..66 ms, about its weights'
    compute): at 1200 MiB (165 ms pass, 120 ms self-draft step) no draft pays even at acceptance 0.9;
    at 900 MiB (427 ms I/O-bound pass) free drafts at acceptance 0.7 do."""
    assert draft_plan.predict(pass_s=0.165, step_s=0.120, acceptance=0.9, row_s=0.0625).draft == 0
    io_bound = draft_plan.predict(pass_s=0.427, step_s=0.0, acceptance=0.7, row_s=0.0625)
    assert io_bound.draft > 0 and io_bound.tok_s > 1.3 / 0.427


@pytest.mark.parametrize("copy_tok_s,chosen", [(10.5, False), (11.5, True)])
def test_the_copy_needs_a_margin_over_the_plan_without_it(pair, monkeypatch, copy_tok_s, chosen):
    """Predicted 10 tok/s without the copy (its best of drafting and not drafting): the copy must
    predict more than COPY_MARGIN above it to take the memory from the pinned clusters."""
    model, sidecar = pair
    info = validate_pair(model, sidecar)
    without = planner.plan_offload(model, sidecar, 200, draft_copy=False)
    with_copy = planner.plan_offload(model, sidecar, 200, draft_copy=True)
    predictions = {
        False: draft_plan.Prediction(0.2, 0.1, 0.01, 0, 10.0),
        True: draft_plan.Prediction(0.5, 0.1, 0.02, 2, copy_tok_s),
    }
    monkeypatch.setattr(draft_plan, "predict_plan", lambda plan, _info: predictions[bool(plan.draft_copy)])
    assert draft_plan.COPY_MARGIN == pytest.approx(0.10)
    plan = draft_plan.choose_draft_copy(info, without, with_copy)
    assert bool(plan.draft_copy) is chosen
    assert plan.draft_choice["chosen"] == ("draft_copy" if chosen else "resident_only")
