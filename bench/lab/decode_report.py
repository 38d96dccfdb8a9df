"""What the memory-limit benchmark reports about decode beyond tok/s, per (limit, config) row.

The I/O bound (:func:`add_io_bound`): the decode speed the disk allows for the bytes read per
decoded (delivered) token. Speculative decoding (docs/SPECULATIVE.md; :func:`speculation_columns`,
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


def add_io_bound(rows: list[dict[str, Any]], runs: list[dict[str, Any]], sidecar: Path) -> None:
    """For each flash-offload row: the decode speed the disk allows, ``io_bound_tps`` = the disk's
    throughput for the engine's reads ÷ the bytes read per decoded token (``decode_read_mb_per_tok``),
    and ``of_io_bound`` = decode ÷ that. The throughput is the saved disk profile's (``llamaflash plan
    --probe-disk``) for the sidecar's filesystem, at the plan's read size (half a cache slot: its up or
    its down_t rows) and queue depth. Rows stay without these fields when no profile is saved."""
    from llamaflash.planning import disk_probe
    from llamaflash.planning.planner import disk_throughput

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


def io_bound_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's lines for :func:`add_io_bound`."""
    out = []
    for row in rows:
        b = row.get("io_bound")
        if not b:
            continue
        of = "" if row.get("of_io_bound") is None else f" = {row['of_io_bound']:.0%} of it"
        out.append(
            f"  {limit_label(row['limit_mb'])} MB {row['config']}: {row['io_bound']['mib_per_token']:.0f} MiB read per "
            f"decoded token at {b['disk_mb_s']:.0f} MB/s ({b['read_kib']:.0f} KiB reads, depth "
            f"{b['queue_depth']}) bounds decode at {row['io_bound_tps']:.2f} tok/s; measured "
            f"{row['decode_tps']:.2f}{of}"
        )
    if out:
        out.insert(0, "I/O bound (the saved disk profile of the sidecar's filesystem; llamaflash plan --probe-disk):")
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
