"""The words of an offload plan: why each part has its size, the notes on what the plan assumes,
and the human-readable table of ``llamaflash plan`` (:func:`explain_plan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..files import ggml_types
from ..files import sidecar_format as fmt
from .plan_budget import (
    DECODE_ROWS,
    GATE_WINDOW_LAYERS,
    MARGIN_FIXED_BYTES,
    MARGIN_FRACTION,
    VERIFY_ROWS,
    Layout,
    PlanRequest,
)
from .plan_llama_share import VOCAB_BYTES_PER_ENTRY, MiB

if TYPE_CHECKING:
    from .plan_clusters import CacheChoice
    from .plan_result import OffloadPlan


def part_reasons(req: PlanRequest, layout: Layout, choice: "CacheChoice", spare: int) -> dict[str, str]:
    """Why each part has its size (name → one line); ``spare``: the margin beyond its formula."""
    lay0 = req.info.layers[0]
    gate = sum(req.gate_layer_bytes)
    max_clusters = choice.table.max_clusters_per_layer
    return {
        "runtime": (
            "given by the caller"
            if req.runtime_given
            else "Python + libraries, measured constant (import llamaflash, llama_cpp)"
        ),
        "llama_vocab": f"llama.cpp tokenizer tables, {VOCAB_BYTES_PER_ENTRY} B per token/merge + 2 MiB (measured)",
        "llama_weights": "non-FFN tensors (attention, norms, token_embd, output) + unserved FFNs, mmapped/repacked",
        "kv_cache": f"f16 K+V, every layer, n_ctx {req.n_ctx} rounded up to 256 cells",
        "compute_buffers": (
            f"the pages a batch of n_ubatch {layout.n_ubatch} writes in llama.cpp's CPU and "
            "LLAMAFLASH compute buffers and logits output; +5% (measured)"
            if not layout.prompt_extra
            else f"the pages a decode batch (up to {DECODE_ROWS} tokens) writes in llama.cpp's CPU and LLAMAFLASH "
            f"compute buffers and logits output, +5% (measured); a prompt batch of n_ubatch {layout.n_ubatch} "
            f"writes {layout.prompt_extra / MiB:.1f} MiB more, in the memory of the cold slots and verify "
            "buffers (emptied before it, its pages freed after it)"
        )
        + ("" if req.n_ubatch is not None else "; n_ubatch chosen for the fastest predicted decode"),
        "prompt_buffers": "what a prompt batch's compute pages need beyond the cold slots and verify buffers",
        "prefill_window": "one layer's base up + down, mmapped page cache during dense prefill",
        "python_logits": "logits_all=True: llama-cpp-python keeps every position's logits, n_ctx x n_vocab x 4",
        "draft_copy": (
            f"the sidecar's draft copy ({ggml_types.type_name(lay0.draft_type)}): every "
            "neuron's up and down_t rows at low bit width, resident, for speculative self-drafts"
        )
        if layout.draft_copy
        else "",
        "gate_rows": f"resident gate matrices, {len(req.info.layers)} layers x {lay0.n_ff} x {lay0.gate_row_bytes} B",
        "gate_window": f"streamed gate: {GATE_WINDOW_LAYERS} layers x {lay0.n_ff} x {lay0.gate_row_bytes} B in the page "
        f"cache (the layer computing, the next read ahead); {gate / 1e6:.0f} MB of gate rows read "
        "from flash per token",
        "cold_slots": f"{1 + req.prefetch_layers} layers x {max_clusters} clusters: current layer + read-ahead",
        "verify_buffers": f"a {VERIFY_ROWS}-token speculative verify batch: {VERIFY_ROWS - 1} more logits rows, and the "
        f"sparse lane's scratch (partial sums: {VERIFY_ROWS} tokens x {max_clusters} clusters x n_embd floats)",
        "hot_slots": f"{choice.hot_slots} pinned clusters x {choice.table.slot_bytes // 1024} KiB, by P(needed) then sum f",
        "margin": f"{MARGIN_FIXED_BYTES // MiB} MiB + {MARGIN_FRACTION:.0%} of the rest, + {spare / MiB:.1f} MiB "
        "left over (slot rounding, or more than all clusters need)",
    }


def plan_notes(req: PlanRequest) -> list[str]:
    """What the plan assumes (the search adds where it chose for the caller: gate_note, ubatch_note)."""
    notes = (
        []
        if req.disk is not None
        else [
            "no disk profile given: built-in conservative default; pass "
            "--probe-disk (or disk=probe_disk(...)) for this machine's numbers"
        ]
    )
    if req.info.sparsity.bundle_order != fmt.BUNDLE_ORDER_BASE:
        notes.append(
            f"bundle order '{req.info.sparsity.bundle_order}': a cluster's down_t rows are not contiguous "
            "in the sidecar; convert with --order base for one read per cluster"
        )
    if "output.weight" in {t.name for t in req.header.tensors}:
        notes.append(
            "token_embd is read by rows (get_rows): llama_weights counts the pages of n_ctx of its "
            "rows, not the whole table"
        )
    notes.append(
        "cluster probabilities assume independent neurons at the sidecar's operating point "
        f"(sparsity target {req.info.sparsity.target:g}); the I/O bound ignores compute, and reuse across tokens but where the cold slots hold every unpinned cluster"
    )
    return notes


def gate_note(req: PlanRequest, streamed: "OffloadPlan", resident: "OffloadPlan | None") -> str:
    """Why the search streamed the gate: the resident gate does not fit (``resident`` None), or its
    memory as pinned clusters predicts the faster decode."""
    gate = sum(req.gate_layer_bytes)
    if resident is None:
        return (
            f"the resident gate ({gate / MiB:.0f} MiB) does not fit this budget: it is streamed from flash "
            f"instead, {gate / 1e6:.0f} MB more read per token"
        )
    return (
        f"the gate is streamed from flash ({gate / 1e6:.0f} MB more read per token): its {gate / MiB:.0f} MiB "
        f"pin clusters instead, {streamed.hot_slots} pinned against {resident.hot_slots} with the gate "
        f"resident, predicted I/O-bound decode {_tok(streamed.io_bound_tok_s)} against "
        f"{_tok(resident.io_bound_tok_s)}"
    )


def _tok(tok_s: float | None) -> str:
    return "unbounded (nothing read)" if tok_s is None else f"{tok_s:.2f} tok/s"


def ubatch_note(choice: dict[str, Any], smallest: dict[str, Any]) -> str:
    """The trade of a plan whose n_ubatch is larger than the smallest that fits (plan_search's
    ``ubatch_choice``): its predicted TTFT and decode against the smallest n_ubatch's."""
    u, p = choice["n_ubatch"], choice["prompt_tokens"]
    return (
        f"n_ubatch {u}, not {smallest['n_ubatch']}: a {p}-token prompt streams the offloaded FFN "
        f"{-(-p // u)} times instead of {-(-p // smallest['n_ubatch'])}; predicted TTFT {choice['ttft_s']:.1f} s "
        f"against {smallest['ttft_s']:.1f} s, decode {choice['decode_tok_s']:.2f} against "
        f"{smallest['decode_tok_s']:.2f} tok/s ({choice['hot_slots']} and {smallest['hot_slots']} pinned "
        f"clusters). n_ubatch is chosen for the shortest request of the prompt plus "
        f"{choice['request_decode_tokens']} decoded tokens; n_ubatch={smallest['n_ubatch']} fixes it."
    )


