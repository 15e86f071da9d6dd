"""Where the warps of a kernel wait, from ``benchmarks/probes/ncu_lizard.sh``'s per-instruction table
(NAME-source.csv.gz: ncu's source page, SASS, with warp stall samples).

    python benchmarks/probes/ncu_stalls.py OUT/NAME-source.csv.gz [--kernel _gla_bwd_fused_kernel] [--top 20]

(A recorded table of an H100 run of tree 331351f: ``git show
0d8611a:docs/results/ncu-lizard-step-h100-331351f-source.csv.gz > step-source.csv.gz``.)

For each kernel: its stall reasons over all samples; the samples of each warp-specialised
partition (told apart by the named barrier its warps synchronise on: ``bar.sync 0`` for the default
partition, 1 for the kernel's own joins, 2 for the first worker); every mbarrier wait (the retry
branch after ``SYNCS.PHASECHK``) holding more than 0.5% of the samples, with its barrier's shared
address; and the ``--top`` instructions by samples, each with its main stall reason.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path: str) -> dict[str, list[dict]]:
    """kernel name -> its rows (one per SASS instruction), from ncu's source page as CSV."""
    kernels: dict[str, list[dict]] = {}
    name, header = None, None
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name, header = row[1], None
                kernels[name] = []
            elif row[0] == "Address":
                header = row
            elif header and name:
                kernels[name].append(dict(zip(header, row)))
    return kernels


def report(name: str, rows: list[dict], top: int) -> None:
    n = lambda r: int(r.get(SAMPLES) or 0)  # noqa: E731
    total = sum(n(r) for r in rows) or 1
    base = int(rows[0]["Address"], 16)
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    by_reason = collections.Counter()
    part, by_part, waits, barrier = "prologue", collections.Counter(), [], None
    for r in rows:
        src = r["Source"]
        if "BAR.SYNC" in src:
            part = {"0x0": "default partition", "0x2": "worker partition"}.get(src.split()[-2].rstrip(","), part)
        by_part[part] += n(r)
        for c in reasons:
            by_reason[c] += int(r[c] or 0)
        if "SYNCS.PHASECHK" in src:
            barrier = src.split("[")[1].split("]")[0]
        elif "BRA" in src and n(r) > 0.005 * total:
            waits.append((n(r), hex(int(r["Address"], 16) - base), part, barrier))
    print(f"{name}: {len(rows)} instructions, {total} samples")
    print("  reasons: " + ", ".join(f"{c[6:]} {v / total:.1%}" for c, v in by_reason.most_common(10)))
    print("  partitions: " + ", ".join(f"{p} {v / total:.1%}" for p, v in by_part.items()))
    for s, addr, p, bar in waits:
        print(f"  mbarrier wait at {addr} ({p}, barrier [{bar}]): {s / total:.1%}")
    for r in sorted(rows, key=lambda r: -n(r))[:top]:
        main = max(reasons, key=lambda c: int(r[c] or 0))
        print(f"  {n(r) / total:5.1%} {hex(int(r['Address'], 16) - base):>8} {r['Source'].strip()[:64]:64s} "
              f"{main[6:]} {int(r[main] or 0) / max(n(r), 1):.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--kernel", default=None, help="one kernel's name (default: every kernel in the file)")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    kernels = load(a.path)
    if a.kernel is not None and a.kernel not in kernels:
        raise SystemExit(f"no kernel {a.kernel!r} in {a.path}; it holds {sorted(kernels)}")
    for name, rows in kernels.items():
        if a.kernel in (None, name):
            report(name, rows, a.top)


if __name__ == "__main__":
    main()
