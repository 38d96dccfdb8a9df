"""Per-layer neuron statistics and sparsity thresholds (NumPy).

Input of :func:`analyse_layer`: the FFN inputs x of one layer profiled through llama.cpp
(:mod:`.llama_runner`), split into *train* and *held-out* tokens, and the layer's dequantized
gate/up/down weights. Everything else is recomputed here in float32: g = gate·x, u = up·x,
h = act(g)·u, y = down·h. llama.cpp's own gate·x (quantized activations) agrees with the
recomputation to about 1% (checked per layer, recorded as ``gate_check_error``).

Criterion (``docs/SIDECAR.md``): neuron i is inactive for a token when |act(g_i)| <= t (CATS).
For each target sparsity s in ``levels`` the threshold t_s is the s-quantile of |act(g)| over
train tokens x neurons, so that a fraction s of (token, neuron) pairs is skipped; the fraction
actually reached on held-out tokens is measured. For ReLU the threshold is never below 0, and at
0 it is the exact zero pattern (no error at all). The alternative criterion |act(g_i)·u_i| (the
neuron's true coefficient) is measured beside it (``*_gate_up``) for the record.

All random choices use a fixed seed: the same input gives the same output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llamaflash.converters.llama_runner import activation_fn


@dataclass(frozen=True)
class AnalysisSettings:
    """Knobs of :func:`analyse_layer`."""

    #: target sparsities at which thresholds and errors are computed
    levels: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    #: held-out tokens on which the FFN output error is measured
    n_error_tokens: int = 256
    #: (token, neuron) values sampled for quantiles
    quantile_samples: int = 1 << 20
    seed: int = 0


@dataclass
class LayerAnalysis:
    """What :func:`analyse_layer` measured for one layer; arrays indexed by level unless noted."""

    layer: int
    n_embd: int
    n_ff: int
    activation: str
    levels: np.ndarray
    n_train: int
    n_heldout: int
    thresholds: np.ndarray  # t_s on |act(g)|
    sparsity_heldout: np.ndarray  # fraction inactive on held-out tokens at t_s
    ffn_error: np.ndarray  # rel. L2 error of y, inactive neurons skipped (held-out)
    thresholds_gate_up: np.ndarray  # alternative criterion |act(g)·u|
    sparsity_heldout_gate_up: np.ndarray
    ffn_error_gate_up: np.ndarray
    natural_sparsity: float  # fraction with act(g) == 0 exactly (ReLU: the zero pattern)
    freq: np.ndarray  # (levels, n_ff): fraction of all tokens active at t_s
    mag: np.ndarray  # (n_ff,): mean |h|
    gate_check_error: float | None = None

    def level_index(self, sparsity: float) -> int:
        idx = int(np.argmin(np.abs(self.levels - sparsity)))
        if abs(self.levels[idx] - sparsity) > 1e-6:
            raise KeyError(f"level {sparsity} was not analysed (levels: {self.levels.tolist()})")
        return idx


def analyse_layer(
    layer: int,
    x: np.ndarray,
    heldout: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    down: np.ndarray,
    activation: str,
    settings: AnalysisSettings,
    gate_check: tuple[np.ndarray, np.ndarray] | None = None,
) -> LayerAnalysis:
    """Analyse one layer.

    ``x`` (N, n_embd) FFN inputs; ``heldout`` (N,) bool, True for held-out tokens; ``gate``/``up``
    (n_ff, n_embd) and ``down`` (n_embd, n_ff) float32 weights; ``gate_check`` = (x rows, llama.cpp's
    gate·x for them) to compare the recomputation against.
    """
    rng = np.random.default_rng(settings.seed + 7919 * layer)
    act = activation_fn(activation)
    x = np.ascontiguousarray(x, dtype=np.float32)
    n_ff, n_embd = gate.shape
    levels = np.asarray(settings.levels, dtype=np.float64)
    train_idx = np.flatnonzero(~heldout)
    ho_idx = np.flatnonzero(heldout)
    if train_idx.size == 0 or ho_idx.size == 0:
        raise ValueError(f"layer {layer}: need both train and held-out tokens")

    check_error = None
    if gate_check is not None:
        xc, gc = gate_check
        ref = xc.astype(np.float32) @ gate.T
        check_error = float(np.linalg.norm(ref - gc) / max(np.linalg.norm(gc), 1e-30))

    g = x @ gate.T  # (N, n_ff)
    a = act(g)  # act(g)
    h = a * (x @ up.T)  # coefficient of each down column
    abs_a = np.abs(a)
    abs_h = np.abs(h)
    natural = float(np.mean(a == 0))

    # thresholds from train tokens, for both criteria
    sample = _flat_sample(rng, train_idx, n_ff, settings.quantile_samples)
    thresholds = np.quantile(abs_a.reshape(-1)[sample], levels).astype(np.float64)
    thresholds_gu = np.quantile(abs_h.reshape(-1)[sample], levels).astype(np.float64)
    # never below the exact zero pattern (ReLU); level 0 means "skip exact zeros only"
    thresholds = np.where(levels > 0, np.maximum(thresholds, 0.0), 0.0)
    thresholds_gu = np.where(levels > 0, np.maximum(thresholds_gu, 0.0), 0.0)

    ho_a, ho_h = abs_a[ho_idx], abs_h[ho_idx]
    sparsity_ho = np.array([np.mean(ho_a <= t) for t in thresholds])
    sparsity_ho_gu = np.array([np.mean(ho_h <= t) for t in thresholds_gu])

    # FFN output error on a subset of held-out tokens
    err_idx = ho_idx[: settings.n_error_tokens]
    h_err = h[err_idx]
    y_norm = float(np.linalg.norm(h_err @ down.T))
    ffn_error = np.array([_skip_error(h_err, abs_a[err_idx] <= t, down, y_norm) for t in thresholds])
    ffn_error_gu = np.array([_skip_error(h_err, abs_h[err_idx] <= t, down, y_norm) for t in thresholds_gu])

    freq = np.stack([np.mean(abs_a > t, axis=0) for t in thresholds]).astype(np.float32)
    mag = np.mean(abs_h, axis=0).astype(np.float32)

    return LayerAnalysis(
        layer=layer,
        n_embd=n_embd,
        n_ff=n_ff,
        activation=activation,
        levels=levels,
        n_train=int(train_idx.size),
        n_heldout=int(ho_idx.size),
        thresholds=thresholds,
        sparsity_heldout=sparsity_ho,
        ffn_error=ffn_error,
        thresholds_gate_up=thresholds_gu,
        sparsity_heldout_gate_up=sparsity_ho_gu,
        ffn_error_gate_up=ffn_error_gu,
        natural_sparsity=natural,
        freq=freq,
        mag=mag,
        gate_check_error=check_error,
    )


def hot_first_order(freq: np.ndarray, mag: np.ndarray) -> np.ndarray:
    """Neuron order, most frequently active first; ties by larger mean magnitude, then index."""
    n = freq.size
    return np.lexsort((np.arange(n), -mag.astype(np.float64), -freq.astype(np.float64))).astype(np.int32)


# --------------------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------------------


def _flat_sample(rng: np.random.Generator, rows: np.ndarray, n_cols: int, k: int) -> np.ndarray:
    """Flat indices into an (N, n_cols) array, restricted to ``rows``: all of them if there are
    at most ``k``, else ``k`` drawn uniformly (with replacement, seeded)."""
    total = rows.size * n_cols
    if total <= k:
        return (rows[:, None] * n_cols + np.arange(n_cols)[None, :]).reshape(-1)
    flat = rng.integers(0, total, size=k)
    return rows[flat // n_cols] * n_cols + flat % n_cols


def _skip_error(h: np.ndarray, skipped: np.ndarray, down: np.ndarray, y_norm: float) -> float:
    """||down·(h ⊙ skipped)|| / ||down·h||: relative L2 error of y when the skipped neurons are left out."""
    if y_norm == 0.0 or not skipped.any():
        return 0.0
    return float(np.linalg.norm(np.where(skipped, h, 0.0) @ down.T) / y_norm)
