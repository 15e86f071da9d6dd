"""Synthetic retrieval training data in varied formats (issue 44): lookups in key-value lists,
facts hidden in natural text, and several facts asked at once.

Formats (``FORMATS``):

- ``kv``: a list of records in one of several layouts (JSON object, ``key = value`` lines,
  ``key: value`` lines, CSV, a Markdown table), keys made of words and digits, values numbers or
  hex codes; one key is asked.
- ``facts``: natural text (the haystack: a local file, a folder, or the bundled Shakespeare) with
  1 + d facts of one kind inserted at sentence starts ("Tobias Marr's locker number was 48213."),
  the asked one at the chosen depth and d distractors (the same kind, other keys and values)
  elsewhere; one fact is asked.
- ``multi``: as ``facts`` with 2-4 facts asked together ("Give the locker numbers of A, B and C,
  in that order, separated by commas") plus distractors.
- ``quiz``: as ``facts`` with 4-16 facts of one kind, then a question on each, in shuffled order,
  each followed by its answer; every answer is trained. Each fact is a distractor for every other
  question, so the answer must be bound to its key (the latest fact of the form is right once),
  and a document carries one answer per fact instead of one in all.

The prompt ends with a question in one of several framings; the training document is
``prompt + " " + answer + EOS`` with a ``loss_mask`` over the answer and the EOS (a quiz: over each
answer, its line break and the EOS), so ``--loss-on assistant`` trains on the answers alone. Every asked value occurs exactly once in the
prompt (values are redrawn until they do), and the templates, the question framings and the
document frame are our own: neither the classic pass-key filler or phrasing (an evaluation,
``passkey.make_classic_passkey_example``) nor the needle evaluation's sentences
(``needle``). ``classic_phrase`` finds the classic phrasing in a text; a generated example that
holds one (haystack text could) is drawn again.

As a data source (``sources.load_documents``, so also in mixtures):
``retrieval:FORMAT[:LENGTH[:COUNT[:HAYSTACK]]]`` with FORMAT ``kv``, ``facts``, ``multi``, ``quiz`` or
``mixed`` (kv, facts and multi in turn), LENGTH the tokens per document (default 2048), COUNT the number
of documents (default 1000) and HAYSTACK the natural text for ``facts`` and ``multi`` (a file or
folder, default ``shakespeare``), e.g. ``retrieval:mixed:2048:2000:../shared/data/mix/gutenberg_books.jsonl.xz``.
Everything random is drawn from one ``random.Random(seed)``: a seed fixes the documents (a
source's seed is the CRC-32 of its spec).
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass
from itertools import accumulate

from .passkey import CLASSIC_FILLER

FORMATS = ("kv", "facts", "multi", "quiz")
MIXED = ("kv", "facts", "multi")  # what ``mixed`` cycles through (kept as recorded recipes used it)
SOURCE_FORMATS = FORMATS + ("mixed",)
DEFAULT_LENGTH = 2048
DEFAULT_COUNT = 1000
ANSWER_RESERVE = 48  # tokens kept free for the answer and EOS

# The classic pass-key test's sentences and its phrasing: never in training data.
CLASSIC_PHRASES = tuple(s.strip().rstrip(".").lower() for s in CLASSIC_FILLER.split(". ") if s.strip()) + (
    "pass key", "passkey is")
_CLASSIC = re.compile("|".join(re.escape(p) for p in CLASSIC_PHRASES), re.IGNORECASE)

_PEOPLE = ("Tobias Marr", "Agatha Wren", "Silas Penrose", "Imogen Vale", "Corwin Ashe", "Petra Lindqvist",
           "Matthias Crane", "Odile Fairweather", "Rufus Caldwell", "Hester Bright", "Anselm Kroll",
           "Juniper Hale", "Lionel Osgood", "Beatrix Moor", "Casimir Drayton", "Wilhelmina Stone",
           "Emrys Talbot", "Noor Haddad", "Ottilie Brandt", "Horace Quimby", "Sabine Aubert", "Ivo Marek")
_SHIPS = ("Northern Lark", "Grey Heron", "Saint Brendan", "Morning Quill", "Iron Duchess", "Hollow Reed",
          "Amber Tide", "Calloway", "Winter Finch", "Lady Marigold", "Sea Thistle", "Red Kestrel")
# (statement, question, plural noun for multi questions, key pool, value kind)
_FACTS = (
    ("{key}'s locker number was {value}.", "What was {key}'s locker number?", "locker numbers of", _PEOPLE, "number"),
    ("The parcel addressed to {key} bore the stamp {value}.", "Which stamp did the parcel addressed to {key} bear?",
     "stamps on the parcels addressed to", _PEOPLE, "code"),
    ("According to the harbour ledger, the {key} carried cargo tag {value}.",
     "Which cargo tag did the {key} carry, according to the harbour ledger?", "cargo tags of the", _SHIPS, "code"),
    ("{key} scratched the figure {value} on the back of the map.",
     "What figure did {key} scratch on the back of the map?", "figures scratched on the map by", _PEOPLE, "number"),
    ("The telephone extension of {key} was {value}.", "What was the telephone extension of {key}?",
     "telephone extensions of", _PEOPLE, "number"),
)
_FRAMES = ("\n\nQuestion: {q}\nAnswer:", "\n\nQ: {q}\nA:", "\n\n{q}\n", "\n\n### Query\n{q}\n### Result\n",
           "\n\nRead the text above and reply briefly. {q}")
_QUIZ_HEADERS = ("\n\nQuestions on the text above, each answered briefly.\n", "\n\nQuiz\n",
                 "\n\n### Questions and answers\n", "\n\nSome details from the passage:\n")
_QUIZ_TURNS = ("Q: {q}\nA:", "Question: {q}\nAnswer:", "{n}. {q}\n", "- {q}")
QUIZ_FACTS = (4, 16)  # facts (and questions) per quiz document, at most one per ~120 tokens
_KV_QUESTIONS = ("What value is stored under {key}?", "Look up the entry {key}. What is its value?",
                 "Which value belongs to {key}?", "In the records above, {key} corresponds to which value?",
                 "Find {key} in the list and give its value.")
_KV_HEADERS = ("", "Lookup table:\n", "Registry export (key, value).\n", "The following records were saved.\n",
               "Inventory of identifiers:\n")
_KEY_PARTS = ("amber", "birch", "cinder", "delta", "ember", "fable", "garnet", "harbor", "indigo", "juniper",
              "kestrel", "lumen", "marble", "nectar", "onyx", "pewter", "quill", "russet", "sable", "tundra",
              "umber", "vesper", "willow", "xylem", "yarrow", "zephyr")


def classic_phrase(text: str) -> str | None:
    """The first of the classic pass-key test's sentences or phrasing found in ``text`` (any case), or None."""
    found = _CLASSIC.search(text)
    return found.group(0) if found else None


