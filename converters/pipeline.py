"""``convert``: base model GGUF → llamaflash sidecar, through converter stages.

The pipeline validates the base model, fills one :class:`~llamaflash.converters.writer.SidecarPlan`
with the sidecar header (format version, base identity, ...) and, for every served layer in
order, lets each stage add that layer's tensors and per-layer values; the plan is then
written atomically. Format v1 has one stage, :class:`~llamaflash.converters.bundle.BundleStage`;
later stages (predictors, statistics) implement :class:`ConverterStage` and are appended.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Protocol, TextIO

from llamaflash import sidecar_format as fmt
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.writer import PlannedTensor, SidecarPlan, write_sidecar_atomically
from llamaflash.errors import ConversionError, OutputExistsError
from llamaflash.gguf_model import (
    BaseModelInfo,
    FfnLayer,
    base_identity,
    read_base_model,
    require_supported,
)
from llamaflash.sidecar import default_sidecar_path


class ConverterStage(Protocol):
    """A converter stage contributes, per served layer, tensors and per-layer metadata."""

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        """Add layer ``ffn.layer``'s tensors (``plan.add_tensor``) and per-layer values
        (``plan.append_layer_value``, exactly once per key per layer) to ``plan``."""
        ...


def convert(
    model_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the base model at ``model_path`` into a sidecar; return the sidecar's path.

    ``out_path`` defaults to :func:`~llamaflash.sidecar.default_sidecar_path` (``m.gguf`` →
    ``m.flash.gguf`` beside it). The base model is validated before anything is written
    (:class:`~llamaflash.errors.BaseModelError` / ``BaseModelNotFoundError``) and never
    modified. An existing output is refused unless ``force``
    (:class:`~llamaflash.errors.OutputExistsError`). The sidecar appears under its final
    name only when complete; on any failure nothing is left behind. With ``progress``,
    one line per layer is printed to stderr.
    """
    model_path = Path(model_path)
    model = read_base_model(model_path)
    require_supported(model)
    out = Path(out_path) if out_path is not None else default_sidecar_path(model_path)
    if out.exists() and os.path.samefile(out, model_path):
        raise ConversionError(
            f"{out}: the output would overwrite the base model. Choose another output path (-o)."
        )
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: already exists. Pass --force to overwrite it.")

    stream = sys.stderr if progress else None
    _say(stream, f"llamaflash convert: {model_path} -> {out} "
                 f"({len(model.ffn_layers)} FFN layers, {model.architecture})")
    plan = plan_sidecar(model, base_identity(model_path, model), [BundleStage()])
    write_sidecar_atomically(plan, out, force=force,
                             progress=_LayerProgress(plan, stream) if stream else None)
    _say(stream, f"llamaflash convert: wrote {out} ({out.stat().st_size} bytes)")
    return out


def plan_sidecar(model: BaseModelInfo, identity: str, stages: list[ConverterStage]) -> SidecarPlan:
    """The complete plan of ``model``'s sidecar: header keys, then every served layer
    through every stage, in layer order."""
    plan = SidecarPlan()
    plan.set_uint32(fmt.KEY_FORMAT_VERSION, fmt.FORMAT_VERSION)
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
