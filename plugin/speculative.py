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
     k is adaptive: see `DraftLength`.
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

#: The default draft sources under a RAM budget, in the order they are tried.
SOURCES = ("prompt_lookup", "self_draft")


@dataclass(frozen=True)
class SpeculativeSettings:
    """`Llama(flash_speculative=...)`: True (these defaults), False (off), or a dict of these fields."""

    max_draft: int = 6             # k_max: drafted tokens per verify pass at most (see BATCH_INVARIANT_MAX)
    prompt_lookup: bool = True     # n-gram drafts from the context
    max_ngram: int = 3             # longest n-gram matched (down to 1)
    self_draft: bool = True        # draft-mode evaluation of the same model (offload only)
    min_confidence: float = 0.4    # self-draft stops when its top token's probability is lower
    adaptive: bool = True          # choose k per pass from measured acceptance and costs

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
            raise ValueError(f"flash_speculative max_draft must be an int in 1..{limit} (a verify batch of 1 + "
                             f"max_draft tokens computes each row as one-token decoding), got {self.max_draft!r}")
        if not isinstance(self.max_ngram, int) or isinstance(self.max_ngram, bool) or not 1 <= self.max_ngram <= 8:
            raise ValueError(f"flash_speculative max_ngram must be an int in 1..8, got {self.max_ngram!r}")
        if not (isinstance(self.min_confidence, (int, float)) and 0.0 <= self.min_confidence < 1.0):
            raise ValueError(f"flash_speculative min_confidence must be in [0, 1), got {self.min_confidence!r}")


def prompt_lookup(tokens: np.ndarray, max_ngram: int, k: int) -> np.ndarray:
    """The continuation (up to k tokens) of the most recent earlier occurrence of the longest n-gram
    (max_ngram .. 1) that ends `tokens`; empty when none occurred."""
    n = int(tokens.shape[0])
    for size in range(min(max_ngram, n - 1), 0, -1):
        tail = tokens[n - size:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n - 1], size)
        hits = np.nonzero(np.all(windows == tail, axis=1))[0]
        for start in hits[::-1]:  # most recent first
            begin = int(start) + size
            if begin < n:
                return tokens[begin:min(begin + k, n)].copy()
    return np.empty(0, dtype=np.intc)


class DraftLength:
    """Adaptive draft length for one draft source.

    With per-token acceptance probability a (tokens accepted / tokens drafted, smoothed), a pass that
    drafts k tokens delivers E(k) = (1 - a^(k+1)) / (1 - a) tokens on average and costs
    T(k) = verify(1 + k) + k · draft_step, with verify(n) = v0 + v1 · n fitted from measured passes
    (running means over batch sizes) and draft_step measured. k = argmax over 0..k_max of E(k) / T(k).
    Until there are measurements the source drafts k_max (optimistic: measuring needs drafts); while
    k = 0 wins, every EXPLORE_EVERY-th pass drafts one token anyway, so that a source that starts to
    predict (the text turns repetitive) is noticed."""

    EXPLORE_EVERY = 16

    def __init__(self, k_max: int, prior_accept: float = 0.6) -> None:
        self.k_max = k_max
        self.accept_num, self.accept_den = prior_accept * 4, 4.0  # a 4-token prior
        self.draft_step_seconds = 0.0
        self.idle = 0  # consecutive passes with k = 0

    @property
    def acceptance(self) -> float:
        return self.accept_num / self.accept_den

    def record(self, drafted: int, accepted: int, draft_seconds: float) -> None:
        decay = 0.97  # ~30 drafted tokens of memory: acceptance changes with the text
        self.accept_num = self.accept_num * decay + accepted
        self.accept_den = self.accept_den * decay + drafted
        if drafted:
            step = draft_seconds / drafted
            self.draft_step_seconds = step if self.draft_step_seconds == 0 else 0.8 * self.draft_step_seconds + 0.2 * step

    def choose(self, verify: "VerifyCost", explore: bool = True) -> int:
        a = min(self.acceptance, 0.999)
        best_k, best_rate = 0, 0.0
        for k in range(0, self.k_max + 1):
            delivered = (1 - a ** (k + 1)) / (1 - a)
            cost = verify.seconds(1 + k) + k * self.draft_step_seconds
            if cost <= 0:
                return self.k_max
            rate = delivered / cost
            if rate > best_rate * 1.0001:
                best_k, best_rate = k, rate
        if not explore:
            return best_k
        if best_k == 0:
            self.idle += 1
            if self.idle >= self.EXPLORE_EVERY:
                self.idle = 0
                return 1
        else:
            self.idle = 0
        return best_k


class VerifyCost:
    """verify(n) = v0 + v1 · n, a least-squares line through the running mean time of each batch
    size n seen (sizes with a single observation count too)."""

    def __init__(self) -> None:
        self.sums: Dict[int, list] = {}

    def record(self, n: int, seconds: float) -> None:
        s = self.sums.setdefault(n, [0.0, 0])
        s[0] += seconds
        s[1] += 1

    def seconds(self, n: int) -> float:
        points = [(size, total / count) for size, (total, count) in self.sums.items()]
        if not points:
            return 0.0
        if len(points) == 1:
            return points[0][1]  # no slope known yet: every size costs the same
        xs = np.array([p[0] for p in points], dtype=float)
        ys = np.array([p[1] for p in points], dtype=float)
        v1, v0 = np.polyfit(xs, ys, 1)
        return float(max(v0 + max(v1, 0.0) * n, 1e-6))


