"""FP8 weights and the FP8 KV cache on CUDA: CUDA graphs equal eager, FP8 agrees with its dequantized twin,
and the Triton FP8-KV path is token-exact against the torch reference in float32.

Skipped without a GPU. The kernels at Qwen3-8B shapes are in test_fp8_kernels.py (gpu-marked there).
"""
import pytest
import torch

from llmserve_core import Engine, EngineConfig
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_proto import SamplingParams
from helpers.fp8 import qwen_fp8_config, write_fp8_checkpoint
from helpers.models import MID
from helpers.models import varied_prompts as prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mid_model(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=11, **MID)


@pytest.fixture(scope="module")
def block_fp8(mid_model, tmp_path_factory):
    return write_fp8_checkpoint(mid_model, tmp_path_factory.mktemp("fp8") / "ckpt", qwen_fp8_config((128, 128)))


def run(path, **kw):
    engine = Engine(EngineConfig(model=path, device="cuda", num_kv_blocks=256, max_model_len=1024, max_num_seqs=8,
                                 **kw))
    return engine, [c.token_ids for c in engine.generate(prompts(engine.model_info.vocab_size), GREEDY)]


@pytest.mark.parametrize("case", ["block-checkpoint", "online-fp8-kv"])
def test_fp8_graphs_equal_eager(mid_model, block_fp8, case):
    path, kw = (block_fp8[0], {}) if case == "block-checkpoint" else \
        (mid_model, dict(quantization="fp8", kv_cache_dtype="fp8_e4m3"))
    outs = []
    for eager in (True, False):
        engine, tokens = run(path, dtype="bfloat16", enforce_eager=eager, **kw)
        assert (engine.runner.graphs is None) == eager
        outs.append(tokens)
    same = sum(a == b for a, b in zip(*outs))
    print(f"fp8 {case} graphs vs eager: {same}/{len(outs[0])} identical")
    assert same >= len(outs[0]) - 1      # a bf16 near-tie may flip one row


def test_block_fp8_decode_attention_quantizes_o_proj_rows_as_o_proj_would(mid_model, tmp_path, monkeypatch):
    """40 sequences decoding at once (past the GEMV's rows): with 64 x 64 blocks (a scale group per head) the
    decode attention hands o_proj its rows quantized; the greedy tokens equal those of o_proj quantizing them
    itself (eager), with and without CUDA graphs."""
    from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
    path, _ = write_fp8_checkpoint(mid_model, tmp_path / "ckpt", qwen_fp8_config((64, 64)))
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in torch.randint(2, 90, (40,), generator=g)]
    handed = []
    attend = TritonAttentionBackend.attend

    def recording(self, *args, quant=None, **kw):
        out = attend(self, *args, quant=quant if self.quantizes else None, **kw)
        handed.append(isinstance(out, tuple))
        return out

    monkeypatch.setattr(TritonAttentionBackend, "attend", recording)
    outs = {}
    for quantizes, eager in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(TritonAttentionBackend, "quantizes", quantizes, raising=False)
        handed.clear()
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="bfloat16", attention_backend="triton",
                                     enforce_eager=eager, num_kv_blocks=512, max_model_len=256, max_num_seqs=48))
        outs[quantizes, eager] = [c.token_ids for c in engine.generate(ps, GREEDY)]
        assert any(handed) == quantizes
    assert outs[True, True] == outs[False, True] and outs[True, False] == outs[False, True]


def test_fp8_checkpoint_tracks_its_bf16_twin(block_fp8):
    """FP8 quantizes the activations too (per 1 x 128 piece at 1-16 rows, per token group beyond): tokens
    agree with the dequantized bf16 twin up to the first near-tie, where the FP8 token is one the twin
    ranked almost as high, and the logprobs before it are close."""
    path, twin = block_fp8
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = {}
    for name, model in (("fp8", path), ("twin", twin)):
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                     max_model_len=1024, max_num_seqs=8))
        outs[name] = engine.generate(prompts(engine.model_info.vocab_size), params)
    agree = []
    for got, want in zip(outs["fp8"], outs["twin"]):
        j = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), len(got.token_ids))
        agree.append(j)
        for i in range(j):
            assert abs(got.logprobs[i].logprob - want.logprobs[i].logprob) < 0.3, (i, got.logprobs[i], want.logprobs[i])
        if j < len(got.token_ids):
            top = dict(want.logprobs[j].top)
            a, b = got.token_ids[j], want.token_ids[j]
            assert a in top and top[b] - top[a] < 0.5, (j, a, b, want.logprobs[j].top)
    print(f"fp8 block checkpoint vs bf16 twin: tokens agree for {agree} of {len(got.token_ids)}")


