"""Speculative decoding for `llamaflash.Llama`: several tokens delivered per pass over the FFN weights.

Why it pays under a RAM budget: on the GLU models llamaflash serves, 72-81% of the neurons fire on
every token, so a decode token reads nearly every FFN cluster from flash. A batch of 1 + k tokens
needs the same clusters, and the offload lane reads each needed cluster once for the whole batch
(the union), so verifying k drafted tokens costs about the reads of one token plus k tokens' compute.

One speculative step (llama-cpp-python's own `generate` loop drives it through `draft_model`):
  1. `Speculator.__call__(input_ids)`: the context holds `n_past` evaluated tokens and input_ids
     ends with the token t just sampled (not yet evaluated). A draft d_1..d_k is proposed:
       * prompt lookup: the longest n-gram (max_ngram .. 1 tokens) that ends the context and occurred
         before, most recent occurrence first; its continuation is the draft (free: no model call);
       * self-draft (offload): the same model and context evaluated greedily in draft mode, whose FFN
         uses only the clusters resident in the neuron cache (no flash read), from t for up to k
         steps, stopping early when the draft's top probability falls under `min_confidence`; then
         the KV cache is rolled back to n_past (no second context, no second KV cache);
       * or a user's `draft_model` (llama-cpp-python's `LlamaDraftModel` interface).
     k is adaptive: `draft_control.DraftController` decides per source from measured costs and
     acceptance, so that drafting does not cost decode speed.
  2. `Llama.eval([t, d_1..d_k])` runs the verify batch with logits for its rows only (never
     n_ctx x n_vocab logits: llama-cpp-python's own draft path forces `logits_all`).
  3. generate samples position by position from the verify batch's logits and keeps d_i while it
     equals the token sampled at its position; the first mismatch ends the step (the sampled token is
     kept, the KV cache is cut behind it).

Exactness (the acceptance rule): every delivered token is drawn from the target model's distribution
at its position given the delivered prefix; the draft only decides how many positions one pass
computes. Greedy output is the non-speculative output token for token, and sampling keeps the target
distribution. (Token t of a verify batch is computed as when decoded alone by the FFN lanes; llama.cpp's
own matrix products for a batch may round differently from one token's, as in stock llama.cpp.)
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from .draft_control import DraftController

#: The default draft sources under a RAM budget, in the order they are tried.
SOURCES = ("prompt_lookup", "self_draft")


@dataclass(frozen=True)
class SpeculativeSettings:
    """`Llama(flash_speculative=...)`: True (these defaults), False (off), or a dict of these fields."""

    max_draft: int = 6  # k_max: drafted tokens per verify pass at most (see BATCH_INVARIANT_MAX)
    prompt_lookup: bool = True  # n-gram drafts from the context
    max_ngram: int = 3  # longest n-gram matched (down to 1)
    self_draft: bool = True  # draft-mode evaluation of the same model (offload only)
    min_confidence: float = 0.4  # self-draft stops when its top token's probability is lower
    adaptive: bool = True  # choose k per pass from measured acceptance and costs (draft_control.py)
    explore_share: float = 0.01  # adaptive: the share of decode time drafting may lose, probes included

    @classmethod
    def from_argument(cls, value: Any) -> Optional["SpeculativeSettings"]:
        """None/False → None (off); True → defaults; a dict → those fields (unknown keys refused)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, dict):
            fields = set(cls.__dataclass_fields__)
            unknown = sorted(set(value) - fields)
            if unknown:
                raise ValueError(f"flash_speculative: unknown setting(s) {unknown}; accepted: {sorted(fields)}")
            settings = cls(**value)
            settings.check()
            return settings
        raise TypeError(f"flash_speculative must be None, True, False or a dict of settings, got {value!r}")

    def check(self) -> None:
        limit = BATCH_INVARIANT_MAX - 1
        if not isinstance(self.max_draft, int) or isinstance(self.max_draft, bool) or not 1 <= self.max_draft <= limit:
            raise ValueError(
                f"flash_speculative max_draft must be an int in 1..{limit} (a verify batch of 1 + "
                f"max_draft tokens computes each row as one-token decoding), got {self.max_draft!r}"
            )
        if not isinstance(self.max_ngram, int) or isinstance(self.max_ngram, bool) or not 1 <= self.max_ngram <= 8:
            raise ValueError(f"flash_speculative max_ngram must be an int in 1..8, got {self.max_ngram!r}")
        if not (isinstance(self.min_confidence, (int, float)) and 0.0 <= self.min_confidence < 1.0):
            raise ValueError(f"flash_speculative min_confidence must be in [0, 1), got {self.min_confidence!r}")
        if not (
            isinstance(self.explore_share, (int, float))
            and not isinstance(self.explore_share, bool)
            and 0.0 <= self.explore_share <= 0.5
        ):
            raise ValueError(
                f"flash_speculative explore_share must be a number in [0, 0.5] (the share of decode "
                f"time drafting may lose), got {self.explore_share!r}"
            )


