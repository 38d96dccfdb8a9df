"""Fetch ggml's public and backend-internal headers for one exact llama-cpp-python version.

llama-cpp-python installs the ggml shared libraries but not `ggml-backend-impl.h`, the header that
defines the backend/device/buffer interfaces (GGML_BACKEND_API_VERSION). A backend plugin must be
compiled against exactly the headers of the libggml it is loaded into, so this script takes them from
the sdist of the pinned version (pip's download cache makes repeated builds cheap) and extracts only
the header files. Nothing third-party is stored in the repository.

usage: fetch_ggml_headers.py VERSION OUT_DIR
Writes OUT_DIR/include/*.h and OUT_DIR/VERSION; exits non-zero with a message on failure.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HEADER_DIRS = ("vendor/llama.cpp/ggml/include/",)
HEADER_FILES = ("vendor/llama.cpp/ggml/src/ggml-backend-impl.h",)


def main() -> int:
    version, out_dir = sys.argv[1], Path(sys.argv[2])
    stamp = out_dir / "VERSION"
    if stamp.exists() and stamp.read_text().strip() == version:
        return 0
    include = out_dir / "include"
    include.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", f"llama-cpp-python=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(f"could not download the llama-cpp-python {version} sdist for ggml headers:\n"
                             f"{proc.stderr[-2000:]}\n")
            return 1
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            sys.stderr.write(f"pip download produced no sdist in {tmp}\n")
            return 1
        n = 0
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[-1]
                if not member.isfile() or not name.endswith(".h"):
                    continue
                in_dir = any(name.startswith(d) and "/" not in name[len(d):] for d in HEADER_DIRS)
                if in_dir or name in HEADER_FILES:
                    data = tar.extractfile(member).read()
                    (include / Path(name).name).write_bytes(data)
                    n += 1
        if not (include / "ggml-backend-impl.h").exists():
            sys.stderr.write("ggml-backend-impl.h not found in the sdist\n")
            return 1
    stamp.write_text(version + "\n")
    print(f"extracted {n} ggml headers for llama-cpp-python {version} into {include}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
