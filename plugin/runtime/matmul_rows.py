"""deterministic=True: the model's K-quant matmuls computed by llamaflash, every row as alone.

ggml-cpu multiplies K-quant weights by 8 or more rows with its tiled kernel, whose rows have other
bits than a row alone, so deterministic evaluation was limited to 7-row batches (or the whole process
had to switch the tiled kernel off). ``_native.begin_matmul_rows`` arms a load so that the model's
2-D K-quant weights that only MUL_MATs use (attention, dense FFN, output; csrc/backend/matmul_rows.h
says which, ``_native.invariant_matmul_weight`` answers for one) go to the llamaflash device, which
computes each of their MUL_MATs with vec_dot's bits per output whatever the batch
(csrc/kernels/kquant_gemm.h). With a dense FFN engine its lanes keep the FFN weights of the layers
they serve and compute their MUL_MATs the same way (csrc/lanes/dense_lane.h; the sparse lane's own
dots are per row anyway). Where every multiplied K-quant matrix of the model is computed so
(``all_rows_alone``), deterministic batches take up to ``eval_shapes.UNTILED_MAX_ROWS`` rows.

The weights are held once. Under a RAM budget, where llama.cpp maps the model file (its default),
the device reads each weight in place through its own mapping of the file: the same page-cache pages
the planner counts (reclaimable under the limit as before; an MoE's dense-part lock covers them). In
memory, and for an unmapped load, they are copied into the device's buffer (in memory measured
faster to decode from than the file's mapping, docs/SAME_ANSWERS.md) and a mapped source's pages are
dropped from the process; an MoE's dense-part lock then leaves them out (model_plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Set

from .. import _native
from ..errors import LlamaflashError
from .llama_settings import TINYBLAS_TYPES

if TYPE_CHECKING:
    from .model_plan import ModelPlan


def eligible_weights(header) -> List[str]:
    """Names of the weights whose MUL_MATs llamaflash computes row-invariantly under deterministic=True
    (the native rule, per tensor): begin_matmul_rows takes them, or a dense FFN engine serves them."""
    if header is None:
        return []
    return [t.name for t in header.tensors if _native.invariant_matmul_weight(t.name, t.ggml_type, list(t.shape))]


def _engine_ffn_weights(plan: "ModelPlan") -> Set[str]:
    """The FFN weights a dense engine serves (its lanes compute them; llama.cpp hands them to it)."""
    dense = plan.engine.dense if plan.engine is not None else None
    if dense is None:
        return set()
    return {n for spec in dense.layers for n in (spec.base_gate_name, spec.base_up_name, spec.base_down_name)}


def taken_weights(header, plan: Optional["ModelPlan"] = None) -> List[str]:
    """Names of the weights begin_matmul_rows takes from this model: the eligible ones but those a
    dense engine of ``plan`` serves."""
    served = _engine_ffn_weights(plan) if plan is not None else set()
    return [n for n in eligible_weights(header) if n not in served]


def reads_in_place(ram_budget_mb: Optional[float]) -> bool:
    """Whether the device reads the weights in place from the model file's mapping (under a budget:
    the pages the planner counts) rather than copying them (in memory)."""
    return ram_budget_mb is not None


def applies(deterministic: bool, plan: "ModelPlan") -> bool:
    """deterministic=True and some weight whose matmuls llamaflash computes row-invariantly."""
    return deterministic and bool(eligible_weights(plan.model.base.header))


def all_rows_alone(plan: "ModelPlan", routers_per_row: bool) -> bool:
    """True if every matrix the model multiplies by, of a type ggml-cpu tiles (not tinyBLAS's: those
    are judged by llama_settings.tinyblas_matrix), is eligible (begin_matmul_rows takes it, or a dense
    FFN engine's lanes compute it so) or, for an MoE,
    an expert tensor the expert lane computes row by row (``routers_per_row``: the deterministic lane).
    The token table counts only where it is also the output matrix."""
    header = plan.model.base.header
    taken = set(eligible_weights(header))
    names = {t.name for t in header.tensors}
    for t in header.tensors:
        if sum(1 for d in t.shape if d > 1) < 2 or t.ggml_type in TINYBLAS_TYPES or t.name in taken:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # read by rows (get_rows), not multiplied
        if t.name.endswith("_exps.weight") and routers_per_row:
            continue
        return False
    return True


def check_bound(llm, plan: "ModelPlan") -> None:
    """After the load: llama.cpp placed every weight begin_matmul_rows takes on the device (else closes
    and raises LlamaflashError: a model is never computed in part so)."""
    expected = len(taken_weights(plan.model.base.header, plan))
    bound = llm._matmul_rows.bound
    if bound != expected:
        llm.close()
        raise LlamaflashError(
            f"llama.cpp placed {bound} of the {expected} K-quant matmul weights of '{plan.model.path}' on the "
            "llamaflash device for deterministic=True; the model cannot run row-invariant. Check that llama_cpp "
            "was not given tensor overrides, or run with deterministic=False."
        )
