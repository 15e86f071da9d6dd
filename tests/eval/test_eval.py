"""Passkey, perplexity and the attention-transfer report (issue 5), on tiny models and the bundled teacher."""

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import linearize
from fixtures import SLIDING_WINDOW, mistral, tiny_model_dir
from linearize.cli import main
from linearize.data.passkey import make_classic_passkey_example, make_passkey_example
from linearize import records
from linearize.eval import passkey
from linearize.eval.passkey import answer_matches, depth_grid, evaluate_model, run_passkey
from linearize.eval.perplexity import run_ppl, sliding_nll, stream_nll, token_stream
from linearize.eval.report import attention_maps, layer_mse, run_report
from linearize.models.convert import linearized_layers
from linearize.models.teacher import load_teacher

WIKI = "/work/shared/data/wiki_demo.txt"  # the shared data, as in test_data.py


@pytest.fixture(scope="module")
def bundled_tokenizer():
    return load_teacher("smollm2-135m")[1]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("teacher") / "tiny", num_layers=3)


@pytest.fixture(scope="module")
def student_dir(teacher_dir, tmp_path_factory):
    model, tok = load_teacher(str(teacher_dir))
    linearize.convert(model, "lizard")
    torch.manual_seed(0)
    with torch.no_grad():  # move the student away from its untrained init, as training would
        for m in linearized_layers(model):
            for p in m.hybrid.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return linearize.save(model, tmp_path_factory.mktemp("student") / "ck")


# ----------------------------------------------------------------------------- passkey


@pytest.mark.parametrize("fmt", ["classic", "lizard"])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_each_example_states_the_asked_passkey_exactly_once(bundled_tokenizer, fmt, depth):
    for n in range(3):
        ex = passkey.make_example(fmt, bundled_tokenizer, 400, depth, random.Random(n))
        answer_sentences = [s for s in (f"pass key is {ex.answer}.", f'passkey is "{ex.answer}".') if s in ex.prompt]
        assert len(answer_sentences) == 1 and ex.prompt.count(answer_sentences[0]) == 1
        assert ex.keys[ex.asked] == ex.answer and ex.depths[ex.asked] == depth
        length = len(bundled_tokenizer(ex.prompt, add_special_tokens=False)["input_ids"])
        assert 390 <= length <= 400
        if fmt == "lizard":
            # the asked key sits at its depth: the fraction of the prompt before it grows with depth
            at = ex.prompt.index(f'passkey is "{ex.answer}"') / len(ex.prompt)
            assert abs(at - depth) < 0.2


def test_asked_depth_is_where_the_asked_key_is(bundled_tokenizer):
    shallow = make_passkey_example(random.Random(0), bundled_tokenizer, 600, asked_depth=0.0)
    deep = make_passkey_example(random.Random(0), bundled_tokenizer, 600, asked_depth=1.0)
    assert shallow.asked == 0 and deep.asked == len(deep.keys) - 1
    with pytest.raises(ValueError, match="asked_depth must be in"):
        make_passkey_example(random.Random(0), bundled_tokenizer, 600, asked_depth=1.5)


def test_the_scorer_is_exact_match():
    assert answer_matches(" 43885. Remember it.", "43885")
    assert answer_matches('"apple river stone moon gate".', "apple river stone moon gate")
    assert not answer_matches(" 43886", "43885")
    assert not answer_matches(" 4388", "43885")
    assert not answer_matches(" 438855", "43885")  # one word, and it is not the key
    assert not answer_matches(" a magical number", "43885")
    assert not answer_matches(" apple river stone gate", "apple river stone moon gate")  # a word missing
    assert not answer_matches(" apple river stone moon", "apple river stone moon gate")
    assert not answer_matches(" Apple river stone moon gate", "apple river stone moon gate")
    assert not answer_matches("", "43885") and not answer_matches("43885", "")


