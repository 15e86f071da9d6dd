"""``eval embed``: embedding agreement, the cost table, and the files it writes."""

import copy
import json
import itertools

import pytest
import torch

import linearize
from linearize.eval.embed import (agreement_se, attention_cost, embed_markdown, embedding_quality, measure_layer,
                                  run_embed_eval)
from linearize.data.sentences import load_sentences, sentence_split
from linearize.models.encoder import nn_agreement

LION = {"variant": "s", "chunk_size": 16, "decay_init": [0.9, 0.95]}  # as read back from JSON


def test_nn_agreement_counts_rows_with_the_same_nearest_neighbour():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(30, 8, generator=g)
    student = teacher + 0.7 * torch.randn(30, 8, generator=g)

    def nearest(e):  # written out: the most similar other row by cosine
        e = [x / x.norm() for x in e.double()]
        return [max((j for j in range(len(e)) if j != i), key=lambda j: float(e[i] @ e[j])) for i in range(len(e))]

    expected = sum(a == b for a, b in zip(nearest(student), nearest(teacher))) / 30
    assert 0 < expected < 1 and nn_agreement(student, teacher) == pytest.approx(expected)
    assert nn_agreement(teacher, teacher) == 1.0 and nn_agreement(3 * teacher, teacher) == 1.0
    q = embedding_quality(student, teacher)
    cos = torch.nn.functional.cosine_similarity(student, teacher)
    assert q["mean_cosine"] == pytest.approx(float(cos.mean()), abs=1e-6)
    assert q["min_cosine"] == pytest.approx(float(cos.min()), abs=1e-6)
    assert q["nn_agreement_se"] == pytest.approx((expected * (1 - expected) / 30) ** 0.5)
    assert agreement_se(0.9, 100) == pytest.approx(0.03) and agreement_se(1.0, 10) == 0.0
    with pytest.raises(ValueError, match="at least 2 sentences, got 1"):
        nn_agreement(teacher[:1], teacher[:1])


def test_sentence_split_is_a_fixed_function_of_the_text(tmp_path):
    path = write_corpus(tmp_path)
    all_ = load_sentences(str(path), seed=0)
    test = load_sentences(str(path), split="test", seed=3)
    assert set(test) == {s for s in all_ if sentence_split(s) == "test"}
    assert set(test).isdisjoint(load_sentences(str(path), split="train"))
    assert 0.03 < len(test) / len(all_) < 0.2
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val', 'test'\) or None, got 'dev'"):
        load_sentences(str(path), split="dev")
    with pytest.raises(FileNotFoundError, match="sentence source 'nope.txt' does not exist"):
        load_sentences("nope.txt")


def test_measure_layer_reports_time_and_memory():
    for form in ("sdpa", "chunk", "recurrent", "parallel"):
        r = measure_layer(form, 64, heads=2, head_dim=8, hidden=16, lion=None if form == "sdpa" else LION,
                          threads=1, max_seconds=0.05, max_repeats=2)
        assert r["ms"] > 0 and r["repeats"] >= 1
        assert r["extra_mib"] is None or r["extra_mib"] >= 0


def test_attention_cost_runs_each_form_in_its_own_process_and_skips_oversized_parallel():
    cost = attention_cost(LION, heads=2, head_dim=8, hidden=16, lengths=[64, 1 << 16], forms=("parallel",),
                          threads=1, memory_limit_gb=1.0, progress=False, timeout=120)
    assert [r["tokens"] for r in cost["forms"]["parallel"]] == [64, 1 << 16]
    assert cost["forms"]["parallel"][0]["ms"] > 0 and cost["forms"]["parallel"][0]["repeats"] >= 1
    assert cost["forms"]["parallel"][1] == {"tokens": 1 << 16, "skipped": "needs about 128 GiB (> 1)"}
    with pytest.raises(ValueError, match=r"forms must be among .* got \['flash'\]"):
        attention_cost(LION, heads=2, head_dim=8, hidden=16, forms=("flash",))


