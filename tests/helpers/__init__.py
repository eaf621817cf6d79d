"""Code several test modules share: starting cores and frontends, checkpoints, prompts, kernel inputs.

Test modules import from here (`from helpers.daemon import start_core`: pytest puts tests/ on the path),
never from one another (tests/test_imports.py checks it)."""
