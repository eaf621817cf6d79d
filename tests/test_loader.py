"""Checkpoint loading: single vs sharded files, dummy weights from config.json alone, and the errors
a user sees for a wrong directory or a checkpoint that does not fit its config."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers.batch import make_batch, make_kv_caches
from helpers.models import rewrite_weights, write_sharded_copy
from llmserve_core.layers.attention import get_backend
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.loader import load_model

BACKEND = get_backend("torch", "cpu")


def load(path, load_format="auto", seed=0, dtype=torch.float32):
    return load_model(ModelConfig.from_hf_dir(path), path, load_format, dtype, "cpu", BACKEND, seed)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_equals_single_file(make_random_qwen3_dir, tmp_path):
    src = make_random_qwen3_dir(seed=5, tie_word_embeddings=False, num_hidden_layers=3)
    sharded = write_sharded_copy(src, tmp_path / "sharded", num_shards=2)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    a, b = dict(load(src).named_parameters()), dict(load(sharded).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_packed_weights_hold_the_checkpoint_tensors(tiny_model_dir):
    model = load(tiny_model_dir)
    cfg = model.cfg
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        qkv = model.model.layers[1].self_attn.qkv_proj.weight
        assert torch.equal(qkv[:cfg.q_size], f.get_tensor("model.layers.1.self_attn.q_proj.weight"))
        assert torch.equal(qkv[cfg.q_size + cfg.kv_size:], f.get_tensor("model.layers.1.self_attn.v_proj.weight"))
        gate_up = model.model.layers[0].mlp.gate_up_proj.weight
        assert torch.equal(gate_up[cfg.intermediate_size:], f.get_tensor("model.layers.0.mlp.up_proj.weight"))
    assert model.lm_head is None and model.lm_head_weight is model.model.embed_tokens.weight


def test_bfloat16_load_converts_without_float32_params(tiny_model_dir):
    model = load(tiny_model_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = load(tiny_model_dir)
    assert torch.equal(model.model.norm.weight, ref.model.norm.weight.bfloat16())


def test_dummy_weights_from_config_alone(tiny_model_dir, tmp_path):
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    shutil.copy(f"{tiny_model_dir}/config.json", only_config)
    model = load(only_config, "dummy", seed=1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.abs().max() <= 1e-3 and p.std() > 1e-4, name
    again, other = load(only_config, "dummy", seed=1), load(only_config, "dummy", seed=2)
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)
    assert not torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)
    cfg = model.cfg
    hidden = model(torch.tensor([1, 2, 3]), make_batch([(0, 3)], [[1]], 4), make_kv_caches(cfg, 2, 4))
    assert torch.isfinite(model.compute_logits(hidden)).all()


def test_missing_or_wrong_directory(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ModelConfig.from_hf_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf_dir(tmp_path)
    llama = tmp_path / "llama"
    llama.mkdir()
    cfg = json.loads(open(f"{tiny_model_dir}/config.json").read())
    (llama / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="only Qwen3"):
        ModelConfig.from_hf_dir(llama)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(f"{tiny_model_dir}/config.json", no_weights)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(no_weights)
    with pytest.raises(ValueError, match="load_format"):
        load(tiny_model_dir, "pickle")


def test_a_file_that_is_not_safetensors_is_named(tiny_model_dir, tmp_path, make_random_qwen3_dir):
    """What a clone without git-lfs leaves (a pointer file) and an interrupted download: a ValueError (which
    the CLI reports as a config error, not a crash) naming the file, not safetensors' bare header error."""
    lfs = copy_dir(tiny_model_dir, tmp_path / "lfs")
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"
                                           "oid sha256:" + "0" * 64 + "\nsize 1503300328\n")
    with pytest.raises(ValueError, match=r"model\.safetensors.* Git LFS pointer"):
        load(lfs)
    cut = Path(write_sharded_copy(make_random_qwen3_dir(seed=5, tie_word_embeddings=False), tmp_path / "cut"))
    shard = cut / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is not a readable safetensors file"):
        load(cut)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_malformed_json_names_the_file(tiny_model_dir, tmp_path, name):
    path = copy_dir(tiny_model_dir, tmp_path / "m")
    (path / name).write_text('{"eos_token_id": [2, 0],}')
    with pytest.raises(ValueError, match=f"{name} is not valid JSON"):
        load(path)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    path = copy_dir(tiny_model_dir, tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(path)


def test_shape_mismatch_is_named(tiny_model_dir, tmp_path):
    path = copy_dir(tiny_model_dir, tmp_path / "m")

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1].clone()
    rewrite_weights(path, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load(path)


def test_unexpected_tensor_is_named_and_stale_rotary_ignored(tiny_model_dir, tmp_path):
    path = copy_dir(tiny_model_dir, tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load(path)
    rewrite_weights(path, lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        load(path)


def test_tied_and_untied_lm_head(make_random_qwen3_dir, tiny_model_dir, tmp_path):
    untied = copy_dir(make_random_qwen3_dir(seed=4, tie_word_embeddings=False), tmp_path / "untied")
    model = load(untied)
    assert model.lm_head is not None
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    rewrite_weights(untied, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load(untied)
    # A tied checkpoint that still carries lm_head.weight (some exporters write it) loads; the embedding wins.
    tied = copy_dir(tiny_model_dir, tmp_path / "tied")
    rewrite_weights(tied, lambda t: t.update({"lm_head.weight": torch.zeros_like(t["model.embed_tokens.weight"])}))
    model = load(tied)
    assert model.lm_head_weight.abs().sum() > 0


def _qwen3_raw(**extra):
    base = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return {**base, **extra}


def test_config_dialects_and_eos():
    # transformers 4.x style: top-level rope_theta, rope_scaling with the legacy "type" key, torch_dtype.
    old = ModelConfig.from_dict(_qwen3_raw(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
                                           torch_dtype="bfloat16", eos_token_id=7))
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.torch_dtype == "bfloat16" and old.eos_token_ids == [7]
    assert old.head_dim == 128  # transformers' Qwen3Config default when config.json omits it
    new = ModelConfig.from_dict(_qwen3_raw(head_dim=8, dtype="float32",
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                                {"eos_token_id": [3, 4]})
    assert new.rope_theta == 1e6 and new.rope_scaling is None and new.eos_token_ids == [3, 4]
    yarn = ModelConfig.from_dict(_qwen3_raw(max_position_embeddings=4096,
                                            rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert yarn.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("raw, match", [
    (_qwen3_raw(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    (_qwen3_raw(rope_scaling={"rope_type": "linear"}), "factor"),
    (_qwen3_raw(num_key_value_heads=3), "num_key_value_heads"),
    (_qwen3_raw(hidden_size=0), "hidden_size"),
    (_qwen3_raw(eos_token_id="x"), "eos_token_id"),
    (_qwen3_raw(attention_bias=True), "attention_bias"),
    (_qwen3_raw(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_config_errors_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_shards_named_in_index_must_exist(tiny_model_dir, tmp_path):
    sharded = write_sharded_copy(tiny_model_dir, tmp_path / "s")
    (tmp_path / "s" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load(sharded)