@dataclass
class RetrievalExample:
    """One example: ``answer`` follows ``prompt`` after a space. ``values[i]`` is the i-th asked
    value's record or fact, starting at character ``positions[i]`` of the prompt; ``depths[i]`` is
    the fraction of the list's characters (kv) or of the natural text's tokens (facts, not counting
    the facts) before it."""

    prompt: str
    answer: str
    format: str
    values: list[str]
    positions: list[int]
    depths: list[float]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _value(rng: random.Random, kind: str) -> str:
    if kind == "number":
        return str(rng.randint(10_000, 9_999_999))
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + "-" + str(rng.randint(1000, 99999))


def _distinct_values(rng: random.Random, kind: str, count: int) -> list[str]:
    values: list[str] = []
    while len(values) < count:
        v = _value(rng, kind)
        if v not in values:
            values.append(v)
    return values


def _once(text: str, value: str) -> bool:
    """``value`` occurs exactly once in ``text``, and not inside a longer number or word."""
    return len(re.findall(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text)) == 1 and text.count(value) == 1


def _check(length, what: str = "length") -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"{what} must be a positive integer, got {length!r}")


def _check_depth(depth) -> None:
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1):
        raise ValueError(f"depth must be in [0, 1] or None, got {depth!r}")


# ---------------------------------------------------------------------------------------------
# key-value lists


