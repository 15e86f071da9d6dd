"""Where the host time of one Gluon kernel launch goes: Lizard's fused forward (``lizard_fwd_fused``,
inference and training), cut into the steps Triton's launch path takes.

    python scripts/gluon_launch_probe.py --out OUT [--shape 16x2048] [--calls 50] [--rounds 5]

Pieces (CPU microseconds a call, medians of the rounds; launching pieces queued behind a GPU held
busy, as ``lizard_launch_overhead.cpu_us``): the whole wrapper; the kernel's ``[grid](...)`` call on
the wrapper's own arguments (Triton's whole launch path); Triton's binder alone (the arguments
specialised, no launch); the compiled kernel's launcher with the bound arguments (the tensor
descriptors expanded into CUDA tensor maps, then the launch); the descriptors' expansion alone;
the raw launch with the maps made beforehand; our own Python (the wrapper less the ``[grid]`` call);
one torch kernel for scale. Triton internals (3.6) are used by name: a probe, not product code.
Writes OUT/gluon-launch-probe.json.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from lizard_launch_overhead import NAMES, cpu_us
from linearize.bench.kernels import _shape_inputs
from linearize.ops.lizard_attn import gluon as lizard_gluon
from probe_common import host_probe_parser, parse_shape, write_rows


class _Recorder:
    """Stands in for a JIT kernel: records the grid, arguments and keywords of its launches, then launches."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = (grid, args, kwargs)
            return self.fn[grid](*args, **kwargs)
        return launch


def host_us(fn, calls: int) -> float:
    """Microseconds a call of fn, for pieces that launch nothing."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def pieces(x: dict, store: bool) -> dict:
    """name -> (callable, launches?) for the fused forward with or without ``store``."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    from triton.runtime import driver

    args = [x[n] for n in NAMES[:7]]
    kw = dict(window=128, scale=128 ** -0.5, eps=1e-6, store=store)

    def whole():
        lizard_gluon.lizard_fwd_fused(*args, x["sinks"], **kw)

    real = lizard_gluon._lizard_fwd_kernel
    rec = _Recorder(real)
    lizard_gluon._lizard_fwd_kernel = rec
    try:
        whole()
    finally:
        lizard_gluon._lizard_fwd_kernel = real
    grid, kargs, kkw = rec.last
    dev = torch.cuda.current_device()
    stream = driver.active.get_current_stream(dev)
    binder = real.device_caches[dev][4]
    bound, _, _ = binder(*kargs, **kkw, debug=False, instrumentation_mode="")
    kernel = real.run(*kargs, grid=grid, warmup=True, **kkw)
    launcher = kernel.run
    vals = list(bound.values())
    meta = getattr(kernel.metadata, "tensordesc_meta", None) or []
    desc_at = [i for i, v in enumerate(vals) if type(v).__name__ == "TensorDescriptor"]

    def expand():
        return [make_tensordesc_arg(vals[i], meta[j] if meta else None) for j, i in enumerate(desc_at)]

    expanded = []
    j = 0
    for i, v in enumerate(vals):
        if i in desc_at:
            expanded.extend(make_tensordesc_arg(v, meta[j] if meta else None))
            j += 1
        else:
            expanded.append(v)
    raw = launcher.launch.__closure__[0].cell_contents if launcher.launch.__closure__ else launcher.launch
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)

    def launcher_call():
        launcher(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *vals)

    def raw_launch():
        raw(*g, stream, kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
            kernel.packed_metadata, None, None, None, *expanded)

    return {
        "whole wrapper": (whole, True),
        "kernel[grid](...) on the wrapper's arguments": (lambda: real[grid](*kargs, **kkw), True),
        "binder alone": (lambda: binder(*kargs, **kkw, debug=False, instrumentation_mode=""), False),
        "launch_metadata": (lambda: kernel.launch_metadata(grid, stream, *vals), False),
        "launcher (descriptors expanded, launch)": (launcher_call, True),
        f"descriptors expanded alone ({len(desc_at)})": (expand, False),
        "raw launch, maps made beforehand": (raw_launch, True),
    }


def main() -> None:
    a = host_probe_parser(calls=50).parse_args()
    B, T = parse_shape(a.shape)
    x = _shape_inputs(B, T, 32, 128, 128, 4, torch.bfloat16, torch.device("cuda"), 0)
    y = torch.zeros(1024, device="cuda")
    rows = []
    for store in (False, True):
        ps = pieces(x, store)
        ps["one torch kernel (add_)"] = (lambda: y.add_(1.0), True)
        for name, (fn, launches) in ps.items():
            try:
                ts = [(cpu_us if launches else host_us)(fn, a.calls) for _ in range(a.rounds)]
            except Exception as e:  # a piece the installed Triton does not have: say so, go on
                rows.append(dict(store=store, piece=name, error=f"{type(e).__name__}: {e}"))
                print(rows[-1], flush=True)
                continue
            rows.append(dict(B=B, T=T, store=store, piece=name, cpu_us_median=statistics.median(ts), cpu_us=ts))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.synchronize()
    write_rows(a.out, "gluon-launch-probe.json", "scripts/gluon_launch_probe.py", rows)


if __name__ == "__main__":
    main()