def test_grid_accuracy_is_the_mean_of_exact_matches(bundled_tokenizer, monkeypatch):
    """An oracle that answers right only at depth 0 and only for some lengths gives exactly that grid."""
    def oracle(model, tokenizer, prompt, max_new_tokens):
        ex = [e for e in made if e.prompt == prompt][0]
        right = ex.depths[ex.asked] == 0.0 and len(prompt) < 1500
        return f" {ex.answer}." if right else " no idea"

    made = []
    original = passkey.make_example
    monkeypatch.setattr(passkey, "make_example", lambda *a: made.append(original(*a)) or made[-1])
    monkeypatch.setattr(passkey, "greedy_continuation", oracle)
    result = evaluate_model(None, bundled_tokenizer, "classic", [200, 800], depth_grid(3), 2, 0, 8)
    assert result["accuracy"] == [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert all(e["correct"] == answer_matches(e["output"], e["answer"]) for e in result["examples"])


@pytest.mark.slow
def test_the_bundled_teacher_retrieves_classic_passkeys(tmp_path):
    """The zero-shot ability this eval measures: the teacher finds a key at 256-512 tokens."""
    data = run_passkey(["smollm2-135m"], tmp_path, lengths=[256, 512], depths=2, samples=1, device="cpu")
    assert data["models"][0]["accuracy"] == [[1.0, 1.0], [1.0, 1.0]]


def test_passkey_run_writes_json_png_md_with_the_same_prompts_for_every_model(teacher_dir, student_dir, tmp_path):
    data = run_passkey([str(teacher_dir), str(student_dir)], tmp_path, lengths=[96, 128], depths=2, samples=2,
                       train_length=96, device="cpu", max_new_tokens=3)
    saved = json.loads((tmp_path / "passkey.json").read_text())
    assert saved["lengths"] == [96, 128] and saved["depths"] == [0.0, 1.0] and saved["train_length"] == 96
    for m in saved["models"]:
        assert len(m["examples"]) == 2 * 2 * 2
        for i, d in enumerate(saved["depths"]):
            for j, n in enumerate(saved["lengths"]):
                cell = [e["correct"] for e in m["examples"] if e["length"] == n and e["depth"] == d]
                assert m["accuracy"][i][j] == sum(cell) / len(cell)
    teacher_answers = [e["answer"] for e in saved["models"][0]["examples"]]
    assert teacher_answers == [e["answer"] for e in saved["models"][1]["examples"]]
    assert [m["linearized"] for m in saved["models"]] == [False, True]
    assert (tmp_path / "passkey.png").stat().st_size > 1000
    md = (tmp_path / "passkey.md").read_text()
    assert "| context (tokens) |" in md and "| 96 |" in md
    assert data["models"][1]["label"].startswith("lizard")


@pytest.mark.parametrize("bad, message", [
    ({"lengths": [32]}, "at least 64 tokens"),
    ({"depths": 0}, "depths must be a positive integer"),
    ({"samples": 0}, "samples must be a positive integer"),
    ({"fmt": "haystack"}, "unknown passkey format 'haystack'"),
])
def test_passkey_rejects_bad_settings(teacher_dir, tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        run_passkey([str(teacher_dir)], tmp_path / "out", **bad)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- perplexity


def direct_nll(model, ids):
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return F.cross_entropy(logits, ids[0, 1:], reduction="sum").item()


def test_sliding_window_equals_full_forward_when_the_window_covers_the_receptive_field():
    """A 2-layer model with an 8-token native window sees at most 14 tokens back from the position
    that predicts a token, i.e. 15 tokens before the token itself: windows that leave that much
    context before every scored token give the full-forward NLL."""
    model = mistral(num_layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 101), generator=torch.Generator().manual_seed(0))
    full = direct_nll(model, ids)
    receptive = 2 * (SLIDING_WINDOW - 1) + 1
    for window, stride in ((101, 50), (40, 40 - receptive), (30, 30 - receptive)):
        nll, n = sliding_nll(model, ids, window, stride)
        assert n == 100
        assert nll == pytest.approx(full, rel=1e-5)
    nll, _ = sliding_nll(model, ids, 30, 30 - receptive + 1)  # one token too little context
    assert abs(nll - full) > 1e-3


def test_a_short_window_scores_every_token_once(teacher_dir):
    model, _ = load_teacher(str(teacher_dir))
    ids = torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(1))
    for window, stride in ((10, 3), (10, 10), (16, 5), (77, 1)):
        _, n = sliding_nll(model, ids, window, stride)
        assert n == 76