def write_corpus(tmp_path):
    """~700 distinct short sentences, enough for a held-out split of a few dozen."""
    subjects = ["The old sailor", "A young teacher", "My neighbour", "The tired doctor", "Our small dog",
                "The quiet student", "A famous painter"]
    verbs = ["found", "carried", "painted", "sold", "watched", "repaired", "described", "forgot", "lost", "hid"]
    objects = ["a red boat", "the broken clock", "an empty basket", "the wooden chair", "a heavy letter",
               "the silver key", "a green lamp", "the long river", "a cold stone", "the bright window"]
    lines = [f"{s} {v} {o} yesterday." for s, v, o in itertools.product(subjects, verbs, objects)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(" ".join(lines[i:i + 5]) for i in range(0, len(lines), 5)))
    return path


@pytest.mark.slow
def test_run_embed_eval_writes_the_three_files(tmp_path):
    """End to end on the bundled MiniLM: an untrained conversion saved as a checkpoint scores
    exactly what the untrained row reports, and the cost table covers every form."""
    teacher, _ = linearize.load_teacher("minilm-l6")
    model = linearize.convert(copy.deepcopy(teacher), "lion-d", chunk_size=32)
    linearize.save(model, tmp_path / "ckpt")
    data = run_embed_eval(str(tmp_path / "ckpt"), str(write_corpus(tmp_path)), tmp_path / "out", sentences=40,
                          lengths=[64], threads=1, progress=False)
    for suffix in ("json", "png", "md"):
        assert (tmp_path / "out" / f"embed.{suffix}").is_file()
    saved = json.loads((tmp_path / "out" / "embed.json").read_text())
    trained, untrained = saved["quality"]
    assert (trained["model"], untrained["model"]) == ("trained", "untrained")
    assert trained["mean_cosine"] == pytest.approx(untrained["mean_cosine"], abs=1e-6)
    assert trained["nn_agreement"] == untrained["nn_agreement"]
    assert 0 < untrained["mean_cosine"] < 1 and saved["sentences"] == 40
    assert set(saved["cost"]["forms"]) == {"sdpa", "parallel", "recurrent", "chunk"}
    md = (tmp_path / "out" / "embed.md").read_text()
    assert "lion-d untrained" in md and "| 64 |" in md and data["method"] == "lion-d"
    assert saved["teacher_seconds"] > 0 and f"(softmax attention) took {saved['teacher_seconds']:.1f} s" in md


@pytest.mark.slow
def test_run_embed_eval_scores_a_lora_checkpoint_with_its_adapters_merged(tmp_path, monkeypatch):
    """The trained row runs the checkpoint with LoRA folded into its projections (as deployed):
    no LoRA layer reaches the embedding, and the figures are those of the unmerged model."""
    from peft.tuners.lora import LoraLayer

    import linearize.eval.embed as embed_mod
    from linearize.models.encoder import embed
    from linearize.models.lora import add_lora
    from linearize.train.encoder import ENCODER_LORA_TARGETS

    teacher, tokenizer = linearize.load_teacher("minilm-l6")
    model = linearize.convert(copy.deepcopy(teacher), "lion-s", chunk_size=16)
    add_lora(model, rank=4, alpha=8.0, targets=list(ENCODER_LORA_TARGETS))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # a trained adapter is not zero
    linearize.save(model, tmp_path / "ckpt")
    corpus = str(write_corpus(tmp_path))
    seen = []
    monkeypatch.setattr(embed_mod, "embed", lambda m, *a, **k: seen.append(m) or embed(m, *a, **k))
    data = run_embed_eval(str(tmp_path / "ckpt"), corpus, tmp_path / "out", sentences=40, timing=False,
                          progress=False)
    assert len(seen) == 3 and not any(isinstance(x, LoraLayer) for x in seen[1].modules())
    held_out = load_sentences(corpus, split="test", max_sentences=40)
    expected = embedding_quality(embed(model, tokenizer, held_out), embed(teacher, tokenizer, held_out))
    trained = data["quality"][0]
    assert trained["mean_cosine"] == pytest.approx(expected["mean_cosine"], abs=1e-5)
    assert trained["mean_cosine"] != pytest.approx(data["quality"][1]["mean_cosine"], abs=1e-4)  # LoRA counts


