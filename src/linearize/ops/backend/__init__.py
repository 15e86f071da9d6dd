"""Shared pieces of the GPU backends: when the kernels run (``dispatch``), device queries,
stream helpers and the interpreter patch. The ops' public functions ask ``dispatch``; nothing
here imports Triton at import time.

``LINEARIZE_KERNELS=0`` forces the torch path everywhere (``kernels_switched`` sets it for a block).
"""

from .dispatch import ENV_SWITCH, kernels_enabled, kernels_switched, on_kernel_device

__all__ = ["ENV_SWITCH", "kernels_enabled", "kernels_switched", "on_kernel_device"]
