"""Whether the sidecar's draft copy earns its memory under a RAM budget.

The same memory can hold either the draft copy (every neuron's up and down_t rows at low bit width,
so a speculative self-draft computes the whole FFN and agrees with the model more often) or more
pinned clusters (fewer bytes read from flash per verify pass, and a resident-only self-draft that
sees more of each layer). :func:`choose_draft_copy` takes the plans of both and keeps the one with the
higher predicted delivered decode speed; ``llamaflash plan`` prints both predictions.

Model of one speculative step (docs/SPECULATIVE.md, "Draft length"), per plan:

    pass_s   = 1 / io_bound_tok_s + resident_bytes / MEMORY_BYTES_PER_S        one verify pass
    step_s   = (resident_bytes + draft_bytes) / MEMORY_BYTES_PER_S             one draft token
    row_s    = (resident_bytes + ffn_row_bytes) / MEMORY_BYTES_PER_S           one more verify row
    T(k)     = pass_s + k · row_s + k · step_s
    E(k)     = (1 − a^(k+1)) / (1 − a)                                          tokens per pass
    tok/s    = max over k in 0..MAX_DRAFT of E(k) / T(k)       (k = 0: the plan without speculation)

with acceptance a = COPY_ACCEPTANCE[type] for the draft copy, and for the resident-only self-draft the
share of active neurons the hot slots hold (``neuron_hit_rate``) to the power RESIDENT_ACCEPTANCE_EXPONENT
(both measured, below).
``resident_bytes`` = llama.cpp's weights + the gate (what every token reads from memory; a streamed gate
is computed from the page cache, its reads from flash are in the I/O bound),
``draft_bytes`` = what the self-draft computes from the FFN rows (the copy, or the hot slots),
``ffn_row_bytes`` = every neuron's up and down_t rows: a verify row is computed like a token of its own
(only the flash reads are shared by the batch), so it costs about a token's compute.
Prompt-lookup drafts are the same for both plans and left out.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..files import ggml_types
from ..runtime.speculative import BATCH_INVARIANT_MAX
from .plan_llama_share import MiB

if TYPE_CHECKING:
    from ..files.sidecar import SidecarInfo
    from .plan_result import OffloadPlan


#: Greedy acceptance of a self-draft from the draft copy, by its type (fraction of drafted tokens the
#: model kept, 4-token drafts). Measured on Qwen2.5-Coder-1.5B Q4_K_M with a Q2_K copy, chat prompts
#: (bench/bench_draft.py, bench/results/draft-acceptance-qwen2.5-chat.json): 0.565 at 1100 MiB and 0.511 at
#: 1200 MiB. Other types are not measured and taken as Q2_K's.
COPY_ACCEPTANCE: dict[int, float] = {ggml_types.Q2_K: 0.54}
#: Resident-only self-draft: acceptance ≈ (neuron-weighted resident share) ** this. Measured on the same
#: runs: share 0.55 -> 0.229 accepted, share 0.80 -> 0.622 (exponents 2.5 and 2.1).
RESIDENT_ACCEPTANCE_EXPONENT = 2.3
#: Bytes per second a draft token or a pass's compute streams from memory, 2 threads, batch-invariant
#: weights (plain, not repacked): a draft step from the Q2_K copy measured 58 ms for ~0.87 GB of
#: resident weights and copy.
MEMORY_BYTES_PER_S = 15e9
#: A verify pass of 1 + k tokens where no row cost is given: (1 + this · k) passes of one token.
VERIFY_EXTRA_PER_TOKEN = 0.25
#: The draft copy is kept only when it predicts at least this much more than the plan without it (the
#: prediction's constants are measured on one machine; a wrong choice costs every pass's cache).
COPY_MARGIN = 0.10
#: The longest draft the engine verifies: a verify batch is the draft and the token before it.
MAX_DRAFT = BATCH_INVARIANT_MAX - 1


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted decode of one plan: acceptance a, verify pass and draft step seconds, best k, tok/s."""

    acceptance: float
    pass_seconds: float
    step_seconds: float
    draft: int
    tok_s: float


