"""Quality of a sparsity setting: perplexity on validation text and greedy agreement with stock.

The dense reference is always stock llama.cpp (:class:`~llamaflash.converters.llama_runner.LlamaRunner`):
its perplexity and its greedy continuations of the fixed prompts. A sparse setting is measured
through the same loop (:meth:`QualityEvaluator.measure_with`, given a ``decode(tokens) -> logits``
callable) with llamaflash's own sparse lane inside llama.cpp (:mod:`.engine_quality`, method
``"engine"``): every token of every evaluated batch goes through the sparse kernel, with the
sidecar's ``ffn_down_t``, exactly as decode computes it.

* Perplexity: every chunk of validation text (BOS first) is evaluated from an empty context;
  each position predicts the next token; ppl = exp(mean negative log-likelihood).
* Greedy agreement: for each fixed prompt, stock llama.cpp greedily generates ``n_gen`` tokens;
  prompt + continuation is then evaluated (teacher forcing) with the setting under test, and
  the agreement is the fraction of continuation positions whose argmax equals the dense
  model's argmax at the same position (1.0 for the dense model by construction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llamaflash.converters.llama_runner import LlamaRunner

#: Fixed prompts for greedy agreement (prose, code, question answering, story).
GREEDY_PROMPTS: tuple[str, ...] = (
    "The history of the printing press begins in",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Q: Why is the sky blue during the day and red at sunset?\nA:",
    "Once upon a time, in a small village by the sea, there lived",
)
GREEDY_TOKENS = 32

#: Rows of logits converted to log-probabilities at a time (bounds temporary memory).
_ROW_BLOCK = 64


#: ``decode(tokens) -> logits``: evaluate ``tokens`` from an empty context, return float32 logits
#: (len(tokens), n_vocab) (a view valid until the next call is fine).
Decoder = Callable[[np.ndarray], np.ndarray]

METHOD_STOCK = "stock"  # the dense reference


@dataclass(frozen=True)
class QualityPoint:
    """One measurement (see the module docstring)."""

    target_sparsity: float  # the level whose thresholds were used (0 for dense)
    ppl: float
    nll: float  # mean negative log-likelihood, nats per token
    greedy_agreement: float
    measured_sparsity: float  # fraction of (token, neuron) FFN activations skipped, all served layers
    selection: str  # "dense" (the reference) or "gate" (gate-first sparse selection)
    method: str  # "engine", or "stock" for the dense reference

    @property
    def active_fraction(self) -> float:
        """Measured fraction of FFN neurons computed per token."""
        return 1.0 - self.measured_sparsity

    def ppl_delta(self, dense: "QualityPoint") -> float:
        """Relative perplexity increase over ``dense`` (0.02 = +2%)."""
        return self.ppl / dense.ppl - 1.0

    def to_dict(self, dense: "QualityPoint | None" = None) -> dict:
        d = {
            "target_sparsity": self.target_sparsity,
            "method": self.method,
            "ppl": self.ppl,
            "nll": self.nll,
            "greedy_agreement": self.greedy_agreement,
            "active_fraction": self.active_fraction,
            "selection": self.selection,
        }
        if dense is not None:
            d["ppl_delta"] = self.ppl_delta(dense)
        return d


class QualityEvaluator:
    """Measures :class:`QualityPoint` s: the dense reference on one stock :class:`LlamaRunner`
    (:meth:`measure_dense`, first), then sparse settings with any decoder, e.g. the engine
    (:meth:`measure_with`)."""

    def __init__(
        self,
        runner: LlamaRunner,
        validation: Sequence[np.ndarray],
        prompts: Sequence[str] = GREEDY_PROMPTS,
        n_gen: int = GREEDY_TOKENS,
        tick: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.validation = list(validation)
        self.n_tokens = int(sum(c.size - 1 for c in self.validation))
        #: called once per chunk/prompt evaluated (progress)
        self.tick: Callable[[], None] = tick or (lambda: None)
        self._prompts: list[tuple[np.ndarray, int]] = []  # (prompt + continuation, prompt length)
        self._prompt_src = list(prompts)
        self._n_gen = n_gen
        self._reference: list[np.ndarray] = []  # dense argmax on each continuation
        self.dense: QualityPoint | None = None

    @property
    def steps_per_eval(self) -> int:
        """Progress ticks one evaluation makes (chunks + prompts)."""
        return len(self.validation) + len(self._prompt_src)

    def measure_dense(self) -> QualityPoint:
        """The stock model: reference perplexity and the greedy continuations."""
        runner = self.runner
        for text in self._prompt_src:
            prompt = runner.with_bos(runner.tokenize(text))
            n_gen = max(1, min(self._n_gen, runner.n_ctx - prompt.size))
            cont = runner.greedy(prompt, n_gen)
            self._prompts.append((np.concatenate([prompt, np.asarray(cont, dtype=np.int32)]), prompt.size))
        dense = self.measure_with(lambda t: runner.decode(t), 0.0, "dense", METHOD_STOCK, _reference=True)
        self.dense = dense
        return dense

    def measure_with(
        self, decode: Decoder, target: float, selection: str, method: str, *, _reference: bool = False
    ) -> QualityPoint:
        """Perplexity over the validation chunks and greedy agreement over the prompts, with
        ``decode`` computing the model under test (``measured_sparsity`` is left 0: the caller
        knows what its decoder skipped)."""
        if not _reference and self.dense is None:
            raise RuntimeError("measure_dense() first")
        nll_sum, count = 0.0, 0
        for chunk in self.validation:
            logits = decode(chunk)
            nll_sum += _nll_sum(logits[:-1], chunk[1:])
            count += chunk.size - 1
            self.tick()
        agree, total = 0, 0
        for i, (seq, n_prompt) in enumerate(self._prompts):
            logits = decode(seq[:-1])
            pred = np.argmax(logits[n_prompt - 1 :], axis=1)
            if _reference:
                self._reference.append(pred)
            agree += int(np.count_nonzero(pred == self._reference[i]))
            total += pred.size
            self.tick()
        nll = nll_sum / max(1, count)
        return QualityPoint(target, math.exp(nll), nll, agree / total if total else 1.0, 0.0, selection, method)


def _nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(logits[row])[targets[row]] (float64 accumulation)."""
    total = 0.0
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        block = np.asarray(logits[start : start + _ROW_BLOCK], dtype=np.float32)
        tgt = targets[start : start + _ROW_BLOCK]
        peak = block.max(axis=1, keepdims=True)
        lse = np.log(np.exp(block - peak).sum(axis=1, dtype=np.float64)) + peak[:, 0]
        total += float(np.sum(lse - block[np.arange(block.shape[0]), tgt]))
    return total
