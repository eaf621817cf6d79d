"""Qwen3ForCausalLM against transformers' own Qwen3ForCausalLM, float32 on CPU.

Mixed-length prompts are packed into one ForwardBatch over a paged cache with interleaved blocks,
then extended in a second step that reads the cached KV; every logit row must match a full-sequence
transformers forward.
"""
import pytest
import torch
from transformers import Qwen3Config
from transformers import Qwen3ForCausalLM as HFQwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from helpers.batch import allocate_tables, make_batch, make_kv_caches, prefill_then_decodes
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_core.layers.activation import silu_and_mul
from llmserve_core.layers.attention import get_backend
from llmserve_core.layers.norm import RMSNorm
from llmserve_core.layers.rotary import RotaryEmbedding
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from helpers.tuned import fake_card  # noqa: F401  (a fixture)

CONFIGS = {
    # GQA ratio 1, head_dim == hidden / heads, tied embeddings, plain RoPE.
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
    # GQA ratio 2, head_dim 32 != 64 / 4, separate lm_head, linear RoPE scaling.
    "gqa2-untied-linear": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                               rope_scaling={"rope_type": "linear", "factor": 2.0}, num_hidden_layers=3),
    # GQA ratio 4, head_dim 16 != 64 / 8, yarn RoPE scaling.
    "gqa4-yarn": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
}
PROMPT_LENS = [1, 7, 23, 16, 5]
BLOCK_SIZE = 4


def load_pair(path):
    cfg = ModelConfig.from_hf_dir(path)
    ours = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("torch", "cpu"))
    hf = HFQwen3.from_pretrained(path, dtype=torch.float32).eval()
    return cfg, ours, hf


def random_prompts(vocab, lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, make_random_qwen3_dir):
    path = make_random_qwen3_dir(seed=3, initializer_range=0.1, **CONFIGS[request.param])
    cfg, ours, hf = load_pair(path)
    prompts = random_prompts(cfg.vocab_size, PROMPT_LENS, seed=11)
    with torch.no_grad():
        ref = [hf(p[None], output_hidden_states=True) for p in prompts]
    return cfg, ours, prompts, ref


@torch.no_grad()
def test_packed_prefill_matches_transformers(case):
    cfg, model, prompts, ref = case
    tables, num_blocks = allocate_tables(PROMPT_LENS, BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
    batch = make_batch([(0, n) for n in PROMPT_LENS], tables, BLOCK_SIZE)
    hidden = model(torch.cat(prompts), batch, kv)
    assert hidden.shape == (sum(PROMPT_LENS), cfg.hidden_size)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (sum(PROMPT_LENS), cfg.vocab_size)
    # The random models must be far from uniform or argmax agreement would prove nothing.
    assert ref[2].logits.std() > 0.5
    for rows, r in zip(logits.split(PROMPT_LENS), ref):
        torch.testing.assert_close(rows, r.logits[0], atol=1e-4, rtol=1e-4)
        assert torch.equal(rows.argmax(-1), r.logits[0].argmax(-1))


@pytest.mark.parametrize("name,lens,chain", [("mha-tied", [7, 3, 12], False), ("gqa4-yarn", [7, 3, 12], False),
                                              ("gqa4-yarn", [9], True)])
@torch.no_grad()
def test_fused_path_matches_the_eager_model(name, lens, chain, make_random_qwen3_dir, monkeypatch):
    """The fast path's kernels (fused norms, q/k norm + rotary + K/V store, split-KV decode), run in
    Triton's interpreter, against the eager model on the torch backend: a packed prefill, then two decode
    steps that read the K/V the fused kernel stored. chain: one sequence, whose decode steps stream the
    projections through kernels/stream_gemv.py, gate_up's ending in the SiLU-and-mul (PDL itself needs a GPU)."""
    import llmserve_core.kernels.silu_mul as silu_mul_module
    silu_rows = []
    real_silu = silu_mul_module.silu_mul
    monkeypatch.setattr(silu_mul_module, "silu_mul", lambda x, **kw: silu_rows.append(x.shape[0]) or real_silu(x, **kw))
    path = make_random_qwen3_dir(seed=3, initializer_range=0.1, **CONFIGS[name])
    cfg = ModelConfig.from_hf_dir(path)
    eager = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("torch", "cpu"))
    fused = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("triton", "cpu"))
    fused.set_fused(True, chain=chain, pdl=False)
    assert (fused.model.layers[0].mlp.down_proj.fast_kernel == "stream") == chain
    num_blocks, steps = prefill_then_decodes(cfg, lens, BLOCK_SIZE)
    caches = [make_kv_caches(cfg, num_blocks, BLOCK_SIZE) for _ in range(2)]
    for ids, batch in steps:
        want = eager.compute_logits(eager(ids, batch, caches[0]))
        hidden = fused(ids, batch, caches[1])
        got = fused.compute_logits(hidden)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # The greedy step's lm_head takes the argmax in its kernel, for up to 64 rows; the eager model never.
        assert torch.equal(fused.greedy_tokens(hidden[:64]), got[:64].argmax(-1))
        assert eager.greedy_tokens(hidden[:64]) is None
        # More rows: the argmax of the model-dtype logits, the float32 logits' argmax
        assert torch.equal(fused.greedy_tokens(hidden.repeat(4, 1)[:70]), got.repeat(4, 1)[:70].argmax(-1))
    for (k0, v0), (k1, v1) in zip(*caches):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)
    layers = cfg.num_hidden_layers
    assert silu_rows == [sum(lens)] * layers + ([] if chain else [len(lens)] * 2 * layers)


