"""Several training sources mixed by weight: ``--data sharegpt.jsonl.xz:0.6,books.jsonl.xz:0.4``.

The data spec (``TrainConfig.data``, ``linearize train --data``) is read by ``parse_data_spec``:

* A string that names an existing file or folder as a whole is that one source (so a path that
  holds a comma or a colon still works alone).
* Otherwise a string with a comma is a mixture: every comma-separated item is ``SOURCE:WEIGHT``,
  where WEIGHT is the text after the item's LAST colon and must be a positive number (``0.6``,
  ``3``, ``2.5e-1``); SOURCE is any form ``load_documents`` accepts. So
  ``passkey:2048:500:0.2`` is the source ``passkey:2048:500`` with weight 0.2, and
  ``wikitext:wikitext-2-raw-v1:0.5`` the hub dataset with its config at weight 0.5. An item
  without a weight is an error (``passkey:2048`` alone would read as weight 2048, so the rule asks
  for the weight on every item rather than guess). Sources must not repeat and cannot contain a
  comma.
* A string without a comma is one source and takes no weight (any colon belongs to the source:
  ``passkey:2048``, ``name:config``).
* In a YAML/JSON config file, ``data`` may also be a list of ``"SOURCE:WEIGHT"`` strings or of
  ``{source: ..., weight: ...}`` mappings, or a mapping ``{SOURCE: WEIGHT, ...}``; ``format_data_spec``
  turns these into the string form, which is what a run records.

Weights are relative (normalised to sum 1) and apply to tokens: ``mix_documents`` gives source i
exactly ``round(w_i * total)`` training tokens (its last document cut to fit), repeating a source
whose training part is too small for its share (with a printed note, never a silent shortfall),
then shuffles the documents with the seed. Token proportions of the training stream therefore
match the weights to within a few tokens. ``load_mixture`` reads each source only as far as its
share needs (``load_documents(max_tokens=...)``: the front of each file, in file order) and holds
out validation documents per source (``split_documents``) before any repetition, so no held-out
text of a source is ever trained on.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .packing import split_documents
from .sources import ACCEPTED_FORMS, Document, load_documents, piece_of

SPEC_FORMS = ("one source (" + ACCEPTED_FORMS + "), or a mixture 'SOURCE:WEIGHT,SOURCE:WEIGHT,...' with a "
              "positive weight after each item's last ':' (e.g. 'chat.jsonl.xz:0.6,books.jsonl.xz:0.4'), or in a "
              "config file a list of 'SOURCE:WEIGHT' strings or {source, weight} mappings")
_WEIGHT = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _bad(spec, why: str) -> ValueError:
    return ValueError(f"bad data spec {spec!r}: {why}. Allowed forms: {SPEC_FORMS}")


def parse_data_spec(spec) -> list[tuple[str, float]]:
    """``[(source, weight), ...]`` from a data spec (see the module docstring); one source has weight
    1.0. Raises ValueError naming the spec, the bad item and the allowed forms."""
    if isinstance(spec, dict):
        spec = [{"source": k, "weight": v} for k, v in spec.items()]
    if isinstance(spec, (list, tuple)):
        return _parse_list(spec)
    if not isinstance(spec, str):
        raise _bad(spec, f"expected a string, a list or a mapping, got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise _bad(spec, "it is empty")
    if "," not in text or Path(text).expanduser().exists():
        return [(text, 1.0)]
    items = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise _bad(spec, "it has an empty item (two commas in a row, or one at an end)")
        source, sep, weight = item.rpartition(":")
        if not sep or not source.strip():
            raise _bad(spec, f"item {item!r} has no ':WEIGHT'; in a mixture every item needs one")
        items.append((source.strip(), _weight(spec, item, weight.strip())))
    return _checked(spec, items)


def _weight(spec, item, text) -> float:
    if isinstance(text, bool) or not (isinstance(text, (int, float)) or _WEIGHT.fullmatch(str(text))):
        raise _bad(spec, f"item {item!r} has weight {text!r}, not a positive number")
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise _bad(spec, f"item {item!r} has weight {text!r}; weights must be positive and finite")
    return value


def _parse_list(spec) -> list[tuple[str, float]]:
    if not spec:
        raise _bad(spec, "the list is empty")
    items = []
    for entry in spec:
        if isinstance(entry, str):
            if "," in entry:
                raise _bad(spec, f"list item {entry!r} holds a comma; give one 'SOURCE:WEIGHT' per item")
            source, sep, weight = entry.strip().rpartition(":")
            if not sep or not source.strip():
                if len(spec) == 1:  # a list of one source, weight optional
                    items.append((entry.strip(), 1.0))
                    continue
                raise _bad(spec, f"list item {entry!r} has no ':WEIGHT'; in a mixture every item needs one")
            items.append((source.strip(), _weight(spec, entry, weight.strip())))
        elif isinstance(entry, dict) and set(entry) <= {"source", "weight"} and isinstance(entry.get("source"), str):
            if "weight" not in entry and len(spec) > 1:
                raise _bad(spec, f"list item {entry!r} has no 'weight'; in a mixture every item needs one")
            items.append((entry["source"].strip(), _weight(spec, entry, entry.get("weight", 1.0))))
        else:
            raise _bad(spec, f"list item {entry!r} is neither 'SOURCE:WEIGHT' nor {{source: ..., weight: ...}}")
    return _checked(spec, items)


def _checked(spec, items: list[tuple[str, float]]) -> list[tuple[str, float]]:
    seen = set()
    for source, _ in items:
        if not source:
            raise _bad(spec, "an item has an empty source")
        if "," in source:
            raise _bad(spec, f"source {source!r} holds a comma, which a mixture cannot name")
        if source in seen:
            raise _bad(spec, f"source {source!r} appears twice; give it once with the sum of its weights")
        seen.add(source)
    return items


def format_data_spec(spec) -> str:
    """The string form of a data spec: the source alone, or ``SOURCE:WEIGHT,...`` for a mixture."""
    items = parse_data_spec(spec)
    if len(items) == 1:  # one source: a weight means nothing, and "SOURCE:W" alone would read as one name
        return items[0][0]
    return ",".join(f"{source}:{weight:.12g}" for source, weight in items)


def mix_documents(sources: list[list], weights: list[float], total_tokens: int, seed: int,
                  names: list[str] | None = None, note: Callable[[str], None] | None = print) -> list:
    """Documents of several sources, source i holding exactly ``round(w_i / sum(w) * total_tokens)``
    tokens, in an order shuffled by ``seed``.

    Each source's documents are taken in order (the last one cut to fit: ``sources.piece_of``
    keeps its loss mask); a source that runs out is taken again from its start, and ``note`` is
    told how many times over (``None`` silences it). Raises ValueError for an empty source or bad
    weights.
    """
    if len(sources) != len(weights) or not sources:
        raise ValueError(f"mix_documents needs one weight per source, got {len(sources)} sources and {len(weights)} weights")
    if any(not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"weights must be positive numbers, got {weights!r}")
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
        raise ValueError(f"total_tokens must be a positive integer, got {total_tokens!r}")
    names = names or [f"source {i}" for i in range(len(sources))]
    total_weight = float(sum(weights))
    mixed = []
    for docs, weight, name in zip(sources, weights, names):
        have = sum(len(d) for d in docs)
        if have == 0:
            raise ValueError(f"data source {name!r} gave no training tokens")
        quota = round(weight / total_weight * total_tokens)
        if quota > have and note is not None:
            note(f"note: data source {name} has {have:,} training tokens for its share of {quota:,} "
                 f"(weight {weight / total_weight:.3g}): repeated {quota / have:.2f} times")
        taken = 0
        while taken < quota:
            for doc in docs:
                if taken >= quota:
                    break
                part = doc if len(doc) <= quota - taken else piece_of(doc, 0, quota - taken)
                if len(part):
                    mixed.append(part)
                    taken += len(part)
    random.Random(seed).shuffle(mixed)
    return mixed


@dataclass
class Mixture:
    """What ``load_mixture`` read: training documents (mixed and shuffled), and each source's
    held-out validation documents apart (``val[i]`` belongs to ``sources[i]``)."""

    sources: list[str]
    weights: list[float]                       # normalised to sum 1
    train: list[Document]
    val: list[list[Document]] = field(default_factory=list)
    train_tokens: list[int] = field(default_factory=list)  # per source, in ``train``


def load_mixture(spec, tokenizer, *, train_tokens: int, val_fraction: float, seed: int, val_tokens: int = 0,
                 text_field: str = "text", note: Callable[[str], None] | None = print,
                 margin: float = 1.1) -> Mixture:
    """Read a data spec for training: each source as far as its share of ``train_tokens`` (and of
    ``val_tokens`` of validation) needs, times ``margin``; split off its validation documents; mix.

    One source: its training documents are all that was read (at least ``train_tokens`` unless the
    source is smaller), as before mixtures existed. Several: ``mix_documents`` over the training
    parts, ``train_tokens`` tokens in all.
    """
    items = parse_data_spec(spec)
    if isinstance(spec, str) and len(items) == 1:
        _refuse_weighted_single(spec)
    total_weight = sum(w for _, w in items)
    weights = [w / total_weight for _, w in items]
    train_parts, val_parts = [], []
    for (source, _), weight in zip(items, weights):
        need = weight * train_tokens / (1 - val_fraction)
        if val_fraction > 0:
            need = max(need, weight * val_tokens / val_fraction)
        budget = max(1, math.ceil(need * margin))
        documents = load_documents(source, tokenizer, text_field=text_field, max_tokens=budget)
        train, val = split_documents(documents, val_fraction, seed)
        train_parts.append(train)
        val_parts.append(val)
    sources = [s for s, _ in items]
    if len(items) == 1:
        train = train_parts[0]
    else:
        train = mix_documents(train_parts, weights, train_tokens, seed, names=sources, note=note)
    per_source = [sum(len(d) for d in part) for part in train_parts] if len(items) == 1 else \
        [round(w * train_tokens) for w in weights]
    return Mixture(sources, weights, train, val_parts, per_source)


def _refuse_weighted_single(spec: str) -> None:
    """``a.jsonl:0.6`` alone, where ``a.jsonl`` exists: a weight without a mixture, said plainly."""
    source, sep, weight = spec.strip().rpartition(":")
    if sep and _WEIGHT.fullmatch(weight) and not Path(spec).expanduser().exists() and Path(source).expanduser().exists():
        raise _bad(spec, f"one source takes no weight; give {source!r} alone, or several 'SOURCE:WEIGHT' joined by commas")
