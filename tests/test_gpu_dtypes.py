"""Every supported dtype x head size x attention backend runs on the GPU with CUDA graphs, and eagerly at
head_dim 128 (eager launches the same kernels outside the graphs), and decodes what the torch backend
decodes: token-exact in float32; in bf16 / fp16 the same tokens up to the first near-tie, and close logprobs
before it.

Prompts are long enough for full prefill tiles, chunked (a small token budget makes the long prompt an
extend over its own first chunks) and share a prefix (an extend over cached blocks), then decode; last,
one prompt decodes alone (batch-1 decode takes its own kernels on Hopper).
"""
from __future__ import annotations

import functools

import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.layers.attention import BACKENDS, get_backend
from llmserve_core.layers.attention.triton_fa4_backend import FA4_MAX_HEAD_DIM
from llmserve_proto import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = ("float32", "bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
NEW_TOKENS = 12
EAGER_HEAD_DIM = 128


def available_backends() -> list[str]:
    names = []
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            get_backend(name, "cuda")
        except ImportError:
            continue
        names.append(name)
    return names


def cases():
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for backend in available_backends():
                for eager in (True, False):
                    if backend == "torch" and not eager:
                        continue        # the torch backend never captures graphs: that is the reference run
                    if backend != "torch" and eager and head_dim != EAGER_HEAD_DIM:
                        continue        # eager runs the graphs' kernels: one head size tells eager from graphs
                    yield pytest.param(dtype, head_dim, backend, eager, id=f"{dtype}-hd{head_dim}-{backend}-"
                                                                          f"{'eager' if eager else 'graphs'}")


@pytest.fixture(scope="module")
def model_dirs(make_random_qwen3_dir):
    return {d: make_random_qwen3_dir(seed=d, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=d,
                                     tie_word_embeddings=False) for d in HEAD_DIMS}


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (160,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 37, 300)] + \
        [shared + [7, 8, 9], shared + [10, 11]]


def run(model_dir: str, dtype: str, backend: str, eager: bool):
    engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype=dtype, attention_backend=backend,
                                 enforce_eager=eager, num_kv_blocks=128, max_model_len=512, max_num_seqs=8,
                                 max_num_batched_tokens=128, warmup=False))   # correctness only, here
    assert (engine.runner.graphs is None) == (eager or backend == "torch")
    ps = prompts(engine.model_info.vocab_size)
    # The shared-prefix prompts go second, so their prefix is cached when they run.
    first = engine.generate(ps[:4], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                   logprobs=5))
    second = engine.generate(ps[4:], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                    logprobs=5))
    assert second[0].num_cached_tokens >= 128, "the shared prefix must come from the cache"
    # Alone, a sequence decodes one row a step: on Hopper that is the stream-GEMV chain under PDL.
    alone = engine.generate(ps[1:2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                    logprobs=5))
    del engine
    torch.cuda.empty_cache()
    return first + second + alone


@functools.lru_cache(maxsize=None)
def reference(model_dir: str, dtype: str):
    return run(model_dir, dtype, "torch", True)


@pytest.mark.parametrize("dtype,head_dim,backend,eager", list(cases()))
def test_backend_decodes_like_torch(model_dirs, dtype, head_dim, backend, eager):
    if backend == "flash-attn" and (dtype == "float32" or head_dim > FA4_MAX_HEAD_DIM):
        pytest.skip("FlashAttention-4 runs bf16 / fp16 at head_dim <= 128 on SM90 (triton-fa4 falls back)")
    ref = reference(model_dirs[head_dim], dtype)
    got = ref if backend == "torch" else run(model_dirs[head_dim], dtype, backend, eager)
    if dtype == "float32":
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
        return
    matched = total = 0
    for g, r in zip(got, ref):
        total += len(r.token_ids)
        for j, (a, b) in enumerate(zip(g.token_ids, r.token_ids)):
            if a != b:
                # Only a near-tie in the reference may flip a token.
                top = dict(r.logprobs[j].top)
                assert a in top and top[b] - top[a] < 0.2, (j, a, b, r.logprobs[j].top)
                break
            matched += 1
            assert abs(g.logprobs[j].logprob - r.logprobs[j].logprob) < 0.1, (j, g.logprobs[j], r.logprobs[j])
    # Every matched token's logprob agrees and every flip is a near-tie, which is the correctness check; the
    # fraction only guards against all sequences flipping at once. Random-weight models have flat logits
    # with many near-ties, and FA4's bf16 accumulation order differs from the torch reference's (one early
    # near-tie flip left 43 of 60 tokens matched on the H200), so the guard is loose.
    assert matched / total >= 0.6, f"{matched}/{total} tokens before the first divergence"
