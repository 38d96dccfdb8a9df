"""Steps 2–5 of the conversion (see :mod:`.pipeline`): texts, profiling, analysis, operating point.

:func:`calibrate` returns a :class:`CalibrationResult`: the per-layer
:class:`~llamaflash.converters.sparsity.LayerDecision` s wrapped in a
:class:`~llamaflash.converters.sparsity.SparsityStage`, the file-level keys, and everything
the report shows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import gguf
import numpy as np

from llamaflash.converters import texts
from llamaflash.converters.analysis import AnalysisSettings, LayerAnalysis, analyse_layer
from llamaflash.converters.blas import blas_threads
from llamaflash.converters.engine_quality import EngineRunner, measurement_sidecar
from llamaflash.converters.llama_runner import LlamaRunner, ProfileHook
from llamaflash.converters.progress import Progress
from llamaflash.converters.quality import GREEDY_PROMPTS, GREEDY_TOKENS, QualityEvaluator, QualityPoint
from llamaflash.converters.sparsity import LayerDecision, SparsityStage, decide_layer
from llamaflash.converters.writer import SidecarPlan
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import BaseModelInfo, TensorLocation, read_tensor_rows


@dataclass
class CalibrationResult:
    """What the calibration decided and measured (see :mod:`.report` for how it is shown)."""

    model: BaseModelInfo
    options: object  # ConvertOptions
    calibration: texts.TextSource
    calibration_tokens: int
    heldout_tokens: int
    samples_per_layer: int
    chunk_len: int
    method: str  # "fixed" | "auto"
    target: float
    analyses: dict[int, LayerAnalysis]
    decisions: dict[int, LayerDecision]
    stage: SparsityStage
    validation: texts.TextSource | None = None
    validation_tokens: int = 0
    dense: QualityPoint | None = None
    curve: list[QualityPoint] = field(default_factory=list)
    chosen: QualityPoint | None = None  # the operating point with the recorded selection modes
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    threads: int = 0  # llama.cpp threads used
    quality_method: str | None = None  # "engine", or None (quality not measured)

    def add_header_keys(self, plan: SidecarPlan) -> None:
        """The file-level v2 keys."""
        plan.set_string(fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE)
        plan.set_string(fmt.KEY_SPARSITY_METHOD, self.method)
        plan.set_string(fmt.KEY_BUNDLE_ORDER, self.options.order)
        plan.set_float32(fmt.KEY_SPARSITY_TARGET, self.target)
        if self.method == fmt.SPARSITY_METHOD_AUTO:
            plan.set_float32(fmt.KEY_QUALITY_BUDGET, self.options.quality_budget)
        plan.set_uint32(fmt.KEY_CALIB_TOKENS, self.calibration_tokens)
        plan.set_string(fmt.KEY_CALIB_SOURCE, self.calibration.source)
        plan.set_string(fmt.KEY_CALIB_SHA256, self.calibration.sha256)
        levels, table = self.threshold_table()
        if levels:
            plan.set_float32_array(fmt.KEY_THRESHOLD_LEVELS, levels)
            plan.set_float32_array(fmt.KEY_THRESHOLD_TABLE, table)
        if self.dense is not None and self.chosen is not None:
            key = lambda name: fmt.quality_key(self.quality_method, name)  # noqa: E731
            plan.set_string(key(fmt.QUALITY_VALIDATION), self.validation.source)
            plan.set_uint32(key(fmt.QUALITY_VALIDATION_TOKENS), self.validation_tokens)
            plan.set_float32(key(fmt.QUALITY_PPL_DENSE), self.dense.ppl)
            plan.set_float32(key(fmt.QUALITY_PPL), self.chosen.ppl)
            plan.set_float32(key(fmt.QUALITY_GREEDY), self.chosen.greedy_agreement)
            plan.set_float32(key(fmt.QUALITY_ACTIVE_FRACTION), self.chosen.active_fraction)
            if self.curve:
                plan.set_float32_array(key(fmt.QUALITY_CURVE_SPARSITY), [p.target_sparsity for p in self.curve])
                plan.set_float32_array(key(fmt.QUALITY_CURVE_PPL), [p.ppl for p in self.curve])
                plan.set_float32_array(key(fmt.QUALITY_CURVE_GREEDY), [p.greedy_agreement for p in self.curve])
                plan.set_float32_array(key(fmt.QUALITY_CURVE_ACTIVE_FRACTION), [p.active_fraction for p in self.curve])

    def set_decisions(self, target: float) -> None:
        """Per served layer, the :class:`LayerDecision` at ``target``; and the stage."""
        opts = self.options
        self.decisions = {
            ffn.layer: decide_layer(self.analyses[ffn.layer], ffn, target, opts.order, opts.down_t_type)
            for ffn in self.model.ffn_layers
        }
        self.stage = SparsityStage(self.decisions)

    def threshold_table(self) -> tuple[list[float], list[float]]:
        """The analysed levels (> 0) and every layer's threshold at each, layer-major in layer
        order (:data:`~llamaflash.files.sidecar_format.KEY_THRESHOLD_TABLE`)."""
        layers = sorted(self.analyses)
        if not layers:
            return [], []
        levels = [float(v) for v in self.analyses[layers[0]].levels if v > 0]
        table = []
        for layer in layers:
            an = self.analyses[layer]
            table.extend(float(an.thresholds[an.level_index(v)]) for v in levels)
        return levels, table

    def write_report(self, sidecar: Path, model_path: Path) -> Path:
        from llamaflash.converters.report import write_report

        return write_report(self, sidecar, model_path)

    def print_table(self, stream: TextIO) -> None:
        from llamaflash.converters.report import print_table

        print_table(self, stream)


#: ``write(result, path)``: write the sidecar ``result`` describes to ``path`` (the pipeline's write path).
SidecarWriter = Callable[[CalibrationResult, Path], object]


def calibrate(
    model: BaseModelInfo,
    opts,
    stream: TextIO | None,
    out: Path | None = None,
    write_sidecar: SidecarWriter | None = None,
) -> CalibrationResult:
    """Profile ``model``, analyse every served layer and choose the operating point.

    Quality is measured by the sparse engine on a temporary sidecar beside ``out`` written by
    ``write_sidecar`` (both required when quality is measured; see :mod:`.engine_quality`)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    fixed = not isinstance(opts.sparsity, str)
    need_quality = (not fixed) or opts.measure_quality
    if need_quality and (out is None or write_sidecar is None):
        raise ValueError("measuring quality needs the output path and a sidecar writer")
    calib = _calibration_source(opts)
    valid = _validation_source(opts) if need_quality else None
    label = f"{model.path.name} ({model.architecture}, n_embd {model.n_embd})"

    threads = opts.n_threads or _default_threads(model)
    runner = LlamaRunner(model.path, opts.chunk_len, n_threads=threads)
    try:
        bos = runner.bos
        per_chunk = runner.n_ctx - (1 if bos is not None else 0)
        windows = texts.calibration_tokens(runner.tokenize, calib.text, opts.calib_tokens, per_chunk)
        chunks = texts.calibration_chunks(
            windows, opts.calib_tokens, runner.n_ctx, bos, texts.required_calibration_tokens(model.n_embd), calib, label
        )
        vchunks = None
        if valid is not None:
            vchunks = texts.validation_chunks(
                runner.tokenize(valid.text), opts.valid_tokens, runner.n_ctx, bos, valid.source, label
            )
        timings["texts_s"] = time.perf_counter() - t0

        t = time.perf_counter()
        x, heldout, gate_checks = _profile(runner, model, chunks, bos, opts, stream)
        timings["profile_s"] = time.perf_counter() - t

        levels = sorted(set(opts.levels) | ({float(opts.sparsity)} if fixed else set()) | {0.0})
        settings = AnalysisSettings(levels=tuple(levels), seed=opts.seed)
        t = time.perf_counter()
        analyses = _analyse(model, x, heldout, gate_checks, settings, stream)
        timings["analyse_s"] = time.perf_counter() - t
        del x

        t = time.perf_counter()
        result = CalibrationResult(
            model=model,
            options=opts,
            calibration=calib,
            calibration_tokens=int(sum(c.size - (1 if bos is not None else 0) for c in chunks)),
            heldout_tokens=int(np.count_nonzero(heldout[model.ffn_layers[0].layer])),
            samples_per_layer=int(heldout[model.ffn_layers[0].layer].size),
            chunk_len=runner.n_ctx,
            method=fmt.SPARSITY_METHOD_FIXED if fixed else fmt.SPARSITY_METHOD_AUTO,
            target=float(opts.sparsity) if fixed else 0.0,
            analyses=analyses,
            decisions={},
            stage=SparsityStage({}),
            validation=valid,
        )
        if need_quality:
            result.quality_method = fmt.QUALITY_METHOD_ENGINE
            bar = Progress(stream, 0, f"quality ({fmt.QUALITY_METHOD_ENGINE})", unit="eval")
            evaluator = QualityEvaluator(runner, vchunks, GREEDY_PROMPTS, GREEDY_TOKENS, tick=bar.update)
            result.validation_tokens = evaluator.n_tokens
            to_eval = [s for s in levels if s > 0] if not fixed else [float(opts.sparsity)] if opts.sparsity > 0 else []
            try:
                bar.add_total(evaluator.steps_per_eval * (1 + len(to_eval)))
                dense = evaluator.measure_dense()
                runner.close()  # the stock model is not needed any more: free its context first
                _engine_operating_point(
                    result, evaluator, dense, to_eval, fixed, opts, bar, threads, out, write_sidecar
                )
            finally:
                bar.close()
        result.set_decisions(result.target)
        result.stage = SparsityStage(result.decisions)
        timings["quality_s"] = time.perf_counter() - t
    finally:
        runner.close()
    result.timings.update(timings)
    result.threads = threads
    return result


