"""Ctrl-C (or SIGTERM, as `timeout` and `kill` send) always ends the bench, and the core it started, within a
bounded time.

SIGTERM is taken as a SIGINT: without a handler it would end the process without unwinding, leaving the
core it started running. The first SIGINT raises KeyboardInterrupt as usual, so the run unwinds, prints
what it must and stops its core. That unwinding runs asyncio's cancellation of every task, which hangs for good if one task swallows
its cancellation (asyncio.wait_for in Python 3.11 can, when its future completes as it is cancelled) or an
executor thread never returns. So the first SIGINT also arms a watchdog: if the process is still alive
`grace_s` later, it stops the core and exits 130. A second SIGINT does that at once. Once armed the watchdog
stays armed after the `with` block too: the process is ending, and interpreter shutdown (which joins worker
threads) is bounded by it as well.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

EXIT_INTERRUPTED = 130


@contextmanager
def bounded_interrupt(stop_core: Callable[[], None], grace_s: float = 15.0):
    """While inside, SIGINT and SIGTERM are handled as described above; `stop_core` must be safe to call
    twice."""
    fired = threading.Event()

    def force_exit() -> None:
        print("\nllmserve-bench: interrupted (cleanup did not finish; stopping the core and exiting)",
              file=sys.stderr, flush=True)
        try:
            stop_core()
        finally:
            os._exit(EXIT_INTERRUPTED)

    def watchdog() -> None:
        # A process that unwinds in time exits before this wakes (the thread is a daemon).
        time.sleep(grace_s)
        force_exit()

    def on_sigint(signum, frame):
        if fired.is_set():
            force_exit()
        fired.set()
        threading.Thread(target=watchdog, name="llmserve-bench-interrupt", daemon=True).start()
        signal.default_int_handler(signum, frame)        # raises KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, on_sigint) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:                                   # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
