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


def test_no_draft_before_the_pass_without_drafts_is_measured():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.9)
    for _ in range(dc.BASELINE_SAMPLES):
        assert ctl.choose("s").k == 0
        assert "measuring the pass without drafts first" in ctl.sources["s"].reason
        ctl.record_pass(1, 0.1)
    assert ctl.choose("s").k > 0


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


def test_pass_cost_by_size():
    cost = dc.PassCost()
    cost.record(3, 0.26)
    assert not cost.known() and cost.seconds(1) == 0.0  # no baseline from a batch
    cost.record(1, 0.2)
    assert cost.seconds(1) == pytest.approx(0.2)
    assert cost.seconds(3) == pytest.approx(0.26)  # measured
    # one batch size measured: the prior slope from it
    assert cost.seconds(4) == pytest.approx(0.26 + 0.2 * dc.PRIOR_VERIFY_SLOPE)
    cost.record(5, 0.30)
    assert cost.seconds(4) == pytest.approx(0.28)  # the line through the sizes >= 2
    cost.record(2, 0.1)  # never below the 1-token pass
    assert cost.seconds(2) == pytest.approx(0.2)
    fresh = dc.PassCost()
    fresh.record(1, 0.2)
    assert fresh.seconds(3) == pytest.approx(0.2 * (1 + 2 * dc.PRIOR_VERIFY_SLOPE))


def compute_bound_verify(n: int) -> float:
    """A verify pass on a compute-bound plan (Qwen2.5-Coder-1.5B at 1200 MiB, measured): 165 ms alone,
    a second row about doubles it, each further row +66 ms (the sparse lane computes every row)."""
    return 0.165 if n == 1 else 0.335 + 0.066 * (n - 2)


def test_the_baseline_is_the_measured_one_token_pass_not_a_lines_intercept():
    """The failure measured at 1200 MiB: a line through the sizes 1..7 put verify(1) at 271 ms (the
    real 1-token pass: 165 ms), so a self-draft with acceptance 0.9 and 120 ms steps booked savings
    while decoding at 0.78x. Its passes must be booked against the measured 1-token pass."""
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("self_draft", 0.76, 0.059)  # the plan's optimistic priors
    seconds, delivered, drafted, probes = simulate(ctl, "self_draft", 2000, compute_bound_verify, 0.120, lambda i: 0.9)
    assert ctl.cost.seconds(1) == pytest.approx(0.165)
    without = delivered * compute_bound_verify(1)
    assert seconds <= without * (1 + ctl.explore_share) + compute_bound_verify(7) + 6 * 0.120
    src = ctl.sources["self_draft"]
    assert src.state == "off" and src.reason.startswith("off:")
    assert src.passes - src.probes <= 3  # switched off after its first measured passes
    assert src.net_saving_seconds < 0  # the ledger sees the loss


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.6, 0.9])
def test_free_drafts_on_a_compute_bound_pass_cost_at_most_the_exploration_share(acceptance):
    """Prompt lookup (no draft cost) where a verify row costs a token's compute: whatever its
    acceptance, speculation delivers at least 1 / (1 + explore_share) of the rate without it."""
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("lookup", 0.4)
    seconds, delivered, _, _ = simulate(ctl, "lookup", 2000, compute_bound_verify, 0.0, lambda i: acceptance, seed=3)
    without = delivered * compute_bound_verify(1)
    assert seconds <= without * (1 + ctl.explore_share) + compute_bound_verify(7)


def test_a_pass_that_does_not_continue_decoding_is_time_not_cost():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.9)
    ctl.record_pass(1, 5.0, steady=False)  # the first pass after a prefill
    assert not ctl.cost.known() and ctl.elapsed_seconds == pytest.approx(5.0)
    assert ctl.summary()["unsteady_passes"] == 1


def test_the_baseline_is_remeasured_while_a_source_drafts_every_pass():
    """A source that pays drafts every pass, so the 1-token pass is forced once every
    BASELINE_REFRESH_PASSES passes; when the pass without drafts becomes cheaper (the draft stops
    paying), the source goes off."""
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.8)
    io_bound = verify_time(0.400, 0.010)
    passes = 20 * dc.BASELINE_REFRESH_PASSES
    seconds, delivered, _, _ = simulate(ctl, "s", passes, io_bound, 0.0, lambda i: 0.8)
    assert ctl.sources["s"].state == "on" and delivered * io_bound(1) / seconds > 2.0
    forced = ctl.baseline_passes
    assert dc.BASELINE_SAMPLES <= forced <= dc.BASELINE_SAMPLES + passes // dc.BASELINE_REFRESH_PASSES + 1
    # the costs change (e.g. the cache warms up): a pass alone costs a fifth, each verify row a
    # token's compute, so drafts no longer pay; the ledger cannot see it until verify(1) is measured
    # again, which happens within BASELINE_REFRESH_PASSES, then every BASELINE_MIN_REFRESH passes
    cheap = lambda n: 0.080 * n  # noqa: E731
    simulate(ctl, "s", 2 * dc.BASELINE_REFRESH_PASSES, cheap, 0.0, lambda i: 0.8, seed=1)
    assert ctl.cost.seconds(1) == pytest.approx(0.080, rel=0.05)
    assert ctl.sources["s"].state == "off" and ctl.sources["s"].reason.startswith("off:")
    seconds, delivered, _, _ = simulate(ctl, "s", 600, cheap, 0.0, lambda i: 0.8, seed=2)
    assert seconds <= delivered * cheap(1) * (1 + ctl.explore_share) + cheap(7)


def test_a_batch_faster_than_the_baseline_remeasures_it_at_once():
    ctl = dc.DraftController(6, 0.01)
    ctl.add_source("s", 0.8)
    for _ in range(dc.BASELINE_SAMPLES):
        ctl.record_pass(1, 0.4)
    assert ctl.choose("s").k > 0
    ctl.record_pass(3, 0.2)  # cheaper than one token alone was: the baseline is stale
    assert ctl.choose("s").k == 0 and ctl.baseline_passes == 1


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


def test_speculator_learns_costs_only_from_passes_that_continue_decoding():
    """The first pass after a prefill (its position does not continue the previous pass) is decode
    time, not a cost: a slow one must not raise the baseline that savings are booked against."""
    spec = speculative.Speculator(speculative.SpeculativeSettings(self_draft=False), clock=FakeClock())
    spec.record_verify(1, 9.0, n_past=40)  # after a prefill of 40 tokens
    spec.record_verify(1, 0.2, n_past=41)
    spec.record_verify(3, 0.3, n_past=42)  # two drafts verified
    spec.record_verify(1, 0.2, n_past=44)  # both accepted: the next pass at 42 + 1 + 2
    spec.record_verify(1, 7.0, n_past=10)  # a new prompt
    c = spec.control
    assert c.unsteady_passes == 2 and c.cost.samples(1) == 2 and c.cost.samples(3) == 1
    assert c.cost.seconds(1) == pytest.approx(0.2)
    assert c.elapsed_seconds == pytest.approx(16.7)
