"""The expert sidecar of an MoE model: its format (the one source of truth for its keys and tensor
names), writing it atomically, reading it, and checking it against the base model.

A GGUF file (``<model stem>.flash.gguf`` beside the model, like the dense sidecar) with
``general.architecture = "llamaflash-experts"``. Metadata:

    llamaflash.experts.format_version   u32   EXPERT_FORMAT_VERSION
    llamaflash.experts.base_identity    str   gguf_model.base_identity of the base file
    llamaflash.experts.base_architecture str
    llamaflash.experts.base_file_size   u64
    llamaflash.experts.n_expert         u32   per layer (all MoE layers share it)
    llamaflash.experts.n_used           u32
    llamaflash.experts.layers           i32[] served layers, in order
    llamaflash.experts.checksum         str   "crc32c"
    llamaflash.experts.routing_tokens   u32   calibration tokens the routing statistics come from (0: none)
    llamaflash.experts.routing_source   str   what the calibration text was

Tensors, per served layer L (n_expert = E):

    blk.L.exps_crc.<kind>    i32 [E]  CRC-32C of each expert's slice of blk.L.ffn_<kind>_exps.weight
                                      (the u32 bit pattern), kind in gate/up/down/gate_up
    blk.L.exps_count         f32 [E]  how often each expert was selected on the calibration text
    blk.L.exps_reuse         f32 [1]  share of a token's experts the previous token also used

The base model's expert bytes are not copied: the engine reads each expert's slice straight from the
base file (one contiguous range per expert tensor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SidecarFormatError, SidecarMismatchError, SidecarVersionError
from . import ggml_types
from .experts import EXPERT_KINDS, MoeModelInfo
from .gguf_header import GGUFHeaderError, TensorInfo, ValueType, read_gguf_header

ARCHITECTURE = "llamaflash-experts"
EXPERT_FORMAT_VERSION = 1
CHECKSUM = "crc32c"

KEY_VERSION = "llamaflash.experts.format_version"
KEY_IDENTITY = "llamaflash.experts.base_identity"
KEY_BASE_ARCH = "llamaflash.experts.base_architecture"
KEY_BASE_SIZE = "llamaflash.experts.base_file_size"
KEY_N_EXPERT = "llamaflash.experts.n_expert"
KEY_N_USED = "llamaflash.experts.n_used"
KEY_LAYERS = "llamaflash.experts.layers"
KEY_CHECKSUM = "llamaflash.experts.checksum"
KEY_ROUTING_TOKENS = "llamaflash.experts.routing_tokens"
KEY_ROUTING_SOURCE = "llamaflash.experts.routing_source"


def crc_tensor_name(layer: int, kind: str) -> str:
    return f"blk.{layer}.exps_crc.{kind}"


def count_tensor_name(layer: int) -> str:
    return f"blk.{layer}.exps_count"


def reuse_tensor_name(layer: int) -> str:
    return f"blk.{layer}.exps_reuse"


@dataclass(frozen=True)
class ExpertLayerStats:
    layer: int
    checksums: dict[str, np.ndarray]  # kind -> uint32 [n_expert]
    counts: np.ndarray  # float32 [n_expert]: selections on calibration text (zeros: none)
    reuse: float  # previous-token reuse on calibration text (nan: unknown)


@dataclass(frozen=True)
class ExpertSidecarInfo:
    path: Path
    format_version: int
    base_identity: str
    base_architecture: str
    base_file_size: int
    n_expert: int
    n_used: int
    routing_tokens: int
    routing_source: str
    layers: tuple[ExpertLayerStats, ...]


def is_expert_sidecar(path: str | os.PathLike) -> bool:
    """True when ``path`` is a GGUF whose architecture is the expert sidecar's."""
    from .gguf_header import read_gguf_header

    try:
        header = read_gguf_header(path)
    except Exception:
        return False
    v = header.metadata.get("general.architecture")
    return v is not None and v.value == ARCHITECTURE


