"""Per-layer neuron statistics, sparsity thresholds and activation predictors (NumPy).

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

Predictor: the rank-r linear map minimising E||gate·x - A·B·x||² over the profiled inputs: with
C = E[x xᵀ] = L Lᵀ, the top-r left singular vectors U_r of gate·L give A = U_r, B = U_rᵀ·gate
(the covariance-weighted truncated SVD; nested in r, so one factorisation serves every rank).
A neuron is predicted active when |act(A_i·B·x)| > tau, with tau calibrated on train tokens for
a target recall; recall and precision of the active set are then measured on held-out tokens.

All random choices use a fixed seed: the same input gives the same output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamaflash import sidecar_format as fmt
from llamaflash.converters.llama_runner import activation_fn


@dataclass(frozen=True)
class AnalysisSettings:
    """Knobs of :func:`analyse_layer`."""

    #: target sparsities at which thresholds, errors and predictor quality are computed
    levels: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    #: predictor ranks tried (those >= n_embd are dropped); () = no predictors
    ranks: tuple[int, ...] = (16, 64, 256)
    #: recall of the active set the predictor threshold is calibrated for (on train tokens)
    recall_target: float = 0.95
    #: held-out tokens on which the FFN output error is measured
    n_error_tokens: int = 256
    #: held-out tokens on which predictor recall/precision are measured
    n_predictor_tokens: int = 256
    #: (token, neuron) values sampled for quantiles
    quantile_samples: int = 1 << 20
    seed: int = 0


@dataclass
class PredictorQuality:
    """Quality of the rank-``rank`` predictor at every level (arrays over levels)."""

    rank: int
    tau: np.ndarray             # predictor threshold on |act(score)|
    recall: np.ndarray          # held-out: |predicted & active| / |active|
    precision: np.ndarray       # held-out: |predicted & active| / |predicted|
    mass_recall: np.ndarray     # held-out: sum h² over predicted & active / sum h² over active
    predicted: np.ndarray       # held-out fraction of neurons predicted active


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
    thresholds: np.ndarray            # t_s on |act(g)|
    sparsity_heldout: np.ndarray      # fraction inactive on held-out tokens at t_s
    ffn_error: np.ndarray             # rel. L2 error of y, inactive neurons skipped (held-out)
    thresholds_gate_up: np.ndarray    # alternative criterion |act(g)·u|
    sparsity_heldout_gate_up: np.ndarray
    ffn_error_gate_up: np.ndarray
    natural_sparsity: float           # fraction with act(g) == 0 exactly (ReLU: the zero pattern)
    freq: np.ndarray                  # (levels, n_ff): fraction of all tokens active at t_s
    mag: np.ndarray                   # (n_ff,): mean |h|
    gate_check_error: float | None = None
    pred_in: np.ndarray | None = None     # B (r_max, n_embd), float32
    pred_out: np.ndarray | None = None    # A (n_ff, r_max), base neuron order
    predictors: list[PredictorQuality] = field(default_factory=list)

    def level_index(self, sparsity: float) -> int:
        idx = int(np.argmin(np.abs(self.levels - sparsity)))
        if abs(self.levels[idx] - sparsity) > 1e-6:
            raise KeyError(f"level {sparsity} was not analysed (levels: {self.levels.tolist()})")
        return idx

    def predictor(self, rank: int) -> PredictorQuality:
        return next(p for p in self.predictors if p.rank == rank)


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

    g = x @ gate.T                       # (N, n_ff)
    a = act(g)                           # act(g)
    h = a * (x @ up.T)                   # coefficient of each down column
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

    result = LayerAnalysis(
        layer=layer, n_embd=n_embd, n_ff=n_ff, activation=activation, levels=levels,
        n_train=int(train_idx.size), n_heldout=int(ho_idx.size),
        thresholds=thresholds, sparsity_heldout=sparsity_ho, ffn_error=ffn_error,
        thresholds_gate_up=thresholds_gu, sparsity_heldout_gate_up=sparsity_ho_gu,
        ffn_error_gate_up=ffn_error_gu, natural_sparsity=natural, freq=freq, mag=mag,
        gate_check_error=check_error,
    )
    del abs_h
    ranks = sorted(r for r in settings.ranks if 0 < r < n_embd)
    if ranks:
        _fit_predictors(result, x, train_idx, ho_idx, gate, abs_a, h, thresholds, ranks, act, settings, rng)
    return result


def train_predictor(x_train: np.ndarray, gate: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The rank-``rank`` predictor of gate·x from inputs like ``x_train``: (B (rank, n_embd),
    A (n_ff, rank)) minimising the mean of ||gate·x - A·B·x||² over ``x_train`` (see module doc)."""
    x32 = np.ascontiguousarray(x_train, dtype=np.float32)
    cov = (x32.T @ x32).astype(np.float64) / max(1, x32.shape[0])
    root = _covariance_root(cov)                                         # cov ≈ root rootᵀ
    m = gate.astype(np.float32) @ root.astype(np.float32)                # (n_ff, n_embd)
    s2, v = np.linalg.eigh((m.T @ m).astype(np.float64))                 # ascending
    top = np.argsort(s2)[::-1][:rank]
    s = np.sqrt(np.clip(s2[top], 1e-30, None))
    u = (m.astype(np.float64) @ v[:, top]) / s               # (n_ff, rank), orthonormal columns
    b = u.T @ gate.astype(np.float64)                        # (rank, n_embd)
    return b.astype(np.float32), u.astype(np.float32)