class Speculator:
    """The `draft_model` that `llamaflash.Llama` gives llama-cpp-python's generate loop (see the
    module docstring). `self_draft(n_past, token, k, min_confidence) -> (tokens, seconds)` is the
    Llama's draft-mode evaluation, or None where there is none (in memory)."""

    def __init__(self, settings: SpeculativeSettings, self_draft: Optional[Callable] = None,
                 user_draft: Optional[Callable] = None) -> None:
        self.settings = settings
        self._self_draft = self_draft
        self._user_draft = user_draft
        self.verify = VerifyCost()
        self.lengths = {name: DraftLength(settings.max_draft) for name in ("prompt_lookup", "self_draft", "user")}
        self._pending: Optional[tuple] = None  # (source, n_past at the pass, drafted, draft seconds)
        self._n_tokens: Callable[[], int] = lambda: 0
        self.reset_stats()

    @property
    def max_batch(self) -> int:
        return verify_batch_max(self.settings)

    def attach_self_draft(self, self_draft: Callable) -> None:
        self._self_draft = self_draft

    def eval_rows(self, llama: Any, tokens: Sequence[int]) -> None:
        """llama_cpp.Llama.eval for one batch that fits n_batch, with logits for every row (the verify
        batch's rows only: llama.cpp keeps len(tokens) x n_vocab floats)."""
        n_past = llama.n_tokens
        llama._ctx.kv_cache_seq_rm(-1, n_past, -1)
        t0 = time.perf_counter()
        llama._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
        llama._ctx.decode(llama._batch)
        self.record_verify(len(tokens), time.perf_counter() - t0)
        llama.input_ids[n_past:n_past + len(tokens)] = tokens
        llama.n_tokens += len(tokens)
        llama._requires_eval = False

    def bind(self, n_tokens: Callable[[], int]) -> None:
        """n_tokens: the context's evaluated token count (Llama.n_tokens), read at each call."""
        self._n_tokens = n_tokens

    def reset_stats(self) -> None:
        self.stats = {name: {"passes": 0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0}
                      for name in ("prompt_lookup", "self_draft", "user", "none")}
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
        source, draft, seconds = self._propose(context, n_past)
        self._pending = (source, n_past, len(draft), seconds)
        return draft

    def _propose(self, context: np.ndarray, n_past: int):
        s = self.settings
        if self._user_draft is not None:
            k = self._k("user")
            t0 = time.perf_counter()
            draft = np.asarray(self._user_draft(context), dtype=np.intc)[:k] if k else np.empty(0, np.intc)
            return "user", draft, time.perf_counter() - t0
        if s.prompt_lookup:
            k = self._k("prompt_lookup")
            if k:
                t0 = time.perf_counter()
                draft = prompt_lookup(context, s.max_ngram, k)
                if draft.shape[0]:
                    return "prompt_lookup", draft, time.perf_counter() - t0
        if s.self_draft and self._self_draft is not None:
            k = self._k("self_draft")
            if k:
                tokens, seconds = self._self_draft(n_past, int(context[-1]), k, s.min_confidence)
                return "self_draft", np.asarray(tokens, dtype=np.intc), seconds
        return "none", np.empty(0, dtype=np.intc), 0.0

    def _k(self, source: str, explore: bool = True) -> int:
        if not self.settings.adaptive:
            return self.settings.max_draft
        return self.lengths[source].choose(self.verify, explore)

    def _settle(self, n_past: int) -> None:
        """Books the previous proposal: generate evaluated [t, d_1..d_k] from position p and cut the
        KV cache behind the first mismatch, so n_past - p - 1 drafts were accepted."""
        if self._pending is None:
            return
        source, p, drafted, seconds = self._pending
        self._pending = None
        accepted = n_past - p - 1
        if not 0 <= accepted <= drafted:
            return  # the context moved otherwise (a new prompt, a reset): nothing to book
        entry = self.stats[source]
        entry["passes"] += 1
        entry["drafted"] += drafted
        entry["accepted"] += accepted
        entry["draft_seconds"] += seconds
        if source in self.lengths:
            self.lengths[source].record(drafted, accepted, seconds)

    # -- the verify side (Llama.eval) -----------------------------------------------------------

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        self.verify_passes += 1
        self.verify_tokens += n_tokens
        self.verify_seconds += seconds
        self.verify.record(n_tokens, seconds)

    def summary(self, flash_bytes: Optional[int] = None) -> Dict[str, Any]:
        """flash_stats()["speculative"]: per source and in total."""
        passes = sum(e["passes"] for e in self.stats.values())
        drafted = sum(e["drafted"] for e in self.stats.values())
        accepted = sum(e["accepted"] for e in self.stats.values())
        delivered = accepted + passes  # each settled pass delivers its accepted drafts + one sampled token
        draft_seconds = sum(e["draft_seconds"] for e in self.stats.values())
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
            "flash_bytes_per_delivered_token": (flash_bytes / delivered if flash_bytes is not None and delivered
                                                else None),
            "by_source": {name: dict(e, acceptance=(e["accepted"] / e["drafted"] if e["drafted"] else None))
                          for name, e in self.stats.items() if e["passes"]},
            "next_k": {name: self._k(name, explore=False) for name in ("prompt_lookup", "self_draft")},
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
        flash, ctx, batch = llama._flash, llama._ctx, llama._batch
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
#: rows of batches of 2..7 tokens equal one-token decoding bit for bit; from 8 rows on, flash
#: attention takes a tiled path that rounds differently). Verify batches stay within it.
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


__all__: Sequence[str] = ("SpeculativeSettings", "Speculator", "DraftLength", "VerifyCost", "prompt_lookup",
                          "make_self_draft", "verify_batch_max", "SOURCES")
