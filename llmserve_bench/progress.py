"""A progress line on stderr: redrawn in place on a terminal, a plain line every few seconds otherwise."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None = None, label: str = "", enabled: bool = True, stream=None,
                 seconds: float | None = None):
        self.total = total              # requests to finish (finite run)
        self.seconds = seconds          # or a time span to fill (closed loop)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.done = 0
        self.tokens = 0
        self.note = ""

    def update(self, done: int | None = None, tokens: int | None = None, note: str | None = None) -> None:
        if done is not None:
            self.done = done
        if tokens is not None:
            self.tokens = tokens
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.enabled and now - self.last_draw >= (0.2 if self.tty else 5.0):
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        elapsed = now - self.start
        if self.total:
            frac = min(1.0, self.done / self.total)
            count = f"{self.done}/{self.total} req"
        elif self.seconds:
            frac = min(1.0, elapsed / self.seconds)
            count = f"{self.done} req"
        else:
            frac, count = 0.0, f"{self.done} req"
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        line = f"{self.label} [{bar}] {frac * 100:3.0f}% {count} {elapsed:6.1f}s {rate:8.1f} tok/s {self.note}"
        if self.tty:
            self.stream.write("\r\033[K" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic(), end="\n")
