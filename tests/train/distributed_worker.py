"""One rank of a torchrun launch for test_distributed.py, which runs several training scenarios
one after another (each launch pays torch's and transformers' imports once, not per scenario):

    torchrun --standalone --nproc-per-node 2 distributed_worker.py PLAN.json

PLAN.json: ``{"logs": DIR, "scenarios": [SCENARIO, ...]}``; each SCENARIO has a ``name`` and either
``cli`` (the arguments of ``linearize`` as a command line: ``["train", "--out", ...]``) or
``config`` (a ``TrainConfig`` as a dict, given to ``linearize.train.run``), and optionally
``resume`` (config only), ``seed_by_rank`` (each rank gets its own seed: ranks with different
settings), ``kill_rank1_at: n`` (rank 1 SIGKILLs itself when it asks for its n-th micro-batch;
this ends the launch, so it is the last scenario) and ``nan_rank1_at: n`` (rank 1's n-th stage-1
loss is NaN), ``expect_error`` (the scenario is meant to raise; the next one runs all the same).

Each scenario's run starts and ends its own process group, as it does in a launch of its own, on
a store of its own (a second group on the launcher's store would meet the first one's keys). Each
rank writes DIR/<name>.rank<r>.out (its stdout), .err (its stderr) and .json
(``{"error": traceback or null, "exit": the CLI's exit code or null}``; a CLI's non-zero exit
is an error). An error that was not expected ends the launch with that error.
"""

import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from linearize.cli import main as cli_main
from linearize.train import TrainConfig, run
from linearize.train import loop as loop_module
run_module = importlib.import_module("linearize.train.run")  # (the package's `run` is the function)

torch.set_num_threads(1)


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    logs = Path(plan["logs"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    for number, scenario in enumerate(plan["scenarios"]):
        own_store(launcher, number, rank)
        name = scenario["name"]
        error, code = None, None
        with open(logs / f"{name}.rank{rank}.out", "w") as out, open(logs / f"{name}.rank{rank}.err", "w") as err, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), patched(scenario, rank):
            try:
                code = play(scenario, rank)
                if code:
                    raise RuntimeError(f"linearize exited with {code}")
            except Exception:
                error = traceback.format_exc()
                err.write(error)
        (logs / f"{name}.rank{rank}.json").write_text(json.dumps({"error": error, "exit": code}))
        if error is not None and not scenario.get("expect_error"):
            raise RuntimeError(f"scenario {name!r} failed on rank {rank}:\n{error}")


def own_store(launcher: dist.TCPStore, number: int, rank: int) -> None:
    """Point ``env://`` at a fresh store that rank 0 will host, on a free port it names to the others."""
    key = f"scenario-{number}-port"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            launcher.set(key, str(s.getsockname()[1]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=launcher.get(key).decode(),
                      TORCHELASTIC_USE_AGENT_STORE="False")


def play(scenario: dict, rank: int) -> int | None:
    if "cli" in scenario:
        return cli_main(scenario["cli"])
    settings = dict(scenario["config"])
    if scenario.get("seed_by_rank"):
        settings["seed"] = rank
    run(TrainConfig(**settings), resume=bool(scenario.get("resume")))
    return None


@contextlib.contextmanager
def patched(scenario: dict, rank: int):
    """The scenario's breakage on rank 1, undone afterwards."""
    real_indices, real_loss = loop_module.batch_indices, run_module.transfer_loss
    kill_at, nan_at = scenario.get("kill_rank1_at", 0), scenario.get("nan_rank1_at", 0)
    if kill_at and rank == 1:
        calls = [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_indices(*args, **kwargs)

        loop_module.batch_indices = dying
    if nan_at and rank == 1:
        run_module.transfer_loss = nan_at_call(real_loss, nan_at)
    try:
        yield
    finally:
        loop_module.batch_indices, run_module.transfer_loss = real_indices, real_loss


def nan_at_call(loss_fn, n: int):
    """``loss_fn`` whose n-th call returns a NaN loss."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        loss, extra = loss_fn(*args, **kwargs)
        return (loss * float("nan") if calls[0] == n else loss), extra

    return wrapped


if __name__ == "__main__":
    main()
