"""The ``llamaflash`` command line: ``convert`` a base model, ``inspect`` a sidecar, run the ``demo``.

Errors llamaflash raises on purpose (:class:`~llamaflash.errors.LlamaflashError`) are
printed to stderr as ``error: <message>`` and end the command with exit status 2, without
a traceback. Also runnable as ``python -m llamaflash.cli``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import gguf

from llamaflash.converters import convert as run_convert
from llamaflash.errors import LlamaflashError
from llamaflash.sidecar import read_sidecar

#: Exit status of a command that failed with a LlamaflashError.
EXIT_LLAMAFLASH_ERROR = 2


class _Group(click.Group):
    """A click group that turns LlamaflashError into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LlamaflashError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(EXIT_LLAMAFLASH_ERROR)


@click.group(cls=_Group)
def main() -> None:
    """llamaflash: serve the FFN layers of llama.cpp models from a neuron-bundled sidecar."""


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", type=click.Path(path_type=Path), default=None,
              help="Sidecar to write (default: MODEL with .gguf replaced by .flash.gguf).")
@click.option("--force", is_flag=True, help="Overwrite the output if it exists.")
@click.option("--quiet", "-q", is_flag=True, help="Do not print per-layer progress.")
def convert(model: Path, output: Path | None, force: bool, quiet: bool) -> None:
    """Convert base model MODEL (.gguf) into its llamaflash sidecar."""
    out = run_convert(model, output, force=force, progress=not quiet)
    click.echo(str(out))


@main.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Registry model to run (see llamaflash.assets.MODELS).")
@click.option("--prompt", default=None, help="Prompt (default: a fixed question).")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--threads", default=2, show_default=True, type=int)
def demo(model_name: str, prompt: str | None, max_tokens: int, threads: int) -> None:
    """Fetch a real model, convert it, and run it through stock llama.cpp and llamaflash side by side."""
    from llamaflash.demo import DEFAULT_PROMPT, run_demo

    run_demo(model_name, prompt or DEFAULT_PROMPT, max_tokens, threads, echo=click.echo)


@main.command()
@click.argument("sidecar", type=click.Path(path_type=Path))
def inspect(sidecar: Path) -> None:
    """Describe the llamaflash sidecar SIDECAR (.flash.gguf)."""
    info = read_sidecar(sidecar)
    click.echo(f"sidecar:          {info.path}")
    click.echo(f"format version:   {info.format_version}")
    click.echo(f"converter:        {info.converter_version}")
    click.echo(f"base identity:    {info.base_identity}")
    click.echo(f"base arch:        {info.base_arch}")
    click.echo(f"base name:        {info.base_name or '(none)'}")
    click.echo(f"base file size:   {info.base_file_size}")
    click.echo(f"ffn activation:   {info.activation}")
    click.echo(f"served layers:    {len(info.layers)}")

    def type_name(type_id: int) -> str:
        return gguf.GGMLQuantizationType(type_id).name

    header = (f"{'layer':>5} {'n_embd':>6} {'n_ff':>6} {'gate':>6} {'up':>6} {'down':>6} "
              f"{'down_t':>6} {'stride':>6} {'bundle_B':>10} {'down_t_B':>10}")
    click.echo(header)
    total = 0
    for lay in info.layers:
        bundle_bytes = lay.n_ff * lay.bundle_stride
        down_t_bytes = lay.n_ff * lay.down_t_row_bytes
        total += bundle_bytes + down_t_bytes
        click.echo(
            f"{lay.layer:>5} {lay.n_embd:>6} {lay.n_ff:>6} {type_name(lay.gate_type):>6} "
            f"{type_name(lay.up_type):>6} {type_name(lay.base_down_type):>6} "
            f"{type_name(lay.down_t_type):>6} {lay.bundle_stride:>6} {bundle_bytes:>10} "
            f"{down_t_bytes:>10}"
        )
    click.echo(f"ffn bytes (bundles + down_t): {total}")


if __name__ == "__main__":
    sys.exit(main())
