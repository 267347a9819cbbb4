"""Argument checks shared by every layer: one definition of "an int", "a positive int", "a probability".

Each caller keeps its own error message (it knows the argument's meaning and the fix); these helpers
only decide. ``bool`` is never an int here, although Python's ``bool`` subclasses ``int``.
"""

from __future__ import annotations

import math

__all__ = ["check_dropout", "check_scale", "check_softcap", "is_int", "positive_int"]


def is_int(value: object, minimum: int | None = None) -> bool:
    """``value`` is an ``int`` (not a ``bool``), and at least ``minimum`` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return minimum is None or value >= minimum


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1, else ``ValueError`` naming ``name``."""
    if not is_int(value, 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_dropout(dropout: float, name: str = "dropout") -> float:
    """A dropout probability in [0, 1)."""
    if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {dropout!r}")
    return float(dropout)


def check_scale(scale: float | None, dk: int) -> float:
    """The score scale: ``scale`` if a finite number, ``1/sqrt(dk)`` if None."""
    if scale is None:
        return 1.0 / math.sqrt(dk)
    if not _is_number(scale) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (= 1/sqrt(Dk)), got {scale!r}")
    return float(scale)


def check_softcap(softcap: float | None) -> float | None:
    """A logit soft cap: ``None`` (off) or a finite number > 0."""
    if softcap is None:
        return None
    if not _is_number(softcap) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(
            f"softcap must be a finite number > 0 (scores -> softcap * tanh(scores / softcap), e.g. 50.0 "
            f"as Gemma 2) or None, got {softcap!r}"
        )
    return float(softcap)