# --------------------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------------------


def _default_threads(model: BaseModelInfo) -> int:
    """llama.cpp threads when ``--threads`` is not given: one for tiny models (OpenMP barriers cost
    more than the work), else one per core that is not busy at the start (1-minute load average),
    at most 8. llama.cpp's OpenMP workers spin at every barrier: with more threads than free
    cores they wait on each other (measured here on a shared 2-core machine: a tiny model's
    decode took 234 ms with 2 threads against 4 ms with 1 while another process ran)."""
    cores = os.cpu_count() or 1
    if model.file_size < 32 << 20:
        return 1
    try:
        busy = int(os.getloadavg()[0] + 0.5)
    except OSError:  # pragma: no cover - no load average on this platform
        busy = 0
    return max(1, min(cores - busy, 8))


def _calibration_source(opts) -> texts.TextSource:
    if opts.calib_text is not None:
        return texts.TextSource(opts.calib_text, "text given to convert()")
    if opts.calib_path is not None:
        return texts.read_text_file(opts.calib_path, "calibration")
    return texts.default_calibration(opts.cache_dir)


def _validation_source(opts) -> texts.TextSource:
    if opts.valid_text is not None:
        return texts.TextSource(opts.valid_text, "text given to convert()")
    if opts.valid_path is not None:
        return texts.read_text_file(opts.valid_path, "validation")
    return texts.default_validation(opts.valid_tokens * 8, opts.cache_dir)


