"""Next-layer expert predictors for MoE prefetch, measured on what stock llama.cpp computes.

While layer l of a one-token decode computes, the engine prefetches the experts it predicts layer
l+1 will route the token to. Its predictor ("lookahead", ``ExpertModel::predict_next``) applies the
next layer's router to this layer's FFN input x_l:

    scores = R_{l+1} · x_l            R_{l+1}: [n_expert, n_embd] f32 (blk.{l+1}.ffn_gate_inp)
    predicted = the k largest scores (ties: lower expert first), k = n_used + prefetch_extra

This module compares it with predictors fitted on calibration tokens, from the same x_l:

* "fitted": ridge regression of layer l+1's router logits on x_l, scores = x_l · W_l + b_l with
  W_l [n_embd, n_expert], b_l [n_expert]. (Fitting x_{l+1} instead and applying R_{l+1} gives the
  same predictor: the ridge solution is linear in the targets and logits_{l+1} = x_{l+1} · R_{l+1}^T.)
* "fitted-residual": the same map with the ridge penalty on W_l - R_{l+1}^T, i.e. shrunk towards
  the lookahead instead of towards zero.
* "reuse": the previous token's true logits of layer l+1 (at k = n_used: its routed experts).

Each ridge penalty is chosen per layer on the last fifth of the fit tokens (best recall at
k = n_used), then the map is refitted on all fit tokens; every metric is on held-out tokens.

Metric, per layer pair (l, l+1) and token: recall = |predicted_k ∩ routed_{l+1}| / n_used, with
routed_{l+1} llama.cpp's own selection (``ffn_moe_topk-{l+1}``); since every expert slice of a
layer has the same size, recall per expert read = hits / k (the precision the engine's
``ExpertCache::prefetch_count`` measures), and at equal k two predictors read equal bytes.

Capture: :class:`ActivationRecorder` extends the converter's routing recorder
(:mod:`llamaflash.converters.moe_routing`) with the scheduler eval callback reading, per MoE layer
L, ``ffn_norm-L`` (x_L, f32 [n_tokens, n_embd]: the FFN input, whose [n_embd, 1, n_tokens] view is
the src[1] of the expert MUL_MAT_IDs the engine predicts from) and ``ffn_moe_logits-L`` (f32
[n_tokens, n_expert]), with the weights in plain CPU buffers (no repacking).

Usage::

    python -m llamaflash.bench.predictor_study MODEL.gguf [--fit-tokens 2048] [--eval-tokens 512]
        [--label NAME] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

#: ridge penalties tried, as multiples of the mean eigenvalue of the centred X^T X
RIDGE_SCALES = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
#: extra experts read beyond n_used, per table column
EXTRA_K = (0, 2, 4)
METHODS = ("lookahead", "fitted", "fitted-residual", "reuse")


# --------------------------------------------------------------------------- capture


@dataclass(frozen=True)
class Capture:
    """Per MoE layer L: ``x[L]`` f32 [n_tokens, n_embd] (FFN input), ``logits[L]`` f32
    [n_tokens, n_expert] (router logits), ``routed[L]`` i32 [n_tokens, n_used] (llama.cpp's
    selection); ``follows`` bool [n_tokens]: token i continues token i-1's sequence."""

    x: dict[int, np.ndarray]
    logits: dict[int, np.ndarray]
    routed: dict[int, np.ndarray]
    follows: np.ndarray

    @property
    def layers(self) -> list[int]:
        return sorted(self.routed)


@contextlib.contextmanager
def _plain_weights() -> Iterator[None]:
    """llama.cpp weights in plain CPU buffers (use_extra_bufts = false) while a model loads, for both
    names of llama_model_default_params (llama_cpp.llama_cpp and its re-export in llama_cpp)."""
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    from llamaflash.runtime.speculative import batch_invariant_weights

    exported = llama_cpp.llama_model_default_params
    with batch_invariant_weights():
        llama_cpp.llama_model_default_params = raw.llama_model_default_params
        try:
            yield
        finally:
            llama_cpp.llama_model_default_params = exported


