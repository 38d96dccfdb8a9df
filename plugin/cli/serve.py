"""``llamaflash serve``: llama-cpp-python's OpenAI-compatible server (``llama_cpp.server``: its routes,
middleware, settings and multi-model config file) with every model loaded as ``llamaflash.Llama``.

Pieces, usable from Python as well as from the command line:

* :class:`FlashModelSettings`: llama-cpp-python's ``ModelSettings`` plus llamaflash's keyword arguments
  (``sidecar_path``, ``flash_mode``, ``flash_sparsity``, ``flash_max_sparse_tokens``, ``flash_dense_up``,
  ``ram_budget_mb``, ``flash_io_engine``, ``flash_stream_gate``, ``flash_disk_profile``, ``flash_draft_copy``). A model may be a
  registry name (``smollm2-135m``), fetched into the llamaflash cache when it is first loaded; its alias
  (the ``model`` clients ask for) stays the name.
* :class:`FlashConfigFileSettings`: the server's JSON/YAML config file, its ``models`` entries being
  :class:`FlashModelSettings`.
* :class:`FlashLlamaProxy`: llama-cpp-python's ``LlamaProxy`` (one model loaded at a time, switched by
  the request's ``model``) loading with :func:`load_flash_llama`.
* :func:`create_app`: the FastAPI app of ``llama_cpp.server.app.create_app`` with the proxy above.
* :func:`serve`: ``llamaflash serve`` (command-line parsing, binding the port before the model loads,
  uvicorn).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
import types
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import llama_cpp
import uvicorn
from fastapi import FastAPI
from fastapi.middleware import Middleware
from fastapi.middleware.cors import CORSMiddleware
from llama_cpp.server import app as server_app
from llama_cpp.server import cli as server_cli
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings, ServerSettings
from pydantic import Field, ValidationError
from starlette_context.middleware import RawContextMiddleware
from starlette_context.plugins import RequestIdPlugin

from ..errors import LlamaflashError
from ..runtime.llama import Llama
from .models_by_name import check_model, resolve_model
from .run_chat import describe_lane, plain_notices, say, untiled_for_determinism


class FlashModelSettings(ModelSettings):
    """llama-cpp-python's model settings plus llamaflash's ``Llama`` keyword arguments (same names and
    meanings; ``None`` leaves llamaflash's default)."""

    sidecar_path: Optional[str] = Field(
        default=None,
        description="llamaflash sidecar GGUF (default: <model stem>.flash.gguf beside the model; "
        "without one the model runs as stock).",
    )
    flash_mode: Optional[Literal["auto", "dense", "sparse"]] = Field(
        default=None, description="llamaflash lane: auto (the default), dense (exact), sparse."
    )
    flash_sparsity: Optional[float] = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="A sparsity level the converter calibrated (default: its operating point).",
    )
    flash_max_sparse_tokens: Optional[int] = Field(
        default=None, ge=1, description="Batches of up to this many tokens may run on the sparse lane."
    )
    flash_dense_up: Optional[bool] = Field(
        default=None, description="Sparse lane: compute up for all neurons with ggml (default: by the level)."
    )
    ram_budget_mb: Optional[float] = Field(
        default=None, gt=0, description="Flash offload: plan the whole process to fit in this many MiB."
    )
    flash_io_engine: Literal["auto", "io_uring", "pool"] = Field(
        default="auto", description="Flash offload I/O: auto, io_uring, pool."
    )
    flash_stream_gate: Optional[bool] = Field(
        default=None,
        description="Flash offload: read the gate matrices from flash every token (true) or keep "
        "them resident (false); default: the planner's choice.",
    )
    flash_disk_profile: Optional[Union[str, Dict[str, Any]]] = Field(
        default=None,
        description="Flash offload: disk profile: 'probe', 'default', a JSON file, or (config "
        "file) an object; default: the saved profile of the sidecar's disk.",
    )
    flash_draft_copy: Optional[bool] = Field(
        default=None,
        description="Flash offload: keep the sidecar's draft copy resident for speculative "
        "self-drafts (true/false); default: the planner's choice.",
    )
    deterministic: bool = Field(
        default=False,
        description="Answers independent of the cache's history and of batching (batch-invariant "
        "evaluation; slower prefill). Default: repeat-stable, the same request gets the same answer.",
    )


