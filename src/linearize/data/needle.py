"""Needles in natural text: short facts hidden in real prose, one of them asked at the end.

An example hides ``1 + distractors`` needles of one kind in a window of natural text (the
haystack) cut to ``length`` tokens, then asks for the value of one needle's key:

- ``number``: "The secret number of Alice is 4821."; asked: "What is the secret number of Alice?"
- ``word``: "The magic word for the blue door is 'lantern'."; asked for the blue door's word;
- ``sentence``: 'The note left for Captain Reed said: "The old fisherman hid the map behind the
  mill."'; asked what the note left for Captain Reed said.

Distractors are needles of the same kind with other keys (other names, other doors, other
recipients) and other values, at random depths elsewhere in the text (never at the asked needle's
place). The prompt ends with the question and the start of the answer, so a base model completes
it: ``"\\n\\nQuestion: What is the secret number of Alice?\\nAnswer: The secret number of Alice is"``.
None of it uses the classic passkey filler or phrasing (issue 44 keeps those for evaluation).

Where: needles go in at sentence boundaries of the haystack. The asked needle's first token lands
at the boundary nearest to ``target = depth * length``, clipped to the positions a needle can take
(0 up to just before the question), so it is within about one sentence of ``depth * length``;
``NeedleExample.positions`` holds the measured token position of every needle.

Length: the prompt (no special tokens) has at most ``length`` tokens of the given tokenizer and
at least ``length - length_tolerance(length)`` (whole sentences are added or dropped until it
fits; the window's start is moved over a few sentences to find the closest fit).

The haystack: natural text prepared once by ``prepare_haystack`` (from a string, token ids or
several documents) or read by ``load_haystack`` from a local file or folder through
``linearize.data.sources.load_documents`` (``.txt``/``.md``/``.json``/``.jsonl``, also ``.gz``,
``.xz``, ``.bz2``: e.g. ``../shared/data/mix/gutenberg_books.jsonl.xz``; reading stops after a
token budget), or ``shakespeare``. Text is split into paragraphs (blank lines) and sentences;
whitespace inside a paragraph is collapsed; a sentence of more than ``MAX_UNIT_WORDS`` words is cut
into pieces (needles never go between the pieces of one sentence).

Scoring (``needle_correct``): the first non-empty line of the continuation must hold the asked
value and no distractor's value: numbers as the exact digits (not inside a longer number), words
case-insensitively as a whole word, sentences case-insensitively as the same words in order.

Everything random is drawn from the ``random.Random`` passed in, so a seed fixes the example.
"""

from __future__ import annotations

import random
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

KINDS = ("number", "word", "sentence")
MAX_UNIT_WORDS = 24       # a longer sentence is cut into pieces of at most this many words
WINDOW_TRIES = 32         # sentence starts tried for the window that fills ``length`` best
MIN_HAYSTACK_PER_GAP = 8  # tokens of haystack per gap between needles, at the least

_NAMES = ("Alice", "Bernard", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko",
          "Lucas", "Marta", "Nikolai", "Olivia", "Pedro", "Quentin", "Rosa", "Samuel", "Tamsin", "Ulrich",
          "Vera", "Walter", "Xenia", "Yusuf", "Zoe", "Amara", "Bruno", "Celeste", "Dario", "Esme", "Felix")
_DOORS = ("blue", "red", "green", "yellow", "black", "white", "copper", "iron", "oak", "glass", "silver",
          "golden", "stone", "cedar", "brass", "narrow", "round", "painted", "velvet", "crooked", "tall",
          "purple", "orange", "wooden")
_WORDS = ("lantern", "harbor", "falcon", "meadow", "compass", "violin", "anchor", "thimble", "orchard",
          "glacier", "pepper", "saddle", "beacon", "quartz", "walnut", "pelican", "ribbon", "tulip", "cactus",
          "biscuit", "kettle", "feather", "pyramid", "trumpet", "volcano", "mitten", "paddle", "canyon",
          "pebble", "rocket", "lobster", "umbrella", "teapot", "magnet", "oyster", "jigsaw", "parsnip",
          "sapphire", "zeppelin", "hammock", "pretzel", "igloo", "banjo", "cobweb", "dolphin", "nutmeg")
_RECIPIENTS = ("Captain Reed", "Doctor Hale", "Professor Lind", "Sister Agnes", "Mayor Quill", "Judge Barrow",
               "Nurse Okafor", "Colonel Stroud", "Father Doyle", "Madame Roux", "Uncle Teodor", "Aunt Philippa",
               "Officer Brandt", "Lady Ashcombe", "Master Penhallow", "Widow Carrick")
