"""More memory is never predicted slower. At every budget from the planner's least budget (refused one
step below it) to past the model (the sweep's default top: the larger of 1.3 x the model file and 1.15
x what stock keeps resident), in small steps:

* the plan's predicted request (plan_search.request_key: TTFT of the stated prompt + the decode) is
  no longer than at any smaller budget (within plan_search.DECODE_TIE_SHARE: the gate placement is
  chosen by decode first); the plan's predicted decode (decode_speed's token without speculation;
  with draft_plan's best draft length over that token, the delivered speed) is at least
  DECODE_TIE_SHARE of the one at every smaller budget of the same n_ubatch (a larger n_ubatch trades
  decode for prefill where that shortens the request, and ubatch_choice says so). The I/O bound
  alone is not a decode prediction (a plan that reads costs compute too) and may fall where the
  predicted decode rises;
* its memory is accounted within the budget: the parts sum to it, none negative, the margin at least
  its formula, the compute buffers those of the plan's own n_ubatch;
* across the step aside into stock (budget_decision), the curve llamaflash follows (the offload plan's
  decode_speed token, then stock's predicted in-memory rate) does not fall, and a larger budget never returns
  from stock to offload;
* ubatch_choice lists every n_ubatch that fits, the plan's the one of the shortest request, and
  where it is not the smallest, the plan's notes say what the smallest would predict.

Pairs: the synthetic ones of planner_cases (tiny models from the conftest factory, hand-set frequencies,
one with a draft copy and hot-first bundles) and SmolLM2-135M with its sidecar converted fresh
(conftest.smollm2_sidecar)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from planner_cases import make_pair

from llamaflash.errors import RamBudgetError
from llamaflash.files.gguf_model import read_base_model
from llamaflash.files.sidecar import validate_pair
from llamaflash.planning import budget_decision, decode_speed, draft_plan
from llamaflash.planning.plan_budget import DECODE_ROWS
from llamaflash.planning.plan_search import DECODE_TIE_SHARE
from llamaflash.planning.planner import MARGIN_FIXED_BYTES, MARGIN_FRACTION, MiB, llama_share, plan_offload

#: The sweep's default top (bench/lab/sweep.py: TOP_MODEL_RATIO, TOP_STOCK_NEED_RATIO).
TOP_MODEL_RATIO, TOP_STOCK_NEED_RATIO = 1.3, 1.15
METRICS = ("nospec", "spec")


def predictions(plan, info, active: float) -> dict[str, float]:
    """The plan's predicted decode tok/s as the sweep predicts it: ``io_bound`` (inf: nothing read from
    flash), ``nospec`` (decode_speed.plan_token_time), ``spec`` (draft_plan's best draft length over that
    pass and decode_speed's draft step; without speculation where the gate is streamed, a self-draft needs it resident, or nothing is
    read)."""
    nospec = decode_speed.plan_token_time(plan, info, active=active).tok_s
    pred = draft_plan.predict_plan(plan, info)
    if pred is None:
        return {"io_bound": math.inf, "nospec": nospec, "spec": nospec}
    step = decode_speed.draft_step_seconds(plan, info, active=active)
    spec = nospec if plan.stream_gate else draft_plan.predict(1.0 / nospec, step, pred.acceptance).tok_s
    return {"io_bound": plan.io_bound_tok_s, "nospec": nospec, "spec": spec}


def check_accounting(plan, header, info, n_ctx: int) -> None:
    parts = plan.parts
    assert sum(parts.values()) == plan.budget_bytes and all(v >= 0 for v in parts.values()), parts
    rest = sum(parts.values()) - parts["margin"] - parts["hot_slots"]
    assert parts["margin"] >= MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * rest)
    # prompt and decode take turns: a decode batch's compute pages, the prompt batch's extra in the
    # cold slots' and verify buffers' memory, what exceeds them its own part (plan_budget)
    decode = llama_share(header, info, n_ctx, min(plan.n_ubatch, DECODE_ROWS), flash_attn=plan.flash_attn)
    full = llama_share(header, info, n_ctx, plan.n_ubatch, flash_attn=plan.flash_attn)
    assert parts["compute_buffers"] == decode["compute_buffers"]
    extra = full["compute_buffers"] - decode["compute_buffers"]
    assert parts.get("prompt_buffers", 0) == max(0, extra - parts["cold_slots"] - parts["verify_buffers"])
    assert plan.n_batch == plan.n_ubatch


def check_ubatch_trade(plan) -> None:
    choice = plan.ubatch_choice
    assert choice["n_ubatch"] == plan.n_ubatch and choice["hot_slots"] == plan.hot_slots
    assert plan.prefill["n_ubatch"] == plan.n_ubatch and plan.prefill["ttft_s"] == choice["ttft_s"]
    fits = [a for a in choice["alternatives"] if a.get("hot_slots") is not None]
    assert plan.n_ubatch in [a["n_ubatch"] for a in fits]
    assert choice["request_s"] <= min(a["request_s"] for a in fits) * (1 + 1e-9)
    smallest = min(fits, key=lambda a: a["n_ubatch"])
    if smallest["n_ubatch"] < plan.n_ubatch:
        assert any(f"n_ubatch {plan.n_ubatch}, not {smallest['n_ubatch']}" in n for n in plan.notes)


def sweep_budgets(model: Path, sidecar: Path, step_mb: float, n_ctx: int = 512, **plan_kw) -> list[dict]:
    """Every budget from the least to the top in ``step_mb`` steps: the plan's checks, and per budget
    its predictions, lane and the curve value llamaflash follows."""
    base = read_base_model(model)
    info = validate_pair(model, sidecar, model=base)
    kw = dict(n_ctx=n_ctx, info=info, header=base.header, **plan_kw)
    active = decode_speed.active_fraction(info)
    least = plan_offload(model, sidecar, 1 << 20, **kw).least_budget_bytes / MiB
    with pytest.raises(RamBudgetError, match=f"minimum of {math.ceil(least)} MiB"):
        plan_offload(model, sidecar, least - 0.5, **kw)
    # the mapped need: read into memory, this small synthetic model runs stock at every budget an
    # offload plan allows (no crossing to test), as test_small_models_run_stock_read_into_memory shows
    stock_mb = budget_decision.decide(base.header, info, 1 << 20, n_ctx, use_mmap=True).stock_need_bytes / MiB
    top = max(TOP_MODEL_RATIO * model.stat().st_size / MiB, TOP_STOCK_NEED_RATIO * stock_mb)
    rows = []
    for i in range(int((top - least) / step_mb) + 2):
        budget = least + i * step_mb
        plan = plan_offload(model, sidecar, budget, **kw)
        check_accounting(plan, base.header, info, n_ctx)
        check_ubatch_trade(plan)
        d = budget_decision.decide(base.header, info, budget, n_ctx, use_mmap=True)
        pred = predictions(plan, info, active)
        rows.append(
            {
                "budget_mb": budget,
                "plan": plan,
                "lane": d.lane,
                **pred,
                "curve": budget_decision.stock_decode_tok_s(d) if d.stock else pred["nospec"],
                "request_s": plan.ubatch_choice["request_s"],
            }
        )
    assert rows[-1]["budget_mb"] >= top
    return rows


def assert_non_decreasing(rows: list[dict], key: str) -> None:
    """``key`` never falls below DECODE_TIE_SHARE of its best at a smaller budget of the same n_ubatch
    (offload rows) or of the stock lane (stock rows)."""
    best: dict = {}
    for r in rows:
        group = "stock" if r["lane"] == budget_decision.STOCK else r["plan"].n_ubatch
        b = best.get(group)
        if b is not None:
            assert r[key] >= DECODE_TIE_SHARE * b[key], (
                f"{key}: {r[key]} at {r['budget_mb']:.2f} MiB < {b[key]} at {b['budget_mb']:.2f} MiB "
                f"(n_ubatch {r['plan'].n_ubatch})"
            )
        if b is None or r[key] > b[key]:
            best[group] = r


def assert_request_non_increasing(rows: list[dict]) -> None:
    """The predicted request of the offload plans never rises above its best at a smaller budget by
    more than the DECODE_TIE_SHARE share."""
    best = None
    for r in rows:
        if r["lane"] == budget_decision.STOCK:
            continue
        if best is not None:
            assert DECODE_TIE_SHARE * r["request_s"] <= best["request_s"], (
                f"request: {r['request_s']} s at {r['budget_mb']:.2f} MiB > {best['request_s']} s at "
                f"{best['budget_mb']:.2f} MiB"
            )
        if best is None or r["request_s"] < best["request_s"]:
            best = r


def assert_monotone_curve(rows: list[dict]) -> None:
    for key in METRICS + ("curve",):
        assert_non_decreasing(rows, key)
    assert_request_non_increasing(rows)
    lanes = [r["lane"] for r in rows]
    assert lanes == sorted(lanes, key=lambda lane: lane == budget_decision.STOCK)  # offload, then stock
    assert lanes[0] == budget_decision.OFFLOAD and lanes[-1] == budget_decision.STOCK
    # stock's predicted rate is above the offload plan's wherever stock runs (it reads its FFN from memory)
    assert all(
        r["curve"] >= r["nospec"] or r["plan"].io_bound_tok_s is None
        for r in rows
        if r["lane"] == budget_decision.STOCK
    )


@pytest.mark.parametrize(
    "name, step_mb, draft_copy",
    [("base-order", 1.0, None), ("hot-order-draft", 2.0, None), ("hot-order-draft", 2.0, False)],
)
def test_synthetic_pair_is_never_predicted_slower_with_more_memory(
    name, step_mb, draft_copy, tiny_model_factory, tmp_path
):
    model, sidecar = make_pair(name, tiny_model_factory, tmp_path)
    rows = sweep_budgets(model, sidecar, step_mb, draft_copy=draft_copy)
    assert_monotone_curve(rows)
    assert any(r["plan"].stream_gate for r in rows) and not rows[-1]["plan"].stream_gate
    assert rows[-1]["plan"].io_bound_tok_s is None and rows[-1]["plan"].n_ubatch == 512  # everything pinned


def test_smollm2_is_never_predicted_slower_with_more_memory(smollm2_sidecar):
    model, sidecar = smollm2_sidecar
    rows = sweep_budgets(model, sidecar, 4.0)
    assert_monotone_curve(rows)
    # n_ctx 1024: a larger budget never predicts a longer request, and the plan says what each n_ubatch
    # would predict
    at = {b: plan_offload(model, sidecar, b, n_ctx=1024) for b in (299, 303)}
    assert at[303].ubatch_choice["request_s"] <= at[299].ubatch_choice["request_s"]
    assert len(at[303].ubatch_choice["alternatives"]) == 5


def test_small_models_run_stock_read_into_memory(tiny_model_factory, tmp_path):
    """Read into memory, a model of a few MiB needs less than any offload plan: every budget an
    offload plan allows runs stock, with use_mmap=False."""
    model, sidecar = make_pair("base-order", tiny_model_factory, tmp_path)
    base = read_base_model(model)
    info = validate_pair(model, sidecar, model=base)
    least = plan_offload(model, sidecar, 1 << 20, n_ctx=512, info=info, header=base.header).least_budget_bytes / MiB
    d = budget_decision.decide(base.header, info, least, 512)
    assert d.stock and not d.use_mmap and d.stock_need_bytes / MiB <= least
