"""A served FFN that produces a NaN or an infinity raises NonFiniteOutputError naming the layer,
in memory and under flash offload, instead of letting generation run on (or stop) silently."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
from synth import FAST_CONVERT

import llamaflash
from llamaflash import _native
from llamaflash.converters import convert
from llamaflash.errors import NonFiniteOutputError
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.sidecar import read_sidecar

KW = dict(n_ctx=128, n_threads=2, n_threads_batch=2, verbose=False, seed=0)
NAN_F16 = struct.pack("<e", float("nan"))


@pytest.fixture(scope="module")
def poisoned(tiny_model_factory, tmp_path_factory):
    """A Q8_0 model and a sidecar whose layer-1 down_t rows all have a NaN block scale (every active
    neuron of that layer then adds NaN to y)."""
    src = tiny_model_factory(weight_type="Q8_0", n_embd=96, n_ff=192)
    d = tmp_path_factory.mktemp("nonfinite")
    model = d / "m.gguf"
    shutil.copy(src, model)
    sidecar = convert(model, progress=False, sparsity=0.5, measure_quality=False, **FAST_CONVERT)
    layer = read_sidecar(sidecar).layers[1]
    data = bytearray(sidecar.read_bytes())
    for row in range(layer.n_ff):
        at = layer.down_t_offset + row * layer.down_t_row_bytes
        data[at : at + 2] = NAN_F16  # the first Q8_0 block's f16 scale
    # the row checksums re-made for the poisoned rows, as a converter writing NaN weights would: the
    # integrity check passes, and what runs into the NaN is the engine's output check
    rows = np.frombuffer(
        bytes(data[layer.down_t_offset : layer.down_t_offset + layer.n_ff * layer.down_t_row_bytes]), dtype=np.uint8
    )
    table = (
        np.frombuffer(bytes(data[layer.checksum_offset : layer.checksum_offset + 16 * layer.n_ff]), dtype="<u4")
        .reshape(layer.n_ff, 4)
        .copy()
    )
    table[:, fmt.CHECKSUM_COLUMNS.index("down_t")] = _native.crc32c_rows(rows, layer.down_t_row_bytes)
    data[layer.checksum_offset : layer.checksum_offset + table.nbytes] = table.tobytes()
    sidecar.write_bytes(bytes(data))
    return model, sidecar, layer.layer


def _decode(llm):
    llm.eval(llm.tokenize(b"hello there, how are you"))
    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))] if llm._logits_all else [1])


@pytest.mark.parametrize("budget", [None, 2000], ids=["in-memory", "offload"])
def test_nan_from_a_served_layer_raises_naming_it(poisoned, budget):
    model, sidecar, layer = poisoned
    # (flash_mode="sparse" under a budget: offload even where the budget would hold stock's model)
    kw = (
        dict(flash_mode="sparse")
        if budget is None
        else dict(ram_budget_mb=budget, flash_speculative=False, flash_mode="sparse")
    )
    llm = llamaflash.Llama(model_path=str(model), sidecar_path=str(sidecar), **kw, **KW)
    with pytest.raises(NonFiniteOutputError, match=rf"layer {layer}'s FFN output: token 0, value \d+ is NaN"):
        _decode(llm)
    llm.close()