_SUBJECTS = ("the old fisherman", "the youngest twin", "a tall stranger", "the baker's son", "my cousin Ida",
             "the night porter", "the retired pilot", "the village teacher", "a quiet shepherd",
             "the lighthouse keeper", "the red-haired clerk", "our new neighbour")
_ACTIONS = ("buried the silver key", "hid the blue map", "left the broken violin", "painted a red star",
            "planted three pear trees", "lost the brass compass", "counted the lanterns", "found a sleeping fox",
            "sold the grey mare", "stole the bishop's ledger", "mended the torn sail", "dropped a wooden box")
_PLACES = ("behind the mill", "under the north bridge", "beside the chapel well", "inside the clock tower",
           "near the salt market", "on the far island", "below the orchard wall", "at the end of the pier",
           "in the empty granary", "past the second gate")

_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z0-9]+)*")
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*$")
_ABBREVIATION = re.compile(r"^[\"'“‘(\[]*(?:Mr|Mrs|Ms|Dr|St|Mt|Jr|Sr|Prof|Rev|Capt|Col|Gen|Lt|Sgt|Messrs|No|"
                           r"vs|viz|cf|[A-Z]|(?:[A-Za-z]\.)+[A-Za-z])\.$")
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")


@dataclass(frozen=True)
class Haystack:
    """Natural text cut into units: ``texts[i]`` follows ``breaks[i]`` ("\\n\\n" at a paragraph's
    start, else " "); ``starts[i]``: unit i begins a sentence (a needle may go before it);
    ``sizes[i]``: the tokens of ``breaks[i] + texts[i]``."""

    texts: tuple[str, ...]
    breaks: tuple[str, ...]
    starts: tuple[bool, ...]
    sizes: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.sizes)


@dataclass
class NeedleExample:
    """One example. Lists are in prompt order; ``asked`` indexes the asked needle in them."""

    prompt: str
    kind: str
    answer: str               # the asked value
    key: str                  # the asked key (a name, a door, a recipient)
    keys: list[str]           # every needle's key
    values: list[str]         # every needle's value
    needles: list[str]        # every needle's sentence, as inserted
    asked: int
    depth: float
    target: int               # the token position the asked needle aims at
    positions: list[int]      # each needle's first token in the prompt
    length: int               # the prompt's tokens

    @property
    def distractors(self) -> list[str]:
        """The values of the other needles."""
        return [v for i, v in enumerate(self.values) if i != self.asked]


class NeedleTooShort(ValueError):
    """A length that cannot hold the needles and the question; ``minimum`` is the least that can."""

    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


