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
The archive is checked against its pinned sha256 before anything is extracted (the download and
the check live in bench/lab/llama_sdist.py, shared with the benchmark lab, which takes vocabulary
files from the same sdist), and the headers are written to a temporary directory that is renamed
into place: an interrupted fetch leaves nothing that a later build would mistake for a complete one.

usage: fetch_ggml_headers.py VERSION OUT_DIR
Writes OUT_DIR/include/*.h and OUT_DIR/VERSION; exits non-zero with a message naming the way out.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

HEADER_DIRS = ("vendor/llama.cpp/ggml/include/",)
HEADER_FILES = ("vendor/llama.cpp/ggml/src/ggml-backend-impl.h",)


def _load_llama_sdist():
    """bench/lab/llama_sdist.py (standard library only), loaded by path: neither llamaflash nor
    its subpackages are importable inside pip's isolated build environment."""
    path = Path(__file__).resolve().parent.parent / "bench" / "lab" / "llama_sdist.py"
    spec = importlib.util.spec_from_file_location("_llamaflash_llama_sdist", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llama_sdist = _load_llama_sdist()
FetchError = llama_sdist.FetchError
SDIST_SHA256 = llama_sdist.SDIST_SHA256


def obtain_sdist(version: str, dest: Path) -> Path:
    return llama_sdist.obtain_sdist(
        version, dest, local=os.environ.get("LLAMAFLASH_LLAMA_CPP_SDIST"), index_url=os.environ.get("PIP_INDEX_URL")
    )


def extract_headers(sdist: Path, include: Path) -> int:
    def wanted(name: str) -> Optional[Path]:
        if not name.endswith(".h"):
            return None
        in_dir = any(name.startswith(d) and "/" not in name[len(d) :] for d in HEADER_DIRS)
        return include / Path(name).name if in_dir or name in HEADER_FILES else None

    n = len(llama_sdist.extract_members(sdist, wanted))
    if not (include / "ggml-backend-impl.h").exists():
        raise FetchError(f"ggml-backend-impl.h not found in {sdist}")
    return n


def fetch(version: str, out_dir: Path) -> Optional[int]:
    """Makes out_dir hold the headers of `version`; returns how many were extracted (None: cached)."""
    stamp = out_dir / "VERSION"
    if (
        stamp.exists()
        and stamp.read_text().strip() == version
        and (out_dir / "include" / "ggml-backend-impl.h").exists()
    ):
        return None
    if version not in SDIST_SHA256:
        raise FetchError(
            f"llama-cpp-python {version} is not supported by this llamaflash "
            f"(supported: {', '.join(SDIST_SHA256)}); install llama-cpp-python=={next(iter(SDIST_SHA256))}"
        )
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
        sys.stderr.write(
            f"llamaflash: could not obtain the ggml headers of llama-cpp-python {version}: {e}\n"
            f"{llama_sdist.how_to_fix(version)}\n"
        )
        return 1
    if n is not None:
        print(f"extracted {n} ggml headers for llama-cpp-python {version} into {out_dir / 'include'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
