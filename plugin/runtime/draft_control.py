"""How many tokens each draft source proposes per verify pass: decided from measured costs and
measured acceptance, so that speculative decoding does not deliver slower than decoding without it.

Measured, in seconds of the caller's clock:
  verify(1)   one pass over the pending token alone, as decoding without drafts runs it: the
              recency-weighted mean of the 1-token passes measured (:class:`PassCost`), never a value
              extrapolated from larger batches (a verify row costs up to a token's compute: on a
              compute-bound pass verify(2) is close to 2·verify(1), so a line through sizes 1..7 puts
              its intercept far above the real 1-token pass and every draft would look like a saving);
  verify(n)   a pass over n >= 2 tokens (the pending token and n - 1 drafts): the mean measured at n,
              else a line through the sizes >= 2 measured, else verify(1)·(1 + PRIOR_VERIFY_SLOPE·(n - 1));
              never less than verify(1);
  step        one drafted token of a source (a self-draft evaluates the model; prompt lookup ≈ 0);
  a           the source's acceptance: drafted tokens accepted / drafted, recency-weighted, from a prior.
Only steady decode passes are measured: a pass that does not continue the previous one (the first
after a prompt's prefill, a new generate call) is counted as decode time but not as a cost.

A pass that drafts k tokens delivers E(k) = (1 − a^(k+1)) / (1 − a) tokens in
T(k) = verify(1 + k) + k·step; without a draft a token costs verify(1). Per source and pass
(:meth:`DraftController.choose`):

  off    until BASELINE_SAMPLES 1-token passes are measured (the baseline every saving is booked
         against), and for one pass whenever BASELINE_REFRESH_PASSES passes went by without a 1-token
         pass (the baseline stays current while a source drafts every pass: at most one pass in
         BASELINE_REFRESH_PASSES forgoes its draft);
  on     the best k in 1..k_max predicts E(k)/T(k) ≥ (1 + ON_MARGIN) / verify(1), the source's recent
         passes did not lose time (below), and the loss ledger is not in deficit: draft that k;
  off    otherwise no draft, except a one-token *probe* once the source's probe interval has passed
         and the ledger can pay for it. The interval doubles after every rejected probe
         (PROBE_MIN_INTERVAL .. PROBE_MAX_INTERVAL passes) and returns to the minimum after an
         accepted one, so a source that starts to predict (the text turns repetitive) is seen again.

The loss ledger. Every settled pass with a draft books its realized saving against decoding without
one, (1 + accepted)·verify(1) − (its verify seconds + its draft seconds), per source and in total. A
source whose recent passes (about RECENT_PASSES of them) lost time on average is off whatever its
prediction says (the prediction's model missed a cost), and no source drafts while the total is below
−explore_share × (all decode seconds so far). By its own measurements, speculation therefore costs at
most explore_share of the decode time plus one pass against decoding without drafts.

Timing: the decisions depend on measured seconds, so how many tokens a pass drafts (and with it the
speed) varies between runs and machines. The tokens do not: every delivered token is the target
model's token at its position whatever was drafted (speculative.py, "Exactness").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

#: A source drafts only when its best draft length predicts at least this much more than no draft.
ON_MARGIN = 0.01
#: Passes between probes of a source that is off: the probe's predicted cost over explore_share of a
#: pass (so probing alone spends about explore_share of the time), at least PROBE_MIN_INTERVAL, times a
#: backoff that doubles after each rejected probe (up to PROBE_MAX_BACKOFF) and is 1 after an accepted one.
PROBE_MIN_INTERVAL = 2
PROBE_MAX_BACKOFF = 8
PROBE_MAX_INTERVAL = 1024
#: Recency of the acceptance estimate (per settled pass) and its prior's weight in drafted tokens.
ACCEPT_DECAY = 0.97
PRIOR_TOKENS = 2.0
#: Recency of a source's realized saving (per pass: about 1 / (1 - RECENT_DECAY) passes), and how many
#: passes it needs before a loss switches the source off.
RECENT_DECAY = 0.95
RECENT_PASSES = 8
#: verify(n) for a size >= 2 not measured and no other size >= 2 measured: verify(1) · (1 + this · (n - 1)).
#: (Measured on Qwen2.5-Coder-1.5B under a budget: +59 ms per verify row on a 427 ms I/O-bound pass,
#: +66 ms on a ~165 ms compute-bound one, i.e. 0.14 .. 0.4 of a pass.)
PRIOR_VERIFY_SLOPE = 0.25
#: Recency of the mean time per batch size (per observation of that size); the 1-token pass, measured
#: rarely while sources draft (every BASELINE_REFRESH_PASSES passes), follows faster.
COST_DECAY = 0.95
BASELINE_DECAY = 0.75
#: 1-token passes measured before any source drafts, and the most passes between two of them while
#: sources draft (a pass without drafts is forced then, so the baseline stays current).
BASELINE_SAMPLES = 2
BASELINE_REFRESH_PASSES = 32
#: A 1-token pass that differs from the baseline by more than this share (the costs drift: the cache
#: warms, the context grows, the machine's load changes), or a batch measured faster than the baseline,
#: brings the next re-measurement forward to BASELINE_MIN_REFRESH passes; the interval then doubles back
#: to BASELINE_REFRESH_PASSES while the samples agree.
BASELINE_TOLERANCE = 0.15
BASELINE_MIN_REFRESH = 4


#: The reason of a source no pass has asked about yet.
NOT_CONSULTED = "off: not consulted yet (no draft of this source was possible so far)"


class PassCost:
    """Seconds of a verify pass by its batch size n (see the module docstring): verify(1) is the
    measured 1-token mean only; n >= 2 the mean measured at n, else a least-squares line through the
    means of the sizes >= 2 measured (slope clamped at >= 0), else verify(1)'s prior slope; never below
    verify(1)."""

    def __init__(self) -> None:
        self._by_size: Dict[int, list] = {}  # n -> [weighted sum of seconds, weight, count]
        self._line: Optional[tuple] = None  # (v0, v1) through the sizes >= 2, fitted on demand

    def record(self, n: int, seconds: float) -> None:
        s = self._by_size.setdefault(int(n), [0.0, 0.0, 0])
        decay = BASELINE_DECAY if int(n) == 1 else COST_DECAY
        s[0] = s[0] * decay + float(seconds)
        s[1] = s[1] * decay + 1.0
        s[2] += 1
        self._line = None

    def samples(self, n: int) -> int:
        """How many passes of ``n`` tokens were measured."""
        return self._by_size.get(int(n), [0.0, 0.0, 0])[2]

    def known(self) -> bool:
        """Whether the 1-token pass (the baseline) has been measured."""
        return self.samples(1) > 0

    def mean(self, n: int) -> Optional[float]:
        """The recency-weighted mean seconds of the passes of ``n`` tokens, None if none was measured."""
        s = self._by_size.get(int(n))
        return s[0] / s[1] if s else None

    def seconds(self, n: int) -> float:
        """verify(n); 0.0 while no 1-token pass is measured."""
        base = self.mean(1)
        if base is None:
            return 0.0
        n = int(n)
        if n <= 1:
            return float(max(base, 1e-6))
        measured = self.mean(n)
        if measured is None:
            if self._line is None:
                self._line = self._fit()
            if self._line is not None:
                v0, v1 = self._line
                measured = v0 + v1 * n
            else:
                measured = base * (1 + PRIOR_VERIFY_SLOPE * (n - 1))
        return float(max(measured, base, 1e-6))

    def _fit(self) -> Optional[tuple]:
        points = [(size, s[0] / s[1]) for size, s in self._by_size.items() if size >= 2]
        base = self.mean(1)
        if not points or base is None:
            return None
        if len(points) == 1:  # one batch size measured: the prior slope from it
            size, t = points[0]
            v1 = base * PRIOR_VERIFY_SLOPE
            return t - v1 * size, v1
        xs = np.array([p[0] for p in points], dtype=float)
        ys = np.array([p[1] for p in points], dtype=float)
        v1, v0 = np.polyfit(xs, ys, 1)
        if v1 <= 0:
            return float(ys.mean()), 0.0
        return float(v0), float(v1)


def delivered(acceptance: float, k: int) -> float:
    """E(k): expected tokens a pass delivers when it drafts k tokens accepted with probability a each."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class Decision:
    """What :meth:`DraftController.choose` decided for one source and pass: draft ``k`` tokens
    (0: none), ``probe`` when it is a probe of a source that is off."""

    k: int
    probe: bool = False


