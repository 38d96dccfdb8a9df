"""FlashReader (csrc/io/flash_io.h): both engines, direct and buffered, alignment, faults, lifetimes.

Every test body runs under a hang guard (:func:`guarded`): a read that never completes fails the test
instead of hanging CI. A real device EIO is not simulated (no device-mapper here); the error path is
exercised by the reader's fault-injection hook instead.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings

import numpy as np
import pytest

import llamaflash  # noqa: F401  (loads llama_cpp's ggml before the extension)
from llamaflash import _native_testing as T
from llamaflash.errors import FlashIoError, LlamaflashError
from llamaflash.planning.disk_probe import format_table, probe_disk
from llamaflash.runtime.flash_io import DirectIoFallbackWarning, aligned_empty, io_uring_available, open_reader

HANG_TIMEOUT = 60.0
FILE_SIZE = 3 * (1 << 20) + 123  # not a multiple of any block size

URING_OK, URING_WHY = io_uring_available()
ENGINES = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason=f"io_uring unavailable: {URING_WHY}")),
    "pool",
]


def guarded(fn, *args, timeout: float = HANG_TIMEOUT, **kwargs):
    """fn(*args, **kwargs) in a daemon thread; fails the test if it has not returned within `timeout`."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not finish within {timeout} s (hang)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _fs_type(path) -> str | None:
    best, fs = "", None
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fs = mnt, parts[2]
    return fs


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    rng = np.random.default_rng(7)
    path.write_bytes(rng.integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes())
    return path


def _expected(path, offsets, lengths) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return b"".join(os.pread(fd, int(n), int(o)) for o, n in zip(offsets, lengths))
    finally:
        os.close(fd)


def _random_ranges(rng, n, size, max_len):
    offsets = rng.integers(0, size, n)
    lengths = np.minimum(rng.integers(0, max_len, n), size - offsets)
    # a few special ranges: empty, whole file tail, first byte, block aligned
    offsets = np.concatenate([offsets, [0, size - 1, size - 5000, 4096, 8192]])
    lengths = np.concatenate([lengths, [0, 1, 5000, 4096, 3 * 65536]])
    return offsets.astype(np.int64), lengths.astype(np.int64)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", [True, False])
