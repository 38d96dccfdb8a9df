"""Running the base model through stock llama.cpp and seeing (or changing) its FFN tensors.

The converter never computes the transformer itself: it runs the model with llama-cpp-python's
llama.cpp (``llama_cpp._internals``: model, context, batch) and installs the scheduler's eval
callback (``llama_context_params.cb_eval``, a ``ggml_backend_sched_eval_callback``). llama.cpp
names the tensors of layer L ``<name>-L`` (``llm_graph_context::cb``); for every supported
architecture (``src/models/{llama,qwen2,gemma3,...}.cpp`` and ``build_ffn`` in
``src/llama-graph.cpp`` of llama-cpp-python 0.3.36) the dense gated FFN is

    ffn_norm-L   x, the FFN input (output of the FFN norm)          [n_tokens, n_embd]
    ffn_gate-L   gate·x                                              [n_tokens, n_ff]
    ffn_up-L     up·x                                                [n_tokens, n_ff]
    ffn_swiglu-L / ffn_geglu-L / ffn_reglu-L   act(gate·x)·(up·x)    [n_tokens, n_ff]

followed by the down projection. With an eval callback the scheduler computes the graph up to
each tensor the callback asks for, then calls it with the tensor computed; the callback reads
it with ``ggml_backend_tensor_get`` and may write it back with ``ggml_backend_tensor_set``
before the rest of the graph runs. That is how the converter profiles FFN inputs
(:class:`ProfileHook`); a :class:`Hook` that returns an array has it written back.

The model is loaded without any llamaflash sidecar: what is profiled and measured is stock
llama.cpp. The last layer's FFN only sees the tokens whose logits are requested, so every
decode here requests logits for all tokens.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals
from llama_cpp._logger import set_verbose

from llamaflash.files import sidecar_format as fmt

# --------------------------------------------------------------------------------------
# ggml tensors, seen through ctypes
# --------------------------------------------------------------------------------------

_GGML_MAX_DIMS = 4
_GGML_MAX_SRC = 10
_GGML_MAX_OP_PARAMS = 64
_GGML_MAX_NAME = 64
_GGML_TYPE_F32 = 0


class _GgmlTensor(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (ggml.h of ggml 0.25.3, llama-cpp-python 0.3.36)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
    ]


_P_TENSOR = ctypes.POINTER(_GgmlTensor)


def _load_ggml_base() -> ctypes.CDLL:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = lib_dir / name
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:  # pragma: no cover - depends on the llama-cpp-python build
        raise RuntimeError(f"libggml-base not found in {lib_dir}")
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_set.restype = None
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    return lib


_ggml = _load_ggml_base()

#: llama.cpp's name of the gated activation tensor act(gate·x)·(up·x), per gate activation.
ACTIVATION_TENSOR_KINDS: dict[str, str] = {
    fmt.ACTIVATION_SILU: "ffn_swiglu",
    fmt.ACTIVATION_GELU: "ffn_geglu",
    fmt.ACTIVATION_RELU: "ffn_reglu",
}
KIND_INPUT = "ffn_norm"
KIND_GATE = "ffn_gate"
KIND_UP = "ffn_up"


def _parse_name(raw: bytes) -> tuple[str, int] | None:
    """``b"ffn_gate-12"`` → ("ffn_gate", 12); None for names without a layer suffix."""
    kind, sep, layer = raw.rpartition(b"-")
    if not sep or not layer.isdigit():
        return None
    return kind.decode("ascii", "replace"), int(layer)


def _read_f32(t: _GgmlTensor, ptr: int) -> np.ndarray:
    """The tensor's data as float32 (ne1, ne0); it must be a contiguous F32 2-D tensor."""
    ne0, ne1 = int(t.ne[0]), int(t.ne[1])
    if t.type != _GGML_TYPE_F32 or t.ne[2] != 1 or t.ne[3] != 1 or t.nb[1] != 4 * ne0:
        raise RuntimeError(
            f"llama.cpp tensor {t.name.decode()} is not a contiguous 2-D F32 tensor "
            f"(type {t.type}, ne {list(t.ne)}, nb {list(t.nb)}); this llama.cpp build is not supported"
        )
    out = np.empty((ne1, ne0), dtype=np.float32)
    _ggml.ggml_backend_tensor_get(ptr, out.ctypes.data, 0, out.nbytes)
    return out


