"""The RAM-budget planner (``llamaflash.planning.planner``) and ``llamaflash plan``: accounting, minimum,
cluster probabilities, pin choice, monotonicity, errors and the command line. Synthetic sidecars
with hand-set neuron frequencies; the real SmolLM2 and its converted sidecar (conftest.smollm2_sidecar)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from planner_cases import random_freqs, write_v2_sidecar

from llamaflash.cli.cli import EXIT_LLAMAFLASH_ERROR, main
from llamaflash.converters.bundle import BundleStage
from llamaflash.converters.pipeline import plan_sidecar
from llamaflash.converters.writer import write_sidecar_atomically
from llamaflash.errors import LlamaflashError, RamBudgetError, SidecarError
from llamaflash.files.gguf_model import base_identity, read_base_model
from llamaflash.files.sidecar import read_sidecar
from llamaflash.planning.plan_llama_share import compute_reserve_bytes, llama_memory
from llamaflash.planning.planner import CLUSTER_SIZES, MiB, default_disk, plan_offload

N_LAYER, N_FF = 3, 256
PARTS = (
    "runtime",
    "llama_vocab",
    "llama_weights",
    "kv_cache",
    "compute_buffers",
    "prefill_window",
    "gate_rows",
    "cold_slots",
    "verify_buffers",
    "hot_slots",
    "margin",
)
RUNTIME = 40 * MiB


@pytest.fixture(autouse=True)
def no_saved_disk_profiles(monkeypatch, tmp_path):
    """The CLI uses a disk profile saved on this machine when there is one: not in these tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory(n_layer=N_LAYER, n_embd=64, n_ff=N_FF, weight_type="Q8_0")


@pytest.fixture(scope="module")
def pair(model, tmp_path_factory) -> tuple[Path, Path]:
    return model, write_v2_sidecar(
        model, tmp_path_factory.mktemp("planner") / "m.flash.gguf", random_freqs(N_LAYER, N_FF)
    )


def plan(pair, budget_mb, **kw):
    kw.setdefault("runtime_rss_bytes", RUNTIME)
    return plan_offload(*pair, budget_mb, **kw)


def minimum_mb(pair, **kw) -> float:
    return plan(pair, 10_000, **kw).minimum_bytes / MiB


