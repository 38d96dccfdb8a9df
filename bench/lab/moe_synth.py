"""Synthetic Mixture-of-Experts GGUF models of real llama.cpp architectures, with random weights.

No MoE model can be downloaded here, so this writes one: the tensors and hyperparameters of a real
architecture (``qwen3moe``, ``llama`` with experts as Mixtral, ``gpt-oss``, ``qwen2moe``; see
:mod:`.moe_layout`), a real tokenizer (a vocab-only GGUF of the llama-cpp-python sdist,
:mod:`.moe_vocab`), random weights whose routing can be shaped (:mod:`.moe_weights`), quantized by
llama.cpp's own quantizer. Stock ``llama_cpp.Llama`` loads and runs the result.

How a model is written: every tensor is generated in F32 and written in F16 (F32 for 1-D tensors,
biases and the router) to a temporary GGUF next to the output, one tensor at a time; then
``llama_model_quantize`` writes the requested type (default Q4_K_M) to a second temporary name,
which is renamed onto the output. Both temporaries are removed on any error or interrupt, so the
output path holds either nothing new or a complete model. Same arguments, same bytes.

Usage::

    python -m llamaflash.bench.moe_synth --arch qwen3moe --preset bench --routing shaped -o out.gguf

Presets: ``tiny`` (tests: a few MB, seconds) for every architecture, ``bench`` (qwen3moe, 24 layers,
64 experts of which 8 used, n_embd 1024, expert FFN 768, Q4_K_M, about 2.4 GB). Every size can be
overridden (``--n-layer`` ...).

Full-size presets, written directly in their final types with no F16 intermediate
(:mod:`.moe_direct`: random quantized expert blocks, ggml's quantizer for the rest):
``qwen3-30b-a3b`` (Qwen3-30B-A3B's shape: qwen3moe, 48 layers, 128 experts of which 8 used,
n_embd 2048, 32 heads / 4 KV heads of 128, expert FFN 768, Q4_K experts, about 17 GB) and
``gpt-oss-20b`` (gpt-oss-20b's shape: 24 layers, 32 experts of which 4 used, n_embd 2880, 64 heads /
8 KV heads of 64, expert FFN 2880, MXFP4 experts, Q8_0 elsewhere, sliding window 128; Qwen2's
151936-token vocabulary instead of o200k, and no YaRN scaling: about 12 GB). ``--routing shaped``
takes each preset's own regime (:data:`PRESET_SHAPED`), tuned to the published statistics of the
real model; ``--measure N`` records the routing of N calibration tokens through stock llama.cpp
with plain weights after writing, and prints the statistics.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from . import moe_direct, moe_vocab
from .moe_layout import ARCHS, Dims, hparams, stored_as_f32, tensor_shapes
from .moe_weights import REGIMES, RoutingShape, WeightMaker

#: llama_ftype per quantization name (llama.h of llama-cpp-python 0.3.36).
FTYPES = {
    "F16": 1,
    "Q4_0": 2,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
}
#: block size of each quantization's main type: n_embd and the FFN sizes must divide by it
FTYPE_BLOCK = {"F16": 1, "Q4_0": 32, "Q8_0": 32, "Q5_0": 32, "Q4_K_S": 256, "Q4_K_M": 256, "Q5_K_M": 256, "Q6_K": 256}


@dataclass(frozen=True)
class MoeSpec:
    """Everything a synthetic model depends on; equal specs give byte-identical files."""

    arch: str = "qwen3moe"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64
    n_ff_shexp: int = 128
    n_ctx_train: int = 4096
    rope_base: float = 10000.0
    sliding_window: int = 128
    quant: str = "Q8_0"
    vocab: Optional[str] = None  # default: the architecture's (moe_layout.ARCHS)
    seed: int = 0
    routing: RoutingShape = field(default_factory=RoutingShape)
    #: write quantized blocks directly (moe_direct; ``quant`` names a moe_direct.MIXES entry)
    direct: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCHS:
            problems.append(f"unknown arch {self.arch!r} (known: {', '.join(ARCHS)})")
        if self.direct and self.quant not in moe_direct.MIXES:
            problems.append(f"direct writing knows the mixes {', '.join(moe_direct.MIXES)}, not {self.quant!r}")
        elif not self.direct and self.quant not in FTYPES:
            problems.append(f"unknown quantization {self.quant!r} (known: {', '.join(FTYPES)})")
        if self.vocab is not None and self.vocab not in moe_vocab.VOCABS:
            problems.append(f"unknown vocabulary {self.vocab!r} (known: {', '.join(moe_vocab.VOCABS)})")
        sizes = {
            k: getattr(self, k)
            for k in (
                "n_layer",
                "n_embd",
                "n_head",
                "n_head_kv",
                "head_dim",
                "n_expert",
                "n_expert_used",
                "n_ff_exp",
                "n_ctx_train",
            )
        }
        problems += [f"{k} must be positive" for k, v in sizes.items() if v <= 0]
        if not problems:
            if self.n_head % self.n_head_kv:
                problems.append("n_head must be a multiple of n_head_kv")
            if self.head_dim % 2:
                problems.append("head_dim must be even (RoPE pairs)")
            if self.n_expert_used > self.n_expert:
                problems.append("n_expert_used must not exceed n_expert")
            if self.arch == "llama" and self.head_dim * self.n_head != self.n_embd:
                problems.append("llama needs head_dim * n_head == n_embd")
            block = 1 if self.direct else FTYPE_BLOCK.get(self.quant, 1)
            dims = {"n_embd": self.n_embd, "n_ff_exp": self.n_ff_exp, "head_dim * n_head": self.head_dim * self.n_head}
            if self.arch == "qwen2moe":
                dims["n_ff_shexp"] = self.n_ff_shexp
            bad = [k for k, v in dims.items() if v % block]
            if self.direct and self.quant in moe_direct.MIXES:
                problems += moe_direct.mix_block_problems(moe_direct.MIXES[self.quant], dims)
            if bad:
                problems.append(
                    f"{self.quant} needs {', '.join(bad)} to be multiples of {block}; "
                    f"change them or pick Q8_0 / Q4_0 (blocks of 32)"
                )
        if problems:
            raise ValueError("invalid synthetic MoE model: " + "; ".join(problems))

    @property
    def vocab_name(self) -> str:
        return self.vocab or ARCHS[self.arch].vocab

    def dims(self, n_vocab: int) -> Dims:
        return Dims(
            n_vocab=n_vocab,
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_exp=self.n_ff_exp,
            n_ff_shexp=self.n_ff_shexp,
            n_ctx_train=self.n_ctx_train,
            rope_base=self.rope_base,
            sliding_window=self.sliding_window,
        )


#: Tiny models for tests: a few MB (most of it the embedding table of the real vocabulary).
_TINY = dict(
    n_layer=3,
    n_embd=64,
    n_head=4,
    n_head_kv=2,
    head_dim=16,
    n_expert=8,
    n_expert_used=2,
    n_ff_exp=64,
    n_ff_shexp=64,
    n_ctx_train=4096,
    rope_base=10000.0,
    quant="Q8_0",
)
PRESETS = {
    "tiny": _TINY,
    # the benchmark model: a half-size Qwen3-30B-A3B (same expert FFN, head layout and rope base)
    "bench": dict(
        arch="qwen3moe",
        n_layer=24,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=128,
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=768,
        n_ctx_train=32768,
        rope_base=1_000_000.0,
        quant="Q4_K_M",
    ),
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 30.5B parameters, 3.3B active
    "qwen3-30b-a3b": dict(
        arch="qwen3moe",
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_ctx_train=40960,
        rope_base=1_000_000.0,
        quant="Q4_K_M",
        direct=True,
    ),
    # gpt-oss-20b (config.json of openai/gpt-oss-20b): 21B parameters, 3.6B active
    "gpt-oss-20b": dict(
        arch="gpt-oss",
        n_layer=24,
        n_embd=2880,
        n_head=64,
        n_head_kv=8,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=2880,
        n_ctx_train=131072,
        rope_base=150_000.0,
        sliding_window=128,
        quant="MXFP4",
        direct=True,
    ),
}
#: The shaped regime of each full-size preset, tuned (with the routing recorder, on the preset's
#: widths) toward the real model's published statistics: Qwen3-30B-A3B previous-token reuse 0.38
#: and top-8 of 128 experts carrying 44.5% of a layer's selections; gpt-oss previous-token reuse
#: about 0.18 (top-k share unpublished). The measured values are in docs/MOE.md.
PRESET_SHAPED = {
    "qwen3-30b-a3b": RoutingShape(structured=True, popularity=0.88, context=0.3, offsets=(1, 2, 3, 4), expert_rms=0.18),
    "gpt-oss-20b": RoutingShape(structured=True, popularity=0.2, context=0.1, offsets=(1, 2, 3, 4), expert_rms=0.18),
}


def preset_spec(
    preset: str, arch: Optional[str] = None, routing: str | RoutingShape = "uniform", **overrides
) -> MoeSpec:
    """The spec of ``preset`` for ``arch`` (the preset's own when None) with ``overrides``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    values = dict(PRESETS[preset])
    if arch is not None:
        if "arch" in values and values["arch"] != arch and preset != "tiny":
            raise ValueError(f"the {preset} preset is {values['arch']}; use --preset tiny or give every size")
        values["arch"] = arch
    if values.get("arch") == "llama" and "head_dim" not in overrides:
        values["head_dim"] = overrides.get("n_embd", values["n_embd"]) // overrides.get("n_head", values["n_head"])
    if isinstance(routing, str):
        if routing not in REGIMES:
            raise ValueError(f"unknown routing regime {routing!r} (known: {', '.join(REGIMES)})")
        routing = PRESET_SHAPED[preset] if routing == "shaped" and preset in PRESET_SHAPED else REGIMES[routing]
    values.update({k: v for k, v in overrides.items() if v is not None})
    return MoeSpec(routing=routing, **values)


# --------------------------------------------------------------------------------------------
# writing


def _write_f16_gguf(path: Path, spec: MoeSpec, vocab_path: Path, say: Callable[[str], None]) -> None:
    """The model with every tensor in F16/F32, streamed tensor by tensor."""
    import gguf

    arch = ARCHS[spec.arch]
    tok_meta = moe_vocab.tokenizer_metadata(vocab_path)
    n_vocab = next(len(m.value) for m in tok_meta if m.key == "tokenizer.ggml.tokens")
    dims = spec.dims(n_vocab)
    maker = WeightMaker(arch, dims, spec.routing, spec.seed)
    shapes = tensor_shapes(arch, dims)

    w = gguf.GGUFWriter(path, arch.name)
    try:
        w.add_name(f"synthetic-{arch.name}-moe-L{spec.n_layer}-E{spec.n_expert}x{spec.n_expert_used}")
        w.add_file_type(1)  # mostly F16
        for key, value, kind in hparams(arch, dims):
            full = f"{arch.name}.{key}"
            if kind == "u32":
                w.add_uint32(full, int(value))
            else:
                w.add_float32(full, float(value))
        w.add_string("general.source.synthetic", repr(dataclasses.asdict(spec)))
        for m in tok_meta:
            w.add_key_value(m.key, m.value, m.vtype, m.sub_type)
        for name, shape in shapes:
            dtype = np.float32 if stored_as_f32(name, shape) else np.float16
            w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, shape) in enumerate(shapes):
            data = maker.make(name, shape)
            if not np.all(np.isfinite(data)):
                raise RuntimeError(f"weights of {name} are not finite")
            if not stored_as_f32(name, shape):
                data = data.astype(np.float16)
            w.write_tensor_data(data)
            del data
            if name.endswith("ffn_down_exps.weight"):
                say(f"layer {name.split('.')[1]}/{spec.n_layer} written")
    finally:
        w.close()


