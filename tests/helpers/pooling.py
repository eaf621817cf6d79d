"""Models and references for the pooling tests: a tiny Qwen3Model (an embedding model's layout), a tiny
causal LM whose tokenizer has the reranker's "yes" and "no", and transformers' answers for both."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve_core.models.tiny import make_tiny_model

LABELS = ("yes", "no")


def make_embedding_model(out_dir, seed: int = 0, **overrides) -> str:
    """A Qwen3Model checkpoint as Qwen3-Embedding ships it (architectures ["Qwen3Model"], no lm_head, tensors
    without `model.`), with the tiny tokenizer."""
    return make_tiny_model(out_dir, seed=seed, embedding=True, **overrides)


def make_reranker_model(src_dir, out_dir) -> str:
    """A copy of a tiny causal LM (vocab_size above the tokenizer's 1024) whose tokenizer also has the tokens
    "yes" and "no", as Qwen's vocabulary does."""
    from tokenizers import Tokenizer
    out = Path(out_dir)
    shutil.copytree(src_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens(list(LABELS))
    tok.save(str(out / "tokenizer.json"))
    return str(out)


def hf_embeddings(model_dir, prompts, dimensions=None, normalize=True) -> list[torch.Tensor]:
    """transformers' Qwen3Model, float32: each prompt's last hidden state, truncated then L2-normalised."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model(torch.tensor([p])).last_hidden_state[0, -1]
            h = h[:dimensions] if dimensions is not None else h
            out.append(F.normalize(h, dim=-1) if normalize else h)
    return out


def hf_label_logits(model_dir, prompts, token_ids) -> list[list[float]]:
    """transformers' Qwen3ForCausalLM, float32: the last position's logits of token_ids, per prompt."""
    from transformers import Qwen3ForCausalLM
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1, list(token_ids)].tolist() for p in prompts]
