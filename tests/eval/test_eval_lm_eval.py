"""lm-eval wiring: model=linearize, the linearize_* task configs, run_lm_eval and the drop-in CLI.

The scoring is checked against the model's own log-likelihoods, computed here directly with a
plain transformers forward (no lm-eval, no linearize loader) on prompts built here from the
fixture rows in the standard formats; accuracies must match exactly.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

import fixtures  # noqa: E402
import linearize  # noqa: E402
from linearize.eval import lm_eval_tasks  # noqa: E402
from linearize.eval.lm_eval_tasks import task_manager  # noqa: E402

SRC = Path(linearize.__file__).resolve().parents[1]
EVALDEV = Path(os.environ.get("LINEARIZE_EVALDEV", "/work/shared/data/evaldev"))  # the shared data, as in test_data.py

# ----------------------------------------------------------------------------- fixture data

PIQA = [
    {"goal": "Keep bread fresh.", "sol1": "Store it in a sealed bag.", "sol2": "Leave it in the sun all day.", "label": 0},
    {"goal": "Open a jar", "sol1": "Hit it with a hammer", "sol2": "Twist the lid after warming it under hot water", "label": 1},
    {"goal": "Dry wet shoes.", "sol1": "Stuff them with newspaper.", "sol2": "Freeze them.", "label": 0},
    {"goal": "Cool soup quickly", "sol1": "Put it on the stove", "sol2": "Stir it in a bowl set in ice", "label": 1},
]
ARC_EASY = [
    {"query": "Question: Which of these is a mammal?", "choices": ["shark", "whale", "trout", "a very small salmon"], "gold": 1},
    {"query": "Question: What do plants need to make food?", "choices": ["sunlight", "rocks", "plastic bags", "sand"], "gold": 0},
    {"query": "Question: Water freezes at what temperature in Celsius?", "choices": ["100", "50", "0", "-40"], "gold": 2},
]
ARC_CHALLENGE = [
    {"query": "Question: Which force keeps the Moon in orbit?", "choices": ["magnetism", "friction", "gravity", "the strong nuclear force"], "gold": 2},
    {"query": "Question: What is the main gas in air?", "choices": ["oxygen", "nitrogen", "argon", "carbon dioxide"], "gold": 1},
    {"query": "Question: An example of a chemical change is", "choices": ["melting ice", "tearing paper", "rusting iron", "boiling water"], "gold": 2},
]
HELLASWAG = [
    {"query": "Baking cookies: A woman mixes flour and sugar in a bowl. she", "choices": ["adds eggs and stirs.", "flies away.", "paints the bowl blue and leaves it outside for a week.", "sleeps."], "gold": 0},
    {"query": "Running: A man ties his shoes on a track. he", "choices": ["eats the shoes.", "starts running around the track.", "sings.", "dives."], "gold": 1},
    {"query": "Washing a car: A boy sprays the car with a hose. the boy", "choices": ["scrubs the car with a sponge.", "drives away.", "reads.", "swims in the hose."], "gold": 0},
]
WINOGRANDE = [
    {"qID": "a", "sentence": "The trophy did not fit in the suitcase because the _ was too big.", "option1": "trophy", "option2": "suitcase", "answer": "1"},
    {"qID": "b", "sentence": "Sam gave Tom a gift because _ was having a birthday.", "option1": "Sam", "option2": "Tom", "answer": "2"},
    {"qID": "c", "sentence": "The cat chased the mouse until _ was tired.", "option1": "the cat", "option2": "the mouse", "answer": "1"},
]
MMLU = {  # subject -> (dev rows, val rows); a row is question, A, B, C, D, answer letter
    "astronomy": ([
        ["What is the closest star to Earth?", "The Sun", "Sirius", "Vega", "Polaris", "A"],
        ["How many planets orbit the Sun?", "7", "8", "9", "10", "B"],
        ["Which planet has rings?", "Mercury", "Venus", "Saturn", "Mars", "C"],
        ["What is a light-year?", "A time", "A distance", "A mass", "A speed", "B"],
        ["The Moon's light comes from", "itself", "the Earth", "the Sun, reflected", "Jupiter", "C"],
    ], [
        ["Which is the largest planet?", "Earth", "Jupiter", "Mars", "Venus", "B"],
        ["What is a comet mostly made of?", "ice and dust", "iron", "gas only", "rock, \"mostly\", and metal", "A"],
        ["The Sun is a", "planet", "moon", "star", "galaxy", "C"],
    ]),
    "high_school_physics": ([
        ["What is the unit of force?", "joule", "newton", "watt", "pascal", "B"],
        ["Speed is distance divided by", "mass", "time", "force", "area", "B"],
        ["What is the unit of energy?", "joule", "newton", "volt", "ohm", "A"],
        ["Which is a vector?", "mass", "time", "velocity", "energy", "C"],
        ["Acceleration due to gravity on Earth, in m/s^2, is about", "1", "5", "9.8", "20", "C"],
    ], [
        ["What is the unit of power?", "watt", "joule", "newton", "kelvin", "A"],
        ["An object at rest stays at rest unless acted on by a", "color", "force", "sound", "smell", "B"],
    ]),
}
ALL_TASKS = ["linearize_piqa", "linearize_arc_easy", "linearize_arc_challenge", "linearize_hellaswag",
             "linearize_winogrande", "linearize_mmlu"]


def write_evaldev(root: Path) -> Path:
    """A folder in the evaldev layout with the rows above."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in (("piqa", PIQA), ("arc_easy", ARC_EASY), ("arc_challenge", ARC_CHALLENGE),
                       ("hellaswag", HELLASWAG), ("winogrande", WINOGRANDE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for split in ("dev", "val"):
        (root / "mmlu" / split).mkdir(parents=True, exist_ok=True)
    for subject, (dev, val) in MMLU.items():
        for split, rows in (("dev", dev), ("val", val)):
            with open(root / "mmlu" / split / f"{subject}_{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows(rows)
    return root


# ----------------------------------------------------------------------------- the standard prompts, built here

def mc_requests(task: str) -> list[tuple[list[tuple[str, str]], int, list[str]]]:
    """Per document: [(context, continuation)] per choice, the gold index, the choice strings
    (whose character lengths acc_norm divides by)."""
    out = []
    if task == "linearize_piqa":
        for r in PIQA:
            ctx = f"Question: {r['goal']}\nAnswer:"
            out.append(([(ctx, " " + s) for s in (r["sol1"], r["sol2"])], r["label"], [r["sol1"], r["sol2"]]))
    elif task in ("linearize_arc_easy", "linearize_arc_challenge", "linearize_hellaswag"):
        rows = {"linearize_arc_easy": ARC_EASY, "linearize_arc_challenge": ARC_CHALLENGE,
                "linearize_hellaswag": HELLASWAG}[task]
        for r in rows:
            ctx = r["query"] if task == "linearize_hellaswag" else f"{r['query']}\nAnswer:"
            out.append(([(ctx, " " + c) for c in r["choices"]], r["gold"], r["choices"]))
    elif task == "linearize_winogrande":
        for r in WINOGRANDE:
            blank = r["sentence"].index("_")
            rest = " " + r["sentence"][blank + 1:].strip()
            contexts = [r["sentence"][:blank] + o for o in (r["option1"], r["option2"])]
            out.append(([(c, rest) for c in contexts], int(r["answer"]) - 1, contexts))
    elif task.startswith("linearize_mmlu_"):
        subject = task[len("linearize_mmlu_"):]
        dev, val = MMLU[subject]

        def q(row):
            return f"{row[0].strip()}\nA. {row[1]}\nB. {row[2]}\nC. {row[3]}\nD. {row[4]}\nAnswer:"

        shots = "\n\n".join(f"{q(r)} {r[5]}" for r in dev[:5])
        head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        for r in val:
            ctx = head + shots + "\n\n" + q(r)
            out.append(([(ctx, " " + letter) for letter in "ABCD"], "ABCD".index(r[5]), list("ABCD")))
    else:
        raise KeyError(task)
    return out


@torch.no_grad()
def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) from one plain forward over context + continuation; the
    continuation's tokens are those of the whole string after the context's (lm-eval's split)."""
    if context:
        ctx = tokenizer.encode(context, add_special_tokens=False)
        cont = tokenizer.encode(context + continuation, add_special_tokens=False)[len(ctx):]
    else:
        ctx, cont = [tokenizer.bos_token_id], tokenizer.encode(continuation, add_special_tokens=False)
    whole = ctx + cont
    rows = model(torch.tensor([whole])).logits[0, len(ctx) - 1:len(whole) - 1].float().log_softmax(-1)
    target = torch.tensor(cont)
    return rows.gather(-1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def expected_scores(model, tokenizer, task: str, limit: int | None = None) -> dict:
    """acc, acc_norm and every log-likelihood of a task, from the model's own forward passes."""
    acc, acc_norm, lls = [], [], []
    for pairs, gold, choices in mc_requests(task)[:limit]:
        ll = [direct_loglikelihood(model, tokenizer, c, x)[0] for c, x in pairs]
        lls.append(ll)
        acc.append(float(max(range(len(ll)), key=ll.__getitem__) == gold))
        norm = [v / len(s) for v, s in zip(ll, choices)]
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == gold))
    return {"acc": acc, "acc_norm": acc_norm, "lls": lls}


def mean(xs):
    return sum(xs) / len(xs)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(fixtures.tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", num_layers=2, seed=3))


@pytest.fixture(scope="module")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_evaldev(tmp_path_factory.mktemp("evaldev") / "data")


@pytest.fixture(scope="module")
def manager(data):
    return task_manager(data)


@pytest.fixture(scope="module")
def student(tiny, tmp_path_factory) -> str:
    """An untrained lizard conversion of the tiny model, saved as a linearize checkpoint."""
    model, _ = linearize.load_teacher(tiny)
    linearize.convert(model, "lizard", window=8)
    return str(linearize.save(model, tmp_path_factory.mktemp("ckpt") / "lizard"))


def make_lm(path, **kwargs):
    from linearize.eval.harness import LinearizeLM

    return LinearizeLM(path=path, device="cpu", **kwargs)


def instances(kind: str, args_list) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)]


