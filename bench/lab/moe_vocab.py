"""Real tokenizers for synthetic models: the vocab-only GGUF files that llama.cpp ships for its
tokenizer tests (``vendor/llama.cpp/models/ggml-vocab-<name>.gguf`` in the llama-cpp-python sdist).

The sdist is downloaded once and checked against its pinned sha256 (:mod:`.llama_sdist`); the
vocabulary files are extracted into ``<cache_dir>/llama-cpp-python-<version>/`` (default
``~/.cache/llamaflash/vocab``) and written atomically, so a cached file is always a complete copy of
a verified archive member. :func:`tokenizer_metadata` returns the ``tokenizer.*`` key-value pairs of
such a file, typed as in the file, for a :class:`gguf.GGUFWriter` to copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from . import llama_sdist

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "llamaflash" / "vocab"

#: Vocabularies shipped in the sdist that the synthetic models use (name -> tokenizer it holds).
VOCABS = {
    "qwen2": "Qwen2/Qwen3 byte-level BPE, 151936 tokens",
    "llama-spm": "Llama/Mistral SentencePiece, 32000 tokens",
    "llama-bpe": "Llama 3 byte-level BPE, 128256 tokens",
}


def _member(name: str) -> str:
    return f"vendor/llama.cpp/models/ggml-vocab-{name}.gguf"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialises extraction across processes (tests may run in parallel)."""
    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def vocab_gguf(
    name: str,
    cache_dir: Optional[Path] = None,
    local_sdist: Optional[str] = None,
    version: str = LLAMA_CPP_PYTHON_VERSION,
) -> Path:
    """Path of the cached ``ggml-vocab-<name>.gguf``, extracting every vocabulary of :data:`VOCABS`
    from the verified sdist when one is missing. ``local_sdist``: a local copy of the sdist to use
    instead of downloading it (it is verified all the same)."""
    if name not in VOCABS:
        raise ValueError(f"unknown vocabulary {name!r}; known: {', '.join(sorted(VOCABS))}")
    directory = Path(cache_dir or DEFAULT_CACHE_DIR) / f"llama-cpp-python-{version}"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"ggml-vocab-{name}.gguf"
    with _locked(directory):
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
            work = Path(tmp)
            try:
                sdist = llama_sdist.obtain_sdist(version, work, local=local_sdist)
            except llama_sdist.FetchError as e:
                raise RuntimeError(
                    f"could not obtain the llama-cpp-python {version} sdist for its "
                    f"vocabulary files: {e}. {llama_sdist.how_to_fix(version)}"
                ) from e
            members = {_member(n): n for n in VOCABS}
            staged = llama_sdist.extract_members(sdist, lambda m: work / f"{members[m]}.gguf" if m in members else None)
            missing = sorted(set(members) - set(staged))
            if missing:
                raise RuntimeError(f"{sdist} lacks {', '.join(missing)}")
            for member, path in staged.items():
                os.replace(path, directory / f"ggml-vocab-{members[member]}.gguf")
    return out


@dataclass(frozen=True)
class MetadataValue:
    """One GGUF key-value pair: ``value`` (a scalar, str, or list) of ``vtype`` (element type
    ``sub_type`` for arrays), as :meth:`gguf.GGUFWriter.add_key_value` takes it."""

    key: str
    value: Any
    vtype: Any
    sub_type: Any = None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def tokenizer_metadata(path: Path) -> tuple[MetadataValue, ...]:
    """The ``tokenizer.*`` key-value pairs of the GGUF at ``path``, in file order (parsed once per
    process and file version).

    A direct parse of the GGUF header (version 2 or 3: magic, version, tensor count, key-value
    count, then key, type, value per pair): gguf-py's reader takes a minute for the 150k-token
    vocabularies, this a fraction of a second.
    """
    st = Path(path).stat()
    return _parse_tokenizer(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parse_tokenizer(path: str, size: int, mtime_ns: int) -> tuple[MetadataValue, ...]:
    import gguf

    data = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        value = data[pos : pos + n].decode("utf-8")
        pos += n
        return value

    def value(vtype: int):
        nonlocal pos
        if vtype in _SCALARS:
            return take(_SCALARS[vtype])
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            sub, n = take("<I"), take("<Q")
            if sub == _STRING:
                return [string() for _ in range(n)]
            if sub in _SCALARS:
                arr = np.frombuffer(data, dtype=np.dtype(_SCALARS[sub]), count=n, offset=pos)
                pos += arr.nbytes
                return arr.tolist()
        raise ValueError(f"{path}: unsupported GGUF value type {vtype}")

    if data[:4] != b"GGUF" or take("<4s") != b"GGUF" or take("<I") not in (2, 3):
        raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
    take("<Q")  # tensor count
    out = []
    for _ in range(take("<Q")):
        key = string()
        vtype = take("<I")
        sub = struct.unpack_from("<I", data, pos)[0] if vtype == _ARRAY else None
        val = value(vtype)
        if key.startswith("tokenizer."):
            out.append(
                MetadataValue(key, val, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub))
            )
    if not any(m.key == "tokenizer.ggml.tokens" for m in out):
        raise ValueError(f"{path} has no tokenizer.ggml.tokens: not a vocabulary GGUF")
    return tuple(out)
