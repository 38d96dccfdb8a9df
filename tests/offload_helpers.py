"""Settings and a hand-made plan for tests that run the flash-offload engine with a forced cache
configuration (the ``converted`` and ``forced_plan`` fixtures are in conftest.py; the planner's own
sizing is tested in test_planner.py)."""

from __future__ import annotations

import types

import numpy as np

from llamaflash import _native
from llamaflash.files.sidecar import read_layer_vectors, read_sidecar

# offload runs batch-invariant (flash attention, plain weights; plugin/runtime/speculative.py): so do the
# in-memory references
KW = dict(n_ctx=128, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, seed=0, flash_batch_invariant=True)
C = 32  # cluster size: n_ff 192 → 6 clusters per layer


def make_plan(sidecar, hot_per_layer: int, prefetch_layers: int = 1, extra_cold: int = 0, stream_gate: bool = False):
    """A plan with the fields of planner.OffloadPlan the engine reads: clusters of C neurons, the
    ``hot_per_layer`` of highest summed frequency pinned in every layer, the least cold region
    (plus ``extra_cold`` slots)."""
    info = read_sidecar(sidecar)
    probs, hot = [], []
    for layer in info.layers:
        f = read_layer_vectors(info, layer)["freq"].astype(np.float64)
        nc = -(-len(f) // C)
        padded = np.zeros(nc * C)
        padded[: len(f)] = f
        probs.append((1 - np.prod(1 - padded.reshape(nc, C), axis=1)).astype(np.float32))
        hot.append(np.argsort(-padded.reshape(nc, C).sum(1))[:hot_per_layer].astype(np.int32))
    n_clusters = max(len(p) for p in probs)
    slot_bytes = _native.cache_slot_bytes(
        C, max(lay.up_row_bytes for lay in info.layers), max(lay.down_t_row_bytes for lay in info.layers)
    )
    plan = types.SimpleNamespace(
        slot_bytes=slot_bytes,
        hot_slots=sum(len(h) for h in hot),
        hot_clusters=hot,
        cluster_prob=probs,
        cluster_size=C,
        cold_slots=(1 + prefetch_layers) * n_clusters + extra_cold,
        prefetch_layers=prefetch_layers,
        prefetch_min_prob=0.5,
        queue_depth=8,
        n_batch=64,
        n_ubatch=64,
        budget_bytes=64 << 20,
        stream_gate=stream_gate,
        draft_copy=False,
        # nothing read per token only where every cluster is pinned (a marker otherwise, not a prediction)
        flash_bytes_per_token=0.0 if all(len(h) == len(p) for h, p in zip(hot, probs)) else 1.0,
    )
    plan.to_dict = lambda: {"cluster_size": C, "hot": [len(h) for h in hot]}
    return plan


#: Speculative decoding under a forced plan (test_speculative.py, test_draft_copy.py).
PROMPT = "Once upon a time, in a land far away, there lived a"
N_GEN = 40
SELF_DRAFT = {"adaptive": False, "max_draft": 4, "prompt_lookup": False, "min_confidence": 0.0}


def greedy(llm, prompt: str = PROMPT, n: int = N_GEN) -> list:
    """The first ``n`` tokens ``llm.generate`` gives for ``prompt`` at temperature 0."""
    out = []
    for tok in llm.generate(llm.tokenize(prompt.encode()), temp=0, top_k=1):
        out.append(tok)
        if len(out) >= n:
            break
    return out