def explain_plan(plan: "OffloadPlan") -> str:
    """A human-readable table: every part and why, the minimum, the choices, the predictions."""
    mib = lambda b: f"{b / MiB:9.1f}"  # noqa: E731
    lines = [
        f"llamaflash offload plan: {plan.model_path}",
        f"  sidecar {plan.sidecar_path}",
        f"  RAM budget {plan.budget_bytes / MiB:.0f} MiB, n_ctx {plan.n_ctx}, n_batch {plan.n_batch}, "
        f"n_ubatch {plan.n_ubatch}",
        "",
        f"  {'part':<16}{'MiB':>9}  why",
    ]
    lines += [f"  {name:<16}{mib(b)}  {plan.reasons[name]}" for name, b in plan.parts.items()]
    lines += [
        f"  {'total':<16}{mib(sum(plan.parts.values()))}  = the budget",
        f"  {'minimum':<16}{mib(plan.least_budget_bytes)}  the least budget this model and these settings "
        "run in (smallest n_ubatch, gate streamed if allowed, no hot_slots, cold region at its minimum)",
        "",
        f"cluster size {plan.cluster_size} neurons, slot {plan.slot_bytes / 1024:.0f} KiB; "
        f"{plan.hot_slots} of {plan.total_clusters} clusters pinned, {plan.cold_slots} cold slots; "
        f"queue depth {plan.queue_depth}; gate "
        f"{'streamed from flash, one layer ahead' if plan.stream_gate else 'resident'}; read-ahead: "
        + (
            f"next {plan.prefetch_layers} layer(s), clusters with P(needed) >= {plan.prefetch_min_prob:g}"
            if plan.prefetch_min_prob <= 1
            else "off"
        ),
        f"disk: {plan.disk_source}",
        "candidates (the best predicted tok/s is chosen):",
        f"  {'C':>4} {'slot KiB':>8} {'min MiB':>8} {'hot':>7} {'hit':>6} {'MB/token':>9} {'tok/s':>7}",
    ]
    for c in plan.candidates:
        if c.get("hot_slots") is None:
            lines.append(
                f"  {c['cluster_size']:>4} {c['slot_bytes'] / 1024:>8.0f} "
                f"{c['minimum_bytes'] / MiB:>8.0f}  (budget below its minimum)"
            )
            continue
        tok = "inf" if c["io_bound_tok_s"] is None else f"{c['io_bound_tok_s']:.1f}"
        lines.append(
            f"  {c['cluster_size']:>4} {c['slot_bytes'] / 1024:>8.0f} {c['minimum_bytes'] / MiB:>8.0f} "
            f"{c['hot_slots']:>7} {c['hit_rate']:>6.3f} {c['flash_bytes_per_token'] / 1e6:>9.1f} "
            f"{tok:>7}"
        )
    tok = "unbounded (nothing read)" if plan.io_bound_tok_s is None else f"{plan.io_bound_tok_s:.1f} tok/s"
    lines += [
        "",
        f"predicted: hit rate {plan.hit_rate:.3f} (neuron-weighted {plan.neuron_hit_rate:.3f}), "
        f"{plan.flash_bytes_per_token / 1e6:.1f} MB read from flash per token, I/O-bound decode {tok}",
    ]
    lines += _prefill_lines(plan)
    lines += _speculation_lines(plan)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _prefill_lines(plan: "OffloadPlan") -> list[str]:
    """The predicted time to first token of the stated prompt beside the decode (prefill_speed)."""
    pre, choice = plan.prefill, plan.ubatch_choice
    if not pre:
        return []
    lines = [
        f"prefill: a {pre['prompt_tokens']}-token prompt takes {pre['passes']} micro-batch(es) of n_ubatch "
        f"{pre['n_ubatch']}, each streaming {pre['stream_bytes'] / 1e6:.0f} MB of offloaded FFN weights "
        f"({pre['read_bytes'] / 1e6:.0f} MB in all): predicted TTFT {pre['ttft_s']:.1f} s "
        f"({pre['read_seconds']:.1f} s reads + {pre['compute_seconds']:.1f} s compute, "
        f"{pre['prefill_tok_s']:.0f} tok/s); predicted decode {choice.get('decode_tok_s', 0.0):.2f} tok/s"
    ]
    alts = [a for a in choice.get("alternatives", []) if a.get("hot_slots") is not None]
    if len(alts) > 1:
        lines.append(
            "  n_ubatch  TTFT s  decode tok/s  request s: "
            + "; ".join(
                f"{a['n_ubatch']}: {a['ttft_s']:.1f} / {a['decode_tok_s']:.2f} / {a['request_s']:.1f}" for a in alts
            )
        )
    return lines


