"""Prompt lookup's index (speculative/ngram.py) against a full scan, the proposals it makes, verification of
per-request draft counts at a fixed row stride, and the configuration: --speculative-method,
--prompt-lookup-min/max and vLLM's --speculative-config, on the command line too."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from llmserve_core import EngineConfig
from llmserve_core.speculative.ngram import NgramIndex, extend_all, reference_match
from llmserve_core.speculative.verify import greedy_verify, rejection_sample_verify


# ---- the index ------------------------------------------------------------------------------------------

def indexed(tokens: list[int], lo: int, hi: int) -> NgramIndex:
    index = NgramIndex(lo, hi)
    index.extend(tokens, len(tokens))
    return index


@pytest.mark.parametrize("seed", range(4))
def test_the_index_finds_what_a_full_scan_finds_as_tokens_arrive(seed):
    """Batches of sequences over small vocabularies (many matches), grown by runs of 0 to 300 tokens (the
    first n-grams running off the start, single tokens, bulk runs), each checked after every update."""
    rnd = random.Random(seed)
    for _ in range(25):
        lo = rnd.randint(1, 4)
        hi = rnd.randint(lo, 7)
        vocab = rnd.choice([2, 3, 7, 1000])
        seqs = [[] for _ in range(rnd.randint(1, 4))]
        indexes = [NgramIndex(lo, hi) for _ in seqs]
        for _ in range(6):
            for s in seqs:
                s += [rnd.randrange(vocab) for _ in range(rnd.choice([0, 1, 2, 3, 9, 80, 300]))]
            extend_all(indexes, seqs, [len(s) for s in seqs])
            for s, index in zip(seqs, indexes):
                assert index.length == len(s) and index.match == reference_match(s, lo, hi), (lo, hi, s)


def test_the_longest_n_gram_wins_then_the_latest_occurrence():
    # "7 1 2 3" ends at 4; "1 2 3" alone (after 9) is later, at 9; the suffix is "7 1 2 3".
    tokens = [7, 1, 2, 3, 50, 9, 1, 2, 3, 60, 7, 1, 2, 3]
    assert indexed(tokens, 2, 4).match == 4                 # the 4-gram, though a 3-gram occurs later
    assert indexed(tokens, 2, 3).match == 9                 # capped at 3: the latest of the 3-grams
    assert indexed(tokens + [1, 2, 3], 2, 4).match == 14    # no earlier "3 1 2 3": the latest "1 2 3"
    assert indexed([5, 6, 7], 1, 3).match == -1


def test_proposals_copy_what_followed_and_repeat_a_run_that_reaches_the_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    index = indexed(tokens, 2, 2)
    assert index.match == 2 and index.propose(tokens, 3) == [3, 4, 5]
    assert index.propose(tokens, 0) == [] and len(index.propose(tokens, 32)) == 32
    # The latest "8 9" ends right before the suffix: the copy runs into the end and repeats what it proposes.
    loop = [8, 9, 8, 9]
    index = indexed(loop, 2, 2)
    assert index.match == 2 and index.propose(loop, 5) == [8, 9, 8, 9, 8]
    assert indexed([1, 2, 3], 1, 2).propose([1, 2, 3], 4) == []


def test_a_hash_collision_never_proposes_from_the_wrong_place():
    """A match is checked token for token: an entry pointing somewhere else (what a collision would leave)
    is skipped, for a shorter n-gram's real occurrence or none."""
    rnd = random.Random(1)
    tokens = [rnd.randrange(50) for _ in range(400)]
    index = indexed(tokens, 1, 4)
    for key in index.last:
        index.last[key] = rnd.randrange(1, len(tokens))
    tokens.append(tokens[100])
    index.extend(tokens, len(tokens))
    m = index.match
    assert m == -1 or tokens[m - 1] == tokens[-1]


def test_a_long_prompt_indexed_at_once_matches_a_scan():
    rnd = random.Random(2)
    base = [rnd.randrange(5000) for _ in range(300)]
    tokens = []
    while len(tokens) < 20000:
        i = rnd.randrange(250)
        tokens += base[i:i + rnd.randrange(3, 50)] + [rnd.randrange(5000)]
    tokens += base[40:44]
    index = indexed(tokens, 2, 5)
    assert index.match == reference_match(tokens, 2, 5) > 0


