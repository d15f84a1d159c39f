"""``warmup()``: prepare every kernel and signature the API accepts, before serving."""
from __future__ import annotations

from . import device, families, loader


def warmup(*, gpu: bool | None = None, cpu: bool | None = None) -> dict:
    """Compile and load every kernel before serving, so no call compiles.

    ``gpu`` (default: when a GPU is usable) compiles and loads every CUDA entry
    point for the current device; ``cpu`` (default: when no GPU is usable)
    compiles the numba CPU kernels for every signature the API accepts.
    Returns what was prepared: ``{"gpu": [...], "cpu": [...]}``.
    """
    if gpu is None:
        gpu = device.has_gpu()
    if cpu is None:
        cpu = not gpu
    done: dict = {"gpu": [], "cpu": []}
    if gpu:
        device.require_gpu()
        for family in families.ALL:
            for entry in family.entry_points():
                loader.get(family, entry)
                done["gpu"].append(f"{family.file}:{entry}")
    if cpu:
        from .cpu_warm import warm_cpu
        done["cpu"] = warm_cpu()
    return done
