"""Calibration and validation text: where it comes from, how it is cut into model-sized chunks,
and when it is too short.

* Calibration (profiling neuron statistics and thresholds): by default the heads of all
  documents of the registry corpus ``calibration`` (English essays + code in 23 languages,
  :func:`llamaflash.files.assets.train_text`), fetched once and cached in ``~/.cache/llamaflash``;
  or a user file (``--calib``). ``n_tokens`` tokens are taken as evenly spaced windows over the
  whole text, so a corpus of several domains is covered evenly.
* Validation (perplexity for ``--sparsity auto``): by default the held-out tails of Shakespeare's
  plays (:func:`llamaflash.files.assets.held_out_text`), never used for calibration; or a user file.

Each chunk starts with the model's BOS token (when it adds one) and holds at most ``chunk_len``
tokens in all.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamaflash.errors import CalibrationError

#: Registry texts used by default.
DEFAULT_CALIBRATION_TEXT = "calibration"
DEFAULT_VALIDATION_TEXT = "shakespeare"

#: A calibration text must give at least this many tokens, and at least 2 * n_embd (each layer's
#: statistics then rest on more FFN inputs than an input has dimensions, held-out ones included).
MIN_CALIBRATION_TOKENS = 1024
#: Minimum validation tokens for a perplexity worth the name.
MIN_VALIDATION_TOKENS = 256
#: The held-out Shakespeare text has ~500k characters; never ask for more than this.
MAX_VALIDATION_CHARS = 400_000


def required_calibration_tokens(n_embd: int) -> int:
    """Calibration tokens a model of width ``n_embd`` needs at least."""
    return max(MIN_CALIBRATION_TOKENS, 2 * n_embd)


@dataclass(frozen=True)
class TextSource:
    """A text and a description of where it came from (recorded in the sidecar and the report)."""

    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def read_text_file(path: str | Path, what: str) -> TextSource:
    """A user-given text file (UTF-8), as a :class:`TextSource`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(f"{path}: no such {what} file. Pass an existing UTF-8 text file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path}: cannot read the {what} text ({exc}). Pass a UTF-8 text file.") from exc
    return TextSource(text, f"file:{path}")


def default_calibration(cache_dir: Path | None = None) -> TextSource:
    """The registry calibration corpus (document heads), fetched and cached on first use."""
    from llamaflash.files import assets

    text = assets.train_text(DEFAULT_CALIBRATION_TEXT, cache_dir=cache_dir)
    spec = assets.TEXTS[DEFAULT_CALIBRATION_TEXT]
    return TextSource(text, f"registry:{DEFAULT_CALIBRATION_TEXT} ({spec.requirement}, document heads)")


def default_validation(n_chars: int, cache_dir: Path | None = None) -> TextSource:
    """The first ``n_chars`` characters (or all) of the registry's held-out Shakespeare text."""
    from llamaflash.files import assets

    text = assets.held_out_text(DEFAULT_VALIDATION_TEXT, min(n_chars, MAX_VALIDATION_CHARS), cache_dir=cache_dir)
    spec = assets.TEXTS[DEFAULT_VALIDATION_TEXT]
    return TextSource(text, f"registry:{DEFAULT_VALIDATION_TEXT} ({spec.requirement}, held-out tails)")


#: Characters taken per calibration window, per token wanted (generous: byte-level vocabularies
#: give about one token per character, BPE vocabularies three to five characters per token).
_WINDOW_CHARS_PER_TOKEN = 8


