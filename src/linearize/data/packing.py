"""Packing token documents into fixed-length training rows, and the validation split.

Policy at document boundaries. A linear-attention layer carries a recurrent state from token to
token; inside a row, nothing resets it at an EOS. Packing two documents into one row therefore
lets the first document's state leak into the second, which a softmax teacher (whose attention
the student imitates) would mostly ignore but a recurrent student cannot. Keeping documents apart
costs padding instead, most of each row on short documents (chats, retrieval examples). So:

``"pack"`` (the default): full rows without cutting documents. Each document is cut into pieces
    of ``seq_len`` tokens as in ``"split"`` (a document no longer than ``seq_len`` is one piece);
    the pieces are then placed into rows by best-fit decreasing bin packing (longest piece first,
    into the row with the least room that still holds it, else a new row), several per row, each
    document still ending with its EOS. A row is right-padded only where no remaining piece fits,
    and no token is dropped. Inside a row the state carries across document boundaries exactly as
    in ``"concat"``: this is concat's leak without concat's cut in the middle, so a document that
    fits in a row (a retrieval example's facts and its question, a chat) is always whole in one row.
``"split"``: documents never share a row. Each document is cut into consecutive pieces of
    ``seq_len`` tokens; the last piece is right-padded (``attention_mask`` False there, ``labels``
    -100) and kept only if it has at least ``min_tokens`` real tokens. Every row starts a fresh
    state at a document start or at a ``seq_len`` cut of one long document.
``"concat"``: the papers' packing (LoLCATs, Lizard), opted into explicitly. All documents (each
    already ending with EOS) are concatenated and cut into full rows of ``seq_len``; the state
    carries across document boundaries inside a row; the last partial row is dropped.

Shapes: ``Rows.input_ids`` (N, seq_len) int64, ``Rows.attention_mask`` (N, seq_len) bool, padding
only on the right. ``Rows.fill`` is the share of the N * seq_len slots that hold tokens.
``Rows.batch`` trims columns that are padding in every row of the batch, in steps of
``trim_bucket(seq_len)`` columns, so that a run sees a few batch shapes rather than one per batch.

Loss on assistant turns only: ``pack(..., loss_masks=True)`` carries each document's ``loss_mask``
(``sources.Document``; a document without one counts whole) into ``Rows.loss_mask`` (N, seq_len)
bool, and ``Rows.batch`` then gives label -100 to the tokens it marks False, so next-token losses
skip them. The inputs (and stage 1, which uses no labels) still see every token.

Loss per document: ``pack(..., weighting="document")`` gives every labelled token of a piece (a
document, or a ``seq_len``-long part of a longer one, cut from its start) the weight 1 / the
piece's labelled tokens, in ``Rows.loss_weight`` (N, seq_len) float32, which ``Rows.batch`` hands
on as ``loss_weight``: a loss averaged with these weights is the mean over pieces of each piece's
mean, so a retrieval example whose answer is 5 labelled tokens weighs as much as a chat with 500.
With ``"token"`` (the default) there are no weights: every labelled token weighs the same.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sources import loss_mask_of, piece_of

PACKING_POLICIES = ("split", "pack", "concat")
WEIGHTINGS = ("token", "document")
TRIM_MULTIPLE = 64  # the chunk (tile) length of the chunked attention kernels


def trim_bucket(seq_len: int) -> int:
    """Columns ``Rows.batch`` trims in: ``seq_len / 8`` rounded up to a multiple of 64, capped at
    ``seq_len`` (at 2048: 256; at 1000: 128; at 512: 64; at 64 or fewer: ``seq_len``, never trimmed).

    Every new batch width is a new CUDA graph to capture and a new torch.compile specialisation,
    so widths take at most 8 values (multiples of the bucket, and ``seq_len``), and a batch pays
    less than a bucket of padding for it (1/8 of a row from ``seq_len`` 512 up). Multiples of 64
    keep the chunked kernels on whole chunks (the Gluon window kernel's fast path asks for
    ``T % 64 == 0``).
    """
    return min(seq_len, TRIM_MULTIPLE * max(1, -(-seq_len // (8 * TRIM_MULTIPLE))))


@dataclass
class Rows:
    """Packed rows: ``input_ids`` (N, seq_len) long, ``attention_mask`` (N, seq_len) bool."""

    input_ids: torch.LongTensor
    attention_mask: torch.BoolTensor
    loss_mask: torch.BoolTensor | None = None  # (N, seq_len): tokens that get a label; None = all real ones
    loss_weight: torch.Tensor | None = None    # (N, seq_len) float32: each label's weight; None = all equal

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in all rows."""
        return int(self.attention_mask.sum())

    @property
    def fill(self) -> float:
        """The share of the N * seq_len token slots that hold real tokens (0.0 without rows)."""
        return self.num_tokens / self.attention_mask.numel() if self.attention_mask.numel() else 0.0

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (int64, as HF models expect) and ``labels`` for some rows.

        Shapes (B, W): W is the longest selected row rounded up to a multiple of
        ``trim_bucket(seq_len)``, at most seq_len; the columns beyond it, padding in every selected
        row, are dropped, so a batch of short rows costs less while batches keep a few shapes.
        ``labels`` are ``input_ids`` with -100 at padding and, with a ``loss_mask``, where it is
        False (the model shifts them for next-token loss). With ``loss_weight``: ``loss_weight``
        (B, W) float32 too, 0 wherever the label is -100.
        """
        index = torch.as_tensor(list(indices), dtype=torch.long)
        if index.numel() == 0:
            raise ValueError("batch needs at least one row index, got none")
        if int(index.min()) < -len(self) or int(index.max()) >= len(self):
            raise IndexError(f"row indices must be in [0, {len(self)}), got {index.tolist()}")
        ids, mask = self.input_ids[index], self.attention_mask[index]
        used = mask.any(dim=0).nonzero()
        bucket = trim_bucket(self.seq_len)
        longest = int(used.max()) + 1 if used.numel() else 1
        width = min(self.seq_len, -(-longest // bucket) * bucket)
        ids, mask = ids[:, :width], mask[:, :width]
        labelled = mask if self.loss_mask is None else mask & self.loss_mask[index][:, :width]
        batch = {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~labelled, -100)}
        if self.loss_weight is not None:
            batch["loss_weight"] = self.loss_weight[index][:, :width].masked_fill(~labelled, 0.0)
        return batch

    def subset(self, indices: Sequence[int]) -> "Rows":
        """The rows at ``indices``, in that order (loss masks kept)."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return Rows(self.input_ids[index], self.attention_mask[index],
                    None if self.loss_mask is None else self.loss_mask[index],
                    None if self.loss_weight is None else self.loss_weight[index])

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        """Rows of several packings one after the other (of one ``seq_len``)."""
        if not parts:
            raise ValueError("concat needs at least one Rows")
        masks = weights = None
        if any(p.loss_mask is not None for p in parts):
            masks = torch.cat([p.attention_mask.clone() if p.loss_mask is None else p.loss_mask for p in parts])
        if any(p.loss_weight is not None for p in parts):
            if not all(p.loss_weight is not None for p in parts):
                raise ValueError("concat of rows with and without loss weights: pack them all with one weighting")
            weights = torch.cat([p.loss_weight for p in parts])
        return Rows(torch.cat([p.input_ids for p in parts]), torch.cat([p.attention_mask for p in parts]), masks,
                    weights)


