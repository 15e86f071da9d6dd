"""The data layer: sources -> token documents, packing policies, validation split, passkeys."""

from __future__ import annotations

import bz2
import copy
import gzip
import json
import lzma
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from linearize.data import (PACKING_POLICIES, Document, PasskeyExample, Rows, load_documents, load_mixture,
                            make_classic_passkey_example, make_passkey_example, mix_documents, pack,
                            parse_data_spec, passkey_documents, split_documents, trim_bucket)
from linearize.data.passkey import CLASSIC_FILLER
from linearize.data.sources import shakespeare_plays

DATA = Path("/work/shared/data")


@pytest.fixture(scope="session")
def plain_tok(tok):
    """The same tokenizer without a chat template (classic Alpaca prompt path)."""
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


class CharTokenizer:
    """One id per character: lets the tests read all 38 plays without minutes of BPE."""

    eos_token_id = 0
    chat_template = None

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        return {"input_ids": [[ord(c) % 5000 + 1 for c in t] for t in texts]}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


ALPACA = [
    {"instruction": "Name a colour of the sky.", "input": "", "output": "The sky is usually blue."},
    {"instruction": "Translate to French.", "input": "good morning", "output": "bonjour"},
]


# ---------------------------------------------------------------------------------------------
# sources


def test_alpaca_json_uses_chat_template(tmp_path, tok):
    path = _write(tmp_path / "a.json", json.dumps(ALPACA))
    docs = load_documents(str(path), tok)
    assert len(docs) == 2
    first, second = (tok.decode(d) for d in docs)
    assert "Name a colour of the sky." in first and "The sky is usually blue." in first
    assert "<|im_start|>user" in first and "<|im_start|>assistant" in first
    assert "Translate to French.\n\ngood morning" in second and "bonjour" in second
    for d in docs:
        assert d[-1] == tok.eos_token_id and d[-2] != tok.eos_token_id  # one EOS, no doubled end
        assert tok.decode(d).endswith("<|im_end|>")


def test_alpaca_jsonl_matches_json(tmp_path, tok):
    as_json = load_documents(str(_write(tmp_path / "a.json", json.dumps(ALPACA))), tok)
    lines = "\n".join(json.dumps(r) for r in ALPACA) + "\n\n"  # a trailing blank line is fine
    as_jsonl = load_documents(str(_write(tmp_path / "a.jsonl", lines)), tok)
    assert as_jsonl == as_json


def test_alpaca_without_chat_template_uses_classic_prompt(tmp_path, plain_tok):
    docs = load_documents(str(_write(tmp_path / "a.json", json.dumps(ALPACA))), plain_tok)
    first, second = (plain_tok.decode(d) for d in docs)
    assert "### Instruction:\nName a colour of the sky.\n\n### Response:\nThe sky is usually blue." in first
    assert "### Input:" not in first and "<|im_start|>" not in first
    assert "### Instruction:\nTranslate to French.\n\n### Input:\ngood morning\n\n### Response:\nbonjour" in second
    assert all(d[-1] == plain_tok.eos_token_id for d in docs)


def test_text_jsonl_with_custom_field(tmp_path, tok):
    lines = [json.dumps({"body": f"Document number {i} talks about apples."}) for i in range(3)]
    path = _write(tmp_path / "t.jsonl", "\n".join(lines))
    docs = load_documents(str(path), tok, text_field="body")
    assert [tok.decode(d[:-1]) for d in docs] == [f"Document number {i} talks about apples." for i in range(3)]
    assert all(d[-1] == tok.eos_token_id for d in docs)
    with pytest.raises(ValueError, match=r"record 1 .*'text'.*'instruction'"):
        load_documents(str(path), tok)  # the default field "text" is absent


@pytest.mark.parametrize("suffix", [".txt", ".md"])
def test_text_file_is_one_document(tmp_path, tok, suffix):
    text = "# Title\n\nFirst paragraph.\n\nSecond paragraph, with more words.\n"
    docs = load_documents(str(_write(tmp_path / f"doc{suffix}", text)), tok)
    assert len(docs) == 1
    assert docs[0][-1] == tok.eos_token_id
    assert tok.decode(docs[0][:-1]) == text


def test_folder_reads_supported_files_recursively_in_path_order(tmp_path, tok):
    _write(tmp_path / "b.txt", "from b")
    _write(tmp_path / "a" / "z.md", "from a/z")
    _write(tmp_path / "c.jsonl", json.dumps({"text": "from c"}))
    _write(tmp_path / "skip.csv", "not,read")
    docs = load_documents(str(tmp_path), tok)
    assert [tok.decode(d[:-1]) for d in docs] == ["from a/z", "from b", "from c"]
    assert load_documents(str(tmp_path), tok, max_documents=2) == docs[:2]


def test_max_documents(tmp_path, tok):
    path = _write(tmp_path / "t.jsonl", "\n".join(json.dumps({"text": f"doc {i}"}) for i in range(10)))
    docs = load_documents(str(path), tok, max_documents=4)
    assert [tok.decode(d[:-1]) for d in docs] == [f"doc {i}" for i in range(4)]
    with pytest.raises(ValueError, match="max_documents"):
        load_documents(str(path), tok, max_documents=0)


def test_empty_folder_file_and_text(tmp_path, tok):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "only_csv" / "x.csv", "a,b")
    with pytest.raises(ValueError, match="holds no"):
        load_documents(str(tmp_path / "empty"), tok)
    with pytest.raises(ValueError, match="holds no"):
        load_documents(str(tmp_path / "only_csv"), tok)
    with pytest.raises(ValueError, match="no text found"):
        load_documents(str(_write(tmp_path / "blank.txt", "  \n\n")), tok)
    with pytest.raises(ValueError, match="no text found"):
        load_documents(str(_write(tmp_path / "none.json", "[]")), tok)


def test_bad_record_names_file_record_and_expected_keys(tmp_path, tok):
    records = [ALPACA[0], {"question": "q", "answer": "a"}]
    path = _write(tmp_path / "bad.json", json.dumps(records))
    with pytest.raises(ValueError) as err:
        load_documents(str(path), tok)
    msg = str(err.value)
    assert "bad.json" in msg and "record 2" in msg
    assert "'answer', 'question'" in msg and "'instruction'" in msg and "'output'" in msg and "'text'" in msg
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_documents(str(_write(tmp_path / "broken.jsonl", '{"text": "ok"}\n{"text": \n')), tok)