# ----------------------------------------------------------------------------- (1) scoring through simple_evaluate

def test_simple_evaluate_scores_the_fixture_exactly(tiny, hf_model, manager):
    res = lm_eval.simple_evaluate(model="linearize", model_args=f"path={tiny},device=cpu,batch_size=3",
                                  tasks=ALL_TASKS, task_manager=manager, log_samples=True)
    model, tokenizer = hf_model
    subjects = [f"linearize_mmlu_{s}" for s in MMLU]
    pooled = []
    for task in ALL_TASKS[:-1] + subjects:
        exp = expected_scores(model, tokenizer, task)
        samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
        # the prompts are the standard ones, built independently above
        assert [list(map(tuple, s["arguments"])) for s in samples] == [p for p, _, _ in mc_requests(task)], task
        got_lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
        for got, want in zip(got_lls, exp["lls"]):
            assert got == pytest.approx(want, abs=2e-4), task
        row = res["results"][task]
        assert row["acc,none"] == mean(exp["acc"]), task
        if task in ("linearize_piqa", "linearize_arc_easy", "linearize_arc_challenge", "linearize_hellaswag"):
            assert row["acc_norm,none"] == mean(exp["acc_norm"]), task
        if task in subjects:
            assert res["n-shot"][task] == 5
            pooled += exp["acc"]
    # the MMLU group: acc weighted by subject size = the mean over all rows
    assert res["results"]["linearize_mmlu"]["acc,none"] == pytest.approx(mean(pooled), abs=1e-12)
    assert sorted(res["group_subtasks"]["linearize_mmlu"]) == sorted(subjects)


