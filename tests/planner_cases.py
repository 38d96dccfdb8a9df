"""Synthetic format-2 sidecars with hand-set neuron frequencies, and the fixed set of planner inputs
whose plans ``tests/data/planner_plans.json`` records (``test_planner_plans.py`` compares the planner
against it; ``python tests/planner_cases.py --record`` rewrites it after a deliberate change).

A plan is summarized by :func:`plan_summary`: every field of ``OffloadPlan.to_dict`` but the paths
(the per-layer arrays as SHA-256 digests; reasons and notes as the lines of its ``explain()`` text); a refused budget by the
error's type and message.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.draft_copy import DraftCopyStage, draft_type
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.sparsity import LayerDecision, SparsityStage
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import LlamaflashError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import base_identity, read_base_model

MiB = 1 << 20
RECORDED = Path(__file__).resolve().parent / "data" / "planner_plans.json"


def write_v2_sidecar(
    model: Path,
    out: Path,
    freqs: dict[int, np.ndarray],
    orders: dict[int, np.ndarray] | None = None,
    draft_copy: bool = False,
) -> Path:
    """A format-2 sidecar of ``model`` whose neuron frequencies are ``freqs[layer]`` (base neuron order),
    bundles in ``orders[layer]`` (default identity), with the converter's automatic draft copy when
    ``draft_copy``."""
    info = read_base_model(model)
    decisions = {}
    for ffn in info.ffn_layers:
        order = (orders or {}).get(ffn.layer, np.arange(ffn.n_ff)).astype(np.int32)
        f = np.asarray(freqs[ffn.layer], dtype=np.float32)
        decisions[ffn.layer] = LayerDecision(
            layer=ffn.layer,
            level=0.5,
            threshold=0.1,
            sparsity=float(1 - f.mean()),
            ffn_rel_error=0.0,
            order=order,
            freq=f[order],
            mag=np.ones(ffn.n_ff, dtype=np.float32),
        )
    stage = SparsityStage(decisions)
    stages = [BundleStage(stage.orders), stage]
    if draft_copy:
        dtype = draft_type(info.n_embd)
        if dtype is None:
            raise ValueError(f"n_embd {info.n_embd} has no automatic draft type")
        stages.append(DraftCopyStage(stage.orders, dtype))
    plan = plan_sidecar(info, base_identity(model, info), stages)
    plan.set_string(fmt.KEY_SPARSITY_CRITERION, fmt.CRITERION_ACT_GATE)
    plan.set_string(fmt.KEY_SPARSITY_METHOD, fmt.SPARSITY_METHOD_FIXED)
    plan.set_string(fmt.KEY_BUNDLE_ORDER, fmt.BUNDLE_ORDER_BASE if orders is None else fmt.BUNDLE_ORDER_HOT)
    plan.set_float32(fmt.KEY_SPARSITY_TARGET, 0.5)
    return write_sidecar_atomically(plan, out)


def random_freqs(n_layer: int, n_ff: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Skewed per-neuron activation frequencies (Beta(0.3, 1.5)), one array per layer."""
    rng = np.random.default_rng(seed)
    return {i: rng.beta(0.3, 1.5, n_ff).astype(np.float32) for i in range(n_layer)}


#: The synthetic pairs: tiny-model parameters, frequency seed, bundle order, draft copy; and the RAM
#: budgets (MiB) their cases run at: from below the least budget (refused) through partly pinned
#: caches, streamed and resident gates, to everything pinned.
PAIRS: dict[str, dict[str, Any]] = {
    "base-order": dict(
        model=dict(n_layer=4, n_embd=256, n_ff=2048, weight_type="Q8_0"),
        seed=0,
        hot_order=False,
        draft_copy=False,
        budgets=(150, 164.5, 165, 166, 167, 168, 170, 172, 176, 180, 10_000),
        runtime_budgets=(200, 215, 230),
    ),
    "hot-order-draft": dict(
        model=dict(n_layer=6, n_embd=512, n_ff=4096, weight_type="Q8_0"),
        seed=1,
        hot_order=True,
        draft_copy=True,
        budgets=(180, 187, 188, 190, 194, 198, 202, 205, 210, 212, 218, 224, 234, 10_000),
        runtime_budgets=(230, 240, 250, 270),
    ),
}


def fast_disk() -> dict[str, Any]:
    """The built-in default disk with four times its IOPS, as a measured profile would be given."""
    from llamaflash.planning.planner import default_disk

    disk = default_disk()
    for point in disk["points"]:
        point["iops"] *= 4
    disk["source"] = "test disk, 4x the default"
    return disk