def _kv_layout(rng: random.Random):
    """(render records -> text, name) for one of the layouts."""
    style = rng.randrange(5)
    if style == 0:
        return lambda recs: json.dumps(dict(recs), indent=rng.choice([None, 1, 2])), "json"
    if style == 1:
        return lambda recs: "\n".join(f"{k} = {v}" for k, v in recs), "equals"
    if style == 2:
        return lambda recs: "\n".join(f"{k}: {v}" for k, v in recs), "colon"
    if style == 3:
        return lambda recs: "key,value\n" + "\n".join(f"{k},{v}" for k, v in recs), "csv"
    return lambda recs: "| key | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in recs), "markdown"


def make_kv_example(rng: random.Random, tokenizer, length: int, *, depth: float | None = None) -> RetrievalExample:
    """A list of records in at most ``length`` tokens, the asked record at ``depth`` of the list
    (random when None)."""
    _check(length)
    _check_depth(depth)
    render, _ = _kv_layout(rng)
    kind = rng.choice(("number", "code"))
    header = rng.choice(_KV_HEADERS)
    frame, question = rng.choice(_FRAMES), rng.choice(_KV_QUESTIONS)

    def key() -> str:
        return f"{rng.choice(_KEY_PARTS)}-{rng.choice(_KEY_PARTS)}-{rng.randint(10, 99)}"

    probe = [(key(), _value(rng, kind)) for _ in range(8)]
    per_record = max(1, -(-len(_ids(tokenizer, render(probe))) // len(probe)))
    fixed = len(_ids(tokenizer, header + frame.format(q=question.format(key=probe[0][0]))))
    n = max(2, (length - fixed) // per_record)
    keys: list[str] = []
    values: list[str] = []
    while len(keys) < n:
        k, v = key(), _value(rng, kind)
        if k not in keys and v not in values:
            keys.append(k)
            values.append(v)
    while True:
        asked = round((rng.random() if depth is None else depth) * (n - 1))
        body = render(list(zip(keys[:n], values[:n])))
        prompt = header + body + frame.format(q=question.format(key=keys[asked]))
        size = len(_ids(tokenizer, prompt))
        if size <= length or n <= 2:
            break
        n = max(2, n - max(1, -(-(size - length) // per_record)))
    if size > length:
        raise ValueError(f"length {length} is too short for a key-value example: use at least {size} tokens")
    value = values[asked]
    if not _once(prompt, value):  # a value inside a key, e.g.: draw again
        return make_kv_example(rng, tokenizer, length, depth=depth)
    at = prompt.index(value)
    return RetrievalExample(prompt, value, "kv", [value], [at], [at / max(1, len(header + body))])


# ---------------------------------------------------------------------------------------------
# facts in natural text


def make_fact_example(rng: random.Random, tokenizer, haystack, length: int, *, asked: int = 1,
                      distractors: int | None = None, depth: float | None = None) -> RetrievalExample:
    """Natural text of ~``length`` tokens from ``haystack`` (a ``needle.Haystack``) with
    ``asked`` facts asked (``multi`` when > 1) and ``distractors`` more (0-4 when None). With one
    asked fact, ``depth`` places it (random when None); several asked facts go at random depths."""
    from .needle import Haystack

    _check(length)
    _check_depth(depth)
    _check(asked, "asked")
    if not isinstance(haystack, Haystack):
        raise ValueError(f"haystack must be a linearize.data.needle.Haystack, got {type(haystack).__name__}")
    statement, question, noun, pool, kind = rng.choice(_FACTS)
    distractors = rng.randint(0, 4) if distractors is None else distractors
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ValueError(f"distractors must be a non-negative integer or None, got {distractors!r}")
    count = asked + distractors
    if count > len(pool):
        raise ValueError(f"at most {len(pool)} facts of one kind, got {asked} asked + {distractors} distractors")
    keys = rng.sample(list(pool), count)  # the first `asked` are asked
    if asked == 1:
        q = question.format(key=keys[0])
        answer_of = lambda vals: vals[0]  # noqa: E731
    else:
        names = ", ".join(keys[:asked - 1]) + " and " + keys[asked - 1]
        q = f"Give the {noun} {names}, in that order, separated by commas."
        answer_of = lambda vals: ", ".join(vals[:asked])  # noqa: E731
    tail = rng.choice(_FRAMES).format(q=q)
    depths = [rng.random() if (depth is None or i > 0 or asked > 1) else float(depth) for i in range(count)]

    for _ in range(16):  # draw windows and values until every asked value occurs once
        values = _distinct_values(rng, kind, count)
        facts = [statement.format(key=k, value=v) for k, v in zip(keys, values)]
        fixed = len(_ids(tokenizer, " ".join(facts) + tail)) + count
        budget = length - fixed
        if budget < 8 * (count + 1):
            raise ValueError(f"length {length} is too short for {count} facts and the question: use at least "
                             f"{fixed + 8 * (count + 1)} tokens")
        prompt, positions, at = _compose(rng, tokenizer, haystack, facts, depths, tail, budget, length)
        answer = answer_of(values)
        if prompt is not None and all(_once(prompt, v) for v in values) and classic_phrase(prompt) is None:
            asked_values = values[:asked]
            return RetrievalExample(prompt, answer, "facts" if asked == 1 else "multi", asked_values,
                                    positions[:asked], at[:asked])
    raise ValueError("could not draw a fact example whose values occur once in the text; give a larger haystack")


@dataclass
class QuizExample:
    """Natural text holding facts of one kind, then ``header`` and one turn per fact: ``questions[i]``
    (ending where the answer starts) followed by `` answers[i]`` and a line break.
    ``positions[i]`` is where the fact asked in turn i starts in ``text``."""

    text: str
    header: str
    questions: list[str]
    answers: list[str]
    positions: list[int]

    def pieces(self) -> list[tuple[str, bool]]:
        """(text, trained) in order: the text with the header and the questions untrained, each answer trained."""
        return [(self.text + self.header, False)] + _quiz_turns(self.questions, self.answers)

    @property
    def prompt(self) -> str:
        return "".join(text for text, _ in self.pieces())


def _quiz_turns(questions: list[str], answers: list[str]) -> list[tuple[str, bool]]:
    """Each question untrained, then its answer after a space with a line break, trained."""
    return [piece for q, a in zip(questions, answers) for piece in ((q, False), (f" {a}\n", True))]


def make_quiz_example(rng: random.Random, tokenizer, haystack, length: int, *, facts: int | None = None) -> QuizExample:
    """Natural text from ``haystack`` with ``facts`` facts of one kind at random depths (4-16 when
    None, as the length allows), then a question on each in shuffled order with its answer, all in
    at most ``length`` tokens."""
    from .needle import Haystack

    _check(length)
    if not isinstance(haystack, Haystack):
        raise ValueError(f"haystack must be a linearize.data.needle.Haystack, got {type(haystack).__name__}")
    statement, question, _, pool, kind = rng.choice(_FACTS)
    cap = min(len(pool), QUIZ_FACTS[1], length // 120)
    if facts is None:
        if cap < 2:
            raise ValueError(f"length {length} is too short for a quiz: use at least 240 tokens")
        facts = rng.randint(min(QUIZ_FACTS[0], cap), cap)
    if isinstance(facts, bool) or not isinstance(facts, int) or not 2 <= facts <= len(pool):
        raise ValueError(f"facts must be an integer in [2, {len(pool)}], got {facts!r}")
    keys = rng.sample(list(pool), facts)
    header, turn = rng.choice(_QUIZ_HEADERS), rng.choice(_QUIZ_TURNS)
    order = rng.sample(range(facts), facts)  # the questions' order, independent of the facts'
    questions = [turn.format(q=question.format(key=keys[j]), n=n + 1) for n, j in enumerate(order)]
    for _ in range(16):  # draw values until each occurs once in the text
        values = _distinct_values(rng, kind, facts)
        answers = [values[j] for j in order]
        quiz = header + "".join(text for text, _ in _quiz_turns(questions, answers))
        lines = [statement.format(key=k, value=v) for k, v in zip(keys, values)]
        fixed = len(_ids(tokenizer, " ".join(lines) + quiz)) + 2 * facts  # (+ joins between the pieces)
        budget = length - fixed
        if budget < 8 * (facts + 1):
            raise ValueError(f"length {length} is too short for {facts} facts and their questions: use at least "
                             f"{fixed + 8 * (facts + 1)} tokens")
        text, positions, _ = _compose(rng, tokenizer, haystack, lines, [rng.random() for _ in keys], quiz,
                                      budget, length)
        if text is not None:
            text = text[: len(text) - len(quiz)]
            if all(_once(text, v) for v in values) and classic_phrase(text + quiz) is None:
                return QuizExample(text, header, questions, answers, [positions[j] for j in order])
    raise ValueError("could not draw a quiz whose values occur once in the text; give a larger haystack")


def _document(tokenizer, pieces: list[tuple[str, bool]], eos: list[int], length: int):
    """A ``sources.Document`` of (text, trained) ``pieces`` and the EOS (trained), at most ``length``
    tokens (a rare long answer is cut, never over a row)."""
    from .sources import Document

    ids, mask = [], []
    for text, trained in pieces:
        part = _ids(tokenizer, text)
        ids += part
        mask += [trained] * len(part)
    return Document((ids + eos)[:length], (mask + [True] * len(eos))[:length])


def _compose(rng, tokenizer, haystack, facts, depths, tail, budget, length):
    """Haystack units from a random sentence start, about ``budget`` tokens, with ``facts`` at the
    sentence starts nearest their ``depths``; shortened until the prompt fits ``length``. Units
    holding a classic pass-key phrase are left out. Returns (prompt, character position of each
    fact, its depth: the fraction of the text's tokens before it) or Nones."""
    starts = [i for i, s in enumerate(haystack.starts) if s]
    first = rng.choice(starts[: max(1, len(starts) - 1)])
    units, total = [], 0  # the window's unit indices
    for i in range(first, len(haystack.sizes)):
        if total + haystack.sizes[i] > budget:
            break
        if classic_phrase(haystack.texts[i]) is None:
            units.append(i)
            total += haystack.sizes[i]
    for _ in range(8):
        if not units:
            return None, None, None
        n = len(units)
        cum = [0, *accumulate(haystack.sizes[i] for i in units)]
        bounds = [b for b in range(n) if haystack.starts[units[b]]] + [n]
        place = [min(bounds, key=lambda b: abs(cum[b] - d * cum[n])) for d in depths]
        order = sorted(range(len(facts)), key=lambda i: (place[i], depths[i]))
        parts, where, before, pos, k = [], {}, {}, 0, 0
        for b in range(n + 1):
            while k < len(order) and place[order[k]] == b:
                sep = "" if not parts else " "
                where[order[k]], before[order[k]] = pos + len(sep), cum[b] / max(1, cum[n])
                parts.append(sep + facts[order[k]])
                pos += len(parts[-1])
                k += 1
            if b < n:
                text = (haystack.breaks[units[b]] if parts else "") + haystack.texts[units[b]]
                parts.append(text)
                pos += len(text)
        prompt = "".join(parts) + tail
        excess = len(_ids(tokenizer, prompt)) - length
        if excess <= 0:
            return prompt, [where[i] for i in range(len(facts))], [before[i] for i in range(len(facts))]
        while len(units) > 1 and excess > 0:
            excess -= haystack.sizes[units.pop()]
    return None, None, None


# ---------------------------------------------------------------------------------------------
# documents and the data source


def retrieval_documents(tokenizer, fmt: str, *, length: int = DEFAULT_LENGTH, count: int = DEFAULT_COUNT,
                        seed: int = 0, haystack=None):
    """``count`` documents ``prompt + " " + answer + EOS`` of at most ``length`` tokens, each a
    ``sources.Document`` whose ``loss_mask`` covers the answer and the EOS. ``fmt``: one of
    ``SOURCE_FORMATS``; ``haystack`` (a ``needle.Haystack``) is needed for facts, multi and mixed."""
    if fmt not in SOURCE_FORMATS:
        raise ValueError(f"retrieval format must be one of {SOURCE_FORMATS}, got {fmt!r}")
    _check(length)
    _check(count, "count")
    if fmt != "kv" and haystack is None:
        raise ValueError(f"retrieval format {fmt!r} needs a haystack of natural text")
    rng = random.Random(seed)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    documents = []
    for i in range(count):
        kind = MIXED[i % len(MIXED)] if fmt == "mixed" else fmt
        target = length - ANSWER_RESERVE
        if kind == "quiz":
            pieces = make_quiz_example(rng, tokenizer, haystack, target).pieces()
        else:
            if kind == "kv":
                example = make_kv_example(rng, tokenizer, target)
            else:  # facts take at most about a third of a short document (~25 tokens each)
                room = max(2, target // 75)
                asked = 1 if kind == "facts" else rng.randint(2, min(4, room))
                example = make_fact_example(rng, tokenizer, haystack, target, asked=asked,
                                            distractors=rng.randint(0, max(0, min(4, room - asked))))
            pieces = [(example.prompt, False), (" " + example.answer, True)]
        documents.append(_document(tokenizer, pieces, eos, length))
    return documents


_SOURCE = re.compile(r"^retrieval:([a-z]+)(?::(\d+)(?::(\d+)(?::(.+))?)?)?$")
SOURCE_FORM = "'retrieval:FORMAT[:LENGTH[:COUNT[:HAYSTACK]]]' (FORMAT one of kv, facts, multi, quiz, mixed)"


def retrieval_source(source: str, tokenizer, *, max_documents: int | None = None, max_tokens: int | None = None):
    """The documents of a ``retrieval:...`` source spec (see the module docstring), seeded by the
    spec's text, so two specs (``retrieval:kv`` and ``retrieval:mixed``) draw different examples."""
    from .needle import load_haystack

    m = _SOURCE.match(source)
    if m is None or m.group(1) not in SOURCE_FORMATS:
        raise ValueError(f"bad retrieval source {source!r}: use {SOURCE_FORM} with positive integers, "
                         "e.g. 'retrieval:kv:2048:500' or 'retrieval:facts:2048:500:books.jsonl.xz'")
    fmt = m.group(1)
    length = int(m.group(2)) if m.group(2) else DEFAULT_LENGTH
    count = int(m.group(3)) if m.group(3) else DEFAULT_COUNT
    if length < 1 or count < 1:
        raise ValueError(f"bad retrieval source {source!r}: LENGTH and COUNT must be at least 1")
    if fmt == "kv" and m.group(4):
        raise ValueError(f"bad retrieval source {source!r}: format 'kv' takes no HAYSTACK (its lists are made up)")
    if max_documents is not None:
        count = min(count, max_documents)
    if max_tokens is not None:
        count = min(count, -(-max_tokens // length))
    haystack = None
    if fmt != "kv":  # enough text for varied windows, without tokenizing a whole library
        haystack = load_haystack(m.group(4) or "shakespeare", tokenizer,
                                 max_tokens=max(4 * length, min(count * length, 2_000_000)))
    return retrieval_documents(tokenizer, fmt, length=length, count=count, seed=zlib.crc32(source.encode()),
                               haystack=haystack)
