"""The next-layer predictor study (llamaflash.bench.predictor_study): its math against NumPy
references, and its capture against the router applied to the captured FFN inputs."""

from __future__ import annotations

import numpy as np
import pytest

from llamaflash.bench import predictor_study as ps


def test_ridge_recovers_a_known_linear_map():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 16))
    W, b = rng.standard_normal((16, 8)), rng.standard_normal(8)
    Y = X @ W + b + 1e-6 * rng.standard_normal((500, 8))
    fit = ps.ridge_fits(X, Y, scales=(1e-9,))[0]
    np.testing.assert_allclose(fit.W, W, atol=1e-4)
    np.testing.assert_allclose(fit.b, b, atol=1e-4)
    np.testing.assert_allclose(fit(X), Y, atol=1e-4)


def test_ridge_with_a_prior_shrinks_towards_it():
    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((50, 6)), rng.standard_normal((50, 3))
    prior = rng.standard_normal((6, 3))
    strong = ps.ridge_fits(X, Y, scales=(1e9,), prior=prior)[0]
    np.testing.assert_allclose(strong.W, prior, atol=1e-6)
    # λ → 0: the prior no longer matters (same least-squares solution)
    a = ps.ridge_fits(X, Y, scales=(1e-12,), prior=prior)[0]
    b = ps.ridge_fits(X, Y, scales=(1e-12,))[0]
    np.testing.assert_allclose(a.W, b.W, atol=1e-6)


def test_top_k_breaks_ties_towards_the_lower_expert():
    scores = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    assert ps.top_k(scores, 3).tolist() == [[1, 2, 4]]


def test_recall_curve_equals_set_intersections():
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((40, 12))
    routed = np.stack([rng.choice(12, 3, replace=False) for _ in range(40)]).astype(np.int32)
    curve = ps.recall_curve(scores, routed)
    for k in range(1, 13):
        ref = np.mean([len(set(np.argsort(-s)[:k]) & set(r)) / 3 for s, r in zip(scores, routed)])
        assert curve[k - 1] == pytest.approx(ref, abs=1e-12)
    assert curve[-1] == pytest.approx(1.0)


TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
    "step. def add(a, b):\n    return a + b\nTo be or not to be, that is the question.\n"
)


@pytest.fixture(scope="module")
def tiny_capture(tiny_moe_factory):
    path = tiny_moe_factory("qwen3moe", "shaped")
    return ps.capture_text(path, TEXT, n_tokens=48, seq_len=24, n_threads=1), ps.router_matrices(path)


def test_capture_is_the_router_input_and_its_selection(tiny_capture):
    cap, routers = tiny_capture
    assert cap.layers == sorted(routers) and len(cap.layers) >= 2
    n = cap.follows.size
    assert n >= 24 and not cap.follows[0]
    for il in cap.layers:
        x, logits, routed = cap.x[il], cap.logits[il], cap.routed[il]
        assert x.shape[0] == logits.shape[0] == routed.shape[0] == n
        # the captured FFN input is what llama.cpp's router multiplies (f32 router: rounding only)
        np.testing.assert_allclose(x @ routers[il].T, logits, rtol=1e-4, atol=1e-4 * np.abs(logits).max())
        # llama.cpp's selection is the top n_used of those logits
        top = ps.top_k(logits, routed.shape[1])
        assert (np.sort(top, axis=1) == np.sort(routed, axis=1)).all()


def test_lookahead_recall_equals_a_numpy_router(tiny_capture):
    cap, routers = tiny_capture
    result = ps.study(cap, cap, routers)
    n_used = result["n_used"]
    keep = cap.follows
    for a, b in zip(cap.layers, cap.layers[1:]):
        x, routed = cap.x[a][keep], cap.routed[b][keep]
        for k in (n_used, n_used + 2):
            ref = []
            for xt, rt in zip(x, routed):
                logits = [float(np.dot(row, xt)) for row in routers[b]]  # predict_next: router_e · x
                best = sorted(range(len(logits)), key=lambda e: (-logits[e], e))[:k]
                ref.append(len(set(best) & set(rt.tolist())) / n_used)
            # the result holds recalls rounded to 6 decimals
            assert result["pairs"][f"{a}->{b}"]["lookahead"][k - 1] == pytest.approx(np.mean(ref), abs=5e-7)
    # every method reaches recall 1 when it reads every expert
    for m in ps.METHODS:
        assert result["mean_recall"][m][-1] == pytest.approx(1.0)
