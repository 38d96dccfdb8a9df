"""Converting an MoE base model: the expert sidecar (plugin/files/expert_sidecar.py).

What it records, per MoE layer: a CRC-32C of every expert's slice of every expert tensor (the engine
checks each slice it reads against it), and routing statistics measured on calibration text by
running the model through stock llama.cpp (converters/moe_routing.py): how often each expert was
selected (the planner pins the most popular), and the previous-token reuse. The base model's bytes
are not copied: the engine reads experts straight from the base file.

Memory: the checksums read the file sequentially through the page cache, and the routing runs
with plain file-backed weights (no anonymous copy of the experts), ``ROUTING_SEQUENCES`` calibration
sequences side by side per batch, so a memory limit below the model's size costs re-reads from
disk (each batch reads every expert once), not an OOM kill.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np

from llamaflash.errors import ConversionError, OutputExistsError
from llamaflash.files import expert_sidecar
from llamaflash.files.experts import MoeModelInfo, check_layout
from llamaflash.files.gguf_model import BaseModelInfo, base_identity

#: calibration sequences evaluated side by side in one batch while routing is measured
ROUTING_SEQUENCES = 4


def expert_checksums(moe: MoeModelInfo, progress=None) -> dict[int, dict[str, np.ndarray]]:
    """CRC-32C of each expert slice, per layer and tensor kind (uint32 [n_expert]); ``progress(done,
    total)`` after each layer."""
    from llamaflash import _native

    out: dict[int, dict[str, np.ndarray]] = {}
    with open(moe.path, "rb") as f:
        for layer in moe.layers:
            out[layer.layer] = {}
            for t in layer.tensors:
                f.seek(t.offset)
                data = f.read(t.expert_bytes * t.n_expert)
                if len(data) != t.expert_bytes * t.n_expert:
                    raise ConversionError(f"{moe.path}: tensor {t.name} runs past the end of the file")
                out[layer.layer][t.kind] = np.asarray(
                    _native.crc32c_rows(data, t.expert_bytes, "auto"), dtype=np.uint32
                )
            if progress is not None:
                progress(len(out), len(moe.layers))
    return out


def routing_statistics(trace, n_expert: int) -> tuple[dict[int, np.ndarray], dict[int, float]]:
    """Per layer: selections of each expert (float32 [n_expert]) and the previous-token reuse
    (converters/moe_routing_stats.py)."""
    from llamaflash.converters.moe_routing_stats import expert_counts, reuse_rate

    follows = trace.continues_previous()
    counts = {il: expert_counts(trace.experts[il], n_expert).astype(np.float32) for il in trace.layers}
    reuse = {il: float(reuse_rate(trace.experts[il], follows)) for il in trace.layers}
    return counts, reuse


def convert_experts(
    model_path: Path,
    model: BaseModelInfo,
    moe: MoeModelInfo,
    out: Path,
    *,
    force: bool = False,
    progress: bool = True,
    calib_text: str | None = None,
    calib_tokens: int = 2048,
    calib_source: str = "",
    n_threads: int | None = None,
) -> Path:
    """Writes the expert sidecar of ``moe`` to ``out``; returns ``out``. ``calib_text``: text to measure
    routing on (None: no routing statistics; the planner then pins nothing)."""
    from llamaflash.converters.writer import removing_temporaries_on_signal

    why = check_layout(moe)
    if why is not None:
        raise ConversionError(f"{model_path}: {why}. Use llama_cpp.Llama for this model.")
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists. Pass --force to overwrite it.")
    stream: TextIO | None = sys.stderr if progress else None
    t0 = time.perf_counter()

    def say(line: str) -> None:
        if stream is not None:
            print(f"[convert {time.perf_counter() - t0:6.1f}s] {line}", file=stream, flush=True)

    say(
        f"{model_path} -> {out} ({len(moe.layers)} MoE layers, {moe.n_expert} experts, {moe.n_used} used, "
        f"{moe.architecture}; experts {moe.expert_bytes_total / 2**20:.0f} MiB of {moe.file_size / 2**20:.0f} MiB)"
    )
    with removing_temporaries_on_signal(out):
        identity = base_identity(model_path, model)
        step = max(1, len(moe.layers) // 8)
        checksums = expert_checksums(
            moe,
            lambda done, total: say(f"checksums: {done}/{total} layers") if done % step == 0 or done == total else None,
        )
        say("checksums of every expert slice done")
        counts = reuse = None
        tokens = 0
        if calib_text:
            from llamaflash.converters import moe_routing

            trace = moe_routing.record_text_routing(
                model_path,
                n_tokens=calib_tokens,
                text=calib_text,
                n_threads=n_threads,
                n_seq=ROUTING_SEQUENCES,
                progress=lambda done, total: say(f"routing: {done}/{total} calibration tokens"),
            )
            counts, reuse = routing_statistics(trace, moe.n_expert)
            tokens = trace.n_tokens
            say(f"routing measured on {tokens} tokens: previous-token reuse {np.nanmean(list(reuse.values())):.2f}")
        path = expert_sidecar.write_expert_sidecar(out, moe, identity, checksums, counts, reuse, tokens, calib_source)
    say(f"wrote {out} ({os.path.getsize(out) / 1024:.0f} KiB)")
    return path
