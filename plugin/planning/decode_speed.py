"""Predicted decode seconds per token: stock llama.cpp with the model resident, and an offload plan.

Both are built from bytes per token and this machine's rates (:class:`MachineRates`):

stock (every weight resident, each read once per token by llama.cpp's kernels)::

    t_stock = token_overhead_s + weight_bytes / dense_bytes_per_s

offload (one token of a plan, no speculation)::

    t_io      = 1 / plan.io_bound_tok_s            the disk model's device time: the cluster reads and a
                                                   streamed gate (plan_clusters.choose_cache)
    t_compute = token_overhead_s + llama_bytes / dense_bytes_per_s        llama.cpp's own graph
              + n_layers * split_overhead_s                               each served FFN's split
              + gate_bytes / dense_bytes_per_s                            the gate GEMV (every row)
              + active * updown_bytes / sparse_bytes_per_s                the sparse kernel: up and
                                                                          down_t rows of active neurons
              + flash_bytes / (check_bytes_per_s * n_threads)             CRC-32C of every read
              + read_layers * read_layer_s + cluster_bytes / read_bytes_per_s   the reads' CPU side
    t         = max(t_io, t_compute) + overlap_loss * min(t_io, t_compute)

The reads overlap the compute only in part: the next layers' read-ahead runs beside llama.cpp's graph
and the clusters already resident are accumulated while a layer's reads run, but the clusters a read
brings are computed (and checked) after it lands, and a layer's reads wait for its gate. So a token
takes the longer of the two plus ``overlap_loss`` (fitted, 0..1) of the shorter: 0 = perfect overlap,
1 = their sum.
``active``: the share of neurons active per token (the sidecar's frequencies, mean over every neuron),
``llama_bytes``: the plan's ``llama_weights`` part (attention, norms, output, token_embd rows),
``updown_bytes``: every neuron's up and down_t rows, ``gate_bytes``: every gate row, ``read_layers``:
the expected number of served layers that read a cluster per token (the plan's ``read_layers_per_token``:
0 where every cluster stays resident), ``cluster_bytes``: the cluster bytes read per token (a streamed
gate's reads are the kernel's read-ahead, outside the engine's read path).

The rates (:data:`DEFAULT_RATES`) are measured on a quiet machine; ``bench/lab/sweep_rates.py`` derives
them from a sweep's recorded runs (each constant's source is beside it) and prints the planner's
counters (hit rate, bytes read, compute seconds) against the measured ones.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..files.sidecar import SidecarInfo
    from .plan_result import OffloadPlan


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """This machine's decode rates at ``n_threads`` threads (see the module docstring)."""

    #: seconds per token that do not scale with weight bytes: graph build and scheduling, the logits'
    #: copy and the sampler, Python's generate loop
    token_overhead_s: float
    #: weight bytes per second llama.cpp's kernels compute a one-token decode from memory (repacked
    #: Q4_K, Q6_K: every weight read once)
    dense_bytes_per_s: float
    #: up and down_t row bytes per second the sparse kernel computes for active neurons, the neuron
    #: cache's plan and bookkeeping included
    sparse_bytes_per_s: float
    #: seconds per served layer per token an offloaded FFN adds beyond its kernels: the split's hand-off
    #: between llama.cpp's scheduler and the engine, and the page faults of mmapped weights it causes
    split_overhead_s: float
    #: bytes per second one thread checks (CRC-32C) of what the neuron cache reads
    check_bytes_per_s: float
    n_threads: int = 2
    #: seconds per served layer per token that reads clusters from flash, on the compute side beyond the
    #: checks: the read round's submission and completion, the read-ahead plan, the slot hand-over
    read_layer_s: float = 0.0
    #: cluster bytes per second the compute side handles beyond the checks (per-byte part of the same)
    read_bytes_per_s: float = float("inf")
    #: the share of the shorter of a token's reads and compute that does not overlap the longer
    overlap_loss: float = 0.0
    #: where the numbers come from
    source: str = ""


