"""A one-line progress display on stderr for the long data commands (tokenizer training,
store preparation): rewritten in place on a terminal, a line every few seconds in logs."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, enabled: bool = True, stream=None):
        self.label, self.enabled = label, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.interval = 0.5 if self.tty else 5.0

    def update(self, text: str, force: bool = False) -> None:
        """Show `text` if enough time passed since the last display (or when forced)."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.interval):
            return
        self.last = now
        line = f"{self.label}: {text} [{now - self.start:.1f}s]"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"{self.label}: {text} in {time.monotonic() - self.start:.1f}s"
        self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.stream.flush()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def rate(count: float, seconds: float) -> str:
    """Human rate such as '2.81M' (per second)."""
    per_s = count / max(seconds, 1e-9)
    return f"{per_s / 1e6:.2f}M" if per_s >= 1e5 else f"{per_s / 1e3:.1f}k"
