"""The memory-limit benchmark harness (llamaflash.bench.memlimit and its report, memlimit_report;
`llamaflash bench`): page-cache eviction, cgroup groups and limits, OOM / timeout / error
classification, summary, table, JSON, plot.

Cgroup tests need root and a cgroup v1 memory controller and are skipped (saying why) without them.
One end-to-end run uses a tiny synthetic model, never a real one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llamaflash.bench import memlimit, memlimit_report
from llamaflash.cli.cli import EXIT_LLAMAFLASH_ERROR, main

MiB = memlimit.MiB

_SUPPORT = memlimit.memory_cgroup_support()
needs_cgroup = pytest.mark.skipif(not _SUPPORT[0], reason=f"memory cgroups unusable here: {_SUPPORT[1]}")


def _cached_file(path: Path, size: int) -> Path:
    """A file of ``size`` bytes, written, synced (clean pages can be evicted) and read back into the cache."""
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    return path


# --------------------------------------------------------------------------------------------
# page cache


def test_eviction_empties_the_page_cache(tmp_path):
    path = _cached_file(tmp_path / "data.bin", 16 * MiB)
    assert memlimit.resident_bytes(path) >= 15 * MiB  # read back: cached
    [ev] = memlimit.evict_files([path])
    assert ev["evicted"] and ev["bytes"] == 16 * MiB
    assert ev["resident_before"] >= 15 * MiB
    assert memlimit.resident_bytes(path) <= memlimit.EVICT_TOLERANCE_BYTES
    assert ev["resident_after"] == memlimit.resident_bytes(path)


def test_eviction_reports_pages_another_mapping_keeps(tmp_path):
    import mmap

    path = _cached_file(tmp_path / "mapped.bin", 16 * MiB)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))  # fault every page into this mapping
        [ev] = memlimit.evict_files([path], attempts=1)
        assert not ev["evicted"] and ev["resident_after"] > memlimit.EVICT_TOLERANCE_BYTES
    memlimit.evict(path)
    assert memlimit.resident_bytes(path) <= memlimit.EVICT_TOLERANCE_BYTES  # unmapped: evictable again


def test_private_copies_are_evictable_and_reused(tmp_path):
    src = _cached_file(tmp_path / "model.gguf", 8 * MiB)
    copies, created = memlimit.private_copies([src], tmp_path / "copies")
    assert copies == created == [tmp_path / "copies" / "model.gguf"]
    assert copies[0].read_bytes() == src.read_bytes()
    assert memlimit.evict_files(copies)[0]["evicted"]  # synced: clean pages, evictable
    again, created = memlimit.private_copies([src], tmp_path / "copies")
    assert again == copies and created == []


def test_resident_bytes_of_an_empty_file(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert memlimit.resident_bytes(tmp_path / "empty") == 0


# --------------------------------------------------------------------------------------------
# cgroups


@needs_cgroup
def test_cgroup_create_limit_and_remove():
    cg = memlimit.MemoryCgroup.create(64 * MiB)
    try:
        assert cg.path.is_dir() and cg.path.name.startswith("llamaflash-bench-")
        assert cg.limit_bytes == 64 * MiB
        stats = cg.stats()
        assert stats["limit_bytes"] == 64 * MiB and stats["oom_kill"] == 0 and cg.pids() == []
    finally:
        assert cg.remove()
    assert not cg.path.exists()


@needs_cgroup
def test_process_runs_inside_the_group_and_is_charged():
    code = "import sys; b = bytearray(24 << 20); b[::4096] = b'x' * len(b[::4096]); print(open('/proc/self/cgroup').read())"
    oc = memlimit.run_in_cgroup([sys.executable, "-c", code], 128, timeout=60)
    assert oc.status == "ok", oc.stderr
    assert "llamaflash-bench-" in oc.stdout  # it was in the fresh group
    assert oc.cgroup["limit_bytes"] == 128 * MiB
    assert 24 * MiB <= oc.cgroup["max_usage_bytes"] <= 128 * MiB
    assert oc.cgroup["oom_kill"] == 0
    group = next(ln.split(":", 2)[2] for ln in oc.stdout.splitlines() if ":memory:" in ln)
    assert not Path("/sys/fs/cgroup/memory" + group).exists()  # removed after the run


@needs_cgroup
def test_oom_kill_is_reported_not_raised():
    code = "b = []\nwhile True: b.append(bytearray(8 << 20))"  # grows past any limit
    oc = memlimit.run_in_cgroup([sys.executable, "-c", code], 64, timeout=60)
    assert oc.status == "OOM"
    assert oc.returncode == -signal.SIGKILL and oc.signal == "SIGKILL"
    assert oc.cgroup["oom_kill"] >= 1
    assert oc.cgroup["max_usage_bytes"] <= 64 * MiB + 1 * MiB


@needs_cgroup
def test_timeout_and_error_statuses():
    oc = memlimit.run_in_cgroup([sys.executable, "-c", "import time; time.sleep(60)"], 128, timeout=1.0)
    assert oc.status == "timeout" and oc.wall_s < 30
    oc = memlimit.run_in_cgroup([sys.executable, "-c", "import sys; sys.exit(3)"], 128, timeout=60)
    assert oc.status == "error" and oc.returncode == 3


@needs_cgroup
def test_blkio_counts_reads_and_eviction_happens_before_the_run(tmp_path):
    path = _cached_file(tmp_path / "payload.bin", 32 * MiB)
    code = f"f = open({str(path)!r}, 'rb')\nwhile f.read(1 << 20): pass"
    oc = memlimit.run_in_cgroup([sys.executable, "-c", code], 256, timeout=60, evict_paths=[path], blkio_file=path)
    assert oc.status == "ok", oc.stderr
    assert oc.eviction[0]["evicted"] and oc.eviction[0]["resident_before"] >= 31 * MiB
    if oc.blkio_read_bytes is None:
        pytest.skip(f"blkio accounting unavailable: {oc.notes}")
    assert oc.blkio_read_bytes >= 30 * MiB  # the evicted file came from the disk
    # its page cache was charged to the group
    assert oc.cgroup["max_usage_bytes"] >= 30 * MiB


@needs_cgroup
def test_run_one_reports_an_oom_killed_worker(monkeypatch, tmp_path):
    from llamaflash.bench import benchkit

    # a stand-in worker: says it loaded (with its budget) and prefilled, then outgrows the limit
    lines = [{"phase": "loaded", "t": 0.1, "ram_budget": {"requested_mb": 64, "applied": False}, "flash_mode": "dense"},
             {"phase": "prefilled", "t": 0.2, "VmHWM_kb": 20480}]  # fmt: skip
    code = ("import json, sys\n"
            + "".join(f"print({benchkit.PROGRESS_MARK + json.dumps(x)!r}, flush=True)\n" for x in lines)
            + "b = []\nwhile True: b.append(bytearray(8 << 20))\n")  # fmt: skip
    monkeypatch.setattr(benchkit, "worker_command", lambda spec: [sys.executable, "-c", code])
    f = _cached_file(tmp_path / "model.gguf", 1 * MiB)
    r = memlimit.run_one({"config": "llamaflash", "rep": 0}, 64, [f], timeout=60)
    assert r["status"] == "OOM" and not r["ok"] and r["signal"] == "SIGKILL"
    assert r["died_in"] == "decode" and r["vm_hwm_mb"] == 20.0
    assert r["ram_budget"]["applied"] is False and r["flash_mode"] == "dense"
    assert r["cgroup"]["oom_kill"] >= 1 and r["limit_mb"] == 64
    assert "OOM in decode" in memlimit._run_line(r)


def test_no_limit_runs_without_a_group():
    oc = memlimit.run_in_cgroup([sys.executable, "-c", "print('hi')"], None, timeout=60)
    assert oc.status == "ok" and oc.cgroup is None and oc.stdout.strip() == "hi"


@pytest.mark.parametrize(
    "returncode, timed_out, oom_kills, failed, expected",
    [
        (0, False, 0, False, "ok"),
        (0, False, 0, True, "error"),
        (1, False, 0, False, "error"),
        (-9, False, 1, False, "OOM"),
        (-9, False, 0, False, "killed"),
        (-11, False, 0, False, "killed"),
        (-9, True, 0, False, "timeout"),
    ],
)
def test_classify(returncode, timed_out, oom_kills, failed, expected):
    assert memlimit.classify(returncode, timed_out, oom_kills, failed) == expected


# --------------------------------------------------------------------------------------------
# summary, table, JSON, plot


def _run(config, limit, rep, status="ok", decode=10.0, tokens=(1, 2, 3, 4), budget=None, died_in=None, **kw):
    r = {"ok": status == "ok", "status": status, "config": config, "limit_mb": limit, "rep": rep}
    if status == "ok":
        r.update({"prefill_tps": 50.0, "decode_tps": decode, "ttft_s": 4.0, "load_s": 1.0, "cg_peak_mb": limit or 900,
                  "vm_hwm_mb": 800.0, "n_gen_done": len(tokens) - 1, "tokens": list(tokens), "foreign_cpu": 0.01,
                  "blkio_read_bytes": 1200 * MiB, "read_bytes_phases": {"decode": 300 * MiB},
                  "evict_residual_mb": 0.0, "flash_mode": "dense" if budget is not None else None})  # fmt: skip
        if budget is not None:
            r["ram_budget"] = {"requested_mb": limit, "applied": budget, "fallback_flash_mode": "dense"}
    else:
        r["died_in"] = died_in
    r.update(kw)
    return r


def _payload(rows, runs):
    return {
        "benchmark": "memlimit",
        "options": {"threads": 2},
        "model": {"name": "tiny"},
        "summary": rows,
        "runs": runs,
    }


def test_summary_table_and_json(tmp_path):
    runs = [
        _run("stock", 1400, 0, decode=28.0), _run("llamaflash", 1400, 0, decode=27.0, budget=False),
        _run("stock", 1400, 1, decode=30.0), _run("llamaflash", 1400, 1, decode=26.0, budget=False),
        _run("stock", 900, 0, decode=1.0, tokens=(1, 2, 3)), _run("llamaflash", 900, 0, decode=0.8, tokens=(1, 2, 9), budget=False),
        _run("stock", 700, 0, status="OOM", died_in="load"),
        _run("llamaflash", 700, 0, status="OOM", died_in="decode", ram_budget={"requested_mb": 700, "applied": False}),
        _run("stock", 700, 1, status="OOM", died_in="load"), _run("llamaflash", 700, 1, status="timeout"),
    ]  # fmt: skip
    rows = memlimit.summarize(runs, ["stock", "llamaflash"], [1400, 900, 700])
    by = {(r["limit_mb"], r["config"]): r for r in rows}
    assert len(rows) == 6
    assert by[1400, "stock"]["decode_tps"] == 29.0 and by[1400, "stock"]["decode_x_stock"] == 1.0
    assert by[1400, "llamaflash"]["decode_x_stock"] == pytest.approx(26.5 / 29.0)
    assert by[1400, "llamaflash"]["budget_applied"] is False
    assert by[900, "stock"]["n_gen_done"] == 2 and by[900, "stock"]["greedy_agree"] == 1.0  # prefix of the ref
    assert (
        by[900, "llamaflash"]["greedy_agree"] == pytest.approx(2 / 3) and by[900, "llamaflash"]["first_divergence"] == 2
    )
    assert by[1400, "stock"]["read_mb"] == 1200 and by[1400, "stock"]["decode_read_mb_per_tok"] == 100
    assert by[700, "stock"]["status"] == "OOM (load)" and by[700, "stock"]["decode_tps"] is None
    assert by[700, "stock"]["counts"]["OOM"] == 2
    assert by[700, "llamaflash"]["status"] == "1 OOM, 1 timeout"
    assert by[700, "llamaflash"]["budget_applied"] is False  # known from the progress of a run that died

    table = memlimit.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["limit", "MB", "config"]
    assert any(ln.startswith("700") and "OOM (load)" in ln for ln in lines)
    assert "llamaflash*" in table and "ram_budget_mb is not implemented" in table
    assert "29.00" in table and "0.91" in table

    out = memlimit.write_json(tmp_path / "r.json", _payload(rows, runs))
    back = json.loads(out.read_text())
    assert back["summary"][0]["decode_tps"] == 29.0 and len(back["runs"]) == 10


def test_table_flags_unevicted_files_and_missing_limits():
    runs = [_run("stock", None, 0, evict_residual_mb=300.0)]
    rows = memlimit.summarize(runs, ["stock"], [None])
    table = memlimit.format_table(rows)
    assert table.splitlines()[2].startswith("none")
    assert "another process maps the file" in table and "without any memory limit" in table


def test_plot_or_a_clear_message(tmp_path, monkeypatch):
    runs = [_run("stock", 1400, 0, decode=28.0), _run("stock", 900, 0, decode=1.0), _run("stock", 700, 0, status="OOM")]
    payload = _payload(memlimit.summarize(runs, ["stock"], [1400, 900, 700]), runs)
    lines: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(memlimit_report, "_pyplot", lambda: None)  # as if matplotlib were not installed
        memlimit.report(payload, tmp_path / "a.json", tmp_path / "a.png", echo=lines.append)
    assert (tmp_path / "a.json").is_file() and not (tmp_path / "a.png").exists()
    assert any("matplotlib is not installed" in ln for ln in lines)
    assert any("OOM" in ln for ln in lines)
    pytest.importorskip("matplotlib")
    png = memlimit.write_plot(tmp_path / "b.png", payload)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_benchmark_at_a_time(tmp_path):
    lock = tmp_path / "bench.lock"
    lines: list[str] = []
    with memlimit.bench_lock(lock, echo=lines.append):
        assert lock.read_text() == str(os.getpid())
        with pytest.raises(TimeoutError, match="still held"):
            with memlimit.bench_lock(lock, wait_s=0.2, echo=lines.append):
                pass  # pragma: no cover
    assert any("waiting for it to finish" in ln for ln in lines)
    with memlimit.bench_lock(lock, wait_s=0.2, echo=lines.append):  # released
        pass


def test_options_validation():
    with pytest.raises(ValueError, match="no memory limits"):
        memlimit.BenchOptions(model="m", limits_mb=[]).validate()
    with pytest.raises(ValueError, match="duplicate"):
        memlimit.BenchOptions(model="m", limits_mb=[900], configs=["stock", "stock"]).validate()
    with pytest.raises(ValueError, match="n_ctx"):
        memlimit.BenchOptions(model="m", limits_mb=[900], n_prompt=500, n_gen=64, n_ctx=512).validate()
    memlimit.BenchOptions(model="m", limits_mb=[], use_cgroup=False).validate()


def test_config_specs():
    assert memlimit._config_spec("stock", 900) == {}
    assert memlimit._config_spec("llamaflash", 900) == {"flash_mode": None, "ram_budget_mb": 900}
    assert memlimit._config_spec("dense", 900) == {"flash_mode": "dense"}


# --------------------------------------------------------------------------------------------
# CLI (thin edge)


def _fake_run_benchmark(captured):
    def fake(opts, echo=print):
        captured["opts"] = opts
        runs = [_run("stock", lim, 0) for lim in opts.limits_mb]
        return _payload(memlimit.summarize(runs, ["stock"], opts.limits_mb), runs)

    return fake


def test_cli_bench_parses_limits_after_one_flag(tmp_path, monkeypatch):
    captured: dict = {}
    monkeypatch.setattr(memlimit, "run_benchmark", _fake_run_benchmark(captured))
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["bench", "model.gguf", "--ram-limit-mb", "900", "700", "--configs", "stock",
                                       "--reps", "1", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    opts = captured["opts"]
    assert opts.model == "model.gguf" and opts.limits_mb == [900, 700] and opts.configs == ["stock"] and opts.reps == 1
    assert out.is_file() and "limit MB" in result.output
    result = CliRunner().invoke(main, ["bench", "m.gguf", "--ram-limit-mb", "900", "--ram-limit-mb", "700",
                                       "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0 and captured["opts"].limits_mb == [900, 700]


def test_cli_bench_usage_errors(tmp_path):
    result = CliRunner().invoke(main, ["bench", "m.gguf"])
    assert result.exit_code == 2 and "--ram-limit-mb" in result.output
    result = CliRunner().invoke(main, ["bench", "m.gguf", "900"])
    assert result.exit_code == 2 and "limits go after --ram-limit-mb" in result.output
    result = CliRunner().invoke(main, ["bench", str(tmp_path / "missing.gguf"), "--ram-limit-mb", "900"])
    assert result.exit_code == EXIT_LLAMAFLASH_ERROR and "neither a file nor a registry model" in result.stderr


# --------------------------------------------------------------------------------------------
# end to end on a tiny synthetic model


@pytest.fixture(scope="module")
def tiny_with_sidecar(tiny_model_factory, tmp_path_factory) -> Path:
    from llamaflash.converters import convert

    d = tmp_path_factory.mktemp("memlimit-model")
    model = d / "tiny.gguf"
    shutil.copyfile(tiny_model_factory(weight_type="Q8_0"), model)
    from synth import FAST_CONVERT

    convert(model, progress=False, sparsity=0.25, measure_quality=False, report=False, **FAST_CONVERT)
    return model


def test_end_to_end_tiny_model(tiny_with_sidecar, tmp_path):
    lines: list[str] = []
    limits = [256] if _SUPPORT[0] else []
    opts = memlimit.BenchOptions(model=str(tiny_with_sidecar), limits_mb=limits, configs=["stock", "llamaflash"],
                                 reps=1, n_prompt=16, n_gen=4, n_ctx=64, n_batch=64, quiet_wait_s=0,
                                 timeout_s=120, use_cgroup=_SUPPORT[0],
                                 private_copy_dir=str(tmp_path / "copies"))  # fmt: skip
    payload = memlimit.run_benchmark(opts, echo=lines.append)
    assert list((tmp_path / "copies").iterdir()) == []  # the copies it made are gone
    assert payload["files"]["originals"]["model"] == str(tiny_with_sidecar)
    assert all(str(tmp_path / "copies") in ev["path"] for r in payload["runs"] for ev in r["eviction"])
    runs = payload["runs"]
    assert [r["status"] for r in runs] == ["ok", "ok"], [r.get("error") for r in runs]
    stock, flash = runs
    assert stock["n_gen_done"] == 4 and len(stock["tokens"]) == 5 and stock["ttft_s"] > 0
    # under a limit: flash offload planned for it (the same tokens as the in-memory sparse lane are
    # checked in test_offload.py); without cgroups: no budget, llamaflash's default lane
    if _SUPPORT[0]:
        assert flash["ram_budget"]["requested_mb"] == 256 and flash["ram_budget"]["applied"] is True
        # 256 MiB hold all of this tiny model and what stock keeps beside it: stock-equivalent
        assert flash["ram_budget"]["decision"]["lane"] == "stock" and flash["flash_mode"] == "stock"
        assert flash["ram_budget"]["plan"] is None
        assert stock["cgroup"]["limit_bytes"] == 256 * MiB and stock["cg_peak_mb"] > 0
        assert len(flash["tokens"]) == len(stock["tokens"])
    else:
        assert any("memory cgroups unavailable" in ln for ln in lines)
    assert all(ev["evicted"] for r in runs for ev in r["eviction"])
    assert len(flash["eviction"]) == 2  # model and sidecar
    memlimit.report(payload, tmp_path / "e.json", None, echo=lines.append)
    assert json.loads((tmp_path / "e.json").read_text())["runs"][0]["status"] == "ok"


def test_decode_time_cap_stops_early(tiny_with_sidecar):
    from llamaflash.bench import benchkit

    spec = {"mode": "run", "model": str(tiny_with_sidecar), "config": "stock", "prompt_tokens": list(range(1, 17)),
            "n_gen": 40, "threads": 1, "n_ctx": 64, "n_batch": 64, "max_decode_s": 1e-9, "progress": True}  # fmt: skip
    r = benchkit.run_worker(spec, timeout=120)
    assert r["ok"] and r["decode_capped"] and r["n_gen_done"] < 40 and len(r["tokens"]) == r["n_gen_done"] + 1


def test_io_bound_from_the_saved_disk_profile(tmp_path, monkeypatch):
    """decode against the disk's bound: the saved profile's throughput at the plan's read size (half a
    slot) and depth ÷ the MiB read per decoded token; nothing without a saved profile."""
    from llamaflash.planning import disk_probe
    from llamaflash.planning.planner import default_disk

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sidecar = tmp_path / "disk" / "m.flash.gguf"
    sidecar.parent.mkdir()
    plan = {"slot_bytes": 2 * 256 * 1024, "queue_depth": 32}
    runs = [
        {"ok": True, "config": "llamaflash", "limit_mb": 900, "ram_budget": {"plan": plan}},
        {"ok": True, "config": "stock", "limit_mb": 900},
    ]
    rows = [
        {"config": "llamaflash", "limit_mb": 900, "decode_tps": 2.0, "decode_read_mb_per_tok": 300.0},
        {"config": "stock", "limit_mb": 900, "decode_tps": 0.9, "decode_read_mb_per_tok": 800.0},
    ]
    memlimit.add_io_bound(rows, runs, sidecar)
    assert "io_bound" not in rows[0] and memlimit.io_bound_lines(rows) == []  # no saved profile
    profile = {**default_disk(), "source": None, "directory": str(sidecar.parent)}
    disk_probe.save_profile(profile)
    memlimit.add_io_bound(rows, runs, sidecar)
    point = next(p for p in profile["points"] if p["request_kib"] == 256 and p["depth"] == 32)
    mb_s = point["iops"] * 256 * 1024 / 1e6
    assert rows[0]["io_bound"]["disk_mb_s"] == pytest.approx(mb_s)
    assert rows[0]["io_bound_tps"] == pytest.approx(mb_s * 1e6 / (300 * 2**20))
    assert rows[0]["of_io_bound"] == pytest.approx(2.0 / rows[0]["io_bound_tps"])
    assert "io_bound" not in rows[1]  # stock has no plan
    lines = memlimit.io_bound_lines(rows)
    assert len(lines) == 2 and "900 MB llamaflash: 300 MiB read per decoded token" in lines[1]
