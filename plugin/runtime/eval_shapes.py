"""The batch shapes `llamaflash.Llama` evaluates tokens in, so that the same request gets the same answer.

ggml-cpu picks its kernels by the number of rows in a batch: the tiled K-quant matmul from 8 rows,
repacked Q4_K gemm on groups of 4 rows and gemv on the rest, llamafile's tinyBLAS from 2 rows for
F16/Q8_0/Q4_0, flash attention tiled from 64 query rows and split over the KV by thread count for one
row over >= 512 cells. A position's logits and KV entries are therefore a function of its tokens *and*
of the batch it was computed in. Two levels make answers reproducible:

Repeat-stable (the default). A row's bits depend on the tokens up to it and on the shape of the
``llama_decode`` call that computed it (its start and size, and whether every row was an output):
not on the tokens after it (attention is causal, matmul rows are independent). `KvHistory` records
that shape for every call (`Segment`) that built the current KV cache; `PromptRecords` keeps, per
prompt, the segments its evaluation had and the logits of its last position. A request whose prompt
was evaluated before is brought back to exactly that state: the segments the cache still holds are
kept, the others are decoded again with their recorded shapes (a segment that was cut, e.g. a verify
batch behind a rejected draft, is padded back to its recorded size with filler rows that are then
removed), and a prompt the cache holds whole samples from its recorded logits. llama-cpp-python
itself would re-evaluate the last prompt token alone, or the suffix after the longest shared prefix,
and get other bits. Cost: none for a plain repeat (nothing is evaluated); where another request took
the cache, the replay decodes earlier answers' tokens in the shapes they were generated in (one decode
call per token that was decoded alone).

Batch-invariant (`Llama(deterministic=True)`, and llamaflash's numerics under a RAM budget). With
weights in plain (not repacked) memory and flash attention, ggml-cpu computes every row of a batch of
2..`MAX_ROWS` rows with the same bits, and a single row too while the KV holds fewer than
`SPLIT_KV_MIN_CELLS` cells; a single row over more cells takes flash attention's split-KV path, which
sums in another order (and by thread count). `invariant_chunks` cuts every evaluation into batches of
up to MAX_ROWS rows, never a lone row once the KV is that long (a filler row is evaluated after it
and removed), so a position's bits no longer depend on batching or cache history. With
speculative decoding (on by default under a RAM budget where tokens read from flash) lone rows are
padded the same way, which keeps it exact past 256 positions: a token verified in a batch gets the
bits it gets decoded alone. Without speculation a lone decode row stays alone, as stock computes it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

#: The largest batch whose rows ggml-cpu computes with the bits of any other batch of 2..MAX_ROWS
#: rows (plain weights, flash attention; measured with this llama-cpp-python): from 8 rows on, the
#: K-quant matmuls take the tiled kernel (ggml-cpu/tiled), which sums in another order.
MAX_ROWS = 7
#: The same where ggml-cpu's tiled kernel is off in this process (GGML_CPU_TILED_MM=0 before its first
#: K-quant matmul; `llamaflash run/chat/serve --deterministic` set it) and no matrix takes tinyBLAS:
#: rows then keep their bits up to flash attention's tiled path, which starts at 64 query rows.
UNTILED_MAX_ROWS = 63

#: Flash attention over one query row splits the KV by thread count from this many cells
#: (ggml-cpu ops.cpp, use_split_kv_path: nek1 >= 512); the KV length is padded to 256 cells.
SPLIT_KV_MIN_CELLS = 512
KV_PAD = 256

#: ggml type ids (ggml.h) of the KV cache types; flash attention's split-KV path takes F32 / F16 K and V
#: of one type only (ggml-cpu ops.cpp: kv_is_f32_or_f16 && k->type == v->type).
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 = 0, 1, 8
#: deterministic=True's KV cache type where the caller gives none: one row over a q8_0 cache is
#: computed as a row of any batch, so no filler row is needed (llama.cpp's -ctk q8_0 -ctv q8_0)
DETERMINISTIC_KV_TYPE = GGML_TYPE_Q8_0


def kv_may_split(type_k: Optional[int], type_v: Optional[int]) -> bool:
    """Whether flash attention may split one query row's KV over a cache of these types (None: F16,
    llama.cpp's default): then a lone row past SPLIT_KV_MIN_CELLS needs a filler row."""
    k = GGML_TYPE_F16 if type_k is None else int(type_k)
    v = GGML_TYPE_F16 if type_v is None else int(type_v)
    return k == v and k in (GGML_TYPE_F32, GGML_TYPE_F16)


@dataclass(frozen=True)
class Segment:
    """One llama_decode call that computed KV entries: positions start .. start+size-1 (some of them
    may have been removed since), every row an output (all_logits) or only the last."""

    start: int
    size: int
    all_logits: bool


class KvHistory:
    """The segments that computed the current KV cache, in position order. A segment covers the
    positions from its start up to the next segment's start (or the context's token count)."""

    def __init__(self) -> None:
        self.segments: List[Segment] = []
        self.known = True

    def cut(self, n_tokens: int) -> None:
        """Positions from n_tokens on are about to be replaced (their KV entries are removed)."""
        self.segments = [s for s in self.segments if s.start < n_tokens]
        if n_tokens == 0:
            self.known = True

    def add(self, segment: Segment) -> None:
        self.segments.append(segment)

    def forget(self) -> None:
        """The KV cache came from elsewhere (a loaded state): nothing in it can be matched."""
        self.segments = []
        self.known = False

    def covering(self, n_positions: int) -> Tuple[Segment, ...]:
        """The segments that computed positions 0 .. n_positions-1."""
        return tuple(s for s in self.segments if s.start < n_positions)


