"""Loading Qwen3-MoE checkpoints: the per-expert layout (Qwen's releases, transformers' save_pretrained) and
transformers' stacked one, single-file and sharded; dummy weights from config.json alone; FP8 experts in
Qwen's block format and compressed-tensors' per-channel one against their dequantized twins, and
--quantization fp8; and the error each malformed checkpoint gets, naming the tensor or field."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers.fp8 import broken_copy, compressed_tensors_config, logits_of, qwen_fp8_config, rel, write_fp8_checkpoint
from helpers.models import make_prompts, rewrite_weights, write_sharded_copy
from llmserve_core import Engine, EngineConfig
from llmserve_core.kernels.fp8_format import FP8, dequantize_weight
from llmserve_core.layers.attention import get_backend
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model
from llmserve_proto import SamplingParams

BACKEND = get_backend("torch", "cpu")
# 10 experts, top-3, layer 1 dense: every kind of tensor a Qwen3-MoE checkpoint holds.
SHAPE = dict(num_experts=10, num_experts_per_tok=3, num_hidden_layers=3, mlp_only_layers=[1],
             tie_word_embeddings=False, initializer_range=0.1)
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"
ROUTER = "model.layers.2.mlp.gate.weight"


def load(path, **kw):
    return load_model(ModelConfig.from_hf_dir(path), path, "auto", torch.float32, "cpu", BACKEND, **kw)


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def source(make_random_qwen3_dir):
    return make_random_qwen3_dir(seed=9, moe=True, **SHAPE)


@pytest.fixture(scope="module")
def prompts(source):
    return make_prompts(ModelConfig.from_hf_dir(source).vocab_size, seed=4)


@pytest.fixture(scope="module")
def stacked(source, tmp_path_factory):
    """The same model as transformers holds it in memory: one [E, 2I, H] gate_up_proj and one [E, H, I]
    down_proj per layer (save_pretrained(save_original_format=False))."""
    from transformers import Qwen3MoeForCausalLM
    out = tmp_path_factory.mktemp("stacked")
    Qwen3MoeForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(out, save_original_format=False)
    return out


def test_save_pretrained_writes_each_expert_apart(source, stacked):
    """What this transformers writes by default is the released layout; the stacked one only on request."""
    with safe_open(str(Path(source) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert EXPERT in names and "model.layers.1.mlp.up_proj.weight" in names and ROUTER in names
    with safe_open(str(stacked / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape()) == (10, 64, 64)
        assert not any(".experts.3." in n for n in f.keys())


def test_both_layouts_and_shards_load_the_same_weights(source, stacked, tmp_path):
    want = params_of(load(source))
    w13 = want["model.layers.0.mlp.w13"]
    assert w13.shape == (10, 64, 64) and want["model.layers.2.mlp.w2"].shape == (10, 64, 32)
    with safe_open(str(Path(source) / "model.safetensors"), framework="pt") as f:
        assert torch.equal(w13[3, 32:], f.get_tensor(EXPERT))                      # up rows after gate rows
        assert torch.equal(w13[3, :32], f.get_tensor(EXPERT.replace("up_proj", "gate_proj")))
    for path in (stacked, write_sharded_copy(source, tmp_path / "sharded", num_shards=3),
                 write_sharded_copy(stacked, tmp_path / "stacked-sharded", num_shards=2)):
        got = params_of(load(path))
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (path, k)


def test_bfloat16_load_converts_without_float32_params(source):
    model = load_model(ModelConfig.from_hf_dir(source), source, "auto", torch.bfloat16, "cpu", BACKEND)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_weights_from_config_alone(source, tmp_path, quantization):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    shutil.copyfile(Path(source) / "config.json", only_config / "config.json")
    model = load_model(ModelConfig.from_hf_dir(only_config), None, "dummy", torch.float32, "cpu", BACKEND, seed=1,
                       quantization=quantization)
    block = model.model.layers[0].mlp
    if quantization:
        assert block.w13.dtype == FP8 and block.w2_scale.shape == (10, 64)
        weight = dequantize_weight(block.w13[4], block.w13_scale[4], None)
        assert 0 < weight.abs().max() <= 1e-3 + 1e-6 and block.w13[4].float().abs().max() == 448
    else:
        assert 0 < block.w13.abs().max() <= 1e-3
    assert block.gate.weight.dtype == torch.float32 and torch.equal(model.model.norm.weight, torch.ones(64))
    assert torch.isfinite(logits_of(model, [[1, 2, 3]])).all()


# ---- malformed checkpoints ----------------------------------------------------------------------------

def _broken(src, dst, edit=None, config=None) -> str:
    shutil.copytree(src, dst)
    if edit:
        rewrite_weights(dst, edit)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        raw.update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


def _set(name, make):
    return lambda t: t.__setitem__(name, make(t))


@pytest.mark.parametrize("edit,config,match", [
    (lambda t: t.pop(EXPERT), None, f"lacks tensors: {EXPERT}"),
    (_set(EXPERT, lambda t: t[EXPERT][:, :-1].contiguous()), None, rf"{EXPERT}' has shape \(32, 63\).*\(32, 64\)"),
    (_set(ROUTER, lambda t: t[ROUTER][:9].contiguous()), None, rf"{ROUTER}' has shape \(9, 64\).*\(10, 64\)"),
    (_set("model.layers.0.mlp.experts.10.up_proj.weight", lambda t: t[EXPERT].clone()), None,
     "experts.10.up_proj.weight' names expert 10, config.json's num_experts is 10"),
    (_set(EXPERT, lambda t: t[EXPERT].to(FP8)), None, f"{EXPERT}.*does not cover"),
    (_set(EXPERT + "_scale", lambda t: torch.ones(32)), None, f"{EXPERT}_scale.*no place"),
    (None, {"mlp_only_layers": [0, 1]},
     "'model.layers.0.mlp.experts.*holds experts, but config.json makes layer 0 dense"),
    (None, {"num_local_experts": 12},
     r"lacks tensors: model.layers.0.mlp.experts.10.*and \d+ more|mlp.gate.weight' has shape"),
    (None, {"num_experts_per_tok": 11}, r"num_experts_per_tok \(11\) exceeds num_local_experts \(10\)"),
    (None, {"num_experts": 12}, r"num_experts \(12\) and num_local_experts \(10\) disagree"),
])
def test_malformed_checkpoints_are_named(source, tmp_path, edit, config, match):
    with pytest.raises(ValueError, match=match):
        load(_broken(Path(source), tmp_path / "b", edit, config))


@pytest.mark.parametrize("name,cut,match", [
    ("model.layers.0.mlp.experts.gate_up_proj", lambda t: t[:9],
     r"gate_up_proj' has shape \(9, 64, 64\).*\(10, 64, 64\)"),
    ("model.layers.2.mlp.experts.down_proj", lambda t: t[:, :, :31], r"down_proj' has shape \(10, 64, 31\)"),
    ("model.layers.2.mlp.experts.down_proj", None, "lacks tensors: model.layers.2.mlp.experts.0.down_proj.weight"),
])
def test_malformed_stacked_checkpoints_are_named(stacked, tmp_path, name, cut, match):
    def edit(t):
        if cut is None:
            t.pop(name)
        else:
            t[name] = cut(t[name]).contiguous()
    with pytest.raises(ValueError, match=match):
        load(_broken(stacked, tmp_path / "b", edit))


# ---- FP8 experts --------------------------------------------------------------------------------------

FORMATS = {
    # Qwen3-30B-A3B-FP8's format (128 x 128 there; 16 x 32 blocks fit the tiny widths, two per expert's gate)
    "qwen-fp8-block": qwen_fp8_config((16, 32)),
    # RedHatAI's FP8-dynamic MoE releases: per-channel scales, the router and lm_head left in bf16 by name
    "compressed-tensors-channel": compressed_tensors_config(("lm_head", "re:.*mlp.gate$")),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_pair(request, source, tmp_path_factory):
    out, twin = write_fp8_checkpoint(source, tmp_path_factory.mktemp(request.param) / "ckpt", FORMATS[request.param])
    return request.param, out, twin


def test_fp8_experts_agree_with_their_dequantized_twin(fp8_pair, prompts, tmp_path):
    name, out, twin = fp8_pair
    model = load(out)
    block = model.model.layers[2].mlp
    assert block.w13.dtype == FP8 and block.w2.dtype == FP8 and block.gate.weight.dtype == torch.float32
    assert block.block == ((16, 32) if "block" in name else None)
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == FP8       # the dense layer's too
    reference = logits_of(load(twin), prompts)
    assert rel(logits_of(model, prompts), reference) < 1e-5
    assert rel(logits_of(load(write_sharded_copy(out, tmp_path / "sharded", num_shards=3)), prompts), reference) < 1e-5


def test_fp8_experts_generate_their_twins_tokens(fp8_pair, prompts):
    _, out, twin = fp8_pair
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [Engine(EngineConfig(model=p, device="cpu", dtype="float32")).generate(prompts, params) for p in (out, twin)]
    assert [c.token_ids for c in got[0]] == [c.token_ids for c in got[1]]


def test_each_experts_scales_land_in_its_slot(fp8_pair):
    name, out, _ = fp8_pair
    block = load(out).model.layers[0].mlp
    suffix = "weight_scale_inv" if "block" in name else "weight_scale"
    with safe_open(str(Path(out) / "model.safetensors"), framework="pt") as f:
        for e in (0, 7):
            gate, up, down = (f.get_tensor(f"model.layers.0.mlp.experts.{e}.{p}_proj.{suffix}")
                              for p in ("gate", "up", "down"))
            if "block" not in name:           # compressed-tensors stores a channel's scale as [N, 1]
                gate, up, down = gate[:, 0], up[:, 0], down[:, 0]
            assert torch.equal(block.w13_scale[e], torch.cat([gate, up]))
            assert torch.equal(block.w2_scale[e], down)
            assert torch.equal(block.w13[e, 32:].view(torch.uint8),
                               f.get_tensor(f"model.layers.0.mlp.experts.{e}.up_proj.weight").view(torch.uint8))


def test_online_quantization_equals_a_per_channel_checkpoint(source, stacked, tmp_path):
    """--quantization fp8 on float experts, either layout, gives exactly the same model quantized offline."""
    offline, _ = write_fp8_checkpoint(source, tmp_path / "ct", compressed_tensors_config(("lm_head",)))
    stored = params_of(load(offline))
    for path in (source, stacked):
        online = params_of(load(path, quantization="fp8"))
        assert online.keys() == stored.keys()
        for k in online:
            assert torch.equal(online[k], stored[k]), k


EXPERT_SCALE = "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def block_ckpt(source, tmp_path_factory):
    return write_fp8_checkpoint(source, tmp_path_factory.mktemp("bad") / "ckpt", FORMATS["qwen-fp8-block"])[0]


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(EXPERT_SCALE), f"lacks tensors: {EXPERT_SCALE}"),
    (_set(EXPERT_SCALE, lambda t: t[EXPERT_SCALE][:1].contiguous()), rf"{EXPERT_SCALE}.*shape \(1, 1\)"),
    (_set(EXPERT_SCALE, lambda t: t[EXPERT_SCALE] * float("nan")), f"{EXPERT_SCALE}.*finite and positive"),
    (_set(EXPERT_SCALE, lambda t: torch.full(t[EXPERT_SCALE].shape, 1e-300, dtype=torch.float64)),
     f"{EXPERT_SCALE}.*finite and positive"),
    (_set(EXPERT_SCALE, lambda t: torch.full(t[EXPERT_SCALE].shape, float("inf"))),
     f"{EXPERT_SCALE}.*finite and positive"),
    (_set(EXPERT, lambda t: t[EXPERT].float()), f"{EXPERT}.*float8_e4m3fn"),
    (_set(ROUTER, lambda t: t[ROUTER].to(FP8)), f"{ROUTER}.*does not cover"),
])
def test_malformed_fp8_experts_are_named(block_ckpt, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load(broken_copy(Path(block_ckpt), tmp_path / "b", edit_tensors=edit))


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.update(modules_to_not_convert=["model.layers.2.mlp.experts.4.gate_proj"]), "must share a format"),
    (lambda q: q.update(weight_block_size=[64, 32]), r"moe_intermediate_size \(32 on this rank\) is not whole 64 x 32"),
])
def test_malformed_fp8_configs_are_named(block_ckpt, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load(broken_copy(Path(block_ckpt), tmp_path / "b", edit_config=edit))


def test_experts_left_unquantized_by_name_stay_float(block_ckpt, source, tmp_path, prompts):
    """An ignore list covering every expert of a layer keeps that layer's experts in the model dtype."""
    layer2 = [f"model.layers.2.mlp.experts.{e}.{p}_proj" for e in range(10) for p in ("gate", "up", "down")]
    out, twin = write_fp8_checkpoint(source, tmp_path / "keep", {**qwen_fp8_config((16, 32)),
                                                                 "modules_to_not_convert": layer2}, keep_bf16=layer2)
    model = load(out)
    assert model.model.layers[2].mlp.w13.dtype == torch.float32 and model.model.layers[0].mlp.w13.dtype == FP8
    assert rel(logits_of(model, prompts), logits_of(load(twin), prompts)) < 1e-5
