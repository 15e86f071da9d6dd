"""`linearize eval needle` (issue 44): needles and distractors in natural text, the exact scorer,
the length x depth grid, and the CLI end to end on tiny random models."""

import json
import lzma
import random
import re

import pytest
import torch

import linearize
from fixtures import tiny_model_dir
from linearize.cli import main
from linearize.data import needle as needles
from linearize.data.needle import (
    KINDS, length_tolerance, load_haystack, make_needle_example, needle_correct, prepare_haystack, split_units,
)
from linearize.eval import needle as needle_eval
from linearize.eval.needle import evaluate_model, run_needle
from linearize.eval.passkey import depth_grid
from linearize.models.convert import linearized_layers
from linearize.models.teacher import load_teacher

WIKI = "/work/shared/data/wiki_demo.txt"  # the shared data, as in test_eval.py


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("teacher") / "tiny", num_layers=2)


@pytest.fixture(scope="module")
def student_dir(teacher_dir, tmp_path_factory):
    model, _ = load_teacher(str(teacher_dir))
    linearize.convert(model, "lizard")
    torch.manual_seed(0)
    with torch.no_grad():
        for m in linearized_layers(model):
            for p in m.hybrid.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return linearize.save(model, tmp_path_factory.mktemp("student") / "ck")


@pytest.fixture(scope="module")
def tok(teacher_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)  # the bundled SmolLM2 tokenizer


@pytest.fixture(scope="module")
def text():
    with open(WIKI, encoding="utf-8") as f:
        return f.read(300_000)


@pytest.fixture(scope="module")
def hay(text, tok):
    return prepare_haystack(text, tok)


