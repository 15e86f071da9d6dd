"""Synthetic retrieval training data: formats, the answer's place and mask, no classic pass-key text, mixtures."""

from __future__ import annotations

import random

import pytest

from linearize.data import load_documents, load_mixture, make_classic_passkey_example, parse_data_spec
from linearize.data.needle import prepare_haystack
from linearize.data.retrieval import (classic_phrase, make_fact_example, make_kv_example, make_quiz_example,
                                      retrieval_documents)
from linearize.data.sources import loss_mask_of, shakespeare_plays


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    """A local text file of natural prose (a Shakespeare play) as a haystack."""
    path = tmp_path_factory.mktemp("hay") / "play.txt"
    path.write_text(shakespeare_plays()[3][5_000:45_000])  # past the cast list: sentences throughout
    return path


@pytest.fixture(scope="module")
def haystack(tok, prose):
    return prepare_haystack(prose.read_text(), tok)


def _split(doc, tok):
    """(prompt text, answer text) of a document at its loss mask, checking the mask is one tail run."""
    mask = loss_mask_of(doc)
    first = mask.index(True)
    assert not any(mask[:first]) and all(mask[first:]), "the mask must cover one run at the end"
    return tok.decode(doc[:first]), tok.decode(doc[first:])


@pytest.mark.parametrize("fmt", ["kv", "facts", "multi", "mixed", "quiz"])
def test_sources_parse_and_are_fixed_by_their_spec(tok, prose, fmt):
    spec = f"retrieval:{fmt}:400:4" + ("" if fmt == "kv" else f":{prose}")
    docs = load_documents(spec, tok)
    assert len(docs) == 4 and load_documents(spec, tok) == docs
    for d in docs:
        assert len(d) <= 400 and d[-1] == tok.eos_token_id
        if fmt != "quiz":  # (a quiz trains several answers: test_quiz_...)
            prompt, answer = _split(d, tok)
            assert answer.endswith(tok.eos_token) and answer.strip()
    assert len(load_documents(spec, tok, max_documents=2)) == 2
    if fmt != "kv":  # the bundled Shakespeare is the default haystack
        assert len(load_documents(f"retrieval:{fmt}:300:1", tok)) == 1


@pytest.mark.parametrize("spec,match", [("retrieval:poems", r"bad retrieval source 'retrieval:poems'"),
                                        ("retrieval:kv:long", r"FORMAT one of kv, facts, multi, quiz, mixed"),
                                        ("retrieval:kv:0:3", "LENGTH and COUNT must be at least 1"),
                                        ("retrieval:kv:9:3:books.txt", "format .kv. takes no HAYSTACK")])
def test_bad_source_specs_are_named(tok, spec, match):
    with pytest.raises(ValueError, match=match):
        load_documents(spec, tok)
    with pytest.raises(FileNotFoundError, match="haystack '/nonexistent/books.txt' does not exist"):
        load_documents("retrieval:facts:300:1:/nonexistent/books.txt", tok)


def test_a_haystack_path_and_weight_in_a_mixture_spec():
    assert parse_data_spec("retrieval:facts:512:10:/x/books.jsonl.xz:0.3,shakespeare:0.7") == [
        ("retrieval:facts:512:10:/x/books.jsonl.xz", 0.3), ("shakespeare", 0.7)]


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_kv_answer_occurs_once_at_its_depth(tok, depth):
    for seed in range(4):
        ex = make_kv_example(random.Random(seed), tok, 600, depth=depth)
        value = ex.values[0]
        assert ex.answer == value and ex.prompt.count(value) == 1 and ex.prompt.index(value) == ex.positions[0]
        assert abs(ex.depths[0] - depth) < 0.1, (ex.depths, depth)
        assert len(tok(ex.prompt, add_special_tokens=False)["input_ids"]) <= 600


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_fact_answer_occurs_once_at_its_depth(tok, haystack, depth):
    for seed in range(4):
        ex = make_fact_example(random.Random(seed), tok, haystack, 800, depth=depth, distractors=3)
        value = ex.values[0]
        assert ex.format == "facts" and ex.answer == value
        assert ex.prompt.count(value) == 1 and ex.prompt.index(value) > ex.positions[0]  # inside its fact
        assert abs(ex.depths[0] - depth) < 0.08, (ex.depths, depth)  # the nearest sentence start
        target = round(depth * 800)  # and in tokens of the whole prompt, within the facts and a sentence
        at = len(tok(ex.prompt[:ex.positions[0]], add_special_tokens=False)["input_ids"])
        assert abs(at - target) < 0.15 * 800, (at, target)
        assert len(tok(ex.prompt, add_special_tokens=False)["input_ids"]) <= 800


