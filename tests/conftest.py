"""Shared fixtures: real Hugging Face Qwen3 directories with seeded random weights and a trained tokenizer."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from llmserve_core.models.tiny import make_tiny_model

# On the CPU, one intra-op thread, here and (through the environment) in every core, frontend and rank the
# tests start: the tiny models' matmuls gain nothing from more, and on a busy 2-core machine a test process
# and a core each spinning two OpenMP threads run several times slower than with one each. A CUDA host's
# runs are left as they were.
if not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The default tiny model (seed 0): 2 layers, hidden 64, 4 heads / 2 kv heads, tied embeddings."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def make_random_qwen3_dir(tmp_path_factory):
    """Factory: make_random_qwen3_dir(seed=0, **Qwen3Config overrides) -> path of a fresh model dir.

    Session-scoped so module-scoped fixtures can use it; identical requests share one directory, so
    treat it as read-only (copy it first to break it on purpose).
    """
    made: dict[str, str] = {}
    counter = itertools.count()

    def make(seed: int = 0, **overrides) -> str:
        key = repr((seed, sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"qwen3-{next(counter)}"), seed=seed, **overrides)
        return made[key]

    return make