def _recorder_class():
    """:class:`ActivationRecorder` (defined on first use: it imports llama_cpp and the converters)."""
    from llamaflash.converters import moe_routing
    from llamaflash.converters.llama_runner import _P_TENSOR, _parse_name, _read_f32

    class ActivationRecorder(moe_routing.RoutingRecorder):
        """The routing recorder, also copying each MoE layer's FFN input and router logits."""

        def __init__(self, model_path, n_ctx: int = 512, n_threads: int | None = None, inputs: bool = True) -> None:
            with _plain_weights():
                super().__init__(model_path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads)
            #: the f32 tensors copied per MoE layer: the FFN input only when ``inputs``
            self.KINDS = ("ffn_norm", "ffn_moe_logits") if inputs else ("ffn_moe_logits",)
            self._f32: dict[str, dict[int, list[np.ndarray]]] = {k: {} for k in self.KINDS}

        def capture(self, sequences: list[np.ndarray]) -> Capture:
            self._f32 = {k: {} for k in self.KINDS}
            trace = self.record(sequences)
            cat = {k: {il: np.concatenate(rows) for il, rows in d.items()} for k, d in self._f32.items()}
            layers = [il for il in trace.layers if all(il in cat[k] for k in self.KINDS)]
            if trace.layers and not layers:
                raise RuntimeError(
                    f"llama.cpp computed no {' / '.join(self.KINDS)} tensors for the MoE layers: this architecture "
                    "names its FFN input or router logits differently (the study reads qwen3moe-style graphs)"
                )
            for il in layers:
                for k in self.KINDS:
                    if cat[k][il].shape[0] != trace.n_tokens:
                        raise RuntimeError(f"layer {il}: {cat[k][il].shape[0]} rows of {k}, {trace.n_tokens} tokens")
            return Capture(
                {il: cat["ffn_norm"][il] for il in layers} if "ffn_norm" in cat else {},
                {il: cat["ffn_moe_logits"][il] for il in layers},
                {il: trace.experts[il] for il in layers},
                trace.continues_previous(),
            )

        def _eval_callback(self, t_ptr: int, ask: bool, user_data: int) -> bool:
            try:
                tensor = ctypes.cast(t_ptr, _P_TENSOR).contents
                parsed = _parse_name(tensor.name)
                if parsed is not None and parsed[0] in self.KINDS:
                    if not ask:
                        self._f32[parsed[0]].setdefault(parsed[1], []).append(_read_f32(tensor, t_ptr))
                    return True
            except BaseException as exc:  # never across into C; re-raised by record()
                if self._error is None:
                    self._error = exc
                return False
            return super()._eval_callback(t_ptr, ask, user_data)

    return ActivationRecorder


def capture_text(
    model_path: Path, text: str, n_tokens: int, seq_len: int, n_threads: int | None, inputs: bool = True
) -> Capture:
    """Captures about ``n_tokens`` tokens of ``text`` in evenly spaced windows of ``seq_len``;
    without ``inputs`` the FFN inputs are not kept (``x`` empty: n_embd floats per token and layer)."""
    from llamaflash.converters import moe_routing

    with _recorder_class()(model_path, n_ctx=seq_len, n_threads=n_threads, inputs=inputs) as rec:
        return rec.capture(moe_routing.text_sequences(rec, n_tokens, seq_len, text=text))


def save_capture(cap: Capture, path: Path) -> None:
    """Writes ``cap`` to an .npz (keys x-L, logits-L, routed-L, follows)."""
    arrays = {"follows": cap.follows}
    for il in cap.layers:
        arrays.update({f"logits-{il}": cap.logits[il], f"routed-{il}": cap.routed[il]})
        if il in cap.x:
            arrays[f"x-{il}"] = cap.x[il]
    np.savez(path, **arrays)


def load_capture(path: Path) -> Capture:
    """The capture :func:`save_capture` wrote (``x`` empty when it was captured without inputs)."""
    with np.load(path) as z:
        layers = sorted(int(k.split("-")[1]) for k in z.files if k.startswith("routed-"))
        x = {il: z[f"x-{il}"] for il in layers if f"x-{il}" in z.files}
        return Capture(x, *({il: z[f"{kind}-{il}"] for il in layers} for kind in ("logits", "routed")), z["follows"])


