"""Exceptions raised by llamaflash.

Every exception llamaflash raises on purpose derives from :class:`LlamaflashError`. Its
message is meant for the user as is: it names the file concerned, says what is wrong
with it, and says how to get out (usually which command to run). The command line prints
the message and exits with status 2, without a traceback.

Some classes also derive from a built-in exception so that generic handlers keep
working: a missing file is a :class:`FileNotFoundError`, a bad base model a
:class:`ValueError`.
"""

from __future__ import annotations


class LlamaflashError(Exception):
    """Base of every error llamaflash raises deliberately; the message is user-facing."""


# --------------------------------------------------------------------------------------
# Sidecar problems
# --------------------------------------------------------------------------------------


class SidecarError(LlamaflashError):
    """A sidecar file (``*.flash.gguf``) is missing, unreadable or does not fit its model."""


class SidecarNotFoundError(SidecarError, FileNotFoundError):
    """The sidecar file does not exist."""


class SidecarFormatError(SidecarError):
    """The file is not a well-formed llamaflash sidecar (not GGUF, truncated, wrong
    ``general.architecture``, missing or malformed keys or tensors)."""


class SidecarVersionError(SidecarError):
    """The sidecar's format version is not one this llamaflash can read."""


class SidecarMismatchError(SidecarError):
    """The sidecar was converted from a different base model than the one given."""


# --------------------------------------------------------------------------------------
# Base model problems
# --------------------------------------------------------------------------------------


class BaseModelError(LlamaflashError, ValueError):
    """The base model GGUF cannot be used: not a GGUF, truncated, corrupt, or of an
    architecture llamaflash does not serve."""


class BaseModelNotFoundError(BaseModelError, FileNotFoundError):
    """The base model file does not exist."""


# --------------------------------------------------------------------------------------
# Conversion problems
# --------------------------------------------------------------------------------------


class ConversionError(LlamaflashError):
    """Writing a sidecar failed (output exists, unwritable location, disk full, ...).
    Nothing is left under the output name when this is raised."""


class OutputExistsError(ConversionError, FileExistsError):
    """The conversion's output file already exists and overwriting was not requested."""


class CalibrationError(ConversionError):
    """The calibration or validation text cannot be used for this model (too short, unreadable).
    Raised before anything is written; the message says how much text is needed."""


# --------------------------------------------------------------------------------------
# Flash read problems
# --------------------------------------------------------------------------------------


class NonFiniteOutputError(LlamaflashError, ArithmeticError):
    """A served FFN layer produced a NaN or an infinity: the message names the layer, the token and
    the value. The weights read were not what the sidecar describes (re-copy or re-convert it:
    `llamaflash convert MODEL --force`), or the model itself overflows at this input."""


class FlashIoError(LlamaflashError, OSError):
    """Reading FFN bundles from flash failed: the file cannot be opened or is not a file, the
    device reported an error (EIO, ...), or the file was truncated, rewritten or replaced while
    in use. The message names the file, the byte range and the cause."""


class SidecarIntegrityError(SidecarError, FlashIoError):
    """Bytes the engine read do not match the checksums the converter stored in the sidecar: a row of
    the sidecar (bundle, down_t) or of the base model's FFN tensors was damaged on disk or in a copy.
    Raised before anything is computed from those bytes. The message names the file, the tensor, the
    row, its byte range and the way out (copy the file again, or re-create the sidecar with
    `llamaflash convert MODEL --force`; a damaged base model must be copied again first)."""


# --------------------------------------------------------------------------------------
# Planning problems
# --------------------------------------------------------------------------------------


class RamBudgetError(LlamaflashError, ValueError):
    """A RAM budget is too small for the flash-offload engine: below the minimum the planner
    computed (llama.cpp's share, the resident gate rows, the smallest cold cache). The message names
    the minimum in MiB and the way out (a larger budget, a smaller n_ctx)."""
