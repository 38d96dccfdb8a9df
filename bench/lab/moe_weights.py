"""Random weights for synthetic Mixture-of-Experts models, with routing shaped on request.

Every tensor is drawn from its own random stream, ``SeedSequence([seed, crc32(name)])``, so a
tensor's values depend only on the seed, the model's sizes and the routing shape: the generator can
stream tensors in any order and the same arguments give byte-identical files.

Two regimes (:class:`RoutingShape`):

* ``structured=False`` ("uniform"): plain random initialisation (every matrix N(0, 1/fan_in)). A
  random router picks experts almost uniformly and independently from token to token: the worst
  case for an expert cache.
* ``structured=True`` ("shaped"): the residual stream h (n_embd coordinates) is laid out as

    h[0]            u: a constant c_u in every token embedding; nothing writes to it afterwards
    h[1 : 1+dT]     T: token content: the token's random embedding plus the experts' outputs
    h[1+dT :]       C: context: written by attention only

  Attention heads are *positional*: q and k read only u (constant), so after RoPE the score of
  query t on key s depends on t - s only. Head i of a KV group peaks at t - s = offsets[i]
  (``sharpness`` = the peak score): it copies the token offsets[i] positions back. V reads T, O
  writes the copies into C through one random map per KV group, so C holds a smoothed window of
  recent tokens and changes slowly from token to token.

  The router row of expert e reads T (fast, token-specific), C with gain ``context`` (slow) and u
  with a bias -``popularity`` * ln(1 + rank_e) (rank_e: the expert's popularity rank, a random
  permutation per layer), all in units of the token part's standard deviation, so ``popularity``
  acts like a Zipf exponent on how often experts are picked and ``context`` sets how much
  consecutive tokens share experts. Top-k selection is invariant to the RMS norm's per-token scale,
  so these ratios carry over to the normalised FFN input.

Magnitudes keep activations O(1): matrices are scaled by 1/sqrt(fan_in), expert outputs by
``EXPERT_GAIN`` and the output projection so that logits have a standard deviation of about
``LOGIT_STD``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Tuple

import numpy as np

from .moe_layout import ROPE_NEOX, ArchInfo, Dims

#: rms of one layer's MoE output per coordinate, relative to the token embedding's (about 1)
EXPERT_GAIN = 1.0
#: standard deviation of the output logits
LOGIT_STD = 3.0
#: attention output scale of the uniform regime: small, so that attention's near-uniform average
#: over the context adds little shared (slowly varying) signal to the residual
UNIFORM_ATTN_GAIN = 0.2
#: rms of one layer's attention output per C coordinate (shaped regime)
CONTEXT_WRITE = 0.3
#: energy of the constant u coordinate relative to the token part's (shaped regime)
U_SHARE = 0.25
#: RoPE frequencies (radians per token) at least this high carry the positional heads
MIN_POSITIONAL_FREQ = 0.2


@dataclass(frozen=True)
class RoutingShape:
    """How routing is shaped; see the module docstring. ``offsets``: how many tokens back the
    heads of each KV group look (cycled over the group's heads). ``expert_rms``: the rms per T
    coordinate that one layer's experts are assumed to add to the residual; the router's token part
    is divided by the resulting growth sqrt(1 + layer * expert_rms^2), so too large a value makes
    routing more skewed and more persistent with depth (measured: 48 layers at 0.3 drifted from
    reuse 0.39 / top-8 0.42 at layer 0 to 0.51 / 0.54 at layer 47)."""

    structured: bool = False
    popularity: float = 0.0
    context: float = 0.0
    offsets: Tuple[int, ...] = (1, 2, 3, 4)
    sharpness: float = 12.0
    expert_rms: float = 0.3

    def __post_init__(self) -> None:
        if self.popularity < 0 or self.context < 0 or self.sharpness <= 0 or self.expert_rms < 0:
            raise ValueError("popularity, context and expert_rms must be >= 0, sharpness > 0")
        if not self.offsets or any(int(k) < 0 for k in self.offsets):
            raise ValueError("offsets must be a non-empty list of non-negative token distances")


#: The named regimes. "shaped" is tuned on the bench preset (qwen3moe, 24 layers, 64 experts, 8
#: used) with the routing recorder; see bench/lab/moe_synth.py for the measured statistics.
REGIMES = {
    "uniform": RoutingShape(structured=False),
    "shaped": RoutingShape(structured=True, popularity=0.7, context=0.4, offsets=(1, 2, 3, 4)),
}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))


def _normal(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out


@dataclass
class WeightMaker:
    """Makes the float32 value of any tensor of one model: ``make(name, shape)``."""

    arch: ArchInfo
    dims: Dims
    shape: RoutingShape
    seed: int
    _layout: Tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        d = self.dims
        d_t = (d.n_embd - 1) // 2
        self._layout = (1, d_t, d.n_embd - 1 - d_t)  # sizes of u, T, C
        if self.shape.structured and min(d_t, self._layout[2]) < 4:
            raise ValueError("the shaped regime needs n_embd >= 9")

    # -- structure -------------------------------------------------------------------------

    @property
    def _t(self) -> slice:
        return slice(1, 1 + self._layout[1])

    @property
    def _c(self) -> slice:
        return slice(1 + self._layout[1], self.dims.n_embd)

    @property
    def _c_u(self) -> float:
        """The constant u coordinate of every embedding."""
        return float(np.sqrt(U_SHARE * self._layout[1]))

    def _x_u(self) -> float:
        """u's coordinate after the first RMS norm (token part's coordinates have variance 1)."""
        d = self.dims
        return self._c_u / float(np.sqrt((self._c_u**2 + self._layout[1]) / d.n_embd))

    def _moe_rms(self) -> float:
        """Approximate rms per T coordinate that one layer's experts add to the residual."""
        return self.shape.expert_rms * EXPERT_GAIN

    def _t_rms(self, layer: int) -> float:
        return float(np.sqrt(1.0 + layer * self._moe_rms() ** 2))

    def _c_rms(self, layer: int) -> float:
        return float(np.sqrt(layer + 1.0)) * CONTEXT_WRITE

    def _rope_pairs(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first index, second index, frequency) of each RoPE pair of a head."""
        hd = self.dims.head_dim
        j = np.arange(hd // 2)
        theta = self.dims.rope_base ** (-2.0 * j / hd)
        if self.arch.rope == ROPE_NEOX:
            return j, j + hd // 2, theta
        return 2 * j, 2 * j + 1, theta

    def _positional(self, offsets) -> Tuple[np.ndarray, np.ndarray]:
        """(q0 per offset [len(offsets), head_dim], k0 [head_dim]) with rms 1 each: after RoPE,
        q0(k)·k0 / sqrt(head_dim) = sqrt(head_dim) * mean_j cos(theta_j (t - s - k)) over the
        active pairs j, largest (sqrt(head_dim)) at t - s = k."""
        hd = self.dims.head_dim
        first, second, theta = self._rope_pairs()
        active = theta >= MIN_POSITIONAL_FREQ
        active[0] = True
        a = np.sqrt(hd / np.count_nonzero(active))
        k0 = np.zeros(hd, np.float32)
        k0[first[active]] = a
        q0 = np.zeros((len(offsets), hd), np.float32)
        for i, k in enumerate(offsets):
            # RoPE turns pair (x0, x1) at position p by p*theta; q = a e^{-i theta k} against
            # k = a gives a^2 cos(theta (t - s - k))
            q0[i, first[active]] = a * np.cos(theta[active] * k)
            q0[i, second[active]] = -a * np.sin(theta[active] * k)
        return q0, k0

    def _head_offsets(self) -> list:
        rep = self.dims.n_head // self.dims.n_head_kv
        return [int(self.shape.offsets[i % len(self.shape.offsets)]) for i in range(rep)]

    # -- tensors -------------------------------------------------------------------------------

    def rng(self, name: str) -> np.random.Generator:
        """The random stream of tensor ``name`` (a function of the seed and the name only)."""
        return _rng(self.seed, name)

    def expert_law(self, name: str, shape: Tuple[int, ...]) -> Tuple[float, np.ndarray | None]:
        """(standard deviation, zero rows) of a routed expert matrix ``ffn_{gate,up,down}_exps``
        as :meth:`make` draws it: zero rows is bool [n_embd] broadcast over [..., n_embd] rows of
        ``ffn_down_exps`` in the shaped regime (only T is written), else None. For writers that make
        the values themselves (random quantized blocks)."""
        kind = name.split(".")[-2]
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            return 1.0 / float(np.sqrt(self.dims.n_embd)), None
        if kind == "ffn_down_exps":
            std = EXPERT_GAIN / float(np.sqrt(shape[-1]))
            if not self.shape.structured:
                return std, None
            zero = np.ones(self.dims.n_embd, bool)
            zero[self._t] = False
            return std, zero
        raise ValueError(f"{name} is not a routed expert matrix")

    def make(self, name: str, shape: Tuple[int, ...]) -> np.ndarray:
        rng = _rng(self.seed, name)
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        kind = name.split(".")[-2] + "." + name.split(".")[-1] if layer >= 0 else name
        d = self.dims
        s = self.shape.structured
        if kind.endswith("norm.weight") and kind not in ("attn_q_norm.weight", "attn_k_norm.weight"):
            return np.ones(shape, np.float32)
        if name == "token_embd.weight":
            if not s:
                return _normal(rng, shape, 1.0)
            out = np.zeros(shape, np.float32)
            out[:, 0] = self._c_u
            out[:, self._t] = _normal(rng, (shape[0], self._layout[1]), 1.0)
            return out
        if name == "output.weight":
            return _normal(rng, shape, LOGIT_STD / np.sqrt(d.n_embd))
        if kind in ("attn_q_norm.weight", "attn_k_norm.weight"):
            if not s:
                return np.ones(shape, np.float32)
            # q and k have rms 1 after the norm; the weight sets the peak score
            return np.full(shape, np.sqrt(self.shape.sharpness / np.sqrt(d.head_dim)), np.float32)
        if kind == "attn_q.weight":
            return self._attn_qk(rng, shape, query=True)
        if kind == "attn_k.weight":
            return self._attn_qk(rng, shape, query=False)
        if kind == "attn_v.weight":
            if not s:
                return _normal(rng, shape, 1.0 / np.sqrt(d.n_embd))
            out = np.zeros(shape, np.float32)
            out[:, self._t] = _normal(rng, (shape[0], self._layout[1]), 1.0 / np.sqrt(self._layout[1]))
            return out
        if kind == "attn_output.weight":
            return self._attn_output(rng, shape)
        if kind == "attn_output.bias":
            return np.zeros(shape, np.float32)
        if kind == "attn_sinks.weight":
            return np.zeros(shape, np.float32)
        if kind == "ffn_gate_inp.weight":
            return self._router(rng, shape, layer)
        if kind == "ffn_gate_inp.bias":
            return self._router_bias(layer) if s else np.zeros(shape, np.float32)
        if kind in (
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_gate_shexp.weight",
            "ffn_up_shexp.weight",
            "ffn_gate_inp_shexp.weight",
        ):
            return _normal(rng, shape, 1.0 / np.sqrt(d.n_embd))
        if kind in ("ffn_down_exps.weight", "ffn_down_shexp.weight"):
            return self._down(rng, shape)
        if kind.endswith("_exps.bias"):
            return _normal(rng, shape, 0.1)
        raise ValueError(f"no weights defined for tensor {name}")

    def _attn_qk(self, rng, shape, query: bool) -> np.ndarray:
        d = self.dims
        if not self.shape.structured:
            return _normal(rng, shape, 1.0 / np.sqrt(d.n_embd))
        q0, k0 = self._positional(self._head_offsets())
        out = np.zeros(shape, np.float32)
        if self.arch.qk_norm:
            scale = 1.0  # the q/k norms normalise; their weights set the peak score
        else:
            # q = W x with x[0] ~ x_u: peak score sharpness at the first layer's x_u
            scale = np.sqrt(self.shape.sharpness / np.sqrt(d.head_dim)) / self._x_u()
        if query:
            rep = len(q0)
            for h in range(d.n_head):
                out[h * d.head_dim : (h + 1) * d.head_dim, 0] = q0[h % rep] * scale
        else:
            for g in range(d.n_head_kv):
                out[g * d.head_dim : (g + 1) * d.head_dim, 0] = k0 * scale
        return out

    def _attn_output(self, rng, shape) -> np.ndarray:
        d = self.dims
        if not self.shape.structured:
            return _normal(rng, shape, UNIFORM_ATTN_GAIN / np.sqrt(shape[1]))
        rep = d.n_head // d.n_head_kv
        out = np.zeros(shape, np.float32)
        for g in range(d.n_head_kv):
            # one map per KV group: every head of the group writes its copy through it
            a = _normal(rng, (self._layout[2], d.head_dim), CONTEXT_WRITE / np.sqrt(d.head_dim))
            for h in range(g * rep, (g + 1) * rep):
                out[self._c, h * d.head_dim : (h + 1) * d.head_dim] = a / np.sqrt(rep)
        return out

    def _popularity_bias(self, layer: int) -> np.ndarray:
        """-popularity * ln(1 + rank) per expert, centred; ranks a random permutation per layer."""
        n = self.dims.n_expert
        rank = _rng(self.seed, f"blk.{layer}.expert_rank").permutation(n)
        bias = -self.shape.popularity * np.log1p(rank.astype(np.float64))
        return (bias - bias.mean()).astype(np.float32)

    def _router(self, rng, shape, layer: int) -> np.ndarray:
        d = self.dims
        if not self.shape.structured:
            return _normal(rng, shape, 1.0 / np.sqrt(d.n_embd))
        out = np.zeros(shape, np.float32)
        d_t, d_c = self._layout[1], self._layout[2]
        out[:, self._t] = _normal(rng, (shape[0], d_t), 1.0 / (np.sqrt(d_t) * self._t_rms(layer)))
        out[:, self._c] = _normal(rng, (shape[0], d_c), self.shape.context / (np.sqrt(d_c) * self._c_rms(layer)))
        if not self.arch.expert_bias:
            out[:, 0] = self._popularity_bias(layer) / self._c_u
        return out

    def _router_bias(self, layer: int) -> np.ndarray:
        """gpt-oss has a router bias: the popularity bias goes there (in x units, at layer 0's scale)."""
        return self._popularity_bias(layer) * np.float32(self._x_u() / self._c_u)

    def _down(self, rng, shape) -> np.ndarray:
        n_ff = shape[-1]
        std = EXPERT_GAIN / np.sqrt(n_ff)
        if not self.shape.structured:
            return _normal(rng, shape, std)
        out = np.zeros(shape, np.float32)
        out[..., self._t, :] = _normal(rng, shape[:-2] + (self._layout[1], n_ff), std)
        return out