@dataclass
class PromptRecord:
    """How a prompt was evaluated: its segments (the last one ends at the prompt's end) and the
    logits of its last position (None once evicted: the last segment is then decoded again)."""

    segments: Tuple[Segment, ...]
    logits: Optional[np.ndarray]


class PromptRecords:
    """Recently evaluated prompts, least recently used evicted first. Logits (n_vocab floats each)
    are kept for the `max_logits` most recent prompts only."""

    def __init__(self, max_records: int = 64, max_logits: int = 4) -> None:
        self.max_records = max_records
        self.max_logits = max_logits
        self._records: "OrderedDict[bytes, PromptRecord]" = OrderedDict()

    @staticmethod
    def key(tokens: Sequence[int]) -> bytes:
        return np.asarray(tokens, dtype=np.intc).tobytes()

    def get(self, tokens: Sequence[int]) -> Optional[PromptRecord]:
        k = self.key(tokens)
        record = self._records.get(k)
        if record is not None:
            self._records.move_to_end(k)
        return record

    def put(self, tokens: Sequence[int], segments: Tuple[Segment, ...], logits: Optional[np.ndarray]) -> None:
        k = self.key(tokens)
        self._records[k] = PromptRecord(segments, logits)
        self._records.move_to_end(k)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)
        for i, record in enumerate(reversed(self._records.values())):
            if i >= self.max_logits:
                record.logits = None

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)


def segment_end(segments: Sequence[Segment], i: int, n_positions: int) -> int:
    """The end of the positions segment i covers: the next segment's start, else n_positions."""
    return segments[i + 1].start if i + 1 < len(segments) else n_positions


@dataclass(frozen=True)
class Replay:
    """How to bring the KV cache to a recorded prompt's state: keep positions < keep, decode
    `segments` (each with the prompt's tokens up to where the next one starts), and sample from the
    recorded logits when `segments` is empty."""

    keep: int
    segments: Tuple[Segment, ...]


def plan_replay(record: PromptRecord, history: KvHistory, shared: int, n_prompt: int) -> Replay:
    """The replay of `record` (a prompt of n_prompt tokens) given the current KV `history`, of which
    the first `shared` positions hold the prompt's own tokens. Segments are kept while they are the
    recorded ones and the cache still holds all the positions the record has them cover."""
    segments = record.segments
    kept = 0
    if history.known:
        current = history.segments
        for i, seg in enumerate(segments):
            end = segment_end(segments, i, n_prompt)
            if i >= len(current) or current[i] != seg or end > shared:
                break
            # the cache's copy of this segment must reach as far as the record's
            if segment_end(current, i, shared) < end:
                break
            kept = i + 1
    if kept == len(segments) and record.logits is None:
        kept -= 1  # no logits kept: the last segment is decoded again for them
    keep = segment_end(segments, kept - 1, n_prompt) if kept else 0
    return Replay(keep, tuple(segments[kept:]))


def invariant_chunks(
    n_past: int, n_tokens: int, max_rows: int = MAX_ROWS, pad_lone: bool = True, pad_always: bool = False
) -> List[Tuple[int, int]]:
    """Batch-invariant evaluation of n_tokens tokens at positions n_past..: (first position, rows)
    per llama_decode call, every call 1..max_rows rows. A call of one row happens only while flash
    attention would not split its KV (fewer than SPLIT_KV_MIN_CELLS cells); past that, a lone token
    is evaluated with one filler row after it, (n_past, 2): the call's rows beyond the tokens are
    fillers, whose KV entries the caller removes and whose logits it ignores. The row before is not
    computed again: its KV entry may come from a batch of more rows, whose bits a 2-row batch would
    replace. pad_always: at every position (a matrix whose type tinyBLAS takes from 2 rows on makes a
    lone row differ everywhere). pad_lone=False: a lone token is always decoded alone (as stock decodes
    it; consistent only where no other batch ever computes that position)."""
    if max_rows < 3:
        raise ValueError(f"max_rows={max_rows}: batch-invariant chunks need at least 3 rows")
    if n_tokens <= 0:
        return []
    if n_tokens == 1:
        if not pad_lone or (not pad_always and kv_cells(n_past + 1) < SPLIT_KV_MIN_CELLS):
            return [(n_past, 1)]  # no split-KV path yet: one row has the bits of any other batch
        return [(n_past, 2)]
    sizes = [max_rows] * (n_tokens // max_rows)
    rest = n_tokens % max_rows
    if rest == 1:
        # never a lone last row: the last full chunk and it become two chunks of 2..max_rows
        sizes[-1:] = [(max_rows + 1) // 2, max_rows + 1 - (max_rows + 1) // 2]
    elif rest:
        sizes.append(rest)
    out, pos = [], n_past
    for size in sizes:
        out.append((pos, size))
        pos += size
    return out


def kv_cells(n_positions: int) -> int:
    """The KV length flash attention sees after n_positions tokens (padded to KV_PAD)."""
    return max(KV_PAD, -(-n_positions // KV_PAD) * KV_PAD)