def write_expert_sidecar(
    out: str | os.PathLike,
    moe: MoeModelInfo,
    identity: str,
    checksums: dict[int, dict[str, np.ndarray]],
    counts: dict[int, np.ndarray] | None,
    reuse: dict[int, float] | None,
    routing_tokens: int,
    routing_source: str,
) -> Path:
    """Writes the sidecar to a temporary name beside ``out`` and renames it into place (an interrupted
    write leaves no file under ``out``, and never a partial one)."""
    import gguf

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # the converters' temporary naming (writer.py)
    writer = gguf.GGUFWriter(str(tmp), ARCHITECTURE)
    try:
        writer.add_uint32(KEY_VERSION, EXPERT_FORMAT_VERSION)
        writer.add_string(KEY_IDENTITY, identity)
        writer.add_string(KEY_BASE_ARCH, moe.architecture)
        writer.add_uint64(KEY_BASE_SIZE, moe.file_size)
        writer.add_uint32(KEY_N_EXPERT, moe.n_expert)
        writer.add_uint32(KEY_N_USED, moe.n_used)
        writer.add_array(KEY_LAYERS, [int(layer.layer) for layer in moe.layers])
        writer.add_string(KEY_CHECKSUM, CHECKSUM)
        writer.add_uint32(KEY_ROUTING_TOKENS, int(routing_tokens))
        writer.add_string(KEY_ROUTING_SOURCE, routing_source)
        for layer in moe.layers:
            for t in layer.tensors:
                crc = np.asarray(checksums[layer.layer][t.kind], dtype=np.uint32)
                writer.add_tensor(crc_tensor_name(layer.layer, t.kind), crc.view(np.int32))
            c = counts.get(layer.layer) if counts else None
            writer.add_tensor(
                count_tensor_name(layer.layer),
                np.asarray(c if c is not None else np.zeros(layer.n_expert), dtype=np.float32),
            )
            r = reuse.get(layer.layer, float("nan")) if reuse else float("nan")
            writer.add_tensor(reuse_tensor_name(layer.layer), np.array([r], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_expert_sidecar(path: str | os.PathLike) -> ExpertSidecarInfo:
    """Parses an expert sidecar. Raises SidecarFormatError / SidecarVersionError naming the problem."""
    path = Path(path)
    try:
        header = read_gguf_header(path)
    except GGUFHeaderError as e:
        raise SidecarFormatError(
            f"'{path}' is not a readable GGUF file ({e}); re-create it with `llamaflash convert MODEL --force`"
        ) from None

    def field(key: str, required: bool = True):
        f = header.metadata.get(key)
        if f is None:
            if required:
                raise SidecarFormatError(
                    f"expert sidecar '{path}' lacks '{key}'; re-create it with `llamaflash convert MODEL --force`"
                )
            return None
        if f.type == ValueType.ARRAY:
            if f.value is None:
                raise SidecarFormatError(f"expert sidecar '{path}': '{key}' is not a numeric array; re-create it")
            return [int(v) for v in f.value]
        return f.value

    arch = field("general.architecture")
    if arch != ARCHITECTURE:
        raise SidecarFormatError(f"'{path}' is not an expert sidecar (architecture '{arch}')")
    version = int(field(KEY_VERSION))
    if version != EXPERT_FORMAT_VERSION:
        raise SidecarVersionError(
            f"expert sidecar '{path}' is format {version}; this llamaflash reads format "
            f"{EXPERT_FORMAT_VERSION}: re-create it with `llamaflash convert MODEL --force`"
        )
    tensors = {t.name: _tensor_data(path, t) for t in header.tensors}
    layers = []
    for il in field(KEY_LAYERS):
        crc = {
            kind: tensors[crc_tensor_name(il, kind)].view(np.uint32).copy()
            for kind in EXPERT_KINDS
            if crc_tensor_name(il, kind) in tensors
        }
        counts = tensors.get(count_tensor_name(il))
        reuse = tensors.get(reuse_tensor_name(il))
        if not crc or counts is None:
            raise SidecarFormatError(f"expert sidecar '{path}' lacks the tensors of layer {il}; re-create it")
        layers.append(
            ExpertLayerStats(
                int(il), crc, counts.astype(np.float32), float(reuse[0]) if reuse is not None else float("nan")
            )
        )
    return ExpertSidecarInfo(
        path,
        version,
        str(field(KEY_IDENTITY)),
        str(field(KEY_BASE_ARCH)),
        int(field(KEY_BASE_SIZE)),
        int(field(KEY_N_EXPERT)),
        int(field(KEY_N_USED)),
        int(field(KEY_ROUTING_TOKENS)),
        str(field(KEY_ROUTING_SOURCE, required=False) or ""),
        tuple(layers),
    )


#: numpy dtype of each ggml type an expert sidecar's tensors have
_DTYPES = {ggml_types.I32: np.int32, ggml_types.F32: np.float32}


def _tensor_data(path: Path, t: TensorInfo) -> np.ndarray:
    """A 1-D i32/f32 tensor's values, read from the file (the only types an expert sidecar holds)."""
    dtype = _DTYPES.get(t.ggml_type)
    if dtype is None or len(t.shape) != 1:
        raise SidecarFormatError(
            f"expert sidecar '{path}': tensor '{t.name}' is not a 1-D i32/f32 vector; re-create it"
        )
    return np.fromfile(path, dtype=dtype, count=int(t.shape[0]), offset=t.offset)


def validate_expert_pair(moe: MoeModelInfo, identity: str, info: ExpertSidecarInfo) -> None:
    """Refuses a sidecar made for another model, naming what differs (before llama.cpp loads)."""
    what = []
    if info.base_file_size != moe.file_size:
        what.append(f"file size {info.base_file_size} vs the model's {moe.file_size}")
    if info.n_expert != moe.n_expert or info.n_used != moe.n_used:
        what.append(f"experts {info.n_expert} (using {info.n_used}) vs the model's {moe.n_expert} (using {moe.n_used})")
    layers = [layer.layer for layer in moe.layers]
    if [s.layer for s in info.layers] != layers:
        what.append("the MoE layers differ")
    else:
        for s, layer in zip(info.layers, moe.layers):
            kinds = sorted(t.kind for t in layer.tensors)
            if sorted(s.checksums) != kinds or any(len(v) != layer.n_expert for v in s.checksums.values()):
                what.append(f"layer {layer.layer}'s expert tensors differ")
                break
    if not what and info.base_identity != identity:
        what.append("the model's header or tensor layout (identity hash)")
    if what:
        raise SidecarMismatchError(
            f"expert sidecar '{info.path}' was made for another model than '{moe.path}': "
            f"{'; '.join(what)}. Re-create it with `llamaflash convert {moe.path} --force`."
        )
