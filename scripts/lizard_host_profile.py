"""Where Lizard's attention spends its CPU time (Python profile of the host code), per call.

    python scripts/lizard_host_profile.py --out OUT [--shape 16x2048] [--calls 20] [--top 40] [--config ...]

The GPU is held busy (``torch.cuda._sleep``) while ``--calls`` calls are queued under cProfile,
so the profile holds host work only, not waits. Calls: the op in inference (no_grad) and its
training step (forward with autograd and backward), bench inputs. Writes OUT/lizard-host-profile.txt
(the functions by own time and by cumulative time, per call).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats

import torch

from lizard_launch_overhead import config_args, lizard_calls
from probe_common import host_probe_parser, parse_shape


def main() -> None:
    p = host_probe_parser(calls=20, rounds=None)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--config", action="append", default=[],
                   help="NAME=FIELD=VALUE[;...]: a training step under that LizardKernelConfig (repeatable)")
    a = p.parse_args()
    os.environ["LINEARIZE_KERNELS"] = "1"
    B, T = parse_shape(a.shape)
    calls = lizard_calls(B, T, config_args(a.config))
    report = io.StringIO()
    for name in [n for n in calls if n.startswith("op")]:
        fn = calls[name]
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        for key in ("tottime", "cumulative"):
            report.write(f"==== {name}, B{B} T{T}, {a.calls} calls, by {key} (seconds for all calls)\n")
            pstats.Stats(prof, stream=report).sort_stats(key).print_stats(a.top)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "lizard-host-profile.txt"), "w") as f:
        f.write(f"{torch.cuda.get_device_name()}\n" + report.getvalue())
    print(report.getvalue()[-20000:])


if __name__ == "__main__":
    main()