def test_multi_asks_several_values_each_once_in_order(tok, haystack):
    for seed in range(6):
        ex = make_fact_example(random.Random(seed), tok, haystack, 800, asked=3, distractors=2)
        assert ex.format == "multi" and len(ex.values) == 3
        assert ex.answer == ", ".join(ex.values)
        assert all(ex.prompt.count(v) == 1 for v in ex.values)


@pytest.mark.parametrize("fmt", ["kv", "facts", "multi"])
def test_loss_mask_covers_exactly_the_answer(tok, haystack, fmt):
    for doc in retrieval_documents(tok, fmt, length=500, count=5, seed=1, haystack=haystack):
        prompt, answer = _split(doc, tok)
        values = answer.removesuffix(tok.eos_token).strip().split(", ")
        assert (len(values) > 1) == (fmt == "multi")
        for value in values:  # every answered value stated exactly once in the prompt
            assert prompt.count(value) == 1, value


def test_quiz_asks_every_fact_once_in_its_own_order_and_trains_each_answer(tok, haystack):
    """Each fact's value is stated once in the text and answered once; the loss mask covers exactly
    the answers (with their line breaks) and the EOS; the questions do not follow the facts' order."""
    in_fact_order = 0
    for seed in range(6):
        ex = make_quiz_example(random.Random(seed), tok, haystack, 1200)
        assert 4 <= len(ex.answers) <= 10 and len(set(ex.answers)) == len(ex.answers)
        assert all(ex.text.count(a) == 1 and ex.prompt.count(a) == 2 for a in ex.answers)
        for a, at in zip(ex.answers, ex.positions):  # each answer inside the fact its question asks
            assert 0 < ex.text.index(a) - at < 120, (a, at)
        in_fact_order += ex.positions == sorted(ex.positions)
    assert in_fact_order <= 1  # shuffled: the questions do not walk through the text
    docs = retrieval_documents(tok, "quiz", length=1200, count=4, seed=3, haystack=haystack)
    for doc in docs:
        mask = loss_mask_of(doc)
        assert len(doc) <= 1200 and doc[-1] == tok.eos_token_id and mask[-1]
        runs, cur = [], []
        for t, m in zip(doc, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs.append(cur)
        answers = [tok.decode(r).removesuffix(tok.eos_token).strip() for r in runs]
        text = tok.decode([t for t, m in zip(doc, mask) if not m])
        assert len(answers) >= 4 and all(text.count(a) == 1 for a in answers), answers
        assert not any(tok.decode(r).strip() == "" for r in runs)
    with pytest.raises(ValueError, match="facts must be an integer in"):
        make_quiz_example(random.Random(0), tok, haystack, 1200, facts=1)
    with pytest.raises(ValueError, match="too short for a quiz"):
        make_quiz_example(random.Random(0), tok, haystack, 200)


def test_no_training_example_uses_the_classic_passkey_phrasing(tok, tmp_path):
    # the detector finds the classic test (so the check below can fail) ...
    classic = make_classic_passkey_example(random.Random(0), tok, 300, 0.5).prompt
    assert classic_phrase(classic) is not None
    # ... and a haystack that holds the classic filler in places still gives none of it
    paragraphs = shakespeare_plays()[5][:30_000].split("\n\n")
    for i in range(0, len(paragraphs), 7):
        paragraphs[i] += " The grass is green. The sky is blue."
    path = tmp_path / "tainted.txt"
    path.write_text("\n\n".join(paragraphs))
    docs = load_documents(f"retrieval:mixed:400:30:{path}", tok) + load_documents("retrieval:mixed:400:15", tok)
    docs += load_documents(f"retrieval:quiz:600:10:{path}", tok)
    for doc in docs:
        text = tok.decode(doc)
        assert classic_phrase(text) is None, text
        lowered = text.lower()
        assert "the grass is green" not in lowered and "pass key" not in lowered and "the sky is blue" not in lowered


def test_mixture_weight_is_respected_in_tokens(tok):
    mixture = load_mixture("retrieval:kv:300:40:0.25,shakespeare:0.75", tok, train_tokens=6000,
                           val_fraction=0.1, seed=0, note=None)
    retrieval = sum(len(d) for d in mixture.train if loss_mask_of(d) is not None)
    text = sum(len(d) for d in mixture.train if loss_mask_of(d) is None)
    assert retrieval == round(0.25 * 6000) and text == round(0.75 * 6000)