class SourceControl:
    """One draft source's estimates, ledger and state (see the module docstring)."""

    def __init__(
        self, name: str, k_max: int, prior_acceptance: float, prior_step_seconds: float = 0.0, note: str = ""
    ) -> None:
        self.name, self.k_max, self.note = name, k_max, note
        self.accept_num, self.accept_den = prior_acceptance * PRIOR_TOKENS, PRIOR_TOKENS
        self.step_seconds = float(prior_step_seconds)
        self.step_measured = False
        self.recent_saving, self.recent_weight = 0.0, 0.0
        self.net_saving_seconds = 0.0
        self.passes = self.drafted = self.accepted = self.probes = 0
        self.backoff = 1
        self.next_probe = 0  # pass index from which a probe is allowed
        self.disabled: Optional[str] = None
        self.state, self.reason = "off", NOT_CONSULTED
        self.last_k = 0

    @property
    def acceptance(self) -> float:
        return self.accept_num / self.accept_den

    def best(self, cost: PassCost) -> tuple:
        """(k, predicted rate at k / rate without a draft): the best k in 0..k_max."""
        base = cost.seconds(1)
        best_k, best_rate = 0, 1.0 / base
        for k in range(1, self.k_max + 1):
            rate = delivered(self.acceptance, k) / (cost.seconds(1 + k) + k * self.step_seconds)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate * base

    def losing(self) -> bool:
        """Whether its recent passes lost time on average (once it has at least RECENT_PASSES passes)."""
        return self.passes >= RECENT_PASSES and self.recent_saving < 0

    def probe_cost(self, cost: PassCost) -> float:
        """Predicted extra seconds of a one-token probe that is rejected."""
        return cost.seconds(2) - cost.seconds(1) + self.step_seconds

    def probe_interval(self, cost: PassCost, explore_share: float) -> int:
        """Passes from one probe to the next (see PROBE_MIN_INTERVAL)."""
        if explore_share <= 0:
            return PROBE_MAX_INTERVAL
        base = max(PROBE_MIN_INTERVAL, math.ceil(self.probe_cost(cost) / (explore_share * cost.seconds(1))))
        return min(base * self.backoff, PROBE_MAX_INTERVAL)

    def record(self, drafted: int, accepted: int, draft_seconds: float, saving: Optional[float]) -> None:
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_num = self.accept_num * ACCEPT_DECAY + accepted
        self.accept_den = self.accept_den * ACCEPT_DECAY + drafted
        if drafted and draft_seconds > 0:
            step = draft_seconds / drafted
            self.step_seconds = step if not self.step_measured else 0.8 * self.step_seconds + 0.2 * step
            self.step_measured = True
        if saving is not None:
            self.net_saving_seconds += saving
            self.recent_saving = self.recent_saving * RECENT_DECAY + saving
            self.recent_weight = self.recent_weight * RECENT_DECAY + 1.0

    def status(self) -> Dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason + (f" [{self.note}]" if self.note else ""),
            "acceptance_estimate": round(self.acceptance, 4),
            "passes": self.passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "probes": self.probes,
            "draft_step_seconds": self.step_seconds,
            "net_saving_seconds": self.net_saving_seconds,
            "next_k": self.last_k,
        }


