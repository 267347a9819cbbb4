"""Optional dependencies: check an extra is installed before the work that needs it starts."""

from __future__ import annotations

import importlib

__all__ = ["MissingExtra", "require"]


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def require(extra: str, modules: tuple[str, ...], needed_for: str) -> None:
    """Import ``modules`` now, or raise :class:`MissingExtra` naming ``multihead[extra]``.

    Args:
        extra: the extra that installs them, e.g. ``"viz"``.
        modules: importable names, e.g. ``("matplotlib.figure",)``.
        needed_for: what needs them, for the message, e.g. ``"the demo's plots and HTML report"``.
    """
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name.split(".")[0])
    if missing:
        raise MissingExtra(
            f"{' and '.join(dict.fromkeys(missing))} not installed, needed for {needed_for}: "
            f"pip install 'multihead[{extra}]'"
        )
