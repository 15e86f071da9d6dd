"""What every benchmark shares: waiting for the device, telling an out-of-memory error, freeing memory."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def cleanup(device: torch.device) -> None:
    """Free what a finished (or failed) cell left: Python garbage, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