def test_parts_sum_to_the_budget_and_are_explained(pair):
    p = plan(pair, minimum_mb(pair, cluster_size=8, n_ubatch=64) + 0.3, cluster_size=8, n_ubatch=64)
    assert tuple(p.parts) == PARTS
    assert sum(p.parts.values()) == p.budget_bytes
    assert all(v >= 0 for v in p.parts.values())
    assert p.parts["runtime"] == RUNTIME and p.n_ubatch == p.n_batch == 64
    assert p.hot_slots > 0 and p.parts["hot_slots"] == p.hot_slots * p.slot_bytes
    assert (
        p.parts["cold_slots"] == p.cold_slots * p.slot_bytes == 3 * (N_FF // 8) * p.slot_bytes
    )  # 1 + 2 read-ahead layers
    assert p.slot_bytes % 4096 == 0 and p.slot_bytes >= 2 * 4096
    assert p.minimum_bytes <= p.budget_bytes - p.parts["hot_slots"] < p.minimum_bytes + p.slot_bytes
    assert p.parts["margin"] >= 16 * MiB
    assert sum(len(h) for h in p.hot_clusters) == p.hot_slots
    text = p.explain()
    for name in PARTS + ("minimum", "predicted", "cluster size 8", "built-in default"):
        assert name in text
    d = json.loads(json.dumps(p.to_dict()))
    assert (
        d["parts"] == p.parts
        and len(d["hot_clusters"]) == N_LAYER
        and d["hot_per_layer"] == [len(h) for h in p.hot_clusters]
    )
    assert "hot_clusters" not in p.to_dict(arrays=False)


def test_budget_at_the_minimum_pins_nothing_and_below_it_is_refused(pair):
    kw = dict(cluster_size=16, n_ubatch=32, stream_gate=False)
    low = minimum_mb(pair, **kw)
    p = plan(pair, low, **kw)
    assert p.hot_slots == 0 and p.parts["hot_slots"] == 0 and p.minimum_bytes == p.budget_bytes
    with pytest.raises(RamBudgetError) as e:
        plan(pair, low - 0.5, **kw)
    assert isinstance(e.value, LlamaflashError) and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert f"minimum of {math.ceil(low)} MiB" in msg and f"--ram-budget-mb {math.ceil(low)}" in msg
    assert "n_ctx" in msg


def test_more_budget_pins_more_and_hits_more(pair):
    # no read-ahead: one layer of cold slots (32); with read-ahead's three layers the cold region holds
    # all 96 clusters and every cluster stays resident from the minimum on (plan_clusters.all_resident)
    kw = dict(cluster_size=8, n_ubatch=32, stream_gate=False, prefetch_layers=0)
    low = minimum_mb(pair, **kw)
    # slots of 8 KiB (the cache's formula), 96 clusters: every step pins more, 3 MiB pins all
    plans = [plan(pair, low + extra, **kw) for extra in (0, 0.05, 0.2, 0.5, 0.7, 3)]
    hot = [p.hot_slots for p in plans]
    hit = [p.hit_rate for p in plans]
    assert hot == sorted(hot) and hot[0] == 0 and hot[-1] == N_LAYER * N_FF // 8  # everything pinned at the end
    assert len(set(hot)) == len(hot)
    assert hit == sorted(hit) and hit[0] == 0 and hit[-1] == pytest.approx(1.0)
    # fewer bytes come from flash, none once the unpinned clusters fit the cold slots
    flash = [plan(pair, low + extra, **kw).flash_bytes_per_token for extra in (0, 0.05, 0.2, 0.5, 1, 3)]
    assert flash == sorted(flash, reverse=True) and flash[-1] == 0
    assert plans[-1].io_bound_tok_s is None and plans[-1].flash_bytes_per_token == 0
    assert all(sum(p.parts.values()) == p.budget_bytes for p in plans)
    # with the cluster size chosen, more budget never predicts a slower decode
    speeds = [plan(pair, low + extra, n_ubatch=32).io_bound_tok_s or math.inf for extra in (0.1, 0.4, 1.0)]
    assert speeds == sorted(speeds)


def test_gate_is_streamed_where_the_resident_gate_does_not_fit_or_predicts_slower(pair):
    info = read_sidecar(pair[1])
    gate = sum(lay.n_ff * lay.gate_row_bytes for lay in info.layers)
    window = 2 * max(lay.n_ff * lay.gate_row_bytes for lay in info.layers)
    kw = dict(cluster_size=8, n_ubatch=32)
    resident = plan(pair, minimum_mb(pair, stream_gate=False, **kw), stream_gate=False, **kw)
    streamed = plan(pair, minimum_mb(pair, stream_gate=True, **kw), stream_gate=True, **kw)
    assert not resident.stream_gate and "gate_rows" in resident.parts and "gate_window" not in resident.parts
    assert streamed.stream_gate and streamed.parts["gate_window"] == window and "gate_rows" not in streamed.parts
    assert resident.minimum_bytes - streamed.minimum_bytes >= gate - window
    # every gate row is read per token on top of the clusters
    assert streamed.flash_bytes_per_token >= gate + resident.flash_bytes_per_token - 1
    assert "streamed from flash" in streamed.explain() and "gate resident" in resident.explain()
    # auto: streamed below the resident gate's minimum (said so), refused below the streamed minimum; from
    # the resident minimum on, the placement that predicts the faster decode (the gate's memory pins clusters
    # when streamed), and resident once it pins every cluster
    budget = resident.budget_bytes / MiB
    auto = plan(pair, budget - 0.01, **kw)
    assert auto.stream_gate and any("does not fit" in n for n in auto.notes)
    for b in (budget, budget + 0.2, budget + 1, budget + 5):
        auto = plan(pair, b, **kw)
        forced = [plan(pair, b, stream_gate=s, **kw).io_bound_tok_s or math.inf for s in (False, True)]
        assert (auto.io_bound_tok_s or math.inf) == max(forced)
        assert auto.stream_gate == (forced[1] > forced[0])
        if auto.stream_gate:
            assert any("pin clusters instead" in n for n in auto.notes)
    assert not auto.stream_gate and auto.io_bound_tok_s is None
    with pytest.raises(RamBudgetError, match=f"minimum of {math.ceil(streamed.minimum_bytes / MiB)} MiB"):
        plan(pair, streamed.minimum_bytes / MiB - 0.01, **kw)


def test_cluster_probability_and_pin_order_on_a_hand_example(model, tmp_path):
    freqs = {i: np.zeros(N_FF, dtype=np.float32) for i in range(N_LAYER)}
    freqs[0][:4] = [0.5, 0.5, 0.1, 0.0]  # clusters of 2: P = 0.75, 0.1
    freqs[1][10:12] = [0.9, 0.2]  # cluster 5: P = 0.92
    freqs[2][20:22] = [0.75, 0.0]  # cluster 10: P = 0.75, sum f 0.75 < layer 0's 1.0
    # bundles stored hot-first (a permutation): probabilities must still be in base neuron order
    orders = {i: np.argsort(-freqs[i], kind="stable").astype(np.int32) for i in range(N_LAYER)}
    pair = (model, write_v2_sidecar(model, tmp_path / "hand.flash.gguf", freqs, orders))
    low = minimum_mb(pair, cluster_size=2, n_ubatch=32)
    p0 = plan(pair, low, cluster_size=2, n_ubatch=32)
    slot_mb = p0.slot_bytes / MiB
    p = plan(pair, low + 3.5 * slot_mb, cluster_size=2, n_ubatch=32)  # 3 slots
    assert p.layers == [0, 1, 2] and p.cluster_size == 2
    np.testing.assert_allclose(p.cluster_prob[0][:3], [0.75, 0.1, 0.0], atol=1e-6)
    assert p.cluster_prob[1][5] == pytest.approx(1 - 0.1 * 0.8)
    assert p.cluster_prob[2][10] == pytest.approx(0.75)
    for i in range(N_LAYER):
        f = np.asarray(freqs[i], dtype=np.float64).reshape(-1, 2)
        np.testing.assert_allclose(p.cluster_prob[i], 1 - np.prod(1 - f, axis=1), atol=1e-6)
    assert p.hot_slots == 3
    assert [h.tolist() for h in p.hot_clusters] == [[0], [5], [10]] and p.hot_clusters[0].dtype == np.int32
    p4 = plan(pair, low + 4.5 * slot_mb, cluster_size=2, n_ubatch=32)
    assert [h.tolist() for h in p4.hot_clusters] == [[0, 1], [5], [10]]
    assert p4.hit_rate == pytest.approx(1.0)
    assert any("bundle order 'hot'" in n for n in p.notes)


def test_choices_are_explained_and_bounded(pair):
    p = plan(pair, minimum_mb(pair) + 2, n_ctx=256)
    assert p.cluster_size in CLUSTER_SIZES
    assert [c["cluster_size"] for c in p.candidates] == [c for c in CLUSTER_SIZES if c <= N_FF]
    assert p.n_ubatch <= 256 and p.queue_depth in (1, 4, 16, 32)
    assert 0.0 <= p.hit_rate <= 1.0 and 0.0 <= p.prefetch_min_prob <= 1.01
    assert "no disk profile given" in " ".join(p.notes)
    # a measured profile replaces the default; a faster disk predicts a faster decode
    fast = default_disk()
    for point in fast["points"]:
        point["iops"] *= 4
    fast["source"] = "test disk"
    q = plan(pair, minimum_mb(pair) + 2, n_ctx=256, disk=fast, cluster_size=p.cluster_size, n_ubatch=p.n_ubatch)
    assert q.disk_source == "test disk" and not any("no disk profile" in n for n in q.notes)
    if p.io_bound_tok_s is not None:
        assert q.io_bound_tok_s > p.io_bound_tok_s
    # a larger context costs KV cache
    assert (
        plan(pair, 10_000, n_ctx=1024, n_ubatch=32, cluster_size=8).parts["kv_cache"]
        == 2 * plan(pair, 10_000, n_ctx=512, n_ubatch=32, cluster_size=8).parts["kv_cache"]
    )
    # no read-ahead: one layer of cold slots
    r = plan(pair, 10_000, prefetch_layers=0, cluster_size=8, n_ubatch=32)
    assert r.cold_slots == N_FF // 8 and r.prefetch_min_prob > 1


def test_n_ubatch_follows_the_budget(pair):
    small = plan(pair, minimum_mb(pair, n_ubatch=32) + 0.5)
    large = plan(pair, 10_000)
    assert small.n_ubatch < 512 and large.n_ubatch == 512
    # a larger batch writes more compute pages: counted in full where the host frees none (the tools)
    full = dict(prompt_pages_freed=False)
    small_full = plan(pair, minimum_mb(pair, n_ubatch=32, **full) + 0.5, **full)
    assert plan(pair, 10_000, **full).parts["compute_buffers"] > small_full.parts["compute_buffers"]


def test_format_1_sidecar_is_refused_naming_convert(model, tmp_path):
    info = read_base_model(model)
    v1 = write_sidecar_atomically(
        plan_sidecar(info, base_identity(model, info), [BundleStage()]), tmp_path / "v1.flash.gguf"
    )
    with pytest.raises(SidecarError, match="llamaflash convert"):
        plan_offload(model, v1, 1000, runtime_rss_bytes=RUNTIME)


def test_the_plan_does_not_depend_on_the_process(pair):
    """The runtime is the measured constant, not this process's RSS: the same plan (and the same
    one minimum) before and after the process grows by 256 MiB, and for any budget asked."""
    from llamaflash.planning.planner import RUNTIME_RSS_BYTES

    before = plan_offload(*pair, 300)
    ballast = np.ones(256 * MiB, dtype=np.uint8)  # touched: resident
    after = plan_offload(*pair, 300)
    assert int(ballast.sum()) == 256 * MiB
    assert after.parts == before.parts and after.parts["runtime"] == RUNTIME_RSS_BYTES
    assert [list(h) for h in after.hot_clusters] == [list(h) for h in before.hot_clusters]
    assert len({plan_offload(*pair, b).least_budget_bytes for b in (300, 600, 10_000)}) == 1


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_plan_prints_the_table_and_json(pair):
    model, sidecar = pair
    ok = run_cli("plan", model, "--sidecar", sidecar, "--ram-budget-mb", 300, "--runtime-mb", 40)
    assert ok.exit_code == 0, ok.output
    assert "hot_slots" in ok.stdout and "minimum" in ok.stdout
    js = run_cli(
        "plan",
        model,
        "--sidecar",
        sidecar,
        "--ram-budget-mb",
        300,
        "--runtime-mb",
        40,
        "--json",
        "--cluster-size",
        8,
        "--n-ctx",
        256,
    )
    assert js.exit_code == 0, js.output
    d = json.loads(js.stdout)
    assert sum(d["parts"].values()) == d["budget_bytes"] == 300 * MiB
    assert d["cluster_size"] == 8 and d["n_ctx"] == 256 and "hot_clusters" not in d
    arrays = json.loads(
        run_cli(
            "plan", model, "--sidecar", sidecar, "--ram-budget-mb", 300, "--runtime-mb", 40, "--json", "--json-arrays"
        ).stdout
    )
    assert len(arrays["cluster_prob"]) == N_LAYER


def test_cli_plan_too_small_budget_exits_2_naming_the_minimum(pair, tmp_path):
    model, sidecar = pair
    r = run_cli("plan", model, "--sidecar", sidecar, "--ram-budget-mb", 20, "--runtime-mb", 40)
    assert r.exit_code == EXIT_LLAMAFLASH_ERROR == 2
    assert r.stderr.startswith("error: RAM budget 20 MiB is below the minimum of ")
    assert "Traceback" not in r.output
    profile = tmp_path / "disk.json"
    profile.write_text(json.dumps(default_disk()))
    ok = run_cli(
        "plan", model, "--sidecar", sidecar, "--ram-budget-mb", 400, "--runtime-mb", 40, "--disk-profile", profile
    )
    assert ok.exit_code == 0 and "built-in default" in ok.stdout
    missing = run_cli("plan", model, "--sidecar", tmp_path / "nope.flash.gguf", "--ram-budget-mb", 300)
    assert missing.exit_code == 2 and "no such sidecar" in missing.stderr


# --------------------------------------------------------------------------------------
# the real SmolLM2 sidecar converted by `llamaflash convert` (conftest.smollm2_sidecar)
# --------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2_plan(smollm2_sidecar):
    SMOL = smollm2_sidecar
    low = plan(SMOL, 10_000, cluster_size=64, n_ubatch=64, stream_gate=False).minimum_bytes / MiB
    assert 200 < low < 360  # includes the 112 MiB page-cache headroom
    with pytest.raises(RamBudgetError, match=f"minimum of {math.ceil(low)} MiB"):
        plan(SMOL, low - 1, cluster_size=64, n_ubatch=64, stream_gate=False)
    plans = [plan(SMOL, low + extra, cluster_size=64, n_ubatch=64, stream_gate=False) for extra in (0, 10, 25, 50)]
    assert all(sum(p.parts.values()) == p.budget_bytes for p in plans)
    assert [p.hot_slots for p in plans] == sorted(p.hot_slots for p in plans)
    assert [p.hit_rate for p in plans] == sorted(p.hit_rate for p in plans)
    assert plans[0].hot_slots == 0 and plans[-1].hot_slots > 0 and len(plans[-1].layers) == 30
    # llama.cpp's non-FFN share of SmolLM2 (token_embd Q8_0 + attention): about 45 MiB
    assert 40 * MiB < plans[0].parts["llama_weights"] < 50 * MiB
    auto = plan(SMOL, low + 25)
    assert auto.cluster_size in CLUSTER_SIZES and sum(auto.parts.values()) == auto.budget_bytes


@pytest.mark.real_model
def test_real_smollm2_llama_buffers_match_llama_cpp_log(smollm2_sidecar):
    """The KV cache and compute-buffer formulas against what llama.cpp logs when llamaflash.Llama loads
    SmolLM2 with its sidecar (bench/planner_constants.py, one fresh process)."""
    import subprocess
    import sys

    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.files.sidecar import validate_pair
    from llamaflash.planning.planner import llama_share

    SMOL = smollm2_sidecar
    script = Path(__file__).resolve().parent.parent / "bench" / "planner_constants.py"
    out = subprocess.run(
        [sys.executable, str(script), "--child", "smollm2-135m,llamaflash,128,512", "--sidecar", str(SMOL[1])],
        capture_output=True,
        text=True,
        check=True,
    )
    logged = json.loads(out.stdout.strip().splitlines()[-1])["buffers_mib"]
    header, info = read_gguf_header(SMOL[0]), validate_pair(*SMOL)
    share = llama_share(header, info, 512, 128)
    assert share["kv_cache"] / MiB == pytest.approx(logged["CPU KV"], abs=0.01)
    compute = logged["CPU compute"] + logged["LLAMAFLASH compute"] + logged["CPU output"]
    n_ff = max(lay.n_ff for lay in info.layers)
    reserved = compute_reserve_bytes(header, 512, 128, 128 * 3 * n_ff * 4) / MiB
    assert compute <= reserved <= 1.1 * compute
    assert share["compute_buffers"] / MiB <= reserved  # what a batch touches, never more than reserved


_TOUCHED_CHILD = """
import re, sys
from llama_cpp import Llama
def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=int(sys.argv[3]), n_ubatch=int(sys.argv[3]),
            n_threads=2, verbose=False)
before = anon()
llm.eval([(i * 7919) % 20000 + 100 for i in range(int(sys.argv[3]))])
print(anon() - before)
"""


@pytest.mark.real_model
@pytest.mark.parametrize("n_ubatch", [64, 512])
def test_real_compute_buffers_cover_the_pages_a_batch_touches(smollm2_sidecar, n_ubatch):
    """llama.cpp reserves its compute buffers for n_ubatch tokens that all return logits, but a batch
    writes only its real tensors: the anonymous memory stock SmolLM2 gains over one full batch (the
    compute pages it touches and the batch's KV rows) stays within the planner's count, and far below
    the reserve at n_ubatch 512 (whose logits rows alone are 512 x n_vocab x 4 bytes)."""
    import subprocess
    import sys

    from llamaflash.files.gguf_header import read_gguf_header

    model = smollm2_sidecar[0]
    header = read_gguf_header(model)
    n_ctx = 1024
    out = subprocess.run(
        [sys.executable, "-c", _TOUCHED_CHILD, str(model), str(n_ctx), str(n_ubatch)],
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(out.stdout.strip().splitlines()[-1])
    mem = llama_memory(header, n_ctx, n_ubatch, (), 0, embeddings_by_rows=True)
    assert grown <= mem["compute_buffers"] + mem["kv_cache"], (grown / MiB, mem["compute_buffers"] / MiB)
    if n_ubatch == 512:
        assert mem["compute_buffers"] < 0.5 * compute_reserve_bytes(header, n_ctx, n_ubatch, 0)


def test_cli_probe_disk_measures_beside_the_sidecar_and_saves_it(pair, monkeypatch, tmp_path):
    from llamaflash.planning import disk_probe

    calls = []

    def fake_probe(directory, **kw):
        calls.append((Path(directory), kw))
        return {**default_disk(), "source": "fake probe", "directory": str(directory)}

    monkeypatch.setattr(disk_probe, "probe_disk", fake_probe)
    model, sidecar = pair
    base = ("plan", model, "--sidecar", sidecar, "--ram-budget-mb", 400, "--runtime-mb", 40)
    r = run_cli(*base, "--probe-disk")
    assert r.exit_code == 0, r.output
    assert calls and calls[0][0] == sidecar.resolve().parent and calls[0][1]["seconds"] <= 0.5
    assert "disk: fake probe" in r.stdout and "| request |" in r.stderr and "disk profile saved" in r.stderr
    # measured once: the next plan on that disk uses the saved profile without probing
    r = run_cli(*base)
    assert r.exit_code == 0, r.output
    assert len(calls) == 1 and "disk: fake probe" in r.stdout


def test_saved_disk_profiles_are_per_filesystem(pair, tmp_path):
    from llamaflash.planning import disk_probe

    cache, disk_dir = tmp_path / "cache", tmp_path / "models"
    disk_dir.mkdir()
    probe = {
        **default_disk(),
        "source": None,
        "directory": str(disk_dir),
        "filesystem": "ext4",
        "engine": "pool",
        "direct": True,
    }
    written = disk_probe.save_profile(probe, cache)
    assert written.parent == cache / "disk-profiles"
    sidecar = disk_dir / "m.flash.gguf"  # need not exist: its directory's filesystem is what counts
    saved = disk_probe.saved_profile(sidecar, cache)
    assert saved["points"] == probe["points"] and saved["saved_at"]
    assert disk_probe.saved_profile(sidecar, tmp_path / "empty-cache") is None
    assert disk_probe.resolve_profile(None, sidecar, cache)["points"] == probe["points"]
    assert disk_probe.resolve_profile(None, sidecar, tmp_path / "empty-cache") is None  # the built-in default
    assert disk_probe.resolve_profile("default", sidecar, cache) is None
    assert disk_probe.resolve_profile(probe, sidecar, cache) is probe
    assert disk_probe.resolve_profile(written, sidecar, cache)["points"] == probe["points"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json has no measured points"):
        disk_probe.resolve_profile(bad, sidecar, cache)
    with pytest.raises(ValueError, match="nothing.json"):
        disk_probe.resolve_profile(tmp_path / "nothing.json", sidecar, cache)
    # the planner names a saved profile as such
    assert f"saved {saved['saved_at']}" in plan(pair, 10_000, disk=saved).disk_source


def test_logits_all_counts_every_row_of_logits(pair):
    """Llama(logits_all=True) keeps every token's logits: a batch writes n_ubatch rows of them, and
    llama-cpp-python holds n_ctx rows; the plan counts both, and leaves the cache that much less."""
    from llamaflash.files.gguf_header import read_gguf_header
    from llamaflash.planning.plan_llama_share import vocabulary_size

    n_vocab = vocabulary_size(read_gguf_header(pair[0]))
    base = plan(pair, 10_000, n_ubatch=64, n_ctx=512)
    every = plan(pair, 10_000, n_ubatch=64, n_ctx=512, logits_all=True)
    assert "python_logits" not in base.parts and every.parts["python_logits"] == 512 * n_vocab * 4
    assert every.parts["compute_buffers"] >= base.parts["compute_buffers"]  # (both at the reserve here)
    assert sum(every.parts.values()) == every.budget_bytes


@pytest.fixture(scope="module")
def wide_pair(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
    """3 layers of 2048 neurons, n_embd 256: with one layer of cold slots, a few MiB of budget where
    clusters are read, wider than what a larger n_ubatch's compute buffers take."""
    wide = tiny_model_factory(n_layer=N_LAYER, n_embd=256, n_ff=2048, weight_type="Q8_0")
    return wide, write_v2_sidecar(wide, tmp_path_factory.mktemp("wide") / "w.flash.gguf", random_freqs(N_LAYER, 2048))


@pytest.mark.parametrize("prompt_tokens", [64, 512, 4096])
def test_n_ubatch_minimizes_the_predicted_request(wide_pair, prompt_tokens):
    """n_ubatch weighs prefill and decode (plan_search.weigh_prefill): of the n_ubatch of the plan's
    gate placement that fit, the plan's predicts the shortest request (prefill_speed: TTFT of the
    prompt + REQUEST_DECODE_TOKENS decoded), each computed from the plan at that fixed n_ubatch; a
    longer prompt never takes a smaller n_ubatch; a caller's n_ubatch is taken as given."""
    from llamaflash.files.sidecar import validate_pair
    from llamaflash.planning import decode_speed, prefill_speed

    info = validate_pair(*wide_pair)
    kw = dict(cluster_size=8, n_ctx=4096, prefetch_layers=0)
    low = minimum_mb(wide_pair, n_ubatch=32, **kw)
    for extra in np.linspace(0.25, 6.0, 8):
        chosen = plan(wide_pair, low + extra, prompt_tokens=prompt_tokens, **kw)
        best = chosen.ubatch_choice["request_s"]
        for u in (32, 64, 128, 256, 512):
            try:
                fixed = plan(
                    wide_pair,
                    low + extra,
                    n_ubatch=u,
                    stream_gate=chosen.stream_gate,
                    prompt_tokens=prompt_tokens,
                    **kw,
                )
            except RamBudgetError:
                continue
            ttft = fixed.prefill["ttft_s"]
            assert fixed.prefill["passes"] == -(-prompt_tokens // u)
            request = prefill_speed.request_seconds(ttft, decode_speed.plan_token_time(fixed, info).tok_s)
            assert best <= request * (1 + 1e-9), (u, chosen.n_ubatch)
        longer = plan(wide_pair, low + extra, prompt_tokens=4 * prompt_tokens, **kw)
        assert longer.n_ubatch >= chosen.n_ubatch
        given = plan(wide_pair, low + extra, n_ubatch=32, prompt_tokens=prompt_tokens, **kw)
        assert given.n_ubatch == 32 and given.ubatch_choice.get("given")


def test_prompt_batches_and_decode_take_turns_in_the_cold_region(wide_pair):
    """Where the host frees a prompt's compute pages after it (llamaflash.Llama) and the engine empties
    the cold region before a prompt batch, the compute buffers count a decode batch's pages and the
    rest of a prompt batch's share the cold slots' and verify buffers' memory: a larger n_ubatch then
    costs no pinned cluster while its extra pages fit there. For the tools (prompt_pages_freed=False)
    every part counts in full."""
    from llamaflash.planning.plan_budget import DECODE_ROWS

    kw = dict(cluster_size=8, n_ctx=4096, prefetch_layers=2)
    budget = minimum_mb(wide_pair, n_ubatch=512, prompt_pages_freed=False, **kw) + 4
    small = plan(wide_pair, budget, n_ubatch=DECODE_ROWS, **kw)
    for u in (64, 128, 256, 512):
        shared = plan(wide_pair, budget, n_ubatch=u, **kw)
        full = plan(wide_pair, budget, n_ubatch=u, prompt_pages_freed=False, **kw)
        assert sum(shared.parts.values()) == sum(full.parts.values()) == budget * MiB // 1
        assert shared.parts["compute_buffers"] == small.parts["compute_buffers"] < full.parts["compute_buffers"]
        extra = full.parts["compute_buffers"] - shared.parts["compute_buffers"]
        cache_floor = shared.parts["cold_slots"] + shared.parts["verify_buffers"]
        assert shared.parts.get("prompt_buffers", 0) == max(0, extra - cache_floor)
        assert "prompt_buffers" in shared.parts or extra <= cache_floor
        assert shared.hot_slots >= full.hot_slots and shared.minimum_bytes <= full.minimum_bytes
        if extra <= cache_floor:
            assert shared.hot_slots == small.hot_slots
        assert "cold slots and verify" in shared.explain()