def _covariance_root(cov: np.ndarray) -> np.ndarray:
    """A square root L of the covariance (cov ≈ L Lᵀ): Cholesky with a tiny ridge, or, when the
    covariance is singular (fewer samples than dimensions, e.g. the last layer), its eigen root."""
    ridge = 1e-6 * max(float(np.mean(np.diag(cov))), 1e-30)
    try:
        return np.linalg.cholesky(cov + ridge * np.eye(cov.shape[0]))
    except np.linalg.LinAlgError:
        lam, q = np.linalg.eigh(cov)
        return q * np.sqrt(np.clip(lam, 0.0, None))


def predictor_quality(
    predicted: np.ndarray, active: np.ndarray, h2: np.ndarray | None = None,
) -> tuple[float, float, float, float]:
    """(recall, precision, mass recall, predicted fraction) of boolean ``predicted`` against the
    true ``active`` set (same shapes); mass recall weighs each active neuron by ``h2`` (its h²)."""
    hit = np.count_nonzero(predicted & active)
    n_active = np.count_nonzero(active)
    n_pred = np.count_nonzero(predicted)
    recall = hit / n_active if n_active else 1.0
    precision = hit / n_pred if n_pred else 1.0
    mass = 1.0
    if h2 is not None:
        total = float(np.sum(h2[active]))
        mass = float(np.sum(h2[predicted & active])) / total if total > 0 else 1.0
    return float(recall), float(precision), float(mass), float(n_pred / predicted.size)


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


def _fit_predictors(
    result: LayerAnalysis, x: np.ndarray, train_idx: np.ndarray, ho_idx: np.ndarray, gate: np.ndarray,
    abs_a: np.ndarray, h: np.ndarray, thresholds: np.ndarray, ranks: list[int], act,
    settings: AnalysisSettings, rng: np.random.Generator,
) -> None:
    """Fit the predictor once at the largest rank; for each rank (nested truncations) and level,
    calibrate tau on train tokens and measure recall/precision on held-out tokens."""
    r_max = ranks[-1]
    b, a_mat = train_predictor(x[train_idx], gate, r_max)
    result.pred_in, result.pred_out = b, a_mat
    k = settings.n_predictor_tokens
    fit_idx = np.sort(rng.choice(train_idx, size=min(k, train_idx.size), replace=False))
    eval_idx = ho_idx[:k]
    z_fit, z_ho = x[fit_idx] @ b.T, x[eval_idx] @ b.T     # (k, r_max)
    fit_abs_a, ho_abs_a = abs_a[fit_idx], abs_a[eval_idx]
    ho_h2 = np.square(h[eval_idx])
    est_fit = np.zeros(fit_abs_a.shape, dtype=np.float32)  # estimated gate·x
    est_ho = np.zeros(ho_abs_a.shape, dtype=np.float32)
    done = 0
    for rank in ranks:  # nested: add components done..rank to the estimate
        est_fit += z_fit[:, done:rank] @ a_mat[:, done:rank].T
        est_ho += z_ho[:, done:rank] @ a_mat[:, done:rank].T
        done = rank
        s_fit, s_ho = np.abs(act(est_fit)), np.abs(act(est_ho))
        q = PredictorQuality(rank=rank, **{name: np.zeros(len(thresholds)) for name in
                                           ("tau", "recall", "precision", "mass_recall", "predicted")})
        for i, t in enumerate(thresholds):
            active_fit = fit_abs_a > t
            if not active_fit.any():
                q.tau[i], q.recall[i], q.precision[i], q.mass_recall[i], q.predicted[i] = 0.0, 1.0, 1.0, 1.0, 0.0
                continue
            q.tau[i] = float(np.quantile(s_fit[active_fit], 1.0 - settings.recall_target))
            q.recall[i], q.precision[i], q.mass_recall[i], q.predicted[i] = predictor_quality(
                s_ho > q.tau[i], ho_abs_a > t, ho_h2)
        result.predictors.append(q)