#: Qwen2.5-Coder-1.5B Q4_K_M, 2 threads, an AVX2 CPU (no AVX-512), 2026-11-26; derived by ``python -m
#: llamaflash.bench.sweep_rates tests/data/sweep-qwen2.5-avx2-counters.json --fit-budget 1200 --read-fit
#: D:800 D:900 D:1000 D:1100`` (D = that file: the counters of bench/results/sweep-qwen2.5-chat-avx2.json and
#: its -nospec companion):
#:
#: * token_overhead_s: in-memory stock decode of three models (bench/results/inmemory-default-*.json:
#:   8.9, 13.9 and 36.2 ms per token for 97, 247 and 980 MB of weights): the least-squares line
#:   t = 6.1 ms + bytes / 32.5 GB/s, its intercept the cost that does not scale with bytes;
#: * dense_bytes_per_s: the stock runs at 2000 MiB (llamaflash's read into memory, stock's mapped):
#:   median 61.9 ms per token for 988.5 MB of weights read, 988.5 MB / (61.9 - 6.1) ms = 17.7 GB/s;
#: * sparse_bytes_per_s: the runs at 1200 MiB, which read nothing (every cluster resident), sparse lane
#:   56.7 ms per token less the gate GEMV (216.8 MB at the dense rate, 12.2 ms): 44.5 ms for the active
#:   71.3% of 433.5 MB of up and down_t rows, 7.0 GB/s (4.3 GB/s before the Q4_K down_t accumulation
#:   had an AVX2 pass);
#: * split_overhead_s: the same runs, 84.8 ms per token, less the sparse lane and llama.cpp's graph at
#:   the dense rate: 0.20 ms per served layer;
#: * read_layer_s, read_bytes_per_s: the non-speculative runs at 800, 900, 1000 and 1100 MiB (459, 345,
#:   240 and 143 MB read per token), their sparse lanes beyond the I/O wait, the gate, the kernel and the
#:   checks: least squares 1.13 ms per layer that reads (the per-byte part came out negative: dropped);
#: * overlap_loss: the same four runs, measured token - max(t_io, t_compute) against min(t_io,
#:   t_compute): 0.18 (the reads and the compute overlap but for 18% of the shorter);
#: * check_bytes_per_s: kept from the 2026-11-25 sweep at 1200 MiB (14.14 GB verified in 1.79
#:   thread-seconds: 7.9 GB/s); the fit run at 1200 MiB now checks too little to time.
#:
#: With these rates every offload budget of that sweep is predicted within 16% (tests/test_decode_speed.py).
DEFAULT_RATES = MachineRates(
    token_overhead_s=6.10e-3,
    dense_bytes_per_s=17.7e9,
    sparse_bytes_per_s=7.04e9,
    split_overhead_s=0.20e-3,
    check_bytes_per_s=7.9e9,
    n_threads=2,
    read_layer_s=1.13e-3,
    read_bytes_per_s=float("inf"),
    overlap_loss=0.18,
    source="Qwen2.5-Coder-1.5B Q4_K_M sweep, AVX2, 2026-11-26 (built in)",
)


@dataclasses.dataclass(frozen=True)
class OffloadTokenTime:
    """One offloaded token's predicted seconds by part (see the module docstring)."""

    io: float
    llama: float
    splits: float
    gate: float
    sparse: float
    checks: float
    reads: float = 0.0
    overlap_loss: float = 0.0  # MachineRates.overlap_loss

    @property
    def compute(self) -> float:
        return self.llama + self.splits + self.gate + self.sparse + self.checks + self.reads

    @property
    def total(self) -> float:
        c = self.compute
        return max(self.io, c) + self.overlap_loss * min(self.io, c)

    @property
    def tok_s(self) -> float:
        return 1.0 / self.total

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "compute": self.compute, "total": self.total, "tok_s": self.tok_s}


def stock_token_seconds(weight_bytes: float, rates: MachineRates = DEFAULT_RATES) -> float:
    """Stock's predicted seconds per decoded token with ``weight_bytes`` of weights resident."""
    return rates.token_overhead_s + weight_bytes / rates.dense_bytes_per_s


