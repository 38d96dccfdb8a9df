"""Fetch ggml's public and backend-internal headers for one exact llama-cpp-python version.

llama-cpp-python installs the ggml shared libraries but not `ggml-backend-impl.h`, the header that
defines the backend/device/buffer interfaces (GGML_BACKEND_API_VERSION). A backend plugin must be
compiled against exactly the headers of the libggml it is loaded into, so this script takes them from
the sdist of the pinned version and extracts only the header files. Nothing third-party is stored in
the repository.

The sdist comes from, in this order:
  1. LLAMAFLASH_LLAMA_CPP_SDIST: the path of a local copy (offline builds);
  2. the package index over plain HTTPS (PEP 503 simple API; PIP_INDEX_URL when set, else PyPI),
     with the standard library only: this runs inside pip's isolated build environment, where pip
     itself is not importable;
  3. `python -m pip download`, when pip is importable and the direct download failed (a proxy or
     index setup only pip knows about).
The archive is checked against the sha256 pinned below before anything is extracted, and the headers
are written to a temporary directory that is renamed into place: an interrupted fetch leaves nothing
that a later build would mistake for a complete one.

usage: fetch_ggml_headers.py VERSION OUT_DIR
Writes OUT_DIR/include/*.h and OUT_DIR/VERSION; exits non-zero with a message naming the way out.
"""
from __future__ import annotations

import hashlib
import html.parser
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import List, Optional

#: sha256 of llama-cpp-python's sdist per supported version (the index's own digest of the file).
SDIST_SHA256 = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}
HEADER_DIRS = ("vendor/llama.cpp/ggml/include/",)
HEADER_FILES = ("vendor/llama.cpp/ggml/src/ggml-backend-impl.h",)
DEFAULT_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60


class FetchError(RuntimeError):
    pass


def _how_to_fix(version: str) -> str:
    return (f"Ways out: check the network connection to the package index, or download the sdist "
            f"elsewhere (`pip download --no-deps --no-binary :all: llama-cpp-python=={version}`) and "
            f"point LLAMAFLASH_LLAMA_CPP_SDIST at the .tar.gz.")


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: List[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def _sdist_names(version: str) -> List[str]:
    return [f"llama_cpp_python-{version}.tar.gz", f"llama-cpp-python-{version}.tar.gz"]


def _download_from_index(version: str, dest: Path) -> Path:
    index = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX).rstrip("/")
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


def _download_with_pip(version: str, dest: Path) -> Path:
    if importlib.util.find_spec("pip") is None:
        raise FetchError("pip is not importable here")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", f"llama-cpp-python=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download failed: {last}")
    for name in _sdist_names(version):
        if (dest / name).exists():
            return dest / name
    raise FetchError(f"pip download left no sdist in {dest}")


def _check_sha256(path: Path, version: str) -> None:
    want = SDIST_SHA256.get(version)
    if want is None:
        raise FetchError(f"llamaflash knows no sdist digest for llama-cpp-python {version} "
                         f"(supported: {', '.join(SDIST_SHA256)})")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != want:
        raise FetchError(f"{path} has sha256 {h.hexdigest()}, expected {want} for llama-cpp-python {version}")


def obtain_sdist(version: str, dest: Path) -> Path:
    local = os.environ.get("LLAMAFLASH_LLAMA_CPP_SDIST")
    if local:
        path = Path(local)
        if not path.is_file():
            raise FetchError(f"LLAMAFLASH_LLAMA_CPP_SDIST={local} is not a file")
        _check_sha256(path, version)
        return path
    errors = []
    for how in (_download_from_index, _download_with_pip):
        try:
            path = how(version, dest)
            _check_sha256(path, version)
            return path
        except FetchError as e:
            errors.append(str(e))
    raise FetchError("; ".join(errors))


def extract_headers(sdist: Path, include: Path) -> int:
    n = 0
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if not member.isfile() or not name.endswith(".h"):
                continue
            in_dir = any(name.startswith(d) and "/" not in name[len(d):] for d in HEADER_DIRS)
            if in_dir or name in HEADER_FILES:
                (include / Path(name).name).write_bytes(tar.extractfile(member).read())
                n += 1
    if not (include / "ggml-backend-impl.h").exists():
        raise FetchError(f"ggml-backend-impl.h not found in {sdist}")
    return n


def fetch(version: str, out_dir: Path) -> Optional[int]:
    """Makes out_dir hold the headers of `version`; returns how many were extracted (None: cached)."""
    stamp = out_dir / "VERSION"
    if stamp.exists() and stamp.read_text().strip() == version and (out_dir / "include" / "ggml-backend-impl.h").exists():
        return None
    if version not in SDIST_SHA256:
        raise FetchError(f"llama-cpp-python {version} is not supported by this llamaflash "
                         f"(supported: {', '.join(SDIST_SHA256)}); install llama-cpp-python=={next(iter(SDIST_SHA256))}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-") as tmp:
        work = Path(tmp)
        sdist = obtain_sdist(version, work)
        staged = work / "staged"
        (staged / "include").mkdir(parents=True)
        n = extract_headers(sdist, staged / "include")
        (staged / "VERSION").write_text(version + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staged, out_dir)
    return n


def main() -> int:
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    version, out_dir = sys.argv[1], Path(sys.argv[2])
    try:
        n = fetch(version, out_dir)
    except FetchError as e:
        sys.stderr.write(f"llamaflash: could not obtain the ggml headers of llama-cpp-python {version}: {e}\n"
                         f"{_how_to_fix(version)}\n")
        return 1
    if n is not None:
        print(f"extracted {n} ggml headers for llama-cpp-python {version} into {out_dir / 'include'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
