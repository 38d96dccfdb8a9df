"""The speed-memory sweep (bench/lab/sweep.py, `llamaflash bench MODEL --sweep`): the ladder, the
planner's predictions alone where nothing can be measured, an interrupted sweep that keeps its points
and resumes where it stopped, no cgroup and no private copy left behind, and a smoke run on SmolLM2
(two budgets, a few tokens: it proves the harness, not a speed)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llamaflash.bench import cgroups, memlimit, memlimit_report, sweep, sweep_report
from llamaflash.cli.cli import main

SMALL = dict(n_prompt=16, n_gen=4, n_ctx=64, n_batch=64, reps=1, quiet_wait_s=0, timeout_s=120, prompt_set=None)


def test_ladder_runs_from_the_least_budget_past_the_top():
    assert sweep.ladder(176.3, 400, 4) == [180, 250, 330, 400]
    assert sweep.ladder(700, 1385, 9)[0] == 700 and sweep.ladder(700, 1385, 9)[-1] == 1390
    two = sweep.ladder(100, 101, 2)
    assert two == sorted(set(two)) and len(two) == 2


def test_monotone_violations_name_the_budgets():
    view = {
        "budgets": {
            "700": {"nospec_tok_s": 2.0},
            "800": {"nospec_tok_s": 2.5},
            "900": {"nospec_tok_s": 2.4},
            "1000": {"nospec_tok_s": None},
            "1100": {"nospec_tok_s": 3.0},
        }
    }
    assert sweep.monotone_violations(view, ("nospec_tok_s",)) == [
        {"key": "nospec_tok_s", "budget_mb": 900, "value": 2.4, "smaller_budget_mb": 800, "smaller_value": 2.5}
    ]


def test_without_cgroups_the_sweep_predicts_only(converted, tmp_path):  # noqa: F811
    model, sidecar = converted
    opts = sweep.SweepOptions(model=str(model), sidecar=str(sidecar), points=3, use_cgroup=False, **SMALL)
    lines: list[str] = []
    payload = sweep.run_sweep(opts, tmp_path / "s.json", echo=lines.append)
    assert payload["measured"] is False and payload["runs"] == []
    assert "simd" in payload["machine"]  # the CPU's SIMD sets: the kernels' speed depends on them
    assert any("PREDICTIONS only" in ln for ln in lines)
    view = payload["predictions"]
    budgets = payload["identity"]["budgets_mb"]
    assert len(budgets) == 3 and budgets[0] >= view["least_mb"]
    assert budgets[-1] >= sweep.TOP_STOCK_NEED_RATIO * view["stock_need_mb"] - sweep.LADDER_STEP_MB
    assert view["budgets"][str(budgets[-1])]["lane"] == "stock"  # past what stock keeps resident
    table = sweep_report.format_table(payload)
    assert "PREDICTIONS ONLY" in table and "predicted nospec" in table
    assert json.loads((tmp_path / "s.json").read_text())["complete"] is True


def test_the_command_line_sweep_says_what_it_could_not_measure(converted, tmp_path, monkeypatch):  # noqa: F811
    model, sidecar = converted
    monkeypatch.setattr(memlimit_report, "_pyplot", lambda: None)  # as without matplotlib
    out = CliRunner().invoke(
        main,
        [
            "bench",
            str(model),
            "--sweep",
            "--no-cgroup",
            "--points",
            "2",
            "--sidecar",
            str(sidecar),
            "--n-gen",
            "4",
            "--prompt-tokens",
            "16",
            "--prompt-set",
            "text",
            "--json",
            str(tmp_path / "c.json"),
        ],
    )
    assert out.exit_code == 0, out.output
    assert "PREDICTIONS ONLY" in out.output and sweep_report.PLOT_NEEDS in out.output
    again = CliRunner().invoke(
        main,
        [
            "bench",
            str(model),
            "--sweep",
            "--no-cgroup",
            "--points",
            "2",
            "--sidecar",
            str(sidecar),
            "--json",
            str(tmp_path / "c.json"),
        ],
    )
    assert again.exit_code == 2 and "--resume" in again.output


def _fake_result(spec, limit):
    tps = {"stock": 1.0, "llamaflash": 2.0, "llamaflash-nospec": 1.9}[spec["config"]] * limit / 100
    return {
        "ok": True,
        "status": "ok",
        "config": spec["config"],
        "rep": spec["rep"],
        "limit_mb": limit,
        "decode_tps": tps,
        "prefill_tps": 10.0,
        "n_gen_done": 4,
        "tokens": [1, 2, 3, 4, 5],
        "flash_mode": "offload" if spec["config"] != "stock" else None,
    }


def test_an_interrupted_sweep_keeps_its_points_and_resumes(converted, tmp_path, monkeypatch):  # noqa: F811
    model, sidecar = converted
    monkeypatch.setattr(memlimit, "memory_cgroup_support", lambda: (True, "fake"))
    copies = tmp_path / "copies"

    def opts():
        return sweep.SweepOptions(
            model=str(model),
            sidecar=str(sidecar),
            budgets_mb=[300, 200],
            private_copy_dir=str(copies),
            **SMALL,
        )

    calls = []

    def interrupting(spec, limit, files, timeout):
        calls.append((limit, spec["config"]))
        assert all(str(copies) in str(f) for f in files)  # the runs see the private copies
        if len(calls) == 3:
            raise KeyboardInterrupt
        return _fake_result(spec, limit)

    path = tmp_path / "sweep.json"
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(opts(), path, runner=interrupting, echo=lines.append)
    kept = json.loads(path.read_text())
    assert len(kept["runs"]) == 2 and kept["complete"] is False
    assert any("--resume" in ln for ln in lines)
    assert list(copies.iterdir()) == []  # the copies this sweep made are gone
    with pytest.raises(FileExistsError):
        sweep.run_sweep(opts(), path, runner=interrupting)
    other = opts()
    other.n_gen = 5
    with pytest.raises(ValueError, match="another sweep.*n_gen"):
        sweep.run_sweep(other, path, resume=True, runner=interrupting)
    resumed = []

    def recording(spec, limit, files, timeout):
        resumed.append((limit, spec["config"]))
        return _fake_result(spec, limit)

    payload = sweep.run_sweep(opts(), path, resume=True, runner=recording)
    assert len(resumed) == 4 and not set(resumed) & set(calls[:2])  # only the points it lacked
    assert payload["complete"] and len({sweep.run_key(r) for r in payload["runs"]}) == 6
    assert list(copies.iterdir()) == []
    rows = sweep_report.curve(payload)
    assert [c["budget_mb"] for c in rows] == [200, 300]
    assert rows[0]["x_stock"] == pytest.approx(2.0) and rows[0]["x_nospec"] == pytest.approx(2 / 1.9)
    assert rows[0]["same_tokens"] is True
    table = sweep_report.format_table(payload)
    assert "x stock" in table and "PREDICTIONS ONLY" not in table
    if memlimit_report._pyplot() is not None:
        assert sweep_report.write_plot(tmp_path / "s.png", payload).stat().st_size > 0


def _groups_of_this_process() -> list[Path]:
    mount = cgroups._v1_mount("memory")
    if mount is None:
        return []
    return [p for p in mount.rglob(f"llamaflash-bench-{os.getpid()}-*") if p.is_dir()]


@pytest.mark.skipif(not memlimit.memory_cgroup_support()[0], reason="needs root and cgroup v1 memory groups")
def test_an_interrupt_inside_a_run_leaves_no_cgroup(converted, tmp_path):  # noqa: F811
    model, sidecar = converted
    before = _groups_of_this_process()

    def interrupted_inside(spec, limit, files, timeout):
        # the run itself is interrupted (as by Ctrl-C) while its process is inside the cgroup
        code = "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(30)"
        return cgroups.run_in_cgroup([sys.executable, "-c", code], limit, timeout=60).__dict__

    opts = sweep.SweepOptions(model=str(model), sidecar=str(sidecar), budgets_mb=[300], configs=["stock"], **SMALL)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep.run_sweep(opts, tmp_path / "i.json", runner=interrupted_inside, echo=lambda s: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _groups_of_this_process() == before


@pytest.mark.skipif(not memlimit.memory_cgroup_support()[0], reason="needs root and cgroup v1 memory groups")
def test_smoke_sweep_on_smollm2(smollm2_sidecar, tmp_path):
    """Two budgets (the planner's least and one past what stock keeps mapped), three configs, the
    chat set with four tokens per prompt: every run ends ok, the speculative and non-speculative tokens
    agree, the predictions are beside the measurements. Not a speed measurement."""
    model, sidecar = smollm2_sidecar
    view = sweep.predict(model, sidecar, [], 256)
    budgets = [int(view["least_mb"]) + 12, int(view["stock_need_mb"]) + 40]
    opts = sweep.SweepOptions(
        model=str(model),
        sidecar=str(sidecar),
        budgets_mb=budgets,
        **{**SMALL, "n_ctx": 256, "n_batch": 256, "prompt_set": "chat", "timeout_s": 600},
    )
    payload = sweep.run_sweep(opts, tmp_path / "smoke.json", echo=lambda s: None)
    assert [r["status"] for r in payload["runs"]] == ["ok"] * 6, [r.get("error") for r in payload["runs"]]
    rows = sweep_report.curve(payload)
    # read into memory (use_mmap=False), SmolLM2-135M needs less than the least offload plan: both
    # budgets run stock, and the run at the least one (a real cgroup) shows that need holds
    lanes = [
        view_b["lane"] for view_b in (sweep.predict(model, sidecar, budgets, 256)["budgets"][str(b)] for b in budgets)
    ]
    assert [c["lane"] for c in rows] == lanes == ["stock", "stock"]
    assert all(c["same_tokens"] for c in rows)
    assert rows[0]["predicted"]["llamaflash-nospec"] is not None
    flash = [r for r in payload["runs"] if r["config"] == "llamaflash"]
    assert {r["limit_mb"]: r["flash_mode"] for r in flash} == {budgets[0]: "stock", budgets[1]: "stock"}
    sweep_report.report(payload, tmp_path / "smoke.json", tmp_path / "smoke.png", echo=lambda s: None)


# --------------------------------------------------------------------------------------------
# a mixture-of-experts model


@pytest.fixture(scope="module")
def moe_pair(tiny_moe_factory, tmp_path_factory) -> tuple[Path, Path]:
    """``(model, sidecar)``: a synthetic qwen3moe whose routed experts (204 MiB) outweigh the planner's
    margin, so that its ladder has budgets where llamaflash serves experts and budgets where it runs
    stock, and its expert sidecar (no routing statistics: uniform routing predicted); read-only."""
    import shutil

    from llamaflash.converters.pipeline import convert

    d = tmp_path_factory.mktemp("moe-sweep")
    model = d / "moe.gguf"
    shutil.copyfile(tiny_moe_factory("qwen3moe", n_layer=4, n_expert=64, n_ff_exp=4096), model)
    convert(model, force=True, progress=False, profile=False)
    return model, model.with_name("moe.flash.gguf")


def test_moe_predictions_follow_the_expert_plan(moe_pair):
    import math

    from llamaflash.errors import RamBudgetError
    from llamaflash.files import expert_sidecar
    from llamaflash.files.experts import read_moe_model
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.planning import disk_probe, expert_plan
    from llamaflash.planning.plan_disk import default_disk

    model, sidecar = moe_pair
    header = read_gguf_header(model)
    moe = read_moe_model(header)
    disk = disk_probe.saved_profile(sidecar)
    view = sweep.predict(model, sidecar, [], 512, disk)
    assert view["kind"] == "moe" and view["routing_tokens"] == 0
    least = math.ceil(view["least_mb"])
    with pytest.raises(RamBudgetError, match=f"minimum for this model \\({least} MiB"):
        expert_plan.plan_experts(moe, header, least - 1, n_ctx=512, disk=default_disk())
    budgets = sweep.default_budgets(model, sidecar, 6, 512, disk)
    assert budgets[0] >= view["least_mb"] and budgets[0] - view["least_mb"] < sweep.LADDER_STEP_MB
    top = max(sweep.TOP_MODEL_RATIO * model.stat().st_size / 2**20, sweep.TOP_STOCK_NEED_RATIO * view["stock_need_mb"])
    assert budgets[-1] >= top - sweep.LADDER_STEP_MB
    view = sweep.predict(model, sidecar, [least - 1, *budgets], 512, disk)
    below = view["budgets"][str(least - 1)]
    assert below["refused"] and "minimum" in below["refused"] and below["lane"] is None
    points = [view["budgets"][str(b)] for b in budgets]
    lanes = [p["lane"] for p in points]
    assert lanes[0] == "experts" and lanes[-1] == "stock" and not any(p["refused"] for p in points)
    assert lanes == sorted(lanes, key=("experts", "stock").index)  # experts below, stock above
    info = expert_sidecar.read_expert_sidecar(sidecar)
    assert info.routing_tokens == 0
    for b, p in zip(budgets, points):
        if p["lane"] == "stock":
            assert p["hit_rate"] is None and p["io_bound_tok_s"] is None and p["note"]
            continue
        plan = expert_plan.plan_experts(moe, header, b, n_ctx=512, disk=disk or default_disk())
        assert not plan.fits
        assert p["hit_rate"] == pytest.approx(1 - plan.miss_rate)
        assert p["flash_bytes_per_token"] == pytest.approx(plan.read_bytes_per_token)
        assert p["io_bound_tok_s"] == pytest.approx(plan.predicted_tok_s)
        assert p["slots_per_layer"] == plan.n_slots and p["nospec_tok_s"] is None
    experts = [p for p in points if p["lane"] == "experts"]
    assert [p["hit_rate"] for p in experts] == sorted(p["hit_rate"] for p in experts)  # more slots, more hits
    assert sweep.monotone_violations(view) == []


def test_moe_sweep_defaults_to_the_moe_configs(moe_pair, converted, tmp_path):  # noqa: F811
    from llamaflash.bench import sweep_moe

    model, sidecar = moe_pair
    assert sweep_moe.MOE_CONFIGS == ("stock-norepack", "stock", "llamaflash-nospec")
    assert sweep_moe.default_configs(model) == sweep_moe.MOE_CONFIGS
    assert sweep_moe.default_configs(converted[0]) == sweep.CONFIGS
    opts = sweep.SweepOptions(model=str(model), points=3, use_cgroup=False, **SMALL)
    payload = sweep.run_sweep(opts, tmp_path / "moe.json", echo=lambda s: None)
    assert payload["identity"]["configs"] == list(sweep_moe.MOE_CONFIGS)
    assert payload["moe"]["n_expert"] == 64 and payload["moe"]["disk"]["disk_mb_s"] > 0
    table = sweep_report.format_table(payload)
    assert "PREDICTIONS ONLY" in table and "predicted hit" in table and "experts" in table
    mine = sweep.SweepOptions(model=str(model), points=3, use_cgroup=False, configs=["stock-norepack"], **SMALL)
    assert sweep.run_sweep(mine, tmp_path / "mine.json", echo=lambda s: None)["identity"]["configs"] == [
        "stock-norepack"
    ]


def _fake_moe_result(spec, limit):
    """A worker result for an MoE sweep: stock (repacking) OOM-killed below 300 MiB; llamaflash-nospec
    serving experts with a hit rate that grows with the budget."""
    config = spec["config"]
    if config == "stock" and limit < 300:
        return {
            "ok": False,
            "status": "OOM",
            "config": config,
            "rep": spec["rep"],
            "limit_mb": limit,
            "died_in": "load",
        }
    r = {
        "ok": True,
        "status": "ok",
        "config": config,
        "rep": spec["rep"],
        "limit_mb": limit,
        "decode_tps": {"stock-norepack": 1.0, "stock": 1.5, "llamaflash-nospec": 4.0}[config],
        "prefill_tps": 10.0,
        "n_gen_done": 4,
        "tokens": [1, 2, 3, 4],
    }
    if config == "llamaflash-nospec":
        hit = limit / 1000
        r["flash_mode"] = "experts"
        r["flash_stats"] = {
            "experts": {
                "hit_rate": hit,
                "bytes_read_per_token": (1 - hit) * 8e6,
                "io_wait_per_token_s": 0.002,
                "slots_per_layer": 10,
                "pinned_per_layer": 0,
                "predicted_miss_rate": 1 - hit,
                "prefetch_recall": None,
                "prefetch_waste": None,
            }
        }
    return r


def test_moe_sweep_reports_hit_rate_and_io_bound(moe_pair, tmp_path, monkeypatch):
    model, sidecar = moe_pair
    monkeypatch.setattr(memlimit, "memory_cgroup_support", lambda: (True, "fake"))
    opts = sweep.SweepOptions(model=str(model), budgets_mb=[260, 320], **SMALL)
    lines: list[str] = []
    payload = sweep.run_sweep(
        opts,
        tmp_path / "moe.json",
        runner=lambda spec, limit, files, t: _fake_moe_result(spec, limit),
        echo=lines.append,
    )
    assert any("OOM" in ln for ln in lines) and any("expert hit rate 0.26" in ln for ln in lines)
    disk_mb_s = payload["moe"]["disk"]["disk_mb_s"]
    saved = json.loads((tmp_path / "moe.json").read_text())
    row = next(r for r in saved["summary"] if r["limit_mb"] == 260 and r["config"] == "llamaflash-nospec")
    assert row["experts"]["hit_rate"] == pytest.approx(0.26)
    assert row["io_bound_tps"] == pytest.approx(disk_mb_s * 1e6 / (0.74 * 8e6))
    assert row["of_io_bound"] == pytest.approx(4.0 / row["io_bound_tps"])
    stock = next(r for r in saved["summary"] if r["limit_mb"] == 260 and r["config"] == "stock")
    assert stock["status"].startswith("OOM") and stock["experts"] is None
    points = sweep_report.curve(payload)
    low = points[0]
    assert low["flash_config"] == "llamaflash-nospec" and low["stock_oom"]
    assert low["x_norepack"] == pytest.approx(4.0) and low["x_stock"] == float("inf")
    assert low["same_tokens"] is True and low["experts"]["io_wait_per_token_s"] == pytest.approx(0.002)
    assert low["predicted_hit_rate"] == payload["predictions"]["budgets"]["260"]["hit_rate"]
    assert points[1]["x_stock"] == pytest.approx(4.0 / 1.5)
    table = sweep_report.format_table(payload)
    head, rule, first = table.splitlines()[:3]
    assert "hit" in head and "MB/tok" in head and "wait ms/tok" in head and "I/O bound" in head
    assert "OOM" in first and "0.260" in first and "5.92" in first and "2.0" in first  # hit, MB/tok, wait ms
    assert f"{disk_mb_s:.0f} MB/s" in table
    if memlimit_report._pyplot() is not None:
        assert sweep_report.write_plot(tmp_path / "moe.png", payload).stat().st_size > 0


@pytest.mark.skipif(not memlimit.memory_cgroup_support()[0], reason="needs root and cgroup v1 memory groups")
def test_smoke_sweep_on_a_tiny_moe(moe_pair, tmp_path):
    """Two budgets in the experts lane, the three MoE configs, one text prompt and four tokens: stock
    (repacking) ends ok or OOM-killed, stock-norepack and llamaflash-nospec end ok with the same
    tokens, and llamaflash served experts (its hit rate and I/O bound in the table). Not a speed
    measurement."""
    model, sidecar = moe_pair
    least = sweep.predict(model, sidecar, [], 256)["least_mb"]
    budgets = [int(least) + 10, int(least) + 40]
    opts = sweep.SweepOptions(model=str(model), budgets_mb=budgets, **{**SMALL, "n_ctx": 256, "n_batch": 256})
    payload = sweep.run_sweep(opts, tmp_path / "moe.json", echo=lambda s: None)
    status = {(r["limit_mb"], r["config"]): r["status"] for r in payload["runs"]}
    assert len(status) == 6, status
    assert all(s in ("ok", "OOM") for (_, c), s in status.items() if c == "stock"), status
    assert all(s == "ok" for (_, c), s in status.items() if c != "stock"), [r.get("error") for r in payload["runs"]]
    for c in sweep_report.curve(payload):
        assert c["lane"] == "experts" and c["same_tokens"] is True
        assert c["experts"]["hit_rate"] is not None and c["experts"]["bytes_read_per_token"] > 0
        assert c["io_bound_tps"] > 0
    sweep_report.report(payload, tmp_path / "moe.json", tmp_path / "moe.png", echo=lambda s: None)
