"""How many tokens each draft source proposes per verify pass: decided from measured costs and
measured acceptance, so that speculative decoding does not deliver slower than decoding without it.

Measured, in seconds of the caller's clock:
  verify(n)   one pass over n tokens (the pending token and n - 1 drafts): :class:`PassCost`, a line
              v0 + v1·n through recency-weighted mean times per batch size;
  step        one drafted token of a source (a self-draft evaluates the model; prompt lookup ≈ 0);
  a           the source's acceptance: drafted tokens accepted / drafted, recency-weighted, from a prior.

A pass that drafts k tokens delivers E(k) = (1 − a^(k+1)) / (1 − a) tokens in
T(k) = verify(1 + k) + k·step; without a draft a token costs verify(1). Per source and pass
(:meth:`DraftController.choose`):

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
#: With a single batch size measured, verify(1 + k) is taken as verify(1) · (1 + this · k).
PRIOR_VERIFY_SLOPE = 0.1
#: Recency of the mean time per batch size (per observation of that size).
COST_DECAY = 0.95


class PassCost:
    """verify(n) = v0 + v1·n: a least-squares line through the recency-weighted mean time of each
    batch size n seen (v1 clamped at >= 0); with one size seen, verify(1) · (1 + PRIOR_VERIFY_SLOPE · (n - 1))
    scaled from it."""

    def __init__(self) -> None:
        self._by_size: Dict[int, list] = {}  # n -> [weighted sum of seconds, weight]
        self._line: Optional[tuple] = None  # (v0, v1) of the current points, fitted on demand

    def record(self, n: int, seconds: float) -> None:
        s = self._by_size.setdefault(int(n), [0.0, 0.0])
        s[0] = s[0] * COST_DECAY + float(seconds)
        s[1] = s[1] * COST_DECAY + 1.0
        self._line = None

    def known(self) -> bool:
        """Whether a pass has been measured at all."""
        return bool(self._by_size)

    def seconds(self, n: int) -> float:
        if not self._by_size:
            return 0.0
        if self._line is None:
            self._line = self._fit()
        v0, v1 = self._line
        return float(max(v0 + v1 * n, 1e-6))

    def _fit(self) -> tuple:
        points = [(size, total / weight) for size, (total, weight) in self._by_size.items()]
        if len(points) == 1:
            size, t = points[0]
            per_unit = t / (1 + PRIOR_VERIFY_SLOPE * (size - 1))
            return per_unit * (1 - PRIOR_VERIFY_SLOPE), per_unit * PRIOR_VERIFY_SLOPE
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
        self.state, self.reason = "off", "not consulted yet"
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

    def record_pass(self, n_tokens: int, seconds: float) -> None:
        """A verify pass of ``n_tokens`` tokens took ``seconds``."""
        self.passes += 1
        self.elapsed_seconds += seconds
        self.cost.record(n_tokens, seconds)

    def allowance(self) -> float:
        """Seconds speculation may still lose: explore_share of the decode time plus what it saved."""
        return self.ledger_seconds + self.explore_share * self.elapsed_seconds

    def choose(self, name: str) -> Decision:
        """How many tokens ``name`` drafts for the coming pass (and whether that is a probe)."""
        src = self.sources[name]
        if src.disabled is not None:
            src.last_k = 0
            return Decision(0)
        if not self.cost.known():
            src.state, src.reason, src.last_k = "off", "off: no pass measured yet (the first decides the baseline)", 0
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
        slope = self.cost.seconds(2) - v1
        step = f", draft step {src.step_seconds * 1e3:.1f} ms" if src.step_seconds else ""
        return f"pass {v1 * 1e3:.0f} ms, +{slope * 1e3:.1f} ms per drafted token{step}"

    def summary(self) -> Dict[str, Any]:
        return {
            "explore_share": self.explore_share,
            "elapsed_seconds": self.elapsed_seconds,
            "net_saving_seconds": self.ledger_seconds,
            "passes": self.passes,
            "verify_1_seconds": self.cost.seconds(1) if self.cost.known() else None,
            "sources": {name: src.status() for name, src in self.sources.items()},
        }


__all__ = ("DraftController", "Decision", "PassCost", "SourceControl", "delivered")