@pytest.mark.parametrize("lo, hi", [(0, 3), (3, 2), (2, 65)])
def test_bad_bounds_name_the_field(lo, hi):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(lo, hi)


# ---- verification of fewer drafts than the depth ----------------------------------------------------------

def test_padded_rows_verify_as_the_packed_ones_do():
    """Requests proposing 0..K drafts, their rows K + 1 apart (padding after the drafts): greedy and rejection
    sampling give what the packed layout gives for the same rows, and never accept a padding draft."""
    torch.manual_seed(0)
    k, vocab = 4, 11
    num_draft = torch.tensor([0, 4, 2, 0, 1])
    drafts = torch.randint(0, vocab, (5, k))
    logits = torch.randn(5 * (k + 1), vocab)
    drafts[1] = logits.view(5, k + 1, vocab)[1, :k].argmax(-1)      # every draft of request 1 right
    drafts[0] = logits.view(5, k + 1, vocab)[0, :k].argmax(-1)      # request 0 proposed none: padding, never taken
    packed_rows = torch.cat([torch.arange(b * (k + 1), b * (k + 1) + n + 1) for b, n in enumerate(num_draft.tolist())])
    strided = greedy_verify(logits, drafts, num_draft, row_stride=k + 1)
    packed = greedy_verify(logits[packed_rows], drafts, num_draft)
    assert strided.token_lists() == packed.token_lists()
    assert strided.num_accepted.tolist()[:2] == [0, 4] and (strided.num_accepted <= num_draft).all()
    probs = torch.softmax(logits, -1)
    torch.manual_seed(1)
    strided = rejection_sample_verify(probs, drafts, num_draft, None, row_stride=k + 1)
    torch.manual_seed(1)
    packed = rejection_sample_verify(probs[packed_rows], drafts, num_draft, None)
    assert strided.token_lists() == packed.token_lists() and (strided.num_accepted <= num_draft).all()
    with pytest.raises(ValueError, match="row_stride"):
        greedy_verify(logits[:-1], drafts, num_draft, row_stride=k + 1)


# ---- configuration --------------------------------------------------------------------------------------

def config(**kw) -> EngineConfig:
    cfg = EngineConfig(model="m", **kw)
    cfg.validate()
    return cfg


def test_methods_and_lookup_bounds_resolve_as_vllm_does():
    assert config().resolved_speculative_method() is None
    assert config(speculative_model="d").resolved_speculative_method() == "eagle3"
    ngram = config(speculative_method="ngram")
    assert ngram.resolved_speculative_method() == "ngram" and ngram.lookup_bounds() == (5, 5)
    assert config(speculative_method="ngram", prompt_lookup_max=4).lookup_bounds() == (4, 4)
    assert config(speculative_method="ngram", prompt_lookup_min=2).lookup_bounds() == (2, 2)
    assert config(speculative_method="ngram", prompt_lookup_min=2, prompt_lookup_max=4).lookup_bounds() == (2, 4)
    assert config(speculative_method="ngram", speculative_gamma=8).draft_shape().depth == 8


@pytest.mark.parametrize("kw, field", [
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="eagle3"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_model="d"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_tree="eagle-small"), "speculative_tree"),
    (dict(speculative_method="ngram", speculative_eagle_topk=2), "speculative_eagle_topk"),
    (dict(prompt_lookup_max=3), "prompt_lookup_max"),
    (dict(speculative_model="d", prompt_lookup_min=3), "prompt_lookup_min"),
    (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="ngram", speculative_gamma=0), "speculative_gamma"),
    (dict(speculative_method="ngram", speculative_gamma=33), "speculative_gamma"),
    *[(dict(speculative_method="ngram", prompt_lookup_min=v), "prompt_lookup_min")
      for v in (0, -1, 33, 2 ** 63, -2 ** 63, 2 ** 64, math.nan, math.inf, 1e-300, 2.0, True, "3")],
    *[(dict(speculative_method="ngram", prompt_lookup_max=v), "prompt_lookup_max") for v in (0, 2 ** 64, math.nan)],
])
def test_bad_settings_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        config(**kw)