def lookup_ngram(tokens: np.ndarray, size: int, k: int) -> np.ndarray:
    """The continuation (up to k tokens) of the most recent earlier occurrence of the n-gram of
    `size` tokens that ends `tokens`; empty when it did not occur before."""
    n = int(tokens.shape[0])
    if not 1 <= size < n:
        return np.empty(0, dtype=np.intc)
    tail = tokens[n - size :]
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
    hits = np.nonzero(np.all(windows == tail, axis=1))[0]
    for start in hits[::-1]:  # most recent first
        begin = int(start) + size
        if begin < n:
            return tokens[begin : min(begin + k, n)].copy()
    return np.empty(0, dtype=np.intc)


def prompt_lookup(tokens: np.ndarray, max_ngram: int, k: int) -> np.ndarray:
    """The continuation (up to k tokens) of the most recent earlier occurrence of the longest n-gram
    (max_ngram .. 1) that ends `tokens`; empty when none occurred."""
    for size in range(min(max_ngram, int(tokens.shape[0]) - 1), 0, -1):
        draft = lookup_ngram(tokens, size, k)
        if draft.shape[0]:
            return draft
    return np.empty(0, dtype=np.intc)


def lookup_source(size: int) -> str:
    """The controller's name for prompt-lookup drafts from an n-gram of `size` tokens (each size has
    its own acceptance: a 1-token match predicts far less often than a 3-token one)."""
    return f"prompt_lookup:{size}"


#: Prior acceptance of each draft source before anything is measured (weight: draft_control.PRIOR_TOKENS);
#: the self-draft's comes from the plan when there is one (Speculator.attach_self_draft).
PRIOR_ACCEPTANCE = {
    "user": 0.5,
    "prompt_lookup:3": 0.4,
    "prompt_lookup:2": 0.25,
    "prompt_lookup:1": 0.1,
    "self_draft": 0.3,
}


