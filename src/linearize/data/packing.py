"""Packing token documents into fixed-length training rows, and the validation split.

Policy at document boundaries. A linear-attention layer carries a recurrent state from token to
token; inside a row, nothing resets it at an EOS. Packing two documents into one row therefore
lets the first document's state leak into the second, which a softmax teacher (whose attention
the student imitates) would mostly ignore but a recurrent student cannot. So:

``"split"`` (the default): documents never share a row. Each document is cut into consecutive
    pieces of ``seq_len`` tokens; the last piece is right-padded (``attention_mask`` False there,
    ``labels`` -100) and kept only if it has at least ``min_tokens`` real tokens. Every row starts
    a fresh state at a document start or at a ``seq_len`` cut of one long document.
``"concat"``: the papers' packing (LoLCATs, Lizard), opted into explicitly. All documents (each
    already ending with EOS) are concatenated and cut into full rows of ``seq_len``; the state
    carries across document boundaries inside a row; the last partial row is dropped.

Shapes: ``Rows.input_ids`` (N, seq_len) int64, ``Rows.attention_mask`` (N, seq_len) bool, padding
only on the right. ``Rows.batch`` trims columns that are padding in every row of the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PACKING_POLICIES = ("split", "concat")


@dataclass
class Rows:
    """Packed rows: ``input_ids`` (N, seq_len) long, ``attention_mask`` (N, seq_len) bool."""

    input_ids: torch.LongTensor
    attention_mask: torch.BoolTensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in all rows."""
        return int(self.attention_mask.sum())

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` (int64, as HF models expect) and ``labels`` for some rows.

        Shapes (B, W) with W <= seq_len: trailing columns that are padding in every selected row are
        trimmed, so a batch of short rows costs less. ``labels`` are ``input_ids`` with -100 at
        padding (the model shifts them for next-token loss).
        """
        index = torch.as_tensor(list(indices), dtype=torch.long)
        if index.numel() == 0:
            raise ValueError("batch needs at least one row index, got none")
        if int(index.min()) < -len(self) or int(index.max()) >= len(self):
            raise IndexError(f"row indices must be in [0, {len(self)}), got {index.tolist()}")
        ids, mask = self.input_ids[index], self.attention_mask[index]
        used = mask.any(dim=0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 1
        ids, mask = ids[:, :width], mask[:, :width]
        return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def pack(documents: list[list[int]], seq_len: int, policy: str = "split", *, min_tokens: int = 16,
         pad_id: int = 0) -> Rows:
    """Pack token documents into rows of ``seq_len`` under ``policy`` (see the module docstring).

    ``min_tokens`` (split only): the fewest real tokens a document's last, padded piece needs to be
    kept. ``pad_id`` fills padding (masked out, so its value only matters for tidiness).
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    if policy not in PACKING_POLICIES:
        raise ValueError(f"unknown packing policy {policy!r}: use one of {', '.join(PACKING_POLICIES)}")
    if not isinstance(min_tokens, int) or not 1 <= min_tokens <= seq_len:
        raise ValueError(f"min_tokens must be an integer in [1, seq_len={seq_len}], got {min_tokens!r}")

    if policy == "concat":
        stream = [token for doc in documents for token in doc]
        n = len(stream) // seq_len
        if n == 0:
            raise ValueError(f"documents are too short to pack: {len(stream)} tokens in all, fewer than "
                             f"one row of seq_len={seq_len}")
        ids = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
        return Rows(ids, torch.ones(n, seq_len, dtype=torch.bool))

    pieces = [doc[start:start + seq_len] for doc in documents for start in range(0, len(doc), seq_len)]
    pieces = [p for p in pieces if len(p) == seq_len or len(p) >= min_tokens]
    if not pieces:
        raise ValueError(f"documents are too short to pack: none has min_tokens={min_tokens} tokens "
                         f"for a row of seq_len={seq_len} (longest has {max(map(len, documents), default=0)})")
    ids = torch.full((len(pieces), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(pieces), seq_len, dtype=torch.bool)
    for row, piece in enumerate(pieces):
        ids[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
        mask[row, : len(piece)] = True
    return Rows(ids, mask)


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
        return [doc[: len(doc) - held]], [doc[len(doc) - held:]]
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(max(1, round(val_fraction * n)), n - 1)
    val = set(order[:k])
    return ([d for i, d in enumerate(documents) if i not in val],
            [d for i, d in enumerate(documents) if i in val])
