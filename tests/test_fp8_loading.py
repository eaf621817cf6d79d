"""FP8 checkpoints: a tiny Qwen3 quantized here into Qwen's block-scaled format and compressed-tensors'
per-channel format (single file and sharded) against its dequantized float32 twin; --quantization fp8 at
load; the errors a malformed FP8 checkpoint gets; the FP8 KV cache against the float one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers.batch import make_batch, make_kv_caches
from helpers.fp8 import broken_copy, compressed_tensors_config, logits_of, qwen_fp8_config, rel, write_fp8_checkpoint
from helpers.models import TRAINED_PAIR, held_out_prompts, make_prompts, write_sharded_copy
from llmserve_core import Engine, EngineConfig
from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.layers.attention import get_backend
from llmserve_core.layers.fp8_linear import Fp8Linear
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from llmserve_proto import SamplingParams

BACKEND = get_backend("torch", "cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def load(path, **kw):
    return load_model(ModelConfig.from_hf_dir(path), path, "auto", torch.float32, "cpu", BACKEND, **kw)


@pytest.fixture(scope="module")
def source(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def prompts(source):
    return make_prompts(ModelConfig.from_hf_dir(source).vocab_size, seed=4)


FORMATS = {
    "qwen-fp8-block32": (qwen_fp8_config((32, 32)), ()),
    "compressed-tensors-channel": (compressed_tensors_config(("lm_head", "model.layers.1.mlp.down_proj")),
                                   ("model.layers.1.mlp.down_proj",)),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_pair(request, source, tmp_path_factory):
    qc, keep = FORMATS[request.param]
    out, twin = write_fp8_checkpoint(source, tmp_path_factory.mktemp(request.param) / "ckpt", qc, keep)
    return request.param, out, twin


def test_fp8_checkpoint_agrees_with_its_dequantized_twin(fp8_pair, prompts, source, tmp_path):
    name, path, twin = fp8_pair
    model = load(path)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    # 2 layers x (qkv, o, gate_up, down), less the down_proj the ignore list keeps in float
    assert len(fp8_layers) == (8 if name.startswith("qwen") else 7)
    assert all(m.weight.dtype == FP8 for m in fp8_layers)
    if name.startswith("qwen"):
        assert fp8_layers[0].weight_scale.shape == (128 // 32, 64 // 32)      # q, k, v rows 64 + 32 + 32, packed
    got, want = logits_of(model, prompts), logits_of(load(twin), prompts)
    # Same dequantized weights, both matmuls in float32: only summation order differs.
    assert rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Quantization itself moves the logits a little from the unquantized model (e4m3 keeps 3 mantissa bits).
    assert rel(got, logits_of(load(source), prompts)) < 0.06     # measured 0.033-0.035
    # Sharded: the same model, scales and packing across files.
    sharded = write_sharded_copy(path, tmp_path / "sharded", num_shards=3)
    a, b = dict(model.named_parameters()), dict(load(sharded).named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_fp8_checkpoint_generates_its_twins_tokens(fp8_pair, prompts):
    _, path, twin = fp8_pair
    outs = [[c.token_ids for c in Engine(EngineConfig(model=p, device="cpu", dtype="float32")).generate(prompts, GREEDY)]
            for p in (path, twin)]
    same = sum(a == b for a, b in zip(*outs))
    assert same >= len(prompts) - 1, f"only {same} of {len(prompts)} greedy continuations agree"


def test_packed_scales_hold_each_shard(fp8_pair):
    name, path, _ = fp8_pair
    model = load(path)
    cfg = model.cfg
    qkv = model.model.layers[0].self_attn.qkv_proj
    gate_up = model.model.layers[1].mlp.gate_up_proj
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        if name.startswith("qwen"):
            k_rows = slice(cfg.q_size // 32, (cfg.q_size + cfg.kv_size) // 32)
            assert torch.equal(qkv.weight_scale[k_rows], f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv"))
            up = f.get_tensor("model.layers.1.mlp.up_proj.weight_scale_inv")
            assert torch.equal(gate_up.weight_scale[cfg.intermediate_size // 32:], up)
        else:
            v = f.get_tensor("model.layers.0.self_attn.v_proj.weight_scale")
            assert torch.equal(qkv.weight_scale[cfg.q_size + cfg.kv_size:], v[:, 0])
            assert torch.equal(gate_up.weight[cfg.intermediate_size:].view(torch.uint8),
                               f.get_tensor("model.layers.1.mlp.up_proj.weight").view(torch.uint8))
    assert not isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear) or name.startswith("qwen")


def test_regex_ignore_entries_match_from_the_start_as_compressed_tensors_does(source, prompts, tmp_path):
    """compressed-tensors (and vLLM) match an ignore entry "re:PATTERN" with re.match: anchored at the
    start only, so "re:model\\.layers\\.1\\.mlp" keeps every linear of that MLP unquantized."""
    keep = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")
    qc = compressed_tensors_config(("lm_head", r"re:model\.layers\.1\.mlp"))
    path, twin = write_fp8_checkpoint(source, tmp_path / "ct", qc, keep)
    model = load(path)
    assert not isinstance(model.model.layers[1].mlp.gate_up_proj, Fp8Linear)
    assert not isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert rel(logits_of(model, prompts), logits_of(load(twin), prompts)) < 1e-5


def test_per_tensor_scales_expand_to_every_row(source, prompts, tmp_path):
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    path, twin = write_fp8_checkpoint(source, tmp_path / "tensor", qc)
    model = load(path)
    scale = model.model.layers[0].self_attn.qkv_proj.weight_scale
    cfg = model.cfg
    # q, k and v each had one scale: packed, they are three runs of equal values
    assert scale[:cfg.q_size].unique().numel() == 1 and scale[-cfg.kv_size:].unique().numel() == 1
    assert scale[0] != scale[-1]
    assert rel(logits_of(model, prompts), logits_of(load(twin), prompts)) < 1e-5


def test_online_quantization_equals_a_per_channel_checkpoint(source, tmp_path):
    """--quantization fp8 on a float checkpoint gives exactly the weights of the same model quantized offline."""
    offline, _ = write_fp8_checkpoint(source, tmp_path / "ct", compressed_tensors_config())
    online = dict(load(source, quantization="fp8").named_parameters())
    stored = dict(load(offline).named_parameters())
    assert online.keys() == stored.keys()
    for k in online:
        assert torch.equal(online[k].float(), stored[k].float()), k
    assert online["model.layers.0.mlp.down_proj.weight"].dtype == FP8


def test_dummy_weights_in_fp8(source):
    cfg = ModelConfig.from_hf_dir(source)
    model = load_model(cfg, None, "dummy", torch.float32, "cpu", BACKEND, seed=1, quantization="fp8")
    layer = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == FP8
    assert (layer.dequantized_weight().abs().max() <= 1e-3 + 1e-6) and layer.weight.float().abs().max() == 448
    assert torch.isfinite(logits_of(model, [[1, 2, 3]])).all()


def test_engine_flags_validate():
    for field, value in (("quantization", "int4"), ("kv_cache_dtype", "fp8_e5m2")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="x", **{field: value}).validate()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="x", kv_cache_dtype="fp8_e4m3", attention_backend="flash-attn").validate()


# ---------------------------------------------------------------- malformed checkpoints

@pytest.fixture(scope="module")
def block_ckpt(source, tmp_path_factory):
    return write_fp8_checkpoint(source, tmp_path_factory.mktemp("bad") / "ckpt", qwen_fp8_config((32, 32)))[0]


SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"
WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(SCALE), f"lacks tensors: {SCALE}"),
    (lambda t: t.__setitem__(SCALE, t[SCALE][:, :1].contiguous()), f"{SCALE}.*shape"),
    (lambda t: t.__setitem__(SCALE, t[SCALE] * float("nan")), f"{SCALE}.*finite and positive"),
    (lambda t: t.__setitem__(SCALE, -t[SCALE]), f"{SCALE}.*finite and positive"),
    (lambda t: t.__setitem__(SCALE, torch.full(t[SCALE].shape, 1e-300, dtype=torch.float64)), f"{SCALE}.*finite and positive"),
    (lambda t: t.__setitem__(SCALE, torch.full(t[SCALE].shape, float("inf"))), f"{SCALE}.*finite and positive"),
    (lambda t: t.__setitem__(SCALE, t[SCALE].to(torch.int64)), f"{SCALE}.*scales must be float"),
    (lambda t: t.__setitem__(WEIGHT, t[WEIGHT].float()), f"{WEIGHT}.*float8_e4m3fn"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias_scale", torch.ones(2)), "bias_scale.*no place"),
    (lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"].to(FP8)),
     "model.embed_tokens.weight.*does not cover"),
])
def test_malformed_tensors_are_named(block_ckpt, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load(broken_copy(Path(block_ckpt), tmp_path / "b", edit_tensors=edit))


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.update(fmt="e5m2"), "quantization_config.fmt"),
    (lambda q: q.update(activation_scheme="static"), "quantization_config.activation_scheme"),
    (lambda q: q.update(weight_block_size=[32]), "weight_block_size"),
    (lambda q: q.update(weight_block_size=[2 ** 63, 32]), "weight_block_size"),
    (lambda q: q.update(weight_block_size=[32, 8]), "cols >= 16"),
    (lambda q: q.update(weight_block_size=[128, 128]), "model.layers.0.self_attn.q_proj has 64 rows"),
    (lambda q: q.update(quant_method="awq"), "quant_method 'awq'"),
    (lambda q: q.update(modules_to_not_convert=["model.layers.0.self_attn.k_proj"]), "packed into one"),
])
def test_malformed_configs_are_named(block_ckpt, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load(broken_copy(Path(block_ckpt), tmp_path / "b", edit_config=edit))


def test_scale_blocks_narrower_than_the_gpus_k_step_are_refused_on_cuda_only():
    from llmserve_core.models.quantization import Fp8Scheme, check_fp8_device
    narrow = Fp8Scheme("fp8", (16, 16), "weight_scale_inv")
    with pytest.raises(ValueError, match=r"\[16, 16\] scale blocks are 16 columns wide; on CUDA .* at least 32"):
        check_fp8_device(narrow, torch.device("cuda"))
    check_fp8_device(narrow, torch.device("cpu"))
    for fine in (Fp8Scheme("fp8", (16, 32), "weight_scale_inv"), Fp8Scheme("online", None, None), None):
        check_fp8_device(fine, torch.device("cuda"))


@pytest.mark.parametrize("weights,match", [
    ({"strategy": "group"}, "strategy: unknown scheme 'group'"),
    ({"num_bits": 4}, "only 8-bit float weights"),
    ({"type": "int"}, "only 8-bit float weights"),
])
def test_unknown_compressed_tensors_schemes_are_named(weights, match):
    from llmserve_core.models.quantization import resolve_quantization
    qc = compressed_tensors_config()
    qc["config_groups"]["group_0"]["weights"].update(weights)
    with pytest.raises(ValueError, match=match):
        resolve_quantization(qc, None)


def test_kv_scales_from_the_checkpoint(block_ckpt, tmp_path):
    def add(t):
        t["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
        t["model.layers.0.self_attn.v_proj.output_scale"] = torch.tensor([2.0])
    model = load(broken_copy(Path(block_ckpt), tmp_path / "kv", edit_tensors=add))
    assert model.model.layers[1].self_attn.k_scale == 0.25 and model.model.layers[0].self_attn.v_scale == 2.0
    assert model.model.layers[0].self_attn.k_scale == 1.0
    for i, bad in enumerate((float("inf"), float("nan"), 1e-300, -1.0, 0.0, 2.0 ** 200)):
        with pytest.raises(ValueError, match="model.layers.1.self_attn.k_scale.*finite and positive"):
            load(broken_copy(Path(block_ckpt), tmp_path / f"kv{i}", edit_tensors=lambda t: t.__setitem__(
                "model.layers.1.self_attn.k_scale", torch.tensor(bad, dtype=torch.float64))))
    with pytest.raises(ValueError, match="model.layers.9.self_attn.v_scale.*layer 9"):
        load(broken_copy(Path(block_ckpt), tmp_path / "kv-layer", edit_tensors=lambda t: t.__setitem__(
            "model.layers.9.self_attn.v_scale", torch.tensor(1.0))))


# ---------------------------------------------------------------- FP8 KV cache on the torch backend

def test_fp8_kv_cache_against_the_float_one(source, prompts):
    """The pool holds twice the tokens in the same bytes; logits stay within 5% of the float cache's and
    greedy continuations agree on most prompts (random tiny weights give flat logits: a bf16-level bound)."""
    engines = {d: Engine(EngineConfig(model=source, device="cpu", dtype="float32", kv_cache_dtype=d,
                                      cpu_kv_cache_gib=0.01)) for d in ("auto", "fp8_e4m3")}
    f32, fp8 = engines["auto"].runner, engines["fp8_e4m3"].runner
    assert fp8.kv_caches[0][0].dtype == FP8
    assert fp8.num_blocks >= 4 * f32.num_blocks - 1          # float32 -> 1 byte: four times the blocks here
    outs = {d: [c.token_ids for c in e.generate(prompts, GREEDY)] for d, e in engines.items()}
    same = sum(a == b for a, b in zip(outs["auto"], outs["fp8_e4m3"]))
    assert same >= len(prompts) - 2, f"only {same} of {len(prompts)} continuations agree"
    model = f32.model
    kv32 = make_kv_caches(model.cfg, 8, 16)
    kv8 = make_kv_caches(model.cfg, 8, 16, dtype=FP8)
    p = prompts[2]
    batch = make_batch([(0, len(p))], [[1, 2, 3]], 16)
    ref = model.compute_logits(model(torch.tensor(p), batch, kv32))
    got = model.compute_logits(model(torch.tensor(p), batch, kv8))
    half = model.compute_logits(model(torch.tensor(p), batch, make_kv_caches(model.cfg, 8, 16, dtype=torch.bfloat16)))
    assert 0 < rel(half, ref) < rel(got, ref) < 0.05      # fp8: measured 0.020-0.031 over these prompts


# ---------------------------------------------------------------- with the rest of the engine

FP8_EVERYWHERE = dict(device="cpu", dtype="float32", quantization="fp8", kv_cache_dtype="fp8_e4m3")


def test_fp8_serving_is_schedule_independent(source, prompts):
    """FP8 weights and KV: chunked prefill, a preempting pool and the prefix cache give the plain run's tokens
    (every K/V row is stored in e4m3 before anything reads it, so a recomputed or cached row is the same)."""
    want = [c.token_ids for c in Engine(EngineConfig(model=source, enable_prefix_caching=False,
                                                     **FP8_EVERYWHERE)).generate(prompts, GREEDY)]
    engine = Engine(EngineConfig(model=source, num_kv_blocks=14, block_size=4, max_num_batched_tokens=7,
                                 max_num_seqs=3, **FP8_EVERYWHERE))
    for _ in range(2):                        # the second pass hits the prefix cache
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == want
    st = engine.stats()
    assert st["num_preemptions"] > 0 and st["prefix_hit_rate"] > 0


def test_eagle3_over_an_fp8_target_is_lossless():
    """The bf16/float draft (and its KV) beside an FP8 target with an FP8 KV pool: greedy speculation
    returns exactly the FP8 target's own tokens, and the trained draft is still accepted."""
    target, draft = str(TRAINED_PAIR / "target"), str(TRAINED_PAIR / "draft")
    prompts = held_out_prompts(4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = Engine(EngineConfig(model=target, **FP8_EVERYWHERE)).generate(prompts, params)
    engine = Engine(EngineConfig(model=target, speculative_model=draft, speculative_policy="always", **FP8_EVERYWHERE))
    got = engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.runner.kv_caches[0][0].dtype == FP8 and engine.spec.proposer.kv[0].dtype == torch.float32
    assert engine.stats()["spec_mean_acceptance_length"] > 1.5


def test_fp8_on_the_cpu_needs_no_triton(tiny_model_dir):
    """Triton is an extra: the CPU reference paths of FP8 weights and the FP8 KV cache must not import it."""
    import subprocess
    import sys
    code = f"""
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError("triton is not installed")
sys.meta_path.insert(0, NoTriton())
from llmserve_core import Engine, EngineConfig
from llmserve_proto import SamplingParams
e = Engine(EngineConfig(model={str(tiny_model_dir)!r}, device="cpu", quantization="fp8", kv_cache_dtype="fp8_e4m3"))
print(len(e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].token_ids))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("4")
