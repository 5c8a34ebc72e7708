"""Progress on stderr while a large trace is read, so a multi-GB export does not look hung.

On a terminal one line is rewritten in place; in a log (not a TTY) a line is printed at every
quarter. Updates are rate-limited: the readers call it for every batch of rows.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "LARGE_BYTES"]

LARGE_BYTES = 32 << 20  # inputs at least this large show progress unless told otherwise


class Progress:
    def __init__(self, label: str, *, enabled: bool = True, stream: TextIO | None = None,
                 min_interval: float = 0.25) -> None:
        self.label, self.enabled = label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self._last, self._quarter, self._shown = 0.0, -1, False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        frac = min(max(done / total, 0.0), 1.0)
        tty = getattr(self.stream, "isatty", lambda: False)()
        if tty:
            now = time.monotonic()
            if now - self._last < self.min_interval and frac < 1.0:
                return
            self._last = now
            self.stream.write(f"\r{self.label}: {100 * frac:5.1f}%")
            self._shown = True
        else:
            quarter = int(frac * 4)
            if quarter > self._quarter:
                self._quarter = quarter
                self.stream.write(f"{self.label}: {100 * frac:.0f}%\n")
        self.stream.flush()

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
