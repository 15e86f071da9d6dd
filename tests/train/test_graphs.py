"""The training step as CUDA graphs (train/graphs.py): what a capture needs from the stages' losses,
checked on the CPU, and the graphed run against the eager one on a GPU."""

from __future__ import annotations

import json
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import linearize
from linearize.train import TrainConfig, run
from linearize.train import graphs as graphs_module
from linearize.train.graphs import compile_attention_modules
from linearize.train.loop import Stage, step_graphs
from linearize.train.run import _distill_loss, _next_token_loss, _position_weights, lm_loss, transfer_loss
from linearize.train.transfer import make_blocks

from fixtures import llama
from helpers import NoHostSync, capturing
from kernel_checks import needs_cuda

torch.set_num_threads(1)


@pytest.mark.parametrize("padded", [False, True], ids=["whole rows", "padded rows"])
@pytest.mark.parametrize("method", ["lizard", "lolcats", "liza"])
@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage2 distill"])
def test_stage_losses_read_no_device_value(method, stage, padded):
    model = llama()
    teacher = llama() if stage == "stage2 distill" else None
    linearize.convert(model, method)
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # whole rows: a graph's batch has no attention mask
    if padded:  # padded rows keep their mask (left padding in one row, right padding in the other)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        mask[1, 30:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    config = TrainConfig(method=method, distill=0.5 if teacher is not None else 0.0)
    if stage == "stage1":
        fn = lambda: transfer_loss(model, batch, "heads", make_blocks(model, None)[0])  # noqa: E731
    else:
        fn = lambda: lm_loss(model, batch, teacher, config)  # noqa: E731
    # as while a CUDA stream captures: transformers and our "anything padded?" shortcuts read no mask
    with capturing(), NoHostSync():
        loss, extras = fn()
        loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.is_tensor(v) for k, v in extras.items() if k != "layers")  # read back after the step


def test_the_host_sync_detector_catches_a_read_unless_capturing_skips_it():
    from linearize.ops.common import known_all_true

    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        known_all_true(torch.ones(3, dtype=torch.bool))
    with capturing(), NoHostSync():
        assert not known_all_true(torch.ones(3, dtype=torch.bool))  # kept masked: no read


def test_next_token_loss_is_the_mean_over_labelled_tokens_and_zero_without_any():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, 2:4] = -100
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(_next_token_loss(logits, labels), want)
    torch.testing.assert_close(_next_token_loss(logits, labels, _position_weights(labels)), want)
    none = _next_token_loss(logits, torch.full_like(labels, -100))
    none.backward()
    assert none.item() == 0.0 and logits.grad is not None and torch.all(logits.grad == 0)


def test_document_weights_make_the_loss_a_mean_over_documents():
    """Row 0 holds a document of 4 tokens then one of 1; row 1 one of 2 (and padding). Each label
    weighs 1 / its document's labels, so every document weighs about the same, not every token
    (a row's first token has no prediction, so document 0 keeps 3 of its 4 quarters)."""
    from linearize.data.packing import pack

    rows = pack([[5, 6, 7, 8], [9], [3, 4]], 5, "pack", min_tokens=1, weighting="document")
    batch = rows.batch([0, 1])
    labels = batch["labels"]
    logits = torch.randn(*labels.shape, 13, generator=torch.Generator().manual_seed(3))
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                         reduction="none").view(2, -1)
    # row 0 predicts 6, 7, 8 (document 0) and 9 (document 1); row 1 predicts 4 (document 2)
    want = (ce[0, :3].sum() / 4 + ce[0, 3] + ce[1, 0] / 2) / (3 / 4 + 1 + 1 / 2)
    got = _next_token_loss(logits, labels, _position_weights(labels, batch["loss_weight"]))
    torch.testing.assert_close(got, want)
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert abs(float(got) - float(per_token)) > 1e-3


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
    torch.testing.assert_close(_distill_loss(s, t, _position_weights(labels), temp), want)
    assert _distill_loss(s, t, _position_weights(torch.full_like(labels, -100)), temp).item() == 0.0