def calibration_tokens(tokenize, text: str, n_tokens: int, per_chunk: int) -> list[np.ndarray]:
    """Token windows of ``text`` to profile: ``tokenize(str) -> int32 array``.

    A text short enough is tokenized whole (one window). A long one (a corpus) is cut into
    ``ceil(n_tokens / per_chunk)`` evenly spaced character windows, each starting at a line start
    and long enough for ``per_chunk`` tokens; each window is tokenized on its own (so a 2 MB corpus
    costs a few dozen KB of tokenization) and cut to ``per_chunk`` tokens.
    """
    n_windows = max(1, math.ceil(n_tokens / per_chunk))
    window = per_chunk * _WINDOW_CHARS_PER_TOKEN
    if len(text) <= 2 * n_windows * window:
        return [tokenize(text)]
    out = []
    for start in np.linspace(0, len(text) - window, n_windows).astype(np.int64):
        nl = text.find("\n", int(start), int(start) + window // 4)
        begin = int(start) if nl < 0 else nl + 1
        out.append(tokenize(text[begin : begin + window])[:per_chunk])
    return out


def calibration_chunks(
    windows: list[np.ndarray],
    n_tokens: int,
    chunk_len: int,
    bos: int | None,
    needed: int,
    source: TextSource,
    model: str,
) -> list[np.ndarray]:
    """Cut the token ``windows`` of the calibration text (:func:`calibration_tokens`, no BOS)
    into chunks for profiling.

    Takes ``n_tokens`` text tokens in all (every token if the text has fewer), as evenly spaced
    pieces of ``chunk_len - 1`` tokens (``chunk_len`` with BOS). Raises :class:`CalibrationError`
    when the text has fewer than ``needed`` tokens, saying how much is needed.
    """
    per_chunk = chunk_len - (1 if bos is not None else 0)
    if len(windows) > 1:  # a corpus, already cut into windows of per_chunk tokens
        total = int(sum(w.size for w in windows))
        if total >= needed:
            return [
                np.concatenate([[bos], w]).astype(np.int32) if bos is not None else w.astype(np.int32)
                for w in windows
                if w.size >= 1
            ]
        tokens = np.concatenate(windows)
    else:
        tokens = windows[0]
    total = int(tokens.size)
    if total < needed:
        chars_per_token = len(source.text) / total if total else 4.0
        raise CalibrationError(
            f"calibration text ({source.source}) is too short for {model}: it has {total} tokens, "
            f"the model needs at least {needed} (2 x n_embd, and at least {MIN_CALIBRATION_TOKENS}); "
            f"give a longer text with --calib: about {math.ceil(needed * chars_per_token)} characters "
            f"of text like this one ({chars_per_token:.1f} characters per token)."
        )
    take = min(total, n_tokens)
    n_chunks = max(1, math.ceil(take / per_chunk))
    if take >= total:  # the whole text, in consecutive chunks
        starts = np.arange(0, total, per_chunk)
    else:
        starts = np.linspace(0, total - per_chunk, n_chunks).astype(np.int64)
    return _chunks(tokens, starts, per_chunk, bos)


def validation_chunks(
    tokens: np.ndarray,
    n_tokens: int,
    chunk_len: int,
    bos: int | None,
    source: str,
    model: str,
) -> list[np.ndarray]:
    """The first ``n_tokens`` tokens of the validation text, in consecutive chunks of ``chunk_len``
    (BOS first). Raises :class:`CalibrationError` when fewer than
    :data:`MIN_VALIDATION_TOKENS` tokens exist."""
    if tokens.size < MIN_VALIDATION_TOKENS:
        raise CalibrationError(
            f"validation text ({source}) is too short for {model}: {tokens.size} tokens, at least "
            f"{MIN_VALIDATION_TOKENS} are needed; give a longer text with --valid."
        )
    tokens = tokens[:n_tokens]
    per_chunk = chunk_len - (1 if bos is not None else 0)
    return _chunks(tokens, range(0, tokens.size, per_chunk), per_chunk, bos)


def _chunks(tokens: np.ndarray, starts, per_chunk: int, bos: int | None) -> list[np.ndarray]:
    """int32 windows tokens[start:start + per_chunk], BOS first when given; windows of fewer than
    2 tokens (nothing to predict) are dropped."""
    chunks = []
    for start in starts:
        piece = tokens[start : start + per_chunk]
        if bos is not None:
            piece = np.concatenate([[bos], piece])
        if piece.size >= 2:
            chunks.append(piece.astype(np.int32))
    return chunks
