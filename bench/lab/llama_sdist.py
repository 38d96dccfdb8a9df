"""The source distribution of one exact llama-cpp-python version, downloaded and verified.

Standard library only: the build runs this file by path (``cmake/fetch_ggml_headers.py``) inside
pip's isolated build environment, where neither llamaflash nor pip may be importable; the benchmark
lab imports it as ``llamaflash.bench.llama_sdist`` (vocabulary files of ``vendor/llama.cpp/models``).

The sdist comes from, in this order:
  1. ``local`` (a path the caller passes, e.g. from LLAMAFLASH_LLAMA_CPP_SDIST at a CLI edge);
  2. the package index over plain HTTPS (PEP 503 simple API; ``index_url``, else PyPI);
  3. ``python -m pip download``, when pip is importable and the direct download failed (a proxy or
     index setup only pip knows about).
The archive is checked against the sha256 pinned in :data:`SDIST_SHA256` before anything is read
from it.
"""

from __future__ import annotations

import hashlib
import html.parser
import importlib.util
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional

#: sha256 of llama-cpp-python's sdist per supported version (the index's own digest of the file).
SDIST_SHA256 = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}
DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60


class FetchError(RuntimeError):
    """The sdist could not be obtained or did not verify."""


def how_to_fix(version: str) -> str:
    return (
        f"Ways out: check the network connection to the package index, or download the sdist "
        f"elsewhere (`pip download --no-deps --no-binary :all: llama-cpp-python=={version}`) and "
        f"point LLAMAFLASH_LLAMA_CPP_SDIST at the .tar.gz."
    )


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: List[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def _sdist_names(version: str) -> List[str]:
    return [f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz"]


def _download_from_index(version: str, dest: Path, index_url: Optional[str]) -> Path:
    index = (index_url or DEFAULT_INDEX).rstrip("/")
    if not index.startswith(("http://", "https://")):
        index = DEFAULT_INDEX
    page_url = f"{index}/llama-cpp-python/"
    try:
        with urllib.request.urlopen(page_url, timeout=TIMEOUT_S) as r:
            page = r.read().decode("utf-8", "replace")
    except OSError as e:
        raise FetchError(f"could not read {page_url}: {e}") from e
    parser = _Links()
    parser.feed(page)
    names = _sdist_names(version)
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page_url, href)
        file_name = urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1]
        if file_name in names:
            out = dest / file_name
            try:
                with urllib.request.urlopen(url.split("#", 1)[0], timeout=TIMEOUT_S) as r, open(out, "wb") as f:
                    shutil.copyfileobj(r, f)
            except OSError as e:
                raise FetchError(f"could not download {url}: {e}") from e
            return out
    raise FetchError(f"{page_url} lists no sdist of llama-cpp-python {version}")


def _download_with_pip(version: str, dest: Path, index_url: Optional[str]) -> Path:
    if importlib.util.find_spec("pip") is None:
        raise FetchError("pip is not importable here")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--no-build-isolation",
        f"llama-cpp-python=={version}",
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download failed: {last}")
    for name in _sdist_names(version):
        if (dest / name).exists():
            return dest / name
    raise FetchError(f"pip download left no sdist in {dest}")


def check_sha256(path: Path, version: str) -> None:
    """Raises :class:`FetchError` unless ``path`` is the pinned sdist of ``version``."""
    want = SDIST_SHA256.get(version)
    if want is None:
        raise FetchError(
            f"llamaflash knows no sdist digest for llama-cpp-python {version} (supported: {', '.join(SDIST_SHA256)})"
        )
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        raise FetchError(f"{path} has sha256 {h.hexdigest()}, expected {want} for llama-cpp-python {version}")


def obtain_sdist(version: str, dest: Path, local: Optional[str] = None, index_url: Optional[str] = None) -> Path:
    """The verified sdist of ``version``: ``local`` when given, else downloaded into ``dest``."""
    if local:
        path = Path(local)
        if not path.is_file():
            raise FetchError(f"the local sdist {local} is not a file")
        check_sha256(path, version)
        return path
    errors = []
    for how in (_download_from_index, _download_with_pip):
        try:
            path = how(version, dest, index_url)
            check_sha256(path, version)
            return path
        except FetchError as e:
            errors.append(str(e))
    raise FetchError("; ".join(errors))


def extract_members(sdist: Path, wanted: Callable[[str], Optional[Path]]) -> Dict[str, Path]:
    """Writes the regular files of ``sdist`` that ``wanted`` maps to an output path.

    ``wanted`` gets each member's path inside the project (the leading ``<name>-<version>/``
    removed) and returns where to write it, or None to skip it. Returns {member path: written path}.
    """
    out: Dict[str, Path] = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            name = member.name.split("/", 1)[-1]
            target = wanted(name)
            if target is None:
                continue
            src = tar.extractfile(member)
            if src is None:  # pragma: no cover - isfile() members always have data
                continue
            with src, open(target, "wb") as f:
                shutil.copyfileobj(src, f)
            out[name] = target
    return out