def test_graphs_only_where_asked_on_cuda_and_allowed():
    stage = Stage("stage2", {}, lambda b: None, None, 1, 1e-3, graphable=True)
    assert step_graphs(stage, [], TrainConfig(), torch.device("cpu")) is None
    with mock.patch("torch.cuda.is_available", return_value=True):
        cuda = torch.device("cuda")
        assert step_graphs(stage, [], TrainConfig(cuda_graph=False), cuda) is None
        assert step_graphs(Stage("x", {}, lambda b: None, None, 1, 1e-3), [], TrainConfig(), cuda) is None
        assert isinstance(step_graphs(stage, [], TrainConfig(), cuda), graphs_module.GraphedStep)


@pytest.mark.parametrize("field", ["cuda_graph", "compile"])
def test_a_bad_fast_step_setting_is_named(field, tmp_path):
    with pytest.raises(ValueError, match=f"{field} must be true or false, got 'yes'"):
        run(TrainConfig(**{field: "yes"}, out=str(tmp_path / "r")))


@pytest.mark.parametrize("method, names", [("lizard", ("phi_q", "phi_k", "gate")), ("lolcats", ("phi_q", "phi_k")),
                                           ("liza", ()), ("lizard-gdn", ("gate", "beta_proj"))])
def test_compile_attention_modules_compiles_the_feature_maps_and_gates_in_place(method, names):
    model = llama(num_layers=2)
    linearize.convert(model, method)
    keys = list(model.state_dict())
    assert compile_attention_modules(model) == 2 * len(names)  # (liza's maps and mu have no parameters)
    assert list(model.state_dict()) == keys  # a checkpoint of a compiled model reads as before
    hybrid = model.model.layers[0].self_attn.hybrid
    assert all(getattr(hybrid, n)._compiled_call_impl is not None for n in names)
    assert hybrid.compile_glue  # and the parameterless glue around the ops


def test_the_compiled_maps_stay_compiled_through_both_stages(monkeypatch, caplog):
    """Every variant a run asks of the compiled feature maps and gates (stage 1 training and
    validation, stage 2 with LoRA, shorter batches) compiles: none falls back to eager because
    torch's recompile limit ran out (it did at torch's default of 8)."""
    import logging

    import torch._dynamo

    from linearize.models.lora import add_lora
    from linearize.train.transfer import make_blocks, trainable_attention_parameters

    torch._dynamo.reset()
    # (config.patch, not monkeypatch: undoing a setattr deletes a config entry, which broke later tests)
    with torch._dynamo.config.patch(recompile_limit=8):
        compile_ = torch.nn.Module.compile
        monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager"))
        model = llama(num_layers=2)
        linearize.convert(model, "lizard")
        compile_attention_modules(model)
        ids = torch.randint(0, 100, (2, 128), generator=torch.Generator().manual_seed(0))
        block = make_blocks(model, None)[0]
        for p in trainable_attention_parameters(model):
            p.requires_grad_(True)
        caplog.set_level(logging.WARNING, logger="torch._dynamo")
        for width in (128, 64):
            loss, _ = transfer_loss(model, {"input_ids": ids[:, :width]}, "heads", block)
            loss.backward()
            with torch.no_grad():
                transfer_loss(model, {"input_ids": ids[:, :width]}, "heads", block)
        for p in model.parameters():
            p.requires_grad_(False)
        add_lora(model, rank=4, alpha=8)
        for width in (128, 64):
            model(input_ids=ids[:, :width], labels=ids[:, :width]).loss.backward()
            with torch.no_grad():
                model(input_ids=ids[:, :width])
        torch._dynamo.reset()
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    assert torch._dynamo.config.recompile_limit >= 8  # the setting outlives the test


# the cases the graph tests train: name -> (method, settings); "+cache": LoLA's sparse cache on,
# with a window short enough for the 64-token rows to fill it (its spans recompute in backward:
# checkpointing under capture); "-far": the cache read at a fixed RoPE distance
GRAPH_METHODS = {"lizard": ("lizard", {}), "lolcats": ("lolcats", {}), "liza": ("liza", {}),
                 "lizard-gdn+cache": ("lizard-gdn", {"window": 16, "sparse_cache": 8}),
                 "lizard-gdn+cache-far": ("lizard-gdn", {"window": 16, "sparse_cache": 8, "sparse_distance": 24})}