def ids(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the haystack


def test_units_are_sentences_and_pieces_of_long_ones():
    text = ("Mr. Smith met Dr. Jones at St. Paul's. They talked.\n\nA new paragraph here! "
            + " ".join(["word"] * 60) + ". End.")
    units = split_units(text)
    assert [u[1] for u in units[:3]] == ["Mr. Smith met Dr. Jones at St. Paul's.", "They talked.",
                                        "A new paragraph here!"]
    assert [u[0] for u in units[:3]] == ["\n\n", " ", "\n\n"]
    long_pieces = [u for u in units if u[1].startswith("word")]
    assert len(long_pieces) == 3 and all(len(u[1].split()) <= needles.MAX_UNIT_WORDS for u in long_pieces)
    assert [u[2] for u in long_pieces] == [True, False, False]  # needles never go inside a sentence
    assert units[-1] == (" ", "End.", True)


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_needle_is_in_the_prompt_once_at_its_depth(hay, tok, kind, depth):
    """Each needle once; the asked one's first token within one sentence of depth * length (clipped to
    the positions a needle can take); the prompt within the stated tolerance under the length."""
    length = 1024
    longest_unit = max(hay.sizes)
    for seed in range(3):
        ex = make_needle_example(hay, tok, length, depth, random.Random(seed), kind=kind)
        prompt_ids = ids(tok, ex.prompt)
        assert length - length_tolerance(length) <= len(prompt_ids) <= length
        assert ex.length == len(prompt_ids)
        for sentence in ex.needles:
            assert ex.prompt.count(sentence) == 1
        if kind == "number":
            # the value nowhere else (not in the haystack either), as a whole number
            assert len(re.findall(rf"(?<!\d){ex.answer}(?!\d)", ex.prompt)) == 1
        asked = ex.needles[ex.asked]
        assert ex.values[ex.asked] == ex.answer and ex.keys[ex.asked] == ex.key and ex.answer in asked
        # the token at the reported position starts the needle
        pos = ex.positions[ex.asked]
        assert tok.decode(prompt_ids[pos:pos + 4]).strip().startswith("The ")
        assert asked in tok.decode(prompt_ids[pos:pos + len(ids(tok, " " + asked)) + 2])
        # within one sentence of depth * length, clipped to where a needle can be
        question = ex.prompt[ex.prompt.rindex("\n\nQuestion:"):]
        latest = len(prompt_ids) - len(ids(tok, question)) - len(ids(tok, " " + asked))
        target = min(max(round(depth * length), 0), latest)
        assert abs(pos - target) <= longest_unit + 4, (pos, target)
        assert positions_sorted(ex)


def positions_sorted(ex):
    return ex.positions == sorted(ex.positions) and len(set(ex.positions)) == len(ex.positions)


@pytest.mark.parametrize("kind", KINDS)
def test_distractors_have_other_keys_and_values_and_the_question_names_the_asked_key(hay, tok, kind):
    for seed in range(5):
        ex = make_needle_example(hay, tok, 512, 0.5, random.Random(seed), kind=kind, distractors=4)
        assert len(ex.keys) == len(ex.values) == len(ex.needles) == len(ex.positions) == 5
        assert len(set(ex.keys)) == 5 and len(set(ex.values)) == 5
        assert all(k != ex.key for i, k in enumerate(ex.keys) if i != ex.asked)
        assert ex.answer not in ex.distractors and len(ex.distractors) == 4
        question = ex.prompt[ex.prompt.rindex("\n\nQuestion:"):]
        assert ex.key in question and not any(k in question for i, k in enumerate(ex.keys) if i != ex.asked)
        assert not any(v in question for v in ex.values)
        for k, v, sentence in zip(ex.keys, ex.values, ex.needles):
            assert k in sentence and v in sentence
        # no classic passkey filler or phrasing
        assert "grass is green" not in ex.prompt and "pass key" not in ex.prompt.lower()
    ex = make_needle_example(hay, tok, 512, 0.5, random.Random(0), kind=kind, distractors=0)
    assert ex.distractors == [] and len(ex.needles) == 1


def test_the_kinds_read_as_stated(hay, tok):
    number = make_needle_example(hay, tok, 400, 0.5, random.Random(1), kind="number")
    assert re.fullmatch(r"The secret number of [A-Z][a-z]+ is \d{4,7}\.", number.needles[number.asked])
    assert number.prompt.endswith(f"Answer: The secret number of {number.key} is")
    word = make_needle_example(hay, tok, 400, 0.5, random.Random(1), kind="word")
    assert re.fullmatch(r"The magic word for the [a-z]+ door is '[a-z]+'\.", word.needles[word.asked])
    sentence = make_needle_example(hay, tok, 400, 0.5, random.Random(1), kind="sentence")
    assert sentence.needles[sentence.asked] == f'The note left for {sentence.key} said: "{sentence.answer}."'
    assert len(sentence.answer.split()) >= 6


def test_examples_are_deterministic_from_the_seed(hay, tok, text):
    for kind in KINDS:
        a = make_needle_example(hay, tok, 600, 0.3, random.Random(7), kind=kind)
        assert make_needle_example(hay, tok, 600, 0.3, random.Random(7), kind=kind) == a
        assert make_needle_example(prepare_haystack(text, tok), tok, 600, 0.3, random.Random(7), kind=kind) == a
        assert make_needle_example(hay, tok, 600, 0.3, random.Random(8), kind=kind) != a


def test_a_haystack_from_token_ids_or_an_xz_jsonl_file(tok, text, tmp_path):
    from_ids = make_needle_example(ids(tok, text[:100_000]), tok, 300, 0.5, random.Random(0))
    assert 300 - length_tolerance(300) <= len(ids(tok, from_ids.prompt)) <= 300
    books = tmp_path / "books.jsonl.xz"
    with lzma.open(books, "wt", encoding="utf-8") as f:
        for i in range(3):
            f.write(json.dumps({"title": f"book {i}", "text": text[i * 50_000:(i + 1) * 50_000]}) + "\n")
    hay = load_haystack(books, tok, max_tokens=20_000)
    assert 15_000 <= hay.tokens < 40_000  # the token budget stops reading after the book that reaches it
    ex = make_needle_example(hay, tok, 2048, 0.5, random.Random(0), kind="word")
    assert ex.prompt.count(ex.needles[ex.asked]) == 1


# ----------------------------------------------------------------------------- the scorer


def test_the_scorer_is_exact():
    assert needle_correct(" 4821.", "4821", ["77310"], "number")
    assert needle_correct(" 4821\n\nQuestion: What is 77310?", "4821", ["77310"], "number")  # first line only
    assert not needle_correct(" 77310.", "4821", ["77310"], "number")        # a distractor's value
    assert not needle_correct(" 4821 or 77310", "4821", ["77310"], "number")  # both: not an answer
    assert not needle_correct(" 48213.", "4821", [], "number")                # inside a longer number
    assert not needle_correct(" 14821", "4821", [], "number")
    assert not needle_correct(" 4821.5", "4821", [], "number")
    assert not needle_correct(" 4,821", "4821", [], "number")
    assert not needle_correct(" 482", "4821", [], "number")
    assert not needle_correct("\n\n", "4821", [], "number") and not needle_correct(" 4821", "", [], "number")
    assert needle_correct(" 'Lantern'.", "lantern", ["falcon"], "word")      # case-insensitive
    assert not needle_correct(" 'lanterns'.", "lantern", [], "word")          # whole word
    assert not needle_correct(" 'falcon'.", "lantern", ["falcon"], "word")
    said = "The old fisherman hid the blue map behind the mill"
    assert needle_correct(' "the old fisherman hid the blue map behind the mill."', said, [], "sentence")
    assert not needle_correct(' "The old fisherman hid the blue map."', said, [], "sentence")
    assert not needle_correct(f' "{said}", or "My cousin Ida sold the grey mare near the salt market"', said,
                              ["My cousin Ida sold the grey mare near the salt market"], "sentence")
    with pytest.raises(ValueError, match="unknown needle kind 'colour'"):
        needle_correct(" x", "x", [], "colour")


def test_grid_accuracy_is_the_mean_over_kinds_of_exact_scores(hay, tok, monkeypatch):
    """An oracle right only at depth 0 on numbers and words, wrong (a distractor) everywhere else."""
    def oracle(model, tokenizer, prompt, max_new_tokens):
        ex = [e for e in made if e.prompt == prompt][0]
        if ex.depth == 0.0 and ex.kind != "sentence":
            return f" {ex.answer}."
        return f" {ex.distractors[0]}."

    made = []
    original = needle_eval.make_example
    monkeypatch.setattr(needle_eval, "make_example", lambda *a: made.append(original(*a)) or made[-1])
    monkeypatch.setattr(needle_eval, "greedy_continuation", oracle)
    result = evaluate_model(None, tok, hay, list(KINDS), [256, 512], depth_grid(2), 2, 2, 0,
                            {k: 8 for k in KINDS})
    assert result["accuracy"] == [[2 / 3, 2 / 3], [0.0, 0.0]]
    assert result["by_kind"]["sentence"] == [[0.0, 0.0], [0.0, 0.0]]
    assert result["by_kind"]["number"] == [[1.0, 1.0], [0.0, 0.0]]
    assert len(result["examples"]) == 2 * 2 * 3 * 2


# ----------------------------------------------------------------------------- bad inputs


def test_bad_arguments_name_the_value(hay, tok):
    with pytest.raises(ValueError, match=r"length 40 is too short .* use at least \d+ tokens"):
        make_needle_example(hay, tok, 40, 0.5, random.Random(0))
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got 1.5"):
        make_needle_example(hay, tok, 512, 1.5, random.Random(0))
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\], got -0.1"):
        make_needle_example(hay, tok, 512, -0.1, random.Random(0))
    with pytest.raises(ValueError, match="unknown needle kind 'colour'"):
        make_needle_example(hay, tok, 512, 0.5, random.Random(0), kind="colour")
    with pytest.raises(ValueError, match="distractors must be a non-negative integer, got -1"):
        make_needle_example(hay, tok, 512, 0.5, random.Random(0), distractors=-1)
    with pytest.raises(ValueError, match="at most .* distractors for number needles, got 100"):
        make_needle_example(hay, tok, 4096, 0.5, random.Random(0), distractors=100)
    small = prepare_haystack("Only a few words. Nothing more.", tok)
    with pytest.raises(ValueError, match="too few for a prompt of length 512"):
        make_needle_example(small, tok, 512, 0.5, random.Random(0))
    with pytest.raises(FileNotFoundError, match="/no/such/books.jsonl.xz"):
        load_haystack("/no/such/books.jsonl.xz", tok)


