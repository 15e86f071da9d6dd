import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import linearize
from linearize.models.checkpoint import ADAPTER_FILE, MERGED_FILE, META_FILE


def _tiny_base(path, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture
def trained(tmp_path, request):
    """A converted tiny model whose new modules moved away from their initialisation (Lizard, or
    the method a test asks for through indirect parametrisation)."""
    base = _tiny_base(tmp_path / "base")
    model, _ = linearize.load_teacher(base)
    linearize.convert(model, getattr(request, "param", "lizard"), window=8, softmax_layers=[1])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hybrid." in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model, tmp_path


IDS = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("trained", ["lizard", "lizard-gdn"], indirect=True)
def test_save_then_load_reproduces_logits_exactly(trained):
    model, tmp = trained
    ref = model(IDS).logits
    linearize.save(model, tmp / "ck")
    meta = json.loads((tmp / "ck" / META_FILE).read_text())
    assert meta["method"] == model.linearize_spec["method"] and meta["overrides"] == {"window": 8} and meta["softmax_layers"] == [1]
    loaded, _ = linearize.load(tmp / "ck")
    assert torch.equal(loaded(IDS).logits, ref)
    # only the new modules are stored: a small fraction of the base
    n_added = sum(p.numel() for n, p in model.named_parameters() if ".hybrid." in n)
    n_base = sum(p.numel() for n, p in model.named_parameters() if ".hybrid." not in n)
    size = (tmp / "ck" / ADAPTER_FILE).stat().st_size
    assert size < 4 * n_added + 4096 and n_added < 0.2 * n_base


def test_load_with_a_parameter_free_override_adds_lolas_cache_to_a_trained_student(trained):
    """sparse_cache adds no parameters: a trained Lizard loads with it, changes its logits (IDS is
    longer than the window of 8), saves with the merged settings and loads back exactly; a setting
    that changes the parameters is refused by name."""
    model, tmp = trained
    ref = model(IDS).logits
    linearize.save(model, tmp / "ck")
    cached, _ = linearize.load(tmp / "ck", overrides={"sparse_cache": 3})
    out = cached(IDS).logits
    assert torch.isfinite(out).all() and not torch.allclose(out, ref)
    linearize.save(cached, tmp / "ck-sparse")
    assert json.loads((tmp / "ck-sparse" / META_FILE).read_text())["overrides"] == {"window": 8, "sparse_cache": 3}
    again, _ = linearize.load(tmp / "ck-sparse")
    assert torch.equal(again(IDS).logits, out)
    far, _ = linearize.load(tmp / "ck", overrides={"sparse_cache": 3, "sparse_distance": 5})  # RoPE tables rebuilt
    linearize.save(far, tmp / "ck-far")
    assert torch.equal(linearize.load(tmp / "ck-far")[0](IDS).logits, far(IDS).logits)
    assert not torch.equal(far(IDS).logits, out)
    with pytest.raises(ValueError, match=r"the overrides \{'feature_dim': 4\} change the checkpoint's parameters"):
        linearize.load(tmp / "ck", overrides={"feature_dim": 4})


def test_merged_export_is_self_contained_and_reproduces_logits(trained):
    model, tmp = trained
    ref = model(IDS).logits
    linearize.save(model, tmp / "merged", merged=True)
    loaded, _ = linearize.load(tmp / "merged", base="/nonexistent-base-is-not-needed")
    assert torch.equal(loaded(IDS).logits, ref)


def test_save_overwrites_atomically_and_leaves_no_temporaries(trained):
    model, tmp = trained
    linearize.save(model, tmp / "ck")
    linearize.save(model, tmp / "ck", overwrite=True)
    assert sorted(p.name for p in tmp.iterdir()) == ["base", "ck"]


def _snapshot(folder):
    """Every file under ``folder``: its bytes, mtime and mode."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _fake_run(folder):
    """The files ``linearize train`` leaves beside its checkpoint (train/run.py)."""
    (folder / "state").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"method": "lizard", "model": "smollm2-135m", "seq_len": 256}))
    (folder / "metrics.jsonl").write_text('{"stage": "stage2", "split": "val", "step": 10, "loss": 2.5}\n')
    (folder / "summary.json").write_text(json.dumps({"student_val_loss": 2.5}))
    (folder / "stage2_loss.png").write_bytes(b"\x89PNG\r\n\x1a\n curves")
    (folder / "state" / "stage2.pt").write_bytes(b"resume state")


def test_save_refuses_a_training_run_or_checkpoint_and_changes_nothing(trained):
    """issue 40: saving over a finished run replaced its trained adapter. Now it is refused, naming
    the folder and what is in it, with every byte left as it was; overwrite=True replaces only the
    checkpoint."""
    model, tmp = trained
    run = tmp / "run"
    _fake_run(run)
    linearize.save(model, run, overwrite=True)  # as the trainer does, into its own directory
    before = _snapshot(run)
    assert set(before) >= {META_FILE, ADAPTER_FILE, "config.json", "metrics.jsonl", "summary.json"}
    with pytest.raises(FileExistsError) as err:
        linearize.save(model, run)
    msg = str(err.value)
    assert msg.startswith(f"{run} holds a training run (config.json, metrics.jsonl, summary.json, state/, "
                          f"stage2_loss.png) and a checkpoint ({META_FILE}, {ADAPTER_FILE})"), msg
    assert "overwrite=True" in msg
    assert _snapshot(run) == before
    assert sorted(p.name for p in tmp.iterdir()) == ["base", "run"], "a temporary folder was left"

    linearize.save(model, tmp / "ck")  # a bare checkpoint is refused too
    with pytest.raises(FileExistsError, match=rf"holds a checkpoint \({META_FILE}, {ADAPTER_FILE}\); pass overwrite"):
        linearize.save(model, tmp / "ck", merged=True)
    assert not (tmp / "ck" / "model.safetensors").exists()

    with torch.no_grad():
        next(p for n, p in model.named_parameters() if ".hybrid." in n).add_(1.0)
    linearize.save(model, run, overwrite=True)
    after = _snapshot(run)
    assert after[ADAPTER_FILE][0] != before[ADAPTER_FILE][0]
    assert {k: v for k, v in after.items() if k not in (META_FILE, ADAPTER_FILE)} == \
        {k: v for k, v in before.items() if k not in (META_FILE, ADAPTER_FILE)}, "the run's own files changed"


def test_save_into_a_file_is_refused_by_name(trained):
    model, tmp = trained
    (tmp / "notes.txt").write_text("keep me")
    with pytest.raises(NotADirectoryError, match=f"{tmp / 'notes.txt'} is a file, not a directory"):
        linearize.save(model, tmp / "notes.txt", overwrite=True)
    with pytest.raises(NotADirectoryError, match=f"{tmp / 'notes.txt'} is a file"):
        linearize.save(model, tmp / "notes.txt" / "ck")
    assert (tmp / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("merged", [False, True])
def test_checkpoint_files_get_the_usual_permissions(trained, umask, merged):
    """Not 0600 (safetensors' own mode, issue 40): 0666 less the umask, as any file the user writes."""
    import os
    import stat

    model, tmp = trained
    old = os.umask(umask)
    try:
        out = linearize.save(model, tmp / "ck", merged=merged)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert (MERGED_FILE if merged else ADAPTER_FILE) in modes and META_FILE in modes
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


@pytest.mark.parametrize("key", ["method", "softmax_layers", "overrides", "base"])
def test_checkpoint_without_a_required_key_is_named(trained, key):
    model, tmp = trained
    linearize.save(model, tmp / "ck")
    meta_path = tmp / "ck" / META_FILE
    meta = json.loads(meta_path.read_text())
    del meta[key]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError) as err:
        linearize.load(tmp / "ck")
    assert str(err.value) == (f"corrupted checkpoint: {meta_path} has no {key!r} key "
                              "(required: method, softmax_layers, overrides, base)")
    meta[key] = "x"
    meta["base"] = {"fingerprint": "0"}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"has no 'base.name' key"):
        linearize.load(tmp / "ck")