class Speculator:
    """The `draft_model` that `llamaflash.Llama` gives llama-cpp-python's generate loop (see the
    module docstring). `self_draft(n_past, token, k, min_confidence) -> (tokens, seconds)` is the
    Llama's draft-mode evaluation, or None where there is none (in memory). With `adaptive`, how
    many tokens each source drafts is the `draft_control.DraftController`'s decision, from the
    verify passes and drafts timed on `clock`."""

    def __init__(
        self,
        settings: SpeculativeSettings,
        self_draft: Optional[Callable] = None,
        user_draft: Optional[Callable] = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        self._self_draft = None
        self._user_draft = user_draft
        self._clock = clock
        self.control = DraftController(settings.max_draft, settings.explore_share)
        self._lookup_sizes = tuple(range(settings.max_ngram, 0, -1))
        for name in ("user", *map(lookup_source, self._lookup_sizes), "self_draft"):
            self.control.add_source(name, PRIOR_ACCEPTANCE.get(name, PRIOR_ACCEPTANCE["prompt_lookup:1"]))
        if not settings.prompt_lookup:
            for size in self._lookup_sizes:
                self.control.disable(lookup_source(size), "off: prompt_lookup=False in flash_speculative")
        if user_draft is None:
            self.control.disable("user", "off: no draft_model given")
        else:  # the caller's explicit choice: used as given, not throttled by the controller
            user = self.control.sources["user"]
            user.state, user.last_k = "on", settings.max_draft
            user.reason = f"on: the caller's draft_model, used as given (up to {settings.max_draft} tokens a pass)"
        self.control.disable(
            "self_draft",
            "off: flash_speculative self_draft=False"
            if not settings.self_draft
            else "off: no self-draft for this model (it needs flash offload with the gate resident)",
        )
        if self_draft is not None:
            self.attach_self_draft(self_draft)
        self._pending: Optional[tuple] = None  # (control name, stats source, n_past, drafted, seconds, probe, pass)
        self._last_verify: tuple = (0, 0, 0.0)  # (pass number, tokens, seconds) of the latest verify pass
        self._last_span: Optional[tuple] = None  # (n_past, tokens) of the latest verify pass with a position
        self._n_tokens: Callable[[], int] = lambda: 0
        self.reset_stats()

    @property
    def max_batch(self) -> int:
        return verify_batch_max(self.settings)

    def attach_self_draft(
        self,
        self_draft: Callable,
        prior_acceptance: Optional[float] = None,
        prior_step_seconds: float = 0.0,
        note: str = "",
    ) -> None:
        """Drafts from `self_draft` from now on (when settings.self_draft); the priors (e.g. the plan's
        predicted acceptance for its resident share, said in `note`) stand until drafts are measured."""
        self._self_draft = self_draft
        if not self.settings.self_draft:
            return
        prior = PRIOR_ACCEPTANCE["self_draft"] if prior_acceptance is None else prior_acceptance
        self.control.add_source("self_draft", prior, prior_step_seconds, note)

    def disable_source(self, name: str, reason: str) -> None:
        """Never draft from `name` (a draft_control source name), giving `reason` in the statistics."""
        self.control.disable(name, reason)

    def eval_rows(self, llama: Any, tokens: Sequence[int]) -> None:
        """llama_cpp.Llama.eval for one batch that fits n_batch, with logits for every row (the verify
        batch's rows only: llama.cpp keeps len(tokens) x n_vocab floats)."""
        n_past = llama.n_tokens
        llama._ctx.kv_cache_seq_rm(-1, n_past, -1)
        t0 = self._clock()
        llama._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
        llama._ctx.decode(llama._batch)
        self.record_verify(len(tokens), self._clock() - t0, n_past)
        llama.input_ids[n_past : n_past + len(tokens)] = tokens
        llama.n_tokens += len(tokens)
        llama._requires_eval = False

    @contextlib.contextmanager
    def timed_verify(self, n_tokens: int):
        """Times a verify pass that the caller evaluates itself (e.g. llama_cpp.Llama.eval with logits_all)."""
        n_past = self._n_tokens()
        t0 = self._clock()
        yield
        self.record_verify(n_tokens, self._clock() - t0, n_past)

    def bind(self, n_tokens: Callable[[], int]) -> None:
        """n_tokens: the context's evaluated token count (Llama.n_tokens), read at each call."""
        self._n_tokens = n_tokens

    def reset_stats(self) -> None:
        """Zeroes the counters of summary() (the controller keeps what it has learned)."""
        self.stats = {
            name: {"passes": 0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0}
            for name in ("prompt_lookup", "self_draft", "user", "none")
        }
        self.verify_passes = 0
        self.verify_tokens = 0
        self.verify_seconds = 0.0

    # -- the LlamaDraftModel interface --------------------------------------------------------

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        n_past = self._n_tokens()
        self._settle(n_past)
        context = np.asarray(input_ids, dtype=np.intc)
        if context.shape[0] != n_past + 1:
            # not the one-pending-token shape of a decode step (e.g. a caller feeding several
            # tokens): no draft this time
            self._pending = None
            return np.empty(0, dtype=np.intc)
        name, source, draft, seconds, probe = self._propose(context, n_past)
        self._pending = (name, source, n_past, len(draft), seconds, probe, self.control.passes)
        return draft

    def _k(self, name: str) -> tuple:
        """(k, probe) for a draft from `name`: the controller's decision, or max_draft when not adaptive."""
        if not self.settings.adaptive:
            return self.settings.max_draft, False
        d = self.control.choose(name)
        return d.k, d.probe

    def _propose(self, context: np.ndarray, n_past: int):
        s = self.settings
        none = ("none", "none", np.empty(0, dtype=np.intc), 0.0, False)
        if self._user_draft is not None:
            k, probe = s.max_draft, False
            t0 = self._clock()
            draft = np.asarray(self._user_draft(context), dtype=np.intc)[:k]
            return "user", "user", draft, self._clock() - t0, probe
        if s.prompt_lookup:
            t0 = self._clock()
            for size in self._lookup_sizes:
                cont = lookup_ngram(context, size, s.max_draft)
                if not cont.shape[0]:
                    continue
                k, probe = self._k(lookup_source(size))
                if k:
                    return lookup_source(size), "prompt_lookup", cont[:k], self._clock() - t0, probe
                if not s.adaptive:
                    break
        if s.self_draft and self._self_draft is not None:
            k, probe = self._k("self_draft")
            if k:
                tokens, seconds = self._self_draft(n_past, int(context[-1]), k, s.min_confidence)
                return "self_draft", "self_draft", np.asarray(tokens, dtype=np.intc), seconds, probe
        return none

    def _settle(self, n_past: int) -> None:
        """Books the previous proposal: generate evaluated [t, d_1..d_k] from position p and cut the
        KV cache behind the first mismatch, so n_past - p - 1 drafts were accepted. Its verify time is
        the pass that followed the proposal, when that pass evaluated 1 + k tokens."""
        if self._pending is None:
            return
        name, source, p, drafted, seconds, probe, pass_before = self._pending
        self._pending = None
        accepted = n_past - p - 1
        if not 0 <= accepted <= drafted:
            return  # the context moved otherwise (a new prompt, a reset): nothing to book
        entry = self.stats[source]
        entry["passes"] += 1
        entry["drafted"] += drafted
        entry["accepted"] += accepted
        entry["draft_seconds"] += seconds
        if name == "none" or not drafted:
            return
        number, n, verify_s = self._last_verify
        verified = verify_s if number == pass_before + 1 and n == drafted + 1 else None
        self.control.settle(name, drafted, accepted, seconds, verified, probe)

    # -- the verify side (Llama.eval) -----------------------------------------------------------

    def record_verify(self, n_tokens: int, seconds: float, n_past: Optional[int] = None) -> None:
        """A verify pass of ``n_tokens`` tokens from position ``n_past`` took ``seconds``. It is a
        steady decode pass (a cost the controller learns from) when it continues the previous one:
        generate evaluates [t, d_1..d_k] at p, keeps the accepted drafts, and evaluates the next pass
        at p + 1 .. p + 1 + k. Any other pass (the first after a prompt's prefill, a new prompt) is
        decode time only. ``n_past`` None: steady."""
        self.verify_passes += 1
        self.verify_tokens += n_tokens
        self.verify_seconds += seconds
        steady = True
        if n_past is not None:
            prev = self._last_span
            steady = prev is not None and prev[0] + 1 <= n_past <= prev[0] + prev[1]
            self._last_span = (int(n_past), int(n_tokens))
        self.control.record_pass(n_tokens, seconds, steady)
        self._last_verify = (self.control.passes, n_tokens, seconds)

    def summary(self, flash_bytes: Optional[int] = None) -> Dict[str, Any]:
        """flash_stats()["speculative"]: per source and in total; `why`: per draft source, whether it
        drafts and why (the controller's reason, from measured costs and acceptance)."""
        passes = sum(e["passes"] for e in self.stats.values())
        drafted = sum(e["drafted"] for e in self.stats.values())
        accepted = sum(e["accepted"] for e in self.stats.values())
        delivered = accepted + passes  # each settled pass delivers its accepted drafts + one sampled token
        draft_seconds = sum(e["draft_seconds"] for e in self.stats.values())
        control = self.control.summary()
        out: Dict[str, Any] = {
            "enabled": True,
            "settings": asdict(self.settings),
            "passes": passes,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_pass": delivered / passes if passes else None,
            "draft_seconds": draft_seconds,
            "verify_passes": self.verify_passes,
            "verify_seconds": self.verify_seconds,
            "verify_tokens_mean": self.verify_tokens / self.verify_passes if self.verify_passes else None,
            "flash_bytes_per_delivered_token": (
                flash_bytes / delivered if flash_bytes is not None and delivered else None
            ),
            "by_source": {
                name: dict(e, acceptance=(e["accepted"] / e["drafted"] if e["drafted"] else None))
                for name, e in self.stats.items()
                if e["passes"]
            },
            "next_k": {name: src["next_k"] for name, src in control["sources"].items()},
            "why": (
                {name: src["reason"] for name, src in control["sources"].items()}
                if self.settings.adaptive
                else {"all": f"adaptive=False: every pass drafts up to max_draft={self.settings.max_draft}"}
            ),
            "control": control,
        }
        return out


def softmax_top(logits: np.ndarray) -> tuple:
    """(argmax, its probability) of a logits row, without overflow."""
    i = int(np.argmax(logits))
    top = float(logits[i])
    z = float(np.exp(logits - top, dtype=np.float32).sum(dtype=np.float64))
    return i, (1.0 / z if z > 0 and math.isfinite(z) else 0.0)


def make_self_draft(llama_ref: "weakref.ReferenceType", n_vocab: int) -> Callable:
    """The draft-mode evaluation of a served Llama (see the module docstring): greedy from `token`
    at position n_past for up to k steps, then the KV cache rolled back to n_past."""
    import llama_cpp

    def self_draft(n_past: int, token: int, k: int, min_confidence: float):
        llama = llama_ref()
        t0 = time.perf_counter()
        out = []
        if llama is None or k <= 0 or n_past + k >= llama.n_ctx():
            return out, 0.0
        # the served engine in draft mode: the dense FlashModel, or the MoE ExpertModel
        flash = llama._flash if llama._flash is not None else llama._experts
        ctx, batch = llama._ctx, llama._batch
        flash.draft = True
        try:
            pos = n_past
            for _ in range(k):
                batch.set_batch(batch=[token], n_past=pos, logits_all=False)
                try:
                    ctx.decode(batch)
                except RuntimeError as e:
                    raise llama._decode_failure(e) from e
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, -1), shape=(n_vocab,))
                token, p = softmax_top(row)
                out.append(token)
                pos += 1
                if p < min_confidence:
                    break
        finally:
            flash.draft = False
            ctx.kv_cache_seq_rm(-1, n_past, -1)
        return out, time.perf_counter() - t0

    return self_draft