@pytest.mark.parametrize("bad, error, message", [
    ({"haystack": "/no/such/file.txt"}, FileNotFoundError, "haystack '/no/such/file.txt' does not exist"),
    ({"kinds": ["number", "colour"]}, ValueError, "unknown needle kind.*'colour'"),
    ({"lengths": [32]}, ValueError, "at least 64 tokens"),
    ({"lengths": [80]}, ValueError, "length 80 is too short"),
    ({"depths": 0}, ValueError, "depths must be a positive integer"),
    ({"samples": 0}, ValueError, "samples must be a positive integer, got 0"),
    ({"distractors": -2}, ValueError, "distractors must be a non-negative integer, got -2"),
])
def test_run_needle_rejects_bad_settings_before_writing(teacher_dir, tmp_path, bad, error, message):
    kwargs = {"haystack": WIKI, "lengths": [256], "depths": 1, "samples": 1, "device": "cpu", **bad}
    with pytest.raises(error, match=message):
        run_needle([str(teacher_dir)], out_dir=tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- run and CLI


def test_cli_eval_needle_end_to_end(teacher_dir, student_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "needle", "--model", str(teacher_dir), "--model", str(student_dir), "--haystack", WIKI,
                 "--haystack-tokens", "8K", "--lengths", "192,256", "--depths", "2", "--samples", "1",
                 "--distractors", "2", "--max-new-tokens", "3", "--train-length", "128", "--out", str(out),
                 "--device", "cpu"]) == 0
    for ext in ("json", "png", "md"):
        assert (out / f"needle.{ext}").is_file()
    assert (out / "needle.png").stat().st_size > 1000
    saved = json.loads((out / "needle.json").read_text())
    assert saved["lengths"] == [192, 256] and saved["depths"] == [0.0, 1.0] and saved["kinds"] == list(KINDS)
    assert saved["haystack"] == WIKI and saved["distractors"] == 2 and saved["train_length"] == 128
    teacher, student = saved["models"]
    assert [teacher["linearized"], student["linearized"]] == [False, True]
    assert len(teacher["examples"]) == 2 * 2 * 3 * 1
    # the same prompts for both models (one tokenizer): same keys, answers and positions
    fields = ("length", "depth", "kind", "key", "answer", "distractors", "position", "prompt_tokens")
    assert [[e[f] for f in fields] for e in teacher["examples"]] == [[e[f] for f in fields] for e in student["examples"]]
    for m in saved["models"]:
        for e in m["examples"]:
            assert e["correct"] == needle_correct(e["output"], e["answer"], e["distractors"], e["kind"])
            assert e["length"] - length_tolerance(e["length"]) <= e["prompt_tokens"] <= e["length"]
    md = capsys.readouterr().out
    assert "# Needles in natural text" in md and "| context (tokens) |" in md and "| sentence |" in md


@pytest.mark.parametrize("argv, message", [
    (["eval", "needle", "--model", "x", "--haystack", WIKI, "--lengths", "1K,abc"], "expected comma-separated token counts"),
    (["eval", "needle", "--model", "smollm2-135m"], "the following arguments are required: --haystack"),
])
def test_cli_eval_needle_usage_errors(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_cli_eval_needle_missing_haystack(teacher_dir, capsys, tmp_path):
    assert main(["eval", "needle", "--model", str(teacher_dir), "--haystack", "/no/such/books.jsonl.xz",
                 "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "haystack '/no/such/books.jsonl.xz' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_help_lists_needle(capsys):
    assert main(["eval", "needle", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--haystack", "--kinds", "--lengths", "--depths", "--samples", "--distractors", "--seed",
                 "--max-new-tokens", "--haystack-tokens", "--text-field", "--train-length", "examples:"):
        assert flag in out
