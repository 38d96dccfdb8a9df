"""Whether a RAM budget needs flash offload at all.

Flash offload pays where the model does not fit: it reads the FFN rows it needs from flash instead
of letting the page cache thrash. Where the budget holds everything stock llama.cpp keeps resident,
stock is faster (its repacked weights, no sparse-lane bookkeeping, nothing read), so
``Llama(ram_budget_mb=N)`` then runs stock llama.cpp untouched: *stock-equivalent*.

Two ways stock can hold its weights, two needs:

* **in memory** (``use_mmap=False``): every tensor of the file read into anonymous memory. Nothing it
  computes from can be reclaimed, so under a cgroup limit that holds it, it decodes at its in-memory
  speed (Qwen2.5-1.5B at 1300 MiB: 16.0 tok/s, against 7.8 mapped);
* **mapped** (llama.cpp's default): the weights llama.cpp does not repack stay page cache, which the
  kernel reclaims first under the limit; near the need, pages of the output matrix are re-read on
  every token and the speed swings between runs.

The in-memory way is taken wherever its need fits (unless the caller fixed ``use_mmap``), else the
mapped one, else offload.

What stock needs resident, in bytes (the planner's own accounting, ``planner.llama_share``, with the
FFN weights resident instead of on flash):

    runtime          the measured RSS of the Python runtime (planner.RUNTIME_RSS_BYTES)
    llama_vocab      llama.cpp's tokenizer tables
    model_weights    every tensor of the model file, the FFN included (token_embd counted by the
                     pages of n_ctx rows when the model has its own output matrix, as the planner does)
    kv_cache         f16 K and V at n_ctx
    compute_buffers  llama.cpp's compute buffers at n_ubatch
    margin           planner.MARGIN_FIXED_BYTES + planner.MARGIN_FRACTION of the above (allocator slack,
                     and the page-cache headroom that keeps mmapped weights resident under a cgroup)

In memory, ``model_weights`` is every tensor of the file (token_embd whole) and the fixed part of
the margin is planner.IN_MEMORY_MARGIN_FIXED_BYTES.

n_ubatch (unless the caller fixes it) is the largest of planner.UBATCH_CHOICES whose compute buffers
take at most planner.UBATCH_BUDGET_SHARE of the budget (stock's decode does not depend on it, its
prefill does), or a smaller one where that one's need does not fit: the budget is stock's when it
holds the sum at one of them (:func:`decide`), so that a larger budget never runs offload where a
smaller ran stock.

Predicted decode (:func:`stock_decode_tok_s`): with everything resident, stock reads every weight
a token uses (``BudgetDecision.weights_read_bytes``: the mapped accounting's ``model_weights``) once per token: decode_speed.stock_token_seconds, a per-token overhead plus those
bytes at this machine's measured dense rate (decode_speed.MachineRates). An offload plan's token
(decode_speed.plan_token_time) computes llama.cpp's weights at the same rate, but its FFN on the
sparse lane (a slower rate per byte, over the active neurons) with a cost per served layer, and waits
for whichever of its reads and its compute is longer; where the budget crosses into stock the
predicted curve therefore does not fall (tests/test_plan_monotone.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from ..files import sidecar_format as fmt
from ..files.gguf_header import GGUFHeader
from ..files.sidecar import SidecarInfo
from . import planner
from .decode_speed import DEFAULT_RATES, MachineRates, stock_token_seconds

#: The lane names of a budget decision (flash_stats()["decision"]["lane"]).
STOCK = "stock"
OFFLOAD = "offload"


@dataclasses.dataclass(frozen=True)
class BudgetDecision:
    """``lane``: STOCK (the budget holds what stock keeps resident) or OFFLOAD; ``stock_need_bytes``:
    that need at ``n_ubatch``; ``parts``: its parts (bytes); ``reason``: one sentence for users;
    ``use_mmap``: how stock holds its weights (False: read into memory, see the module docstring)."""

    lane: str
    budget_bytes: int
    stock_need_bytes: int
    n_ubatch: int
    parts: Dict[str, int]
    reason: str
    use_mmap: bool = True
    #: weight bytes a decoded token reads (every tensor, token_embd by the rows of n_ctx tokens where
    #: the model has its own output matrix): the mapped accounting's model_weights, in either way
    weights_read_bytes: int = 0

    @property
    def stock(self) -> bool:
        return self.lane == STOCK

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def stock_need(
    header: GGUFHeader,
    info: SidecarInfo,
    n_ctx: int,
    n_ubatch: int,
    runtime_rss_bytes: Optional[int] = None,
    logits_all: bool = False,
    use_mmap: bool = True,
) -> Dict[str, int]:
    """The parts (bytes) of what stock llama.cpp keeps resident with its weights mapped, or with
    ``use_mmap=False`` read into memory (see the module docstring); with ``logits_all`` also every
    token's logits (plan_llama_share.llama_memory)."""
    share = planner.llama_share(header, info, n_ctx, n_ubatch, logits_all)
    if use_mmap:
        size = {t.name: t.nbytes for t in header.tensors}
        ffn = sum(
            size.get(name(lay.layer), 0)
            for lay in info.layers
            for name in (fmt.base_ffn_gate_name, fmt.base_ffn_up_name, fmt.base_ffn_down_name)
        )
        weights = share["llama_weights"] + ffn
    else:
        weights = sum(t.nbytes for t in header.tensors)
    parts = {
        "runtime": int(planner.RUNTIME_RSS_BYTES if runtime_rss_bytes is None else runtime_rss_bytes),
        "llama_vocab": share["llama_vocab"],
        "model_weights": weights,
        "kv_cache": share["kv_cache"],
        "compute_buffers": share["compute_buffers"],
    }
    if logits_all:
        parts["python_logits"] = share["python_logits"]
    fixed = planner.MARGIN_FIXED_BYTES if use_mmap else planner.IN_MEMORY_MARGIN_FIXED_BYTES
    parts["margin"] = fixed + int(planner.MARGIN_FRACTION * sum(parts.values()))
    return parts


