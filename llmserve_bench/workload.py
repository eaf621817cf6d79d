"""What the benchmark sends: prompts as token ids of exact lengths, and their output lengths.

A Workload hands out RequestSpecs one after another from a seeded generator, so a finite run takes the first
N and a closed loop takes as many as it needs, and the same --seed gives the same requests.
Prompt sources: random valid token ids (no special tokens), natural text from the corpus the repo ships
(cut to exact length by the model's tokenizer), or a ShareGPT-format dataset. A --mix draws each request's
(input, output) lengths from weighted classes; --shared-prefix-len makes the first tokens of every prompt one
of --num-prefixes shared prefixes (prefix-cache studies).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    group: str = ""


@dataclass
class MixEntry:
    weight: float
    input_len: int
    output_len: int


@dataclass
class WorkloadConfig:
    prompt_mode: str = "random"          # random | natural
    input_len: int = 128
    output_len: int | None = 128         # None: from the dataset
    mix: list[MixEntry] = field(default_factory=list)
    dataset: str | None = None
    shared_prefix_len: int = 0
    num_prefixes: int = 1
    seed: int = 0


def parse_mix(text: str) -> list[MixEntry]:
    """"0.8:128:128,0.2:4096:128" -> weighted (input, output) classes; ValueError names the bad part."""
    entries = []
    for part in text.split(","):
        bits = part.strip().split(":")
        if len(bits) != 3:
            raise ValueError(f"--mix: expected WEIGHT:INPUT_LEN:OUTPUT_LEN entries separated by commas, got {part!r}")
        try:
            w, i, o = float(bits[0]), int(bits[1]), int(bits[2])
        except ValueError:
            raise ValueError(f"--mix: {part!r}: weight must be a number and lengths integers") from None
        if not w > 0 or w == float("inf"):
            raise ValueError(f"--mix: {part!r}: weight must be a positive number")
        if i < 1 or o < 1:
            raise ValueError(f"--mix: {part!r}: lengths must be >= 1")
        entries.append(MixEntry(w, i, o))
    return entries


def length_classes(cfg: WorkloadConfig) -> list[tuple[int, int]]:
    """(input, output) pairs the workload can produce without a dataset."""
    if cfg.mix:
        return [(m.input_len, m.output_len) for m in cfg.mix]
    return [(cfg.input_len, cfg.output_len)]


def check_lengths(cfg: WorkloadConfig, max_model_len: int) -> None:
    """Raise ValueError when a prompt plus its output cannot fit the model (checked before anything is sent)."""
    if cfg.dataset:
        return    # dataset entries that do not fit are dropped when the dataset is loaded
    for i, o in length_classes(cfg):
        if i + o > max_model_len:
            raise ValueError(f"input length {i} + output length {o} = {i + o} exceeds the model's "
                             f"max_model_len {max_model_len}")


# ---------------------------------------------------------------- tokenizer (no torch, no core import)

class TokenizerInfo:
    """The model's tokenizer through the `tokenizers` library (tokenizer.json), else transformers."""

    def __init__(self, path: str):
        self.path = path
        tj = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tj):
            from tokenizers import Tokenizer
            self._tok = Tokenizer.from_file(tj)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            with open(tj, encoding="utf-8") as f:
                added = json.load(f).get("added_tokens", [])
            self.special_ids = {t["id"] for t in added if t.get("special")}
            self._encode = lambda s: self._tok.encode(s, add_special_tokens=False).ids
        else:
            from transformers import AutoTokenizer
            self._tok = AutoTokenizer.from_pretrained(path)
            self.vocab_size = len(self._tok)
            self.special_ids = set(self._tok.all_special_ids)
            self._encode = lambda s: self._tok.encode(s, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))