# ----------------------------------------------------------------------------- (2) loglikelihood, batching, padding

def test_loglikelihood_matches_direct_and_batching_changes_nothing(tiny, hf_model):
    model, tokenizer = hf_model
    reqs = [("Question: What is the capital of France?\nAnswer:", " Paris"),
            ("Short", " and a much longer continuation that spans several tokens"),
            ("", "An empty context is conditioned on the BOS token"),
            ("A context of moderate length, used twice", " yes"),
            ("A context of moderate length, used twice", " no"),
            ("x", " y")]
    want = [direct_loglikelihood(model, tokenizer, c, x) for c, x in reqs]
    one = make_lm(tiny, batch_size=1).loglikelihood(instances("loglikelihood", reqs), disable_tqdm=True)
    many = make_lm(tiny, batch_size=4).loglikelihood(instances("loglikelihood", reqs), disable_tqdm=True)
    for (ll1, g1), (ll4, g4), (ll, g) in zip(one, many, want):
        assert ll1 == pytest.approx(ll, abs=2e-4) and ll4 == pytest.approx(ll1, abs=1e-5)
        assert g1 == g4 == g


def test_loglikelihood_truncates_long_inputs_on_the_left(tiny, hf_model):
    model, tokenizer = hf_model
    context, continuation = " ".join(f"word{i}" for i in range(40)), " end of it"
    lm = make_lm(tiny, max_length=16)
    (ll, _), = lm.loglikelihood(instances("loglikelihood", [(context, continuation)]), disable_tqdm=True)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(context + continuation, add_special_tokens=False)[len(ctx):]
    n = len(cont)
    kept = (ctx + cont)[-17:]
    with torch.no_grad():
        logp = model(torch.tensor([kept[:-1]])).logits[0].log_softmax(-1)
    direct = logp[-n:].gather(-1, torch.tensor(kept[-n:])[:, None]).sum().item()
    assert ll == pytest.approx(direct, abs=2e-4)


