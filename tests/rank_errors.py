"""What each rank's bad calls raised, recorded for the test to assert on (the ranks return it)."""

from __future__ import annotations

from collections.abc import Callable


class Caught(dict):
    """{call name: None if it returned, else (exception type name, message)}."""

    def attempt(self, name: str, fn: Callable[[], object]) -> None:
        """Run ``fn`` and record what it raised under ``name`` (None: it did not raise)."""
        try:
            fn()
            self[name] = None
        except Exception as exc:  # noqa: BLE001 -- recorded and asserted by the test
            self[name] = (type(exc).__name__, str(exc))