def stock_decode_tok_s(decision: BudgetDecision, rates: MachineRates = DEFAULT_RATES) -> float:
    """Stock's predicted decode tok/s with the model resident (see the module docstring): every weight a
    token reads (``decision.weights_read_bytes``) read once per token."""
    return 1.0 / stock_token_seconds(decision.weights_read_bytes, rates)


def stock_ubatch(header: GGUFHeader, info: SidecarInfo, budget_bytes: int, n_ctx: int) -> int:
    """The n_ubatch stock takes at ``budget_bytes``: the largest of planner.UBATCH_CHOICES whose compute
    buffers take at most planner.UBATCH_BUDGET_SHARE of it, else the smallest."""
    choices = [u for u in planner.UBATCH_CHOICES if u <= n_ctx] or [n_ctx]
    for u in choices:
        if planner.llama_share(header, info, n_ctx, u)["compute_buffers"] <= planner.UBATCH_BUDGET_SHARE * budget_bytes:
            return u
    return choices[-1]


def decide(
    header: GGUFHeader,
    info: SidecarInfo,
    ram_budget_mb: float,
    n_ctx: int,
    n_ubatch: Optional[int] = None,
    runtime_rss_bytes: Optional[int] = None,
    logits_all: bool = False,
    use_mmap: Optional[bool] = None,
) -> BudgetDecision:
    """STOCK when ``ram_budget_mb`` MiB hold what stock keeps resident at ``n_ctx`` (and ``n_ubatch``, or
    stock's choice for the budget, :func:`stock_ubatch`), else OFFLOAD; the reason names both numbers.
    ``use_mmap``: the caller's llama.cpp setting; None: in memory where that fits, else mapped."""
    MiB = planner.MiB
    budget = int(ram_budget_mb * MiB)
    if n_ubatch:
        candidates = [min(int(n_ubatch), n_ctx)]
    else:  # stock's choice, else a smaller one that fits (so a larger budget is never less stock)
        first = stock_ubatch(header, info, budget, n_ctx)
        candidates = [u for u in (planner.UBATCH_CHOICES + (n_ctx,)) if u <= first] or [first]
        candidates = sorted(set(candidates), reverse=True)
    ways = [False, True] if use_mmap is None else [bool(use_mmap)]  # in memory first: it cannot thrash

    def need_at(u: int, mapped: bool) -> Dict[str, int]:
        return stock_need(header, info, n_ctx, u, runtime_rss_bytes, logits_all, use_mmap=mapped)

    fits = next(((u, m) for m in ways for u in candidates if sum(need_at(u, m).values()) <= budget), None)
    # where nothing fits, report the need the way llama.cpp would load by default, at the planner's choice
    u, mapped = fits if fits is not None else (candidates[0], ways[-1])
    parts = need_at(u, mapped)
    need = sum(parts.values())
    read = (parts if mapped else need_at(u, True))["model_weights"]
    detail = (
        f"model {parts['model_weights'] / MiB:.0f} + llama.cpp {(parts['llama_vocab'] + parts['kv_cache'] + parts['compute_buffers']) / MiB:.0f} "
        f"+ runtime {parts['runtime'] / MiB:.0f} + margin {parts['margin'] / MiB:.0f} MiB at n_ctx {n_ctx}, "
        f"n_ubatch {u}" + ("" if mapped else ", use_mmap=False")
    )
    if fits is not None:
        how = "with its weights mapped from the file" if mapped else "with its weights read into memory"
        return BudgetDecision(
            STOCK,
            budget,
            need,
            u,
            parts,
            (
                f"running as stock: the budget of {ram_budget_mb:g} MiB holds the {need / MiB:.0f} MiB stock llama.cpp "
                f"keeps resident {how} ({detail}), so nothing is offloaded to flash"
            ),
            use_mmap=mapped,
            weights_read_bytes=read,
        )
    return BudgetDecision(
        OFFLOAD,
        budget,
        need,
        u,
        parts,
        (
            f"flash offload: the budget of {ram_budget_mb:g} MiB is below the {need / MiB:.0f} MiB stock llama.cpp "
            f"keeps resident ({detail})"
        ),
        use_mmap=mapped,
        weights_read_bytes=read,
    )


__all__ = (
    "BudgetDecision",
    "decide",
    "stock_decode_tok_s",
    "stock_need",
    "stock_ubatch",
    "STOCK",
    "OFFLOAD",
)