def test_generate_until_is_greedy_and_stops(tiny, hf_model):
    model, tokenizer = hf_model
    context = "Question: Say something.\nAnswer:"
    lm = make_lm(tiny)
    out, = lm.generate_until(instances("generate_until", [(context, {"until": ["\n\n"], "max_gen_toks": 6})]),
                             disable_tqdm=True)
    ids = tokenizer.encode(context, add_special_tokens=False)
    new = []
    with torch.no_grad():
        while len(new) < 6 and tokenizer.eos_token_id not in new:
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert out == text.split("\n\n")[0]
    # a stop string cuts the text where it first appears
    stop = text[2:4] if len(text) >= 4 else None
    if stop and stop.strip():
        cut, = lm.generate_until(instances("generate_until", [(context, {"until": [stop], "max_gen_toks": 6})]),
                                 disable_tqdm=True)
        assert cut == text.split(stop)[0]


# ----------------------------------------------------------------------------- (3) a linearized checkpoint

def test_linearized_checkpoint_evaluates(student, manager):
    res = lm_eval.simple_evaluate(model="linearize", model_args=f"path={student},device=cpu,batch_size=8",
                                  tasks=["linearize_winogrande"], task_manager=manager, limit=2)
    assert res["config"]["linearized"] is True
    model, tokenizer = linearize.load(student)  # the student's own log-likelihoods
    assert res["results"]["linearize_winogrande"]["acc,none"] == mean(
        expected_scores(model, tokenizer, "linearize_winogrande", limit=2)["acc"])


# ----------------------------------------------------------------------------- (4) loglikelihood_rolling

TEXT = ("The quick brown fox jumps over the lazy dog. " * 4).strip()