@pytest.mark.parametrize("piece", [7, 64, 200])
def test_a_stateful_student_in_pieces_equals_one_full_forward(teacher_dir, piece):
    model, _ = load_teacher(str(teacher_dir))
    linearize.convert(model, "lizard")
    ids = torch.randint(0, 1000, (1, 150), generator=torch.Generator().manual_seed(2))
    nll, n = stream_nll(model, ids, piece)
    assert n == 149 and nll == pytest.approx(direct_nll(model, ids), rel=1e-5)


def test_ppl_run_matches_a_direct_computation(teacher_dir, student_dir, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text(open(WIKI).read()[:3000])
    data = run_ppl([str(teacher_dir), str(student_dir)], str(text), tmp_path / "out", max_tokens=300, device="cpu")
    tok = load_teacher(str(teacher_dir))[1]
    from linearize.data.sources import load_documents
    ids = token_stream(load_documents(str(text), tok), tok.eos_token_id, 300)
    assert data["tokens"] == ids.shape[1] == 300
    teacher = load_teacher(str(teacher_dir))[0]
    student = linearize.load(str(student_dir))[0]
    for m, model in zip(data["models"], (teacher, student)):
        expected = math.exp(direct_nll(model, ids) / 299)  # the tiny model's context (2048) covers it
        assert m["ppl"] == pytest.approx(expected, rel=1e-5) and m["tokens"] == 299
    saved = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert [m["ppl"] for m in saved["models"]] == [m["ppl"] for m in data["models"]]
    assert "one pass carrying state" in saved["models"][1]["how"] and "sliding window" in saved["models"][0]["how"]
    assert "| perplexity |" in (tmp_path / "out" / "ppl.md").read_text()


def test_ppl_errors_name_the_problem(teacher_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        run_ppl([str(teacher_dir)], str(tmp_path / "missing.txt"), tmp_path / "out")
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 2, got 1"):
        run_ppl([str(teacher_dir)], WIKI, tmp_path / "out", max_tokens=1)
    with pytest.raises(ValueError, match="at least one model"):
        run_ppl([], WIKI, tmp_path / "out")


# ----------------------------------------------------------------------------- transfer report


def test_attention_maps_are_the_mixers_exact_weights(student_dir):
    """Weights read with identity values reproduce the real outputs: weights @ v == output."""
    model, _ = linearize.load(str(student_dir))
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    maps = attention_maps(model, ids, [(1, 0), (1, 3)])
    captured = {}
    m = linearized_layers(model)[1]
    handle = m.hybrid.register_forward_pre_hook(lambda mod, args: captured.__setitem__("a", args))
    from linearize.models.attention import TransferRecorder
    for layer in linearized_layers(model):
        layer.transfer = TransferRecorder("heads")
    with torch.no_grad():
        model(input_ids=ids)
        q, k, v, q_rope, k_rope, x = captured["a"][:6]
        y_student, _ = m.hybrid(q, k, v, q_rope, k_rope, x, None, None)
        y_teacher = m.teacher_heads(q_rope, k_rope, v, None)
    handle.remove()
    for (layer, head), (teacher, student) in maps.items():
        assert torch.allclose(teacher @ v[0, head].float(), y_teacher[0, head].float(), atol=1e-5)
        assert torch.allclose(student @ v[0, head].float(), y_student[0, head].float(), atol=1e-5)
        assert torch.allclose(teacher.sum(-1), torch.ones(24), atol=1e-5)
        assert torch.equal(teacher.triu(1), torch.zeros(24, 24))  # causal
        assert torch.allclose(student.triu(1), torch.zeros(24, 24), atol=1e-6)


def test_report_json_png_md(student_dir, tmp_path):
    data = run_report(str(student_dir), WIKI, tmp_path, rows=3, seq_len=48, heads=1, map_tokens=16, device="cpu")
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["layers"] == [0, 1, 2]
    # the figures are the direct measurement on the last 3 rows, for the checkpoint and a fresh conversion
    student, tok = linearize.load(str(student_dir))
    fresh, _ = load_teacher(str(student.linearize_base))
    torch.manual_seed(0)
    linearize.convert(fresh, "lizard")
    from linearize.data.packing import pack
    from linearize.data.sources import load_documents
    rows = pack(load_documents(WIKI, tok), 48, "concat", pad_id=tok.pad_token_id or 0)
    batch = rows.batch(list(range(len(rows) - 3, len(rows))))
    for model, key in ((student, "trained"), (fresh, "untrained")):
        direct = layer_mse(model, [batch])
        assert saved["mse"][key] == pytest.approx([direct[i] for i in (0, 1, 2)], rel=1e-5)
    assert all(t != u for t, u in zip(saved["mse"]["trained"], saved["mse"]["untrained"]))
    assert [(m["layer"], m["head"]) for m in saved["maps"]] == [(0, 0), (1, 0), (2, 0)]
    assert len(saved["maps"][0]["teacher"]) == 16 == saved["map_tokens"]
    assert data["mse"] == saved["mse"]
    assert "| layer | MSE trained |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_layer_mse_is_zero_for_the_teachers_own_attention(teacher_dir):
    """The measurement itself: a student whose mixer is the teacher's softmax has MSE 0."""
    model, _ = load_teacher(str(teacher_dir))
    linearize.convert(model, "lizard")
    for m in linearized_layers(model):
        m.hybrid.forward = (lambda m: lambda q, k, v, q_rope, k_rope, x, state, valid, need_state=True, q_far=None:
                            (m.teacher_heads(q_rope, k_rope, v, valid), {}))(m)
    batch = {"input_ids": torch.randint(0, 1000, (2, 20)), "attention_mask": torch.ones(2, 20, dtype=torch.long)}
    assert all(v < 1e-12 for v in layer_mse(model, [batch]).values())


def test_report_rejects_layers_that_are_not_linearized(student_dir, tmp_path):
    with pytest.raises(ValueError, match=r"layers \[7\] are not linearized layers"):
        run_report(str(student_dir), WIKI, tmp_path, layers=[7], device="cpu")


# ----------------------------------------------------------------------------- outputs and CLI


def test_figures_are_drawn_from_the_json_on_disk(tmp_path):
    seen = {}

    def figure(data, path):
        seen["data"] = data
        path.write_bytes(b"png")

    records.write_outputs(tmp_path, "x", {"a": 1.5, "bad": float("nan"), "t": (1, 2)}, lambda d: "md", figure)
    assert seen["data"] == json.loads((tmp_path / "x.json").read_text()) == {"a": 1.5, "bad": None, "t": [1, 2]}


def test_cli_eval_commands(teacher_dir, student_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "passkey", "--model", str(teacher_dir), "--model", str(student_dir), "--lengths", "96",
                 "--depths", "1", "--samples", "1", "--max-new-tokens", "2", "--out", str(out),
                 "--device", "cpu"]) == 0
    assert main(["eval", "ppl", "--model", str(student_dir), "--data", WIKI, "--max-tokens", "128",
                 "--out", str(out), "--device", "cpu"]) == 0
    assert main(["eval", "report", "--model", str(student_dir), "--data", WIKI, "--rows", "2", "--seq-len", "32",
                 "--heads", "1", "--map-tokens", "8", "--out", str(out), "--device", "cpu"]) == 0
    for stem in ("passkey", "ppl", "report"):
        for ext in ("json", "png", "md"):
            assert (out / f"{stem}.{ext}").is_file()
    assert "# Perplexity" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["eval", "passkey", "--model", "x", "--lengths", "1K,abc"], "expected comma-separated token counts"),
    (["eval", "passkey", "--model", "smollm2-135m", "--format", "nope"], "invalid choice: 'nope'"),
    (["eval", "ppl", "--model", "/no/such/dir", "--data", WIKI], "model directory /no/such/dir does not exist"),
    (["eval", "report", "--model", "a", "--model", "b", "--data", WIKI], "takes one linearized checkpoint"),
])
def test_cli_eval_errors(argv, message, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_environment_names_python_m_linearize_as_the_linearize_command(monkeypatch):
    """A record written under ``python -m linearize.cli`` names its command as a user types it."""
    import linearize.cli
    from linearize.records import environment

    main = str(Path(linearize.cli.__file__).with_name("__main__.py"))
    monkeypatch.setattr(sys, "argv", [main, "eval", "needle", "--model", "m"])
    assert environment()["command"] == "linearize eval needle --model m"
    monkeypatch.setattr(sys, "argv", ["/usr/bin/bench.py", "x"])
    assert environment()["command"] == "bench.py x"
