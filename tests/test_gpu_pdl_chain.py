"""The decode chain under PDL on a Hopper GPU, against the same kernels in plain stream order.

Under PDL a kernel launches before the one it follows has finished, reads its static inputs (weights, and
for a split decode the lengths, block tables and earlier K/V) before its wait, and releases the kernel after
it (kernels/pdl.py). Only the order of launches changes, never the arithmetic, so a decode step must give
bit-identical logits and K/V caches with PDL and without it: eagerly, and replayed many times from one CUDA
graph (a read that raced a write would differ in some replay). At Qwen3-8B's layer widths (three layers),
batch 1 (the stream GEMVs, split decodes over 9 pieces) and 4 (the few-row GEMVs), bf16 and FP8 weights.
"""
import json

import pytest
import torch

from helpers.batch import allocate_tables, make_batch, make_kv_caches
from llmserve_core.layers.attention import get_backend
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a Hopper (or later) GPU for PDL")]

SHAPE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
             intermediate_size=12288, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000,
             tie_word_embeddings=False, eos_token_id=151645)
BLOCK_SIZE = 16
PROMPT = 560         # 9 pieces of 64 keys at batch 1
REPLAYS = 20


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-8b-widths")
    (d / "config.json").write_text(json.dumps(SHAPE))
    return str(d)


@torch.no_grad()
def decode_outputs(model, cfg, rows: int, pdl: bool, graph: bool):
    """Prefill `rows` prompts, then decode one token each REPLAYS times (eagerly, or replaying one captured
    graph): every step's logits, and the caches after."""
    model.set_fused(True, chain=True, pdl=pdl)
    g = torch.Generator().manual_seed(0)
    lens = [PROMPT + 7 * i for i in range(rows)]
    tables, num_blocks = allocate_tables([n + 1 for n in lens], BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE, torch.bfloat16, "cuda")
    prompt = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).cuda()
    model(prompt, make_batch([(0, n) for n in lens], tables, BLOCK_SIZE, "cuda"), kv)
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g).cuda()
    batch = make_batch([(n, 1) for n in lens], tables, BLOCK_SIZE, "cuda")
    step = lambda: model.compute_logits(model(ids, batch, kv))      # noqa: E731
    logits = [step()]                        # (also compiles every kernel outside the capture)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = step()
        for _ in range(REPLAYS):
            captured.replay()
            logits.append(out.clone())
    else:
        logits += [step() for _ in range(REPLAYS)]
    torch.cuda.synchronize()
    return logits, kv


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_chain_is_bit_identical_to_plain_launches(shape_dir, quantization, rows):
    cfg = ModelConfig.from_hf_dir(shape_dir)
    model = load_model(cfg, shape_dir, "dummy", torch.bfloat16, "cuda", get_backend("triton", "cuda"),
                       quantization=quantization)
    plain, plain_kv = decode_outputs(model, cfg, rows, pdl=False, graph=False)
    assert all(torch.equal(x, plain[0]) for x in plain)
    for graph in (False, True):
        got, kv = decode_outputs(model, cfg, rows, pdl=True, graph=graph)
        same = sum(torch.equal(x, plain[0]) for x in got)
        assert same == len(got), f"graph={graph}: {len(got) - same} of {len(got)} PDL steps differ"
        for (k0, v0), (k1, v1) in zip(plain_kv, kv):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