#: The settings llamaflash adds to llama-cpp-python's ModelSettings (passed to llamaflash.Llama).
FLASH_FIELDS: Tuple[str, ...] = tuple(n for n in FlashModelSettings.model_fields if n not in ModelSettings.model_fields)


class FlashSettings(ServerSettings, FlashModelSettings):
    """Everything the command line sets: server settings and one model's settings."""


class FlashConfigFileSettings(ServerSettings):
    """The server's config file (JSON, or YAML by extension): server settings and a list of models."""

    models: List[FlashModelSettings] = Field(default=[], description="Model configs")


def flash_kwargs(settings: ModelSettings) -> Dict[str, Any]:
    """llamaflash.Llama keyword arguments set in ``settings`` (none for plain ModelSettings)."""
    defaults = FlashModelSettings.model_fields
    return {
        name: getattr(settings, name)
        for name in FLASH_FIELDS
        if getattr(settings, name, defaults[name].default) != defaults[name].default
    }


class _FlashLlamaClass:
    """Stands for ``llama_cpp.Llama`` in llama-cpp-python's loader: constructs ``llamaflash.Llama`` with
    the llamaflash settings added (also through ``from_pretrained``)."""

    def __init__(self, extra: Dict[str, Any]) -> None:
        self.extra = extra

    def __call__(self, **kwargs: Any) -> Llama:
        kwargs = _loader_keywords(kwargs)
        if self.extra.get("deterministic") and kwargs.get("flash_attn") is False:
            # llama-cpp-python's server passes its default flash_attn=False; deterministic needs it on
            del kwargs["flash_attn"]
        return Llama(**kwargs, **self.extra)

    def from_pretrained(self, **kwargs: Any) -> Llama:
        return Llama.from_pretrained(**_loader_keywords(kwargs), **self.extra)


