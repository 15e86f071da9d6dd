"""The training step as CUDA graphs (train/graphs.py): what a capture needs from the stages' losses,
checked on the CPU, and the graphed run against the eager one on a GPU."""

from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import linearize
from linearize.train import TrainConfig, run
from linearize.train import graphs as graphs_module
from linearize.train.loop import Stage, step_graphs
from linearize.train.run import _distill_loss, _next_token_loss, lm_loss, transfer_loss
from linearize.train.transfer import make_blocks

from fixtures import llama, tiny_model_dir
from kernel_checks import needs_cuda

torch.set_num_threads(1)


class NoHostReads(TorchDispatchMode):
    """Raises on every op that reads a tensor's value on the host (what ``.item()``, ``bool(t)``,
    boolean indexing and ``nonzero`` do): on CUDA each is a sync, and inside a graph capture an error."""

    HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.HOST_READS:
            raise AssertionError(f"{func} reads a device value on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["lizard", "lolcats", "liza"])
@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage2 distill"])
def test_stage_losses_read_no_device_value(method, stage):
    model = llama()
    teacher = llama() if stage == "stage2 distill" else None
    linearize.convert(model, method)
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # no attention mask: a graph's batch has no padding
    config = TrainConfig(method=method, distill=0.5 if teacher is not None else 0.0)
    if stage == "stage1":
        fn = lambda: transfer_loss(model, batch, "heads", make_blocks(model, None)[0])  # noqa: E731
    else:
        fn = lambda: lm_loss(model, batch, teacher, config)  # noqa: E731
    # transformers skips its own host checks of the mask while a CUDA stream captures
    with mock.patch("torch.cuda.is_current_stream_capturing", return_value=True), NoHostReads():
        loss, extras = fn()
        loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.is_tensor(v) for k, v in extras.items() if k != "layers")  # read back after the step


def test_the_host_read_detector_catches_a_read():
    with pytest.raises(AssertionError, match="reads a device value"), NoHostReads():
        torch.ones(3).sum().item()


def test_next_token_loss_is_the_mean_over_labelled_tokens_and_zero_without_any():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, 2:4] = -100
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(_next_token_loss(logits, labels), want)
    none = _next_token_loss(logits, torch.full_like(labels, -100))
    none.backward()
    assert none.item() == 0.0 and logits.grad is not None and torch.all(logits.grad == 0)


def test_distill_loss_is_the_batch_mean_kl_over_kept_positions():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 1:] = -100
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != -100
    temp = 2.0
    want = F.kl_div(F.log_softmax(s[keep] / temp, -1), F.log_softmax(t[keep] / temp, -1), log_target=True,
                    reduction="batchmean") * temp**2
    torch.testing.assert_close(_distill_loss(s, t, labels, temp), want)
    assert _distill_loss(s, t, torch.full_like(labels, -100), temp).item() == 0.0


def test_graphs_only_where_asked_on_cuda_and_allowed():
    stage = Stage("stage2", {}, lambda b: None, None, 1, 1e-3, graphable=True)
    assert step_graphs(stage, [], TrainConfig(), torch.device("cpu")) is None
    with mock.patch("torch.cuda.is_available", return_value=True):
        cuda = torch.device("cuda")
        assert step_graphs(stage, [], TrainConfig(cuda_graph=False), cuda) is None
        assert step_graphs(Stage("x", {}, lambda b: None, None, 1, 1e-3), [], TrainConfig(), cuda) is None
        assert isinstance(step_graphs(stage, [], TrainConfig(), cuda), graphs_module.GraphedStep)


def test_a_bad_cuda_graph_setting_is_named(tmp_path):
    with pytest.raises(ValueError, match="cuda_graph must be true or false, got 'yes'"):
        run(TrainConfig(cuda_graph="yes", out=str(tmp_path / "r")))


@needs_cuda
@pytest.mark.parametrize("method", ["lizard", "liza"])
def test_graphed_training_matches_eager(method, tmp_path):
    """Both stages on CUDA with and without graphs: the same losses and weights within bf16 noise,
    and every training micro-batch on a graph."""
    from linearize.data.sources import shakespeare_plays

    folder = tmp_path / "text"
    folder.mkdir()
    for i, body in enumerate(shakespeare_plays()[:4]):
        (folder / f"{i}.txt").write_text(body[:6000])
    model = str(tiny_model_dir(tmp_path / "model", num_layers=3))
    replays = []
    real_call = graphs_module.GraphedStep.__call__

    def counting(self, batch):
        out = real_call(self, batch)
        replays.append(out is not None)
        return out

    results = {}
    for graphed in (False, True):
        out = tmp_path / f"run-{graphed}"
        config = TrainConfig(model=model, data=str(folder), out=str(out), method=method, seq_len=64, batch_size=2,
                             stage1_tokens=64 * 2 * 5, stage2_tokens=64 * 2 * 5, val_rows=2, eval_every=100,
                             progress=False, warmup_steps=0, device="cuda", cuda_graph=graphed)
        with mock.patch.object(graphs_module.GraphedStep, "__call__", counting), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns: fail here instead
            run(config)
        recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
        losses = [r["loss"] for r in recs if r.get("split") == "train"]
        weights = load_file(str(next(out.glob("**/*.safetensors"))))
        results[graphed] = losses, weights
    assert replays and all(replays)
    eager, graph = results[False], results[True]
    assert len(eager[0]) == len(graph[0]) == 10
    torch.testing.assert_close(torch.tensor(graph[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-3)
    for name, w in eager[1].items():
        torch.testing.assert_close(graph[1][name].float(), w.float(), rtol=3e-2, atol=3e-3, msg=name)
