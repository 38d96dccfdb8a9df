"""What the memory-limit benchmark reports about decode beyond tok/s, per (limit, config) row.

The I/O bound (:func:`add_io_bound`): the decode speed the disk allows for the bytes read per
decoded (delivered) token: for flash offload the neuron cache's reads, for an MoE model's experts the
expert cache's (:func:`add_expert_io_bound`, at the expert planner's disk rate, :func:`expert_read_rate`).
The expert engine's statistics (:func:`expert_columns`, from ``flash_stats()["experts"]``), medians over
the ok runs of the row, None where no run served experts: hit rate, prefetch recall and waste, bytes
read and I/O wait per decoded token, slots and pinned experts per layer, the plan's predicted miss rate. Speculative decoding (docs/SPECULATIVE.md; :func:`speculation_columns`,
from the "generate" runs of bench/lab/worker.py), medians over the ok runs of the row, None where a
run has no speculation (stock, or off):
  acceptance          drafted tokens accepted / drafted (all sources)
  tokens_per_pass     delivered tokens per verify pass (accepted drafts + the sampled token)
  flash_mb_per_token  flash bytes the neuron cache read per delivered token (MB)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from . import benchkit
from .pagecache import MiB


def limit_label(limit: int | None) -> str:
    return "none" if limit is None else str(limit)


def add_io_bound(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], sidecar: Path, expert_disk: Optional[dict] = None
) -> None:
    """For each flash-offload row: the decode speed the disk allows, ``io_bound_tps`` = the disk's
    throughput for the engine's reads ÷ the bytes read per decoded token (``decode_read_mb_per_tok``),
    and ``of_io_bound`` = decode ÷ that. The throughput is the saved disk profile's (``llamaflash plan
    --probe-disk``) for the sidecar's filesystem, at the plan's read size (half a cache slot: its up or
    its down_t rows) and queue depth. Rows stay without these fields when no profile is saved.
    Rows that served an MoE model's experts (``experts``, :func:`expert_columns`) get theirs from
    ``expert_disk`` (:func:`expert_read_rate`; None: none) by :func:`add_expert_io_bound`."""
    from llamaflash.planning import disk_probe
    from llamaflash.planning.planner import disk_throughput

    add_expert_io_bound(rows, expert_disk)
    profile = disk_probe.saved_profile(sidecar)
    if profile is None:
        return
    for row in rows:
        plans = [
            ((r.get("ram_budget") or {}).get("plan") or {})
            for r in runs
            if r.get("ok") and r["config"] == row["config"] and r["limit_mb"] == row["limit_mb"]
        ]
        plan = next((p for p in plans if p.get("slot_bytes")), None)
        # the neuron cache's own count where there is one (io_uring reads escape /proc/self/io)
        per_tok = (
            row["flash_mb_per_token"] * 1e6 / MiB
            if row.get("flash_mb_per_token")
            else row.get("decode_read_mb_per_tok")
        )
        if plan is None or not per_tok:
            continue
        size = plan["slot_bytes"] / 2
        mb_s = disk_throughput(profile, size, plan["queue_depth"]) / 1e6
        row["io_bound"] = {
            "disk_mb_s": mb_s,
            "read_kib": size / 1024,
            "queue_depth": plan["queue_depth"],
            "profile": profile.get("saved_at"),
            "mib_per_token": per_tok,
        }
        row["io_bound_tps"] = mb_s * 1e6 / (per_tok * MiB)
        row["of_io_bound"] = row["decode_tps"] / row["io_bound_tps"] if row.get("decode_tps") else None


#: The expert engine's statistics (``flash_stats()["experts"]``, runtime/expert_runtime.stats) a row keeps.
EXPERT_STATS = (
    "hit_rate",
    "prefetch_recall",
    "prefetch_waste",
    "bytes_read_per_token",
    "io_wait_per_token_s",
    "slots_per_layer",
    "pinned_per_layer",
    "predicted_miss_rate",
)


def expert_columns(good: list[dict[str, Any]]) -> Optional[dict[str, Optional[float]]]:
    """Medians over ``good`` (ok runs) of their expert statistics (EXPERT_STATS), each over the runs that
    have it; None when no run served experts (stock, a dense model, an MoE model the budget runs stock)."""
    ex = [r["flash_stats"]["experts"] for r in good if (r.get("flash_stats") or {}).get("experts")]
    if not ex:
        return None
    return {k: benchkit.median(e.get(k) for e in ex) for k in EXPERT_STATS}


def expert_read_rate(model: Path, sidecar: Path, n_ctx: int = 512) -> Optional[dict[str, Any]]:
    """The disk rate the expert planner gives an MoE model's expert reads (None for a dense model):
    ``disk_mb_s`` = plan_experts' ``disk_bytes_per_s`` / 1e6 (the disk profile's throughput for one
    expert tensor's slot share, at EXPERT_READ_DEPTH), with ``read_kib``, ``queue_depth`` and
    ``profile`` (where the disk profile came from). The profile is the one a Llama loading ``sidecar``
    plans with: the saved probe of its filesystem, else the planner's built-in default."""
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.planning import disk_probe, expert_plan
    from llamaflash.planning.plan_disk import default_disk, disk_source

    header = read_gguf_header(model)
    moe = read_moe_model(header)
    if moe is None:
        return None
    disk = disk_probe.saved_profile(sidecar) or default_disk()
    # n_used slots per layer at a budget that holds them: a plan that serves experts whatever fits
    plan = expert_plan.plan_experts(moe, header, 1 << 20, n_ctx=n_ctx, disk=disk, n_slots=moe.n_used)
    return {
        "disk_mb_s": plan.disk_bytes_per_s / 1e6,
        "read_kib": plan.slot_bytes / max(1, len(moe.layers[0].tensors)) / 1024,
        "queue_depth": expert_plan.EXPERT_READ_DEPTH,
        "profile": disk.get("saved_at") or disk_source(disk),
    }


