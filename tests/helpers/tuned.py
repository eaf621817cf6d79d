"""A card the tests make up, with tuned tables of their own: kernels/tuned.py reads the tables from a
temporary folder, written by its own writer, and every device answers as that card.

    from helpers.tuned import fake_card  # noqa: F401  (the fixture)

    def test_x(fake_card):
        card = fake_card({"fp8_gemv": [({"N": 64, ...}, {"kernel": "stream"})]})
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from llmserve_core.kernels import tuned

CARD = "TEST_CARD"


@pytest.fixture
def fake_card(monkeypatch, tmp_path):
    """make(tables=None, capability=(9, 0)) -> the Device every device now is: this machine's (its
    multiprocessors and shared memory: the CPU's stand-in off CUDA), named `CARD`, with this compute
    capability (9, 0: FP8 products) and only `tables` ({kernel: [(shape, config), ...]}) tuned. Each call
    starts from empty tables."""
    folder = tmp_path / "kernel-configs"
    monkeypatch.setattr(tuned, "CONFIG_DIR", folder)
    here = tuned.device_spec(torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def make(tables: dict | None = None, capability: tuple[int, int] = (9, 0)) -> tuned.Device:
        shutil.rmtree(folder, ignore_errors=True)
        card = dataclasses.replace(here, name=CARD, capability=capability)
        monkeypatch.setattr(tuned, "device_spec", lambda device: card)
        for kernel, entries in (tables or {}).items():
            tuned.write_configs(kernel, CARD, entries, "tests")
        tuned.clear_cache()
        return card

    yield make
    tuned.clear_cache()
