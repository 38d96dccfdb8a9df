"""Quality measured with llamaflash's own sparse lane, the converter's quality method ("engine").

The converter writes a *measurement sidecar* (the sidecar it is about to produce, with the
thresholds of every analysed level in its threshold table but no quality record yet) to a
hidden temporary file beside the output (:func:`measurement_sidecar`; removed however the
measurement ends, never under the final name), opens :class:`EngineRunner` on it and
evaluates each level with ``set_flash_sparsity``. ``flash_max_sparse_tokens = n_ctx`` sends
every evaluated batch through the sparse lane token by token, exactly as decode computes each
token (gate by ggml, then the kernel's active-neuron up/down with the sidecar's ``ffn_down_t``);
nothing runs on the dense lane (checked after every level). The active fraction comes from the
lane's own counters.

The engine selects active neurons gate-first in every layer, so what is measured is gate-first.

When the measurement cannot run, the errors name the way out: a fixed ``--sparsity`` with
``--no-quality`` converts without measuring (:data:`WITHOUT_MEASUREMENT`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from llamaflash.converters.writer import held
from llamaflash.errors import ConversionError, LlamaflashError

#: How to convert when the quality measurement cannot run (the end of the errors below).
WITHOUT_MEASUREMENT = (
    "convert with a fixed sparsity and no measurement instead (`llamaflash convert MODEL --sparsity 0.3 --no-quality`)"
)


@contextmanager
def measurement_sidecar(out: Path, write: Callable[[Path], object]) -> Iterator[Path]:
    """``write(path)`` a measurement sidecar at a hidden temporary path beside ``out``
    (``.<out name>.quality-<pid>``), yield the path while holding its lock (in use, see
    :func:`~llamaflash.converters.writer.held`), and remove it afterwards whatever happens."""
    path = out.with_name(f".{out.name}.quality-{os.getpid()}")
    try:
        try:
            write(path)
        except ConversionError as exc:  # name the output the user asked for, not the hidden file
            raise ConversionError(
                f"{out}: the quality measurement needs a temporary sidecar beside it ({path.name}) and writing "
                f"it failed ({exc.__cause__ or exc}); nothing was written. Check free disk space (one more "
                f"sidecar's size) and permissions, then retry, or {WITHOUT_MEASUREMENT}."
            ) from exc
        with held(path):
            yield path
    finally:
        path.unlink(missing_ok=True)


class EngineRunner:
    """``llamaflash.Llama`` on a sidecar in sparse mode, every batch of up to ``n_ctx`` tokens on
    the sparse lane; :meth:`decode` has :meth:`LlamaRunner.decode`'s contract (tokens from an
    empty context → logits of every position)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        sidecar_path: str | os.PathLike[str],
        n_ctx: int,
        level: float,
        n_threads: int,
    ) -> None:
        from llamaflash.runtime.llama import Llama  # loads the native extension only when measuring

        self.n_ctx = n_ctx
        try:
            self.llm = Llama(
                model_path=os.fspath(model_path),
                sidecar_path=os.fspath(sidecar_path),
                flash_mode="sparse",
                flash_sparsity=level,
                flash_max_sparse_tokens=n_ctx,
                logits_all=True,
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                verbose=False,
            )
        except LlamaflashError as exc:
            raise ConversionError(
                f"the sparse engine could not run {os.fspath(model_path)} for the quality measurement ({exc}); "
                f"{WITHOUT_MEASUREMENT}"
            ) from exc
        self.llm.reset_flash_stats()

    def set_level(self, level: float) -> None:
        """Switch to the thresholds of ``level`` (a level in the sidecar's table) and reset the counters."""
        self.llm.set_flash_sparsity(level)
        self.llm.reset_flash_stats()

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """One batch from an empty context, all logits; a view of llama.cpp's output buffer valid until
        the next call. Goes below ``Llama.eval`` (same context and batch objects, same calls) so the
        logits are not copied into ``Llama.scores``: for a 262k vocabulary that copy is 1 GiB per
        512-token chunk, and the pages of ``scores`` stay untouched (not resident)."""
        n = len(tokens)
        if not 0 < n <= self.n_ctx:
            raise ValueError(f"decode: {n} tokens, context holds {self.n_ctx}")
        llm = self.llm
        llm.reset()  # Llama's own token count: a later eval() starts from an empty context as well
        llm._ctx.kv_cache_clear()
        llm._batch.set_batch([int(t) for t in tokens], n_past=0, logits_all=True)
        llm._ctx.decode(llm._batch)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n, llm.n_vocab()))

    def active_fraction(self) -> float:
        """Measured fraction of neurons computed per token since the last :meth:`set_level` (mean
        over served layers). Raises :class:`ConversionError` if any FFN ran off the sparse lane
        (the measurement would not be of the sparse computation)."""
        st = self.llm.flash_stats()
        if st["dense_lane_calls"] or st.get("sparse_fallbacks") or not st.get("sparse_lane_calls"):
            raise ConversionError(
                f"the sparse engine did not run every FFN of the measurement on its sparse lane "
                f"(sparse lane calls {st.get('sparse_lane_calls')}, dense lane calls {st['dense_lane_calls']}, "
                f"fallbacks {st.get('sparse_fallbacks')}); {WITHOUT_MEASUREMENT}"
            )
        return float(st["mean_active_fraction"])

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> "EngineRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
