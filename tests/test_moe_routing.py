"""The MoE routing recorder (llamaflash.converters.moe_routing) against llama.cpp's own router
logits, and the routing statistics (moe_routing_stats) against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from synth import synthetic_text

from llamaflash.converters import moe_routing_stats as st
from llamaflash.converters.llama_runner import Hook, LlamaRunner
from llamaflash.converters.moe_routing import RoutingRecorder, RoutingTrace

# -- statistics on a hand-made trace ----------------------------------------------------------

#: 4 tokens, 2 experts each, of 4 experts
IDS = np.array([[0, 1], [1, 2], [2, 3], [0, 1]])


def test_counts_and_top_k_share():
    assert st.expert_counts(IDS, 4).tolist() == [2, 3, 2, 1]
    assert st.top_k_share(IDS, 4, 1) == pytest.approx(3 / 8)
    assert st.top_k_share(IDS, 4, 2) == pytest.approx(5 / 8)
    assert st.top_k_share(IDS, 4, 4) == pytest.approx(1.0)
    assert st.top_k_share(np.zeros((0, 2), int), 4, 2) == 0.0


def test_reuse_counts_only_pairs_inside_a_sequence():
    # shared with the previous token: 1 of 2, 1 of 2, 0 of 2
    assert st.reuse_rate(IDS) == pytest.approx(2 / 6)
    # a new sequence starts at token 2: only tokens 1 and 3 have a predecessor
    assert st.reuse_rate(IDS, np.array([False, True, False, True])) == pytest.approx(1 / 4)
    assert st.reuse_rate(np.array([[5, 6], [6, 5]])) == 1.0


def test_layer_transitions():
    b = np.array([[3], [3], [0], [1]])
    m = st.layer_transitions(IDS, b, 4)
    want = np.zeros((4, 4), int)
    for i, j in [(0, 3), (1, 3), (1, 3), (2, 3), (2, 0), (3, 0), (0, 1), (1, 1)]:
        want[i, j] += 1
    np.testing.assert_array_equal(m, want)


def test_lru_hit_rate_with_and_without_pinned_experts():
    # slots 2, LRU: hits are token 1's expert 1 and token 2's expert 2
    assert st.lru_hit_rate(IDS, 2) == pytest.approx(2 / 8)
    # expert 1 pinned, one LRU slot: hits 1 (t0), 1 (t1), 2 (t2), 1 (t3)
    assert st.lru_hit_rate(IDS, 2, pinned=[1]) == pytest.approx(4 / 8)
    assert st.lru_hit_rate(IDS, 4) == pytest.approx(4 / 8)  # only cold misses
    assert st.lru_hit_rate(IDS, 0) == 0.0
    with pytest.raises(ValueError, match="do not fit"):
        st.lru_hit_rate(IDS, 1, pinned=[0, 1])


def test_summarize_a_trace():
    trace = RoutingTrace({0: IDS, 1: IDS[::-1].copy()}, 4, np.arange(4, dtype=np.int32), np.array([0, 2]))
    s = st.summarize(trace, k=2, cache_slots=[2, 4], pin_top=1)
    assert s["n_tokens"] == 4 and s["n_sequences"] == 2 and s["random_reuse"] == 0.5
    assert s["layers"][0]["reuse"] == pytest.approx(1 / 4)
    assert s["layers"][0]["top_k_share"] == pytest.approx(5 / 8)
    assert s["layers"][0]["lru"][2] == pytest.approx(2 / 8)
    assert s["layers"][0]["pinned_lru"][2] == pytest.approx(4 / 8)
    assert s["top_k_share"]["mean"] == pytest.approx(5 / 8)


def test_trace_rejects_inconsistent_data():
    with pytest.raises(ValueError, match="outside"):
        RoutingTrace({0: IDS}, 3, np.arange(4), np.array([0]))
    with pytest.raises(ValueError, match="shape"):
        RoutingTrace({0: IDS}, 4, np.arange(5), np.array([0]))
    with pytest.raises(ValueError, match="sequence_starts"):
        RoutingTrace({0: IDS}, 4, np.arange(4), np.array([1]))


# -- the recorder on synthetic models ---------------------------------------------------------


class _RouterLogits(Hook):
    """llama.cpp's router logits (ffn_moe_logits-L, float32 [n_tokens, n_expert]) per layer."""

    def __init__(self):
        self.logits = {}

    def wants(self, kind, layer):
        return kind == "ffn_moe_logits"

    def seen(self, kind, layer, data):
        self.logits[layer] = data.copy()