def router_matrices(model_path: Path) -> dict[int, np.ndarray]:
    """Per MoE layer, its router as the engine holds it: f32 [n_expert, n_embd]."""
    from llamaflash.files import experts
    from llamaflash.files.gguf_header import read_gguf_header

    moe = experts.read_moe_model(read_gguf_header(model_path))
    if moe is None:
        raise ValueError(f"{model_path} has no routed expert tensors: not a Mixture-of-Experts model")
    return {ly.layer: experts.router_matrix(model_path, ly.router) for ly in moe.layers if ly.router is not None}


# --------------------------------------------------------------------------- math


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """i64 [n, k]: per row the k largest of ``scores`` [n, n_expert], best first, ties lower index
    first (as ``predict_next``)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def recall_curve(scores: np.ndarray, routed: np.ndarray) -> np.ndarray:
    """f64 [n_expert]: entry k-1 = mean over tokens of |top_k(scores) ∩ routed| / n_used, for
    scores [n, n_expert] and routed i32 [n, n_used]."""
    n, n_expert = scores.shape
    order = top_k(scores, n_expert)
    is_routed = np.zeros((n, n_expert), dtype=bool)
    np.put_along_axis(is_routed, routed.astype(np.int64), True, axis=1)
    hits = np.take_along_axis(is_routed, order, axis=1).cumsum(axis=1)
    return hits.mean(axis=0) / routed.shape[1]


@dataclass(frozen=True)
class RidgeFit:
    """scores = x · W + b; W f64 [n_embd, n_out], b f64 [n_out]; ``penalty`` the λ used."""

    W: np.ndarray
    b: np.ndarray
    penalty: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.W + self.b


class RidgeBasis:
    """The Gram matrix G = XcᵀXc (f64 [n_embd, n_embd]) of centred inputs X [n, n_embd], shared by
    every target, prior and penalty fitted on them."""

    def __init__(self, X: np.ndarray) -> None:
        X = X.astype(np.float64)
        self.x_mean = X.mean(axis=0)
        self.Xc = X - self.x_mean
        self.G = self.Xc.T @ self.Xc
        self.mean_eig = max(float(np.trace(self.G)) / self.G.shape[0], 1e-30)  # mean eigenvalue of G

    def fits(self, Y: np.ndarray, scales=RIDGE_SCALES, prior: np.ndarray | None = None) -> list[RidgeFit]:
        """Minimisers of |Xc·W - Yc|² + λ|W - prior|² (Yc centred; b = ȳ - x̄·W), one per λ =
        scale · mean_eig; Y [n, n_out], prior [n_embd, n_out] or None (0). Closed form:
        W = prior + (G + λI)⁻¹ Xcᵀ (Yc - Xc·prior)."""
        Y = Y.astype(np.float64)
        y_mean = Y.mean(axis=0)
        target = Y - y_mean if prior is None else Y - y_mean - self.Xc @ prior
        XtY = self.Xc.T @ target
        eye = np.eye(self.G.shape[0])
        out = []
        for scale in scales:
            lam = scale * self.mean_eig
            W = np.linalg.solve(self.G + lam * eye, XtY)
            if prior is not None:
                W = W + prior
            out.append(RidgeFit(W, y_mean - self.x_mean @ W, lam))
        return out


def ridge_fits(X: np.ndarray, Y: np.ndarray, scales=RIDGE_SCALES, prior: np.ndarray | None = None) -> list[RidgeFit]:
    """:meth:`RidgeBasis.fits` of X [n, n_embd] → Y [n, n_out], one per penalty scale."""
    return RidgeBasis(X).fits(Y, scales, prior)


def fit_predictors(
    X: np.ndarray, Y: np.ndarray, routed: np.ndarray, priors: dict[str, np.ndarray | None]
) -> dict[str, RidgeFit]:
    """Per named prior, the ridge map X → Y whose λ gives the best recall at k = n_used on the last
    fifth of the rows (fitted on the rest), refitted with that λ on all rows."""
    n_used = routed.shape[1]
    cut = X.shape[0] - max(1, X.shape[0] // 5)
    trial, full = RidgeBasis(X[:cut]), RidgeBasis(X)
    out = {}
    for name, prior in priors.items():
        scores = [recall_curve(f(X[cut:]), routed[cut:])[n_used - 1] for f in trial.fits(Y[:cut], prior=prior)]
        out[name] = full.fits(Y, scales=(RIDGE_SCALES[int(np.argmax(scores))],), prior=prior)[0]
    return out


def layer_scores(
    fit: Capture, held: Capture, routers: dict[int, np.ndarray], layer: int, nxt: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per method, (scores [m, n_expert], routed [m, n_used]) of layer ``nxt`` on the m held-out
    tokens that follow another token (the ones every method, reuse included, can predict)."""
    keep = held.follows
    x = held.x[layer][keep]
    routed = held.routed[nxt][keep]
    R = routers[nxt].astype(np.float32)
    fitted = fit_predictors(
        fit.x[layer], fit.logits[nxt], fit.routed[nxt], {"fitted": None, "fitted-residual": R.T.astype(np.float64)}
    )
    previous = np.roll(held.logits[nxt], 1, axis=0)[keep]
    return {
        "lookahead": (x @ R.T, routed),
        "fitted": (fitted["fitted"](x), routed),
        "fitted-residual": (fitted["fitted-residual"](x), routed),
        "reuse": (previous, routed),
    }