def _train_both_stages(case: str, graphed: bool, tmp_path) -> tuple[list[float], dict, dict]:
    """Stage 1 then stage 2 (LoRA) of a tiny Llama on CUDA through ``fit``, 5 steps each, on rows of
    random tokens (``case``: a key of GRAPH_METHODS): the training losses, the trained weights and
    the same weights before their stage."""
    from linearize.data import pack
    from linearize.models.lora import add_lora, lora_parameters
    from linearize.train.loop import MetricsLog, fit
    from linearize.train.run import named_parameters_of
    from linearize.train.transfer import freeze_all_but, trainable_attention_parameters

    g = torch.Generator().manual_seed(0)
    # every document's last row is padded: batches with and without padding, a graph for each
    rows = pack([torch.randint(3, 120, (170,), generator=g).tolist() for _ in range(8)], 64, "split", min_tokens=8)
    device = torch.device("cuda")
    model = llama(num_layers=3).to(device)
    method, settings = GRAPH_METHODS[case]
    linearize.convert(model, method, **settings)
    if graphed:  # as linearize train runs on CUDA: graphs, and the small modules compiled
        compile_attention_modules(model)
    config = TrainConfig(method=method, batch_size=2, progress=False, val_fraction=0.0, warmup_steps=0,
                         cuda_graph=graphed, device="cuda")
    metrics = MetricsLog(tmp_path / f"m-{graphed}.jsonl")
    block = make_blocks(model, None)[0]
    params = trainable_attention_parameters(model, block)
    freeze_all_but(model, params)
    model.eval()
    loss1 = lambda b: transfer_loss(model, b, config.transfer_target, block)  # noqa: E731
    start = {id(p): p.detach().float().cpu() for p in params}
    if params:  # (liza's attention learns nothing in stage 1)
        fit(Stage("stage1", named_parameters_of(model, params), loss1, None, 5, config.stage1_lr, graphable=True),
            rows, config, device, tmp_path / f"s1-{graphed}.pt", metrics, resume=False)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)  # the adapters' random init (compiling draws from the global generator)
    add_lora(model, rank=config.lora_rank, alpha=config.lora_alpha, targets=config.lora_targets)
    model.to(device).train()
    params2 = lora_parameters(model)
    start.update({id(p): p.detach().float().cpu() for p in params2})
    loss2 = lambda b: lm_loss(model, b, None, config)  # noqa: E731
    fit(Stage("stage2", named_parameters_of(model, params2), loss2, None, 5, config.stage2_lr, graphable=True),
        rows, config, device, tmp_path / f"s2-{graphed}.pt", metrics, resume=False)
    losses = [json.loads(line)["loss"] for line in open(metrics.path) if '"train"' in line]
    trained = [(n, p) for n, p in model.named_parameters() if any(p is q for q in params + params2)]
    return losses, {n: p.detach().float().cpu() for n, p in trained}, {n: start[id(p)] for n, p in trained}


@needs_cuda
@pytest.mark.parametrize("case", list(GRAPH_METHODS))
def test_graphed_training_matches_eager(case, tmp_path):
    """Both stages on CUDA with and without graphs: the same losses, and the same weight updates
    within noise (each LoRA adapter's as the change B @ A: see _updates), and every training
    micro-batch on a graph. (A graph that replayed stale inputs or weights would be 100% apart, or
    not move.)"""
    replays = []
    real_call = graphs_module.GraphedStep.__call__

    def counting(self, batch, weight=1.0):
        out = real_call(self, batch, weight)
        replays.append(out is not None)
        signatures.add(tuple(sorted(graphs_module.GraphedStep._graph_inputs(batch))))
        return out

    signatures = set()

    eager = _train_both_stages(case, False, tmp_path)
    with mock.patch.object(graphs_module.GraphedStep, "__call__", counting), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns: fail here instead
        graph = _train_both_stages(case, True, tmp_path)
    steps = 5 if case == "liza" else 10
    assert len(replays) == steps and all(replays)
    assert signatures == {("input_ids", "labels"), ("attention_mask", "input_ids", "labels")}
    assert len(eager[0]) == len(graph[0]) == steps
    torch.testing.assert_close(torch.tensor(graph[0]), torch.tensor(eager[0]), rtol=2e-2, atol=2e-3)
    assert eager[1].keys() == graph[1].keys() and eager[1]
    for name in eager[1]:
        assert torch.equal(graph[2][name], eager[2][name]), name  # the same start
    for name, (start, e, g) in _updates(eager, graph).items():
        moved, apart = (e - start).norm(), (g - e).norm()
        assert apart <= 0.5 * moved or apart == moved == 0, f"{name}: updates {apart:.3g} apart, eager moved {moved:.3g}"
    for name in (n for n in eager[1] if ".lora_A." in n):  # moved in both runs, whatever the sign noise
        assert (graph[1][name] - graph[2][name]).norm() > 0 and (eager[1][name] - eager[2][name]).norm() > 0, name


