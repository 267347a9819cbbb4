"""The one progress bar of the tools (demo, bench, the benchmark scripts): dependency-free, and redrawn in
place only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[#####.....]  50%  500/1000  loss 0.123  12.3s``, redrawn in place on a terminal only.

    The bar is drawn on ``file`` (default ``sys.stderr``); ``enabled=False`` draws nothing. When that stream is a terminal the line is
    redrawn in place at most 10 times a second; otherwise (a CI log, a pipe, a test) it is written as
    plain lines, one at each quarter of the way and the final one by :meth:`close`, with no carriage
    returns. Use as a context manager::

        with Progress(1000, "train") as bar:
            for step in range(1000):
                bar.update(1, loss=f"{loss:.3f}")
    """

    def __init__(
        self, total: int, desc: str, *, file: TextIO | None = None, width: int = 28, enabled: bool = True
    ) -> None:
        self.total, self.desc, self.width, self.enabled = max(1, int(total)), desc, width, enabled
        self.file = sys.stderr if file is None else file
        self.tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.done, self.start, self.last = 0, time.perf_counter(), 0.0
        self.info: dict[str, object] = {}
        self.quarter = 0  # quarters already written as plain lines (not a terminal)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """The bar as text."""
        frac = min(1.0, self.done / self.total)
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        secs = time.perf_counter() - self.start
        info = "  ".join(f"{k} {v}" for k, v in self.info.items())
        return f"{self.desc:<10} [{bar}] {frac:4.0%} {self.done}/{self.total} {info} {secs:.1f}s"

    def update(self, n: int = 1, **info: object) -> None:
        """Advance by ``n`` (0: only show) and show ``info`` (``key value`` pairs, each kept until replaced)."""
        self.done += n
        self.info.update(info)
        if not self.enabled:
            return
        if self.tty:
            now = time.perf_counter()
            if now - self.last > 0.1 or self.done >= self.total:
                self.last = now
                self.file.write("\r" + self.line())
                self.file.flush()
        elif self.done < self.total and 4 * self.done // self.total > self.quarter:
            self.quarter = 4 * self.done // self.total
            self.file.write(self.line() + "\n")
            self.file.flush()

    def close(self) -> None:
        """Write the final line and a newline."""
        if not self.enabled:
            return
        self.file.write(("\r" if self.tty else "") + self.line() + "\n")
        self.file.flush()
