"""The ``llamaflash`` command line: ``run`` a prompt, ``chat``, ``serve`` an OpenAI-compatible API,
list the registry ``models`` (those four in :mod:`llamaflash.cli.cli_run`), ``convert`` a base model,
``inspect`` a sidecar, ``verify`` a sidecar's checksums, ``tune`` the default lane (those four in
:mod:`llamaflash.cli.cli_sidecar`), run the ``demo``, ``bench`` under memory limits, ``plan`` the
flash-offload engine's RAM (those two in :mod:`llamaflash.cli.cli_budget`), print the ``env`` for stock
llama.cpp tools (:mod:`llamaflash.cli.env_cmd`). This module holds the group ``main`` (the entry point),
its error handling and ``--version``, and ``demo``; it registers the other commands on ``main``.
Wherever a model file is expected, a registry model name (``llamaflash models``) works too.

Errors llamaflash raises on purpose (:class:`~llamaflash.errors.LlamaflashError`) are
printed to stderr as ``error: <message>`` and end the command with exit status 2, without
a traceback. Also runnable as ``python -m llamaflash`` (or ``python -m llamaflash.cli.cli``).
"""

from __future__ import annotations

import sys

import click

from llamaflash import __version__
from llamaflash.errors import LlamaflashError

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


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    import importlib.metadata

    click.echo(f"llamaflash {__version__} (llama-cpp-python {importlib.metadata.version('llama_cpp_python')})")
    ctx.exit()


@click.group(cls=_Group)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and exit.",
)
def main() -> None:
    """llamaflash: serve the FFN layers of llama.cpp models from a neuron-bundled sidecar."""


@click.command()
@click.option(
    "--model",
    "model_name",
    default="qwen2.5-coder-1.5b",
    show_default=True,
    help="Registry model to run (see llamaflash.files.assets.MODELS).",
)
@click.option(
    "--ram-limit-mb",
    "limits",
    type=click.IntRange(min=1),
    multiple=True,
    help="Memory limit(s) for the side-by-side run, MiB (repeatable; default 900 and 700).",
)
@click.option("--no-limit", is_flag=True, help="Skip the memory-limit part (only the in-memory comparison).")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
def demo(model_name: str, limits: tuple[int, ...], no_limit: bool, max_tokens: int, threads: int) -> None:
    """Fetch a real model, convert it, and run it beside stock llama.cpp under memory limits and in memory."""
    from llamaflash.cli.demo import DEFAULT_LIMITS_MB, run_demo

    run_demo(model_name, () if no_limit else (limits or DEFAULT_LIMITS_MB), max_tokens, threads, echo=click.echo)


def _register_commands() -> None:
    """Put every command on ``main`` (``llamaflash --help`` lists them sorted by name)."""
    from llamaflash.cli.cli_budget import bench, plan
    from llamaflash.cli.cli_run import chat, models, run, serve_command
    from llamaflash.cli.cli_sidecar import convert, inspect, tune, verify
    from llamaflash.cli.env_cmd import env

    for command in (convert, demo, tune, verify, inspect, run, chat, serve_command, models, bench, plan, env):
        main.add_command(command)


_register_commands()


if __name__ == "__main__":
    sys.exit(main())