def test_fp8_kv_triton_token_exact_against_torch_in_float32(mid_model):
    outs = {b: run(mid_model, dtype="float32", attention_backend=b, kv_cache_dtype="fp8_e4m3")[1]
            for b in ("torch", "triton")}
    assert outs["triton"] == outs["torch"]


def test_fp8_block_checkpoint_decodes_alone_as_in_a_batch(block_fp8):
    """Alone, a sequence decodes one row a step; in a batch its rows share each FP8 GEMV (on Hopper both
    quantize the activations per 1 x 128 piece, and one row of o_proj's shape streams weight-only), so
    the tokens agree up to the first near-tie, and the logprobs before it are close."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=5)
    engine = Engine(EngineConfig(model=block_fp8[0], device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                 max_model_len=1024, max_num_seqs=8))
    ps = prompts(engine.model_info.vocab_size)
    batched = engine.generate(ps, params)
    for p, want in zip(ps, batched):
        got = engine.generate([p], params)[0]
        for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            if a != b:
                top = dict(want.logprobs[j].top)
                assert a in top and top[b] - top[a] < 0.2, (j, a, b, want.logprobs[j].top)
                break
            assert abs(got.logprobs[j].logprob - want.logprobs[j].logprob) < 0.1, (j, got.logprobs[j], want.logprobs[j])


def test_fp8_rows_17_to_64_at_the_8b_projection_shapes(make_random_qwen3_dir):
    """kernels/fp8_gemv.py's tables are keyed by Qwen3-8B's projection shapes, so one layer of those widths
    takes them on a card like the measured one: 17-64 rows of qkv, gate_up and down read x quantized ahead (by
    the norms and the SiLU-and-mul). The warm-up meets every variant (serving 1-64 rows of decodes and prompts
    compiles nothing), and CUDA graphs give eager's tokens."""
    from llmserve_core.kernels.fp8_gemv import X_AHEAD_GROUP
    model = make_random_qwen3_dir(seed=5, hidden_size=4096, intermediate_size=12288, num_hidden_layers=1,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=False)
    g = torch.Generator().manual_seed(0)
    work = [[torch.randint(0, 1000, (L,), generator=g).tolist() for L in lengths]
            for lengths in ([5], [3] * 17, [40] + [2] * 24, [7] * 40, [1, 33, 64, 65] * 16)]
    outs = []
    for eager in (False, True):
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", quantization="fp8",
                                     enforce_eager=eager, max_num_seqs=64, max_num_batched_tokens=1024,
                                     max_model_len=512, num_kv_blocks=1024))
        layer = engine.runner.model.model.layers[0]
        if torch.cuda.get_device_properties(0).multi_processor_count == 132 and not eager:   # the tables' card
            assert layer.self_attn.qkv_proj.input_quant(40, torch.bfloat16) == RowQuant(X_AHEAD_GROUP)
            assert layer.mlp.down_proj.input_quant(64, torch.bfloat16) == RowQuant(X_AHEAD_GROUP)
        # past the GEMV's rows the norms and the SiLU-and-mul hand the W8A8 GEMM its rows, one scale a token
        assert layer.self_attn.qkv_proj.input_quant(65, torch.bfloat16) == RowQuant(4096)
        assert layer.mlp.down_proj.input_quant(65, torch.bfloat16) == RowQuant(12288)
        before = engine.stats()["jit_compilations"]
        outs.append([c.token_ids for batch in work for c in engine.generate(batch, GREEDY)])
        assert engine.stats()["jit_compilations"] == before, "a kernel compiled after start-up"
    same = sum(a == b for a, b in zip(*outs))
    print(f"fp8 8B-shape layer, graphs vs eager: {same}/{len(outs[0])} identical")
    assert same >= len(outs[0]) - 3      # a bf16 near-tie may flip a row
