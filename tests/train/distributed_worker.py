"""One rank of a training run for test_distributed.py, launched by torchrun:

    torchrun --standalone --nproc-per-node 2 distributed_worker.py '<TrainConfig JSON>' [--resume]

The same config from Python as ``linearize train`` gives from the command line, with two ways to
break it: ``SEED_BY_RANK=1`` gives each rank its own seed (ranks with different settings),
``KILL_RANK1_AT=n`` makes rank 1 SIGKILL itself when it asks for its n-th micro-batch, and
``NAN_RANK1_AT=n`` makes rank 1's n-th stage-1 loss NaN.
"""

import importlib
import json
import os
import signal
import sys

import torch

from linearize.train import TrainConfig, run
from linearize.train import loop as loop_module
run_module = importlib.import_module("linearize.train.run")  # (the package's `run` is the function)

torch.set_num_threads(1)


def main() -> None:
    settings = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    if os.environ.get("SEED_BY_RANK"):
        settings["seed"] = rank
    kill_at = int(os.environ.get("KILL_RANK1_AT", "0"))
    if kill_at and rank == 1:
        real, calls = loop_module.batch_indices, [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        loop_module.batch_indices = dying
    nan_at = int(os.environ.get("NAN_RANK1_AT", "0"))
    if nan_at and rank == 1:
        run_module.transfer_loss = nan_at_call(run_module.transfer_loss, nan_at)
    run(TrainConfig(**settings), resume="--resume" in sys.argv)


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
