"""How `llamaflash.Llama` loads a model, stage by stage. ``Llama.__init__`` runs, in order:

  request_from_arguments  its own arguments checked, and what this host asks of the plan
  model_plan stages       identify_model → find_sidecar → decide_mode → plan_load (shared with
                          `llamaflash env`: runtime/model_plan.py)
  open_engine             the plan as data (plan_file.in_memory) opened by ``_native.open_plan``, the
                          entry point the backend library opens `llamaflash env`'s plan file with
  load_llama              llama.cpp loads the model (``llama_cpp.Llama.__init__``) with the engine
                          armed to receive its FFN or expert weights, then the speculator
  attach_engine           the engine checked to hold every weight it serves and wired to the Llama

Each stage sets the ``Llama`` attributes it owns and nothing else.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional

import llama_cpp

from .. import _native
from ..errors import LlamaflashError
from ..files import plan_file
from . import eval_shapes, expert_runtime, matmul_rows, offload, speculative
from .llama_settings import (
    _check_argument_types,
    _check_deterministic,
    _resolve_mode,
    deterministic_kv_type,
    tinyblas_matrix,
)
from .model_plan import OFFLOAD, LoadRequest, ModelPlan
from .notices import say_once, warn_unchecked

if TYPE_CHECKING:
    from .llama import Llama


def request_from_arguments(llm: "Llama", model_path, kwargs: Dict[str, Any]) -> LoadRequest:
    """Checks llamaflash's arguments (``llm._flash_args``) before any file is read: a ValueError naming
    the argument. Sets the numerics this host asks for: ``llm._batch_invariant`` (default: under a
    budget or deterministic), ``llm._deterministic`` and the requested ``llm._flash_mode``. Returns
    what the plan is asked for."""
    a = llm._flash_args
    budget = a["ram_budget_mb"]
    llm._flash_mode = _resolve_mode(a["flash_mode"])
    max_sparse_given = a["flash_max_sparse_tokens"] is not None
    _check_deterministic(a["deterministic"], a["flash_batch_invariant"], a["flash_max_sparse_tokens"], kwargs)
    llm._deterministic = a["deterministic"]
    if not max_sparse_given:
        a["flash_max_sparse_tokens"] = 1
    _check_argument_types(
        a["sidecar_path"],
        a["flash_sparsity"],
        a["flash_max_sparse_tokens"],
        a["flash_dense_up"],
        budget,
        a["flash_io_engine"],
        a["flash_stream_gate"],
        a["flash_draft_copy"],
        a["flash_verify"],
    )
    prompt_tokens = a["flash_prompt_tokens"]
    if prompt_tokens is not None and (
        isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1
    ):
        raise ValueError(f"flash_prompt_tokens={prompt_tokens!r} must be a positive number of tokens, or None")
    if budget is None and any(
        a[k] is not None for k in ("flash_stream_gate", "flash_disk_profile", "flash_draft_copy")
    ):
        raise ValueError(
            "flash_stream_gate, flash_disk_profile and flash_draft_copy are flash-offload settings: "
            "pass ram_budget_mb too, or leave them unset"
        )
    if budget is not None and llm._flash_mode == "dense":
        raise ValueError(
            "ram_budget_mb needs the sparse lane (flash offload reads only the active neurons' rows); "
            "use flash_mode='sparse' or leave flash_mode unset, or drop ram_budget_mb for the dense lane"
        )
    speculation = a["flash_speculative"]
    speculative.SpeculativeSettings.from_argument(True if speculation is None and budget is not None else speculation)
    invariant = a["flash_batch_invariant"]
    if invariant is not None and not isinstance(invariant, bool):
        raise ValueError(f"flash_batch_invariant={invariant!r} must be True, False or None")
    llm._batch_invariant = (budget is not None or llm._deterministic) if invariant is None else invariant
    if llm._batch_invariant and not max_sparse_given:
        # every row of a batch-invariant chunk (up to MAX_ROWS, a lone decode row evaluated with a
        # filler row after it; deterministic: up to UNTILED_MAX_ROWS where the matmuls are
        # llamaflash's, invariant_rows) goes to the lane a token decoded alone goes to
        rows = eval_shapes.UNTILED_MAX_ROWS if llm._deterministic else eval_shapes.MAX_ROWS
        a["flash_max_sparse_tokens"] = rows
    return LoadRequest(
        model_path=os.fspath(model_path),
        sidecar_path=a["sidecar_path"],
        flash_mode=llm._flash_mode,
        sparsity=a["flash_sparsity"],
        max_sparse_tokens=a["flash_max_sparse_tokens"],
        dense_up=a["flash_dense_up"],
        ram_budget_mb=budget,
        n_ctx=int(kwargs.get("n_ctx", 512)),
        n_batch=kwargs.get("n_batch"),
        n_ubatch=kwargs.get("n_ubatch"),
        logits_all=bool(kwargs.get("logits_all", False)),
        use_mmap=kwargs.get("use_mmap"),
        flash_attn=bool(kwargs.get("flash_attn", llm._batch_invariant)),
        embedding=bool(kwargs.get("embedding")),
        io_engine=a["flash_io_engine"],
        stream_gate=a["flash_stream_gate"],
        disk_profile=a["flash_disk_profile"],
        draft_copy=a["flash_draft_copy"],
        verify=a["flash_verify"],
        expert_slots=a["flash_expert_slots"],
        prompt_tokens=prompt_tokens,
        batch_invariant=llm._batch_invariant,
        speculation=speculation,
        user_draft=kwargs.get("draft_model") is not None,
        deterministic=llm._deterministic,
    )


def open_engine(plan: ModelPlan) -> Optional["_native.PlanEngine"]:
    """The engine of a plan that serves the model, opened from the plan's serialised form by
    ``_native.open_plan`` (csrc/backend/plan_reader.h: read, checked against this ggml and the files,
    opened, pinned rows or experts read and checked); None for stock. Raises what the engine's open
    raises (ValueError for a configuration it refuses, FlashIoError, SidecarIntegrityError)."""
    if plan.engine is None:
        return None
    if plan.engine.dense is not None and plan.sidecar.info.integrity is None:
        warn_unchecked(plan.sidecar.info, plan.model.path)
    with plan_file.in_memory(plan.engine) as path:
        return _native.open_plan(path)


def computed_per_row(plan: ModelPlan) -> frozenset:
    """The matrices llamaflash computes every row of as a lone row (an MoE's routers under
    deterministic=True), which therefore need no filler row after a lone token."""
    if plan.engine is None or plan.engine.experts is None or not plan.engine.experts.router_rows:
        return frozenset()
    return frozenset(layer.router.name for layer in plan.model.moe.layers)


def invariant_rows(llm: "Llama", plan: ModelPlan, kwargs: Dict[str, Any], rows_alone: bool = False) -> int:
    """The most rows of a deterministic evaluation's batches (eval_shapes): UNTILED_MAX_ROWS where no
    matrix takes tinyBLAS, a dense FFN engine (if any) computes every batch of up to that many rows on
    one lane, and either llamaflash computes every K-quant matmul row by row (``rows_alone``: the load
    is armed by _native.begin_matmul_rows, and matmul_rows.all_rows_alone) or ggml-cpu's tiled kernel
    is off in this process and no dense engine serves the FFN (probed: _native.kquant_rows_invariant);
    else MAX_ROWS."""
    if not llm._deterministic or llm._tinyblas_matrix is not None:
        return eval_shapes.MAX_ROWS
    dense = plan.engine.dense if plan.engine is not None else None
    if dense is not None:
        # the sparse lane (lossy) takes batches up to max_tokens, the dense lane bigger ones: a
        # token must meet the same lane in every batch
        one_lane = not dense.sparse.enabled or dense.sparse.max_tokens >= eval_shapes.UNTILED_MAX_ROWS
        if not (rows_alone and one_lane):
            return eval_shapes.MAX_ROWS
    if rows_alone and matmul_rows.all_rows_alone(plan, bool(computed_per_row(plan))):
        return eval_shapes.UNTILED_MAX_ROWS  # every K-quant matmul llamaflash's, rows as alone
    threads = int(kwargs.get("n_threads_batch") or kwargs.get("n_threads") or 2)
    if dense is not None or not _native.kquant_rows_invariant(eval_shapes.UNTILED_MAX_ROWS, threads):
        return eval_shapes.MAX_ROWS
    return eval_shapes.UNTILED_MAX_ROWS


def load_llama(llm: "Llama", plan: ModelPlan, engine, model_path, args: tuple, kwargs: Dict[str, Any]) -> None:
    """``llama_cpp.Llama.__init__`` with the plan's llama.cpp settings (its defaults where the caller gave
    none, its overrides always) and, when ``engine`` is given, the engine armed to receive the weights it
    serves for exactly this load. Then the speculator as llama-cpp-python's draft_model (its own draft
    path would keep n_ctx x n_vocab logits; the speculator's verify batches keep only their rows), so a
    user's draft_model goes through it too. Stock with a checksummed sidecar: the base model's FFN rows
    are checked on a thread of their own meanwhile (SidecarIntegrityError after closing on a mismatch).
    deterministic=True without type_k / type_v: a q8_0 KV cache where the model's heads allow it
    (llama_settings.deterministic_kv_type); ``llm._kv_may_split`` says whether split-KV attention
    can occur."""
    llm._load_plan = plan
    llm._flash_mode = plan.mode
    llm._flash_decision = plan.decision
    llm._flash_plan = plan.offload
    llm._speculation_off_reason = plan.speculation_off_reason
    if plan.model.moe is None and plan.sidecar is not None:
        llm._flash_info, llm._flash_sidecar = plan.sidecar.info, plan.sidecar.path
    speculation = plan.speculation
    if plan.stock_fits_budget:  # batch-invariant numerics only where speculation needs them to be exact
        invariant = llm._flash_args["flash_batch_invariant"]
        llm._batch_invariant = (speculation is not None or llm._deterministic) if invariant is None else invariant
    if llm._batch_invariant:
        kwargs.setdefault("flash_attn", True)
    kv_type = deterministic_kv_type(plan.model.base.header) if llm._deterministic else None
    if kv_type is not None and "type_k" not in kwargs and "type_v" not in kwargs:
        # a q8_0 KV cache: flash attention never splits one row's KV for it, so a lone decode row
        # needs no filler row (eval_shapes.kv_may_split); type_k / type_v given are kept
        kwargs.update(type_k=kv_type, type_v=kv_type)
    llm._kv_may_split = eval_shapes.kv_may_split(kwargs.get("type_k"), kwargs.get("type_v"))
    # a matrix tinyBLAS multiplies from 2 rows on: a lone row gets other bits at every position
    llm._tinyblas_matrix = tinyblas_matrix(plan.model.base.header, per_row=computed_per_row(plan))
    # deterministic: the K-quant matmuls computed by llamaflash, rows as alone (matmul_rows)
    rows_alone = matmul_rows.applies(llm._deterministic, plan)
    llm._invariant_rows = invariant_rows(llm, plan, kwargs, rows_alone)
    for name, value in plan.llama_defaults.items():
        kwargs.setdefault(name, value)
    kwargs.update(plan.llama_overrides)
    if plan.notice and kwargs.get("verbose", True):
        say_once(plan.notice)
    if plan.check_base_rows:
        from ..files.integrity import BaseRowCheck  # numpy: only a check needs it

        llm._base_check = BaseRowCheck(plan.sidecar.info, model_path)
    user_draft = kwargs.pop("draft_model", None)
    if speculation is None and user_draft is not None:
        speculation = speculative.SpeculativeSettings(prompt_lookup=False, self_draft=False)
    if engine is not None:
        _native.register_backend()  # idempotent; the first served model registers the ggml backend
        engine.begin_model_load()
    if rows_alone:
        in_place = matmul_rows.reads_in_place(llm._flash_args["ram_budget_mb"])
        llm._matmul_rows = _native.begin_matmul_rows(read_in_place=in_place)  # armed until end_model_load
    try:
        if llm._batch_invariant:
            with speculative.batch_invariant_weights():
                llama_cpp.Llama.__init__(llm, model_path, *args, **kwargs)
        else:
            llama_cpp.Llama.__init__(llm, model_path, *args, **kwargs)
    finally:
        if engine is not None or rows_alone:
            _native.end_model_load()
    if rows_alone:
        matmul_rows.check_bound(llm, plan)
    if speculation is not None:
        ref = weakref.ref(llm)
        llm._speculator = speculative.Speculator(speculation, user_draft=user_draft)
        llm._speculator.bind(lambda: ref().n_tokens)
        llm.draft_model = llm._speculator
    llm._user_draft = user_draft
    if llm._base_check is not None:
        try:
            llm._base_check.wait()
        except LlamaflashError:
            llm.close()
            raise


def attach_engine(llm: "Llama", plan: ModelPlan, engine) -> None:
    """Checks that llama.cpp placed every weight the engine serves on the llamaflash device (else closes
    and raises LlamaflashError: the model is never served in part), then wires the engine to ``llm``:
    dense, its FlashModel (offload: prompt pages freed after each evaluation, the self-draft over the
    resident clusters); MoE, its ExpertModel with the model's dense part locked in RAM and the
    self-draft routing among resident experts. Nothing for stock."""
    if engine is None:
        return
    if engine.bound_count != engine.expected_weights:
        llm.close()
        if engine.experts is not None:
            what, fix = "expert tensors", "expert weights, or run without ram_budget_mb"
        else:
            what, fix = "FFN weights", "FFN weights, or run without a sidecar"
        raise LlamaflashError(
            f"llama.cpp placed {engine.bound_count} of the {engine.expected_weights} {what} of '{plan.model.path}' "
            f"on the llamaflash device; the model cannot be served. Check that llama_cpp was not given tensor "
            f"overrides for {fix}."
        )
    user_drafts = llm._user_draft is None
    if engine.experts is not None:
        llm._experts = engine.experts
        llm._expert_lock = expert_runtime.lock_dense_part(plan.model.path, plan.engine.lock_ranges)
        llm._flash_sidecar = plan.sidecar.path
        if llm._speculator is not None and user_drafts and plan.speculation.self_draft:
            # cache-conditional routing: each draft token among the resident experts, nothing read
            llm._speculator.attach_self_draft(
                speculative.make_self_draft(weakref.ref(llm), llm.n_vocab()),
                note="draft tokens route among the resident experts only (no flash reads)",
            )
        return
    llm._flash = engine.dense
    if plan.mode == OFFLOAD:
        offload.free_prompt_pages_after_decode(llm)
        if llm._speculator is not None and user_drafts:
            llm._speculation_off_reason = offload.attach_self_draft(
                llm, llm._speculator, plan.offload, plan.sidecar.info, plan.speculation
            )
