"""Checks of scalar arguments: one place, so every op words its errors alike."""
from __future__ import annotations

import operator

import numpy as np


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``; bools and floats are refused."""
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}: expected an int, got bool")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{name}: expected an int, got {type(value).__name__} "
                            f"{value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value}")
    return value


def check_window_start(N, M: int, note: str = "") -> int:
    """``N`` (a request's compressed rows, where its window rows start) as an
    int in ``[0, M]``, ``M`` its workspace rows; ``note`` ends the message."""
    N = check_int("N", N, minimum=0)
    if N > M:
        raise ValueError(f"N: expected at most M ({M}), a request's workspace rows, got {N}"
                         + (f" ({note})" if note else ""))
    return N


def check_choice(name: str, value, choices: tuple):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value
