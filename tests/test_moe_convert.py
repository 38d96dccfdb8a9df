"""Converting an MoE model (converters/moe_convert.py, moe_routing.py): progress while routing is
measured, plain file-backed weights (no anonymous copy of the experts), and a conversion killed at
any point leaves no sidecar and, after the next conversion, no temporary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from llamaflash.converters import moe_routing

CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import llamaflash.converters.moe_routing as moe_routing
    from llamaflash.converters import convert

    model, marker = sys.argv[1], Path(sys.argv[2])
    record = moe_routing.RoutingRecorder.record
    def paused(self, sequences, progress=None):
        marker.write_text("routing")
        time.sleep(120)
        return record(self, sequences, progress)
    moe_routing.RoutingRecorder.record = paused
    convert(model, progress=False, calib_tokens=256)
""")


def test_routing_recorder_reports_progress_with_plain_weights(tiny_moe_factory):
    path = tiny_moe_factory("qwen3moe", "shaped")
    seen = []
    with moe_routing.RoutingRecorder(path, n_ctx=64, n_batch=32, n_threads=2) as rec:
        trace = rec.record([np.arange(100, 180), np.arange(300, 340)], progress=lambda d, t: seen.append((d, t)))
    assert trace.n_tokens == 120
    # batches of 32 over pieces of 64 (the context), 64 + 16 and 40 tokens
    assert seen == [(32, 120), (64, 120), (80, 120), (112, 120), (120, 120)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_while_routing_leaves_nothing(tmp_path, tiny_moe_factory, sig):
    src = tiny_moe_factory("qwen3moe", "shaped")
    model = tmp_path / "m.gguf"
    model.write_bytes(src.read_bytes())
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(marker)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the conversion never reached the routing measurement"
            time.sleep(0.05)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "marker"]  # no sidecar, no temporary


def test_refuses_to_overwrite_then_converts(tmp_path, tiny_moe_factory):
    from llamaflash.converters import convert
    from llamaflash.errors import OutputExistsError

    src = tiny_moe_factory("qwen3moe", "shaped")
    model = tmp_path / "m.gguf"
    model.write_bytes(src.read_bytes())
    out = Path(convert(model, progress=False, calib_tokens=128))
    assert out.is_file()
    with pytest.raises(OutputExistsError):
        convert(model, progress=False, calib_tokens=128)


def test_sequences_side_by_side_route_as_one_by_one(tiny_moe_factory):
    """n_seq sequences in one batch (unified KV cache, flash attention) select the experts the
    sequences select evaluated alone: the same set per token, up to float ties (none here)."""
    path = tiny_moe_factory("qwen3moe", "shaped")
    seqs = [np.arange(100 + 50 * i, 164 + 50 * i) for i in range(5)]
    with moe_routing.RoutingRecorder(path, n_ctx=64, n_batch=64, n_threads=2) as rec:
        alone = rec.record(seqs)
    seen = []
    with moe_routing.RoutingRecorder(path, n_ctx=64, n_batch=64, n_threads=2, n_seq=2) as rec:
        together = rec.record(seqs, progress=lambda d, t: seen.append(d))
    assert seen == [128, 256, 320]
    assert together.sequence_starts.tolist() == alone.sequence_starts.tolist() == [0, 64, 128, 192, 256]
    for layer in alone.layers:
        same = np.sort(alone.experts[layer], axis=1) == np.sort(together.experts[layer], axis=1)
        assert same.all(), f"layer {layer}: {int((~same.all(axis=1)).sum())} tokens routed differently"
    with pytest.raises(ValueError, match="n_batch == n_ctx"):
        moe_routing.RoutingRecorder(path, n_ctx=64, n_batch=32, n_seq=2)
