"""A minimal stock llama.cpp host for tests of the backend library, run as a subprocess: it calls
``ggml_backend_load_all()`` as every llama.cpp tool does at start (so GGML_BACKEND_PATH is honoured),
loads the model with stock ``llama_cpp.Llama`` and prints JSON on stdout: the registered devices and
the greedy completion's token ids.

Usage: python tool_host.py MODEL PROMPT N_TOKENS [FLAGS]; FLAGS in llama-cli's spelling (the library
reads them from the command line as it does a tool's): -c N, -b N, -ub N, -fa on|off, --no-repack,
-np N, -ot X, -cram N (-np, -ot and -cram are only seen by the library: this host decodes one
sequence, loads the library itself and keeps no prompt cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys


def _kwargs(flags: list) -> tuple:
    # verbose: llama-cpp-python silences stderr while loading otherwise, and the library speaks then
    kwargs = {"n_ctx": 512, "n_threads": 2, "seed": 0, "verbose": True}
    no_repack = False
    names = {"-c": "n_ctx", "-b": "n_batch", "-ub": "n_ubatch"}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag in names:
            kwargs[names[flag]] = int(flags[i + 1])
            i += 2
        elif flag == "-fa":
            kwargs["flash_attn"] = flags[i + 1] == "on"
            i += 2
        elif flag in ("-np", "-ot", "-cram"):
            i += 2
        elif flag == "--no-repack":
            no_repack = True
            i += 1
        else:
            raise SystemExit(f"tool_host: unknown flag {flag}")
    return kwargs, no_repack


def main() -> None:
    import llama_cpp

    model, prompt, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kwargs, no_repack = _kwargs(sys.argv[4:])
    lib = ctypes.CDLL(
        os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml.so.0")
    )  # the copy libllama loads (soname)
    lib.ggml_backend_load_all()
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    devices = [
        lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)).decode() for i in range(lib.ggml_backend_dev_count())
    ]
    if no_repack:  # llama-cli --no-repack: llama.cpp's weights in plain CPU memory
        from llamaflash.runtime.speculative import batch_invariant_weights

        loading = batch_invariant_weights()
    else:
        loading = contextlib.nullcontext()
    with loading:
        llm = llama_cpp.Llama(model, **kwargs)
    out = []
    for token in llm.generate(llm.tokenize(prompt.encode()), top_k=1, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) >= n_tokens or token == llm.token_eos():
            break
    print(json.dumps({"devices": devices, "tokens": out}))


if __name__ == "__main__":
    main()