def _loader_keywords(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """llama-cpp-python's loader passes settings this llama_cpp.Llama takes no parameter for (e.g.
    rpc_servers) and so ignores; llamaflash.Llama refuses unknown keywords, so they are dropped here."""
    from ..runtime.llama_settings import known_keywords

    known = known_keywords()
    return {k: v for k, v in kwargs.items() if k in known} if known else dict(kwargs)


class _LlamaCppWithFlashLlama:
    """The ``llama_cpp`` module as the loader below sees it: ``Llama`` is :class:`_FlashLlamaClass`,
    every other name is llama_cpp's own."""

    def __init__(self, llama_class: _FlashLlamaClass) -> None:
        self.Llama = llama_class

    def __getattr__(self, name: str) -> Any:
        return getattr(llama_cpp, name)


_UPSTREAM_LOADER = LlamaProxy.load_llama_from_model_settings
if "llama_cpp" not in _UPSTREAM_LOADER.__code__.co_names:  # the loader reaches Llama as llama_cpp.Llama
    raise ImportError(
        f"llama_cpp {llama_cpp.__version__}: LlamaProxy.load_llama_from_model_settings no longer "
        "constructs llama_cpp.Llama by that name; llamaflash.cli.serve must be updated for it"
    )


def _loader_constructing(llama_class: _FlashLlamaClass):
    """llama-cpp-python's own ``LlamaProxy.load_llama_from_model_settings`` (chat handlers, kv overrides,
    draft model, tokenizer, cache, chat template kwargs, all as upstream does them) with its ``llama_cpp``
    name bound to :class:`_LlamaCppWithFlashLlama`: the same code, its own namespace; nothing global changes."""
    namespace = dict(_UPSTREAM_LOADER.__globals__, llama_cpp=_LlamaCppWithFlashLlama(llama_class))
    return types.FunctionType(
        _UPSTREAM_LOADER.__code__,
        namespace,
        _UPSTREAM_LOADER.__name__,
        _UPSTREAM_LOADER.__defaults__,
        _UPSTREAM_LOADER.__closure__,
    )


def load_flash_llama(settings: ModelSettings) -> Llama:
    """Load the model of ``settings`` as ``llamaflash.Llama``: a registry name is fetched first (the
    settings are not changed: the alias stays the name), then llama-cpp-python's loader runs with the
    llamaflash settings added. Says on stderr what loads, how long it took and which lane serves it."""
    if settings.hf_model_repo_id is None:
        settings = settings.model_copy(update={"model": str(resolve_model(settings.model, progress=True))})
    say(f"llamaflash: loading {settings.model} ...")
    start = time.perf_counter()
    with plain_notices():
        llm = _loader_constructing(_FlashLlamaClass(flash_kwargs(settings)))(settings)
    say(f"llamaflash: loaded in {time.perf_counter() - start:.1f} s, {describe_lane(llm)}")
    return llm


class FlashLlamaProxy(LlamaProxy):
    """llama-cpp-python's LlamaProxy loading every model with :func:`load_flash_llama`."""

    load_llama_from_model_settings = staticmethod(load_flash_llama)

    def __setitem__(self, model: str, settings: Union[ModelSettings, str, bytes]) -> None:
        if isinstance(settings, (bytes, str)):
            settings = FlashModelSettings.model_validate_json(settings)
        super().__setitem__(model, settings)


def create_app(server_settings: ServerSettings, model_settings: Sequence[ModelSettings]) -> FastAPI:
    """``llama_cpp.server.app.create_app``'s app (its router, request-id and CORS middleware, server
    settings, ping setting) whose models are served by :class:`FlashLlamaProxy`. The first model loads
    here. The routes reach the proxy through ``llama_cpp.server.app``'s module state, so one app per
    process, as upstream."""
    server_app.set_server_settings(server_settings)
    app = FastAPI(
        middleware=[Middleware(RawContextMiddleware, plugins=(RequestIdPlugin(),))],
        title="llama.cpp Python API (llamaflash)",
        version=llama_cpp.__version__,
        root_path=server_settings.root_path,
    )
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    app.include_router(server_app.router)
    # what upstream's set_llama_proxy does, with the llamaflash proxy
    server_app._llama_proxy = FlashLlamaProxy(models=list(model_settings))
    if server_settings.disable_ping_events:
        server_app.set_ping_message_factory(lambda: bytes())
    return app


# -- command line ------------------------------------------------------------------------------------

#: Short spellings of options (besides --name and --name-with-dashes).
_ALIASES = {"sidecar_path": ["--sidecar"], "model": [], "config_file": []}


def _add_setting_option(parser: argparse.ArgumentParser, name: str, field) -> None:
    """One option per setting, as llama_cpp.server's own command line adds them (``--n_ctx 4096``), also
    spelled with dashes (``--n-ctx``); a boolean given without a value means true (``--embedding``)."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else []) + _ALIASES.get(name, [])
    description = field.description or ""
    if not field.is_required() and field.default is not None:
        description += f" (default: {field.default})"
    annotation = field.annotation
    base = server_cli._get_base_type(annotation) if annotation is not None else str
    if server_cli._contains_dict_type(annotation):
        parser.add_argument(*flags, dest=name, type=server_cli._parse_json_object_arg, help=description)
    elif base is bool:
        parser.add_argument(*flags, dest=name, type=server_cli._parse_bool_arg, nargs="?", const=True, help=description)
    else:
        parser.add_argument(
            *flags,
            dest=name,
            type=base,
            help=description,
            nargs="*" if server_cli._contains_list_type(annotation) else None,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamaflash serve",
        allow_abbrev=False,
        description="llama-cpp-python's OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
        "/v1/embeddings, /v1/models, ...) with the models served by llamaflash. Every "
        "llama_cpp.server option works, with underscores or dashes, as do llamaflash's.",
        epilog="Several models: --config_file FILE (JSON, or YAML by extension): the server settings plus "
        '"models": [{"model": ..., "model_alias": ..., "ram_budget_mb": ..., ...}, ...].',
    )
    parser.add_argument(
        "model_arg", nargs="?", metavar="MODEL", help="Model: a .gguf file or a registry name (`llamaflash models`)."
    )
    parser.add_argument(
        "--config_file",
        "--config-file",
        dest="config_file",
        help="Server config file (JSON or YAML) with several models; also $CONFIG_FILE.",
    )
    for name, field in FlashSettings.model_fields.items():
        _add_setting_option(parser, name, field)
    return parser


def _validation_message(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())


def read_config_file(path: str) -> FlashConfigFileSettings:
    if not os.path.exists(path):
        raise LlamaflashError(f"config file '{path}' does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(raw)
        else:
            data = json.loads(raw)
        return FlashConfigFileSettings.model_validate(data)
    except ValidationError as e:
        raise LlamaflashError(f"config file '{path}': {_validation_message(e)}") from e
    except ValueError as e:  # JSON or YAML syntax
        raise LlamaflashError(f"config file '{path}' cannot be read: {e}") from e


def parse_settings(argv: Sequence[str]) -> Tuple[ServerSettings, List[FlashModelSettings]]:
    """Server and model settings from ``llamaflash serve`` arguments. With a config file, its models
    are served and the command line may only set server options (they override the file's)."""
    args = build_parser().parse_args(list(argv))
    given = {k: v for k, v in vars(args).items() if v is not None and k in FlashSettings.model_fields}
    if args.model_arg is not None:
        if "model" in given and given["model"] != args.model_arg:
            raise LlamaflashError(f"two models given: {args.model_arg} and --model {given['model']}")
        given["model"] = args.model_arg
    server_given = {k: v for k, v in given.items() if k in ServerSettings.model_fields}
    model_given = {k: v for k, v in given.items() if k not in ServerSettings.model_fields}
    config_file = args.config_file or os.environ.get("CONFIG_FILE")
    try:
        if config_file:
            if model_given:
                raise LlamaflashError(
                    f"with a config file the models and their options come from the file "
                    f"(given here: {', '.join(sorted(model_given))})"
                )
            config = read_config_file(config_file)
            if not config.models:
                raise LlamaflashError(f"config file '{config_file}' lists no models")
            server = ServerSettings.model_validate({**config.model_dump(exclude={"models"}), **server_given})
            models = list(config.models)
        else:
            if "model" not in model_given:
                raise LlamaflashError("give a MODEL (a .gguf file or a registry name) or --config_file")
            server = ServerSettings(**server_given)
            models = [FlashModelSettings(**model_given)]
    except ValidationError as e:
        raise LlamaflashError(f"invalid settings: {_validation_message(e)}") from e
    for model in models:
        if model.hf_model_repo_id is None:
            check_model(model.model)
    return server, models


class PortInUseError(LlamaflashError, OSError):
    """The server's address is taken."""


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (as uvicorn binds one), before any model loads, so a
    taken port is reported at once as :class:`PortInUseError`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is already in use (another server?); choose another with --port"
            ) from e
        raise LlamaflashError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def serve(argv: Sequence[str]) -> None:
    """``llamaflash serve``: parse, bind, load the first model, serve until Ctrl-C or SIGTERM."""
    server_settings, models = parse_settings(argv)
    if models and all(getattr(m, "deterministic", False) for m in models):
        untiled_for_determinism()
    sock = listen(server_settings.host, server_settings.port)
    port = sock.getsockname()[1]
    try:
        scheme = "https" if server_settings.ssl_certfile else "http"
        host = f"[{server_settings.host}]" if ":" in server_settings.host else server_settings.host
        url = f"{scheme}://{host}:{port}{server_settings.root_path}/v1"
        say(
            f"llamaflash: listening on {url} ({len(models)} model{'s' if len(models) != 1 else ''}: "
            f"{', '.join(m.model_alias or m.model for m in models)}); loading the first"
        )
        try:
            app = create_app(server_settings, models)
        except ValueError as e:  # llama.cpp cannot load the file, or llamaflash.Llama refused a setting
            if isinstance(e, LlamaflashError):
                raise
            raise LlamaflashError(f"loading {models[0].model_alias or models[0].model}: {e}") from e
        say(f"llamaflash: serving the OpenAI-compatible API at {url} (Ctrl-C stops the server)")
        config = uvicorn.Config(
            app,
            host=server_settings.host,
            port=port,
            ssl_keyfile=server_settings.ssl_keyfile,
            ssl_certfile=server_settings.ssl_certfile,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


if __name__ == "__main__":
    serve(sys.argv[1:])
