#!/usr/bin/env python3
"""Compare the two inactivity criteria end to end (EMULATED perplexity and greedy agreement).

    python scripts/compare_criteria.py MODEL.gguf 0.2,0.3,0.4 out.json

Profiles MODEL like ``llamaflash convert`` (4096 calibration tokens of the registry corpus), computes
per-layer thresholds for |act(gate·x)| (CATS, the sidecar's criterion) and |act(gate·x)·(up·x)| at
each sparsity level, and measures both with the converter's sparse-FFN emulation in stock llama.cpp
on 2048 held-out Shakespeare tokens. Prints one JSON line per level and writes them all to out.json.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from llamaflash import sidecar_format as fmt
from llamaflash.converters import calibrate as C
from llamaflash.converters import texts
from llamaflash.converters.analysis import AnalysisSettings
from llamaflash.converters.llama_runner import EmulatedLayer, LlamaRunner
from llamaflash.converters.pipeline import ConvertOptions
from llamaflash.converters.quality import QualityEvaluator
from llamaflash.gguf_model import read_base_model


def main(model_path: str, levels_arg: str, out_path: str) -> None:
    levels = [float(v) for v in levels_arg.split(",")]
    model = read_base_model(model_path)
    opts = ConvertOptions()
    runner = LlamaRunner(model_path, opts.chunk_len, n_threads=C._default_threads(model))
    calib = texts.default_calibration()
    per_chunk = runner.n_ctx - (1 if runner.bos is not None else 0)
    windows = texts.calibration_tokens(runner.tokenize, calib.text, opts.calib_tokens, per_chunk)
    chunks = texts.calibration_chunks(windows, opts.calib_tokens, runner.n_ctx, runner.bos,
                                      texts.required_calibration_tokens(model.n_embd), calib, model_path)
    x, heldout, checks = C._profile(runner, model, chunks, runner.bos, opts, None)
    analyses = C._analyse(model, x, heldout, checks, AnalysisSettings(levels=tuple([0.0] + levels), ranks=()), None)
    valid = texts.default_validation(opts.valid_tokens * 8)
    vchunks = texts.validation_chunks(runner.tokenize(valid.text), opts.valid_tokens, runner.n_ctx, runner.bos,
                                      valid.source, model_path)
    ev = QualityEvaluator(runner, model.activation, vchunks)
    dense = ev.measure_dense()
    out = {"model": model_path, "ppl_dense_emulated": dense.ppl, "validation_tokens": ev.n_tokens, "rows": []}
    for level in levels:
        row = {"level": level}
        for criterion, attr, err in ((fmt.CRITERION_ACT_GATE, "thresholds", "ffn_error"),
                                     ("act_gate_up", "thresholds_gate_up", "ffn_error_gate_up")):
            layers = {layer: EmulatedLayer(float(getattr(an, attr)[an.level_index(level)]), criterion=criterion)
                      for layer, an in analyses.items()}
            q = ev.measure(layers, level)
            row[criterion] = {
                "ppl_emulated": q.ppl, "ppl_delta_emulated": q.ppl_delta(dense),
                "greedy_agreement_emulated": q.greedy_agreement, "measured_sparsity_emulated": q.measured_sparsity,
                "mean_ffn_rel_error": float(np.mean([getattr(an, err)[an.level_index(level)]
                                                     for an in analyses.values()])),
            }
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    runner.close()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
