"""dsv4_cupy inside vLLM: a ``vllm.general_plugins`` entry point.

With ``DSV4_CUPY_VLLM=1`` in the environment, ``register()`` makes vLLM's
DeepSeek-V4 FlashMLA backend build its C128A/C4A metadata with
``dsv4_cupy.DeepseekV4MetadataBuilder`` (one launch per group and step, no
JIT while serving). It patches nothing unless the vLLM version is one it is
tested on and the platform one the library serves (CUDA sm_90/sm_100, or
vLLM's CPU port through the numba path), and logs what it did. vLLM loads
plugins in every process, sometimes twice: registering again changes nothing.

The core library never imports vLLM; this subpackage imports it only inside
``register()``.
"""
from __future__ import annotations

import importlib
import logging
import os

#: The environment variable that turns the plugin on (``"1"``).
ENABLE_VARIABLE = "DSV4_CUPY_VLLM"
#: The environment variable that, at ``"0"``, leaves the runner's per-step
#: build alone (no one-launch step: each group builds on its own).
STEP_VARIABLE = "DSV4_CUPY_VLLM_STEP"
#: vLLM releases the plugin is tested on (major.minor).
TESTED_VERSIONS = ("0.34",)
#: CUDA compute-capability majors the library's kernels serve.
SERVED_MAJORS = (9, 10)
#: The submodules whose ``install()`` patches vLLM: its builders, its per-layer ops, the
#: runner's per-step build (the one-launch step).
INSTALLED_PARTS = ("builders", "ops", "step")

logger = logging.getLogger("vllm.dsv4_cupy")
_patched: dict = {}


def register() -> None:
    """Patch vLLM 0.34's DeepSeek-V4 builders with the library's (idempotent)."""
    if os.environ.get(ENABLE_VARIABLE) != "1" or _patched:
        return
    import vllm
    version = ".".join(vllm.__version__.split(".")[:2])
    if version not in TESTED_VERSIONS:
        logger.warning("dsv4_cupy: vLLM %s is not a tested version (%s); nothing patched",
                       vllm.__version__, ", ".join(TESTED_VERSIONS))
        return
    refusal = platform_refusal()
    if refusal:
        logger.warning("dsv4_cupy: %s; nothing patched", refusal)
        return
    for part in INSTALLED_PARTS:
        if part == "step" and os.environ.get(STEP_VARIABLE) == "0":
            logger.info("dsv4_cupy: %s=0: no one-launch step", STEP_VARIABLE)
            continue
        _patched.update(importlib.import_module(f"{__name__}.{part}").install())
    for target, replacement in _patched.items():
        logger.info("dsv4_cupy: %s -> %s", target, replacement)


def platform_refusal() -> str | None:
    """Why the current platform is not served, or None."""
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        return None
    if not current_platform.is_cuda():
        return f"platform {type(current_platform).__name__} is not served (CUDA sm_90/sm_100 or CPU)"
    capability = current_platform.get_device_capability()
    if capability is None or capability.major not in SERVED_MAJORS:
        return f"compute capability {capability} is not served (sm_90, sm_100)"
    return None


def patched() -> dict:
    """What ``register()`` patched: target -> replacement (empty when inactive)."""
    return dict(_patched)
