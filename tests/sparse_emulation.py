"""A reference sparse FFN inside stock llama.cpp, for tests: the activations of the neurons the
sparse lane skips are zeroed before the down projection.

:class:`SparseFfnEmulator` is a :class:`~llamaflash.converters.llama_runner.Hook`: per configured
layer it captures llama.cpp's ``ffn_gate-L`` (g = gate·x) and rewrites the gated activation
act(g)·(up·x) with the entries of neurons where |act(g_i)| <= the layer's threshold set to 0
(NumPy, written back before the down projection). The result equals skipping those neurons,
computed with the base model's own down weights (not the sidecar's ``ffn_down_t``) and stock
numerics. ``measured_sparsity`` counts the skipped (token, neuron) fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llamaflash.converters.llama_runner import ACTIVATION_TENSOR_KINDS, KIND_GATE, Hook, activation_fn


@dataclass
class SparseFfnEmulator(Hook):
    activation: str
    thresholds: dict[int, float]  # served layer -> threshold on |act(gate·x)|
    inactive: int = 0
    total: int = 0
    _gate: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._act_kind = ACTIVATION_TENSOR_KINDS[self.activation]
        self._act = activation_fn(self.activation)

    @property
    def measured_sparsity(self) -> float:
        return self.inactive / self.total if self.total else 0.0

    def wants(self, kind: str, layer: int) -> bool:
        return layer in self.thresholds and kind in (self._act_kind, KIND_GATE)

    def seen(self, kind: str, layer: int, data: np.ndarray) -> np.ndarray | None:
        if kind == KIND_GATE:
            self._gate[layer] = data
            return None
        gate = self._gate.pop(layer)
        if gate.shape != data.shape:
            raise RuntimeError(f"layer {layer}: gate {gate.shape} and activation {data.shape} disagree")
        active = np.abs(self._act(gate)) > self.thresholds[layer]
        self.inactive += int(active.size - np.count_nonzero(active))
        self.total += int(active.size)
        data[~active] = 0.0
        return data
