"""The integrity stage: the row checksums of every served layer (the sidecar's integrity section).

Per served layer L it plans, after the layer's bundle and down_t tensors (see ``docs/SIDECAR.md``,
"Integrity"):

* ``blk.L.ffn_crc`` (I32, numpy shape (n_ff, 4)): row k = CRC-32C of bundle row k, of ``ffn_down_t``
  row k, of base ``ffn_gate`` row k and of base ``ffn_up`` row k (``fmt.CHECKSUM_COLUMNS``);
* ``blk.L.ffn_down_crc`` (I32, (n_embd,)): CRC-32C of each base ``ffn_down`` row;

and the file-level key ``llamaflash.integrity.algorithm``. The sidecar's rows are checksummed from
the very bytes written (the writer hands each produced tensor to the stage), the base rows from the
base file as it is now, so a conversion records the base model it read.
"""

from __future__ import annotations

import gguf
import numpy as np

from llamaflash.converters.writer import PlannedTensor, SidecarPlan
from llamaflash.files import sidecar_format as fmt
from llamaflash.files.gguf_model import BaseModelInfo, FfnLayer, read_tensor_rows


def row_checksums(rows: np.ndarray) -> np.ndarray:
    """uint32 CRC-32C of each row of a 2-D array (any dtype: its raw bytes, rows C-contiguous)."""
    from llamaflash import _native  # the C++ CRC-32C (SSE4.2 where the CPU has it)

    data = np.ascontiguousarray(rows)
    n_rows = data.shape[0]
    if n_rows == 0:
        return np.zeros(0, dtype=np.uint32)
    return _native.crc32c_rows(data.reshape(-1).view(np.uint8), data.nbytes // n_rows)


class IntegrityStage:
    """Plans the checksum tensors of every served layer; must come after the stage that plans the
    layer's bundle and down_t (:class:`~llamaflash.converters.bundle.BundleStage`)."""

    #: The section may be held by any format (optional before 3); see ``plan_sidecar``.
    min_format_version = 1

    def __init__(self) -> None:
        self._header_done = False

    def plan_layer(self, model: BaseModelInfo, ffn: FfnLayer, plan: SidecarPlan) -> None:
        if not self._header_done:
            plan.set_string(fmt.KEY_INTEGRITY_ALGORITHM, fmt.INTEGRITY_ALGORITHM)
            self._header_done = True
        seen: dict[str, np.ndarray] = {}
        for column, name in (
            ("bundle", fmt.bundle_tensor_name(ffn.layer)),
            ("down_t", fmt.down_t_tensor_name(ffn.layer)),
        ):
            planned = next(t for t in plan.tensors if t.name == name)
            n_rows = planned.shape[0]
            plan.observe_tensor(
                name,
                lambda data, column=column, n_rows=n_rows: seen.__setitem__(
                    column, row_checksums(data.reshape(n_rows, -1))
                ),
            )

        def table() -> np.ndarray:
            missing = [c for c in ("bundle", "down_t") if c not in seen]
            if missing:
                raise RuntimeError(f"layer {ffn.layer}: {', '.join(missing)} not written before its checksums")
            out = np.empty((ffn.n_ff, len(fmt.CHECKSUM_COLUMNS)), dtype=np.uint32)
            out[:, 0] = seen["bundle"]
            out[:, 1] = seen["down_t"]
            out[:, 2] = row_checksums(read_tensor_rows(model.path, ffn.gate))
            out[:, 3] = row_checksums(read_tensor_rows(model.path, ffn.up))
            return out.view(np.int32)

        plan.add_tensor(
            PlannedTensor(
                name=fmt.checksum_tensor_name(ffn.layer),
                ggml_type=gguf.GGMLQuantizationType.I32,
                shape=(ffn.n_ff, len(fmt.CHECKSUM_COLUMNS)),
                produce=table,
                layer=ffn.layer,
            )
        )
        plan.add_tensor(
            PlannedTensor(
                name=fmt.base_down_checksum_tensor_name(ffn.layer),
                ggml_type=gguf.GGMLQuantizationType.I32,
                shape=(ffn.n_embd,),
                produce=lambda: row_checksums(read_tensor_rows(model.path, ffn.down)).view(np.int32),
                layer=ffn.layer,
            )
        )
