"""Reading an llmserve-core command line from the tools that start cores (the HTTP frontend, the bench),
without importing the core: what the core's parser will see."""
from __future__ import annotations


def flag_value(flags: list[str], *names: str) -> str | None:
    """The value of the last `--name VALUE` or `--name=VALUE` among flags, else None."""
    found = None
    for i, flag in enumerate(flags):
        for name in names:
            if flag == name and i + 1 < len(flags):
                found = flags[i + 1]
            elif flag.startswith(name + "="):
                found = flag.split("=", 1)[1]
    return found
