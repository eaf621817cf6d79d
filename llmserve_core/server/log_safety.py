"""Client-supplied text made safe to log, and a per-client rate limit on repeated error lines.

A client name or request id with a newline would forge log lines, a 50 MB one would write a 50 MB line,
and a flood of bad frames would fill the disk. Everything a client sent passes through `printable`
before it reaches the log, and warnings about one client's bad input pass through `LogLimiter`.
"""
from __future__ import annotations

import re
import time

MAX_LOGGED_CHARS = 120

# C0/C1 controls, DEL, and the invisible or direction-changing characters that let text pose as other text.
_UNSAFE = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match) -> str:
    c = m.group()
    if c == "\\":
        return "\\\\"
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def printable(value, limit: int = MAX_LOGGED_CHARS) -> str:
    """One log-safe line: control characters escaped, at most `limit` characters of the value kept."""
    s = value if isinstance(value, str) else repr(value)
    cut = len(s) - limit
    s = _UNSAFE.sub(_escape, s[:limit])
    return f"{s}...(+{cut} chars)" if cut > 0 else s


class LogLimiter:
    """At most `burst` lines per key per `window` seconds; the count of the rest is handed back with the
    first line allowed after the window, to be logged with it. Keys are client routing ids; old keys are forgotten so the table stays small."""

    def __init__(self, burst: int = 5, window: float = 10.0, max_keys: int = 4096, clock=time.monotonic):
        self.burst, self.window, self.max_keys, self.clock = burst, window, max_keys, clock
        self._state: dict[object, list] = {}     # key -> [window start, lines logged, lines suppressed]

    def allow(self, key) -> tuple[bool, int]:
        """(log this line?, lines suppressed in the window that just ended: say so when > 0)."""
        now = self.clock()
        st = self._state.get(key)
        suppressed = 0
        if st is None or now - st[0] >= self.window:
            suppressed = st[2] if st is not None else 0
            if st is None and len(self._state) >= self.max_keys:
                self._forget_old(now)
            st = self._state[key] = [now, 0, 0]
        if st[1] < self.burst:
            st[1] += 1
            return True, suppressed
        st[2] += 1
        return False, suppressed

    def _forget_old(self, now: float) -> None:
        for k in [k for k, st in self._state.items() if now - st[0] >= self.window]:
            del self._state[k]
        if len(self._state) >= self.max_keys:     # all recent: drop the oldest half
            for k in sorted(self._state, key=lambda k: self._state[k][0])[:len(self._state) // 2]:
                del self._state[k]
