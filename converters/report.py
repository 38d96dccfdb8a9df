"""The conversion report: ``<sidecar>.report.json`` and a table per layer on stderr.

Quality numbers (perplexity, greedy agreement, active fraction) are measured by the method the
report names (``quality.method``; this converter writes ``engine``: llamaflash's sparse lane, see
:mod:`.quality`). Sparsity and FFN output error are measured directly on profiled activations of
held-out calibration tokens (:mod:`.analysis`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TextIO

import numpy as np

from llamaflash.converters.quality import GREEDY_PROMPTS, GREEDY_TOKENS
from llamaflash.files import sidecar_format as fmt

REPORT_SUFFIX = ".report.json"

#: Report format: 2 since the quality method is named (quality.method; field names without "_emulated");
#: 3 since the converter trains no activation predictors (no "pred_*", "bytes_per_token_predictor_first",
#: "curve.predictors", "selection*", "layers_predictor" or "mean_pred_*" fields).
REPORT_VERSION = 3

#: What the report's quality numbers are (method ``engine``, the only one this converter measures with).
QUALITY_NOTE = (
    "Measured with llamaflash's sparse engine: every token of every evaluated batch ran through the "
    "sparse lane inside llama.cpp (gate-first selection in every layer, the sidecar's down_t), as decode "
    "computes it; the dense reference and the greedy continuations are stock llama.cpp."
)


def report_path(sidecar: Path) -> Path:
    """``model.flash.gguf`` → ``model.flash.gguf.report.json``."""
    return sidecar.with_name(sidecar.name + REPORT_SUFFIX)


def build_report(result, sidecar: Path, model_path: Path) -> dict:
    """The report as a JSON-ready dict."""
    opts = result.options
    dense = result.dense
    layers = []
    for layer, d in sorted(result.decisions.items()):
        an = result.analyses[layer]
        entry = {
            "layer": layer,
            "samples": an.n_train + an.n_heldout,
            "heldout_samples": an.n_heldout,
            "threshold": d.threshold,
            "sparsity_heldout": d.sparsity,
            "ffn_rel_error": d.ffn_rel_error,
            "bytes_per_token_gate_first": d.bytes_gate,
            "natural_sparsity": an.natural_sparsity,
            "gate_check_rel_error": an.gate_check_error,
            "hot_neurons_freq_ge_0.5": int(np.count_nonzero(d.freq >= 0.5)),
            "curve": {
                "levels": an.levels.tolist(),
                "thresholds": an.thresholds.tolist(),
                "sparsity_heldout": an.sparsity_heldout.tolist(),
                "ffn_rel_error": an.ffn_error.tolist(),
                "criterion_act_gate_up": {
                    "thresholds": an.thresholds_gate_up.tolist(),
                    "sparsity_heldout": an.sparsity_heldout_gate_up.tolist(),
                    "ffn_rel_error": an.ffn_error_gate_up.tolist(),
                },
            },
        }
        layers.append(entry)

    quality = None
    if dense is not None:
        quality = {
            "method": result.quality_method,
            "note": QUALITY_NOTE,
            "validation": result.validation.source,
            "validation_tokens": result.validation_tokens,
            "ppl_dense": dense.ppl,
            "curve": [p.to_dict(dense) for p in result.curve],
            "chosen": result.chosen.to_dict(dense) if result.chosen is not None else None,
            "greedy_prompts": list(GREEDY_PROMPTS),
            "greedy_tokens_per_prompt": GREEDY_TOKENS,
        }

    n_served = len(result.decisions)

    def mean(xs):
        return float(np.mean(xs)) if xs else None

    report = {
        "llamaflash_report": REPORT_VERSION,
        "sidecar": str(sidecar),
        "model": str(model_path),
        "base_architecture": result.model.architecture,
        "format_version": fmt.FORMAT_VERSION,
        "criterion": fmt.CRITERION_ACT_GATE,
        "bundle_order": opts.order,
        "operating_point": {
            "method": result.method,
            "target_sparsity": result.target,
            "quality_budget": opts.quality_budget if result.method == fmt.SPARSITY_METHOD_AUTO else None,
            "mean_sparsity_heldout": mean([d.sparsity for d in result.decisions.values()]),
            "mean_ffn_rel_error": mean([d.ffn_rel_error for d in result.decisions.values()]),
            "quality_method": result.quality_method,
            "ppl_dense": dense.ppl if dense is not None else None,
            "ppl": result.chosen.ppl if result.chosen is not None else None,
            "ppl_delta": result.chosen.ppl_delta(dense) if result.chosen is not None else None,
            "greedy_agreement": result.chosen.greedy_agreement if result.chosen is not None else None,
            "active_fraction": result.chosen.active_fraction if result.chosen is not None else None,
        },
        "calibration": {
            "source": result.calibration.source,
            "sha256": result.calibration.sha256,
            "tokens": result.calibration_tokens,
            "samples_per_layer": result.samples_per_layer,
            "heldout_samples": result.heldout_tokens,
            "chunk_len": result.chunk_len,
        },
        "quality": quality,
        "served_layers": n_served,
        "layers": layers,
        "notes": list(result.notes),
        "llama_threads": result.threads,
        "timings_s": dict(result.timings),
    }
    return _clean(report)


def write_report(result, sidecar: Path, model_path: Path) -> Path:
    """Write the report beside the sidecar (atomically) and return its path."""
    path = report_path(sidecar)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(build_report(result, sidecar, model_path), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def print_table(result, stream: TextIO) -> None:
    """Per-layer table and the quality summary."""
    p = lambda line="": print(line, file=stream)  # noqa: E731
    p()
    p(f"operating point: {result.method} sparsity {result.target:.2f} (criterion |act(gate.x)| <= threshold)")
    p(f"{'layer':>5} {'threshold':>10} {'sparsity':>8} {'ffn_err':>8} {'bytes/tok':>10}")
    for layer, d in sorted(result.decisions.items()):
        p(f"{layer:>5} {d.threshold:>10.4g} {d.sparsity:>8.3f} {d.ffn_rel_error:>8.4f} {d.bytes_gate:>10.0f}")
    if result.dense is not None:
        dense = result.dense
        p(
            f"quality ({fmt.QUALITY_METHOD_LABELS[result.quality_method]}; {result.validation_tokens} tokens of "
            f"{result.validation.source}):"
        )
        p(f"  dense ppl {dense.ppl:.4f}")

        def point(label, q):
            p(
                f"  {label}: ppl {q.ppl:.4f} ({100 * q.ppl_delta(dense):+.2f}%), "
                f"greedy agreement {q.greedy_agreement:.3f}, active fraction {q.active_fraction:.3f}"
            )

        for q in result.curve:
            point(f"sparsity {q.target_sparsity:.2f}", q)
        if result.chosen is not None:
            point("chosen", result.chosen)
    for note in result.notes:
        p(f"note: {note}")


def _clean(obj):
    """Replace non-finite floats by None and numpy scalars by Python ones (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj
