"""``convert``: base model GGUF → llamaflash sidecar, through converter stages.

The pipeline (``docs/SIDECAR.md``):

1. validate the base model, refuse an existing output (unless ``force``) — before any work;
2. read the calibration text (default: the registry's calibration corpus) and the validation
   text (default: held-out Shakespeare), refuse texts too short for the model;
3. **profile** the stock model through llama.cpp (:mod:`.llama_runner`): the FFN input x of
   every served layer for up to ``calib_tokens`` calibration tokens (float16);
4. **analyse** each layer in NumPy (:mod:`.analysis`): thresholds for every sparsity level,
   held-out sparsity and FFN output error, per-neuron frequency/magnitude;
5. choose the **operating point**: a fixed ``sparsity``, or ``"auto"``: the highest level whose
   perplexity on the validation text stays within ``quality_budget`` of dense (:mod:`.quality`:
   measured with llamaflash's sparse engine on a temporary measurement sidecar beside the output,
   :mod:`.engine_quality`); then each layer's decision (:mod:`.sparsity`);
6. fill one :class:`~llamaflash.converters.writer.SidecarPlan` (header keys, then each served
   layer through the :class:`~llamaflash.converters.bundle.BundleStage` with the hot-first
   orders and the :class:`~llamaflash.converters.sparsity.SparsityStage`) and write it
   atomically; then the report ``<sidecar>.report.json`` (:mod:`.report`).

``profile=False`` skips 2–5 and writes a format-1 sidecar (bundles in base order, no sparsity
content; the backend runs it dense).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from llamaflash.converters.bundle import DEFAULT_DOWN_T, DOWN_T_CHOICES, BundleStage
from llamaflash.converters.draft_copy import DraftCopyStage, draft_type
from llamaflash.converters.integrity import IntegrityStage
from llamaflash.converters.moe_convert import convert_experts
from llamaflash.converters.writer import (
    PlannedTensor,
    SidecarPlan,
    remove_stale_temporaries,
    removing_temporaries_on_signal,
    write_sidecar_atomically,
)
from llamaflash.errors import ConversionError, OutputExistsError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.experts import read_moe_model
from llamaflash.files.gguf_model import (
    BaseModelInfo,
    FfnLayer,
    base_identity,
    read_base_model,
    require_supported,
)
from llamaflash.files.sidecar import default_sidecar_path


class ConverterStage(Protocol):
    """A converter stage contributes, per served layer, tensors and per-layer metadata.

    ``min_format_version`` is the oldest format that can hold what it plans; the sidecar is
    written with the largest of its stages' versions.
    """

    min_format_version: int

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        """Add layer ``ffn.layer``'s tensors (``plan.add_tensor``) and per-layer values
        (``plan.append_layer_value``, exactly once per key per layer) to ``plan``."""
        ...


@dataclass(frozen=True)
class ConvertOptions:
    """Settings of :func:`convert` (all have working defaults)."""

    #: calibration text (a string) or file; None: the registry calibration corpus
    calib_text: str | None = None
    calib_path: Path | None = None
    #: validation text or file for perplexity; None: held-out Shakespeare
    valid_text: str | None = None
    valid_path: Path | None = None
    #: calibration tokens profiled (evenly spaced windows over the text)
    calib_tokens: int = 4096
    #: validation tokens scored per perplexity measurement
    valid_tokens: int = 2048
    #: target sparsity in [0, 1), or "auto"
    sparsity: float | str = "auto"
    #: --sparsity auto: perplexity may rise at most this much over dense (0.02 = +2%)
    quality_budget: float = 0.02
    #: bundle order: "base" (identity; the dense lane maps the bundles in place) or "hot"
    #: (most frequently active neuron first; this version's dense lane then copies gate/up)
    order: str = "base"
    #: type of the transposed down rows the sparse lane reads (llamaflash.converters.bundle.DOWN_T_CHOICES)
    down_t_type: str = DEFAULT_DOWN_T
    #: type of the draft copy a speculative self-draft computes from under a RAM budget
    #: (llamaflash.files.sidecar_format.DRAFT_CHOICES; "none": no copy)
    draft_type: str = fmt.DEFAULT_DRAFT
    #: measure perplexity/greedy agreement for a fixed sparsity too (always for "auto")
    measure_quality: bool = True
    #: False: write a format-1 sidecar (no profiling, no sparsity content)
    profile: bool = True
    #: write <sidecar>.report.json
    report: bool = True
    #: sparsity levels analysed (and, for "auto", evaluated in increasing order)
    levels: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    #: "auto" stops evaluating levels once perplexity exceeds this multiple of the budget
    stop_factor: float = 2.0
    #: profiling / evaluation context length (capped by the model's training context)
    chunk_len: int = 512
    #: FFN inputs kept per layer at most (subsampled uniformly beyond)
    max_samples: int = 4096
    #: fraction of calibration chunks held out for recall/sparsity/error measurements
    heldout_fraction: float = 0.25
    n_threads: int | None = None
    cache_dir: Path | None = None
    seed: int = 0


def convert(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
    options: ConvertOptions | None = None,
    **settings,
) -> Path:
    """Convert the base model at ``model_path`` into a sidecar; return the sidecar's path.

    ``out_path`` defaults to :func:`~llamaflash.files.sidecar.default_sidecar_path` (``m.gguf`` →
    ``m.flash.gguf`` beside it). The base model is validated before anything is written
    (:class:`~llamaflash.errors.BaseModelError` / ``BaseModelNotFoundError``) and never
    modified. An existing output is refused unless ``force``
    (:class:`~llamaflash.errors.OutputExistsError`); texts too short for the model raise
    :class:`~llamaflash.errors.CalibrationError`. The sidecar appears under its final name
    only when complete; on any failure, SIGINT, SIGTERM or SIGHUP nothing is left behind
    (:func:`~llamaflash.converters.writer.removing_temporaries_on_signal`), and temporaries left by
    conversions that died in the same directory are removed first
    (:func:`~llamaflash.converters.writer.remove_stale_temporaries`). With ``progress``, progress
    bars, one line per written layer and the report table go to stderr.

    ``options`` (a :class:`ConvertOptions`) and/or keyword ``settings`` (its field names)
    configure calibration and sparsity.
    """
    opts = dataclasses.replace(options or ConvertOptions(), **settings)
    _check_options(opts)
    t_start = time.perf_counter()
    model_path = Path(model_path)
    model = read_base_model(model_path)
    moe = read_moe_model(model.header) if model.header is not None else None
    if moe is not None:  # a mixture-of-experts model: the expert sidecar (converters/moe_convert.py)
        out = Path(out_path) if out_path is not None else default_sidecar_path(model_path)
        if out.exists() and os.path.samefile(out, model_path):
            raise ConversionError(f"{out}: the output would overwrite the base model. Choose another output path (-o).")
        from llamaflash.converters.calibrate import _calibration_source

        source = _calibration_source(opts) if opts.profile else None
        return convert_experts(
            model_path,
            model,
            moe,
            out,
            force=force,
            progress=progress,
            calib_text=source.text if source is not None else None,
            calib_tokens=opts.calib_tokens,
            calib_source=source.source if source is not None else "",
            n_threads=opts.n_threads,
        )
    require_supported(model)
    draft_type(model.n_embd, opts.draft_type)  # a named type must divide n_embd: refused before any work
    out = Path(out_path) if out_path is not None else default_sidecar_path(model_path)
    if out.exists() and os.path.samefile(out, model_path):
        raise ConversionError(f"{out}: the output would overwrite the base model. Choose another output path (-o).")
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists. Pass --force to overwrite it.")
    if not out.parent.is_dir():
        raise ConversionError(
            f"{out}: the directory {out.parent} does not exist. Create it or choose another output path."
        )

    stream = sys.stderr if progress else None
    _say(
        stream, f"llamaflash convert: {model_path} -> {out} ({len(model.ffn_layers)} FFN layers, {model.architecture})"
    )
    _report_stale_temporaries(out, stream)
    with removing_temporaries_on_signal(out):
        return _convert(model_path, model, out, force, stream, opts, t_start)


def _convert(
    model_path: Path,
    model: BaseModelInfo,
    out: Path,
    force: bool,
    stream: TextIO | None,
    opts: ConvertOptions,
    t_start: float,
) -> Path:
    identity = base_identity(model_path, model)
    if not opts.profile:
        plan = plan_sidecar(model, identity, [BundleStage(down_t=opts.down_t_type), IntegrityStage()])
        write_sidecar_atomically(plan, out, force=force, progress=_LayerProgress(plan, stream) if stream else None)
        _say(stream, f"llamaflash convert: wrote {out} ({out.stat().st_size} bytes)")
        return out

    from llamaflash.converters.calibrate import calibrate  # imports llama_cpp: only when needed

    def write_measurement(res, path: Path) -> None:  # the engine's measurement sidecar (no progress lines)
        write_sidecar_atomically(sidecar_plan(model, identity, res), path, force=True)

    result = calibrate(model, opts, stream, out=out, write_sidecar=write_measurement)
    plan = sidecar_plan(model, identity, result, draft=opts.draft_type)
    t_write = time.perf_counter()
    write_sidecar_atomically(plan, out, force=force, progress=_LayerProgress(plan, stream) if stream else None)
    result.timings["write_s"] = time.perf_counter() - t_write
    result.timings["total_s"] = time.perf_counter() - t_start
    _say(stream, f"llamaflash convert: wrote {out} ({out.stat().st_size} bytes)")
    if opts.report:
        report_path = result.write_report(out, model_path)
        _say(stream, f"llamaflash convert: report {report_path}")
    if stream is not None:
        result.print_table(stream)
    return out


def sidecar_plan(model: BaseModelInfo, identity: str, result, draft: str = "none") -> SidecarPlan:
    """The plan of the format-2 sidecar a :class:`~llamaflash.converters.calibrate.CalibrationResult`
    describes: bundles and sparsity content in its decisions' orders, the draft copy of type
    ``draft`` (a DRAFT_CHOICES entry; the quality measurement's sidecar has none), the row checksums,
    then its header keys."""
    stages = [BundleStage(result.stage.orders, down_t=result.options.down_t_type), result.stage]
    dtype = draft_type(model.n_embd, draft)
    if dtype is not None:
        stages.append(DraftCopyStage(result.stage.orders, dtype))
    stages.append(IntegrityStage())
    plan = plan_sidecar(model, identity, stages)
    result.add_header_keys(plan)
    return plan


def plan_sidecar(model: BaseModelInfo, identity: str, stages: list[ConverterStage]) -> SidecarPlan:
    """The complete plan of ``model``'s sidecar: header keys, then every served layer
    through every stage, in layer order. The format version is the largest
    ``min_format_version`` of the stages."""
    version = max([1] + [getattr(stage, "min_format_version", 1) for stage in stages])
    # the integrity section is optional before format 3 and required from it: a file with the
    # sparsity content and checksums is format 3; a bundle-only one stays format 1 (with checksums)
    if version >= fmt.SPARSITY_FORMAT_VERSION and any(isinstance(s, IntegrityStage) for s in stages):
        version = max(version, fmt.INTEGRITY_FORMAT_VERSION)
    if version not in fmt.SUPPORTED_FORMAT_VERSIONS:
        raise ValueError(f"stages need format version {version}, which this llamaflash cannot read")
    plan = SidecarPlan()
    plan.set_uint32(fmt.KEY_FORMAT_VERSION, version)
    plan.set_string(fmt.KEY_CONVERTER_VERSION, fmt.CONVERTER_VERSION)
    plan.set_string(fmt.KEY_BASE_IDENTITY, identity)
    plan.set_string(fmt.KEY_BASE_ARCHITECTURE, model.architecture)
    plan.set_string(fmt.KEY_BASE_NAME, model.name)
    plan.set_uint64(fmt.KEY_BASE_FILE_SIZE, model.file_size)
    assert model.activation is not None
    plan.set_string(fmt.KEY_FFN_ACTIVATION, model.activation)
    plan.set_uint32(fmt.KEY_N_EMBD, model.n_embd)
    plan.set_uint32_array(fmt.KEY_LAYERS, [ffn.layer for ffn in model.ffn_layers])
    for ffn in model.ffn_layers:
        for stage in stages:
            stage.plan_layer(model, ffn, plan)
    return plan


def _check_options(opts: ConvertOptions) -> None:
    if opts.draft_type not in fmt.DRAFT_CHOICES:
        raise ValueError(f"draft_type {opts.draft_type!r}: use one of {', '.join(fmt.DRAFT_CHOICES)}")
    if opts.down_t_type not in DOWN_T_CHOICES:
        raise ValueError(f"down_t_type {opts.down_t_type!r}: use one of {', '.join(DOWN_T_CHOICES)}")
    if isinstance(opts.sparsity, str):
        if opts.sparsity != fmt.SPARSITY_METHOD_AUTO:
            raise ValueError(f"sparsity must be a number in [0, 1) or 'auto', not {opts.sparsity!r}")
    elif not 0.0 <= float(opts.sparsity) < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), not {opts.sparsity}")
    if not opts.quality_budget > 0:
        raise ValueError(f"quality_budget must be positive, not {opts.quality_budget}")
    if opts.order not in fmt.BUNDLE_ORDERS:
        raise ValueError(f"order must be one of {sorted(fmt.BUNDLE_ORDERS)}, not {opts.order!r}")
    if not all(0.0 < s < 1.0 for s in opts.levels):
        raise ValueError(f"levels must lie in (0, 1): {opts.levels}")
    if opts.calib_tokens <= 0 or opts.valid_tokens <= 0:
        raise ValueError("calib_tokens and valid_tokens must be positive")


def _report_stale_temporaries(out: Path, stream: TextIO | None) -> None:
    """Remove the temporaries that dead conversions left in ``out``'s directory; say so on ``stream``,
    and name those left in place because their process runs or they are in use."""
    removed, kept = remove_stale_temporaries(out)
    if removed:
        names = ", ".join(f"{path.name} (process {pid})" for path, pid in removed)
        _say(
            stream,
            f"llamaflash convert: removed {len(removed)} temporary file(s) left by conversions "
            f"that did not finish: {names}",
        )
    if kept:
        names = ", ".join(f"{path.name} (process {pid})" for path, pid in kept)
        _say(stream, f"llamaflash convert: left in place, in use by a running conversion: {names}")


class _LayerProgress:
    """Progress callback printing one line when the last tensor of a layer is written."""

    def __init__(self, plan: SidecarPlan, stream: TextIO) -> None:
        self._stream = stream
        self._last_index = {t.layer: i for i, t in enumerate(plan.tensors) if t.layer is not None}
        self._n_layers = len(self._last_index)
        self._done = 0

    def __call__(self, written: int, total: int, tensor: PlannedTensor) -> None:
        if tensor.layer is not None and self._last_index.get(tensor.layer) == written - 1:
            self._done += 1
            _say(self._stream, f"  layer {tensor.layer:>3} written ({self._done}/{self._n_layers})")


def _say(stream: TextIO | None, line: str) -> None:
    if stream is not None:
        print(line, file=stream, flush=True)
