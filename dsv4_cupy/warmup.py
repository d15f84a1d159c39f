"""``warmup()``: prepare every kernel and signature the API accepts, before serving."""
from __future__ import annotations

import sys

from . import device, families, loader, prefill_plan, split


def warmup(*, gpu: bool | None = None, cpu: bool | None = None,
           progress: bool | None = None) -> dict:
    """Compile and load every kernel before serving, so no call compiles.

    ``gpu`` (default: when a GPU is usable) compiles and loads every CUDA entry
    point for the current device; ``cpu`` (default: when no GPU is usable)
    compiles the numba CPU kernels for every signature the API accepts. The
    host planners' numba functions (a step with prefills, on either path)
    are always compiled. The first warm-up of a machine compiles (tens of
    seconds: about 40 s for the CPU kernels on 2 cores); later ones read
    CuPy's and numba's disk caches. ``progress``
    (default: when stderr is a terminal) counts the kernels on stderr as
    they are prepared. Returns what was prepared: ``{"gpu": [...], "cpu":
    [...], "host": [...]}``.
    """
    if gpu is None:
        gpu = device.has_gpu()
    if cpu is None:
        cpu = not gpu
    show = _Progress(sys.stderr.isatty() if progress is None else bool(progress))
    show("host planners")
    done: dict = {"gpu": [], "cpu": [],
                  "host": split.warm_split() + prefill_plan.warm_planners()}
    if gpu:
        device.require_gpu()
        entries = [(family, entry) for family in families.ALL for entry in family.entry_points()]
        for family, entry in entries:
            show(f"GPU kernels {len(done['gpu']) + 1}/{len(entries)} ({family.file})")
            loader.get(family, entry)
            done["gpu"].append(f"{family.file}:{entry}")
    if cpu:
        from .cpu_warm import warm_cpu
        done["cpu"] = warm_cpu(lambda count, name: show(f"CPU kernels {count} ({name})"))
    show.close(f"warmed {summary(done)}")
    return done


def summary(done: dict) -> str:
    """What ``warmup()`` prepared, counted."""
    return (f"{len(done['gpu'])} GPU and {len(done['cpu'])} CPU kernels, "
            f"{len(done['host'])} host planners")


class _Progress:
    """One line on stderr, rewritten in place (nothing when off)."""

    def __init__(self, enabled: bool):
        self.enabled, self.width = enabled, 0

    def __call__(self, text: str) -> None:
        if self.enabled:
            line = f"\rwarmup: {text}"
            sys.stderr.write(line.ljust(self.width))
            sys.stderr.flush()
            self.width = len(line)

    def close(self, text: str) -> None:
        if self.enabled:
            self(text)
            sys.stderr.write("\n")