def predict(pass_s: float, step_s: float, acceptance: float, row_s: float | None = None) -> Prediction:
    """The best draft length and its delivered tok/s under the model in the module docstring
    (``row_s`` None: VERIFY_EXTRA_PER_TOKEN · pass_s)."""
    a = min(max(acceptance, 0.0), 0.999)
    row = VERIFY_EXTRA_PER_TOKEN * pass_s if row_s is None else row_s
    best = Prediction(a, pass_s, step_s, 0, 1.0 / pass_s)
    for k in range(1, MAX_DRAFT + 1):
        tokens = (1 - a ** (k + 1)) / (1 - a)
        tok_s = tokens / (pass_s + k * row + k * step_s)
        if tok_s > best.tok_s:
            best = Prediction(a, pass_s, step_s, k, tok_s)
    return best


def predict_plan(plan: "OffloadPlan", info: "SidecarInfo") -> Prediction | None:
    """The prediction for ``plan`` (None when nothing is read from flash: no pass to amortize)."""
    if plan.io_bound_tok_s is None:
        return None
    # the gate is computed from memory every token whether it is resident or streamed (then from the page
    # cache, its reads in the I/O bound): the same resident bytes for every plan of the model
    resident = plan.parts.get("llama_weights", 0) + sum(lay.n_ff * lay.gate_row_bytes for lay in info.layers)
    pass_s = 1.0 / plan.io_bound_tok_s + resident / MEMORY_BYTES_PER_S
    if plan.draft_copy:
        draft = plan.parts["draft_copy"]
        acceptance = COPY_ACCEPTANCE.get(int(info.layers[0].draft_type), COPY_ACCEPTANCE[ggml_types.Q2_K])
    else:
        draft = plan.parts.get("hot_slots", 0)
        acceptance = plan.neuron_hit_rate**RESIDENT_ACCEPTANCE_EXPONENT
    ffn_rows = sum(lay.n_ff * (lay.up_row_bytes + lay.down_t_row_bytes) for lay in info.layers)
    return predict(
        pass_s, (resident + draft) / MEMORY_BYTES_PER_S, acceptance, (resident + ffn_rows) / MEMORY_BYTES_PER_S
    )


def copy_unused(without: "OffloadPlan", why: str) -> "OffloadPlan":
    """``without``, with a note saying why the draft copy was not weighed: ``why``."""
    return dataclasses.replace(without, notes=without.notes + [f"draft copy unused: {why}"])


def copy_does_not_fit(without: "OffloadPlan", copy_bytes: int) -> "OffloadPlan":
    """``without``, noting that the draft copy does not fit its budget beside the minimum."""
    return copy_unused(
        without,
        f"its {copy_bytes / MiB:.0f} MiB do not fit this budget beside the minimum "
        f"(it would need about {(without.minimum_bytes + copy_bytes) / MiB:.0f} MiB)",
    )


def choose_draft_copy(info: "SidecarInfo", without: "OffloadPlan", with_copy: "OffloadPlan") -> "OffloadPlan":
    """``with_copy`` (the same budget and n_ubatch, the draft copy resident) when its predicted delivered
    tok/s is more than COPY_MARGIN above ``without``'s (whose prediction includes decoding without
    drafts), else ``without``. The returned plan's ``draft_choice`` holds
    both predictions and its ``least_budget_bytes`` is the one without the copy (the least budget the
    model runs in)."""
    p0, p1 = predict_plan(without, info), predict_plan(with_copy, info)
    if p0 is None:
        return copy_unused(without, "every cluster is pinned at this budget, nothing is read from flash")
    if p1 is None:  # (unreachable: the copy leaves fewer pinned clusters) nothing to draft for
        return without
    choice: dict[str, Any] = {
        "resident_only": dataclasses.asdict(p0),
        "draft_copy": dataclasses.asdict(p1),
        "chosen": "draft_copy" if p1.tok_s > p0.tok_s * (1 + COPY_MARGIN) else "resident_only",
    }
    chosen = with_copy if choice["chosen"] == "draft_copy" else without
    copy_bytes = with_copy.parts["draft_copy"]
    note = (
        f"draft copy ({copy_bytes / MiB:.0f} MiB) vs the same memory as pinned clusters: predicted "
        f"{p1.tok_s:.1f} vs {p0.tok_s:.1f} tok/s delivered (acceptance {p1.acceptance:.2f} vs "
        f"{p0.acceptance:.2f}, draft {p1.draft} vs {p0.draft}): {choice['chosen'].replace('_', ' ')} chosen"
    )
    return dataclasses.replace(
        chosen, least_budget_bytes=without.least_budget_bytes, draft_choice=choice, notes=chosen.notes + [note]
    )