def pack(documents: list[list[int]], seq_len: int, policy: str = "pack", *, min_tokens: int = 16,
         pad_id: int = 0, loss_masks: bool = False, weighting: str = "token") -> Rows:
    """Pack token documents into rows of ``seq_len`` under ``policy`` (see the module docstring).

    ``min_tokens`` (split only): the fewest real tokens a document's last, padded piece needs to be
    kept ("pack" keeps every token, "concat" drops only the last partial row). ``pad_id`` fills
    padding (masked out, so its value only matters for tidiness). ``loss_masks``: carry the
    documents' ``loss_mask`` into ``Rows.loss_mask`` (loss on assistant turns only); off, every
    real token gets a label. ``weighting``: ``"token"`` or ``"document"`` (``Rows.loss_weight``,
    see the module docstring). The result's ``fill`` says how much of it is real tokens.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    if policy not in PACKING_POLICIES:
        raise ValueError(f"unknown packing policy {policy!r}: use one of {', '.join(PACKING_POLICIES)}")
    if not isinstance(min_tokens, int) or not 1 <= min_tokens <= seq_len:
        raise ValueError(f"min_tokens must be an integer in [1, seq_len={seq_len}], got {min_tokens!r}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {weighting!r}: use one of {', '.join(WEIGHTINGS)}")

    use_masks = loss_masks and any(loss_mask_of(doc) is not None for doc in documents)

    def doc_mask(doc) -> list[bool]:
        mask = loss_mask_of(doc) if loss_masks else None
        return [True] * len(doc) if mask is None else mask

    def piece_weights(flags: list[bool]) -> torch.Tensor:
        """A piece's loss weights: 1 / its labelled tokens on each of them, 0 elsewhere."""
        return torch.tensor(flags, dtype=torch.float32) / max(1, sum(flags))

    by_document = weighting == "document"

    if policy == "concat":
        stream = [token for doc in documents for token in doc]
        n = len(stream) // seq_len
        if n == 0:
            raise ValueError(f"documents are too short to pack: {len(stream)} tokens in all, fewer than "
                             f"one row of seq_len={seq_len}")
        ids = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
        labelled = weights = None
        if use_masks:
            flags = [m for doc in documents for m in doc_mask(doc)]
            labelled = torch.tensor(flags[: n * seq_len], dtype=torch.bool).view(n, seq_len)
        if by_document:
            flat = torch.cat([piece_weights(flags[start:start + seq_len]) for flags in map(doc_mask, documents)
                              for start in range(0, len(flags), seq_len)])
            weights = flat[: n * seq_len].view(n, seq_len)
        return Rows(ids, torch.ones(n, seq_len, dtype=torch.bool), labelled, weights)

    # a piece: (document index, start, length), a document's tokens [start, start + length)
    pieces = [(i, start, min(seq_len, len(doc) - start)) for i, doc in enumerate(documents)
              for start in range(0, len(doc), seq_len)]
    if policy == "split":
        pieces = [p for p in pieces if p[2] >= min(seq_len, min_tokens)]
        if not pieces:
            raise ValueError(f"documents are too short to pack: none has min_tokens={min_tokens} tokens "
                             f"for a row of seq_len={seq_len} (longest has {max(map(len, documents), default=0)})")
        layout = [[p] for p in pieces]
    else:
        if not pieces:
            raise ValueError(f"documents are too short to pack: {len(documents)} documents hold no token")
        layout = _best_fit(pieces, seq_len)

    ids = torch.full((len(layout), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(layout), seq_len, dtype=torch.bool)
    labelled = torch.zeros(len(layout), seq_len, dtype=torch.bool) if use_masks else None
    weights = torch.zeros(len(layout), seq_len, dtype=torch.float32) if by_document else None
    for row, placed in enumerate(layout):
        at = 0
        for doc_index, start, length in placed:
            doc = documents[doc_index]
            ids[row, at:at + length] = torch.tensor(doc[start:start + length], dtype=torch.long)
            mask[row, at:at + length] = True
            if labelled is not None or weights is not None:
                flags = doc_mask(doc)[start:start + length]
            if labelled is not None:
                labelled[row, at:at + length] = torch.tensor(flags, dtype=torch.bool)
            if weights is not None:  # pieces start at multiples of seq_len: the piece is [start, start + length)
                weights[row, at:at + length] = piece_weights(flags)
            at += length
    return Rows(ids, mask, labelled, weights)


def _best_fit(pieces: list[tuple[int, int, int]], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Rows of ``pieces`` (each ``(doc, start, length)``, length <= seq_len) by best-fit decreasing.

    Deterministic: pieces go longest first (equal lengths in input order), each into the open row
    with the least room that holds it (equal room: the older row), else into a new row. The rows
    come back ordered by their first piece in input order, and inside a row the pieces keep input
    order, so the layout reads like the documents did, whatever order the packing placed them in.
    """
    order = sorted(range(len(pieces)), key=lambda k: (-pieces[k][2], k))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free slots, row) of rows with room left, sorted
    for k in order:
        length = pieces[k][2]
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            row, free = len(rows), seq_len
            rows.append([])
        else:
            free, row = room.pop(at)
        rows[row].append(k)
        if free - length > 0:
            bisect.insort(room, (free - length, row))
    rows = sorted(sorted(r) for r in rows)
    return [[pieces[k] for k in r] for r in rows]


def split_documents(documents: list[list[int]], val_fraction: float, seed: int) -> tuple[list, list]:
    """``(train, val)``: a held-out split by whole documents, fixed by ``seed``.

    A seeded shuffle picks ``round(val_fraction * n)`` validation documents (at least 1 when
    ``val_fraction > 0`` and n >= 2, and never all of them); both lists keep the input order. With
    a single document, its last ``val_fraction`` of tokens becomes the validation document.
    """
    if not 0.0 <= val_fraction <= 0.5:
        raise ValueError(f"val_fraction must be in [0, 0.5], got {val_fraction!r}")
    n = len(documents)
    if val_fraction == 0 or n == 0:
        return list(documents), []
    if n == 1:
        doc = documents[0]
        if len(doc) < 2:
            raise ValueError(f"cannot hold out part of a single document of {len(doc)} token(s)")
        held = min(max(1, round(val_fraction * len(doc))), len(doc) - 1)
        return [piece_of(doc, 0, len(doc) - held)], [piece_of(doc, len(doc) - held)]
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(max(1, round(val_fraction * n)), n - 1)
    val = set(order[:k])
    return ([d for i, d in enumerate(documents) if i not in val],
            [d for i, d in enumerate(documents) if i in val])
