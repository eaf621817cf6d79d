"""Tensor parallelism on CUDA with decode (and EAGLE-3 verify) graphs captured around the NCCL all-reduces.

TP 2 needs two GPUs (NCCL takes one per rank) and skips with fewer. The world-of-one test runs the same
machinery on one GPU: a one-rank NCCL group behind the driver, its collectives captured in the graphs.
"""
import pytest
import torch

from llmserve_core import Engine, EngineConfig, start_engine
from llmserve_proto import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MID = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mid_model(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=11, **MID)


def prompts(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


# 3 prompts decode padded to bucket 4, 6 to bucket 8; the 200-token prompt's chunks (64-token budget) share
# steps with decoding rows, so the eager mixed steps interleave with graph replays.
BATCHES = ([5, 17, 40], [3, 17, 64, 130, 9, 200])


def config(model, **kwargs) -> EngineConfig:
    return EngineConfig(model=model, device="cuda", dtype="float32", attention_backend="triton", num_kv_blocks=256,
                        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, warmup=False, **kwargs)


def generate(engine) -> list[list[int]]:
    vocab = engine.model_info.vocab_size
    return [c.token_ids for i, lens in enumerate(BATCHES)
            for c in engine.generate(prompts(vocab, lens, seed=i), GREEDY)]


def run(model, **kwargs):
    engine = start_engine(config(model, **kwargs))
    try:
        out = generate(engine)
        graphs = engine.runner.graphs
        replays = {g.name: g.replays for g in engine.runner.mirrored}
        buckets = graphs.buckets if graphs is not None else []
        return out, replays, buckets, [g.capture for g in engine.runner.mirrored]
    finally:
        engine.close()


def test_world_of_one_captures_its_collectives(mid_model):
    """A one-rank NCCL group behind the driver (the core's side of TP, no worker): every decode graph is
    captured with the model's all-reduces and vocabulary gathers inside, replays are announced, and the
    tokens are the plain engine's. Closing releases the graphs and tears the group down."""
    from llmserve_core.distributed.launch import start_rank0
    from llmserve_core.models.config import ModelConfig
    want, _, _, _ = run(mid_model)
    cfg = config(mid_model)
    tp = start_rank0(cfg, ModelConfig.from_hf_dir(mid_model))
    assert tp.driver is not None and not tp.driver.workers.procs
    engine = Engine(cfg, tp=tp)
    try:
        graphs = engine.runner.graphs
        assert graphs.capture and sorted(graphs.graphs) == graphs.buckets
        got = generate(engine)
        assert graphs.replays > 0
    finally:
        engine.close()
    assert got == want
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"TP 2 needs 2 GPUs (one NCCL rank each); {torch.cuda.device_count()} visible")
def test_tp2_decode_graphs_equal_tp1_and_eager_tp2(mid_model):
    """TP 2 with decode graphs captured on both ranks (the all-reduces inside): greedy float32 tokens equal
    TP 1's (with graphs) and eager TP 2's, over batches padded to a bucket and mixed prefill/decode steps."""
    tp1, tp1_replays, buckets, _ = run(mid_model)
    eager, eager_replays, _, _ = run(mid_model, tensor_parallel_size=2, enforce_eager=True)
    graphs, replays, tp2_buckets, capture = run(mid_model, tensor_parallel_size=2)
    assert tp1_replays["decode"] > 0 and eager_replays == {}
    assert capture == [True] and replays["decode"] > 0 and tp2_buckets == buckets
    assert graphs == tp1
    assert graphs == eager


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"TP 2 needs 2 GPUs (one NCCL rank each); {torch.cuda.device_count()} visible")
def test_tp2_eagle3_verify_graphs_equal_plain(mid_model, tmp_path):
    """EAGLE-3 chain drafts under TP 2 with graphs: rank 0's draft graphs, the verify graph replayed on both
    ranks with the drafts from the step broadcast, no fused step: greedy tokens are the plain TP 1 ones."""
    from llmserve_core.models.tiny_draft import make_tiny_draft
    draft = make_tiny_draft(tmp_path / "draft", mid_model, seed=1)
    want, _, _, _ = run(mid_model)
    engine = start_engine(config(mid_model, tensor_parallel_size=2, speculative_model=draft, speculative_gamma=3,
                           speculative_policy="always"))
    try:
        got = generate(engine)
        spec = engine.spec
        assert "fused step" not in spec.graphs and spec.graphs["verify"].capture
        assert spec.graphs["verify"].replays > 0 and engine.stats()["spec_num_drafted_steps"] > 0
    finally:
        engine.close()
    assert got == want
