"""`llamaflash.Llama`: a drop-in replacement for `llama_cpp.Llama` that serves FFN layers from a sidecar.

Layering (as in llama-cpp-python): `llamaflash._native` (C++ core and ggml backend) → this module,
which owns the native engine for the lifetime of the llama.cpp model → the public `Llama`. `__init__`
is the load's stages: the arguments checked (`llama_load.request_from_arguments`), the plan made
exactly as `llamaflash env` makes it (`model_plan`: identify the model, find and check the sidecar,
decide the mode, plan), the plan opened as data by the native engine's one entry point, shared with
the backend library of the llama.cpp tools (`llama_load.open_engine`), llama.cpp loaded
(`llama_load.load_llama`), the engine attached (`llama_load.attach_engine`). Beside it: `offload`
(the plan and configuration under ram_budget_mb), `expert_runtime` (an MoE model's expert engine),
`notices` (what loading tells the user) and `flash_stats` (the `flash_stats()` report).

Everything `llama_cpp.Llama` accepts and does keeps working. Added keyword arguments:
  sidecar_path   path of the sidecar GGUF; default `<model stem>.flash.gguf` beside the model. With
                 no sidecar the model runs exactly as stock llama-cpp-python (said once, as a warning).
  flash_mode     None / "auto" (in memory): the lane measured for this sidecar on this machine
                 (plugin/planning/lane_decision.py): stock llama.cpp, untouched, unless `llamaflash tune` (or
                 `lane_decision.measure`) stored a measurement showing the sparse lane faster than stock
                 here, then "sparse". Fixed at load, never timed at run time (deterministic);
                 `flash_stats()["decision"]` says what was chosen and why. Embedding models
                 (`embedding=True`) always run exact (stock). "dense": the exact dense lane
                 (bit-identical to stock); "sparse": decode batches (up to `flash_max_sparse_tokens`
                 tokens) of layers with a threshold run on the sparse lane (lossy: the converter's
                 operating point), prefill on the dense lane.
  flash_sparsity None: the converter's operating point (the sidecar's thresholds); a level the
                 converter analysed (e.g. 0.3): that level's per-layer thresholds; 0: no sparsity
                 (sparse mode then skips only exact zeros of the activation).
  flash_max_sparse_tokens  batches up to this many tokens are eligible for the sparse lane
                 (default 1: decode only).
  flash_dense_up  sparse lane only: True = u = up·x for every neuron by ggml's dense GEMV (then the
                 kernel reads only the active neurons' down_t rows); False = up rows of the active
                 neurons only, in the kernel; None = chosen from the level's sparsity (dense up below
                 DENSE_UP_MAX_SPARSITY, where streaming the whole matrix measured faster).
  ram_budget_mb  flash offload: the whole process (llama.cpp's weights, KV cache and buffers, Python,
                 and everything llamaflash allocates) is planned to fit in this many MiB
                 (plugin/planning/planner.py; `llamaflash plan MODEL --ram-budget-mb N` shows the plan). The up
                 and down_t rows of the FFN stay on flash and come through a neuron cache by direct I/O;
                 decode runs on the sparse lane (the converter's operating point, or flash_sparsity).
                 Needs a format-2 sidecar in base neuron order. A budget below the minimum raises
                 RamBudgetError naming the minimum; n_batch/n_ubatch default to the plan's. With
                 flash_mode unset, a budget that holds everything stock llama.cpp keeps resident (the
                 model file, llama.cpp's share and a margin: plugin/planning/budget_decision.py) runs stock
                 llama.cpp untouched instead, which is faster there: with its weights read into memory
                 (use_mmap=False, so the page cache cannot thrash under the limit) where that need fits
                 and use_mmap is not given, else mapped; flash_stats()["decision"] says which and why
                 (flash_mode="sparse" forces offload).
  flash_io_engine  offload only: "auto" (io_uring when the kernel allows it, else a pread pool),
                 "io_uring" or "pool".
  flash_disk_profile  offload only: what the planner assumes of the disk. None = the profile saved
                 for the sidecar's disk by `llamaflash plan --probe-disk` if any, else a built-in
                 conservative default; "probe" = measure it now (a few seconds) and save it;
                 "default"; a dict or the path of a saved probe (JSON).
  flash_stream_gate  offload only: None = the planner's choice (the gate matrices resident, or read
                 from flash every token one layer ahead, whichever predicts the faster decode: streamed
                 where resident does not fit or its memory pins enough more clusters); True / False
                 force streamed / resident.
  flash_speculative  speculative decoding (plugin/runtime/speculative.py): None = on under ram_budget_mb,
                 off in memory; True / False; or a dict of `SpeculativeSettings` fields. Drafts come
                 from the context (prompt lookup), from the model itself in draft mode (offload: FFN
                 from the RAM-resident clusters only), or from a `draft_model=` the caller passes;
                 the target model verifies them, so the tokens are the non-speculative ones.
  flash_draft_copy  offload only: the sidecar's draft copy (every neuron's up and down rows at low bit
                 width, `llamaflash convert --draft-type`) kept resident for the self-draft: None = the
                 planner's choice (the copy or the same memory as pinned clusters, whichever predicts
                 the faster delivered decode; plugin/planning/draft_plan.py); True / False force it. Only drafts
                 use it, so it never changes the tokens; without self-drafts it is never kept (True is
                 refused there), so speculation off gets the plan without speculation.
  flash_batch_invariant  None = on under ram_budget_mb, off in memory. On: flash attention
                 (flash_attn=True unless given) and llama.cpp's and llamaflash's weights in plain, not
                 repacked, CPU memory, so that each row of a batch of up to 7 tokens is computed with
                 the bits of decoding it alone (speculative.BATCH_INVARIANT_MAX): verify batches then
                 give exactly the non-speculative tokens. Off: stock llama.cpp's numerics.
  deterministic  False (default): repeat-stable, the same request gives the same tokens and logits as
                 the first time it was evaluated, whatever ran in between (plugin/runtime/eval_shapes.py:
                 a prompt evaluated before is brought back with the batch shapes it had then, and a prompt
                 the cache holds whole samples from its recorded logits). True: batch-invariant, every
                 evaluation in batches of 1..7 rows (up to 63 where llamaflash computes every K-quant
                 matmul: plugin/runtime/matmul_rows.py) over plain weights with flash attention and a q8_0 KV
                 cache (unless type_k / type_v are given), so an answer no longer depends on the cache's
                 history or on n_batch / n_ubatch: a conversation replayed from scratch gives the answer it
                 got continued in the KV cache. Costs prefill speed, and the q8_0 KV cache a little
                 quality (docs/BENCHMARKS.md, "Identical answers").
  flash_prompt_tokens  offload only: the prompt length the planner weighs when it predicts time to
                 the first token and chooses n_ubatch (None: 512; plugin/planning/prefill_speed.py).
  flash_expert_slots  mixture-of-experts models under ram_budget_mb: expert cache slots per MoE layer
                 (None: the planner's choice from the budget; given: the engine serves the experts from
                 flash even when the whole model would fit).
  flash_verify   True (default): every FFN row llamaflash reads is checked against the sidecar's
                 CRC-32C row checksums before anything is computed with it (in memory once at load,
                 offload on every flash read; running as stock with a sidecar, the base model's FFN
                 rows once at load, on a thread of their own while llama.cpp loads); a mismatch raises SidecarIntegrityError naming the file,
                 tensor and offset. False skips the checks (for measuring their cost). A sidecar
                 without checksums (format 1/2 from an older converter) is served unchecked, with a
                 warning once. Before every evaluation both files are also checked (one fstat each): one
                 that shrank or grew since load is a FlashIoError; one rewritten in place is checked
                 against the checksums again (docs/SIDECAR.md, "Files that change while in use").
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional

import llama_cpp
import numpy as np
from llama_cpp._logger import set_verbose

from .. import _native
from ..errors import FlashIoError, NonFiniteOutputError, SidecarIntegrityError
from ..files.sidecar import SidecarInfo
from ..planning import lane_decision
from . import eval_shapes, flash_stats, llama_load, model_plan, shaped_eval, speculative
from .eval_shapes import KvHistory, PromptRecords, Segment
from .llama_settings import FLASH_MODES, _check_known_keywords, sparsity_thresholds  # noqa: F401
from .notices import LlamaflashWarning  # noqa: F401

if TYPE_CHECKING:
    from ..files.integrity import BaseRowCheck

_GENERATE_PARAMETERS = list(inspect.signature(llama_cpp.Llama.generate).parameters)[2:]  # after self, tokens


def _generate_reset(args, kwargs) -> bool:
    """The `reset` argument of a llama_cpp.Llama.generate call (positional or keyword)."""
    if "reset" in kwargs:
        return bool(kwargs["reset"])
    i = _GENERATE_PARAMETERS.index("reset")
    return bool(args[i]) if len(args) > i else True


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` with the FFN layers served by llamaflash (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *args: Any,
        sidecar_path: Optional[str] = None,
        flash_mode: Optional[str] = None,
        flash_sparsity: Optional[float] = None,
        flash_max_sparse_tokens: Optional[int] = None,
        flash_dense_up: Optional[bool] = None,
        ram_budget_mb: Optional[int] = None,
        flash_io_engine: str = "auto",
        flash_stream_gate: Optional[bool] = None,
        flash_disk_profile: Any = None,
        flash_speculative: Any = None,
        flash_batch_invariant: Optional[bool] = None,
        flash_draft_copy: Optional[bool] = None,
        flash_verify: bool = True,
        flash_expert_slots: Optional[int] = None,
        deterministic: bool = False,
        flash_prompt_tokens: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        _check_known_keywords(kwargs)  # llama_cpp.Llama ignores unknown ones: a misspelt setting would be lost
        self._flash: Optional[_native.FlashModel] = None
        self._prompt_pages_freed = 0  # bytes of compute-buffer ranges freed after prompt batches (flash_stats)
        self._flash_info: Optional[SidecarInfo] = None
        self._flash_sidecar: Optional[Path] = None
        self._flash_plan = None
        self._flash_decision: Optional[lane_decision.Decision] = None
        self._base_check: Optional["BaseRowCheck"] = None  # stock with a sidecar: its row check
        self._speculator: Optional[speculative.Speculator] = None
        self._speculation_off_reason: Optional[str] = None
        self._experts = None  # _native.ExpertModel: an MoE model's experts served from flash
        self._expert_lock: Dict[str, Any] = {}  # what locking an MoE model's dense part did
        self._user_draft = None
        self._kv_history = KvHistory()  # the batch shapes that computed the KV cache (eval_shapes)
        self._prompt_records = PromptRecords()
        self._pending_prompt: Optional[Any] = None
        self._kv_may_split = True  # the KV cache's types may take split-KV attention (load_llama)
        self._tinyblas_matrix: Optional[str] = None  # see eval_shapes.invariant_chunks (load_llama)
        self._invariant_rows = eval_shapes.MAX_ROWS  # a deterministic evaluation's largest batch (load_llama)
        self._matmul_rows = None  # _native.InvariantMatmuls: K-quant matmuls computed row by row (load_llama)
        self._load_plan: Optional[model_plan.ModelPlan] = None
        self._flash_args = {
            "sidecar_path": sidecar_path,
            "flash_mode": flash_mode,
            "flash_sparsity": flash_sparsity,
            "flash_max_sparse_tokens": flash_max_sparse_tokens,
            "flash_dense_up": flash_dense_up,
            "ram_budget_mb": ram_budget_mb,
            "flash_io_engine": flash_io_engine,
            "flash_stream_gate": flash_stream_gate,
            "flash_disk_profile": flash_disk_profile,
            "flash_speculative": flash_speculative,
            "flash_batch_invariant": flash_batch_invariant,
            "flash_draft_copy": flash_draft_copy,
            "flash_verify": flash_verify,
            "flash_expert_slots": flash_expert_slots,
            "deterministic": deterministic,
            "flash_prompt_tokens": flash_prompt_tokens,
        }
        request = llama_load.request_from_arguments(self, model_path, kwargs)
        # ggml logs through llama-cpp-python's callback, filtered by its verbosity: set it before
        # llamaflash loads anything through ggml (repacking weights logs a line per tensor)
        set_verbose(bool(kwargs.get("verbose", True)))
        model = model_plan.identify_model(request)
        sidecar = model_plan.find_sidecar(model, request)
        choice = model_plan.decide_mode(model, sidecar, request)
        plan = model_plan.plan_load(model, sidecar, choice, request)
        engine = llama_load.open_engine(plan)
        llama_load.load_llama(self, plan, engine, model_path, args, kwargs)
        llama_load.attach_engine(self, plan, engine)

    def eval(self, tokens) -> None:
        """`llama_cpp.Llama.eval`, in the batch shapes of eval_shapes: batch-invariant chunks of 2..7
        rows (deterministic=True: every evaluation; otherwise under batch-invariant numerics:
        evaluations of up to 7 tokens, i.e. decode steps and verify batches), else llama-cpp-python's
        own n_batch chunks; each call is recorded in the KV history. A verify batch (speculation on)
        gets the logits of every row and only those (generate samples each position from them). An
        I/O error inside the offload lane (which fails llama_decode) is raised as FlashIoError naming
        the file and the cause (a failed checksum as SidecarIntegrityError), instead of a bare
        RuntimeError; the context keeps its earlier tokens. First, the sidecar and the model file are
        checked for having changed since load (FlashIoError, or SidecarIntegrityError for a rewritten
        row), before any of their pages is computed with."""
        if self._flash is not None:
            self._flash.check_files()
        tokens = list(tokens)
        n_past = self.n_tokens
        self._kv_history.cut(n_past)
        verify = self._speculator is not None and 1 <= len(tokens) <= min(self.n_batch, self._speculator.max_batch)
        try:
            if self._batch_invariant and tokens and (self._deterministic or len(tokens) <= eval_shapes.MAX_ROWS):
                shaped_eval.eval_invariant(self, tokens, all_logits=self._logits_all or verify)
            elif verify and not self._logits_all:
                self._speculator.eval_rows(self, tokens)
                self._kv_history.add(Segment(n_past, len(tokens), True))
            else:
                if verify:
                    with self._speculator.timed_verify(len(tokens)):
                        super().eval(tokens)
                else:
                    super().eval(tokens)
                for i in range(0, len(tokens), self.n_batch):
                    self._kv_history.add(Segment(n_past + i, min(self.n_batch, len(tokens) - i), self._logits_all))
        except RuntimeError as e:
            self._kv_history.forget()
            raise self._decode_failure(e) from e
        except BaseException:
            self._kv_history.forget()
            raise
        shaped_eval.record_prompt(self, evaluated=bool(tokens))

    def generate(self, tokens, *args, **kwargs):
        """`llama_cpp.Llama.generate`, repeat-stable: a prompt evaluated before (and still in the
        prompt records) is brought back to the KV state and logits its first evaluation gave
        (eval_shapes.plan_replay) before llama-cpp-python's loop samples from it. With
        deterministic=True every row is batch-invariant, so llama-cpp-python's own prefix reuse is
        already exact."""
        tokens = list(tokens)
        reset = _generate_reset(args, kwargs)
        if reset and tokens and not self._deterministic:
            shaped_eval.replay_prompt(self, tokens)
            self._pending_prompt = np.asarray(tokens, dtype=np.intc)
        try:
            return (yield from super().generate(tokens, *args, **kwargs))
        finally:
            self._pending_prompt = None

    def reset(self) -> None:
        super().reset()
        self._kv_history.cut(0)

    def load_state(self, state) -> None:
        super().load_state(state)
        self._kv_history.forget()  # a KV cache computed elsewhere: no prompt can be matched in it

    def _decode_failure(self, e: RuntimeError) -> Exception:
        """What a failed llama_decode means: a served FFN's NaN/inf (NonFiniteOutputError, naming the
        layer), a flash read error (FlashIoError), else `e` itself."""
        if self._experts is not None:
            message = self._experts.take_error()
            if message.startswith(_native.INTEGRITY_ERROR_PREFIX):
                return SidecarIntegrityError(f"llamaflash: an expert read from flash failed its check: {message}")
            if message:
                return FlashIoError(f"llamaflash: reading experts from flash failed: {message}")
            return e
        bad = self._flash.take_non_finite() if self._flash is not None else ""
        if bad:
            return NonFiniteOutputError(
                f"llamaflash: {bad}. The served weights are not what the sidecar describes (re-copy it, or "
                f"re-create it with `llamaflash convert --force`), or the model overflows at this input"
            )
        message = self._flash.take_error() if self._flash is not None else ""
        if message.startswith(_native.INTEGRITY_ERROR_PREFIX):
            return SidecarIntegrityError(f"llamaflash: a flash read failed its check: {message}")
        if message:
            return FlashIoError(f"llamaflash: reading FFN weights from flash failed: {message}")
        return e

    def _configure_sparse(self, level: Optional[float]) -> None:
        self._flash.set_sparse_config(
            True,
            max_tokens=self._flash_args["flash_max_sparse_tokens"],
            up_by_ggml=model_plan.dense_up(self._flash_info, level, self._flash_args["flash_dense_up"]),
        )

    # -- llamaflash additions -------------------------------------------------------------------

    @property
    def flash_mode(self) -> str:
        """The lane in use: "sparse", "dense", "offload" (ram_budget_mb: sparse lane over the flash
        neuron cache), or "stock" (no sidecar, or the default decided that stock is faster here;
        `flash_stats()["decision"]` says why)."""
        return self._flash_mode

    @property
    def flash_plan(self):
        """The `planner.OffloadPlan` in use (ram_budget_mb), else None."""
        return self._flash_plan

    def set_flash_sparsity(self, level: Optional[float]) -> None:
        """Switches the sparse lane to another calibrated level (see `flash_sparsity`) without
        reloading; only in "sparse" mode."""
        if self._flash is None or self._flash_mode not in ("sparse", model_plan.OFFLOAD):
            raise ValueError(
                f"set_flash_sparsity needs flash_mode='sparse' (or ram_budget_mb) with a format-2 sidecar "
                f"(this model runs {self._flash_mode!r})"
            )
        self._flash.thresholds = sparsity_thresholds(self._flash_info, level)
        if self._flash_mode != model_plan.OFFLOAD:
            self._configure_sparse(level)

    def flash_stats(self) -> Dict[str, Any]:
        """Counters since load (or the last reset): layers served, FFN evaluations, tokens, time
        (assembled by :func:`llamaflash.runtime.flash_stats.collect`)."""
        return flash_stats.collect(self)

    def reset_flash_stats(self) -> None:
        if self._flash is not None:
            self._flash.reset_stats()
            self._flash.reset_cache_stats()
        self._prompt_pages_freed = 0
        if self._experts is not None:
            self._experts.reset_stats()
        if self._speculator is not None:
            self._speculator.reset_stats()

    # -- lifetime and pickling ------------------------------------------------------------------

    def close(self) -> None:
        if hasattr(self, "_stack"):  # absent when __init__ refused the input before llama.cpp started
            super().close()
        # after llama.cpp freed its buffers (and with them the registry's references)
        self._flash = None
        self._experts = None

    def __getstate__(self):
        state = super().__getstate__()
        state.update(self._flash_args)
        state["draft_model"] = getattr(self, "_user_draft", None)  # not the speculator (rebuilt by __init__)
        return state