def offload_token_time(
    *,
    io_seconds: float,
    llama_bytes: float,
    n_layers: int,
    gate_bytes: float,
    updown_bytes: float,
    active_fraction: float,
    flash_bytes: float,
    read_layers: float = 0.0,
    cluster_bytes: Optional[float] = None,
    rates: MachineRates = DEFAULT_RATES,
) -> OffloadTokenTime:
    """The parts of one offloaded token (see the module docstring), from plain per-token numbers: a
    plan's predictions, or the counters of a measured run. ``cluster_bytes`` None: ``flash_bytes``
    (no streamed gate)."""
    clusters = flash_bytes if cluster_bytes is None else cluster_bytes
    return OffloadTokenTime(
        io=io_seconds,
        llama=rates.token_overhead_s + llama_bytes / rates.dense_bytes_per_s,
        splits=n_layers * rates.split_overhead_s,
        gate=gate_bytes / rates.dense_bytes_per_s,
        sparse=active_fraction * updown_bytes / rates.sparse_bytes_per_s,
        checks=flash_bytes / (rates.check_bytes_per_s * max(rates.n_threads, 1)),
        reads=read_layers * rates.read_layer_s + clusters / rates.read_bytes_per_s,
        overlap_loss=rates.overlap_loss,
    )


def active_fraction(info: "SidecarInfo") -> float:
    """The expected share of neurons active per token: the sidecar's activation frequencies, mean over
    every neuron of the served layers (1.0 without frequencies)."""
    from .plan_clusters import neuron_frequencies

    try:
        freqs = neuron_frequencies(info)
    except Exception:  # a sidecar without neuron statistics: every neuron computed
        return 1.0
    n = sum(len(f) for f in freqs)
    return float(sum(float(f.sum()) for f in freqs) / n) if n else 1.0


def ffn_row_bytes(info: "SidecarInfo") -> tuple[int, int]:
    """(gate bytes, up + down_t bytes) of every neuron of the served layers."""
    gate = sum(lay.n_ff * lay.gate_row_bytes for lay in info.layers)
    updown = sum(lay.n_ff * (lay.up_row_bytes + lay.down_t_row_bytes) for lay in info.layers)
    return gate, updown


def plan_token_time(
    plan: "OffloadPlan",
    info: "SidecarInfo",
    rates: MachineRates = DEFAULT_RATES,
    active: Optional[float] = None,
) -> OffloadTokenTime:
    """The predicted token of ``plan`` (where nothing is read from flash, every cluster pinned, the I/O
    term is 0 and the compute alone counts). ``active``: :func:`active_fraction` of ``info`` when the
    caller has it."""
    gate, updown = ffn_row_bytes(info)
    flash = plan.flash_bytes_per_token if plan.io_bound_tok_s is not None else 0.0
    return offload_token_time(
        io_seconds=0.0 if plan.io_bound_tok_s is None else 1.0 / plan.io_bound_tok_s,
        llama_bytes=plan.parts.get("llama_weights", 0),
        n_layers=len(info.layers),
        gate_bytes=gate,
        updown_bytes=updown,
        active_fraction=active_fraction(info) if active is None else active,
        flash_bytes=flash,
        read_layers=plan.read_layers_per_token,
        cluster_bytes=max(flash - (gate if plan.stream_gate else 0.0), 0.0),
        rates=rates,
    )


def draft_step_seconds(
    plan: "OffloadPlan",
    info: "SidecarInfo",
    rates: MachineRates = DEFAULT_RATES,
    active: Optional[float] = None,
) -> float:
    """One speculative draft token of ``plan``: the token's compute with no read and no check, its sparse
    kernel over the rows a self-draft has (the pinned clusters' share of the active neurons,
    ``neuron_hit_rate``, exact; the rest from the draft copy's low-bit rows where the plan keeps it,
    else left out)::

        t_draft = t_compute(llama, splits, gate) + active * (h * updown_bytes + (1 - h) * copy_bytes)
                  / sparse_bytes_per_s

    Every cluster pinned (nothing read), the draft is the model: t_draft = t_compute."""
    gate, updown = ffn_row_bytes(info)
    hit = 1.0 if plan.io_bound_tok_s is None else plan.neuron_hit_rate
    copy = plan.parts.get("draft_copy", 0) if plan.draft_copy else 0
    rows = hit * updown + (1.0 - hit) * copy
    share = active_fraction(info) if active is None else active
    return (
        rates.token_overhead_s
        + (plan.parts.get("llama_weights", 0) + gate) / rates.dense_bytes_per_s
        + len(info.layers) * rates.split_overhead_s
        + share * rows / rates.sparse_bytes_per_s
    )


__all__ = (
    "draft_step_seconds",
    "DEFAULT_RATES",
    "MachineRates",
    "OffloadTokenTime",
    "active_fraction",
    "ffn_row_bytes",
    "offload_token_time",
    "plan_token_time",
    "stock_token_seconds",
)