def _write_direct_gguf(path: Path, spec: MoeSpec, vocab_path: Path, n_threads: int, say) -> None:
    """The model in its final types, streamed tensor by tensor (moe_direct)."""
    arch = ARCHS[spec.arch]
    tok_meta = moe_vocab.tokenizer_metadata(vocab_path)
    n_vocab = next(len(m.value) for m in tok_meta if m.key == "tokenizer.ggml.tokens")
    dims = spec.dims(n_vocab)
    moe_direct.write_direct(
        path,
        arch.name,
        f"synthetic-{arch.name}-moe-L{spec.n_layer}-E{spec.n_expert}x{spec.n_expert_used}",
        hparams(arch, dims),
        repr(dataclasses.asdict(spec)),
        tok_meta,
        tensor_shapes(arch, dims),
        WeightMaker(arch, dims, spec.routing, spec.seed),
        moe_direct.MIXES[spec.quant],
        stored_as_f32,
        n_threads,
        say,
        spec.n_layer,
    )


def _quantize(src: Path, dst: Path, quant: str, n_threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = n_threads
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {quant}) failed with {rc}")


def generate(
    spec: MoeSpec,
    out: str | os.PathLike,
    cache_dir: Optional[Path] = None,
    local_sdist: Optional[str] = None,
    n_threads: Optional[int] = None,
    progress: bool = False,
) -> Path:
    """Writes the model of ``spec`` to ``out`` (atomically) and returns its path.

    ``cache_dir``: where the verified vocabulary files are cached (default ~/.cache/llamaflash/vocab);
    ``local_sdist``: a local copy of the llama-cpp-python sdist to take them from instead of the index.
    """
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory; give the path of the .gguf file to write")
    if not out.parent.is_dir():
        raise ValueError(f"{out.parent} does not exist; create it first")
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if progress:
            print(f"[moe_synth {time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    vocab_path = moe_vocab.vocab_gguf(spec.vocab_name, cache_dir, local_sdist)
    f16 = out.with_name(f".{out.name}.f16.{os.getpid()}.tmp")
    staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        if spec.direct:
            say(f"writing {spec.arch} {spec.quant} model to {staged} (quantized blocks, no float intermediate)")
            _write_direct_gguf(staged, spec, vocab_path, n_threads or os.cpu_count() or 1, say)
        elif spec.quant == "F16":
            say(f"writing {spec.arch} F16 model to {f16}")
            _write_f16_gguf(f16, spec, vocab_path, say)
            os.replace(f16, staged)
        else:
            say(f"writing {spec.arch} F16 model to {f16}")
            _write_f16_gguf(f16, spec, vocab_path, say)
            say(f"quantizing to {spec.quant}")
            _quantize(f16, staged, spec.quant, n_threads or os.cpu_count() or 1)
        os.replace(staged, out)
    finally:
        for p in (f16, staged):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    say(f"{out}: {out.stat().st_size / 1e6:.1f} MB")
    return out


# --------------------------------------------------------------------------------------------
# command line

_SIZE_FLAGS = (
    "n_layer",
    "n_embd",
    "n_head",
    "n_head_kv",
    "head_dim",
    "n_expert",
    "n_expert_used",
    "n_ff_exp",
    "n_ff_shexp",
    "n_ctx_train",
    "sliding_window",
    "seed",
)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llamaflash.bench.moe_synth",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--arch", choices=sorted(ARCHS), default=None, help="architecture (default: the preset's, else qwen3moe)"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--routing", choices=sorted(REGIMES), default="uniform")
    p.add_argument("--popularity", type=float, help="override the regime's Zipf-like popularity exponent")
    p.add_argument("--context", type=float, help="override the regime's context gain")
    p.add_argument("--offsets", type=str, help="override the positional heads' offsets, e.g. 1,2,3,4")
    p.add_argument("--sharpness", type=float, help="override the positional heads' peak score")
    p.add_argument("--expert-rms", type=float, help="override the regime's assumed expert output rms per layer")
    p.add_argument(
        "--quant",
        choices=sorted(set(FTYPES) | set(moe_direct.MIXES)),
        help="quantization (default: the preset's; the full-size presets take a moe_direct mix)",
    )
    p.add_argument("--vocab", choices=sorted(moe_vocab.VOCABS), help="tokenizer (default: the architecture's)")
    p.add_argument("--rope-base", type=float)
    for name in _SIZE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    p.add_argument("--cache-dir", type=Path, default=None, help="vocabulary cache (default ~/.cache/llamaflash/vocab)")
    p.add_argument(
        "--sdist",
        default=os.environ.get("LLAMAFLASH_LLAMA_CPP_SDIST"),
        help="local llama-cpp-python sdist (default: $LLAMAFLASH_LLAMA_CPP_SDIST, else download)",
    )
    p.add_argument("--threads", type=int, default=None, help="quantizer threads (default: all cores)")
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="N",
        help="after writing, record the routing of N calibration tokens (stock llama.cpp, plain weights) and print it",
    )
    p.add_argument("-o", "--output", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        regime = PRESET_SHAPED.get(a.preset, REGIMES["shaped"]) if a.routing == "shaped" else REGIMES[a.routing]
        changes = {
            k: getattr(a, k) for k in ("popularity", "context", "sharpness", "expert_rms") if getattr(a, k) is not None
        }
        if a.offsets:
            changes["offsets"] = tuple(int(x) for x in a.offsets.split(","))
        if changes:
            regime = dataclasses.replace(regime, structured=True, **changes)
        overrides = {k: getattr(a, k) for k in _SIZE_FLAGS}
        overrides.update(quant=a.quant, vocab=a.vocab, rope_base=a.rope_base)
        spec = preset_spec(a.preset, a.arch, regime, **overrides)
        t0 = time.monotonic()
        path = generate(spec, a.output, a.cache_dir, a.sdist, a.threads, progress=True)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"moe_synth: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("moe_synth: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"{path}\t{path.stat().st_size} bytes\t{time.monotonic() - t0:.1f} s")
    if a.measure:
        print(measure_routing(path, a.measure, a.threads))
    return 0


