"""Shared pieces of the GPU backends: when the kernels run (``dispatch``), device queries,
stream helpers and the interpreter patch. The ops' public functions ask ``dispatch``; nothing
here imports Triton at import time.

``LINEARIZE_KERNELS=0`` forces the torch path everywhere (``kernels_switched`` sets it for a block).
The kernels' user settings (``settings``): ``KernelSettings``, set for a block by ``kernel_settings``.
"""

from .dispatch import ENV_SWITCH, kernels_enabled, kernels_switched, on_kernel_device
from .settings import KernelSettings, current_settings, kernel_settings

__all__ = ["ENV_SWITCH", "KernelSettings", "current_settings", "kernel_settings", "kernels_enabled",
           "kernels_switched", "on_kernel_device"]
