"""`llamaflash.Llama`: a drop-in replacement for `llama_cpp.Llama` that serves FFN layers from a sidecar.

Layering (as in llama-cpp-python): `llamaflash._native` (C++ core and ggml backend) → this module,
which opens the native FlashModel (`llamaflash.runtime.engine`: one typed configuration, one open call) and
owns it for the lifetime of the llama.cpp model → the public `Llama`. Beside it: `offload` (the plan
and configuration under ram_budget_mb), `moe_init` (an MoE model's expert engine), `notices` (what
loading tells the user) and `flash_stats` (the `flash_stats()` report).

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
                 evaluation in batches of 1..7 rows over plain weights with flash attention and a q8_0 KV
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
import os
import weakref
from pathlib import Path
from typing import Any, Dict, Optional

import llama_cpp
import numpy as np
from llama_cpp._logger import set_verbose

from .. import _native
from ..errors import FlashIoError, LlamaflashError, NonFiniteOutputError, SidecarIntegrityError, SidecarNotFoundError
from ..files import experts, gguf_model
from ..files.gguf_model import BaseModelInfo
from ..files.sidecar import SidecarInfo, default_sidecar_path, validate_pair
from ..planning import budget_decision, lane_decision
from . import engine, eval_shapes, expert_runtime, flash_stats, moe_init, offload, shaped_eval, speculative
from .eval_shapes import KvHistory, PromptRecords, Segment
from .llama_settings import (  # noqa: F401
    DENSE_UP_MAX_SPARSITY,
    FLASH_MODES,
    _check_argument_types,
    _check_deterministic,
    _check_known_keywords,
    _has_sparsity,
    _level_sparsity,
    _resolve_mode,
    deterministic_kv_type,
    sparsity_thresholds,
    tinyblas_matrix,
)
from .notices import LlamaflashWarning, say_once, warn_no_sidecar, warn_unchecked  # noqa: F401

OFFLOAD_MODE = "offload"  # flash_mode reported when ram_budget_mb is set

_GENERATE_PARAMETERS = list(inspect.signature(llama_cpp.Llama.generate).parameters)[2:]  # after self, tokens


def _generate_reset(args, kwargs) -> bool:
    """The `reset` argument of a llama_cpp.Llama.generate call (positional or keyword)."""
    if "reset" in kwargs:
        return bool(kwargs["reset"])
    i = _GENERATE_PARAMETERS.index("reset")
    return bool(args[i]) if len(args) > i else True


def _default_decision(info: SidecarInfo, sidecar: Path, kwargs: Dict[str, Any]) -> lane_decision.Decision:
    """The lane of flash_mode=None in memory (see lane_decision)."""
    if kwargs.get("embedding"):
        return lane_decision.Decision(lane_decision.STOCK, False, "running as stock: embeddings are always exact")
    if not _has_sparsity(info):
        return lane_decision.Decision(
            lane_decision.STOCK,
            False,
            "running as stock: the sidecar has no sparsity thresholds, so nothing "
            "can be skipped (flash_mode='dense' is exact but not faster; re-convert for the sparse lane)",
        )
    return lane_decision.stored_decision(sidecar)


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
        self._expert_setup: Optional[expert_runtime.ExpertSetup] = None
        self._kv_history = KvHistory()  # the batch shapes that computed the KV cache (eval_shapes)
        self._prompt_records = PromptRecords()
        self._pending_prompt: Optional[Any] = None
        self._flash_mode = _resolve_mode(flash_mode)
        _check_deterministic(deterministic, flash_batch_invariant, flash_max_sparse_tokens, kwargs)
        self._deterministic = deterministic
        self._kv_may_split = True  # the KV cache's types may take split-KV attention (set below)
        self._tinyblas_matrix: Optional[str] = None  # see eval_shapes.invariant_chunks (set below)
        max_sparse_given = flash_max_sparse_tokens is not None
        if flash_max_sparse_tokens is None:
            flash_max_sparse_tokens = 1
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
        _check_argument_types(
            sidecar_path,
            flash_sparsity,
            flash_max_sparse_tokens,
            flash_dense_up,
            ram_budget_mb,
            flash_io_engine,
            flash_stream_gate,
            flash_draft_copy,
            flash_verify,
        )
        if flash_prompt_tokens is not None and (
            isinstance(flash_prompt_tokens, bool) or not isinstance(flash_prompt_tokens, int) or flash_prompt_tokens < 1
        ):
            raise ValueError(
                f"flash_prompt_tokens={flash_prompt_tokens!r} must be a positive number of tokens, or None"
            )
        if ram_budget_mb is None and (
            flash_stream_gate is not None or flash_disk_profile is not None or flash_draft_copy is not None
        ):
            raise ValueError(
                "flash_stream_gate, flash_disk_profile and flash_draft_copy are flash-offload settings: "
                "pass ram_budget_mb too, or leave them unset"
            )
        requested_mode = self._flash_mode
        if ram_budget_mb is not None:
            if self._flash_mode == "dense":
                raise ValueError(
                    "ram_budget_mb needs the sparse lane (flash offload reads only the active neurons' rows); "
                    "use flash_mode='sparse' or leave flash_mode unset, or drop ram_budget_mb for the dense lane"
                )
            self._flash_mode = OFFLOAD_MODE
        spec_settings = speculative.SpeculativeSettings.from_argument(
            True if flash_speculative is None and ram_budget_mb is not None else flash_speculative
        )
        user_draft = kwargs.get("draft_model")
        if flash_batch_invariant is not None and not isinstance(flash_batch_invariant, bool):
            raise ValueError(f"flash_batch_invariant={flash_batch_invariant!r} must be True, False or None")
        self._batch_invariant = (
            (ram_budget_mb is not None or deterministic) if flash_batch_invariant is None else flash_batch_invariant
        )
        if self._batch_invariant and not max_sparse_given:
            # every row of a batch-invariant chunk (up to MAX_ROWS, a lone decode row evaluated with a
            # filler row after it) goes to the lane a token decoded alone goes to
            flash_max_sparse_tokens = eval_shapes.MAX_ROWS
            self._flash_args["flash_max_sparse_tokens"] = flash_max_sparse_tokens
        flash_attn_given = "flash_attn" in kwargs
        if self._batch_invariant:
            kwargs.setdefault("flash_attn", True)

        # ggml logs through llama-cpp-python's callback, filtered by its verbosity: set it before
        # llamaflash loads anything through ggml (repacking weights logs a line per tensor)
        set_verbose(bool(kwargs.get("verbose", True)))
        base = gguf_model.read_base_model(os.fspath(model_path))  # the one parse of the base header
        kv_type = deterministic_kv_type(base.header) if deterministic else None
        if kv_type is not None and "type_k" not in kwargs and "type_v" not in kwargs:
            # a q8_0 KV cache: flash attention never splits one row's KV for it, so a lone decode row
            # needs no filler row (eval_shapes.kv_may_split); type_k / type_v given are kept
            kwargs.update(type_k=kv_type, type_v=kv_type)
        self._kv_may_split = eval_shapes.kv_may_split(kwargs.get("type_k"), kwargs.get("type_v"))
        # a matrix tinyBLAS multiplies from 2 rows on: a lone row gets other bits at every position
        self._tinyblas_matrix = tinyblas_matrix(base.header)
        moe = experts.read_moe_model(base.header) if base.header is not None else None
        if moe is not None:
            moe_init.init_moe(self, os.fspath(model_path), base, moe, args, kwargs, flash_speculative)
            return
        sidecar = self._find_sidecar(os.fspath(model_path), sidecar_path, base)
        if sidecar is None and ram_budget_mb is not None:
            raise SidecarNotFoundError(
                f"ram_budget_mb needs a sidecar for '{model_path}' (none at "
                f"'{default_sidecar_path(model_path)}'); create it with `llamaflash convert {model_path}`"
            )
        if sidecar is None:
            self._flash_mode = "stock"
            self._init_llama(model_path, args, kwargs, spec_settings)
            return

        # Everything that can be wrong with the files is found here, before llama.cpp starts.
        info = validate_pair(model_path, sidecar, model=base)  # the one identity check
        if self._flash_mode == OFFLOAD_MODE and requested_mode == "auto":
            # stock-equivalent where the budget holds what stock keeps resident
            choice = budget_decision.decide(
                base.header,
                info,
                ram_budget_mb,
                int(kwargs.get("n_ctx", 512)),
                kwargs.get("n_ubatch"),
                logits_all=bool(kwargs.get("logits_all", False)),
                use_mmap=kwargs.get("use_mmap"),
            )
            self._flash_decision = lane_decision.Decision(choice.lane, False, choice.reason, detail=choice.as_dict())
            if choice.stock:
                if flash_disk_profile is not None and str(flash_disk_profile) != "probe":
                    from ..planning import disk_probe

                    disk_probe.resolve_profile(flash_disk_profile, sidecar)  # a bad one is still an error
                self._flash_mode = "stock"
                self._flash_info, self._flash_sidecar = info, Path(sidecar)
                # speculation as in memory: off unless asked for; asked for, it keeps the batch-invariant
                # numerics that make it exact; otherwise stock's numerics
                stock_spec = speculative.SpeculativeSettings.from_argument(flash_speculative)
                self._batch_invariant = (
                    (stock_spec is not None or deterministic)
                    if flash_batch_invariant is None
                    else flash_batch_invariant
                )
                if not self._batch_invariant and not flash_attn_given:
                    kwargs.pop("flash_attn", None)
                kwargs.setdefault("n_ubatch", choice.n_ubatch)
                kwargs["use_mmap"] = choice.use_mmap  # the way its need was counted
                if kwargs.get("verbose", True):
                    say_once(f"llamaflash: {choice.reason}")
                self._init_llama(model_path, args, kwargs, stock_spec)
                return
        if self._flash_mode == "auto":
            self._flash_decision = _default_decision(info, sidecar, kwargs)
            if self._flash_decision.lane == lane_decision.STOCK:
                # not one claimed weight, no extra split: the backend is not even registered
                self._flash_mode = "stock"
                self._flash_info, self._flash_sidecar = info, Path(sidecar)
                if kwargs.get("verbose", True):
                    say_once(f"llamaflash: '{sidecar}': {self._flash_decision.reason}")
                # llama.cpp reads the FFN weights itself: their rows are checked against the sidecar's
                # checksums on a thread of their own while it loads (a damaged model is refused here too)
                if flash_verify and info.integrity is not None:
                    from ..files.integrity import BaseRowCheck  # numpy: only a check needs it

                    self._base_check = BaseRowCheck(info, model_path)
                self._init_llama(model_path, args, kwargs, spec_settings)
                if self._base_check is not None:
                    try:
                        self._base_check.wait()
                    except LlamaflashError:
                        self.close()
                        raise
                return
            self._flash_mode = "sparse"
        thresholds = None
        if self._flash_mode in ("sparse", OFFLOAD_MODE):
            thresholds = sparsity_thresholds(info, flash_sparsity)
        if self._flash_mode == OFFLOAD_MODE:
            # the draft copy serves self-drafts only: without them the plan is the one without speculation
            self_drafts = spec_settings is not None and spec_settings.self_draft and user_draft is None
            if flash_draft_copy and not self_drafts:
                raise ValueError(
                    "flash_draft_copy=True keeps the draft copy for speculative self-drafts, which are off here "
                    "(flash_speculative=False, self_draft=False, or a draft_model given); leave flash_draft_copy "
                    "unset or turn self-drafts on"
                )
            plan, config, spec_settings, self._speculation_off_reason = offload.configure(
                model_path,
                sidecar,
                info,
                base.header,
                thresholds,
                kwargs,
                spec_settings,
                ram_budget_mb=ram_budget_mb,
                max_sparse_tokens=flash_max_sparse_tokens,
                stream_gate=flash_stream_gate,
                disk_profile=flash_disk_profile,
                draft_copy=flash_draft_copy if self_drafts else False,
                io_engine=flash_io_engine,
                verify=flash_verify,
                speculation_by_default=flash_speculative is None and user_draft is None,
                prompt_tokens=flash_prompt_tokens,
            )
            self._flash_plan = plan
        else:
            sparse = engine.sparse_config(False)
            if thresholds is not None:
                sparse = engine.sparse_config(
                    True, flash_max_sparse_tokens, up_by_ggml=self._dense_up(info, flash_sparsity)
                )
            config = engine.engine_config(info, model_path, thresholds, sparse, verify=flash_verify)
        config.repack = not self._batch_invariant
        if info.integrity is None:
            warn_unchecked(info, os.fspath(model_path))
        flash = engine.open_engine(config)

        _native.register_backend()  # idempotent; the first served model registers the ggml backend
        _native.begin_model_load(flash)
        try:
            self._init_llama(model_path, args, kwargs, spec_settings)
        finally:
            _native.end_model_load()

        expected = 3 * len(info.layers)
        if flash.bound_count != expected:
            self.close()
            raise LlamaflashError(
                f"llama.cpp placed {flash.bound_count} of the {expected} FFN weights of '{model_path}' on the "
                f"llamaflash device; the model cannot be served. Check that llama_cpp was not given tensor "
                f"overrides for FFN weights, or run without a sidecar."
            )
        self._flash = flash
        self._flash_info = info
        self._flash_sidecar = Path(sidecar)
        if self._flash_mode == OFFLOAD_MODE:
            offload.free_prompt_pages_after_decode(self)
        if self._speculator is not None and self._flash_mode == OFFLOAD_MODE and user_draft is None:
            self._speculation_off_reason = offload.attach_self_draft(
                self, self._speculator, self._flash_plan, info, spec_settings
            )

    def _init_llama(self, model_path, args, kwargs, spec_settings) -> None:
        """llama_cpp.Llama.__init__, then the speculator as its draft_model. llama-cpp-python's own
        draft path would keep n_ctx x n_vocab logits (it forces logits_all); the speculator's verify
        batches keep only their own rows (see eval), so a user's draft_model goes through it too."""
        user_draft = kwargs.pop("draft_model", None)
        if spec_settings is None and user_draft is not None:
            spec_settings = speculative.SpeculativeSettings(prompt_lookup=False, self_draft=False)
        if self._batch_invariant:
            with speculative.batch_invariant_weights():
                super().__init__(model_path, *args, **kwargs)
        else:
            super().__init__(model_path, *args, **kwargs)
        if spec_settings is not None:
            ref = weakref.ref(self)
            self._speculator = speculative.Speculator(spec_settings, user_draft=user_draft)
            self._speculator.bind(lambda: ref().n_tokens)
            self.draft_model = self._speculator
        self._user_draft = user_draft

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

    def _dense_up(self, info: SidecarInfo, level: Optional[float]) -> bool:
        """up·x by ggml's dense GEMV (flash_dense_up, or chosen from the level's sparsity)."""
        dense_up = self._flash_args["flash_dense_up"]
        if dense_up is None:
            dense_up = _level_sparsity(info, level) < DENSE_UP_MAX_SPARSITY
        return bool(dense_up)

    def _configure_sparse(self, level: Optional[float]) -> None:
        self._flash.set_sparse_config(
            True,
            max_tokens=self._flash_args["flash_max_sparse_tokens"],
            up_by_ggml=self._dense_up(self._flash_info, level),
        )

    @staticmethod
    def _find_sidecar(
        model_path: str, sidecar_path: Optional[str], base: Optional[BaseModelInfo] = None
    ) -> Optional[Path]:
        """The sidecar to use (None: run as stock); ``base``: the model's parsed header, if read already."""
        if base is None:
            base = gguf_model.read_base_model(model_path)
        if sidecar_path is not None:
            path = Path(sidecar_path)
            if not path.exists():
                raise SidecarNotFoundError(
                    f"sidecar '{path}' does not exist; create it with `llamaflash convert {model_path} -o {path}` "
                    f"or leave sidecar_path unset to run without one"
                )
            return path
        if not base.ffn_layers:
            return None  # no classic FFN (e.g. state-space models): pass through untouched
        path = default_sidecar_path(model_path)
        if not path.exists():
            warn_no_sidecar(model_path, path)
            return None
        return path

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
        if self._flash is None or self._flash_mode not in ("sparse", OFFLOAD_MODE):
            raise ValueError(
                f"set_flash_sparsity needs flash_mode='sparse' (or ram_budget_mb) with a format-2 sidecar "
                f"(this model runs {self._flash_mode!r})"
            )
        self._flash.thresholds = sparsity_thresholds(self._flash_info, level)
        if self._flash_mode != OFFLOAD_MODE:
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