def _write_f32(ptr: int, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data, dtype=np.float32)
    _ggml.ggml_backend_tensor_set(ptr, data.ctypes.data, 0, data.nbytes)


def activation_fn(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """NumPy version of a gate activation as llama.cpp computes it (gelu: tanh approximation)."""
    if name == fmt.ACTIVATION_SILU:
        return lambda g: g / (1.0 + np.exp(-g))
    if name == fmt.ACTIVATION_GELU:
        c = np.float32(np.sqrt(2.0 / np.pi))
        return lambda g: 0.5 * g * (1.0 + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
    if name == fmt.ACTIVATION_RELU:
        return lambda g: np.maximum(g, 0)
    raise ValueError(f"unknown activation {name!r}")


# --------------------------------------------------------------------------------------
# hooks
# --------------------------------------------------------------------------------------


class Hook:
    """What the eval callback does: ``wants(kind, layer)`` selects tensors; ``seen(kind, layer,
    data)`` gets each one as float32 (n_tokens, features) and may return an array to write back."""

    def wants(self, kind: str, layer: int) -> bool:
        return False

    def seen(self, kind: str, layer: int, data: np.ndarray) -> np.ndarray | None:
        return None


class ProfileHook(Hook):
    """Collects the FFN inputs x of the given layers (float16), and the first ``n_gate_check``
    tokens of llama.cpp's own gate·x per layer (float32) to check the NumPy recomputation.

    ``keep`` (set before each decode) selects which rows of the ubatch to keep, except in layer
    ``output_layer`` (llama.cpp's last layer, which only computes the rows whose logits were
    asked for): there every row is kept.
    """

    def __init__(self, layers: Sequence[int], n_gate_check: int = 8, output_layer: int | None = None) -> None:
        self.layers = set(layers)
        self.x: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
        self.gate_check: dict[int, np.ndarray] = {}
        self.x_check: dict[int, np.ndarray] = {}
        self.n_gate_check = n_gate_check
        self.keep: np.ndarray | slice | None = None
        self.output_layer = output_layer

    def wants(self, kind: str, layer: int) -> bool:
        if layer not in self.layers:
            return False
        return kind == KIND_INPUT or (kind == KIND_GATE and layer not in self.gate_check)

    def seen(self, kind: str, layer: int, data: np.ndarray) -> None:
        rows = data if self.keep is None or layer == self.output_layer else data[self.keep]
        if kind == KIND_INPUT:
            self.x[layer].append(rows.astype(np.float16))
            if layer not in self.x_check:
                self.x_check[layer] = rows[: self.n_gate_check].copy()
        elif kind == KIND_GATE and layer not in self.gate_check:
            self.gate_check[layer] = rows[: self.n_gate_check].copy()
        return None


# --------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------


class LlamaRunner:
    """One stock llama.cpp model + context (``n_ctx`` tokens, one sequence, every token in one
    ubatch) with an eval callback that dispatches to the current :class:`Hook`."""

    def __init__(self, model_path: str | os.PathLike[str], max_ctx: int, n_threads: int | None = None) -> None:
        n_threads = n_threads or max(1, min(os.cpu_count() or 1, 8))
        set_verbose(False)  # llama.cpp's load/context logs go to llama-cpp-python's logger: errors only
        mparams = llama_cpp.llama_model_default_params()
        self.model = _internals.LlamaModel(path_model=os.fspath(model_path), params=mparams, verbose=False)
        #: context (= chunk) length: ``max_ctx`` capped by the model's training context
        self.n_ctx = int(min(max_ctx, self.model.n_ctx_train() or max_ctx))
        self.n_vocab = self.model.n_vocab()
        self.hook: Hook = Hook()
        self.error: BaseException | None = None
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval_callback)

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self.n_ctx
        cparams.n_ubatch = self.n_ctx
        cparams.n_seq_max = 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        cparams.cb_eval = self._callback
        cparams.cb_eval_user_data = None
        self.ctx = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1, verbose=False)

    # -- tokens ------------------------------------------------------------------------

    @property
    def bos(self) -> int | None:
        """The BOS token when the model adds one, else None."""
        return self.model.token_bos() if self.model.add_bos_token() else None

    def tokenize(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no BOS, special tokens not parsed) as int32."""
        data = text.encode("utf-8")
        vocab = self.model.vocab
        capacity = len(data) + 16
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, capacity, False, False)
        if n < 0:  # pragma: no cover - more tokens than bytes + 16 cannot happen
            raise RuntimeError(f"tokenization failed ({n})")
        return np.frombuffer(buf, dtype=np.int32, count=n).copy()

    def with_bos(self, tokens: np.ndarray) -> np.ndarray:
        bos = self.bos
        return tokens if bos is None else np.concatenate([[bos], tokens]).astype(np.int32)

    # -- evaluation --------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], hook: Hook | None = None, outputs: np.ndarray | None = None) -> np.ndarray:
        """Evaluate ``tokens`` from an empty context (at most ``n_ctx``), with ``hook`` installed;
        returns the logits of the output positions, float32 (n_outputs, n_vocab), a view valid
        until the next decode. ``outputs`` (bool per token) selects the output positions (default:
        all). llama.cpp's last layer only computes the output rows."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise ValueError(f"decode: {n} tokens, context holds {self.n_ctx}")
        self.ctx.kv_cache_clear()
        self.batch.set_batch(list(map(int, tokens)), n_past=0, logits_all=True)
        if outputs is not None:
            if outputs.shape != (n,) or not outputs.any():
                raise ValueError("decode: outputs must be a bool per token, at least one True")
            for i in range(n):
                self.batch.batch.logits[i] = bool(outputs[i])
            n = int(np.count_nonzero(outputs))
        self.hook = hook or Hook()
        self.error = None
        try:
            self.ctx.decode(self.batch)
        finally:
            self.hook = Hook()
        if self.error is not None:
            raise self.error
        ptr = self.ctx.get_logits()
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab))

    def greedy(self, prompt: Sequence[int], n_gen: int) -> list[int]:
        """Stock greedy continuation of ``prompt`` (no hook): ``n_gen`` tokens, one decode each."""
        self.ctx.kv_cache_clear()
        tokens = list(map(int, prompt))
        self.batch.set_batch(tokens, n_past=0, logits_all=False)
        self.ctx.decode(self.batch)
        out: list[int] = []
        n_past = len(tokens)
        for _ in range(n_gen):
            logits = np.ctypeslib.as_array(self.ctx.get_logits_ith(-1), shape=(self.n_vocab,))
            tok = int(np.argmax(logits))
            out.append(tok)
            if n_past >= self.n_ctx:
                break
            self.batch.set_batch([tok], n_past=n_past, logits_all=False)
            self.ctx.decode(self.batch)
            n_past += 1
        return out

    def close(self) -> None:
        """Free the context and the model (again: nothing)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.batch.close()
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> "LlamaRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- callback ----------------------------------------------------------------------

    def _eval_callback(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        try:
            t = ctypes.cast(t_ptr, _P_TENSOR).contents
            parsed = _parse_name(t.name)
            if parsed is None or not self.hook.wants(*parsed):
                return False
            if ask:
                return True
            data = _read_f32(t, t_ptr)
            out = self.hook.seen(parsed[0], parsed[1], data)
            if out is not None:
                _write_f32(t_ptr, out)
            return True
        except BaseException as exc:  # never let an exception cross into C; re-raised by decode()
            if self.error is None:
                self.error = exc
            return False