def length_tolerance(length: int) -> int:
    """How many tokens under ``length`` a prompt may fall: max(16, length // 64)."""
    return max(16, length // 64)


# ---------------------------------------------------------------------------------------------
# the haystack


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def split_units(text: str) -> list[tuple[str, str, bool]]:
    """``(break, text, starts_sentence)`` units of natural text: paragraphs at blank lines,
    whitespace collapsed inside them, sentences at . ! ? (not after Mr., Dr., initials and the
    like), sentences longer than ``MAX_UNIT_WORDS`` words in pieces of at most that many."""
    units: list[tuple[str, str, bool, bool]] = []  # (break, text, starts a sentence, ends one)
    for paragraph in _PARAGRAPH.split(text):
        words = paragraph.split()
        first, current = True, []
        for i, word in enumerate(words):
            current.append(word)
            end = _SENTENCE_END.search(word) and not _ABBREVIATION.match(word)
            if end or len(current) >= MAX_UNIT_WORDS or i == len(words) - 1:
                starts = not units or units[-1][3] or first
                units.append(("\n\n" if first else " ", " ".join(current), starts, bool(end) or i == len(words) - 1))
                first, current = False, []
    return [(b, t, s) for b, t, s, _ in units]


def prepare_haystack(text: str | Sequence[int] | Sequence[str], tokenizer) -> Haystack:
    """A ``Haystack`` from natural text: a string, a document's token ids (decoded with
    ``tokenizer``), or several documents (strings, one after another)."""
    if isinstance(text, str):
        docs = [text]
    elif len(text) and all(isinstance(t, int) for t in text):
        docs = [tokenizer.decode(list(text), skip_special_tokens=True)]
    elif all(isinstance(t, str) for t in text):
        docs = list(text)
    else:
        raise ValueError("haystack must be text, a document's token ids or a list of texts, got "
                         f"{type(text).__name__} of {sorted({type(t).__name__ for t in text})}")
    units = [u for doc in docs for u in split_units(doc)]
    if not units:
        raise ValueError("the haystack holds no text")
    sizes = [len(ids) for ids in tokenizer([b + t for b, t, _ in units], add_special_tokens=False,
                                           verbose=False)["input_ids"]]
    return Haystack(texts=tuple(t for _, t, _ in units), breaks=tuple(b for b, _, _ in units),
                    starts=tuple(s for _, _, s in units), sizes=tuple(sizes))


def check_haystack_source(source: str | Path) -> str:
    """``source`` as a string, or FileNotFoundError naming it when it is neither an existing file
    or folder nor ``shakespeare``."""
    source = str(source)
    if source != "shakespeare" and not Path(source).expanduser().exists():
        raise FileNotFoundError(f"haystack {source!r} does not exist: give a .txt/.md/.json/.jsonl file (plain or "
                                ".gz/.xz/.bz2, e.g. ../shared/data/mix/gutenberg_books.jsonl.xz), a folder of them, "
                                "or 'shakespeare'")
    return source


def load_haystack_texts(source: str | Path, tokenizer, *, max_tokens: int | None = None,
                        text_field: str = "text") -> list[str]:
    """The documents of a local source as text, read through ``load_documents`` until at least
    ``max_tokens`` tokens are in (the last document whole)."""
    from .sources import load_documents

    source = check_haystack_source(source)
    documents = load_documents(source, tokenizer, text_field=text_field, max_tokens=max_tokens)
    return [tokenizer.decode(list(d), skip_special_tokens=True) for d in documents]


def load_haystack(source: str | Path, tokenizer, *, max_tokens: int | None = None,
                  text_field: str = "text") -> Haystack:
    """``prepare_haystack`` of a local file, folder or ``shakespeare`` (see the module docstring)."""
    return prepare_haystack(load_haystack_texts(source, tokenizer, max_tokens=max_tokens, text_field=text_field),
                            tokenizer)


# ---------------------------------------------------------------------------------------------
# needles


def _needle(kind: str, key: str, value: str) -> str:
    if kind == "number":
        return f"The secret number of {key} is {value}."
    if kind == "word":
        return f"The magic word for the {key} is '{value}'."
    return f'The note left for {key} said: "{value}."'


def _tail(kind: str, key: str) -> str:
    if kind == "number":
        return f"\n\nQuestion: What is the secret number of {key}?\nAnswer: The secret number of {key} is"
    if kind == "word":
        return f"\n\nQuestion: What is the magic word for the {key}?\nAnswer: The magic word for the {key} is"
    return f"\n\nQuestion: What did the note left for {key} say?\nAnswer: The note left for {key} said:"


def _draw_keys(kind: str, count: int, rng: random.Random) -> list[str]:
    pool = {"number": _NAMES, "word": [f"{c} door" for c in _DOORS], "sentence": _RECIPIENTS}[kind]
    if count > len(pool):
        raise ValueError(f"at most {len(pool) - 1} distractors for {kind} needles, got {count - 1}")
    return rng.sample(list(pool), count)


def _draw_value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        digits = rng.randint(4, 7)
        return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    if kind == "word":
        return rng.choice(_WORDS)
    sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_ACTIONS)} {rng.choice(_PLACES)}"
    return sentence[0].upper() + sentence[1:]


def _contains(text: str, value: str, kind: str) -> bool:
    if kind == "number":
        return re.search(rf"(?<!\d)(?<!\d[.,]){re.escape(value)}(?!\d)(?![.,]\d)", text) is not None
    want = [w.lower() for w in _WORD.findall(value)]
    got = [w.lower() for w in _WORD.findall(text)]
    return bool(want) and any(got[i:i + len(want)] == want for i in range(len(got) - len(want) + 1))


def _draw_values(kind: str, count: int, rng: random.Random, avoid: str) -> list[str]:
    """``count`` distinct values, none inside another and none already in the text ``avoid``."""
    values: list[str] = []
    for attempt in range(10_000):
        value = _draw_value(kind, rng)
        clash = any(value in v or v in value for v in values) if kind == "number" else value in values
        if not clash and (attempt > 5_000 or not _contains(avoid, value, kind)):
            values.append(value)
            if len(values) == count:
                return values
    raise ValueError(f"cannot draw {count} distinct {kind} values")


def _first_line(output: str) -> str:
    for line in output.splitlines():
        if line.strip():
            return line
    return ""