def test_recorded_experts_are_llama_cpp_top_k_of_its_router_logits(tiny_moe_factory):
    path = tiny_moe_factory("qwen3moe", "shaped")
    with RoutingRecorder(path, n_ctx=256, n_batch=64) as rec:
        tokens = rec.tokenize(synthetic_text(150, seed=3))[:200]
        trace = rec.record([tokens[:130], tokens[130:]])
    assert trace.n_tokens == tokens.size
    assert trace.sequence_starts.tolist() == [0, 130]
    assert trace.layers == [0, 1, 2]
    assert trace.n_expert == 8 and trace.n_used == 2
    np.testing.assert_array_equal(trace.tokens, tokens)
    for ids in trace.experts.values():
        assert ids.shape == (tokens.size, 2) and ids.min() >= 0 and ids.max() < 8
        assert (ids[:, 0] != ids[:, 1]).all()
    # reference: the same first sequence in one ubatch, router logits read as F32, top-2 by NumPy
    with LlamaRunner(path, max_ctx=256) as runner:
        hook = _RouterLogits()
        runner.decode(tokens[:130], hook)
    for layer, logits in hook.logits.items():
        want = np.sort(np.argsort(-logits, axis=1, kind="stable")[:, :2], axis=1)
        got = np.sort(trace.experts[layer][:130], axis=1)
        np.testing.assert_array_equal(got, want)


def test_recording_is_deterministic_and_splits_long_sequences(tiny_moe_factory):
    path = tiny_moe_factory("llama", "uniform")
    with RoutingRecorder(path, n_ctx=64, n_batch=32) as rec:
        tokens = rec.tokenize(synthetic_text(120, seed=4))[:150]
        a = rec.record(tokens)
        b = rec.record(tokens)
    assert a.sequence_starts.tolist() == list(range(0, 150, 64))
    assert a.n_tokens == 150
    for layer in a.layers:
        np.testing.assert_array_equal(a.experts[layer], b.experts[layer])


def test_shaped_routing_raises_reuse_and_skew_over_uniform(tiny_moe_factory):
    """Tiny preset (8 experts, 2 used; random reuse 0.25), 1000 tokens of synthetic text: measured
    reuse 0.27 (uniform) vs 0.35 (shaped), top-2 share 0.34 vs 0.45 (deterministic for a build;
    the tiny model's 16-wide heads make the positional attention blurrier than the bench model's).
    Required: reuse at least 0.05 higher, top-2 share at least 0.08 higher."""
    text = synthetic_text(1200, seed=5)
    stats = {}
    for regime in ("uniform", "shaped"):
        with RoutingRecorder(tiny_moe_factory("qwen3moe", regime), n_ctx=512, n_batch=512) as rec:
            tokens = rec.tokenize(text)[:1000]
            trace = rec.record([tokens[:500], tokens[500:]])
        cont = trace.continues_previous()
        stats[regime] = (
            np.mean([st.reuse_rate(trace.experts[lay], cont) for lay in trace.layers]),
            np.mean([st.top_k_share(trace.experts[lay], 8, 2) for lay in trace.layers]),
        )
    assert stats["uniform"][0] < 0.33
    assert stats["shaped"][0] > stats["uniform"][0] + 0.05, stats
    assert stats["shaped"][1] > stats["uniform"][1] + 0.08, stats


def test_recorder_refuses_bad_input(tiny_llama_q8_0, tiny_moe_factory, tmp_path):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        RoutingRecorder(tiny_llama_q8_0)
    with pytest.raises(FileNotFoundError):
        RoutingRecorder(tmp_path / "missing.gguf")
    with RoutingRecorder(tiny_moe_factory("llama", "uniform"), n_ctx=64) as rec:
        with pytest.raises(ValueError, match="token ids"):
            rec.record(np.array([1, 2, 10**7]))