def _updates(eager, graph) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{name: (start, eager's end, graph's end)} of every trained tensor, each LoRA adapter's A taken
    as the weight change B @ A it makes. Adam's first steps are close to sign steps, a whole step
    for an element whose gradient is near zero, whichever sign rounding gives it; A's gradient is
    zero at the first step (B starts at zero), then in proportion to B's first small steps, so its
    update is largely such steps (26% and 51% of it apart between two pairs of runs on an H200).
    B @ A, what the model computes, is dominated by A's random start and moves as B does."""
    out = {}
    for name, e in eager[1].items():
        if ".lora_A." in name:
            b = name.replace(".lora_A.", ".lora_B.")
            out[name.replace(".lora_A.", ".lora_BA.")] = (eager[2][b] @ eager[2][name], eager[1][b] @ e,
                                                          graph[1][b] @ graph[1][name])
        else:
            out[name] = (eager[2][name], e, graph[1][name])
    return out


@needs_cuda
def test_a_graphed_steps_weight_scales_its_gradients():
    """A replicated rank weighs its share of a micro-batch by a number the graph reads from the device
    at each replay: the gradients are that multiple of the unweighted ones, from one captured graph."""
    from linearize.train.graphs import GraphedStep

    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 1).to(device)
    params = list(layer.parameters())

    def loss_fn(batch):
        return layer(batch["x"].to(device)).square().mean(), {}

    step = GraphedStep(loss_fn, params, lambda: torch.autocast("cuda", enabled=False), 0.5, device)
    batch = {"x": torch.randn(4, 8)}
    grads = []
    for weight in (1.0, 0.25, 3.0):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        assert step(batch, weight) is not None
        grads.append([p.grad.clone() for p in params])
    assert len(step.graphs) == 1
    for scaled, weight in zip(grads[1:], (0.25, 3.0)):
        for g, g1 in zip(scaled, grads[0]):
            torch.testing.assert_close(g, g1 * weight)
    x = batch["x"].to(device).requires_grad_(False)
    expected = torch.autograd.grad(layer(x).square().mean() * 0.5, params)
    for g, e in zip(grads[0], expected):
        torch.testing.assert_close(g, e)


def test_frozen_casts_are_kept_and_give_autocasts_products():
    """cache_frozen_casts: under (CPU) bf16 autocast a stage-2 step's loss and LoRA gradients are
    exactly autocast's own; a frozen weight is cast once (the same cached tensor at the next step)
    and again after an in-place change; without autocast the plain fp32 product runs; trainable
    projections (LoRA's) are left to autocast."""
    import linearize
    from linearize.models.lora import add_lora, lora_parameters
    from linearize.train.graphs import cache_frozen_casts

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in lora_parameters(model)]

    models = []
    for cached in (False, True):
        model = linearize.convert(llama(num_layers=2), "lizard")
        for p in model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(1)
        add_lora(model, rank=4, alpha=8)
        if cached:
            assert cache_frozen_casts(model) > 0
        models.append(model)
    (loss_ref, grads_ref), (loss, grads) = step(models[0]), step(models[1])
    assert torch.equal(loss, loss_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
    q = models[1].model.layers[0].self_attn.q_proj
    base = q.base_layer
    first = base._cast_weight
    assert first is not None and first.dtype == torch.bfloat16 and torch.equal(first, base.weight.bfloat16())
    assert q.lora_A["default"]._cast_key is None  # trainable: autocast's own cast
    step(models[1])
    assert base._cast_weight is first
    with torch.no_grad():
        base.weight.mul_(2)
    step(models[1])
    assert base._cast_weight is not first and torch.equal(base._cast_weight, base.weight.bfloat16())
    x = torch.randn(3, base.in_features)
    assert torch.equal(base(x), torch.nn.functional.linear(x, base.weight, base.bias))  # no autocast: fp32
