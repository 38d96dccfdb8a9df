"""Quality of a sparsity setting: perplexity on validation text and greedy agreement with stock.

EMULATION ESTIMATE. The native sparse FFN engine does not exist yet, so the sparse model is
emulated inside stock llama.cpp (:class:`~llamaflash.converters.llama_runner.SparseFfnEmulator`:
the activations of the neurons the engine would skip are zeroed before the down projection).
Mathematically this is the sparse FFN; it differs from the engine only in the down weights
(base ``ffn_down`` here, the sidecar's Q8_0 ``ffn_down_t`` in the engine) and in summation order.
Every number produced here is labelled "emulated" in the sidecar and the report; the engine's
own measurement will replace it.

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

from llamaflash.converters.llama_runner import EmulatedLayer, Hook, LlamaRunner, SparseFfnEmulator

#: Fixed prompts for greedy agreement (prose, code, question answering, story).
GREEDY_PROMPTS: tuple[str, ...] = (
    "The history of the printing press begins in",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: Why is the sky blue during the day and red at sunset?\nA:",
    "Once upon a time, in a small village by the sea, there lived",
)
GREEDY_TOKENS = 32

#: Rows of logits converted to log-probabilities at a time (bounds temporary memory).
_ROW_BLOCK = 64


@dataclass(frozen=True)
class QualityPoint:
    """One emulated measurement (see the module docstring)."""

    target_sparsity: float          # the level whose thresholds were used (0 for dense)
    ppl: float
    nll: float                      # mean negative log-likelihood, nats per token
    greedy_agreement: float
    measured_sparsity: float        # fraction of (token, neuron) activations zeroed, all served layers
    selection: str                  # "dense", "gate" or "mixed" (some layers by predictor)

    def ppl_delta(self, dense: "QualityPoint") -> float:
        """Relative perplexity increase over ``dense`` (0.02 = +2%)."""
        return self.ppl / dense.ppl - 1.0

    def to_dict(self, dense: "QualityPoint | None" = None) -> dict:
        d = {
            "target_sparsity": self.target_sparsity,
            "ppl_emulated": self.ppl,
            "nll_emulated": self.nll,
            "greedy_agreement_emulated": self.greedy_agreement,
            "measured_sparsity_emulated": self.measured_sparsity,
            "selection": self.selection,
        }
        if dense is not None:
            d["ppl_delta_emulated"] = self.ppl_delta(dense)
        return d


class QualityEvaluator:
    """Measures :class:`QualityPoint` s on one :class:`LlamaRunner`."""

    def __init__(
        self,
        runner: LlamaRunner,
        activation: str,
        validation: Sequence[np.ndarray],
        prompts: Sequence[str] = GREEDY_PROMPTS,
        n_gen: int = GREEDY_TOKENS,
        tick: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.activation = activation
        self.validation = list(validation)
        self.n_tokens = int(sum(c.size - 1 for c in self.validation))
        #: called once per chunk/prompt evaluated (progress)
        self.tick: Callable[[], None] = tick or (lambda: None)
        self._prompts: list[tuple[np.ndarray, int]] = []   # (prompt + continuation, prompt length)
        self._prompt_src = list(prompts)
        self._n_gen = n_gen
        self._reference: list[np.ndarray] = []             # dense argmax on each continuation
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
        self.dense = self._measure(Hook(), 0.0, "dense", reference=True)
        return self.dense

    def measure(self, layers: dict[int, EmulatedLayer], target_sparsity: float) -> QualityPoint:
        """The emulated sparse model with the given per-layer selection."""
        if self.dense is None:
            raise RuntimeError("measure_dense() first")
        mixed = any(spec.pred_in is not None for spec in layers.values())
        hook = SparseFfnEmulator(self.activation, layers)
        point = self._measure(hook, target_sparsity, "mixed" if mixed else "gate")
        return QualityPoint(point.target_sparsity, point.ppl, point.nll, point.greedy_agreement,
                            hook.measured_sparsity, point.selection)

    def _measure(self, hook: Hook, target: float, selection: str, reference: bool = False) -> QualityPoint:
        runner = self.runner
        nll_sum, count = 0.0, 0
        for chunk in self.validation:
            logits = runner.decode(chunk, hook)
            nll_sum += _nll_sum(logits[:-1], chunk[1:])
            count += chunk.size - 1
            self.tick()
        agree, total = 0, 0
        for i, (seq, n_prompt) in enumerate(self._prompts):
            logits = runner.decode(seq[:-1], hook)
            pred = np.argmax(logits[n_prompt - 1:], axis=1)
            if reference:
                self._reference.append(pred)
            agree += int(np.count_nonzero(pred == self._reference[i]))
            total += pred.size
            self.tick()
        nll = nll_sum / max(1, count)
        return QualityPoint(target, math.exp(nll), nll, agree / total if total else 1.0, 0.0, selection)


def _nll_sum(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum over rows of -log softmax(logits[row])[targets[row]] (float64 accumulation)."""
    total = 0.0
    for start in range(0, logits.shape[0], _ROW_BLOCK):
        block = np.asarray(logits[start:start + _ROW_BLOCK], dtype=np.float32)
        tgt = targets[start:start + _ROW_BLOCK]
        peak = block.max(axis=1, keepdims=True)
        lse = np.log(np.exp(block - peak).sum(axis=1, dtype=np.float64)) + peak[:, 0]
        total += float(np.sum(lse - block[np.arange(block.shape[0]), tgt]))
    return total
