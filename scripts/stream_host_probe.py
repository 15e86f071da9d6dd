"""What the host pays for each piece of a fork to a second CUDA stream and back, per call, with the
GPU held busy (so that nothing waits for it): events made and recorded, a stream waiting for an
event, the current stream switched, ``wait_stream``, ``record_stream`` on a tensor then freed, and a
small tensor allocated on either stream. Medians of ``--rounds`` rounds of ``--calls`` calls (of at
most 500 for a piece that launches a kernel: past about a thousand launches queued behind the busy
GPU, a launch waits for the queue, and the time is the GPU's; a run with 2000 read 509 us a launch).

    python scripts/stream_host_probe.py --out OUT [--calls 2000] [--rounds 5]

Writes OUT/stream-host-probe.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from probe_common import write_rows


def _us_per_call(fn, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # (about a second at 2 GHz: longer than the queueing below)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


LAUNCHES = ("x.add_(1) (one torch kernel)",)


def pieces() -> dict:
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    x = torch.zeros(1024, device="cuda")

    def switch():
        torch.cuda.set_stream(side)
        torch.cuda.set_stream(main)

    def context():
        with torch.cuda.stream(side):
            pass

    def alloc_side_recorded():
        torch.cuda.set_stream(side)
        t = torch.empty(64, device="cuda")
        torch.cuda.set_stream(main)
        t.record_stream(main)
        del t

    def alloc_side():
        torch.cuda.set_stream(side)
        t = torch.empty(64, device="cuda")
        torch.cuda.set_stream(main)
        del t

    return {
        "nothing (the loop)": lambda: None,
        "torch.cuda.Event() then record()": lambda: torch.cuda.Event().record(),
        "a kept event's record()": lambda: ev.record(),
        "side.wait_event(kept event)": lambda: side.wait_event(ev),
        "set_stream(side), set_stream(main)": switch,
        "with torch.cuda.stream(side)": context,
        "main.wait_stream(side)": lambda: main.wait_stream(side),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "empty(64) on main, freed": lambda: torch.empty(64, device="cuda"),
        "empty(64) on side, freed": alloc_side,
        "empty(64) on side, record_stream(main), freed": alloc_side_recorded,
        "x.add_(1) (one torch kernel)": lambda: x.add_(1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    rows = []
    for name, fn in pieces().items():
        fn()
        calls = min(a.calls, 500) if name in LAUNCHES else a.calls
        us = [_us_per_call(fn, calls) for _ in range(a.rounds)]
        rows.append({"piece": name, "calls": calls, "us_per_call": statistics.median(us), "us": us})
        print(json.dumps(rows[-1]), flush=True)
    write_rows(a.out, "stream-host-probe.json", "scripts/stream_host_probe.py", rows)


if __name__ == "__main__":
    main()