def study(fit: Capture, held: Capture, routers: dict[int, np.ndarray]) -> dict:
    """Recall curves per layer pair and method, and their means over the pairs (see the module doc)."""
    layers = [il for il in fit.layers if il in held.routed]
    pairs = [(a, b) for a, b in zip(layers, layers[1:]) if b in routers]
    if not pairs:
        raise ValueError("fewer than two consecutive MoE layers with routers: nothing to predict")
    per_pair = {}
    for a, b in pairs:
        scored = layer_scores(fit, held, routers, a, b)
        per_pair[f"{a}->{b}"] = {m: recall_curve(s, r) for m, (s, r) in scored.items()}
    mean = {m: np.mean([c[m] for c in per_pair.values()], axis=0).round(6).tolist() for m in METHODS}
    per_pair = {p: {m: c.round(6).tolist() for m, c in curves.items()} for p, curves in per_pair.items()}
    n_used = int(fit.routed[layers[0]].shape[1])
    return {"n_used": n_used, "n_expert": len(mean["lookahead"]), "mean_recall": mean, "pairs": per_pair}


def head(cap: Capture, n: int) -> Capture:
    """The first ``n`` tokens of ``cap``."""
    return Capture(*({il: a[:n] for il, a in d.items()} for d in (cap.x, cap.logits, cap.routed)), cap.follows[:n])


def fit_size_sweep(fit: Capture, held: Capture, routers: dict[int, np.ndarray], sizes: list[int]) -> dict:
    """Per number of fit tokens (the first n of ``fit``), each method's mean recall at k = n_used."""
    out = {}
    for n in sizes:
        r = study(head(fit, n), held, routers)
        out[str(n)] = {m: r["mean_recall"][m][r["n_used"] - 1] for m in METHODS}
    return out


def selection_agreement(cap: Capture, n_used: int) -> float:
    """Share of (token, layer) whose llama.cpp selection is the top n_used of the captured logits."""
    same = [(np.sort(top_k(cap.logits[il], n_used), 1) == np.sort(cap.routed[il], 1)).all(1) for il in cap.layers]
    return float(np.mean(same))


def reads_to_match(curve: list[float], target: float) -> int | None:
    """The smallest k whose recall reaches ``target`` (None: none does)."""
    for k, r in enumerate(curve, start=1):
        if r >= target - 1e-12:
            return k
    return None


