"""The tiny model directory is a real Hugging Face Qwen3 checkpoint with a working tokenizer,
written deterministically and quickly; the shipped corpus it is trained from is clean and licensed."""
import filecmp
import platform
import time

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from llmserve_core.data import CORPUS_PATH, corpus_paragraphs
from llmserve_core.models.config import ModelConfig
from llmserve_core.models.tiny import make_tiny_model

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_directory_is_a_hf_qwen3_checkpoint(tiny_model_dir):
    hf = AutoConfig.from_pretrained(tiny_model_dir)
    assert hf.model_type == "qwen3" and hf.architectures == ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.max_position_embeddings == 2048 and cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_ids == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        emb = f.get_tensor("model.embed_tokens.weight")
    assert abs(emb.std().item() - 0.02) < 0.002  # transformers' own init, not zeros or constants


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_model_dir):
    start = time.perf_counter()
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert time.perf_counter() - start < 15
    for name in FILES:
        assert filecmp.cmp(f"{tiny_model_dir}/{name}", f"{again}/{name}", shallow=False), name
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert not filecmp.cmp(f"{tiny_model_dir}/model.safetensors", f"{other}/model.safetensors", shallow=False)
    assert filecmp.cmp(f"{tiny_model_dir}/tokenizer.json", f"{other}/tokenizer.json", shallow=False)


def test_overrides_reach_config(tmp_path):
    path = make_tiny_model(tmp_path / "m", seed=0, num_hidden_layers=3, tie_word_embeddings=False, vocab_size=1100,
                           rope_scaling={"rope_type": "yarn", "factor": 2.0})
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.num_hidden_layers == 3 and not cfg.tie_word_embeddings and cfg.vocab_size == 1100
    assert cfg.rope_scaling["rope_type"] == "yarn"


def test_tokenizer_round_trip(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = list(corpus_paragraphs()[:50]) + ["naïve café — 東京 🙂\ttabs\n\nnewlines  spaces", ""]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Trained on the corpus: its prose compresses well below one token per byte.
    sample = " ".join(corpus_paragraphs()[:200])
    assert len(tok.encode(sample)) < 0.5 * len(sample.encode())
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_chat_template_is_chatml(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 2


def test_transformers_generates_from_the_directory(tiny_model_dir):
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_corpus_is_licensed_prose_of_useful_size():
    raw = CORPUS_PATH.read_text(encoding="utf-8")
    assert 200_000 <= len(raw.encode()) <= 500_000
    assert "Python Software Foundation" in raw.splitlines()[1] and "PSF License" in raw.splitlines()[2]
    paragraphs = corpus_paragraphs()
    assert len(paragraphs) > 1000 and len(set(paragraphs)) == len(paragraphs)
    assert not any(p.startswith((">>>", "#")) for p in paragraphs)


def test_corpus_regenerates_identically():
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_corpus", CORPUS_PATH.parents[2] / "scripts/build_corpus.py")
    build_corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_corpus)
    raw = CORPUS_PATH.read_text(encoding="utf-8")
    version = platform.python_version()
    if f"Python {version} standard" not in raw.splitlines()[0]:
        import pytest
        pytest.skip(f"corpus was built from another Python version than {version}")
    assert build_corpus.build(400_000) == raw


def test_make_tiny_model_moe_writes_a_qwen3_moe_checkpoint(tmp_path):
    """`make-tiny-model --moe`: transformers' own Qwen3MoeForCausalLM, seeded and byte-identical per seed, each
    expert apart as Qwen's releases store them."""
    from llmserve_core.cli import main
    assert main(["make-tiny-model", str(tmp_path / "m"), "--moe", "--seed", "2", "--untied"]) == 0
    hf = AutoConfig.from_pretrained(tmp_path / "m")
    assert hf.model_type == "qwen3_moe" and hf.architectures == ["Qwen3MoeForCausalLM"]
    cfg = ModelConfig.from_hf_dir(tmp_path / "m")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 32, True)
    assert not cfg.tie_word_embeddings and all(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    with safe_open(f"{tmp_path}/m/model.safetensors", framework="pt") as f:
        assert tuple(f.get_slice("model.layers.1.mlp.experts.7.down_proj.weight").get_shape()) == (64, 32)
    again = make_tiny_model(tmp_path / "again", seed=2, moe=True, tie_word_embeddings=False)
    assert filecmp.cmp(f"{tmp_path}/m/model.safetensors", f"{again}/model.safetensors", shallow=False)