def test_engines_return_the_bytes_pread_returns(data_file, engine, direct):
    def body():
        rng = np.random.default_rng(1)
        offsets, lengths = _random_ranges(rng, 300, FILE_SIZE, 200_000)
        reader = open_reader(data_file, engine=engine, queue_depth=8, direct=direct, max_op_bytes=64 << 10)
        assert reader.engine == engine
        out = np.zeros(int(lengths.sum()), np.uint8)
        reader.read(offsets, lengths, out)
        assert out.tobytes() == _expected(data_file, offsets, lengths)
        s = reader.stats()
        assert s["requests"] == int((lengths > 0).sum())
        assert s["bytes_requested"] == int(lengths.sum())
        assert s["bytes_read"] >= s["bytes_requested"]
        assert s["errors"] == 0 and s["engine"] == engine and s["direct"] == reader.direct
        if reader.direct:
            assert s["bounced"] > 0  # unaligned requests went through bounce buffers
        else:
            assert s["bounced"] == 0
        reader.close()

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_aligned_requests_are_read_in_place(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=4)
        if not reader.direct:
            pytest.skip(f"no direct I/O on {data_file.parent}: {reader.fallback_reason}")
        a = max(reader.alignment, 4096)
        n = 40
        offsets = np.random.default_rng(2).integers(0, FILE_SIZE // a - 4, n) * a
        lengths = np.full(n, 4 * a)
        out = aligned_empty(int(lengths.sum()), a)
        assert out.ctypes.data % a == 0
        reader.read(offsets, lengths, out)
        assert out.tobytes() == _expected(data_file, offsets, lengths)
        assert reader.stats()["bounced"] == 0
        assert reader.stats()["reads"] == n

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("queue_depth,n_requests", [(64, 5), (2, 400), (1, 50)])
def test_queue_depth_above_and_below_request_count(data_file, engine, queue_depth, n_requests):
    def body():
        rng = np.random.default_rng(queue_depth * 1000 + n_requests)
        offsets = rng.integers(0, FILE_SIZE - 70_000, n_requests)
        lengths = rng.integers(1, 70_000, n_requests)
        dst = np.cumsum(np.concatenate([[0], lengths[:-1] + 17]))  # gaps between destinations
        out = np.zeros(int(dst[-1] + lengths[-1]), np.uint8)
        reader = open_reader(data_file, engine=engine, queue_depth=queue_depth)
        assert reader.queue_depth == queue_depth
        reader.read(offsets, lengths, out, dst_offsets=dst)
        got = b"".join(out[d : d + n].tobytes() for d, n in zip(dst, lengths))
        assert got == _expected(data_file, offsets, lengths)

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_tickets_poll_and_wait_in_any_order(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=4)
        bufs, tickets, ranges = [], [], []
        for i in range(12):
            offs = np.arange(5, dtype=np.int64) * 100_003 + i * 1000
            lens = np.full(5, 20_000 + i)
            buf = bytearray(int(lens.sum()))
            tickets.append(reader.submit(offs, lens, buf))
            bufs.append(buf)
            ranges.append((offs, lens))
        deadline = time.time() + 30
        while not reader.poll(tickets[0]) and time.time() < deadline:
            time.sleep(0.001)
        assert reader.poll(tickets[0])
        for t, buf, (offs, lens) in reversed(list(zip(tickets, bufs, ranges))):
            reader.wait(t)
            assert bytes(buf) == _expected(data_file, offs, lens)
        with pytest.raises(ValueError, match="unknown read ticket"):
            reader.wait(tickets[0])
        assert T.pending_buffers(reader) == 0

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_many_threads_share_one_reader(data_file, engine):
    reader = open_reader(data_file, engine=engine, queue_depth=8)
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                offsets, lengths = _random_ranges(rng, 10, FILE_SIZE, 50_000)
                out = np.zeros(int(lengths.sum()), np.uint8)
                reader.read(offsets, lengths, out)
                assert out.tobytes() == _expected(data_file, offsets, lengths)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def body():
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    guarded(body)
    assert not errors, errors


@pytest.mark.parametrize("engine", ENGINES)
def test_truncated_file_is_a_clear_error(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=4)
        os.truncate(data_file, 1 << 20)
        out = np.zeros(200_000, np.uint8)
        with pytest.raises(FlashIoError) as exc:
            reader.read([(1 << 20) - 1000], [200_000], out)  # straddles the new end
        msg = str(exc.value)
        assert str(data_file) in msg and "truncated" in msg and str((1 << 20) - 1000) in msg
        with pytest.raises(FlashIoError, match="ended early"):
            reader.read([2 << 20], [4096], out)  # wholly past the new end
        with pytest.raises(FlashIoError, match="size changed"):
            reader.verify()
        reader.read([0], [1000], out)  # what is left still reads
        assert reader.stats()["errors"] >= 2

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_truncation_while_reading_never_hangs(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=8)
        chunk = 64 << 10
        offsets = np.arange(0, FILE_SIZE - chunk, chunk, dtype=np.int64)
        lengths = np.full(len(offsets), chunk)
        out = np.zeros(int(lengths.sum()), np.uint8)
        truncator = threading.Timer(0.05, os.truncate, (data_file, 100_000))
        truncator.start()
        deadline = time.time() + 20
        try:
            while time.time() < deadline:
                reader.read(offsets, lengths, out)  # succeeds until the truncation, then must fail
            pytest.fail("reads past the truncated end kept succeeding")
        except FlashIoError as e:
            assert "ended early" in str(e) and str(data_file) in str(e)
        finally:
            truncator.join()

    guarded(body)


def test_replaced_file_is_detected(data_file):
    def body():
        reader = open_reader(data_file, queue_depth=4)
        original = _expected(data_file, [0], [5000])
        tmp = data_file.with_name("new.bin")
        tmp.write_bytes(b"\0" * FILE_SIZE)
        os.replace(tmp, data_file)
        out = bytearray(5000)
        reader.read([0], [5000], out)  # the open file is still the original
        assert bytes(out) == original
        with pytest.raises(FlashIoError, match="different file"):
            reader.verify()

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_injected_eio_is_a_clear_error(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=4)
        T.inject_fault(reader, 300_000, errno.EIO)
        out = np.zeros(30_017, np.uint8)
        with pytest.raises(FlashIoError) as exc:
            reader.read([0, 290_000, 500_000], [10_000, 10_000 + 17, 10_000], out)
        msg = str(exc.value)
        assert "Input/output error" in msg and str(data_file) in msg and "290000" in msg
        assert isinstance(exc.value, OSError) and isinstance(exc.value, LlamaflashError)
        T.inject_fault(reader, 300_000, 0)
        reader.read([290_000], [10_000], out)
        assert out[:10_000].tobytes() == _expected(data_file, [290_000], [10_000])

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_request_of_a_batch_can_be_waited_for_before_the_batch(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=2, max_op_bytes=4096)
        T.inject_fault(reader, 300_000, errno.EIO)
        offs, lens = [0, 290_000, 500_000, 700_001], [50_000, 20_000, 30_000, 9_999]
        out = np.zeros(sum(lens), np.uint8)
        t = reader.submit(offs, lens, out)
        states = [reader.wait_request(t, i) for i in (3, 0, 2, 1)]
        assert states == [True, True, True, False]  # the range over the injected fault failed
        ends = np.cumsum([0] + lens)
        for i in (0, 2, 3):  # the finished ranges hold their bytes before the batch is waited for
            assert out[ends[i] : ends[i + 1]].tobytes() == _expected(data_file, [offs[i]], [lens[i]])
        with pytest.raises(ValueError, match="no request 4"):
            reader.wait_request(t, 4)
        with pytest.raises(FlashIoError, match="Input/output error"):
            reader.wait(t)
        with pytest.raises(ValueError, match="unknown read ticket"):
            reader.wait_request(t, 0)

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_injected_eintr_is_retried(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=2)
        T.inject_fault(reader, 0, errno.EINTR)  # EINTR forever: retried, then reported, never a hang
        with pytest.raises(FlashIoError, match="Interrupted"):
            reader.read([0], [100], bytearray(100))
        assert reader.stats()["retried"] >= 100

    guarded(body)


@pytest.mark.parametrize("bad", ["directory", "missing", "device"])
def test_unusable_paths_are_clear_errors(tmp_path, bad):
    path = {"directory": tmp_path, "missing": tmp_path / "nope.flash.gguf", "device": "/dev/null"}[bad]
    with pytest.raises(FlashIoError) as exc:
        guarded(open_reader, path)
    assert str(path) in str(exc.value)
    assert {"directory": "is a directory", "missing": "No such file", "device": "not a regular file"}[bad] in str(
        exc.value
    )


def test_requests_outside_the_file_are_refused(data_file):
    reader = open_reader(data_file)
    with pytest.raises(FlashIoError, match="lies outside"):
        reader.submit([FILE_SIZE - 10], [11], bytearray(11))
    with pytest.raises(ValueError, match="does not fit"):
        reader.submit([0], [100], bytearray(99))
    with pytest.raises(ValueError):
        reader.submit([-1], [10], bytearray(10))
    with pytest.raises(ValueError):
        open_reader(data_file, engine="nope")
    with pytest.raises(ValueError):
        open_reader(data_file, queue_depth=0)


def test_tmpfs_falls_back_to_buffered_reads_with_a_warning():
    shm = "/dev/shm"
    if not os.path.isdir(shm) or _fs_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = os.path.join(shm, f"llamaflash-test-{os.getpid()}.bin")
    data = np.random.default_rng(3).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    try:
        with pytest.warns(DirectIoFallbackWarning, match="no direct I/O"):
            reader = open_reader(path)
        assert not reader.direct and "tmpfs" in reader.fallback_reason
        assert reader.stats()["direct"] is False
        out = bytearray(999)
        guarded(reader.read, [12_345], [999], out)
        assert bytes(out) == data[12_345:13_344]
        reader.close()
    finally:
        os.unlink(path)


def test_direct_io_on_a_disk_filesystem(data_file):
    if _fs_type(data_file) in ("tmpfs", "ramfs", "overlay", None):
        pytest.skip(f"{data_file.parent} is not on a disk filesystem")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader = open_reader(data_file)
        buffered = open_reader(data_file, direct=False)  # not asked: no warning either
    assert reader.direct and reader.fallback_reason == ""
    assert reader.alignment >= 512 and reader.alignment & (reader.alignment - 1) == 0
    assert not buffered.direct and buffered.fallback_reason == ""


def test_auto_engine_prefers_io_uring(data_file):
    reader = open_reader(data_file)
    assert reader.engine == ("io_uring" if URING_OK else "pool")
    assert (reader.engine_note == "") == URING_OK


@pytest.mark.parametrize("engine", ENGINES)
def test_reader_destroyed_with_requests_in_flight(data_file, engine):
    def body():
        reader = open_reader(data_file, engine=engine, queue_depth=1)
        for i in range(50):
            buf = bytearray(8 * 65536)  # only the reader keeps it alive
            reader.submit(np.arange(8, dtype=np.int64) * 300_000 + i, np.full(8, 65536), buf)
        assert T.pending_buffers(reader) == 50
        t0 = time.perf_counter()
        reader.close()  # cancels what is queued, drains what is in flight
        assert time.perf_counter() - t0 < 10
        with pytest.raises(ValueError, match="closed"):
            reader.stats()
        reader.close()  # idempotent
        again = open_reader(data_file, engine=engine, queue_depth=2)
        for i in range(20):
            again.submit([i * 1000], [100_000], np.zeros(100_000, np.uint8))
        del again  # garbage collection with reads in flight

    guarded(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_measure_random_reads(data_file, engine):
    reader = open_reader(data_file, engine=engine, queue_depth=4)
    m = guarded(reader.measure_random_reads, 4096, 4, 0.05)
    assert m["reads"] > 0 and m["bytes"] == m["reads"] * 4096 and m["seconds"] > 0


def test_probe_disk_returns_a_table(tmp_path):
    result = guarded(probe_disk, tmp_path, sizes_kib=(4, 64), depths=(1, 4), seconds=0.05, file_mb=8)
    assert {(p["request_kib"], p["depth"]) for p in result["points"]} == {(4, 1), (4, 4), (64, 1), (64, 4)}
    assert all(p["iops"] > 0 and p["mb_s"] > 0 for p in result["points"])
    assert result["sequential_mb_s"] > 0 and result["engine"] in ("io_uring", "pool")
    assert "QD 4" in format_table(result)
    assert not any(p.name.startswith(".llamaflash-disk-probe") for p in tmp_path.iterdir())