def table(result: dict) -> str:
    """Recall (and recall per expert read) at k = n_used + extra, means over the layer pairs."""
    n_used = result["n_used"]
    ks = [n_used + e for e in EXTRA_K if n_used + e <= result["n_expert"]]
    target = result["mean_recall"]["lookahead"][n_used - 1]
    head = (
        f"{'predictor':<16}" + "".join(f"  recall@{k:<3} per-read@{k:<3}" for k in ks) + f"  k for lookahead@{n_used}"
    )
    lines = [head]
    for m in METHODS:
        curve = result["mean_recall"][m]
        cells = "".join(f"  {curve[k - 1]:9.3f} {curve[k - 1] * n_used / k:11.3f}" for k in ks)
        lines.append(f"{m:<16}{cells}  {reads_to_match(curve, target)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Captures fit and held-out tokens of MODEL, prints the table, writes the JSON."""
    from llamaflash.converters import texts
    from llamaflash.files import assets

    p = argparse.ArgumentParser(prog="python -m llamaflash.bench.predictor_study", description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--fit-tokens", type=int, default=2048, help="calibration tokens to fit on (document heads)")
    p.add_argument("--eval-tokens", type=int, default=512, help="held-out tokens (document tails)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per evaluated sequence")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--label", default="", help="what the model is, recorded in the JSON (e.g. SYNTHETIC ...)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument(
        "--captures",
        type=Path,
        default=None,
        help="folder for the captured tensors (fit.npz, held.npz): reused when present, else written",
    )
    a = p.parse_args(argv)
    if a.fit_tokens < 10 or a.eval_tokens < 2 or a.seq_len < 2:
        p.error("--fit-tokens must be >= 10, --eval-tokens and --seq-len >= 2")
    if not a.model.is_file():
        print(f"predictor_study: {a.model}: no such file", file=sys.stderr)
        return 1
    try:
        routers = router_matrices(a.model)
        fit_text = texts.default_calibration().text
        held_text = assets.held_out_text(texts.DEFAULT_CALIBRATION_TEXT, 150_000)
        captured = []
        for name, text, n in (("fit", fit_text, a.fit_tokens), ("held", held_text, a.eval_tokens)):
            saved = a.captures / f"{name}.npz" if a.captures else None
            if saved is not None and saved.is_file():
                captured.append(load_capture(saved))
                continue
            t1 = time.perf_counter()
            captured.append(capture_text(a.model, text, n, a.seq_len, a.threads))
            print(f"captured {captured[-1].follows.size} {name} tokens in {time.perf_counter() - t1:.0f} s", flush=True)
            if saved is not None:
                saved.parent.mkdir(parents=True, exist_ok=True)
                save_capture(captured[-1], saved)
        fit, held = captured
        result = study(fit, held, routers)
        n_fit = fit.follows.size
        result["fit_size_recall"] = fit_size_sweep(fit, held, routers, [n_fit // 4, n_fit // 2])
    except (ValueError, RuntimeError, OSError) as e:
        print(f"predictor_study: {e}", file=sys.stderr)
        return 1
    first = fit.layers[0]
    result.update(
        model=os.fspath(a.model),
        label=a.label,
        fit_tokens=int(fit.routed[first].shape[0]),
        eval_tokens=int(held.follows.sum()),
        fit_text=f"registry:{texts.DEFAULT_CALIBRATION_TEXT} document heads",
        eval_text=f"registry:{texts.DEFAULT_CALIBRATION_TEXT} held-out document tails",
        seq_len=a.seq_len,
        ridge_scales=list(RIDGE_SCALES),
        routed_equals_top_logits=selection_agreement(fit, result["n_used"]),
    )
    print(
        f"{a.model} ({a.label or 'unlabelled'}): {result['fit_tokens']} fit tokens, "
        f"{result['eval_tokens']} held-out tokens, {len(result['pairs'])} layer pairs"
    )
    print(table(result))
    for n, recalls in result["fit_size_recall"].items():
        print(
            f"fitted on the first {n} tokens: recall@{result['n_used']} "
            + ", ".join(f"{m} {v:.3f}" for m, v in recalls.items() if m.startswith("fitted"))
        )
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
