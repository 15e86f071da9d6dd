"""Sentences from local text, for sentence encoders (``train.encoder``, ``eval.embed``).

``load_sentences`` cuts distinct sentences of ``MIN_WORDS``..``MAX_WORDS`` words out of a file,
a folder, ``shakespeare`` or several of these; ``sentence_split`` fixes each sentence's part
(~10% "test", ~10% "val", the rest "train") by a hash of its text, so training and evaluation
agree on the held-out set whatever their other settings.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path

from .sources import SUFFIXES, shakespeare_plays

SPLITS = ("train", "val", "test")
MIN_WORDS, MAX_WORDS = 5, 64

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+")


def sentence_split(sentence: str) -> str:
    """'test' (~10%), 'val' (~10%) or 'train', a pure function of the sentence text."""
    bucket = zlib.crc32(sentence.encode("utf-8")) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def _texts(source: str) -> list[str]:
    if source == "shakespeare":
        return list(shakespeare_plays())
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
        if not files:
            raise ValueError(f"folder {str(path)!r} holds no {'/'.join(SUFFIXES)} files")
        return [t for f in files for t in _texts(str(f))]
    if not path.is_file():
        raise FileNotFoundError(f"sentence source {source!r} does not exist; accepted: a .txt/.md/.json/.jsonl file, "
                                "a folder of them, 'shakespeare', or several of these joined by commas")
    if path.suffix.lower() in (".txt", ".md"):
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix.lower() not in (".json", ".jsonl"):
        raise ValueError(f"cannot read sentences from {path.name}: use .txt, .md, .json or .jsonl")
    raw = path.read_text(encoding="utf-8", errors="replace")
    records = json.loads(raw) if path.suffix.lower() == ".json" else [json.loads(line) for line in raw.splitlines() if line.strip()]
    texts = []
    for record in records if isinstance(records, list) else [records]:
        if isinstance(record, str):
            texts.append(record)
        elif isinstance(record, dict):  # plain text records, or Alpaca's instruction / input / output
            texts += [record[key] for key in ("text", "instruction", "input", "output") if isinstance(record.get(key), str)]
    return texts


def _sentences_of(text: str) -> list[str]:
    out = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.splitlines() if line.strip()]
        # a short first line without punctuation is a heading or a speaker's name (the plays)
        if lines and len(lines[0].split()) <= 3 and not re.search(r"[.!?,;:]", lines[0]):
            lines = lines[1:]
        joined = re.sub(r"\s+", " ", " ".join(lines))
        out += [s.strip() for s in _SENTENCE_END.split(joined) if s.strip()]
    return out


def load_sentences(source: str, *, split: str | None = None, max_sentences: int | None = None,
                   seed: int = 0) -> list[str]:
    """Distinct sentences of ``MIN_WORDS``..``MAX_WORDS`` words from local text, shuffled by ``seed``.

    ``source``: a .txt/.md file (plain text), a .json/.jsonl file (``text`` fields, or Alpaca
    records), a folder of such files, ``shakespeare`` (the bundled plays), or several of these
    joined by commas. ``split``: keep only the sentences of one ``sentence_split`` part.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    if max_sentences is not None and (isinstance(max_sentences, bool) or not isinstance(max_sentences, int)
                                      or max_sentences < 1):
        raise ValueError(f"max_sentences must be a positive int or None, got {max_sentences!r}")
    seen, sentences = set(), []
    for part in str(source).split(","):
        for text in _texts(part.strip()):
            for s in _sentences_of(text):
                words = len(s.split())
                if MIN_WORDS <= words <= MAX_WORDS and s not in seen and sum(c.isalpha() for c in s) > len(s) / 2:
                    seen.add(s)
                    if split is None or sentence_split(s) == split:
                        sentences.append(s)
    if not sentences:
        raise ValueError(f"no sentences of {MIN_WORDS}-{MAX_WORDS} words found in {source!r}"
                         + (f" for split {split!r}" if split else ""))
    random.Random(seed).shuffle(sentences)
    return sentences[:max_sentences] if max_sentences else sentences