def test_vllm_speculative_configs_carry_over():
    ngram = config(speculative_config='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                                      '"prompt_lookup_min": 2}')
    assert (ngram.resolved_speculative_method(), ngram.draft_shape().depth, ngram.lookup_bounds()) == ("ngram", 5, (2, 4))
    eagle = config(speculative_config={"method": "eagle3", "model": "/d", "num_speculative_tokens": 3})
    assert (eagle.resolved_speculative_method(), eagle.speculative_model, eagle.draft_shape().depth) == ("eagle3", "/d", 3)
    assert config(speculative_config={"model": "/d"}).resolved_speculative_method() == "eagle3"
    assert config(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2}).speculative_model is None
    # A field given beside the JSON must agree with it (the two names of the depth are one setting).
    same = config(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, speculative_num_steps=4)
    assert same.draft_shape().depth == 4


@pytest.mark.parametrize("value, needle", [
    ('{"method": "ngram", "lookup": 3}', "unknown key 'lookup'"),
    ('{"method": "ngram", "quantization": "fp8"}', "key 'quantization' (a vLLM setting) is not supported"),
    ('{"method": "eagle", "model": "/d"}', "key 'method': 'eagle' is not supported"),
    ('{"method": "medusa"}', "key 'method': 'medusa'"),
    ('{"method": 3}', "key 'method' must be a non-empty string"),
    ('{"num_speculative_tokens": 3}', "key 'method' is needed"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "key 'num_speculative_tokens' must be an integer in"),
    ('{"method": "ngram", "num_speculative_tokens": 1e400}', "key 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": NaN}', "key 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": 18446744073709551616}', "key 'num_speculative_tokens'"),
    ('{"method": "ngram", "num_speculative_tokens": "5"}', "key 'num_speculative_tokens'"),
    ('{"method": "ngram", "prompt_lookup_max": -1}', "key 'prompt_lookup_max'"),
    ('{"method": "ngram", "prompt_lookup_min": true}', "key 'prompt_lookup_min'"),
    ('{"method": "ngram",', "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
])
def test_bad_vllm_configs_name_the_key(value, needle):
    with pytest.raises(ValueError, match=r"^speculative_config: ") as e:
        config(speculative_config=value)
    assert needle in str(e.value)


def test_a_flag_that_disagrees_with_the_json_is_refused():
    with pytest.raises(ValueError, match="key 'num_speculative_tokens' is 5 but speculative_gamma is 3"):
        config(speculative_config={"method": "ngram", "num_speculative_tokens": 5}, speculative_gamma=3)
    with pytest.raises(ValueError, match="key 'method' is 'ngram' but speculative_method is 'eagle3'"):
        config(speculative_config={"method": "ngram"}, speculative_method="eagle3")


def test_the_command_line_takes_the_flags_and_vllms_json(tiny_model_dir, tmp_path, capsys):
    from llmserve_core.cli import parse_serve_args
    listen = ["--model", tiny_model_dir, "--listen", f"ipc://{tmp_path}/core.sock"]
    cfg, _, _ = parse_serve_args(listen + ["--speculative-method", "ngram", "--speculative-gamma", "5",
                                           "--prompt-lookup-min", "2", "--prompt-lookup-max", "4"])
    assert (cfg.resolved_speculative_method(), cfg.draft_shape().depth, cfg.lookup_bounds()) == ("ngram", 5, (2, 4))
    vllm = json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    cfg, _, _ = parse_serve_args(listen + ["--speculative-config", vllm])
    assert (cfg.resolved_speculative_method(), cfg.draft_shape().depth, cfg.lookup_bounds()) == ("ngram", 5, (2, 4))
    for bad, needle in ((["--speculative-config", '{"method": "ngram", "x": 1}'], "--speculative-config: unknown key 'x'"),
                        (["--speculative-method", "ngram", "--prompt-lookup-min", "0"], "--prompt-lookup-min: must be"),
                        (["--speculative-method", "ngram", "--prompt-lookup-max", "nan"], "--prompt-lookup-max")):
        with pytest.raises(SystemExit) as e:
            parse_serve_args(listen + bad)
        assert e.value.code == 2 and needle in capsys.readouterr().err
