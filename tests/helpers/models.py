"""Checkpoints and prompts several test modules share."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# The shipped trained tiny pair (a Qwen3 and its EAGLE-3 draft), which `make demo` serves.
TRAINED_PAIR = Path(__file__).resolve().parents[2] / "llmserve_core/data/trained_pair"
# A mid-sized Qwen3 for the GPU tests: big enough for the fused kernels' tiles, small enough to load fast.
MID = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)


def write_sharded_copy(src_dir, out_dir, num_shards: int = 2) -> str:
    """Copy a single-file checkpoint into num_shards files plus model.safetensors.index.json, as
    transformers writes large checkpoints. Non-weight files are copied unchanged."""
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copyfile(f, out / f.name)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {name: f.get_tensor(name) for name in names}
    per_shard = (len(names) + num_shards - 1) // num_shards
    weight_map, total = {}, 0
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per_shard:(i + 1) * per_shard]}
        save_file(part, str(out / shard_name), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = shard_name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return str(out)


def rewrite_weights(path, edit):
    """Apply edit(dict of tensors) to model.safetensors in place."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def make_prompts(vocab, seed):
    rnd = random.Random(seed)
    shared = [rnd.randrange(vocab) for _ in range(13)]
    prompts = [shared + [rnd.randrange(vocab) for _ in range(n)] for n in (1, 6, 19)]   # shared prefix
    prompts += [[rnd.randrange(vocab) for _ in range(n)] for n in (1, 3, 30)]
    return prompts


def varied_prompts(vocab, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 64, 130, 9, 257][:n]
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]


def held_out_prompts(n: int, length: int = 24) -> list[list[int]]:
    from tokenizers import Tokenizer

    from llmserve_core.data import corpus_paragraphs
    tok = Tokenizer.from_file(str(TRAINED_PAIR / "target/tokenizer.json"))
    held = [p for i, p in enumerate(corpus_paragraphs()) if i % 20 == 19]      # as the training script splits
    return [ids[:length] for ids in (tok.encode(t).ids for t in held) if len(ids) >= length][:n]


def hf_greedy_generate(hf, prompt, max_new):
    """transformers' greedy continuation of `prompt` on the model's device (generate, no stop tokens)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=max_new, do_sample=False,
                          min_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
