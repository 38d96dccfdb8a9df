"""Loading a mixture-of-experts model into `llamaflash.Llama`: under ``ram_budget_mb`` its routed
experts are served from flash by the expert engine (:mod:`~llamaflash.runtime.expert_runtime` decides,
plans and opens it) and every other weight is locked resident; otherwise, or where stock fits, the
model runs as stock llama.cpp untouched. Speculation's self-draft then routes among the resident
experts only."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, Dict

from .. import _native
from ..errors import LlamaflashError
from ..planning import lane_decision
from . import expert_runtime, speculative
from .notices import say_once

if TYPE_CHECKING:
    from .llama import Llama


def init_moe(
    llm: "Llama", model_path: str, base, moe, args: tuple, kwargs: Dict[str, Any], flash_speculative: Any
) -> None:
    """An MoE model: its routed experts from flash under ram_budget_mb (expert_runtime), else stock.
    Completes ``llm``'s ``__init__`` (llama.cpp loaded through ``llm._init_llama``)."""
    a = llm._flash_args
    if llm._flash_args["flash_mode"] not in (None, "auto"):
        raise ValueError(
            f"flash_mode={a['flash_mode']!r} is for dense FFN models; '{model_path}' is a "
            f"mixture-of-experts model: leave flash_mode unset"
        )
    setup = expert_runtime.prepare(
        model_path,
        base,
        moe,
        sidecar_path=a["sidecar_path"],
        ram_budget_mb=a["ram_budget_mb"],
        n_ctx=int(kwargs.get("n_ctx", 512)),
        n_ubatch=kwargs.get("n_ubatch"),
        io_engine=a["flash_io_engine"],
        disk_profile=a["flash_disk_profile"],
        verify=a["flash_verify"],
        n_slots=a["flash_expert_slots"],
        logits_all=bool(kwargs.get("logits_all", False)),
    )
    llm._expert_setup = setup
    llm._flash_decision = lane_decision.Decision(
        lane_decision.STOCK if setup.model is None else expert_runtime.EXPERTS_MODE, False, setup.reason
    )
    spec_settings = speculative.SpeculativeSettings.from_argument(flash_speculative)
    if spec_settings is not None and setup.model is None:
        spec_settings = dataclasses.replace(spec_settings, self_draft=False)  # stock: nothing to draft with
    if setup.model is None:
        llm._flash_mode = "stock"
        if setup.plan is not None and setup.plan.fits:  # the prefill batch at which stock fits the budget
            kwargs.setdefault("n_ubatch", setup.plan.n_ubatch)
        if kwargs.get("verbose", True):
            say_once(f"llamaflash: '{model_path}': {setup.reason}")
        llm._init_llama(model_path, args, kwargs, spec_settings)
        return
    plan = setup.plan
    kwargs.setdefault("n_batch", plan.n_ubatch)
    kwargs.setdefault("n_ubatch", plan.n_ubatch)
    _native.register_backend()
    _native.begin_expert_model_load(setup.model)
    try:
        llm._init_llama(model_path, args, kwargs, spec_settings)
    finally:
        _native.end_model_load()
    if setup.model.bound_count != moe.n_expert_tensors:
        llm.close()
        raise LlamaflashError(
            f"llama.cpp placed {setup.model.bound_count} of the {moe.n_expert_tensors} expert tensors of "
            f"'{model_path}' on the llamaflash device; the model cannot be served. Check that llama_cpp was "
            f"not given tensor overrides for expert weights, or run without ram_budget_mb."
        )
    llm._experts = setup.model
    llm._expert_lock = expert_runtime.lock_dense_part(model_path, moe, base.header)
    llm._flash_mode = expert_runtime.EXPERTS_MODE
    llm._flash_sidecar = setup.sidecar
    if llm._speculator is not None and llm._user_draft is None and spec_settings.self_draft:
        # cache-conditional routing: each draft token among the resident experts, nothing read
        llm._speculator.attach_self_draft(
            speculative.make_self_draft(weakref.ref(llm), llm.n_vocab()),
            note="draft tokens route among the resident experts only (no flash reads)",
        )
