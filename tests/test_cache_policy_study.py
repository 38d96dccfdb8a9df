"""The cache policy study (llamaflash.bench.cache_policy_study): its simulators on hand-made traces
against hand-computed hits, and the one-pass LRU stack against the explicit LRU simulator."""

from __future__ import annotations

import numpy as np
import pytest

from llamaflash.bench import cache_policy_study as cps

#: single-expert requests, the textbook sequence: 1 2 3 4 1 2 5 1 2 3 4 5
TEXTBOOK = np.array([[1], [2], [3], [4], [1], [2], [5], [1], [2], [3], [4], [5]])


def test_belady_on_the_textbook_sequence():
    # 3 slots: 7 misses, 5 hits (the textbook's 7 faults). t3 needs 4 with {1,2,3} resident: next uses 1@4 2@5 3@9 -> evict 3; t6 needs 5 with {1,2,4}:
    # next uses 1@7 2@8 4@10 -> evict 4; t9 needs 3 with {1,2,5}: 1,2 never again, 5@11 -> evict 1
    # (ties: lower expert first); t10 needs 4 with {2,3,5}: 2,3 never again -> evict 2; t11: 5 hit.
    assert cps.simulate_belady(TEXTBOOK, 3, 6) == 5
    # 4 slots: misses 1 2 3 4, 5 (evicts 4: 1@7 2@8 3@9 4@10), 4 (evicts 1 or 2, never used again) -> 6 hits
    assert cps.simulate_belady(TEXTBOOK, 4, 6) == 6


def test_lru_on_the_textbook_sequence():
    assert cps.simulate_lru(TEXTBOOK, 3) == 2  # hits only at t7 (1) and t8 (2): 10 faults
    assert cps.simulate_lru(TEXTBOOK, 4) == 4  # t4, t5, t7, t8: 8 faults
    assert cps.simulate_lru(TEXTBOOK, 5) == 7  # only the 5 compulsory misses


def test_next_uses():
    nxt = cps.next_uses(np.array([[0, 1], [1, 2], [0, 2]]), 4)
    assert nxt.tolist() == [[2, 1, 1, 3], [2, 3, 2, 3], [3, 3, 3, 3]]


def test_a_request_never_evicts_its_own_experts():
    # 2 slots, requests of 2: {0,1} then {1,2}: 1 is a hit, 2 must evict 0 (not 1, also LRU-old)
    req = np.array([[0, 1], [1, 2], [1, 3]])
    assert cps.simulate_lru(req, 2) == 2  # 1 hit at t1 and t2
    assert cps.simulate_belady(req, 2, 4) == 2
    # a hit that is the least recent is touched before the misses take victims
    req = np.array([[0, 1], [2, 3], [0, 4], [2, 0]])
    # 3 slots, least recent first: t0 {0,1} -> [1, 0] (first-ranked most recent); t1 {2,3} misses,
    # evicts 1 -> [0, 3, 2]; t2 {0,4}: 0 hits, 4 evicts 3 (0 is in the request) -> [2, 4, 0];
    # t3 {2,0}: both hit
    assert cps.simulate_lru(req, 3) == 3


def test_pinned_experts_are_hits_and_never_evicted():
    req = np.array([[0, 1], [2, 3], [0, 4], [5, 0]])
    # 3 slots, 0 pinned: 2 LRU slots; t0 1 misses; t1 {2,3} evict 1; t2 4 evicts 3; t3 5 misses
    assert cps.simulate_lru(req, 3, pinned=[0]) == 3
    assert cps.simulate_lru(req, 3, pinned=[0], warmup=2) == 2
    assert cps.static_hits(req, [0, 5]) == 4
    assert cps.static_hits(req, [0, 5], warmup=3) == 2


def test_lru_stack_matches_the_explicit_simulator():
    rng = np.random.default_rng(0)
    n_expert, k = 12, 3
    p = rng.dirichlet(np.full(n_expert, 0.5))
    req = np.stack([rng.choice(n_expert, k, replace=False, p=p) for _ in range(200)])
    rank = np.argsort(-p, kind="stable")
    rank_of = np.argsort(rank)
    stack = cps.lru_stack(req, rank)
    for n_pin in (0, 1, 3):
        for s in range(k + n_pin, n_expert + 1):
            ref = cps.simulate_lru(req, s, pinned=rank[:n_pin])
            assert cps.pinned_lru_hits(stack, req, rank_of, s, n_pin) == ref, (s, n_pin)
            ref = cps.simulate_lru(req, s, pinned=rank[:n_pin], warmup=50)
            assert cps.pinned_lru_hits(stack[50:], req[50:], rank_of, s, n_pin) == ref


def test_belady_is_never_below_lru_and_all_hit_when_everything_fits():
    rng = np.random.default_rng(1)
    req = np.stack([rng.choice(10, 2, replace=False) for _ in range(150)])
    for s in range(2, 11):
        assert cps.simulate_belady(req, s, 10) >= cps.simulate_lru(req, s)
    distinct = len(np.unique(req))
    assert cps.simulate_belady(req, 10, 10) == req.size - distinct