#: While profiling, logits are asked for every OUTPUT_STRIDE-th token only: llama.cpp's last layer
#: computes just those rows (so it gets 1/OUTPUT_STRIDE of the samples), and the output projection,
#: as costly as the whole model for large vocabularies (Gemma-3: 262k x 640), runs on 1/4 of them.
OUTPUT_STRIDE = 4


def _profile(runner: LlamaRunner, model: BaseModelInfo, chunks, bos, opts, stream):
    """FFN inputs of every served layer: (x per layer (N_layer, n_embd) float16, held-out mask per
    layer (N_layer,), gate check pairs per layer). The BOS position of each chunk is left out; the
    model's last layer sees only every OUTPUT_STRIDE-th position."""
    layers = [ffn.layer for ffn in model.ffn_layers]
    last = model.n_layer - 1
    hook = ProfileHook(layers, output_layer=last)
    first = 1 if bos is not None else 0
    hook.keep = slice(first, None)
    heldout_parts, heldout_last = [], []
    period = max(2, round(1 / opts.heldout_fraction)) if opts.heldout_fraction > 0 else 0
    with Progress(stream, len(chunks), "profile", unit="chunk") as bar:
        for i, chunk in enumerate(chunks):
            pos = np.arange(chunk.size)
            outputs = (pos % OUTPUT_STRIDE == OUTPUT_STRIDE - 1) & (pos >= first)
            outputs[-1] = True
            runner.decode(chunk, hook, outputs=outputs)
            if len(chunks) >= period:  # whole chunks held out: every period-th chunk
                held = np.full(chunk.size, i % period == period - 1)
            else:  # too few chunks: the last part of each
                held = pos >= chunk.size - max(1, int((chunk.size - first) * opts.heldout_fraction))
            heldout_parts.append(held[first:])
            heldout_last.append(held[outputs])
            bar.update()
    heldout_all = np.concatenate(heldout_parts)
    heldout_out = np.concatenate(heldout_last)
    rng = np.random.default_rng(opts.seed)
    x, heldout = {}, {}
    for layer in layers:
        rows = np.concatenate(hook.x.pop(layer))
        held = heldout_out if layer == last else heldout_all
        if rows.shape[0] != held.size:
            raise RuntimeError(f"layer {layer}: profiled {rows.shape[0]} FFN inputs for {held.size} tokens")
        if held.size > opts.max_samples:
            keep = np.sort(rng.choice(held.size, opts.max_samples, replace=False))
            rows, held = rows[keep], held[keep]
        x[layer], heldout[layer] = rows, held
    checks = {
        layer: (hook.x_check[layer], hook.gate_check[layer])
        for layer in layers
        if layer in hook.gate_check and layer in hook.x_check
    }
    return x, heldout, checks