def test_run_embed_eval_rejects_a_causal_checkpoint_and_too_few_sentences(tmp_path):
    (tmp_path / "c").mkdir()
    meta = {"format_version": 1, "method": "lizard", "softmax_layers": [], "overrides": {},
            "base": {"name": "smollm2-135m", "fingerprint": "0" * 64}}  # a causal checkpoint's required keys
    (tmp_path / "c" / "linearize.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="holds a 'lizard' model; eval embed takes a LION encoder"):
        run_embed_eval(str(tmp_path / "c"), "shakespeare", tmp_path / "o", timing=False)
    with pytest.raises(ValueError, match="sentences must be an int >= 2, got 1"):
        run_embed_eval(str(tmp_path / "c"), "shakespeare", tmp_path / "o", sentences=1)


def test_markdown_states_where_chunk_beats_sdpa():
    cost = {"threads": 2, "heads": 12, "head_dim": 32, "variant": "s", "chunk_size": 64, "forms": {
        "sdpa": [{"tokens": 512, "ms": 1.0, "extra_mib": 1.0}, {"tokens": 16384, "ms": 900.0, "extra_mib": 30.0}],
        "chunk": [{"tokens": 512, "ms": 3.0, "extra_mib": 2.0}, {"tokens": 16384, "ms": 100.0, "extra_mib": 40.0}],
        "parallel": [{"tokens": 512, "ms": 2.0, "extra_mib": 50.0}, {"tokens": 16384, "skipped": "needs about 48 GiB"}],
    }}
    data = {"method": "lion-s", "base": "minilm-l6", "data": "x", "sentences": 10, "tokens_per_sentence": 12.0,
            "quality": [{"model": "trained", "mean_cosine": 0.97, "min_cosine": 0.8, "nn_agreement": 0.91, "seconds": 1.0}],
            "cost": cost, "environment": {"device": "cpu", "torch": "2", "command": "x"}}
    md = embed_markdown(data)
    assert "faster than SDPA softmax at: 16384 tokens" in md and "skipped (needs about 48 GiB)" in md
    assert "| 0.910 ± 0.090 |" in md  # a record from before the standard error was stored: sqrt(.91 .09 / 10)
    assert "(softmax attention) took" not in md  # a record from before the teacher was timed
    md = embed_markdown({**data, "teacher_seconds": 0.5})
    assert "the teacher minilm-l6 (softmax attention) took 0.5 s" in md


@pytest.mark.slow
def test_cli_trains_a_lion_encoder_and_evaluates_it(tmp_path, capsys):
    """`linearize train --method lion-*` takes the encoder path; `linearize eval embed` reads its checkpoint."""
    from linearize.cli import main

    corpus = str(write_corpus(tmp_path))
    run = tmp_path / "run"
    assert main(["train", "--method", "lion-lit", "--model", "minilm-l6", "--data", corpus, "--out", str(run),
                 "--seq-len", "32", "--batch-size", "8", "--stage1-tokens", "600", "--stage2-tokens", "600",
                 "--val-rows", "8", "--device", "cpu", "--no-progress"]) == 0
    assert linearize.load(str(run))[0].linearize_spec["method"] == "lion-lit"
    assert main(["eval", "embed", "--model", str(run), "--data", corpus, "--sentences", "20", "--no-timing",
                 "--out", str(tmp_path / "eval"), "--device", "cpu"]) == 0
    saved = json.loads((tmp_path / "eval" / "embed.json").read_text())
    assert [q["model"] for q in saved["quality"]] == ["trained", "untrained"]
    assert "nearest" in capsys.readouterr().out.lower()
