"""LoRA in checkpoints: a LoRA-trained model saves, loads back exactly, and merges into a
self-contained export with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

import linearize
from linearize.models.lora import add_lora, default_lora_targets, merge_lora

from fixtures import tiny_model_dir

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))


def trained(tiny, method, **lora):
    model, tok = linearize.load_teacher(tiny)
    linearize.convert(model, method)
    add_lora(model, **lora)
    torch.manual_seed(1)
    with torch.no_grad():  # as if trained: LoRA's B starts at zero, the new modules at identity
        for name, p in model.named_parameters():
            if "lora_B" in name or ".hybrid." in name:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval(), tok


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("method", ["lizard", "lolcats", "liza"])
def test_lora_checkpoint_round_trip_and_merged_export(tiny, tmp_path, method):
    model, tok = trained(tiny, method)
    ids = torch.randint(0, 1000, (2, 40))
    expected = logits(model, ids)

    linearize.save(model, tmp_path / "ckpt", tokenizer=tok)
    meta = json.loads((tmp_path / "ckpt" / "linearize.json").read_text())
    assert meta["lora"] == {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    loaded, _ = linearize.load(tmp_path / "ckpt")
    assert torch.equal(logits(loaded, ids), expected)

    linearize.save(model, tmp_path / "merged", merged=True, tokenizer=tok)
    assert json.loads((tmp_path / "merged" / "linearize.json").read_text())["lora"] is None
    merged, merged_tok = linearize.load(tmp_path / "merged")
    assert merged_tok is not None
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-4, atol=1e-4)
    # the model that was saved still has its adapters
    assert model.linearize_lora is not None and any("lora_" in n for n, _ in model.named_parameters())


def test_merge_lora_folds_in_place(tiny):
    model, _ = trained(tiny, "lizard", rank=4, alpha=8.0)
    ids = torch.randint(0, 1000, (1, 30))
    expected = logits(model, ids)
    merge_lora(model)
    assert model.linearize_lora is None and not any("lora_" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(logits(model, ids), expected, rtol=1e-4, atol=1e-4)


def test_lora_targets_default_and_errors(tiny):
    model, _ = linearize.load_teacher(tiny)
    linearize.convert(model, "lizard")
    assert default_lora_targets(model) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match=r"lora_targets \['qq_proj'\].*q_proj"):
        add_lora(model, targets=["qq_proj"])
    add_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(model)


def test_fused_qkv_architecture_gets_fused_targets():
    from fixtures import phi3

    model = phi3()
    linearize.convert(model, "lizard")
    assert default_lora_targets(model) == ["qkv_proj", "o_proj"]