def value_in(output: str, value: str, kind: str) -> bool:
    """Whether the first non-empty line of ``output`` holds ``value`` (numbers: those exact digits,
    not part of a longer number; words and sentences: the same words, case-insensitive, in order)."""
    if kind not in KINDS:
        raise ValueError(f"unknown needle kind {kind!r}; available: {', '.join(KINDS)}")
    return _contains(_first_line(output), value, kind)


def needle_correct(output: str, answer: str, distractors: Sequence[str], kind: str) -> bool:
    """The score of one continuation: the asked value is in its first non-empty line and no
    distractor's value is."""
    return bool(answer) and value_in(output, answer, kind) and not any(value_in(output, d, kind) for d in distractors)


# ---------------------------------------------------------------------------------------------
# the example


def _check(kind: str, length, depth, distractors) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown needle kind {kind!r}; available: {', '.join(KINDS)}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ValueError(f"distractors must be a non-negative integer, got {distractors!r}")


def make_needle_example(haystack: Haystack | str | Sequence[int], tokenizer, length: int, depth: float,
                        rng: random.Random, *, kind: str = "number", distractors: int = 3) -> NeedleExample:
    """An example of ``kind`` in ~``length`` tokens with the asked needle at ``depth`` (0 = start
    of the text, 1 = just before the question) and ``distractors`` other needles of the same kind
    at random depths. ``haystack``: a prepared ``Haystack`` (prepare once, reuse), or text / token
    ids prepared here. Raises ValueError naming a bad kind, length, depth or distractor count, a
    length too short for the needles and the question, or a haystack too small for the length."""
    _check(kind, length, depth, distractors)
    if not isinstance(haystack, Haystack):
        haystack = prepare_haystack(haystack, tokenizer)
    count = 1 + distractors
    keys = _draw_keys(kind, count, rng)  # keys[0] is asked; the others are distractors
    depths = [float(depth)] + [rng.random() for _ in range(distractors)]

    # the window: from a random sentence start with enough text after it
    cum = [0, *accumulate(haystack.sizes)]
    starts = [i for i, s in enumerate(haystack.starts) if s]
    usable = bisect_right(starts, bisect_right(cum, cum[-1] - length) - 1)
    if usable == 0:
        raise ValueError(f"the haystack holds {cum[-1]} tokens, too few for a prompt of length {length}: give "
                         "more text (a longer file, or a larger token budget)")
    first = rng.randrange(usable)
    tries = starts[first:min(usable, first + WINDOW_TRIES)]
    region_end = bisect_left(cum, cum[tries[-1]] + length) + 1
    region = " ".join(haystack.texts[tries[0]:region_end])

    values = _draw_values(kind, count, rng, region)
    needles = [_needle(kind, k, v) for k, v in zip(keys, values)]
    tail = _tail(kind, keys[0])
    needle_sizes = [len(ids) for ids in tokenizer([" " + n for n in needles], add_special_tokens=False,
                                                  verbose=False)["input_ids"]]
    fixed = sum(needle_sizes) + len(_ids(tokenizer, tail))
    floor = MIN_HAYSTACK_PER_GAP * (count + 1)
    budget = length - fixed
    if budget < floor:
        raise NeedleTooShort(f"length {length} is too short for {count} {kind} needle(s), the question and some "
                             f"text: use at least {fixed + floor} tokens", fixed + floor)

    # the start among the tries whose whole sentences come closest under the budget
    def fill(s: int) -> int:
        return bisect_right(cum, cum[s] + budget) - 1 - s

    tolerance = length_tolerance(length)

    def fit(start: int):
        """The window from ``start`` measured and adjusted a unit at a time (tokens can merge
        across joins): (prompt, positions, target, tokens), never over ``length``, or None."""
        build = _Builder(haystack, tokenizer, start, needles, needle_sizes, depths, tail, length)
        n = max(1, fill(start))
        built = build(n)
        for _ in range(8):
            excess = built[3] - length
            if -tolerance <= excess <= 0:
                break
            if excess > 0:
                while n > 1 and excess > 0:
                    n -= 1
                    excess -= haystack.sizes[start + n]
            else:
                grown = n
                while start + grown < len(haystack.sizes) and haystack.sizes[start + grown] <= -excess:
                    excess += haystack.sizes[start + grown]
                    grown += 1
                if grown == n:
                    break  # the next unit would overshoot: whole units get no closer
                n = grown
            built = build(n)
        while built[3] > length and n > 1:
            n -= 1
            built = build(n)
        return built if built[3] <= length else None

    # the starts among the tries whose whole sentences come closest under the budget, best first
    best = None
    for start in sorted(tries, key=lambda s: (budget - (cum[s + fill(s)] - cum[s]), s))[:8]:
        built = fit(start)
        if built is not None and (best is None or built[3] > best[3]):
            best = built
        if best is not None and best[3] >= length - tolerance:
            break
    if best is None:
        raise NeedleTooShort(f"length {length} is too short for {count} {kind} needle(s), the question and some "
                             f"text: use at least {fixed + 2 * floor} tokens", fixed + 2 * floor)
    prompt, positions, target, total = best

    order = sorted(range(count), key=lambda i: positions[i])
    return NeedleExample(prompt=prompt, kind=kind, answer=values[0], key=keys[0],
                         keys=[keys[i] for i in order], values=[values[i] for i in order],
                         needles=[needles[i] for i in order], asked=order.index(0), depth=float(depth),
                         target=target, positions=[positions[i] for i in order], length=total)


