"""Write the stored reference of a bundled student: its fp32 CPU logits on a few fixed prompts.

    PYTHONPATH=src python benchmarks/make_student_reference.py src/linearize/students/smollm2-135m-lizard

writes reference.safetensors (per prompt: the input ids, the top-16 logits and their token ids at
every position, every logit at the last position) and reference.json (the prompts, the adapter's
SHA-256, the torch and transformers versions) into the folder; tests/models/test_students.py loads the
student by name and compares. Run it again whenever the folder's weights change.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the student's checkpoint folder (linearize.json + adapter.safetensors)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the base is a bundled teacher: nothing to fetch
    from linearize.models.students import REFERENCE_FILE, REFERENCE_META, write_reference

    folder = write_reference(args.folder)
    size = (folder / REFERENCE_FILE).stat().st_size
    print(f"wrote {folder / REFERENCE_FILE} ({size / 1024:.0f} KiB) and {folder / REFERENCE_META}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
