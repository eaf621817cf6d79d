"""Which speculation method a configuration asks for, its n-gram bounds, and vLLM's `--speculative-config`
JSON spelled as llmserve's fields, so a vLLM command line carries over.

Methods: eagle3 (an EAGLE-3 draft head, --speculative-model; the default when a model is named) and ngram
(prompt lookup: no model, see ngram.py). The n-gram bounds follow vLLM's rule: with neither given both are
5, with one given the other takes its value.
"""
from __future__ import annotations

import json

from llmserve_core.speculative.shape import MAX_DEPTH

METHODS = ("eagle3", "ngram")
DEFAULT_LOOKUP = 5           # vLLM's, for both bounds when neither is given
MAX_LOOKUP = 32              # well past what pays; each token indexes (max - min + 1) n-grams

# vLLM's key -> the EngineConfig field it sets.
VLLM_KEYS = {"method": "speculative_method", "model": "speculative_model",
             "num_speculative_tokens": "speculative_gamma", "prompt_lookup_min": "prompt_lookup_min",
             "prompt_lookup_max": "prompt_lookup_max"}
# Keys vLLM takes that llmserve does not (named in the error, so it reads as unsupported, not as a typo).
VLLM_UNSUPPORTED = ("draft_tensor_parallel_size", "tensor_parallel_size", "quantization", "max_model_len",
                    "revision", "code_revision", "disable_padded_drafter_batch", "disable_by_batch_size",
                    "speculative_token_tree", "parallel_drafting", "enforce_eager", "draft_load_config",
                    "rejection_sample_method", "draft_sampling_method", "suffix_decoding_max_tree_depth",
                    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                    "suffix_decoding_min_token_prob", "moe_backend", "use_local_argmax_reduction")
# vLLM's spellings of the n-gram method.
NGRAM_NAMES = ("ngram", "[ngram]")


def parse_vllm_config(value) -> dict:
    """vLLM's speculative config (a JSON object, or a dict) -> {EngineConfig field: value}. ValueError naming
    speculative_config and the key at fault for anything llmserve cannot honour."""
    where = "speculative_config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON object, got {type(value).__name__}")
    out = {}
    for key, v in value.items():
        if key in VLLM_UNSUPPORTED:
            raise ValueError(f"{where}: key {key!r} (a vLLM setting) is not supported; llmserve takes "
                             f"{', '.join(VLLM_KEYS)}")
        if key not in VLLM_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; llmserve takes {', '.join(VLLM_KEYS)}")
        if key in ("method", "model"):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{where}: key {key!r} must be a non-empty string, got {v!r}")
        else:
            high = MAX_DEPTH if key == "num_speculative_tokens" else MAX_LOOKUP
            if not _is_int(v) or not 1 <= v <= high:
                raise ValueError(f"{where}: key {key!r} must be an integer in [1, {high}], got {v!r}")
        out[VLLM_KEYS[key]] = v
    method, model = out.get("speculative_method"), out.get("speculative_model")
    if model in NGRAM_NAMES and method in (None, "ngram"):      # vLLM's older spelling: model "[ngram]"
        del out["speculative_model"]
        out["speculative_method"] = method = "ngram"
    if method in NGRAM_NAMES:
        out["speculative_method"] = method = "ngram"
    if method is None:
        if model is None:
            raise ValueError(f"{where}: key 'method' is needed without a 'model' (one of {', '.join(METHODS)})")
        out["speculative_method"] = "eagle3"          # the one method that reads a model
    elif method not in METHODS:
        raise ValueError(f"{where}: key 'method': {method!r} is not supported; llmserve serves "
                         f"{' and '.join(METHODS)}")
    return out


def merge_vllm_config(config) -> None:
    """Set config's speculative fields from config.speculative_config; a field also given directly must agree
    (speculative_gamma and speculative_num_steps being one setting)."""
    for name, v in parse_vllm_config(config.speculative_config).items():
        given = ([config.speculative_gamma, config.speculative_num_steps] if name == "speculative_gamma"
                 else [getattr(config, name)])
        clash = next((g for g in given if g is not None and g != v), None)
        if clash is not None:
            key = next(k for k, f in VLLM_KEYS.items() if f == name)
            raise ValueError(f"speculative_config: key {key!r} is {v!r} but {name} is {clash!r}: set it once")
        if name != "speculative_gamma" or config.speculative_num_steps is None:
            setattr(config, name, v)


def resolved_method(method: str | None, model: str | None) -> str | None:
    """The method a config's fields ask for (None: no speculation)."""
    if method is None:
        return "eagle3" if model is not None else None
    if method not in METHODS:
        raise ValueError(f"speculative_method: {method!r} is not one of {', '.join(METHODS)}")
    return method


def lookup_bounds(lo: int | None, hi: int | None) -> tuple[int, int]:
    """(prompt_lookup_min, prompt_lookup_max) with vLLM's defaults, checked."""
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if v is not None and (not _is_int(v) or not 1 <= v <= MAX_LOOKUP):
            raise ValueError(f"{name}: must be an integer in [1, {MAX_LOOKUP}], got {v!r}")
    lo, hi = (lo if lo is not None else hi or DEFAULT_LOOKUP), (hi if hi is not None else lo or DEFAULT_LOOKUP)
    if lo > hi:
        raise ValueError(f"prompt_lookup_min: {lo} exceeds prompt_lookup_max {hi}")
    return lo, hi


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