def measure_routing(path: Path, n_tokens: int, n_threads: Optional[int] = None) -> str:
    """The routing statistics of the model at ``path`` on ``n_tokens`` calibration tokens, one
    paragraph (recorded through stock llama.cpp with plain, file-backed weights)."""
    from llamaflash.converters import moe_routing, moe_routing_stats

    t0 = time.monotonic()
    trace = moe_routing.record_text_routing(
        path,
        n_tokens,
        n_threads=n_threads,
        progress=lambda done, total: print(
            f"[moe_synth routing {time.monotonic() - t0:6.1f}s] {done}/{total} tokens", file=sys.stderr, flush=True
        ),
    )
    s = moe_routing_stats.summarize(trace, 8, [], 0)
    return (
        f"routing (SYNTHETIC, random weights) of {path.name} on {s['n_tokens']} tokens: "
        f"previous-token reuse mean {s['reuse']['mean']:.3f} (min {s['reuse']['min']:.3f}, max {s['reuse']['max']:.3f}; "
        f"random {s['random_reuse']:.3f}); top-8 share mean {s['top_k_share']['mean']:.3f} "
        f"(min {s['top_k_share']['min']:.3f}, max {s['top_k_share']['max']:.3f}) of {s['n_expert']} experts, "
        f"{s['n_used']} used"
    )


if __name__ == "__main__":
    sys.exit(main())