class _Builder:
    """Composes the prompt for a window of ``n`` units from ``start``: needles at sentence
    boundaries, the question after. Returns (prompt, positions, asked target, token count)."""

    def __init__(self, haystack: Haystack, tokenizer, start, needles, needle_sizes, depths, tail, length):
        self.h, self.tok, self.start = haystack, tokenizer, start
        self.needles, self.sizes, self.depths, self.tail, self.length = needles, needle_sizes, depths, tail, length
        self.tail_size = len(_ids(tokenizer, tail))

    def __call__(self, n: int):
        h, start = self.h, self.start
        cum = [0, *accumulate(h.sizes[start:start + n])]
        allowed = [b for b in range(n + 1) if b in (0, n) or h.starts[start + b]]
        total = cum[n] + sum(self.sizes) + self.tail_size  # estimated prompt tokens

        def target(i: int) -> int:
            return min(max(round(self.depths[i] * self.length), 0), max(total - self.tail_size - self.sizes[i], 0))

        def nearest(t: float, choices) -> int:
            return min(choices, key=lambda b: (abs(cum[b] + shift - t), b))

        others = list(range(1, len(self.needles)))
        t_asked = target(0)
        before = [i for i in others if target(i) < t_asked]
        after = [i for i in others if target(i) >= t_asked]
        shift = sum(self.sizes[i] for i in before)
        asked_at = nearest(t_asked, allowed)
        if asked_at == 0 and before:  # nothing can go before the very start
            after, before, shift = sorted(before + after, key=target), [], 0
            asked_at = nearest(t_asked, allowed)
        if asked_at == n and after:  # nor after the very end
            before, after = sorted(before + after, key=target), []
            shift = sum(self.sizes[i] for i in before)
            asked_at = nearest(t_asked, [b for b in allowed if b > 0])
        place = {0: asked_at}
        shift = 0
        for i in before:
            place[i] = nearest(target(i), [b for b in allowed if b < asked_at])
        shift = sum(self.sizes[i] for i in before) + self.sizes[0]
        for i in after:
            place[i] = nearest(target(i), [b for b in allowed if b > asked_at])

        # compose; needles at one boundary go in order of their targets
        at: dict[int, list[int]] = {}
        for i in sorted(place, key=lambda i: (place[i], target(i), i)):
            at.setdefault(place[i], []).append(i)
        parts: list[str] = []
        where: dict[int, int] = {}
        length = 0
        for b in range(n + 1):
            for i in at.get(b, []):
                # at a paragraph's start the needle is a paragraph of its own; else it joins the text
                sep = "" if not parts else h.breaks[start + b] if b < n else " "
                where[i] = length + len(sep)
                parts.append(sep + self.needles[i])
                length += len(parts[-1])
            if b < n:
                text = (h.breaks[start + b] if parts else "") + h.texts[start + b]
                parts.append(text)
                length += len(text)
        prompt = "".join(parts) + self.tail
        positions, count = _positions(self.tok, prompt, [where[i] for i in range(len(self.needles))])
        return prompt, positions, t_asked, count


def _positions(tokenizer, prompt: str, chars: list[int]) -> tuple[list[int], int]:
    """The token index holding each character offset in ``chars``, and the prompt's token count."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ends = [end for _, end in enc["offset_mapping"]]
        return [bisect_right(ends, c) for c in chars], len(enc["input_ids"])
    return [len(_ids(tokenizer, prompt[:c])) for c in chars], len(_ids(tokenizer, prompt))