@torch.no_grad()
def test_block_fp8_decode_attention_hands_o_proj_its_rows_quantized(make_random_qwen3_dir, tmp_path, monkeypatch):
    """Past the GEMV's rows (20 decode rows) a block-scaled o_proj whose scale group is a head takes its rows
    quantized by the decode attention, so no projection quantizes on its own; the logits equal those of
    o_proj quantizing the attention's plain output. A prefill's rows (the prefill kernel) stay plain."""
    import llmserve_core.kernels.fp8_quant as fp8_quant_module
    from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
    from helpers.fp8 import qwen_fp8_config, write_fp8_checkpoint
    path = make_random_qwen3_dir(seed=3, initializer_range=0.1, **CONFIGS["gqa2-untied-linear"])   # head_dim 32
    path, _ = write_fp8_checkpoint(path, tmp_path / "ckpt", qwen_fp8_config((32, 32)))
    cfg = ModelConfig.from_hf_dir(path)
    own, handed = [], []
    real = fp8_quant_module.quantize_activation
    monkeypatch.setattr(fp8_quant_module, "quantize_activation", lambda *a, **kw: own.append(1) or real(*a, **kw))

    class Recording(TritonAttentionBackend):
        quantizes = True

        def attend(self, *args, quant=None, **kw):
            out = super().attend(*args, quant=quant if self.quantizes else None, **kw)
            handed.append(isinstance(out, tuple))
            return out

    backend = Recording()
    model = load_model(cfg, path, "auto", torch.float32, "cpu", backend)
    model.set_fused(True, chain=True, pdl=False)
    lens = [2 + i % 5 for i in range(20)]
    tables, num_blocks = allocate_tables([n + 1 for n in lens], BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
    model(torch.cat(random_prompts(cfg.vocab_size, lens, seed=7)), make_batch([(0, n) for n in lens], tables, BLOCK_SIZE), kv)
    assert handed == [False] * cfg.num_hidden_layers
    decode = make_batch([(n, 1) for n in lens], tables, BLOCK_SIZE)
    ids = torch.arange(20) + 3
    logits = []
    for quantizes in (True, False):
        backend.quantizes = quantizes
        own.clear()
        handed.clear()
        logits.append(model.compute_logits(model(ids, decode, kv)))
        assert handed == [quantizes] * cfg.num_hidden_layers
        assert len(own) == (0 if quantizes else cfg.num_hidden_layers)
    assert torch.equal(*logits)


@pytest.mark.parametrize("quantization", ["channel", "block"])
@torch.no_grad()
def test_fp8_norms_hand_their_projection_rows_quantized_ahead(quantization, make_random_qwen3_dir, tmp_path,
                                                               monkeypatch, fake_card):
    """On a card whose table has tiles for x quantized ahead (faked here: FP8 products, 132 multiprocessors),
    a decode row's input and post-attention norms leave in e4m3 for qkv_proj and gate_up_proj, and its
    SiLU-and-mul for down_proj, and the logits equal those of the GEMVs quantizing x themselves (the same
    tile, group and arithmetic); the prefill rows (9: the GEMV quantizes them as it reads) stay unquantized."""
    import llmserve_core.kernels.fp8_gemv as fp8_gemv_module
    import llmserve_core.kernels.rmsnorm as rmsnorm_module
    from llmserve_core.kernels import tuned
    import llmserve_core.kernels.silu_mul as silu_mul_module
    from helpers.fp8 import qwen_fp8_config, write_fp8_checkpoint
    path = make_random_qwen3_dir(seed=3, initializer_range=0.1, **CONFIGS["gqa4-yarn"])
    block = None if quantization == "channel" else (32, 32)
    if block is not None:
        path, _ = write_fp8_checkpoint(path, tmp_path / "ckpt", qwen_fp8_config(block))
    cfg = ModelConfig.from_hf_dir(path)
    group = 64 if block is None else 32          # divides the hidden size (64) and the scale block
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.intermediate_size)}
    # both paths run the same a8 tile, quantizing per `group` columns
    tile = {"kernel": "a8", "tile": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=group, SPLIT_K=2, num_warps=4, num_stages=1)}
    calls, silu_calls = [], []
    real = rmsnorm_module.rmsnorm
    monkeypatch.setattr(rmsnorm_module, "rmsnorm", lambda *a, **kw: calls.append(kw.get("quant")) or real(*a, **kw))
    real_silu = silu_mul_module.silu_mul
    monkeypatch.setattr(silu_mul_module, "silu_mul",
                        lambda *a, **kw: silu_calls.append(kw.get("quant")) or real_silu(*a, **kw))
    prompt = random_prompts(cfg.vocab_size, [9], seed=5)[0]
    tables, num_blocks = allocate_tables([len(prompt) + 2], BLOCK_SIZE)
    logits = {}
    for ahead in (False, True):
        monkeypatch.setattr(fp8_gemv_module, "X_AHEAD_GROUP", group)
        fake_card({"fp8_gemv": [({"N": n, "K": k, "rows": 1, "scale": tuned.scale_key(block), "x": x}, tile)
                                for n, k in shapes.values() for x in (("raw", "fp8") if ahead else ("raw",))]})
        model = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("triton", "cpu"),
                           quantization="fp8" if block is None else None)
        model.set_fused(True, chain=True, pdl=False)
        kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
        steps = [([(0, len(prompt))], prompt)] + [([(len(prompt) + i, 1)], torch.tensor([5 + i])) for i in range(2)]
        calls.clear()
        silu_calls.clear()
        logits[ahead] = [model.compute_logits(model(ids, make_batch(seqs, tables, BLOCK_SIZE), kv)) for seqs, ids in steps]
        per_step = 2 * cfg.num_hidden_layers + 1      # two norms a layer, then the final norm
        quantized = [g for g in calls if g is not None]
        assert len(calls) == 3 * per_step and quantized == ([RowQuant(group)] * 2 * cfg.num_hidden_layers * 2 if ahead else [])
        assert calls[:per_step] == [None] * per_step      # the prefill's rows are not one row
        # down_proj's input leaves the SiLU-and-mul quantized for the decode rows; the prefill's gate_up GEMV
        # ends in the SiLU-and-mul itself where its rule's tile does not split K
        layers = cfg.num_hidden_layers
        prefill = [] if model.model.layers[0].mlp.gate_up_proj.folds_silu_mul(len(prompt)) else [None] * layers
        assert silu_calls == prefill + [RowQuant(group) if ahead else None] * 2 * layers
    for a, b in zip(logits[False], logits[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quantization", ["channel", "block"])
@torch.no_grad()
def test_fp8_prefill_rows_reach_the_gemm_quantized_by_the_norms(quantization, make_random_qwen3_dir, tmp_path,
                                                                monkeypatch):
    """Past the GEMV's rows (a 70-token prompt) the norms and the SiLU-and-mul hand qkv_proj, gate_up_proj
    and down_proj their rows quantized as the W8A8 GEMM reads them, so only o_proj quantizes on its own,
    and the logits equal those of every projection quantizing for itself."""
    import llmserve_core.kernels.fp8_quant as fp8_quant_module
    from llmserve_core.layers.fp8_linear import Fp8Linear
    from helpers.fp8 import qwen_fp8_config, write_fp8_checkpoint
    path = make_random_qwen3_dir(seed=3, initializer_range=0.1, **CONFIGS["gqa4-yarn"])
    if quantization == "block":
        path, _ = write_fp8_checkpoint(path, tmp_path / "ckpt", qwen_fp8_config((32, 32)))
    cfg = ModelConfig.from_hf_dir(path)
    own = []
    real = fp8_quant_module.quantize_activation
    monkeypatch.setattr(fp8_quant_module, "quantize_activation", lambda *a, **kw: own.append(1) or real(*a, **kw))
    prompt = random_prompts(cfg.vocab_size, [70], seed=6)[0]
    tables, num_blocks = allocate_tables([len(prompt)], BLOCK_SIZE)
    logits = []
    for ahead in (True, False):
        if not ahead:
            monkeypatch.setattr(Fp8Linear, "input_quant", lambda self, rows, dtype: None)
        model = load_model(cfg, path, "auto", torch.float32, "cpu", get_backend("triton", "cpu"),
                           quantization="fp8" if quantization == "channel" else None)
        model.set_fused(True, chain=True, pdl=False)
        own.clear()
        hidden = model(prompt, make_batch([(0, len(prompt))], tables, BLOCK_SIZE), make_kv_caches(cfg, num_blocks, BLOCK_SIZE))
        logits.append(model.compute_logits(hidden))
        assert len(own) == cfg.num_hidden_layers * (1 if ahead else 4)
    assert torch.equal(*logits)


@torch.no_grad()
def test_extend_from_cached_prefix_matches_transformers(case):
    """Step 1 prefills a prefix of each prompt; step 2 brings the rest (one token for some, a chunk
    for others) and must attend to the cached prefix through the block tables."""
    cfg, model, prompts, ref = case
    split = [0, 6, 9, 15, 4]        # 0: the whole prompt arrives in step 2
    tables, num_blocks = allocate_tables(PROMPT_LENS, BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
    first = [i for i, s in enumerate(split) if s > 0]
    batch1 = make_batch([(0, split[i]) for i in first], [tables[i] for i in first], BLOCK_SIZE)
    model(torch.cat([prompts[i][:split[i]] for i in first]), batch1, kv)
    batch2 = make_batch([(s, n - s) for s, n in zip(split, PROMPT_LENS)], tables, BLOCK_SIZE)
    hidden = model(torch.cat([p[s:] for p, s in zip(prompts, split)]), batch2, kv)
    logits = model.compute_logits(hidden)
    for rows, r, s in zip(logits.split([n - s for s, n in zip(split, PROMPT_LENS)]), ref, split):
        torch.testing.assert_close(rows, r.logits[0, s:], atol=1e-4, rtol=1e-4)
        assert torch.equal(rows.argmax(-1), r.logits[0, s:].argmax(-1))


@torch.no_grad()
def test_aux_hidden_states_are_the_layer_inputs(case):
    """Aux state for layer i is the residual stream entering layer i: transformers' hidden_states[i]."""
    cfg, model, prompts, ref = case
    tables, num_blocks = allocate_tables(PROMPT_LENS, BLOCK_SIZE)
    kv = make_kv_caches(cfg, num_blocks, BLOCK_SIZE)
    batch = make_batch([(0, n) for n in PROMPT_LENS], tables, BLOCK_SIZE)
    layer_ids = (cfg.num_hidden_layers - 1, 0, 1)
    hidden, aux = model(torch.cat(prompts), batch, kv, aux_layer_ids=layer_ids)
    assert len(aux) == len(layer_ids)
    for layer, got in zip(layer_ids, aux):
        want = torch.cat([r.hidden_states[layer][0] for r in ref])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = model(torch.cat(prompts), batch, make_kv_caches(cfg, num_blocks, BLOCK_SIZE))
    torch.testing.assert_close(hidden, plain, atol=0, rtol=0)


def test_bad_aux_layer_and_cache_count(tiny_model_dir):
    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    model = load_model(cfg, tiny_model_dir, "auto", torch.float32, "cpu", get_backend("torch", "cpu"))
    batch = make_batch([(0, 3)], [[1]], BLOCK_SIZE)
    ids = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="aux_layer_ids"):
        model(ids, batch, make_kv_caches(cfg, 2, BLOCK_SIZE), aux_layer_ids=(cfg.num_hidden_layers,))
    with pytest.raises(ValueError, match="kv_caches"):
        model(ids, batch, make_kv_caches(cfg, 2, BLOCK_SIZE)[:1])


@torch.no_grad()
def test_bfloat16_runs_close_to_float32(tiny_model_dir):
    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    backend = get_backend("torch", "cpu")
    f32 = load_model(cfg, tiny_model_dir, "auto", torch.float32, "cpu", backend)
    bf16 = load_model(cfg, tiny_model_dir, "auto", torch.bfloat16, "cpu", backend)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16.rotary.cos.dtype == torch.bfloat16
    ids = random_prompts(cfg.vocab_size, [12], seed=0)[0]
    batch = make_batch([(0, 12)], [[1, 2, 3]], BLOCK_SIZE)
    a = f32.compute_logits(f32(ids, batch, make_kv_caches(cfg, 4, BLOCK_SIZE)))
    b = bf16.compute_logits(bf16(ids, batch, make_kv_caches(cfg, 4, BLOCK_SIZE, dtype=torch.bfloat16)))
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.05, rtol=0.05)


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_cache_is_bit_identical_to_transformers(name, head_dim):
    scaling = ROPE_CASES[name]
    theta, max_pos = 1_000_000.0, 2048
    hf_cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=max_pos,
                         rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta})
    hf_rope = Qwen3RotaryEmbedding(hf_cfg)
    positions = torch.arange(max_pos)
    cos_ref, sin_ref = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = ModelConfig.from_dict(hf_cfg.to_dict())
    rope = RotaryEmbedding(head_dim, max_pos, ours.rope_theta, ours.rope_scaling, max_pos, torch.float32, "cpu")
    half = head_dim // 2
    assert torch.equal(rope.cos, cos_ref[0, :, :half]) and torch.equal(rope.cos, cos_ref[0, :, half:])
    assert torch.equal(rope.sin, sin_ref[0, :, :half])
    # Applying it: same rotation as transformers' rotate_half formulation.
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    pos = torch.tensor([0, 5, 2047, 300])
    q, k = torch.randn(4, 3, head_dim), torch.randn(4, 1, head_dim)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos_ref[:, pos], sin_ref[:, pos])
    cos, sin = rope.cos_sin(pos)
    assert torch.equal(RotaryEmbedding.apply(q, cos, sin), q_ref[0].transpose(0, 1))
    assert torch.equal(RotaryEmbedding.apply(k, cos, sin), k_ref[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_with_fused_residual_matches_transformers(dtype):
    torch.manual_seed(0)
    x, res = torch.randn(5, 48, dtype=dtype) * 3, torch.randn(5, 48, dtype=dtype)
    weight = torch.randn(48, dtype=dtype)
    ref = Qwen3RMSNorm(48, eps=1e-5).to(dtype)
    ours = RMSNorm(48, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        assert torch.equal(ours(x), ref(x))
        out, stream = ours(x, res)
        assert torch.equal(stream, x + res)
        assert torch.equal(out, ref(x + res))


def test_silu_and_mul_matches_separate_projections():
    x = torch.randn(6, 2 * 10)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(x[:, :10]) * x[:, 10:], atol=0, rtol=0)
