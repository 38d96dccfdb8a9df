"""`llamaflash.Llama.flash_stats()`: one dict assembled from the native engine's counters
(csrc/model/flash_stats.h), the offload cache's (:mod:`~llamaflash.runtime.offload`) or the expert
engine's (:mod:`~llamaflash.runtime.expert_runtime`), the row checks and speculation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from . import expert_runtime, offload

if TYPE_CHECKING:
    from .llama import Llama


def collect(llm: "Llama") -> Dict[str, Any]:
    """Counters since load (or the last reset): layers served, FFN evaluations, tokens, time."""
    stats: Dict[str, Any] = {
        "mode": llm._flash_mode,
        "sidecar": str(llm._flash_sidecar) if llm._flash_sidecar else None,
        "layers_served": 0,
        "ffn_evals": 0,
        "tokens": 0,
        "graph_splits": 0,
        "dense_lane_calls": 0,
        "compute_seconds": 0.0,
        "prepare_seconds": 0.0,
        "resident_ffn_bytes": 0,
        "decision": llm._flash_decision.as_dict() if llm._flash_decision is not None else None,
    }
    if llm._flash is not None:
        native = llm._flash.stats()
        layer_ids = native.pop("layer_ids")
        tokens = native.pop("layer_sparse_tokens")
        active = native.pop("layer_active_neurons")
        stats.update(native)
        stats["layers_served"] = len(llm._flash.served_layers)
        config = llm._flash.sparse_config
        stats["sparse_config"] = config
        # the lane is fixed per layer: sparse for batches up to max_tokens when the lane is
        # enabled and the layer has a threshold, dense otherwise
        stats["sparse_layers"] = sum(1 for t in llm._flash.thresholds if t >= 0) if config["enabled"] else 0
        stats["resident_ffn_bytes"] = llm._flash.resident_bytes
        n_ff = {layer.layer: layer.n_ff for layer in llm._flash_info.layers}
        # per layer: fraction of neurons the sparse lane computed, over the tokens it ran
        stats["active_fraction"] = {
            layer: (a / (t * n_ff[layer]) if t else None) for layer, t, a in zip(layer_ids, tokens, active)
        }
        fractions = [f for f in stats["active_fraction"].values() if f is not None]
        stats["mean_active_fraction"] = sum(fractions) / len(fractions) if fractions else None
        stats["offload"] = offload.stats(llm._flash, llm._flash_plan)
        if stats["offload"] is not None:  # the compute pages prompts wrote, freed after them (Llama.eval)
            stats["offload"]["prompt_pages_freed_bytes"] = llm._prompt_pages_freed
    if llm._experts is not None:
        plan = llm._load_plan
        stats["experts"] = expert_runtime.stats(llm._experts, plan.expert_plan, plan.model.moe)
        stats["experts"].update(llm._expert_lock)
        stats["layers_served"] = len(plan.model.moe.layers)
    stats["integrity"] = integrity_stats(llm, stats.get("offload"))
    stats["speculative"] = speculation_stats(llm, stats)
    stats["numerics"] = numerics(llm)
    return stats


#: The stock configuration llamaflash's batch-invariant numerics equal, bit for bit.
BATCH_INVARIANT_STOCK = (
    "stock llama.cpp with weights not repacked and flash attention on (llama_cpp.Llama(..., "
    "flash_attn=True) loaded with use_extra_bufts=False; llama-cli/llama-server --no-repack -fa on)"
)
BATCH_INVARIANT_SPECULATIVE = (
    BATCH_INVARIANT_STOCK + " while the context holds at most 256 tokens; beyond that stock decodes a lone token "
    "with flash attention's KV split by thread count, which llamaflash, verifying drafts in batches, avoids by "
    "evaluating each lone token with a filler row after it"
)


def numerics(llm: "Llama") -> Dict[str, Any]:
    """Which answers are reproducible, and the stock configuration the lossless lanes equal."""
    deterministic = bool(llm._deterministic)
    # under a budget with deterministic=True every FFN is computed whole (offload.stream_stats): exact
    whole_layers = llm._flash is not None and llm._flash.layer_stream_stats() is not None
    lossy = llm._flash_mode in ("sparse", "offload") and llm._experts is None and not whole_layers
    if deterministic:
        kv = "its KV cache as given" if llm._kv_may_split else "a q8_0 KV cache (-ctk q8_0 -ctv q8_0)"
        equals = (
            f"no stock default: stock llama.cpp with weights not repacked, flash attention on and {kv}, "
            f"every batch evaluated in 1..{llm._invariant_rows} rows (llama.cpp's tools cannot be told to)"
        )
        if llm._tinyblas_matrix is None and not llm._kv_may_split:
            # no filler rows: every row has the bits of a row evaluated alone (an MoE's routers
            # computed so by the expert lane)
            equals += ", which here gives every position the logits of evaluating one token per call"

    elif llm._batch_invariant:
        equals = BATCH_INVARIANT_SPECULATIVE if llm._speculator is not None else BATCH_INVARIANT_STOCK
    else:
        equals = "stock llama-cpp-python with the same arguments (llama_cpp.Llama(model, ...))"
    return {
        "answers": "deterministic" if deterministic else "repeat-stable",
        "batch_invariant": bool(llm._batch_invariant),
        "lossless": not lossy,
        "equals_stock": None if lossy else equals,
        "lossy_note": "the sparse lane skips neurons under the sidecar's thresholds (its measured quality cost)"
        if lossy
        else None,
        "prompt_records": len(llm._prompt_records),
        "invariant_rows": int(llm._invariant_rows) if deterministic else None,
        "matmuls": matmuls_stats(llm),
    }


def matmuls_stats(llm: "Llama") -> Optional[Dict[str, Any]]:
    """deterministic=True: the K-quant matmuls llamaflash computes, every row as alone
    (csrc/backend/matmul_rows.h; a dense FFN lane's too, csrc/lanes/dense_lane.h): weights bound to the
    device (not those the lane keeps), MUL_MATs computed and their rows; None where ggml-cpu computes
    them all."""
    m = llm._matmul_rows
    if m is None:
        return None
    return {
        "by": "llamaflash (kquant_gemm: vec_dot's bits per output)",
        "weights": int(m.bound),
        "in_place": int(m.in_place),  # read from the model file's mapping, not copied
        "computed": int(m.matmuls),
        "rows": int(m.columns),
    }


def integrity_stats(llm: "Llama", off: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """What is checked: the sidecar's checksums (algorithm or None), whether this model checks them,
    bytes and seconds checked at load and, offload, on flash reads since the last reset (and how many
    clusters the compute threads checked right before using them rather than the waiting thread)."""
    if llm._flash_info is None:
        return None
    out = {"algorithm": llm._flash_info.integrity, "checked": False}
    if llm._flash is not None:
        native = llm._flash.integrity
        out.update(
            checked=native["verifying"],
            load_verified_bytes=native["load_verified_bytes"],
            load_verify_seconds=native["load_verify_seconds"],
            crc32c=native["crc32c"],
        )
        if off is not None:
            out.update(
                read_verified_bytes=off["verified_bytes"],
                read_verify_seconds=off["verify_seconds"],
                # whole layers: K-quant rows checked by the products as they multiply them (untimed)
                read_verified_by_products_bytes=off.get("product_verified_bytes", 0),
                read_clusters_checked_by_compute=off.get("clusters_checked_by_compute", 0),
                read_compute_verify_seconds=off.get("compute_verify_seconds", 0.0),
            )
    elif llm._base_check is not None:  # stock: the base model's FFN rows, checked while llama.cpp loaded
        out.update(
            checked=True,
            load_verified_bytes=llm._base_check.checked_bytes,
            load_verify_seconds=llm._base_check.seconds,
        )
    if llm._flash_info.integrity is None:
        out["note"] = "the sidecar has no checksums (re-create it with `llamaflash convert MODEL --force`)"
    return out


def speculation_stats(llm: "Llama", stats: Dict[str, Any]) -> Dict[str, Any]:
    if llm._speculator is None:
        return {"enabled": False, "reason": llm._speculation_off_reason or "flash_speculative is off"}
    off = stats.get("offload") or {}
    out = llm._speculator.summary(flash_bytes=off.get("bytes_read"))
    if llm._flash is not None:
        native = llm._flash.stats()
        out["draft_tokens_evaluated"] = native.get("draft_tokens", 0)
    copy_bytes = llm._flash.draft_copy_bytes if llm._flash is not None and llm._flash.offloaded else 0
    out["self_draft_source"] = "draft_copy" if copy_bytes else "resident_clusters"
    out["draft_copy_bytes"] = copy_bytes
    if off.get("draft_plans"):  # the share a draft computed from exact rows (with a copy: the rest from it)
        out["draft_resident_fraction"] = off["draft_clusters_resident"] / max(1, off["draft_clusters_needed"])
    out["self_draft_off_reason"] = llm._speculation_off_reason
    return out