def corpus_path() -> Path:
    """llmserve_core/data/corpus.txt, found without importing llmserve_core (which would import torch)."""
    spec = importlib.util.find_spec("llmserve_core")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("natural prompts need llmserve_core/data/corpus.txt, and llmserve_core is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "corpus.txt"


def corpus_token_ids(tok: TokenizerInfo) -> list[int]:
    text = corpus_path().read_text(encoding="utf-8")
    body = "\n".join(line for line in text.split("\n") if not line.startswith("#"))
    return tok.encode(body)


def load_sharegpt(path: str, tok: TokenizerInfo, max_model_len: int, output_len: int | None) -> list[tuple[list[int], int]]:
    """ShareGPT JSON ([{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]) ->
    (prompt ids, output length): first human turn and the length of the reply that follows (or output_len).
    Entries that do not fit max_model_len, or have no reply to measure, are dropped."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--dataset: {path} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset: {path}: expected a JSON list of ShareGPT conversations")
    out = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < (1 if output_len else 2):
            continue
        prompt = conv[0].get("value") if isinstance(conv[0], dict) else None
        if not isinstance(prompt, str) or not prompt:
            continue
        ids = tok.encode(prompt)
        if output_len:
            n_out = output_len
        else:
            reply = conv[1].get("value") if isinstance(conv[1], dict) else None
            n_out = len(tok.encode(reply)) if isinstance(reply, str) else 0
        if not ids or n_out < 1 or len(ids) + n_out > max_model_len:
            continue
        out.append((ids, n_out))
    if not out:
        raise ValueError(f"--dataset: {path}: no conversation has a prompt and reply that fit max_model_len {max_model_len}")
    return out


# ---------------------------------------------------------------- the workload

class Workload:
    def __init__(self, cfg: WorkloadConfig, *, vocab_size: int, special_ids=(), tokenizer: TokenizerInfo | None = None,
                 max_model_len: int = 1 << 30):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.allowed = [t for t in range(vocab_size) if t not in set(special_ids)]
        if not self.allowed:
            raise ValueError("the vocabulary has no non-special tokens")
        self.corpus: list[int] | None = None
        self.dataset: list[tuple[list[int], int]] | None = None
        if cfg.dataset:
            self.dataset = load_sharegpt(cfg.dataset, tokenizer, max_model_len, cfg.output_len)
        elif cfg.prompt_mode == "natural":
            self.corpus = corpus_token_ids(tokenizer)
            longest = max(i for i, _ in length_classes(cfg))
            if len(self.corpus) < longest:
                raise ValueError(f"the corpus has {len(self.corpus)} tokens, fewer than the input length {longest}")
        self.prefixes = [self._tokens(cfg.shared_prefix_len) for _ in range(cfg.num_prefixes)] \
            if cfg.shared_prefix_len else []
        self._order: list[int] = []       # dataset indices still to hand out in this pass
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        if self.corpus is not None:
            start = self.rng.randrange(len(self.corpus) - n + 1)
            return self.corpus[start:start + n]
        return self.rng.choices(self.allowed, k=n)

    def next(self) -> RequestSpec:
        self.count += 1
        if self.dataset is not None:
            # Each entry once per pass, in a seeded order (as vLLM samples ShareGPT): drawing with replacement
            # repeats prompts early, and a repeat is served from the prefix cache.
            if not self._order:
                self._order = list(range(len(self.dataset)))
                self.rng.shuffle(self._order)
            ids, n_out = self.dataset[self._order.pop()]
            return RequestSpec(list(ids), n_out, "dataset")
        cfg = self.cfg
        if cfg.mix:
            k = self.rng.choices(range(len(cfg.mix)), weights=[m.weight for m in cfg.mix])[0]
            n_in, n_out, group = cfg.mix[k].input_len, cfg.mix[k].output_len, f"{cfg.mix[k].input_len}:{cfg.mix[k].output_len}"
        else:
            n_in, n_out, group = cfg.input_len, cfg.output_len, ""
        if self.prefixes:
            prefix = self.prefixes[self.rng.randrange(len(self.prefixes))]
            ids = prefix + self._tokens(n_in - len(prefix))
        else:
            ids = self._tokens(n_in)
        return RequestSpec(ids, n_out, group)

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next() for _ in range(n)]
