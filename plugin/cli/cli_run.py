"""``llamaflash run`` (answer one prompt), ``chat`` (a conversation), ``serve`` (llama-cpp-python's
OpenAI-compatible server with llamaflash) and ``models`` (the registry's models): the commands that load a
model and talk to it, registered on the ``llamaflash`` group by :mod:`llamaflash.cli.cli`. MODEL (run,
chat, serve) is a .gguf file or a registry model name; the work is done in :mod:`llamaflash.cli.run_chat`
and :mod:`llamaflash.cli.serve`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llamaflash.errors import LlamaflashError

#: Exit status after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


def _generation_options(command):
    """The options ``run`` and ``chat`` share: how the model loads and how replies are sampled."""
    options = [
        click.option(
            "--sidecar",
            type=click.Path(path_type=Path),
            default=None,
            help="Sidecar (default: MODEL's .flash.gguf beside it; without one the model runs as stock).",
        ),
        click.option(
            "--flash-mode",
            type=click.Choice(["auto", "dense", "sparse"]),
            default=None,
            help="Lane for the FFN layers (default: auto).",
        ),
        click.option(
            "--ram-budget-mb",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Flash offload: plan the whole process to fit in this many MiB (`llamaflash plan`).",
        ),
        click.option(
            "--n-ctx",
            type=click.IntRange(min=1),
            default=2048,
            show_default=True,
            help="Context size in tokens (rounded up to a multiple of 256, as llama.cpp does).",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="llama.cpp threads (default: llama-cpp-python's, half the cores).",
        ),
        click.option(
            "--max-tokens",
            type=int,
            default=512,
            show_default=True,
            help="Most tokens per reply; 0: until the context is full.",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=None,
            help="Sampling temperature, 0 for greedy (default: llama-cpp-python's).",
        ),
        click.option("--seed", type=int, default=None, help="Sampling seed (default: random)."),
        click.option(
            "--deterministic",
            is_flag=True,
            help="Batch-invariant evaluation: replies independent of the conversation's cache history "
            "and of batching (slower prefill). Default: repeat-stable.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _load(model: str, sidecar, flash_mode, ram_budget_mb, n_ctx, threads, deterministic=False):
    from llamaflash.cli import run_chat

    options = run_chat.LoadOptions(
        sidecar=str(sidecar) if sidecar else None,
        flash_mode=flash_mode,
        ram_budget_mb=ram_budget_mb,
        n_ctx=n_ctx,
        threads=threads,
        deterministic=deterministic,
    )
    try:
        return run_chat.load_model(model, options)
    except ValueError as e:  # llama.cpp cannot load the file, or Llama refused a setting
        if isinstance(e, LlamaflashError):
            raise
        raise LlamaflashError(str(e)) from e


@click.command()
@click.argument("model")
@click.argument("prompt", required=False)
@click.option(
    "--raw",
    is_flag=True,
    help="Complete PROMPT as plain text instead of sending it through the model's chat template as a user message.",
)
@_generation_options
@click.pass_context
def run(
    ctx: click.Context,
    model: str,
    prompt: str | None,
    raw: bool,
    sidecar,
    flash_mode,
    ram_budget_mb,
    n_ctx,
    threads,
    max_tokens,
    temperature,
    seed,
    deterministic,
) -> None:
    """Answer PROMPT with MODEL (a .gguf file or a registry name), the reply streamed to stdout.

    Without PROMPT (or with -), the prompt is read from stdin. Loading and notices go to stderr.
    Ctrl-C stops the reply (exit status 130)."""
    from llamaflash.cli import run_chat

    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise click.UsageError("give a PROMPT (or pipe one on stdin)")
        prompt = sys.stdin.read()
    try:
        llm = _load(model, sidecar, flash_mode, ram_budget_mb, n_ctx, threads, deterministic)
        finished = run_chat.run_prompt(
            llm, prompt, raw=raw, sampling=run_chat.sampling_kwargs(max_tokens, temperature, seed)
        )
    except ValueError as e:
        if "exceed context window" not in str(e):
            raise
        raise LlamaflashError(f"the prompt does not fit the context: {e}; use a larger --n-ctx") from e
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    if not finished:
        ctx.exit(EXIT_INTERRUPTED)


@click.command()
@click.argument("model")
@click.option("--system", default=None, help="System message at the start of the conversation.")
@_generation_options
@click.pass_context
def chat(
    ctx: click.Context,
    model: str,
    system: str | None,
    sidecar,
    flash_mode,
    ram_budget_mb,
    n_ctx,
    threads,
    max_tokens,
    temperature,
    seed,
    deterministic,
) -> None:
    """Chat with MODEL (a .gguf file or a registry name) through its chat template, replies streamed.

    The conversation is kept (the oldest exchanges are dropped when it outgrows --n-ctx); /reset
    forgets it. Ctrl-C stops a reply; Ctrl-D, /exit, or Ctrl-C at an empty prompt quits."""
    from llamaflash.cli import run_chat

    try:
        llm = _load(model, sidecar, flash_mode, ram_budget_mb, n_ctx, threads, deterministic)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    run_chat.say(run_chat.CHAT_HELP)
    run_chat.chat_loop(run_chat.ChatSession(llm, system, run_chat.sampling_kwargs(max_tokens, temperature, seed)))


@click.command(
    "serve", add_help_option=False, context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def serve_command(ctx: click.Context, args: tuple[str, ...]) -> None:
    """Serve MODEL over llama-cpp-python's OpenAI-compatible API (its own server) with llamaflash.

    llamaflash serve MODEL [--ram-budget-mb N] [--sidecar S] [--flash-mode M] [--host H] [--port P]
    [any llama_cpp.server option] [--config_file FILE]; `llamaflash serve --help` lists them all."""
    try:
        from llamaflash.cli.serve import serve
    except ImportError as e:
        raise LlamaflashError(
            f"`llamaflash serve` needs llama-cpp-python's server packages ({e.name} is not "
            "installed): pip install 'llamaflash[server]'"
        ) from e
    try:
        serve(args)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)


@click.command()
def models() -> None:
    """List the registry models (usable by name wherever a model file is expected): size, whether
    they are in the cache, and the sidecar beside them if there is one."""
    from llamaflash.cli.models_by_name import format_model_table, model_rows

    click.echo(format_model_table(model_rows()))