def test_allocations():
    assert cps.allocate_proportional([1.0, 1.0, 2.0], 14, 2, 10).tolist() == [4, 4, 6]
    # largest remainder: 10 above lo as 2.5, 2.5, 5 -> the first .5 gets the spare slot
    assert cps.allocate_proportional([1.0, 1.0, 2.0], 16, 2, 10).tolist() == [5, 4, 7]
    # a layer capped at hi hands its share to the others
    assert cps.allocate_proportional([10.0, 1.0, 1.0], 15, 2, 5).tolist() == [5, 5, 5]
    with pytest.raises(ValueError):
        cps.allocate_proportional([1.0, 1.0], 30, 2, 10)
    # the DP puts slots where the curve gains: layer 0 saturates at 3 slots, layer 1 keeps gaining
    curves = [np.array([0, 5, 6, 6, 6]), np.array([0, 2, 4, 6, 8])]
    assert cps.allocate_best(curves, 8, 2).tolist() == [3, 5]
    assert cps.entropy_size([5, 5, 0, 0]) == pytest.approx(2.0)


def test_study_on_a_small_trace():
    rng = np.random.default_rng(2)
    n_expert, k = 16, 2
    p = rng.dirichlet(np.full(n_expert, 0.7))
    routed = {il: np.stack([rng.choice(n_expert, k, replace=False, p=p) for _ in range(120)]) for il in (0, 1)}
    counts = {il: np.bincount(routed[il].ravel(), minlength=n_expert) for il in routed}
    trace = cps.Trace(routed, n_expert, np.ones(120, dtype=bool))
    r = cps.study(trace, counts, [4, 8], warmup=20, log=lambda m: None)
    for s in ("4", "8"):
        h = r["slots"][s]["hit_rate"]
        assert h["belady"] >= max(h["engine"], h["lru"]) - 1e-12
        # the engine's pinned experts (planner's count) simulated explicitly
        n_pin = r["slots"][s]["planner_pinned"]
        rank = np.argsort(-counts[0], kind="stable")
        ref = cps.simulate_lru(routed[0], int(s), pinned=rank[:n_pin], warmup=20) / (100 * k)
        assert r["slots"][s]["per_layer"]["engine"][0] == pytest.approx(ref, abs=1e-5)
        alloc = r["slots"][s]["allocation"]
        assert alloc["trace_optimum"]["hit_rate"] >= alloc["equal"]["hit_rate"] - 1e-12
    assert "4" in cps.table(r)


def test_prefetch_fills_lru_victims_before_the_request():
    req = np.array([[0, 1], [2, 3], [0, 2]])
    guess = np.array([[0, 1], [2, 4], [0, 3]])
    # 3 slots, least recent first: t0 prefetches 0, 1 -> [1, 0], both requested (2 hits);
    # t1 prefetches 4 -> [1, 0, 4], then 2 evicts 1 -> [0, 4, 2]; 3 misses and evicts 0 -> [4, 3, 2];
    # t2 prefetches 0 (3 resident), evicting 4 -> [3, 2, 0]: 0 and 2 hit
    assert cps.simulate_prefetch(req, guess, 3) == (5, 5, 4)
    assert cps.simulate_prefetch(req, guess, 3, warmup=1) == (3, 3, 2)
    assert cps.simulate_lru(req, 3) == 2
    # 0 pinned: never prefetched; the other 2 slots as above -> t0 1; t1 4, 2 (evicts 1), 3 misses; t2 hits
    assert cps.simulate_prefetch(req, guess, 3, pinned=[0]) == (5, 3, 2)


def test_reuse_by_lag():
    routed = {0: np.array([[0, 1], [1, 2], [0, 1], [3, 2]])}
    one = cps.Trace(routed, 4, np.array([False, True, True, True]))
    r = cps.reuse_by_lag(one, lags=(1, 2, 8))
    assert r["1"] == pytest.approx(1 / 3) and r["2"] == pytest.approx(0.75) and "8" not in r
    # independent routing at the trace's rates q = (2, 3, 2, 1) / 4 tokens: sum q^2 / k
    assert r["independent"] == pytest.approx(1.125 / 2)
    two = cps.Trace(routed, 4, np.array([False, True, False, True]))  # pairs only inside a window
    r = cps.reuse_by_lag(two, lags=(1, 2))
    assert r["1"] == pytest.approx(0.25) and "2" not in r


def test_the_planner_pins_every_slot_but_n_used():
    from llamaflash.planning import expert_plan as ep

    assert ep.pinned_count(54, 8) == 46 and ep.pinned_count(8, 8) == 0 and ep.pinned_count(6, 8) == 0
    assert ep.pinned_experts(np.array([3, 9, 9, 1]), 2) == [1, 2]  # ties: lower expert first