@pytest.mark.parametrize("name, raw, where", [
    ("latin1.txt", "Señor Bañez\n".encode("latin-1"), "byte 0xf1 at offset 2, line 1"),
    ("cp1251.md", "ok\n".encode() + "Привет".encode("cp1251"), "byte 0xcf at offset 3, line 2"),
    ("records.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "line 2"),
    ("records.json", b'[{"text": "\xd1"}]', "byte 0xd1 at offset 11"),
])
def test_non_utf8_file_is_named(tmp_path, name, raw, where):
    """A data file that is not UTF-8 is named, with where it breaks and that it must be UTF-8 (issue 40),
    read alone or from a folder."""
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / name
    path.write_bytes(raw)
    for source in (path, tmp_path / "data"):
        with pytest.raises(ValueError) as err:
            load_documents(str(source), CharTokenizer())
        msg = str(err.value)
        assert str(path) in msg and "not UTF-8 text" in msg and "must be UTF-8" in msg and where in msg, msg
        assert "codec can't decode" not in msg


@pytest.mark.parametrize("source", ["no/such/dir", "missing.json", "./data", "/tmp/definitely-not-here-42.txt"])
def test_missing_path_is_file_not_found_with_accepted_forms(tmp_path, tok, source):
    with pytest.raises(FileNotFoundError) as err:
        load_documents(source, tok)
    msg = str(err.value)
    assert repr(source) in msg and "does not exist" in msg
    assert "shakespeare" in msg and "passkey" in msg and "Hugging Face" in msg


def test_hub_name_without_datasets_gives_clear_error(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail, installed or not
    for source in ["linearize-test-org/no-such-dataset", "wikitext:wikitext-2-raw-v1"]:
        with pytest.raises(FileNotFoundError) as err:
            load_documents(source, tok)
        msg = str(err.value)
        assert "not an existing file or folder" in msg and "hub dataset could not be loaded" in msg
        assert "'datasets' package is not installed" in msg


def test_shakespeare_is_one_document_per_play():
    plays = shakespeare_plays()
    assert len(plays) >= 30
    docs = load_documents("shakespeare", CharTokenizer())
    assert len(docs) == len(plays)
    assert all(d[-1] == 0 and len(d) > 20_000 for d in docs)
    everything = "".join(plays)
    assert "Fair is foul, and foul is fair" in everything and "To be, or not to be" in everything
    assert "**" not in everything and "  \n" not in everything  # Markdown markup is gone


def test_shakespeare_with_real_tokenizer(tok):
    docs = load_documents("shakespeare", tok, max_documents=2)
    assert len(docs) == 2 and all(d[-1] == tok.eos_token_id for d in docs)
    assert tok.decode(docs[0][:-1]) == shakespeare_plays()[0]


def test_passkey_source(tok):
    docs = load_documents("passkey:300:3", tok)
    assert len(docs) == 3
    for d in docs:
        assert 250 <= len(d) <= 300 and d[-1] == tok.eos_token_id
        assert "passkey" in tok.decode(d)
    assert load_documents("passkey:300:3", tok) == docs  # fixed seed
    assert len(load_documents("passkey:300:9", tok, max_documents=2)) == 2
    with pytest.raises(ValueError, match="passkey:LENGTH"):
        load_documents("passkey:long", tok)
    with pytest.raises(ValueError, match="length 50 is too short"):
        load_documents("passkey:50:1", tok)


def _skip_without(name: str) -> Path:
    path = DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    return path


def test_real_alpaca_and_gsm8k_files(tok):
    for name in ["alpaca_en_demo.json", "gsm8k_train_alpaca_format.json"]:
        path = _skip_without(name)
        records = json.loads(path.read_text())[:5]
        docs = load_documents(str(path), tok, max_documents=5)
        assert len(docs) == 5
        for record, doc in zip(records, docs):
            text = tok.decode(doc)
            assert record["instruction"].strip() in text and record["output"].strip() in text
            assert doc[-1] == tok.eos_token_id


def test_real_text_files(tok):
    c4 = load_documents(str(_skip_without("c4_demo.jsonl")), tok, max_documents=10)
    assert len(c4) == 10 and all(d[-1] == tok.eos_token_id for d in c4)
    wiki = _skip_without("wiki_demo.txt")
    docs = load_documents(str(wiki), tok)
    assert len(docs) == 1 and len(docs[0]) > 100_000
    assert tok.decode(docs[0][:50]) == wiki.read_text()[: len(tok.decode(docs[0][:50]))]


# ---------------------------------------------------------------------------------------------
# packing


def _docs(lengths):
    """Document i holds tokens 1000*i + 1 ... so every token names its document."""
    return [list(range(1000 * i + 1, 1000 * i + 1 + n)) for i, n in enumerate(lengths)]


def test_split_rows_never_mix_documents_and_mask_padding():
    docs = _docs([5, 40, 16, 37, 10])
    rows = pack(docs, 16, "split", min_tokens=5, pad_id=0)
    assert rows.input_ids.dtype == torch.long and rows.attention_mask.dtype == torch.bool
    assert rows.input_ids.shape == (len(rows), 16)
    kept = []
    for ids, mask in zip(rows.input_ids, rows.attention_mask):
        real = ids[mask].tolist()
        assert len({t // 1000 for t in real}) == 1  # one document per row
        assert mask[: len(real)].all() and not mask[len(real):].any()  # right padding only
        assert (ids[~mask] == 0).all()
        kept.append(real)
    # every document comes back whole and in order (all tails here have >= 5 tokens)
    assert [t for row in kept for t in row] == [t for d in docs for t in d]
    assert rows.num_tokens == sum(map(len, docs))


def test_split_min_tokens_drops_or_keeps_short_tails():
    docs = _docs([2 * 16 + 5, 4, 16])
    assert len(pack(docs, 16, "split", min_tokens=16)) == 3  # two full pieces + the 16-token document
    lenient = pack(docs, 16, "split", min_tokens=4)
    assert len(lenient) == 5
    assert lenient.attention_mask.sum(1).tolist() == [16, 16, 5, 4, 16]
    assert len(pack(docs, 16, "split", min_tokens=5)) == 4  # the 4-token document is dropped, the 5-token tail kept


def test_batch_labels_and_trimming():
    rows = pack(_docs([5, 70, 256]), 256, "split", min_tokens=1)  # trimmed in steps of trim_bucket(256) = 64
    b = rows.batch([0, 1])
    assert b["input_ids"].shape == (2, 128)  # the longest row (70) rounded up to the bucket
    assert b["attention_mask"].tolist()[0] == [1] * 5 + [0] * 123
    assert (b["labels"][b["attention_mask"] == 0] == -100).all()
    assert torch.equal(b["labels"][b["attention_mask"] == 1], b["input_ids"][b["attention_mask"] == 1])
    assert rows.batch([1, 2])["input_ids"].shape == (2, 256)
    assert rows.batch(torch.tensor([0]))["input_ids"].tolist() == [[1, 2, 3, 4, 5] + [0] * 59]
    short = pack(_docs([5, 9, 16]), 16, "split", min_tokens=1)  # seq_len <= 64: one bucket, never trimmed
    assert short.batch([0])["input_ids"].shape == (1, 16)
    with pytest.raises(ValueError, match="at least one"):
        rows.batch([])
    with pytest.raises(IndexError):
        rows.batch([3])


def test_trim_bucket_gives_a_few_widths_in_whole_chunks():
    assert [trim_bucket(n) for n in (2048, 4096, 512, 1000, 100, 64, 32)] == [256, 512, 64, 128, 64, 64, 32]
    seq_len = 1000
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, seq_len + 1, (64,), generator=g).tolist()
    rows = pack([list(range(1, n + 1)) for n in lengths], seq_len, "split", min_tokens=1)
    widths = set()
    for _ in range(200):
        index = torch.randint(0, len(rows), (3,), generator=g).tolist()
        b = rows.batch(index)
        width, longest = b["input_ids"].shape[1], max(lengths[i] for i in index)
        assert width == seq_len or width % 128 == 0
        assert longest <= width < longest + 128  # no real column lost, less than a bucket of padding added
        assert torch.equal(b["input_ids"], rows.input_ids[index][:, :width])
        assert not rows.attention_mask[index][:, width:].any()  # only padding is dropped
        assert (b["labels"][b["attention_mask"] == 0] == -100).all()
        widths.add(width)
    assert len(widths) > 1 and widths <= {128 * k for k in range(1, 8)} | {seq_len}


def test_concat_rows_are_full_and_preserve_the_stream():
    docs = _docs([5, 40, 16, 33, 10])
    stream = [t for d in docs for t in d]
    rows = pack(docs, 16, "concat")
    assert len(rows) == len(stream) // 16
    assert rows.attention_mask.all()
    assert rows.input_ids.flatten().tolist() == stream[: len(rows) * 16]
    assert any(len({t // 1000 for t in row.tolist()}) > 1 for row in rows.input_ids)  # it does mix
    assert (rows.batch(range(len(rows)))["labels"] == rows.input_ids).all()


def _doc_runs(row) -> list[list[int]]:
    """A packed row's real tokens as runs of one document each (tokens name their document)."""
    runs = []
    for t in row:
        if runs and runs[-1][-1] // 1000 == t // 1000:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def test_pack_keeps_every_token_once_and_cuts_only_long_documents():
    seq_len = 16
    lengths = [5, 40, 16, 3, 11, 7, 9, 2, 33, 1, 14, 8, 12, 6, 4]
    docs = _docs(lengths)
    rows = pack(docs, seq_len, "pack", pad_id=0)
    assert rows.input_ids.shape == (len(rows), seq_len) and rows.num_tokens == sum(lengths)
    found = {i: [] for i in range(len(docs))}
    for ids, mask in zip(rows.input_ids, rows.attention_mask):
        real = ids[mask].tolist()
        assert mask[: len(real)].all() and not mask[len(real):].any() and (ids[~mask] == 0).all()
        for run in _doc_runs(real):
            found[run[0] // 1000].append(run)
    for i, doc in enumerate(docs):
        pieces = sorted(found[i])
        if len(doc) <= seq_len:
            assert pieces == [doc]  # whole, in one row
        else:  # cut where "split" cuts it: full pieces of seq_len and one tail
            assert pieces == [doc[s:s + seq_len] for s in range(0, len(doc), seq_len)]
    assert len(rows) < len(pack(docs, seq_len, "split", min_tokens=1))
    assert any(len(_doc_runs(ids[mask].tolist())) > 1 for ids, mask in zip(rows.input_ids, rows.attention_mask))


def test_pack_fills_rows_where_split_pads():
    rng = random.Random(0)
    lengths = [rng.randint(5, 60) for _ in range(300)] + [rng.randint(100, 700) for _ in range(30)]
    rng.shuffle(lengths)
    docs, seq_len = _docs(lengths), 128
    packed, split = pack(docs, seq_len, "pack"), pack(docs, seq_len, "split", min_tokens=1)
    assert packed.num_tokens == split.num_tokens == sum(lengths)
    assert packed.fill == pytest.approx(sum(lengths) / (len(packed) * seq_len))
    assert packed.fill >= 0.9 and split.fill < 0.5, (packed.fill, split.fill)
    assert len(packed) <= -(-sum(lengths) // seq_len) + 2  # within two rows of the least possible


def test_pack_is_deterministic():
    rng = random.Random(1)
    sources = [_docs([rng.randint(3, 50) for _ in range(60)]), _docs([rng.randint(40, 300) for _ in range(10)])]

    def rows(seed):
        return pack(mix_documents(sources, [0.5, 0.5], 4000, seed, note=None), 64, "pack")

    a, b, other = rows(3), rows(3), rows(4)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert not torch.equal(a.input_ids[: len(other)], other.input_ids[: len(a)])


def test_pack_loss_masks_follow_their_documents():
    """Masked documents label the tokens divisible by 3; a document without a mask counts whole."""
    docs = []
    for i, doc in enumerate(_docs([7, 30, 5, 12, 9, 3, 20])):
        docs.append(doc if i % 3 == 2 else Document(doc, [t % 3 == 0 for t in doc]))
    rows = pack(docs, 16, "pack", loss_masks=True)
    assert rows.loss_mask is not None
    real = rows.attention_mask
    expected = torch.where((rows.input_ids // 1000) % 3 == 2, True, rows.input_ids % 3 == 0) & real
    assert torch.equal(rows.loss_mask, expected)
    batch = rows.batch(range(len(rows)))
    assert torch.equal(batch["labels"] != -100, expected[:, : batch["labels"].shape[1]])
    assert pack(docs, 16, "pack").loss_mask is None


@pytest.mark.parametrize("policy", PACKING_POLICIES)
def test_document_weights_give_every_piece_one_unit_of_loss(policy):
    """With ``weighting="document"`` each piece (a document, or a seq_len-long part of one) spreads a
    weight of 1 evenly over its labelled tokens, whatever the policy and the loss masks."""
    docs = []
    for i, doc in enumerate(_docs([7, 30, 5, 12, 9, 3, 20, 40])):
        docs.append(doc if i % 3 == 2 else Document(doc, [t % 3 == 0 for t in doc]))
    rows = pack(docs, 16, policy, min_tokens=1, loss_masks=True, weighting="document")
    labelled = rows.loss_mask & rows.attention_mask
    assert torch.all((rows.loss_weight > 0) == labelled)
    # sum the weights of each (document, piece): token ids are 1000 * document + position
    doc, pos = rows.input_ids // 1000, rows.input_ids % 1000 - 1
    sums: dict = {}
    for d, p, w in zip(doc[labelled].tolist(), pos[labelled].tolist(), rows.loss_weight[labelled].tolist()):
        sums[(d, p // 16)] = sums.get((d, p // 16), 0.0) + w
    assert sums and all(v == pytest.approx(1.0) for k, v in sums.items() if policy != "concat" or k != max(sums))
    batch = rows.batch([0, 1])
    assert torch.equal(batch["loss_weight"] > 0, batch["labels"] != -100)
    kept = rows.subset([1, 0])
    assert torch.equal(kept.loss_weight, rows.loss_weight[[1, 0]])
    assert torch.equal(Rows.concat([rows, kept]).loss_weight, torch.cat([rows.loss_weight, kept.loss_weight]))
    assert pack(docs, 16, policy, min_tokens=1, loss_masks=True).loss_weight is None
    with pytest.raises(ValueError, match="with and without loss weights"):
        Rows.concat([rows, pack(docs, 16, policy, min_tokens=1)])


def test_pack_rejects_bad_arguments():
    docs = _docs([40])
    with pytest.raises(ValueError, match="seq_len.*got 1"):
        pack(docs, 1)
    with pytest.raises(ValueError, match="'bogus'.*split, pack, concat"):
        pack(docs, 16, "bogus")
    with pytest.raises(ValueError, match="loss weighting 'tokens'.*token, document"):
        pack(docs, 16, weighting="tokens")
    with pytest.raises(ValueError, match=r"min_tokens.*\[1, seq_len=16\].*got 17"):
        pack(docs, 16, "split", min_tokens=17)
    with pytest.raises(ValueError, match="too short"):
        pack(_docs([3, 8]), 16, "split", min_tokens=10)
    with pytest.raises(ValueError, match="too short"):
        pack(_docs([3, 8]), 16, "concat")
    with pytest.raises(ValueError, match="no token"):
        pack([[], []], 16, "pack")
    from linearize.data.packing import WEIGHTINGS
    from linearize.train.config import LOSS_AVERAGES, PACKING

    assert PACKING_POLICIES == ("split", "pack", "concat") == PACKING  # the CLI's choices, kept without torch
    assert WEIGHTINGS == ("token", "document") == LOSS_AVERAGES
    default = pack(docs, 16)
    assert isinstance(default, Rows) and torch.equal(default.input_ids, pack(docs, 16, "pack").input_ids)
    assert len(default) == 3 and len(pack(docs, 16, "split")) == 2  # "pack" keeps the 8-token tail split drops


# ---------------------------------------------------------------------------------------------
# validation split


def test_split_documents_is_seeded_disjoint_and_covering():
    docs = _docs([3] * 20)
    train, val = split_documents(docs, 0.2, seed=7)
    assert len(val) == 4 and len(train) == 16
    assert sorted(map(tuple, train + val)) == sorted(map(tuple, docs))
    assert not set(map(tuple, train)) & set(map(tuple, val))
    assert split_documents(docs, 0.2, seed=7) == (train, val)
    assert any(split_documents(docs, 0.2, seed=s)[1] != val for s in range(8, 12))
    assert train == [d for d in docs if d in train]  # input order kept


def test_split_documents_edge_cases():
    docs = _docs([3, 4, 5])
    assert len(split_documents(docs, 0.01, seed=0)[1]) == 1  # at least one when asked for any
    assert split_documents(docs, 0.0, seed=0) == (docs, [])
    train, val = split_documents(_docs([100]), 0.1, seed=0)
    assert train == [_docs([90])[0]] and val == [list(range(91, 101))]
    for bad in (-0.1, 0.6):
        with pytest.raises(ValueError, match=r"val_fraction.*\[0, 0.5\]"):
            split_documents(docs, bad, seed=0)


# ---------------------------------------------------------------------------------------------
# passkeys


def _filler_fraction(prompt: str, head_end: int, tail_start: int, sentences: list[str], sentence: str) -> float:
    """Where ``sentence`` sits in the filler (characters), not counting the inserted sentences."""
    at = prompt.index(sentence)
    inserted_before = sum(len(s) for s in sentences if prompt.index(s) < at)
    filler = tail_start - head_end - sum(len(s) for s in sentences)
    return (at - head_end - inserted_before) / filler


@pytest.mark.parametrize("length", [512, 2048])
def test_five_passkey_example(tok, length):
    ex = make_passkey_example(random.Random(3), tok, length)
    assert isinstance(ex, PasskeyExample)
    n = len(tok(ex.prompt, add_special_tokens=False)["input_ids"])
    assert abs(n - length) <= 0.05 * length
    assert len(ex.keys) == 5 and len(set(ex.keys)) == 5
    assert all(5 <= len(k.split()) <= 8 and re.fullmatch(r"[a-z ]+", k) for k in ex.keys)
    assert ex.answer == ex.keys[ex.asked]
    assert ex.prompt.count(ex.answer) == 1
    ordinals = ["first", "second", "third", "fourth", "fifth"]
    assert f"which is the {ordinals[ex.asked]} passkey?" in ex.prompt
    sentences = [f'Remember that the {o} passkey is "{k}".' for o, k in zip(ordinals, ex.keys)]
    positions = [ex.prompt.index(s) for s in sentences]
    assert positions == sorted(positions) and ex.depths == sorted(ex.depths)
    head_end = ex.prompt.index("\n\n") + 2
    tail_start = ex.prompt.rindex("Based on the provided context")
    for s, depth in zip(sentences, ex.depths):
        assert abs(_filler_fraction(ex.prompt, head_end, tail_start, sentences, s) - depth) < 0.06


def test_passkey_is_deterministic_per_seed(tok):
    a = make_passkey_example(random.Random(11), tok, 400)
    assert make_passkey_example(random.Random(11), tok, 400) == a
    assert make_passkey_example(random.Random(12), tok, 400) != a


def test_passkey_options_and_errors(tok):
    ex = make_passkey_example(random.Random(0), tok, 300, num_keys=2, words_per_key=(3, 3),
                              filler="Cats sleep a lot. Dogs bark at night.\n")
    assert len(ex.keys) == 2 and all(len(k.split()) == 3 for k in ex.keys)
    assert "Cats sleep a lot." in ex.prompt and "Macbeth" not in ex.prompt
    with pytest.raises(ValueError, match="length 100 is too short"):
        make_passkey_example(random.Random(0), tok, 100)
    with pytest.raises(ValueError, match="length must be"):
        make_passkey_example(random.Random(0), tok, 0)
    with pytest.raises(ValueError, match="words_per_key"):
        make_passkey_example(random.Random(0), tok, 500, words_per_key=(6, 5))


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.9, 1.0])
def test_classic_passkey_position_matches_depth(tok, depth):
    ex = make_classic_passkey_example(random.Random(5), tok, 1000, depth)
    n = len(tok(ex.prompt, add_special_tokens=False)["input_ids"])
    assert abs(n - 1000) <= 50
    assert re.fullmatch(r"\d{5}", ex.answer) and ex.keys == [ex.answer] and ex.depths == [depth]
    sentence = f"The pass key is {ex.answer}. Remember it. {ex.answer} is the pass key."
    assert ex.prompt.count(sentence) == 1
    assert ex.prompt.endswith("What is the pass key? The pass key is")
    head_end = ex.prompt.index(CLASSIC_FILLER[:20])
    tail_start = ex.prompt.rindex("What is the pass key?")
    assert abs(_filler_fraction(ex.prompt, head_end, tail_start, [sentence], sentence) - depth) < 0.03
    with pytest.raises(ValueError, match="depth"):
        make_classic_passkey_example(random.Random(5), tok, 1000, 1.5)


def test_passkey_documents(tok):
    docs = passkey_documents(tok, length=400, count=4, seed=1)
    assert len(docs) == 4 and docs == passkey_documents(tok, length=400, count=4, seed=1)
    assert docs != passkey_documents(tok, length=400, count=4, seed=2)
    for d in docs:
        assert 350 <= len(d) <= 400 and d[-1] == tok.eos_token_id
        assert re.search(r'passkey\? Answer: [a-z ]+$', tok.decode(d[:-1]))
    # a document fits in one row, so packing keeps every answer
    assert len(pack(docs, 400, "split")) == 4


# ---------------------------------------------------------------------------------------------
# chat records, assistant loss masks (issue 43)

MIX = Path(__file__).resolve().parents[3] / "shared" / "data" / "mix"  # ../shared/data/mix beside the repo


def _runs(doc, decode) -> list[str]:
    """The contiguous runs of masked tokens of ``doc``, each decoded."""
    runs, current = [], []
    for token, keep in zip(doc, doc.loss_mask):
        if keep:
            current.append(token)
        elif current:
            runs.append(decode(current))
            current = []
    if current:
        runs.append(decode(current))
    return runs


CHAT = {"id": "c1", "system": "Answer briefly.", "messages": [
    {"role": "user", "content": "Say yes, please."},
    {"role": "assistant", "content": "yes"},  # also found inside the user turn: the mask must pick the answer
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "It is 4.\nAnything else?"},
]}


def test_chat_record_uses_chat_template_and_masks_exactly_the_answers(tmp_path, tok):
    path = _write(tmp_path / "chat.jsonl", json.dumps(CHAT) + "\n")
    [doc] = load_documents(str(path), tok)
    messages = [{"role": "system", "content": "Answer briefly."}, *CHAT["messages"]]
    assert tok.decode(doc) == tok.apply_chat_template(messages, tokenize=False).rstrip()
    assert doc[-1] == tok.eos_token_id and doc.count(tok.eos_token_id) == 5  # one end per turn, no extra EOS
    assert len(doc.loss_mask) == len(doc)
    # the answers and the end-of-turn token after each, nothing else (not "yes" in the user turn)
    assert _runs(doc, tok.decode) == ["yes<|im_end|>", "It is 4.\nAnything else?<|im_end|>"]
    unmasked = tok.decode([t for t, m in zip(doc, doc.loss_mask) if not m])
    assert "Say yes, please." in unmasked and "Answer briefly." in unmasked and "It is 4" not in unmasked


def test_chat_without_template_is_role_colon_content(tmp_path, plain_tok):
    path = _write(tmp_path / "chat.json", json.dumps([CHAT]))
    [doc] = load_documents(str(path), plain_tok)
    text = ("system: Answer briefly.\n\nuser: Say yes, please.\n\nassistant: yes\n\nuser: And 2+2?\n\n"
            "assistant: It is 4.\nAnything else?")
    assert plain_tok.decode(doc) == text + plain_tok.eos_token
    # the appended EOS ends the last answer, so it is trained too; a token that holds the separator's
    # space and the answer's first word (" yes") is part of the answer
    assert _runs(doc, plain_tok.decode) == [" yes", " It is 4.\nAnything else?" + plain_tok.eos_token]


def test_chat_mask_without_offsets_tokenizes_spans_apart(tmp_path):
    """A tokenizer without character offsets (CharTokenizer) gets the mask from the spans tokenized apart."""
    path = _write(tmp_path / "chat.jsonl", json.dumps(CHAT))
    [doc] = load_documents(str(path), CharTokenizer())
    decode = lambda ids: "".join("<eos>" if i == 0 else chr(i - 1) for i in ids)  # noqa: E731
    assert decode(doc).startswith("system: Answer briefly.\n\nuser: Say yes, please.\n\nassistant: yes")
    assert _runs(doc, decode) == ["yes", "It is 4.\nAnything else?<eos>"]


def test_alpaca_answer_is_masked(tmp_path, tok, plain_tok):
    path = _write(tmp_path / "a.json", json.dumps(ALPACA))
    docs = load_documents(str(path), tok)
    assert [_runs(d, tok.decode) for d in docs] == [["The sky is usually blue.<|im_end|>"], ["bonjour<|im_end|>"]]
    classic = load_documents(str(path), plain_tok)  # the classic prompt: the response and the appended EOS
    assert [_runs(d, plain_tok.decode) for d in classic] == [["The sky is usually blue." + plain_tok.eos_token],
                                                             ["bonjour" + plain_tok.eos_token]]


def test_plain_text_has_no_mask(tmp_path, tok):
    docs = load_documents(str(_write(tmp_path / "t.jsonl", json.dumps({"text": "Just some text."}))), tok)
    assert docs[0].loss_mask is None


@pytest.mark.parametrize("record, expected", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]},
     ["message 2 has role 'bot'", "allowed roles: system, user, assistant"]),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]},
     ["message 2 has role 'system'", "may only come first"]),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, ["message 1 (user) has content ['a', 'list']"]),
    ({"messages": [{"role": "user", "text": "hi"}]}, ["message 1 must be a mapping with 'role' and 'content'"]),
    ({"messages": []}, ["'messages' must be a non-empty list", "got []"]),
    ({"system": "s", "messages": [{"role": "system", "content": "t"}]}, ["both a 'system' field"]),
    ({"system": 3, "messages": [{"role": "user", "content": "t"}]}, ["'system' must be a string, got 3"]),
])
def test_bad_chat_record_names_file_line_and_value(tmp_path, record, expected):
    good = json.dumps(CHAT)
    path = _write(tmp_path / "bad.jsonl", f"{good}\n\n{json.dumps(record)}\n")
    with pytest.raises(ValueError) as err:
        load_documents(str(path), CharTokenizer())
    msg = str(err.value)
    assert f"{path}: record 2 (line 3)" in msg, msg
    for part in expected:
        assert part in msg, msg


# ---------------------------------------------------------------------------------------------
# compressed files, token budget

OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


def _compress(path: Path, suffix: str) -> Path:
    target = path.with_name(path.name + suffix)
    with OPENERS[suffix](target, "wb") as f:
        f.write(path.read_bytes())
    return target


@pytest.mark.parametrize("suffix", [".gz", ".xz", ".bz2"])
def test_compressed_files_read_like_plain_ones(tmp_path, tok, suffix):
    plain = tmp_path / "plain"
    records = [CHAT, *ALPACA, {"text": "A plain line of text."}]
    files = [_write(plain / "r.jsonl", "\n".join(json.dumps(r) for r in records) + "\n"),
             _write(plain / "r.json", json.dumps(records)),
             _write(plain / "t.txt", "A whole text file.\nTwo lines.\n")]
    (tmp_path / "packed").mkdir()
    for f in files:
        expected = load_documents(str(f), tok)
        packed = _compress(f, suffix)
        got = load_documents(str(packed), tok)
        assert got == expected and len(got) == (1 if f.suffix == ".txt" else 4)
        assert [d.loss_mask for d in got] == [d.loss_mask for d in expected]
        packed.rename(tmp_path / "packed" / packed.name)
    # a folder reads the compressed files too, in path order, like their plain twins
    assert load_documents(str(tmp_path / "packed"), tok) == load_documents(str(plain), tok)


def test_broken_compressed_file_is_named(tmp_path):
    path = tmp_path / "cut.jsonl.xz"
    whole = lzma.compress(("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(2000))).encode())
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError) as err:
        load_documents(str(path), CharTokenizer())
    assert str(path) in str(err.value) and ".xz stream" in str(err.value)
    latin = tmp_path / "latin.txt.gz"
    latin.write_bytes(gzip.compress("Señor\n".encode("latin-1")))
    with pytest.raises(ValueError, match=r"latin.txt.gz is not UTF-8 text \(byte 0xf1 at offset 2, line 1\)"):
        load_documents(str(latin), CharTokenizer())
    with pytest.raises(ValueError, match=r"gzip -dc .*latin.txt.gz \| iconv -f latin1 -t utf-8 \| gzip >"):
        load_documents(str(latin), CharTokenizer())


def test_max_tokens_stops_reading_early(tmp_path):
    """With a token budget a large file is read only as far as needed: a broken line at its end is
    never reached."""
    lines = [json.dumps({"text": "x" * 99}) for _ in range(5000)] + ["{broken"]
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress("\n".join(lines).encode()))
    docs = load_documents(str(path), CharTokenizer(), max_tokens=1000)
    assert len(docs) == 10 and all(len(d) == 100 for d in docs)  # 99 characters + EOS each
    with pytest.raises(ValueError, match="line 5001 is not valid JSON"):
        load_documents(str(path), CharTokenizer())
    with pytest.raises(ValueError, match="max_tokens"):
        load_documents(str(path), CharTokenizer(), max_tokens=0)


def test_real_mix_files_read_partly(tok):
    path = MIX / "sharegpt_en.jsonl.xz"
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    docs = load_documents(str(path), tok, max_tokens=50_000)
    total = sum(map(len, docs))
    assert total >= 50_000 and total - len(docs[-1]) < 50_000
    first = json.loads(lzma.open(path, "rt").readline())
    answers = [m["content"] for m in first["messages"] if m["role"] == "assistant" and m["content"].strip()]
    runs = _runs(docs[0], tok.decode)
    assert len(runs) == len(answers)
    assert all(run.removesuffix("<|im_end|>").strip() == answer.strip() for run, answer in zip(runs, answers))


# ---------------------------------------------------------------------------------------------
# mixtures


@pytest.mark.parametrize("spec, expected", [
    ("sharegpt.jsonl.xz:0.6,books.jsonl.xz:0.4", [("sharegpt.jsonl.xz", 0.6), ("books.jsonl.xz", 0.4)]),
    (" a.jsonl : 3 , b.txt:1 ", [("a.jsonl", 3.0), ("b.txt", 1.0)]),
    ("passkey:2048:500:0.2,wikitext:wikitext-2-raw-v1:.8",
     [("passkey:2048:500", 0.2), ("wikitext:wikitext-2-raw-v1", 0.8)]),
    ("c:/odd:name.jsonl:2.5e-1,shakespeare:1", [("c:/odd:name.jsonl", 0.25), ("shakespeare", 1.0)]),
    ("passkey:2048", [("passkey:2048", 1.0)]),          # no comma: one source, colons its own
    ("wikitext:wikitext-2-raw-v1", [("wikitext:wikitext-2-raw-v1", 1.0)]),
    (["a.jsonl:0.6", "b.jsonl:0.4"], [("a.jsonl", 0.6), ("b.jsonl", 0.4)]),
    ([{"source": "a.jsonl", "weight": 3}, {"source": "passkey:64:2", "weight": 1}],
     [("a.jsonl", 3.0), ("passkey:64:2", 1.0)]),
    ({"a.jsonl": 0.6, "b.jsonl": 0.4}, [("a.jsonl", 0.6), ("b.jsonl", 0.4)]),
    (["shakespeare"], [("shakespeare", 1.0)]),
])
def test_parse_data_spec(spec, expected):
    assert parse_data_spec(spec) == expected


def test_existing_path_with_comma_is_one_source(tmp_path):
    path = _write(tmp_path / "notes, vol 2:0.5.txt", "text")
    assert parse_data_spec(str(path)) == [(str(path), 1.0)]


@pytest.mark.parametrize("spec, named", [
    ("a.jsonl:0.6,b.jsonl", "item 'b.jsonl' has no ':WEIGHT'"),
    ("a.jsonl:0.6,,b.jsonl:0.4", "empty item"),
    ("a.jsonl:0.6,b.jsonl:0.4,", "empty item"),
    ("a.jsonl:-1,b.jsonl:1", "weight '-1'"),
    ("a.jsonl:0,b.jsonl:1", "weight '0'"),
    ("a.jsonl:nan,b.jsonl:1", "weight 'nan'"),
    ("a.jsonl:inf,b.jsonl:1", "weight 'inf'"),
    ("a.jsonl:lots,b.jsonl:1", "weight 'lots'"),
    (":0.5,b.jsonl:1", "item ':0.5' has no ':WEIGHT'"),
    ("a.jsonl:0.5,a.jsonl:0.5", "source 'a.jsonl' appears twice"),
    (["a.jsonl:0.6", "b.jsonl"], "list item 'b.jsonl' has no ':WEIGHT'"),
    ([{"source": "a.jsonl", "weight": 1}, {"path": "b"}], "list item {'path': 'b'}"),
    ([{"source": "a.jsonl", "weight": 1}, {"source": "b"}], "has no 'weight'"),
    ([], "the list is empty"),
    ("  ", "it is empty"),
    (3, "expected a string, a list or a mapping"),
])
def test_bad_data_spec_names_value_and_forms(spec, named):
    with pytest.raises(ValueError) as err:
        parse_data_spec(spec)
    msg = str(err.value)
    assert f"bad data spec {spec!r}" in msg and named in msg and "SOURCE:WEIGHT" in msg, msg


def test_train_config_takes_a_list_and_records_the_string(tmp_path):
    from linearize.train import TrainConfig

    config = TrainConfig(data=[{"source": "a.jsonl.xz", "weight": 0.6}, "books.jsonl.xz:0.4"]).validate()
    assert config.data == "a.jsonl.xz:0.6,books.jsonl.xz:0.4"
    assert TrainConfig(data="shakespeare").validate().data == "shakespeare"
    assert TrainConfig(data=["passkey:64:2:0.5"]).validate().data == "passkey:64:2"  # one source: no weight
    with pytest.raises(ValueError, match="a comma-separated mixture.*linearize train --data"):
        load_documents("a.jsonl:0.5,b.jsonl:0.5", CharTokenizer())  # one-source readers refuse a mixture
    with pytest.raises(ValueError, match="bad data spec 'a.jsonl:0.6,b.jsonl'"):
        TrainConfig(data="a.jsonl:0.6,b.jsonl").validate()
    with pytest.raises(ValueError, match=r"loss_on must be one of \('all', 'assistant'\), got 'answers'"):
        TrainConfig(loss_on="answers").validate()
    exists = _write(tmp_path / "a.jsonl", json.dumps({"text": "hello there"}))
    with pytest.raises(ValueError, match="one source takes no weight"):
        load_mixture(f"{exists}:0.6", CharTokenizer(), train_tokens=100, val_fraction=0.0, seed=0)


def _source(tmp_path: Path, name: str, first: int, count: int, length: int) -> tuple[Path, range]:
    """``count`` documents, document i all character ``first + i``: every token names its document.
    (CharTokenizer ids: ord % 5000 + 1; the range assumes no wrap.)"""
    path = _write(tmp_path / f"{name}.jsonl", "\n".join(json.dumps({"text": chr(first + i) * length})
                                                       for i in range(count)))
    return path, range(first % 5000 + 1, (first + count) % 5000 + 1)


def test_mixture_token_proportions_repeat_and_held_out_rows(tmp_path):
    """Over a long stream (200K tokens), each source's share of the packed training tokens is within
    1% of its weight; the small source is repeated with a note; held-out documents of each source
    never reach training; the same seed gives the same stream."""
    big, big_ids = _source(tmp_path, "big", 20_000, 1500, 300)  # ids 1..1500, 451K tokens
    small, small_ids = _source(tmp_path, "small", 22_000, 100, 150)  # ids 2001..2100, 15K tokens, asked for 60K
    notes = []
    spec = f"{big}:0.7,{small}:0.3"
    mixture = load_mixture(spec, CharTokenizer(), train_tokens=200_000, val_fraction=0.05, seed=3,
                           note=notes.append)
    assert len(notes) == 1 and str(small) in notes[0] and "repeated" in notes[0]
    rows = pack(mixture.train, 128, "split", min_tokens=16)
    tokens = rows.input_ids[rows.attention_mask]
    in_big = ((tokens >= big_ids.start) & (tokens < big_ids.stop)).sum().item()
    in_small = ((tokens >= small_ids.start) & (tokens < small_ids.stop)).sum().item()
    eos = (tokens == 0).sum().item()
    assert in_big + in_small + eos == len(tokens) and len(tokens) > 195_000
    assert abs(in_big / len(tokens) - 0.7) < 0.01 and abs(in_small / len(tokens) - 0.3) < 0.01
    # the big source was read only as far as its share needed (140K / 0.95 held-out split, +10%): about
    # 540 of its 1500 documents
    read = {d[0] for d in mixture.val[0]} | {d[0] for d in mixture.train if d[0] in big_ids}
    assert 460 < len(read) < 560
    # held-out documents per source: never trained on, and both sources have some
    for val, ids in zip(mixture.val, (big_ids, small_ids)):
        held = {d[0] for d in val}
        assert held and held <= set(ids)
        assert not held & set(tokens.unique().tolist())
    again = load_mixture(spec, CharTokenizer(), train_tokens=200_000, val_fraction=0.05, seed=3, note=None)
    assert again.train == mixture.train
    other = load_mixture(spec, CharTokenizer(), train_tokens=200_000, val_fraction=0.05, seed=4, note=None)
    assert other.train != mixture.train


def test_mix_documents_cuts_to_exact_quotas():
    a = [Document([1] * 50, [True] * 50), Document([1] * 50, [False] * 50)]
    b = [[2] * 7]
    mixed = mix_documents([a, b], [3, 1], 80, seed=0, note=None)
    flat = [t for d in mixed for t in d]
    assert flat.count(1) == 60 and flat.count(2) == 20
    cut = [d for d in mixed if d and d[0] == 1 and len(d) == 10]
    assert len(cut) == 1 and cut[0].loss_mask == [False] * 10  # the cut keeps its mask
    with pytest.raises(ValueError, match="gave no training tokens"):
        mix_documents([a, []], [1, 1], 10, seed=0, note=None)


# ---------------------------------------------------------------------------------------------
# the assistant mask reaches the stage-2 loss


def _answer_doc(ids, answer: slice) -> Document:
    return Document(ids, [answer.start <= i < answer.stop for i in range(len(ids))])


def test_assistant_mask_reaches_the_stage2_loss():
    """With loss masks, the stage-2 loss is the cross-entropy of exactly the answer tokens: changing a
    token outside the answer (after it, so the causal model's predictions of the answer stay the
    same) leaves the loss unchanged, and without masks it changes it; the distillation term too."""
    import torch.nn.functional as F
    from fixtures import VOCAB, llama

    from linearize.train import TrainConfig
    from linearize.train.run import lm_loss

    model, teacher = llama(seed=0), llama(seed=1)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    answer = slice(10, 25)  # a user turn, the answer, then a trailing user turn
    other = ids[:30] + [(ids[30] + 1) % VOCAB or 3] + ids[31:]
    config, distill = TrainConfig(), TrainConfig(distill=1.0)

    def loss(tokens, masks, with_teacher=False):
        rows = pack([_answer_doc(tokens, answer)], 64, "split", loss_masks=masks)
        batch = rows.batch([0])
        if masks:
            assert batch["labels"][0].tolist() == [t if answer.start <= i < answer.stop else -100
                                                   for i, t in enumerate(tokens)] + [-100] * (64 - len(tokens))
        with torch.no_grad():
            return lm_loss(model, batch, teacher if with_teacher else None, distill if with_teacher else config)[0].item()

    base = loss(ids, True)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    expected = F.cross_entropy(logits[answer.start - 1:answer.stop - 1], torch.tensor(ids[answer])).item()
    assert base == pytest.approx(expected, rel=1e-5)
    assert loss(other, True) == pytest.approx(base, rel=1e-6)
    assert abs(loss(other, False) - loss(ids, False)) > 1e-4
    answer_changed = ids[:20] + [(ids[20] + 1) % VOCAB or 3] + ids[21:]
    assert abs(loss(answer_changed, True) - base) > 1e-4
    kl = loss(ids, True, with_teacher=True)
    assert kl > 0 and loss(other, True, with_teacher=True) == pytest.approx(kl, rel=1e-6)
    # a batch without any answer token gives 0, not NaN
    rows = pack([Document(ids, [False] * len(ids))], 64, "split", loss_masks=True)
    assert lm_loss(model, rows.batch([0]), None, config)[0].item() == 0.0


def test_train_rows_honour_loss_on(tmp_path, tok):
    """``loss_on`` reaches the rows the run trains and validates on; a mixture's validation rows
    come from every source."""
    from linearize.train import TrainConfig
    from linearize.train.run import _rows

    chats = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                           {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(40)]
    chat = _write(tmp_path / "chat.jsonl", "\n".join(json.dumps(c) for c in chats))
    books = _write(tmp_path / "books.jsonl", "\n".join(json.dumps({"text": f"Book {i}. " * 30}) for i in range(40)))
    # split: each row holds one document, which the checks below read
    common = dict(seq_len=64, stage1_tokens=2000, stage2_tokens=2000, val_fraction=0.1, val_rows=4, packing="split")
    train, val = _rows(TrainConfig(data=f"{chat}:0.5,{books}:0.5", loss_on="assistant", **common).validate(), tok)
    batch = train.batch(range(len(train)))
    labelled = batch["labels"] != -100
    chat_answers = 0
    for row, ids in enumerate(batch["input_ids"]):
        text = tok.decode(ids[batch["attention_mask"][row].bool()])
        kept = tok.decode(ids[labelled[row]])
        if "<|im_start|>" in text:  # a chat row: only the answer and its end-of-turn token (a row may
            # hold a document's piece without it, or one cut short by the mixture's quota)
            assert kept == (text[text.index("It is"):] if "It is" in text else ""), (text, kept)
            chat_answers += "It is" in text
        else:  # plain text counts whole (from the second token: the first has no prediction)
            assert labelled[row][batch["attention_mask"][row].bool()].all()
    assert chat_answers >= 5
    assert val is not None and val.loss_mask is not None
    val_text = [tok.decode(r[m]) for r, m in zip(val.input_ids, val.attention_mask)]
    assert any("<|im_start|>" in t for t in val_text) and any("Book" in t for t in val_text)
    plain, _ = _rows(TrainConfig(data=str(chat), loss_on="all", **common).validate(), tok)
    assert plain.loss_mask is None
    assert (plain.batch([0])["labels"] != -100).sum() == plain.attention_mask[0].sum()


def test_config_file_list_becomes_the_recorded_spec_and_old_runs_resume(tmp_path):
    """``data:`` as a YAML list reaches the run as the string spec it records; a run recorded before
    ``loss_on`` existed still resumes (a missing setting counts as its default)."""
    from linearize.cli.train import load_config_file
    from linearize.train import TrainConfig
    from linearize.train.run import changed_settings

    path = _write(tmp_path / "recipe.yaml", "data:\n  - {source: chat.jsonl.xz, weight: 0.6}\n"
                                            "  - books.jsonl.xz:0.4\nloss-on: assistant\n")
    config = TrainConfig.from_dict(load_config_file(path))
    assert config.data == "chat.jsonl.xz:0.6,books.jsonl.xz:0.4" and config.loss_on == "assistant"
    old = TrainConfig().to_dict()
    del old["loss_on"]
    assert changed_settings(old, TrainConfig().validate()) == []
    assert changed_settings(old, TrainConfig(loss_on="assistant").validate()) == ["loss_on"]


def test_chat_template_refusal_names_the_record(tmp_path, tok):
    strict = copy.deepcopy(tok)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}")
    path = _write(tmp_path / "c.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                  + json.dumps(CHAT) + "\n")
    with pytest.raises(ValueError) as err:
        load_documents(str(path), strict)
    msg = str(err.value)
    assert f"{path}: record 2 (line 2)" in msg and "chat template refused" in msg and "no system role" in msg


def test_mixed_records_with_a_tokenizer_without_offsets(tmp_path):
    """Plain text, Alpaca (classic prompt) and chat records in one file, read by a tokenizer without
    character offsets: each in order, masks only on the records with answers."""
    records = [{"text": "plain"}, ALPACA[1], CHAT, {"text": "more"}]
    path = _write(tmp_path / "m.jsonl", "\n".join(json.dumps(r) for r in records))
    docs = load_documents(str(path), CharTokenizer())
    decode = lambda ids: "".join("<eos>" if i == 0 else chr(i - 1) for i in ids)  # noqa: E731
    assert [decode(d) for d in (docs[0], docs[3])] == ["plain<eos>", "more<eos>"]
    assert docs[0].loss_mask is None and docs[3].loss_mask is None
    assert _runs(docs[1], decode) == ["bonjour<eos>"] and len(_runs(docs[2], decode)) == 2