#: The largest batch whose every row ggml-cpu computes with the bits of a one-token decode, in the
#: batch-invariant configuration below (measured on Qwen2.5-1.5B Q4_K_M with this llama-cpp-python:
#: rows of batches of 2..7 tokens equal one-token decoding bit for bit; from 8 rows on, ggml-cpu's
#: K-quant matmuls take its tiled kernel, ggml-cpu/tiled, which rounds differently). Verify batches
#: stay within it.
BATCH_INVARIANT_MAX = 7


@contextlib.contextmanager
def batch_invariant_weights():
    """While a model loads: llama.cpp keeps its weights in plain CPU memory (use_extra_bufts =
    false, llama-cli's --no-repack). ggml-cpu's repacked kernels (e.g. Q4_K 8x8) compute 4+ rows
    with another summation order than one row, so a verify batch would round differently from
    one-token decoding; with flash attention on (Llama(flash_attn=True)) and plain weights, each row
    of a batch of up to BATCH_INVARIANT_MAX tokens gets the bits of decoding it alone."""
    import llama_cpp.llama_cpp as raw

    default = raw.llama_model_default_params

    def plain_weights():
        params = default()
        params.use_extra_bufts = False
        return params

    raw.llama_model_default_params = plain_weights
    try:
        yield
    finally:
        raw.llama_model_default_params = default


def verify_batch_max(settings: Optional[SpeculativeSettings]) -> int:
    """The largest verify batch (1 + k_max), 1 when speculation is off."""
    return 1 + settings.max_draft if settings is not None else 1


__all__: Sequence[str] = (
    "SpeculativeSettings",
    "Speculator",
    "prompt_lookup",
    "lookup_ngram",
    "lookup_source",
    "make_self_draft",
    "verify_batch_max",
    "SOURCES",
)
