"""FFN weights placed on the llamaflash device stay phantom on llama.cpp's side.

- no anonymous RAM is committed for them (RssAnon, measured in fresh processes);
- reading one the way another backend would have to aborts loudly instead of returning garbage.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from llamaflash.converters import convert

# 4 layers x 3 matrices x 512 x 2048 F32 = 48 MiB of FFN weights
N_LAYER, N_EMBD, N_FF = 4, 512, 2048
FFN_BYTES = N_LAYER * 3 * N_EMBD * N_FF * 4

_MEASURE = """
import json, sys
from pathlib import Path
def kib(field):
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(field + ':'):
            return int(line.split()[1])
flash = sys.argv[1] == 'flash'
if flash:
    import llamaflash
    from llamaflash import Llama
else:
    from llama_cpp import Llama
before = kib('RssAnon')
llm = Llama(model_path=sys.argv[2], n_ctx=64, n_threads=2, verbose=False)
llm.eval(llm.tokenize(b'hello world'))
print(json.dumps({'anon_kib': kib('RssAnon') - before, 'hwm_kib': kib('VmHWM')}))
"""


@pytest.fixture(scope="module")
def big_fixture(tiny_model_factory, tmp_path_factory):
    src = tiny_model_factory(weight_type="F32", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, n_head=8, n_head_kv=4)
    model = tmp_path_factory.mktemp("phantom") / src.name
    shutil.copy(src, model)
    convert(model, progress=False)
    return model


def _measure(mode: str, model) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode, str(model)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_phantom_weights_commit_no_anonymous_memory(big_fixture):
    stock = _measure("stock", big_fixture)
    flash = _measure("flash", big_fixture)
    # F32 weights are used in place from file mappings by both (stock: llama.cpp's mmap of the GGUF,
    # llamaflash: its own mappings), so neither commits anonymous memory for them. Had the phantom
    # weights been committed, llamaflash would show +48 MiB.
    assert flash["anon_kib"] * 1024 < stock["anon_kib"] * 1024 + 0.15 * FFN_BYTES, (stock, flash)


def test_reading_a_phantom_weight_aborts_loudly(big_fixture):
    code = f"""
        import llamaflash
        from llamaflash import _native_testing
        llm = llamaflash.Llama(model_path={str(big_fixture)!r}, flash_mode="dense", n_ctx=64, verbose=False)
        _native_testing.read_phantom_weight()
        print("returned garbage")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "returned garbage" not in proc.stdout
    assert "phantom FFN weight" in proc.stderr
    assert "ffn_" in proc.stderr