def dequantize(model_path: Path, tensor: TensorLocation) -> np.ndarray:
    """``tensor`` of the base model as float32, numpy shape (n_rows, ne0)."""
    raw = np.asarray(read_tensor_rows(model_path, tensor))
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(tensor.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(tensor.n_rows, tensor.shape[0])


def _analyse(model, x, heldout, gate_checks, settings, stream) -> dict[int, LayerAnalysis]:
    analyses = {}
    with Progress(stream, len(model.ffn_layers), "analyse", unit="layer") as bar, blas_threads(1):
        for ffn in model.ffn_layers:
            rows = x.pop(ffn.layer).astype(np.float32)
            analyses[ffn.layer] = analyse_layer(
                ffn.layer,
                rows,
                heldout[ffn.layer],
                dequantize(model.path, ffn.gate),
                dequantize(model.path, ffn.up),
                dequantize(model.path, ffn.down),
                model.activation,
                settings,
                gate_check=gate_checks.get(ffn.layer),
            )
            bar.update()
    return analyses


def _engine_operating_point(
    result: CalibrationResult,
    ev: QualityEvaluator,
    dense: QualityPoint,
    to_eval,
    fixed: bool,
    opts,
    bar,
    threads: int,
    out: Path | None,
    write_sidecar: SidecarWriter | None,
) -> None:
    """:func:`_operating_point` with every level measured by the sparse engine on a measurement
    sidecar (the sidecar being converted, thresholds of all levels; no quality record), written
    beside ``out`` and removed afterwards. With no level to measure (fixed sparsity 0) only the
    dense reference is recorded."""
    if not to_eval:
        _operating_point(result, dense, None, to_eval, fixed, opts, bar)
        return
    # Bundle order and down_t type as in the final sidecar (the lane computes gate by ggml for base
    # order, from the bundles for hot order); a hot order is that of the first level evaluated.
    measuring = dataclasses.replace(
        result, decisions={}, curve=[], notes=[], dense=None, chosen=None, target=to_eval[0]
    )
    measuring.set_decisions(to_eval[0])
    bar.set_postfix("writing the measurement sidecar")
    t = time.perf_counter()
    with measurement_sidecar(out, lambda path: write_sidecar(measuring, path)) as path:
        result.timings["quality_sidecar_s"] = time.perf_counter() - t
        bar.set_postfix("")
        with EngineRunner(result.model.path, path, result.chunk_len, to_eval[0], threads) as engine:

            def measure(level: float) -> QualityPoint:
                engine.set_level(level)
                point = ev.measure_with(engine.decode, level, fmt.SELECTION_GATE, fmt.QUALITY_METHOD_ENGINE)
                return dataclasses.replace(point, measured_sparsity=1.0 - engine.active_fraction())

            _operating_point(result, dense, measure, to_eval, fixed, opts, bar)


def _operating_point(
    result: CalibrationResult,
    dense: QualityPoint,
    measure: Callable[[float], QualityPoint] | None,
    to_eval,
    fixed: bool,
    opts,
    bar,
) -> None:
    """Given the dense reference, (auto) ``measure`` the levels in increasing order until perplexity
    exceeds ``stop_factor`` x budget, choosing the highest level within budget; or (fixed) the one level."""
    result.dense = dense
    for level in to_eval:
        point = measure(level)
        result.curve.append(point)
        bar.set_postfix(f"s={level:.2f} ppl {point.ppl:.3f} ({100 * point.ppl_delta(dense):+.2f}%)")
        if not fixed and point.ppl_delta(dense) > opts.stop_factor * opts.quality_budget:
            break
    if fixed:
        result.chosen = result.curve[0] if result.curve else dense
        return
    passing = [p for p in result.curve if p.ppl_delta(dense) <= opts.quality_budget]
    if passing:
        best = max(passing, key=lambda p: p.target_sparsity)
        result.target, result.chosen = best.target_sparsity, best
    else:
        result.target, result.chosen = 0.0, dense
        result.notes.append(
            f"no sparsity level kept perplexity within +{100 * opts.quality_budget:g}% of dense "
            f"(lowest level {result.curve[0].target_sparsity:g}: {100 * result.curve[0].ppl_delta(dense):+.2f}%); "
            "thresholds are 0 (only exact zeros are skipped)"
        )
