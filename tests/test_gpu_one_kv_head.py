"""The shape that once killed the engine on an H100 (issue 62): Qwen3 with hidden 256, 2 layers, 4 query heads
and ONE KV head, head_dim 128, tied embeddings, a 512-token vocabulary (smaller than many tiles), everything
else transformers' defaults (max_position_embeddings 32,768); a 64-token budget, so five of six prompts (1,
7, 31, 64, 129, 300 tokens) are chunked or share steps with decodes; 16 greedy tokens each, in one generate
call, on the engine's defaults otherwise (async scheduling, the memory-sized KV pool, and for the default
backend with graphs, the crashing configuration, the warm-up, which the others skip to keep the suite short). Every backend, eager and with CUDA graphs,
float32 token-exact against transformers and bfloat16 against the torch backend given the same tokens
(benchmarks/gpu_fuzz.py's checks).

Last, the fault itself made certain: with every forward slowed on the device, long prompts chunked over many
steps that sample nothing still come out as transformers' (the staging arena is never refilled ahead of its copy).

LLMSERVE_KV1_OVERRIDES (JSON of EngineConfig fields, e.g. {"async_scheduling": false}) changes the engine, so that
benchmarks/gpu_checks.sh can tell which part of the default path a failure needs.
"""
from __future__ import annotations

import functools
import json
import os
import random
import sys

import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.layers.attention import BACKENDS, get_backend
from llmserve_proto import SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from gpu_fuzz import against_torch_backend, against_transformers, torch_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
             head_dim=128, tie_word_embeddings=True)
PROMPT_LENS = (1, 7, 31, 64, 129, 300)
NEW_TOKENS = 16


def backends() -> list[str]:
    names = []
    for name in BACKENDS:
        try:
            if name != "auto":
                get_backend(name, "cuda")
                names.append(name)
        except ImportError:
            pass
    return names


def cases():
    for dtype in ("float32", "bfloat16"):
        for backend in backends():
            for graphs in (False, True):
                if backend == "torch" and graphs:
                    continue            # the torch backend never captures graphs
                yield pytest.param(dtype, backend, graphs, id=f"{dtype}-{backend}-{'graphs' if graphs else 'eager'}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from llmserve_core.models.tiny import train_tokenizer, write_random_qwen3, write_tokenizer
    path = tmp_path_factory.mktemp("one-kv-head")
    write_random_qwen3(path, seed=0, **SHAPE)
    write_tokenizer(train_tokenizer(), path)       # make_tiny_model refuses a vocabulary under the tokenizer's
    return str(path)


def prompts() -> list[list[int]]:
    r = random.Random(62)
    return [[r.randrange(SHAPE["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def bf16_reference(model_dir: str):
    return torch_reference(model_dir, "cuda", "bfloat16", prompts(), [NEW_TOKENS] * len(PROMPT_LENS))


@pytest.mark.parametrize("dtype,backend,graphs", list(cases()))
def test_one_kv_head_shape(model_dir, dtype, backend, graphs):
    if backend == "flash-attn" and dtype == "float32":
        pytest.skip("FlashAttention-4 has no float32 kernels (triton-fa4 keeps float32 on Triton)")
    default = get_backend("auto", "cuda").name == backend
    config = dict(model=model_dir, device="cuda", dtype=dtype, attention_backend=backend, enforce_eager=not graphs,
                  enable_chunked_prefill=True, max_num_batched_tokens=64, warmup=None if default and graphs else False)
    engine = Engine(EngineConfig(**{**config, **json.loads(os.environ.get("LLMSERVE_KV1_OVERRIDES", "{}"))}))
    assert (engine.runner.graphs is not None) == (not engine.config.enforce_eager and backend != "torch")
    ps = prompts()
    out = engine.generate(ps, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [NEW_TOKENS] * len(ps)
    assert engine.stats()["used_kv_blocks"] == 0
    del engine
    torch.cuda.empty_cache()
    if dtype == "float32":
        result = against_transformers(model_dir, ps, [NEW_TOKENS] * len(ps), [out])
    else:
        result = against_torch_backend(bf16_reference(model_dir), dtype, ps, [out])
    assert result["ok"], result["why"]


def test_a_device_far_behind_the_host_keeps_every_chunk_intact(model_dir):
    """What the shape's 64-token budget exposed: a prompt chunked over many steps samples nothing until its
    last chunk, so the engine never waits for those steps, and where the device falls behind (long contexts,
    float32 attention) the host used to refill a staging arena whose copy to the device had not run yet: the
    chunk then read another step's ids, positions, slots and block tables (out-of-range ids: a device-side
    assert in the embedding). Here every forward is made slow on the device, so the host runs far ahead; the
    output must still be transformers'."""
    engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                                 max_num_batched_tokens=64, warmup=False, num_kv_blocks=160, max_num_seqs=4))
    model = engine.runner.model
    forward = model.forward

    def slow_forward(*args, **kwargs):
        torch.cuda._sleep(20_000_000)            # about 10 ms of device time before each forward
        return forward(*args, **kwargs)
    model.forward = slow_forward
    r = random.Random(7)
    long_prompts = [[r.randrange(SHAPE["vocab_size"]) for _ in range(n)] for n in (1200, 700)]
    out = engine.generate(long_prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    del engine
    torch.cuda.empty_cache()
    result = against_transformers(model_dir, long_prompts, [4, 4], [out])
    assert result["ok"], result["why"]
