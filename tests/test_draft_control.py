"""The speculative draft controller (plugin/runtime/draft_control.py) on simulated passes: fake costs and a
seeded acceptance process, no model and no clock, so every decision here is deterministic.

What is asserted, against the time the same tokens take without drafts (every token one pass of
verify(1)): a source whose drafts do not pay is switched off and costs at most explore_share of the
decode time plus one pass; a source that pays is used and speeds decoding up; a source that starts to
predict later is found again by its probes; the reasons say which case holds. (With real timings the
decisions, and with them the speed, vary between runs; the tokens do not, see test_speculative.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest

from llamaflash.runtime import draft_control as dc
from llamaflash.runtime import speculative


def verify_time(pass_s: float, per_token_s: float):
    return lambda n: pass_s + per_token_s * (n - 1)


def simulate(ctl: dc.DraftController, name: str, passes: int, verify, step_s: float, acceptance, seed: int = 0):
    """Runs `passes` passes of one source; acceptance(i) is the per-token acceptance at pass i.
    Returns (seconds, delivered tokens, drafted tokens, probes)."""
    rng = random.Random(seed)
    seconds, delivered, drafted, probes = 0.0, 0, 0, 0
    for i in range(passes):
        d = ctl.choose(name)
        accepted = 0
        while accepted < d.k and rng.random() < acceptance(i):
            accepted += 1
        v = verify(1 + d.k)
        draft_s = d.k * step_s
        ctl.record_pass(1 + d.k, v)
        if d.k:
            ctl.settle(name, d.k, accepted, draft_s, v, d.probe)
        seconds += v + draft_s
        delivered += 1 + accepted
        drafted += d.k
        probes += d.probe
    return seconds, delivered, drafted, probes


def test_no_draft_before_a_pass_is_measured():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.9)
    assert ctl.choose("s").k == 0
    assert "no pass measured" in ctl.sources["s"].reason


@pytest.mark.parametrize(
    "pass_s,per_token_s,step_s,acceptance",
    [
        (0.270, 0.005, 0.040, 0.08),  # I/O-bound pass, a self-draft over few resident clusters
        (0.090, 0.012, 0.045, 0.30),  # short pass (most of the model pinned): a step costs half a pass
        (0.050, 0.020, 0.000, 0.02),  # compute-bound pass, prompt lookup that never predicts
    ],
)
def test_a_source_that_does_not_pay_costs_at_most_the_exploration_share(pass_s, per_token_s, step_s, acceptance):
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.6, step_s)  # an optimistic prior: the controller must find out itself
    verify = verify_time(pass_s, per_token_s)
    seconds, delivered, drafted, probes = simulate(ctl, "s", 3000, verify, step_s, lambda i: acceptance)
    without = delivered * verify(1)
    assert seconds <= without * (1 + ctl.explore_share) + verify(6) + 6 * step_s
    src = ctl.sources["s"]
    assert src.state == "off" and src.reason.startswith("off:")
    assert probes < 40  # probes back off: rare after the first rejections


def test_a_source_that_pays_is_used():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.1)  # a pessimistic prior: probes must find it
    verify = verify_time(0.270, 0.005)
    seconds, delivered, drafted, _ = simulate(ctl, "s", 400, verify, 0.0, lambda i: 0.7)
    assert delivered * verify(1) / seconds > 2.0  # > 2x the rate without drafts
    src = ctl.sources["s"]
    assert src.state == "on" and src.reason.startswith("on:") and src.last_k >= 3
    assert src.net_saving_seconds > 0


def test_a_source_that_starts_to_predict_is_found_again():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.3)
    verify = verify_time(0.270, 0.005)
    simulate(ctl, "s", 2000, verify, 0.0, lambda i: 0.0)
    assert ctl.sources["s"].state == "off"
    assert ctl.sources["s"].backoff == dc.PROBE_MAX_BACKOFF
    seconds, delivered, _, _ = simulate(ctl, "s", 2000, verify, 0.0, lambda i: 0.8, seed=1)
    assert ctl.sources["s"].state == "on"
    assert delivered * verify(1) / seconds > 2.0  # found within one probe interval, then used


def test_a_ledger_in_deficit_stops_every_source():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("a", 0.9)
    ctl.add_source("b", 0.9)
    for _ in range(10):
        ctl.record_pass(1, 0.1)
    assert ctl.choose("a").k > 0
    ctl.record_pass(7, 0.2)
    ctl.settle("a", 6, 0, 5.0, 0.2)  # a draft that took 5 s and was rejected
    assert ctl.allowance() < 0
    for name in ("a", "b"):
        assert ctl.choose(name).k == 0
        assert "more than the 1% allowed" in ctl.sources[name].reason


def test_a_source_whose_passes_lose_is_off_whatever_it_predicts():
    ctl = dc.DraftController(6, 0.5)  # a large allowance: the source's own record decides
    ctl.add_source("s", 0.9)
    for _ in range(4):
        ctl.record_pass(1, 0.1)
    for _ in range(dc.RECENT_PASSES):
        ctl.record_pass(2, 0.1)
        ctl.settle("s", 1, 1, 0.0, 0.5)  # accepted, but the pass took 5x what the line says
    assert ctl.sources["s"].losing()
    assert ctl.choose("s").k == 0 or ctl.choose("s").probe
    assert "lost" in ctl.sources["s"].reason


def test_disabled_source_says_why():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.9)
    ctl.disable("s", "off: the gate is streamed")
    ctl.record_pass(1, 0.1)
    assert ctl.choose("s").k == 0
    assert ctl.summary()["sources"]["s"] == {
        **ctl.sources["s"].status(),
        "state": "disabled",
        "reason": "off: the gate is streamed",
    }


def test_pass_cost_line_and_single_size_prior():
    cost = dc.PassCost()
    cost.record(1, 0.2)
    assert cost.seconds(1) == pytest.approx(0.2)
    assert cost.seconds(3) == pytest.approx(0.2 * (1 + 2 * dc.PRIOR_VERIFY_SLOPE))
    cost.record(3, 0.26)
    assert cost.seconds(2) == pytest.approx(0.23)
    cost.record(2, 0.1)  # a line with a negative slope is clamped flat
    assert cost.seconds(7) >= cost.seconds(1) - 1e-12


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_speculator_books_each_draft_with_its_verify_pass():
    """The Speculator's bookkeeping without a model: prompt lookup proposes, a simulated verify
    pass of 1 + k tokens follows, the next call settles it against that pass's time."""
    clock = FakeClock()
    spec = speculative.Speculator(speculative.SpeculativeSettings(self_draft=False), clock=clock)
    n_past = [0]
    spec.bind(lambda: n_past[0])
    text = np.array([5, 6, 7, 8, 9] * 4, dtype=np.intc)  # repetitive: 3-gram lookups predict
    n_past[0] = 12
    for step in range(30):
        context = np.resize(text, n_past[0] + 1)
        draft = spec(context)
        truth = np.resize(text, n_past[0] + 1 + len(draft) + 1)[n_past[0] + 1 :]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[accepted]:
            accepted += 1
        clock.t += 0.27 + 0.005 * len(draft)
        spec.record_verify(1 + len(draft), 0.27 + 0.005 * len(draft))
        n_past[0] += 1 + accepted
    s = spec.summary()
    src = s["control"]["sources"]["prompt_lookup:3"]
    assert src["passes"] > 0 and src["accepted"] == src["drafted"]
    assert src["state"] == "on" and s["why"]["prompt_lookup:3"].startswith("on:")
    assert s["tokens_per_pass"] > 3
    assert s["why"]["self_draft"].startswith("off: flash_speculative self_draft=False")
    assert s["why"]["user"] == "off: no draft_model given"