def cases(pair: str) -> list[dict[str, Any]]:
    """Planner inputs for :data:`PAIRS` entry ``pair`` (keyword arguments of plan_offload; ``disk``
    "fast" is :func:`fast_disk`)."""
    spec = PAIRS[pair]
    rt = dict(runtime_rss_bytes=40 * MiB)
    some = spec["budgets"][2:-1:3]
    return (
        [dict(ram_budget_mb=b, **rt) for b in spec["budgets"]]
        + [dict(ram_budget_mb=b) for b in spec["runtime_budgets"]]
        + [dict(ram_budget_mb=b, cluster_size=8, n_ubatch=32, **rt) for b in some]
        + [dict(ram_budget_mb=b, stream_gate=s, n_ubatch=32, **rt) for b in some for s in (True, False)]
        + [dict(ram_budget_mb=b, draft_copy=d, **rt) for b in some for d in (True, False)]
        + [dict(ram_budget_mb=b, prefetch_layers=p, **rt) for b in some for p in (0, 1, 3)]
        + [dict(ram_budget_mb=b, n_ctx=c, **rt) for b in some for c in (64, 256, 2048)]
        + [dict(ram_budget_mb=b, disk="fast", **rt) for b in some]
        + [dict(ram_budget_mb=b, disk="fast", cluster_size=4, prefetch_layers=1, **rt) for b in some]
    )


def make_pair(name: str, tiny_model_factory, directory: Path) -> tuple[Path, Path]:
    """``(model, sidecar)`` of :data:`PAIRS` entry ``name``, the sidecar written into ``directory``."""
    spec = PAIRS[name]
    model = tiny_model_factory(**spec["model"])
    m = spec["model"]
    freqs = random_freqs(m["n_layer"], m["n_ff"], spec["seed"])
    orders = (
        {i: np.argsort(-f, kind="stable").astype(np.int32) for i, f in freqs.items()} if spec["hot_order"] else None
    )
    return model, write_v2_sidecar(model, directory / f"{name}.flash.gguf", freqs, orders, spec["draft_copy"])


def _plain(value: Any) -> Any:
    """JSON-able, floats rounded to 12 significant digits (the comparison is of the recorded text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(f"{float(value):.12g}")
    return value


def plan_summary(model: Path, sidecar: Path, case: dict[str, Any]) -> dict[str, Any]:
    """The plan of ``case`` for the pair, as a JSON-able dict without paths (or the refusal)."""
    from llamaflash.planning.planner import plan_offload

    kw = dict(case)
    if kw.get("disk") == "fast":
        kw["disk"] = fast_disk()
    budget = kw.pop("ram_budget_mb")
    try:
        plan = plan_offload(model, sidecar, budget, **kw)
    except LlamaflashError as e:
        message = str(e).replace(str(sidecar), "<sidecar>").replace(str(model), "<model>")
        return {"error": type(e).__name__, "message": message.replace(Path(model).name, "<model>")}
    d = plan.to_dict(arrays=False)
    for name in ("hot_clusters", "cluster_prob"):  # digests of the per-layer arrays (kept out of the record)
        text = json.dumps(_plain(getattr(plan, name)))
        d[f"{name}_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    for name in ("model_path", "sidecar_path", "reasons", "notes"):  # reasons and notes: lines of explain()
        d.pop(name)
    text = plan.explain().replace(str(model), "<model>").replace(str(sidecar), "<sidecar>")
    return _plain({**d, "explain": text.splitlines()})


def record(tiny_model_factory, directory: Path) -> dict[str, list[dict[str, Any]]]:
    """The summary of every :func:`cases` entry of every :data:`PAIRS` entry."""
    out = {}
    for name in PAIRS:
        model, sidecar = make_pair(name, tiny_model_factory, directory)
        out[name] = [{"case": case, "plan": plan_summary(model, sidecar, case)} for case in cases(name)]
    return out


def _main() -> None:
    import tempfile

    from synth import TinyModelSpec, write_tiny_llama

    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {sys.argv[0]} --record   (rewrites {RECORDED})")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def factory(**params) -> Path:
            spec = TinyModelSpec(**params)
            return write_tiny_llama(root / f"{spec.file_stem}.gguf", spec)

        data = record(factory, root)
    RECORDED.parent.mkdir(exist_ok=True)
    lines = ",\n".join(
        f"  {json.dumps(name)}: [\n" + ",\n".join(json.dumps(row, sort_keys=True) for row in rows) + "]"
        for name, rows in data.items()
    )
    RECORDED.write_text("{\n" + lines + "\n}\n")  # one line per case
    print(f"wrote {RECORDED}")


if __name__ == "__main__":
    _main()