@torch.no_grad()
def full_logprob(model, ids: list[int]) -> float:
    logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()


def test_loglikelihood_rolling_teacher(tiny, hf_model):
    model, tokenizer = hf_model
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    prefix = tokenizer.bos_token_id
    got, = make_lm(tiny).loglikelihood_rolling(instances("loglikelihood_rolling", [(TEXT,)]), disable_tqdm=True)
    assert got == pytest.approx(full_logprob(model, [prefix, *tokens]), abs=2e-4)  # fits in the context
    # windows of L tokens: each predicts the next L tokens from the one before them (the first from
    # BOS); the last window reads a full L tokens of context (lm-eval's rolling rule)
    L = 8
    got, = make_lm(tiny, max_length=L).loglikelihood_rolling(instances("loglikelihood_rolling", [(TEXT,)]),
                                                              disable_tqdm=True)
    want, done = 0.0, 0
    while done < len(tokens):
        n = min(L, len(tokens) - done)
        inp = ([prefix] + tokens)[done + n - L: done + n] if done else [prefix, *tokens[:n - 1]]
        with torch.no_grad():
            logp = model(torch.tensor([inp])).logits[0].log_softmax(-1)
        want += logp[-n:].gather(-1, torch.tensor(tokens[done:done + n])[:, None]).sum().item()
        done += n
    assert got == pytest.approx(want, abs=2e-4)


def test_loglikelihood_rolling_student_reads_in_one_pass(student):
    model, tokenizer = linearize.load(student)
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    lm = make_lm(student, max_length=16)  # pieces of 16 tokens carrying the state
    assert lm.linearized
    got, = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(TEXT,)]), disable_tqdm=True)
    assert got == pytest.approx(full_logprob(model, [tokenizer.bos_token_id, *tokens]), rel=1e-4, abs=1e-3)


# ----------------------------------------------------------------------------- run_lm_eval: JSON, PNG, Markdown