def add_expert_io_bound(rows: list[dict[str, Any]], expert_disk: Optional[dict[str, Any]]) -> None:
    """For each row with expert statistics that read from flash: ``io_bound_tps`` = disk bytes/s
    (``expert_disk["disk_mb_s"]``) ÷ the median bytes read per decoded token, ``of_io_bound`` = decode ÷
    that, and ``io_bound`` (what it came from, as :func:`add_io_bound` records it). No-op for
    ``expert_disk`` None."""
    if not expert_disk:
        return
    for row in rows:
        per_tok = (row.get("experts") or {}).get("bytes_read_per_token")
        if not per_tok:
            continue
        row["io_bound"] = {**expert_disk, "mib_per_token": per_tok / MiB}
        row["io_bound_tps"] = expert_disk["disk_mb_s"] * 1e6 / per_tok
        row["of_io_bound"] = row["decode_tps"] / row["io_bound_tps"] if row.get("decode_tps") else None


def io_bound_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's lines for :func:`add_io_bound` (and :func:`add_expert_io_bound`)."""
    out = []
    profiles = set()
    for row in rows:
        b = row.get("io_bound")
        if not b:
            continue
        profiles.add(str(b.get("profile")))
        of = "" if row.get("of_io_bound") is None else f" = {row['of_io_bound']:.0%} of it"
        per_tok = b["mib_per_token"]
        what = "of expert reads" if row.get("experts") else "read"
        decode = "-" if row.get("decode_tps") is None else f"{row['decode_tps']:.2f}"
        out.append(
            f"  {limit_label(row['limit_mb'])} MB {row['config']}: {per_tok:.{0 if per_tok >= 10 else 2}f} MiB "
            f"{what} per decoded token at {b['disk_mb_s']:.0f} MB/s ({b['read_kib']:.0f} KiB reads, depth "
            f"{b['queue_depth']}) bounds decode at {row['io_bound_tps']:.2f} tok/s; measured {decode}{of}"
        )
    if out:
        out.insert(
            0,
            "I/O bound (disk profile: "
            + ", ".join(sorted(profiles))
            + "; the sidecar's filesystem, saved by llamaflash plan --probe-disk):",
        )
    return out


def _spec(r: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    s = (r.get("flash_stats") or {}).get("speculative")
    return s if s and s.get("enabled") else None


def speculation_columns(good: List[Dict[str, Any]]) -> Dict[str, Any]:
    def per_run(r: Dict[str, Any]) -> Dict[str, Optional[float]]:
        s = _spec(r)
        off = (r.get("flash_stats") or {}).get("offload") or {}
        delivered = r.get("n_gen_done") or 0
        return {
            "acceptance": s.get("acceptance") if s else None,
            "tokens_per_pass": s.get("tokens_per_pass") if s else None,
            "flash_mb_per_token": off["bytes_read"] / 1e6 / delivered if off.get("bytes_read") and delivered else None,
        }

    rows = [per_run(r) for r in good]
    return {
        key: benchkit.median(x[key] for x in rows) for key in ("acceptance", "tokens_per_pass", "flash_mb_per_token")
    }


def speculation_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """One line per row that speculated, for the report under the table."""
    out = []
    for row in rows:
        if row.get("tokens_per_pass") is None:
            if row.get("flash_mb_per_token"):
                out.append(
                    f"  {row['limit_mb']} MB {row['config']}: no speculation | "
                    f"{row['flash_mb_per_token']:.0f} MB read from flash per token"
                )
            continue
        acc = row.get("acceptance")
        mb = row.get("flash_mb_per_token")
        out.append(
            f"  {row['limit_mb']} MB {row['config']}: acceptance {acc:.2f} "
            if acc is not None
            else f"  {row['limit_mb']} MB {row['config']}: acceptance - "
        )
        out[-1] += f"| {row['tokens_per_pass']:.2f} tokens per verify pass" + (
            f" | {mb:.0f} MB read from flash per delivered token" if mb is not None else ""
        )
    return out