def _speculation_lines(plan: "OffloadPlan") -> list[str]:
    """What speculative decoding (docs/SPECULATIVE.md) gets under this plan."""
    draft = (
        "off: the gate is streamed from flash, a draft would wait for it"
        if plan.stream_gate
        else f"the same model over the resident clusters only: they hold "
        f"{plan.neuron_hit_rate:.0%} of the active neurons (frequency-weighted); no memory of its own "
        f"(same context, KV cache rolled back)"
    )
    lines = [
        "",
        f"speculation: verify batches up to {VERIFY_ROWS} tokens read the union of their clusters once "
        f"(their logits are in compute_buffers); self-draft: {draft}",
    ]
    if plan.io_bound_tok_s is None:
        return lines
    pass_s = 1.0 / plan.io_bound_tok_s  # a verify pass reads what one token reads
    rates = []
    for a in (0.2, 0.4, 0.6, 0.8):
        best = max((1 - a ** (k + 1)) / (1 - a) for k in range(VERIFY_ROWS))
        rates.append(f"a={a:.1f}: {best / pass_s:.1f}")
    lines.append(
        "predicted delivered tok/s at draft acceptance a, I/O bound, free drafts (prompt lookup; a "
        "self-draft step costs compute on top): " + ", ".join(rates)
    )
    return lines
