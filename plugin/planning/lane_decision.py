"""What `llamaflash.Llama` does by default in memory (no `ram_budget_mb`): stock or the sparse lane,
decided once per (sidecar, machine) by measurement and stored beside the sidecar.

Contract of the default:
  * It is never slower than stock llama.cpp. Unless a stored measurement for *this* sidecar on
    *this* machine showed the sparse lane at least `DECODE_MARGIN` faster at decode and not slower
    at prefill than stock, the model runs as stock: nothing is claimed, no split is added, the
    llamaflash backend is not even registered.
  * It is deterministic. The choice is read from the stored measurement at load and fixed for the
    life of the model; nothing is timed at run time, so outputs never depend on machine noise.
  * It is visible: `Llama.flash_stats()["decision"]`, `llamaflash inspect SIDECAR`.

The measurement (`measure`, `llamaflash tune MODEL`) runs stock and the sparse lane alternately, each
run in a fresh process (the benchmark worker, `llamaflash.bench.benchkit.timed_run`), `reps` times each,
and compares medians. It is stored in
`<sidecar>.tuning.json`, a JSON object keyed by `machine_key()`, so one sidecar shared between
machines keeps one decision per machine. An entry is valid only for the sidecar it measured (size
and mtime recorded): re-converting invalidates it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

#: The sparse lane becomes the default only when its median decode speed is at least this multiple
#: of stock's, measured in the same run (a margin over the few-percent noise of a quiet machine).
DECODE_MARGIN = 1.03
#: ... and its median prefill speed (prompt batches run on llamaflash's dense lane) at least this.
PREFILL_MARGIN = 0.99
#: CPU features that change which kernels ggml and llamaflash run.
_ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avxvnni",
    "amx_tile",
    "asimd",
    "sve",
)

STOCK = "stock"
SPARSE = "sparse"


def machine_key() -> str:
    """A short id of what makes speed comparable: CPU model and ISA features, core count, and the
    versions of llama-cpp-python and llamaflash (read from the installed distribution, so that a
    stored decision is found without loading llama.cpp)."""
    from .. import __version__

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    cpu = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                if key in ("flags", "Features") and cpu:
                    break
    except OSError:
        pass
    isa = ",".join(f for f in _ISA_FLAGS if f in flags)
    import importlib.metadata  # here, not at import: loading a model never needs it

    llama_cpp_version = importlib.metadata.version("llama_cpp_python")
    text = f"{cpu}|{isa}|{os.cpu_count()}|llama-cpp-python {llama_cpp_version}|llamaflash {__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tuning_path(sidecar: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(sidecar)}.tuning.json")


@dataclass
class Decision:
    """The default lane for one sidecar on one machine. `lane`: "stock" or "sparse". `measured`:
    False when no measurement exists (then `lane` is "stock"). `reason`: one sentence for users."""

    lane: str
    measured: bool
    reason: str
    machine: str = ""
    decode_ratio: Optional[float] = None
    prefill_ratio: Optional[float] = None
    detail: Dict = field(default_factory=dict)

    def as_dict(self) -> Dict:
        return dataclasses.asdict(self)


def _sidecar_stamp(sidecar: Path) -> Dict[str, int]:
    st = sidecar.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_entries(sidecar: Path) -> Dict:
    path = tuning_path(sidecar)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stored_decision(sidecar: str | os.PathLike, machine: Optional[str] = None) -> Decision:
    """The default lane for `sidecar` on this machine (or `machine`): the stored measurement when one
    is valid, else stock with the reason."""
    sidecar = Path(sidecar)
    machine = machine or machine_key()
    entry = _read_entries(sidecar).get(machine)
    if not isinstance(entry, dict):
        return Decision(
            STOCK,
            False,
            "running as stock: the sparse lane has not been measured on this machine "
            "(`llamaflash tune` measures it and stores the result beside the sidecar)",
            machine,
        )
    if entry.get("sidecar") != _sidecar_stamp(sidecar):
        return Decision(
            STOCK,
            False,
            "running as stock: the stored measurement is of an earlier version of the "
            "sidecar (`llamaflash tune` measures it again)",
            machine,
        )
    try:
        return Decision(
            **{
                k: entry[k]
                for k in ("lane", "measured", "reason", "machine", "decode_ratio", "prefill_ratio", "detail")
            }
        )
    except (KeyError, TypeError):
        return Decision(
            STOCK,
            False,
            "running as stock: the stored measurement is unreadable (`llamaflash tune` measures it again)",
            machine,
        )


def store_decision(sidecar: str | os.PathLike, decision: Decision) -> Path:
    """Writes `decision` into `<sidecar>.tuning.json` under its machine key (atomically; other
    machines' entries are kept)."""
    sidecar = Path(sidecar)
    entries = _read_entries(sidecar)
    entries[decision.machine] = {
        **decision.as_dict(),
        "sidecar": _sidecar_stamp(sidecar),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = tuning_path(sidecar)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def decide(stock: Dict[str, List[float]], sparse: Dict[str, List[float]], machine: str) -> Decision:
    """The rule, on per-run speeds {"decode": [...], "prefill": [...]} (tok/s) of both engines."""
    if min(stock["decode"] + stock["prefill"] + sparse["decode"] + sparse["prefill"], default=0) <= 0:
        raise ValueError(f"a measurement has no speed (stock {stock}, sparse {sparse}): nothing to decide on")
    import statistics

    d = statistics.median(sparse["decode"]) / statistics.median(stock["decode"])
    p = statistics.median(sparse["prefill"]) / statistics.median(stock["prefill"])
    detail = {"stock": stock, "sparse": sparse, "decode_margin": DECODE_MARGIN, "prefill_margin": PREFILL_MARGIN}
    if d >= DECODE_MARGIN and p >= PREFILL_MARGIN:
        return Decision(
            SPARSE,
            True,
            f"sparse lane: measured {d:.2f}x stock decode and {p:.2f}x prefill on this "
            f"machine (lossy: the sidecar's operating point)",
            machine,
            d,
            p,
            detail,
        )
    return Decision(
        STOCK,
        True,
        f"running as stock: the sparse lane measured {d:.2f}x stock decode and {p:.2f}x "
        f"prefill on this machine (needs >= {DECODE_MARGIN:.2f}x and >= {PREFILL_MARGIN:.2f}x)",
        machine,
        d,
        p,
        detail,
    )


#: Prompt tokens of a speed measurement: a realistic prompt length (prefill runs as one batch);
#: the content does not matter for speed.
SPEED_PROMPT_TOKENS = 200


def measure(
    model: str | os.PathLike,
    sidecar: str | os.PathLike,
    reps: int = 5,
    n_threads: int = 2,
    max_tokens: int = 48,
    echo: Callable[[str], None] = lambda s: None,
    store: bool = True,
) -> Decision:
    """Measures stock against the sparse lane (the sidecar's operating point) on this machine,
    alternating the two, `reps` runs each in fresh processes; decides by `decide` and stores it."""
    from ..bench import benchkit

    model, sidecar = os.fspath(model), Path(sidecar)
    speeds: Dict[str, Dict[str, List[float]]] = {e: {"decode": [], "prefill": []} for e in (STOCK, SPARSE)}
    prompt = benchkit.prompt_tokens(model, SPEED_PROMPT_TOKENS)
    engines = {STOCK: {"config": "stock"}, SPARSE: {"config": "sparse", "sidecar_path": str(sidecar)}}
    for rep in range(reps):
        for engine in (STOCK, SPARSE) if rep % 2 == 0 else (SPARSE, STOCK):
            r = benchkit.timed_run(model, prompt=prompt, n_gen=max_tokens, threads=n_threads, **engines[engine])
            speeds[engine]["decode"].append(r["decode_tps"])
            speeds[engine]["prefill"].append(r["prefill_tps"])
            echo(
                f"  rep {rep + 1}/{reps} {engine:6}  prefill {r['prefill_tps']:7.1f} tok/s  "
                f"decode {r['decode_tps']:6.1f} tok/s"
            )
    decision = decide(speeds[STOCK], speeds[SPARSE], machine_key())
    if store:
        store_decision(sidecar, decision)
    return decision