class DraftController:
    """Per-source draft lengths for one speculator (see the module docstring). The caller reports
    every verify pass (:meth:`record_pass`), asks :meth:`choose` before drafting from a source, and
    books what became of the draft (:meth:`settle`)."""

    def __init__(self, k_max: int, explore_share: float) -> None:
        self.k_max, self.explore_share = k_max, explore_share
        self.cost = PassCost()
        self.sources: Dict[str, SourceControl] = {}
        self.passes = 0
        self.elapsed_seconds = 0.0  # every verify pass and every draft
        self.ledger_seconds = 0.0  # realized saving of all drafts against no drafts
        self.last_plain_pass = 0  # self.passes at the latest measured 1-token pass
        self.baseline_passes = 0  # passes without drafts forced to measure verify(1)
        self.unsteady_passes = 0  # passes counted as time but not as costs (see record_pass)
        self.refresh_interval = BASELINE_REFRESH_PASSES  # passes from one forced 1-token pass to the next
        self._forced_at = -1  # self.passes when the coming pass was last forced to go without drafts

    def add_source(
        self, name: str, prior_acceptance: float, prior_step_seconds: float = 0.0, note: str = ""
    ) -> SourceControl:
        """A draft source; ``note`` (e.g. where its prior came from) is appended to its reasons."""
        src = SourceControl(name, self.k_max, prior_acceptance, prior_step_seconds, note)
        self.sources[name] = src
        return src

    def disable(self, name: str, reason: str) -> None:
        src = self.sources[name]
        src.disabled, src.state, src.reason = reason, "disabled", reason

    def record_pass(self, n_tokens: int, seconds: float, steady: bool = True) -> None:
        """A verify pass of ``n_tokens`` tokens took ``seconds``. ``steady``: it continued the previous
        pass (a decode step); otherwise (the first pass after a prefill or a new prompt) it counts as
        decode time but not as a measured cost."""
        self.passes += 1
        self.elapsed_seconds += seconds
        if not steady:
            self.unsteady_passes += 1
            return
        base = self.cost.mean(1)
        self.cost.record(n_tokens, seconds)
        if n_tokens == 1:
            self.last_plain_pass = self.passes
            drifted = base is not None and abs(seconds - base) > BASELINE_TOLERANCE * base
            self.refresh_interval = (
                BASELINE_MIN_REFRESH if drifted else min(2 * self.refresh_interval, BASELINE_REFRESH_PASSES)
            )
        elif base is not None and seconds < base:  # a batch cannot cost less than its first token alone
            self.refresh_interval = min(self.refresh_interval, max(0, self.passes - self.last_plain_pass))

    def baseline_due(self) -> Optional[str]:
        """Why the coming pass must go without drafts to measure verify(1), or None."""
        have = self.cost.samples(1)
        if have < BASELINE_SAMPLES:
            return (
                f"off: measuring the pass without drafts first ({have} of {BASELINE_SAMPLES} "
                f"1-token passes; every saving is booked against it)"
            )
        if self.passes - self.last_plain_pass >= self.refresh_interval:
            return (
                f"off for one pass: re-measuring the pass without drafts ({self.passes - self.last_plain_pass} "
                f"passes since the last one)"
            )
        return None

    def allowance(self) -> float:
        """Seconds speculation may still lose: explore_share of the decode time plus what it saved."""
        return self.ledger_seconds + self.explore_share * self.elapsed_seconds

    def choose(self, name: str) -> Decision:
        """How many tokens ``name`` drafts for the coming pass (and whether that is a probe)."""
        src = self.sources[name]
        if src.disabled is not None:
            src.last_k = 0
            return Decision(0)
        due = self.baseline_due()
        if due is not None:
            if self._forced_at != self.passes:  # one forced pass, however many sources are asked
                self._forced_at = self.passes
                self.baseline_passes += 1
            # a refresh leaves the state and reason of a source consulted before
            if self.cost.samples(1) < BASELINE_SAMPLES or src.reason == NOT_CONSULTED:
                src.state, src.reason = "off", due
            src.last_k = 0
            return Decision(0)
        k, gain = src.best(self.cost)
        deficit = self.allowance() < 0
        if k and gain >= 1 + ON_MARGIN and not src.losing() and not deficit:
            src.state, src.last_k = "on", k
            src.reason = (
                f"on: acceptance {src.acceptance:.2f}, {k}-token drafts predict {gain:.2f}x the rate "
                f"without drafts ({self._costs_text(src)}); measured net saving "
                f"{src.net_saving_seconds:+.2f} s"
            )
            return Decision(k)
        if src.state == "on":  # just switched off: the next probe waits a full interval
            src.next_probe = self.passes + src.probe_interval(self.cost, self.explore_share)
        src.last_k = 0
        if deficit:
            why = (
                f"off: speculation has lost {-self.ledger_seconds:.2f} s of {self.elapsed_seconds:.1f} s decoding, "
                f"more than the {self.explore_share:.0%} allowed; drafting resumes when the allowance recovers"
            )
        elif src.losing():
            why = (
                f"off: its drafts lost {-src.recent_saving / max(src.recent_weight, 1e-9) * 1e3:.1f} ms per pass "
                f"recently against no drafts (measured net {src.net_saving_seconds:+.2f} s)"
            )
        else:
            why = (
                f"off: acceptance {src.acceptance:.2f} over {src.drafted} drafted tokens; the best draft predicts "
                f"{gain:.2f}x the rate without drafts, under the {1 + ON_MARGIN:.2f}x needed "
                f"({self._costs_text(src)})"
            )
        src.state = "off"
        if self.passes >= src.next_probe and self.allowance() >= src.probe_cost(self.cost):
            src.probes += 1
            src.reason = why + f"; probing with one token (probe {src.probes})"
            return Decision(1, probe=True)
        src.reason = why + (f"; next probe in {max(0, src.next_probe - self.passes)} passes" if not deficit else "")
        return Decision(0)

    def settle(
        self,
        name: str,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        verify_seconds: Optional[float],
        probe: bool = False,
    ) -> None:
        """Book a pass that drafted ``drafted`` tokens from ``name`` of which ``accepted`` were kept;
        ``verify_seconds``: that pass's measured time (None: not measured, nothing booked to the ledger)."""
        src = self.sources[name]
        self.elapsed_seconds += draft_seconds
        saving = None
        if verify_seconds is not None and self.cost.known():
            saving = (1 + accepted) * self.cost.seconds(1) - (verify_seconds + draft_seconds)
            self.ledger_seconds += saving
        src.record(drafted, accepted, draft_seconds, saving)
        if probe:
            src.backoff = 1 if accepted else min(2 * src.backoff, PROBE_MAX_BACKOFF)
            src.next_probe = self.passes + src.probe_interval(self.cost, self.explore_share)

    def _costs_text(self, src: SourceControl) -> str:
        v1 = self.cost.seconds(1)
        k = max(src.last_k, 1)
        extra = self.cost.seconds(1 + k) - v1
        step = f", draft step {src.step_seconds * 1e3:.1f} ms" if src.step_seconds else ""
        return (
            f"pass {v1 * 1e3:.0f} ms without drafts (measured {self.cost.samples(1)}x), "
            f"+{extra * 1e3:.1f} ms to verify {k} drafted{step}"
        )

    def summary(self) -> Dict[str, Any]:
        return {
            "explore_share": self.explore_share,
            "elapsed_seconds": self.elapsed_seconds,
            "net_saving_seconds": self.ledger_seconds,
            "passes": self.passes,
            "verify_1_seconds": self.cost.seconds(1) if self.cost.known() else None,
            "verify_seconds_by_size": {n: self.cost.mean(n) for n in sorted(self.cost._by_size)},
            "passes_by_size": {n: self.cost.samples(n) for n in sorted(self.cost._by_size)},
            "baseline_passes": self.baseline_passes,
            "unsteady_passes": self.unsteady_passes,
            "sources": {name: src.status() for name, src in self.sources.items()},
        }


__all__ = ("DraftController", "Decision", "PassCost", "SourceControl", "delivered")