def test_wrong_base_fingerprint_is_refused(trained):
    model, tmp = trained
    linearize.save(model, tmp / "ck")
    other = _tiny_base(tmp / "other", seed=1)
    with pytest.raises(ValueError, match="does not match the checkpoint: weights fingerprint"):
        linearize.load(tmp / "ck", base=other)


def test_format_version_mismatch_is_refused(trained):
    model, tmp = trained
    linearize.save(model, tmp / "ck")
    meta_path = tmp / "ck" / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"format_version 99 is not supported .*supported: 1"):
        linearize.load(tmp / "ck")


@pytest.mark.parametrize("damage", ["truncate", "garbage_json", "delete"])
def test_corrupted_checkpoint_gives_a_clear_error(trained, damage):
    model, tmp = trained
    linearize.save(model, tmp / "ck")
    tensors = tmp / "ck" / ADAPTER_FILE
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:100])
        err, match = ValueError, "corrupted checkpoint: cannot read"
    elif damage == "garbage_json":
        (tmp / "ck" / META_FILE).write_text("{not json")
        err, match = ValueError, "corrupted checkpoint: .* is not valid JSON"
    else:
        tensors.unlink()
        err, match = FileNotFoundError, "corrupted checkpoint: .* is missing"
    with pytest.raises(err, match=match):
        linearize.load(tmp / "ck")


def test_save_requires_a_converted_model(tmp_path):
    model, _ = linearize.load_teacher(_tiny_base(tmp_path / "base"))
    with pytest.raises(ValueError, match="converted with linearize.convert"):
        linearize.save(model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow
def test_bundled_teacher_checkpoint_round_trip(tmp_path):
    model, _ = linearize.load_teacher()
    linearize.convert(model, "lizard")
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".hybrid." in name:
                p.add_(torch.randn_like(p) * 0.01)
        ref = model(ids).logits
    linearize.save(model, tmp_path / "ck")
    size = (tmp_path / "ck" / ADAPTER_FILE).stat().st_size
    base_bytes = 4 * sum(p.numel() for n, p in model.named_parameters() if ".hybrid." not in n)
    print(f"\nlizard checkpoint of SmolLM2-135M: {size / 1e6:.2f} MB = {100 * size / base_bytes:.2f}% of the fp32 base")
    assert size < 0.05 * base_bytes
    loaded, tokenizer = linearize.load(tmp_path / "ck")
    assert tokenizer is not None
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
