"""One rank of a training run for test_distributed.py, launched by torchrun:

    torchrun --standalone --nproc-per-node 2 distributed_worker.py '<TrainConfig JSON>' [--resume]

The same config from Python as ``linearize train`` gives from the command line, with two ways to
break it: ``SEED_BY_RANK=1`` gives each rank its own seed (ranks with different settings), and
``KILL_RANK1_AT=n`` makes rank 1 SIGKILL itself when it asks for its n-th micro-batch.
"""

import json
import os
import signal
import sys

import torch

from linearize.train import TrainConfig, run
from linearize.train import loop as loop_module

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
    run(TrainConfig(**settings), resume="--resume" in sys.argv)


if __name__ == "__main__":
    main()
