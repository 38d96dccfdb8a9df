"""Predicted time to first token of a flash-offload plan: the prompt's prefill, streamed.

Prefill runs the dense lane (csrc/lanes/dense_lane.h) once per micro-batch of n_ubatch prompt
tokens and layer. Each dense split of a served layer reads that layer's base up and down (and the
gate, when it is streamed) through the page cache and drops them after the split
(csrc/offload/offload_state.h), so every micro-batch streams the served FFN weights once:

    passes        = ceil(P / n_ubatch)                        P: prompt tokens
    stream_bytes  = sum over served layers of base up + down bytes (+ gate bytes when streamed)
    read_seconds  = passes * stream_bytes / PREFILL_STREAM_BYTES_PER_S
    compute       = P * macs_per_token / PREFILL_MACS_PER_S
    ttft          = read_seconds + compute                    (the splits read, then compute: no overlap)

``macs_per_token``: the multiply-accumulates of every matrix weight of the model but token_embd and
the output matrix (llama.cpp computes the output for the last token only), i.e. its elements; the
attention's own P^2 term is left out (3% of the compute at P = 1000 on Qwen2.5-1.5B).

The request the n_ubatch choice minimizes (plan_search) is one prompt of ``prompt_tokens`` tokens and
``REQUEST_DECODE_TOKENS`` decoded tokens: ttft + REQUEST_DECODE_TOKENS / decode tok/s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..files import sidecar_format as fmt

if TYPE_CHECKING:
    from .plan_budget import PlanRequest

#: Bytes per second a dense split pulls its layer's base up/down through the page cache, checksums
#: and page faults included, and multiply-accumulates per second of ggml's batched kernels on the
#: plain weights (two cores). Fitted (a line through two points) to the median TTFT of a 1000-token
#: prompt on Qwen2.5-Coder-1.5B Q4_K_M in a cgroup of the budget, files evicted: 11.19 s at 900 MiB
#: (n_ubatch 256: 4 passes of 483 MB) and 16.08 s at 1200 MiB (n_ubatch 64: 16 passes); at 800 MiB
#: (gate streamed, 4 passes of 700 MB) it predicts 11.9 s, measured 11.62 (docs/PLANNER.md, "Prefill
#: and the n_ubatch choice"; bench/results/prefill_budget_p1000.json).
PREFILL_STREAM_BYTES_PER_S = 1.19e9
PREFILL_MACS_PER_S = 137e9
#: Default prompt length a plan predicts TTFT for (``llamaflash plan --prompt-tokens``).
DEFAULT_PROMPT_TOKENS = 512
#: Decoded tokens of the request the n_ubatch choice minimizes the time of, beside the prompt.
REQUEST_DECODE_TOKENS = 128


@dataclass(frozen=True)
class PrefillPrediction:
    """TTFT of ``prompt_tokens`` at ``n_ubatch``: ``passes`` micro-batches each streaming
    ``stream_bytes``; ``read_seconds`` + ``compute_seconds`` = ``ttft_s``."""

    prompt_tokens: int
    n_ubatch: int
    passes: int
    stream_bytes: int
    read_bytes: int
    read_seconds: float
    compute_seconds: float
    ttft_s: float

    @property
    def tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_tok_s": self.tok_s}


def stream_bytes(req: "PlanRequest", stream_gate: bool) -> int:
    """Bytes one prefill micro-batch streams: every served layer's base up + down (+ gate)."""
    size = {t.name: t.nbytes for t in req.header.tensors}
    total = 0
    for lay in req.info.layers:
        total += size[fmt.base_ffn_up_name(lay.layer)] + size[fmt.base_ffn_down_name(lay.layer)]
        if stream_gate:
            total += size[fmt.base_ffn_gate_name(lay.layer)]
    return total


def macs_per_token(req: "PlanRequest") -> int:
    """Elements of the model's matrix weights but token_embd and output (see the module docstring)."""
    total = 0
    for t in req.header.tensors:
        if t.name in ("token_embd.weight", "output.weight") or len(t.shape) < 2:
            continue
        total += math.prod(int(d) for d in t.shape)
    return total


def predict(
    req: "PlanRequest", n_ubatch: int, stream_gate: bool, prompt_tokens: int | None = None
) -> PrefillPrediction:
    """The prefill of ``prompt_tokens`` (None: the request's) at ``n_ubatch`` (see the module docstring)."""
    p = int(prompt_tokens if prompt_tokens is not None else req.prompt_tokens)
    passes = -(-p // max(1, int(n_ubatch)))
    per_pass = stream_bytes(req, stream_gate)
    read_s = passes * per_pass / PREFILL_STREAM_BYTES_PER_S
    compute_s = p * macs_per_token(req) / PREFILL_MACS_PER_S
    return PrefillPrediction(
        p, int(n_ubatch), passes, per_pass, passes * per_pass, read_s, compute_s, read_s + compute_s
    )


def request_seconds(ttft_s: float, decode_tok_s: float) -> float:
    """The time of the request the n_ubatch choice minimizes: ttft + REQUEST_DECODE_TOKENS / decode."""
    return ttft_s + (REQUEST_DECODE_TOKENS / decode_tok_s if decode_tok_s > 0 else math.inf)