def test_run_lm_eval_writes_one_table(tiny, student, hf_model, data, tmp_path):
    from linearize.eval.lm_eval_run import run_lm_eval

    out = run_lm_eval([tiny, student], ["piqa", "arc_challenge", "mmlu"], data, tmp_path, batch_size=8, limit=2)
    saved = json.loads((tmp_path / "lm_eval.json").read_text())
    assert [m["model"] for m in saved["models"]] == [tiny, student]
    assert [t["metric"] for t in saved["tasks"]] == ["acc", "acc_norm", "acc"]
    model, tokenizer = hf_model
    teacher = saved["models"][0]["results"]
    assert teacher["piqa"]["value"] == mean(expected_scores(model, tokenizer, "linearize_piqa", 2)["acc"])
    assert teacher["arc_challenge"]["value"] == mean(
        expected_scores(model, tokenizer, "linearize_arc_challenge", 2)["acc_norm"])
    assert teacher["piqa"]["n"] == 2 and teacher["mmlu"]["n"] == 2 * len(MMLU) and saved["limit"] == 2
    assert teacher["mmlu"]["num_fewshot"] == 5 and set(teacher["mmlu"]["subtasks"]) == set(MMLU)
    assert saved["models"][1]["linearized"] is True and out["models"][0]["linearized"] is False
    md = (tmp_path / "lm_eval.md").read_text()
    assert "| task | metric | n | chance |" in md and "acc_norm" in md and "lizard" in md
    assert (tmp_path / "lm_eval.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- (5) the drop-in command line

def test_drop_in_cli_runs_lm_eval(tiny, data, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "linearize.cli.lm_eval", "--model", "linearize",
                           "--model_args", f"path={tiny}", "--device", "cpu", "--tasks", "linearize_piqa", "--limit", "2",
                           "--data-dir", str(data), "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "linearize_piqa" in proc.stdout and "acc" in proc.stdout
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert written and "linearize_piqa" in json.loads(written[0].read_text())["results"]


def test_import_registers_lazily_and_survives_without_lm_eval():
    script = (
        "import sys\n"
        "sys.modules['lm_eval'] = None\n"  # lm-eval not installed
        "import linearize\n"
        "del sys.modules['lm_eval']\n"
        "linearize._register_with_lm_eval()\n"
        "from lm_eval.api.registry import model_registry as r\n"
        "assert 'linearize' in r and 'hf' in r, sorted(r.keys())[:5]\n"
        "assert 'linearize.eval.harness' not in sys.modules and 'lm_eval.api.model' not in sys.modules\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- (6) errors

def test_missing_data_file_is_named(tiny, data, tmp_path, capsys, monkeypatch):
    from linearize.eval.lm_eval_run import run_lm_eval
    from linearize.cli.lm_eval import main

    partial = write_evaldev(tmp_path / "partial")
    (partial / "hellaswag.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"hellaswag\.jsonl"):
        run_lm_eval([tiny], ["piqa", "hellaswag"], partial, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (partial / "mmlu" / "dev" / "astronomy_dev.csv").unlink()
    with pytest.raises(FileNotFoundError, match=r"astronomy_dev\.csv"):
        lm_eval_tasks.check_data(partial, lm_eval_tasks.resolve_tasks("mmlu"))
    assert main(["--model", "linearize", "--model_args", f"path={tiny}", "--tasks", "linearize_hellaswag",
                 "--data-dir", str(partial)]) == 2
    assert "hellaswag.jsonl" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lm_eval_tasks.check_data(tmp_path / "nowhere", lm_eval_tasks.resolve_tasks("piqa"))
    # a task loaded without any folder says how to give one
    monkeypatch.delenv("LINEARIZE_EVAL_DATA", raising=False)
    with pytest.raises(ValueError, match="--data-dir"):
        lm_eval_tasks.load_piqa(data_dir=None)


def _outside_git(monkeypatch, tmp_path) -> None:
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git is not installed: lm-eval's lookup prints nothing anyway")
    monkeypatch.chdir(tmp_path)
    if subprocess.run(["git", "rev-parse"], capture_output=True).returncode == 0:
        pytest.skip(f"{tmp_path} is inside a git repository")


def test_eval_lm_eval_prints_no_git_message_outside_a_repository(tiny, data, tmp_path, capfd, monkeypatch):
    """issue 40: `linearize eval lm-eval` printed git's `fatal: not a git repository` (lm-eval runs
    `git describe` for its results with git's stderr on the terminal)."""
    from linearize.cli import main

    _outside_git(monkeypatch, tmp_path)
    capfd.readouterr()
    assert main(["eval", "lm-eval", "--model", tiny, "--tasks", "piqa", "--data-dir", str(data), "--limit", "2",
                 "--out", str(tmp_path / "out"), "--device", "cpu"]) == 0
    err = capfd.readouterr().err
    assert "not a git repository" not in err and "fatal:" not in err, err[-2000:]


def test_quiet_git_keeps_the_lookup_and_restores_lm_eval(tmp_path, capfd, monkeypatch):
    from lm_eval import evaluator
    from lm_eval.loggers import utils as logger_utils

    from linearize.eval.lm_eval_run import quiet_git

    original = evaluator.get_git_commit_hash
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    expected = original()  # inside the repository: the same hash through either
    with quiet_git():
        assert evaluator.get_git_commit_hash() == expected
    _outside_git(monkeypatch, tmp_path)
    capfd.readouterr()
    with quiet_git():
        assert evaluator.get_git_commit_hash() is None
        assert logger_utils.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err
    assert evaluator.get_git_commit_hash is original


def test_unknown_task_and_bad_arguments(tiny, data, tmp_path):
    from linearize.eval.lm_eval_run import run_lm_eval

    with pytest.raises(ValueError, match=r"unknown task 'squad'.*piqa, arc_easy"):
        run_lm_eval([tiny], ["piqa", "squad"], data, tmp_path)
    assert [s.name for s in lm_eval_tasks.resolve_tasks("piqa,linearize_mmlu")] == ["linearize_piqa", "linearize_mmlu"]
    with pytest.raises(ValueError, match="limit"):
        run_lm_eval([tiny], ["piqa"], data, tmp_path, limit=0)
    with pytest.raises(ValueError, match="at least one model"):
        run_lm_eval([], ["piqa"], data, tmp_path)
    with pytest.raises(TypeError, match="unknown model argument.*pretrainedd"):
        make_lm(tiny, pretrainedd="x")
    with pytest.raises(ValueError, match="batch_size"):
        make_lm(tiny, batch_size=0)
    with pytest.raises(ValueError, match="unknown task"):
        lm_eval_tasks.resolve_tasks(["nope"])


def test_bad_rows_are_named(tmp_path):
    root = write_evaldev(tmp_path / "bad")
    (root / "piqa.jsonl").write_text(json.dumps(PIQA[0]) + "\n" + json.dumps({"goal": "x", "sol1": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"piqa\.jsonl, line 2: missing field\(s\) sol2, label"):
        lm_eval_tasks.load_piqa(data_dir=root)
    with open(root / "mmlu" / "val" / "astronomy_val.csv", "w", newline="") as f:
        csv.writer(f).writerow(["q", "a", "b", "c", "d", "E"])
    with pytest.raises(ValueError, match="answer must be A, B, C or D"):
        lm_eval_tasks.load_mmlu(data_dir=root, subject="astronomy")
    assert lm_eval_tasks.hellaswag_preprocess(" Cooking [title] Boil water. [step] Add salt.") == \
        "Cooking. Boil water. Add salt."


# ----------------------------------------------------------------------------- the real development splits

@pytest.mark.skipif(not (EVALDEV / "piqa.jsonl").is_file(), reason=f"no evaldev folder at {EVALDEV}")
def test_configs_read_the_real_dev_splits():
    loaded = task_manager(EVALDEV).load(ALL_TASKS)
    tasks = loaded["tasks"]
    counts = {name: len(tasks[name].eval_docs) for name in ALL_TASKS[:-1]}
    assert counts == {"linearize_piqa": 300, "linearize_arc_easy": 300, "linearize_arc_challenge": 200,
                      "linearize_hellaswag": 500, "linearize_winogrande": 250}
    subjects = [t for t in tasks if t.startswith("linearize_mmlu_")]
    assert len(subjects) == 57
    assert sum(len(tasks[t].eval_docs) for t in subjects) == 1531
    assert all(len(tasks[t].fewshot_docs()) == 5 for t in subjects)
    doc = tasks["linearize_arc_challenge"].eval_docs[0]
    assert tasks["linearize_arc_challenge"].doc_to_text(doc).startswith("Question: ")
    assert tasks["linearize_arc_challenge"].doc_to_text(doc).endswith("\nAnswer:")
    assert not math.isnan(float(doc["gold"]))


def test_linearize_eval_lm_eval_command(tiny, hf_model, data, tmp_path, capsys):
    from linearize.cli import main

    assert main(["eval", "lm-eval", "--model", tiny, "--tasks", "piqa,winogrande", "--data-dir", str(data),
                 "--limit", "2", "--out", str(tmp_path), "--device", "cpu"]) == 0
    saved = json.loads((tmp_path / "lm_eval.json").read_text())
    model, tokenizer = hf_model
    assert saved["models"][0]["results"]["piqa"]["value"] == mean(
        expected_scores(model, tokenizer, "linearize_piqa", 2)["acc"])
    assert "| task | metric |" in capsys.readouterr().out
    assert main(["eval", "lm-eval", "--model", tiny, "--tasks", "squad", "--data-dir", str(data),
                 "--out", str(tmp_path / "x")]) == 2
    assert "unknown task 'squad'" in capsys.readouterr().err
