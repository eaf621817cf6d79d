"""Speculative decoding algorithms that do not need the engine: verification, trees, metrics,
and the EAGLE-3 draft model in the speculators format."""
from __future__ import annotations

import math

import pytest
import torch

from helpers.distribution import chi2_critical
from llmserve_core.layers.sampler import SamplingTensors, sampling_probs
from llmserve_proto import SamplingParams
from llmserve_core.speculative.types import SpecMetrics, SpecStepResult
from llmserve_core.speculative.verify import greedy_verify, rejection_sample_verify, verify_probs


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    n = counts.sum()
    expected = probs.double() * n
    assert counts[expected == 0].sum() == 0, "sampled a token of probability zero"
    live = expected > 0
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof: counts {counts.tolist()} expected {expected.tolist()}"


def one_hot_logits(ids, vocab):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


# ---- target distribution for verification ------------------------------------------------------

def sampling_tensors(params_list):
    return SamplingTensors.from_params(params_list, "cpu")


def test_verify_probs_match_sampler_and_make_greedy_rows_one_hot():
    logits = torch.randn(3, 11)
    st = sampling_tensors([SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=4),
                           SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
    probs = verify_probs(logits, st)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(logits[0].argmax(), 11).float())
    torch.testing.assert_close(probs[1:], sampling_probs(logits, st)[1:])
    assert int((probs[1] > 0).sum()) == 4


# ---- greedy verification --------------------------------------------------------------------------

def test_greedy_verify_exact_cases():
    vocab = 10
    # Request 0: drafts 3,4,5 vs target 3,4,9,(7): accepts 2, corrects with 9.
    # Request 1: drafts 1,2 vs target 1,2,(8): all accepted, bonus 8.
    # Request 2: no drafts: just the target's token 6.
    # Request 3: drafts 5 vs target 0: nothing accepted, correction 0.
    target = [3, 4, 9, 7, 1, 2, 8, 6, 0, 1]
    drafts = torch.tensor([[3, 4, 5], [1, 2, -1], [-1, -1, -1], [5, -1, -1]])
    out = greedy_verify(one_hot_logits(target, vocab), drafts, torch.tensor([3, 2, 0, 1]))
    assert out.num_accepted.tolist() == [2, 2, 0, 0]
    assert out.token_lists() == [[3, 4, 9], [1, 2, 8], [6], [0]]
    assert out.token_ids[2].tolist() == [6, -1, -1, -1]


def test_greedy_verify_rejects_bad_layout():
    with pytest.raises(ValueError, match="target rows"):
        greedy_verify(torch.randn(3, 5), torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]))
    with pytest.raises(ValueError, match="num_draft"):
        greedy_verify(torch.randn(5, 5), torch.zeros(1, 3, dtype=torch.long), torch.tensor([4]))


def test_rejection_sampling_with_greedy_rows_equals_greedy_verify():
    torch.manual_seed(0)
    vocab, k = 7, 3
    num_draft = torch.tensor([3, 1, 0, 2])
    logits = torch.randn(int((num_draft + 1).sum()), vocab)
    drafts = torch.randint(0, vocab, (4, k))
    # Make some drafts right so acceptance paths are exercised.
    drafts[0, :2] = logits[:2].argmax(-1)
    n = len(logits)
    probs = verify_probs(logits, sampling_tensors([SamplingParams(temperature=0.0)] * n))
    q = torch.softmax(torch.randn(int(num_draft.sum()), vocab), -1)
    greedy = greedy_verify(logits, drafts, num_draft)
    for draft_probs in (None, q):
        sampled = rejection_sample_verify(probs, drafts, num_draft, draft_probs)
        assert sampled.token_lists() == greedy.token_lists()


# ---- rejection sampling is lossless ------------------------------------------------------------------

@pytest.mark.parametrize("draft_kind", ["sampled", "argmax"])
def test_rejection_sampling_output_distribution_equals_target(draft_kind):
    torch.manual_seed(1)
    vocab, trials = 6, 40000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, -1)   # target rows 0, 1 (after draft 1), 2 (bonus)
    p[0, 5] = 0.0                                          # a token the target never emits
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(2, vocab) * 1.5, -1)    # arbitrary draft distributions, unrelated to p
    if draft_kind == "sampled":
        drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True) for j in range(2)], 1)
        draft_probs = q.repeat(trials, 1)
    else:
        drafts = q.argmax(-1).repeat(trials, 1)
        draft_probs = None
    out = rejection_sample_verify(p.repeat(trials, 1), drafts, torch.full((trials,), 2), draft_probs)
    first = out.token_ids[:, 0]
    assert_distribution(first, p[0])
    # Given the first draft was kept, the next token must follow the target's next row.
    second = out.token_ids[out.num_accepted >= 1, 1]
    assert_distribution(second, p[1])
    third = out.token_ids[out.num_accepted == 2, 2]
    assert_distribution(third, p[2])


def test_rejection_sampling_seeded_requests_are_reproducible_across_batches():
    """A seeded request's chain verification emits the plain sampler's tokens at its positions, alone or
    beside another request, for any draft; different seeds give different tokens."""
    from llmserve_core.layers.sampler import sample
    torch.manual_seed(2)
    vocab = 9
    logits = torch.randn(4, vocab)
    q = torch.softmax(torch.randn(3, vocab), -1)
    drafts = torch.multinomial(q, 1).T                       # [1, 3]

    def plain(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        return [int(sample(logits[j:j + 1], SamplingTensors.from_params([params], "cpu", positions=[20 + j]))
                    .token_ids[0]) for j in range(4)]

    def verify(seed, company: bool):
        params = SamplingParams(temperature=1.0, seed=seed)
        if not company:
            st = SamplingTensors.from_params([params], "cpu", positions=[20])
            return rejection_sample_verify(verify_probs(logits, st.repeat_rows(4)), drafts, torch.tensor([3]),
                                           q).token_lists()[0]
        other = torch.randn(2, vocab)
        st = SamplingTensors.from_params([SamplingParams(temperature=1.0), params], "cpu", positions=[5, 20])
        probs = verify_probs(torch.cat([torch.cat([other, other]), logits]), st.repeat_rows(4))
        probs = torch.cat([probs[:2], probs[4:]])            # the other request verified one draft
        return rejection_sample_verify(probs, torch.cat([torch.tensor([[0, -1, -1]]), drafts]),
                                       torch.tensor([1, 3]), torch.cat([q[:1], q])).token_lists()[1]

    for seed in range(20):
        alone, mixed, want = verify(seed, False), verify(seed, True), plain(seed)
        assert alone == mixed == want[:len(alone)]
        assert alone[:-1] == drafts[0, :len(alone) - 1].tolist()     # the accepted drafts, then a plain token
    assert len({tuple(plain(s)) for s in range(20)}) > 1


# ---- metrics ---------------------------------------------------------------------------------------

def test_metrics_accumulate():
    m = SpecMetrics()
    m.record([SpecStepResult([1, 2, 3], 3, 2), SpecStepResult([4], 3, 0)])
    m.record([SpecStepResult([5, 6, 7, 8], 3, 3)])
    assert m.num_steps == 3 and m.num_batches == 2
    assert m.acceptance_rate == pytest.approx(5 / 9)
    assert m.mean_acceptance_length == pytest.approx(8 / 3)
    assert m.per_position_acceptance == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    with m.timer("draft"):
        pass
    with pytest.raises(ValueError, match="timing key"):
        m.add_time("nope", 1.0)
    d = m.as_dict()
    assert d["spec_accepted_tokens_per_step"] == pytest.approx(2.5)
    with pytest.raises(ValueError, match="num_accepted"):
        SpecStepResult([1, 2], 0, 1)


# ---- trees -----------------------------------------------------------------------------------------

from llmserve_core.layers.batch import ForwardBatch  # noqa: E402
from llmserve_core.layers.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from llmserve_core.speculative.tree import (  # noqa: E402
    CandidateTree, batch_tree_mask, compact_kv, fill_level, get_tree, tree_greedy_verify, tree_kv_moves,
    tree_rejection_verify)


@pytest.mark.parametrize("name", ["chain", "eagle-small", "binary"])
@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_tree_structure_and_mask(name, gamma):
    tree = get_tree(name, gamma)
    assert tree.depth == gamma and tree.parents[0] == -1
    mask = tree.attention_mask()
    n = tree.num_nodes
    assert mask.shape == (n, n) and mask.diagonal().all()
    assert not mask.triu(1).any()                        # causal: a node never sees a later node
    assert mask.sum(1).tolist() == [d + 1 for d in tree.depths]
    for i in range(1, n):
        assert mask[i, tree.parents[i]]
        assert torch.equal(mask[i] & ~torch.nn.functional.one_hot(torch.tensor(i), n).bool(), mask[tree.parents[i]])
    if name == "chain":
        assert torch.equal(mask, torch.ones(n, n, dtype=torch.bool).tril())
    if name == "eagle-small" and gamma == 3:
        assert n == 11 and tree.max_children(0) == 3 and tree.max_children(1) == 2


def test_tree_rejects_bad_layouts():
    with pytest.raises(ValueError, match="unknown tree"):
        get_tree("nope", 3)
    with pytest.raises(ValueError, match="no parent"):
        CandidateTree.from_paths("x", [(0, 0)])
    with pytest.raises(ValueError, match="ranks"):
        CandidateTree.from_paths("x", [(1,)])


def test_batch_tree_mask_mixes_trees_and_causal_rows():
    tree = get_tree("binary", 2)
    m = batch_tree_mask([3, tree.num_nodes, 1], [None, tree.attention_mask(), None], tree.num_nodes)
    assert m.shape == (3 + tree.num_nodes + 1, tree.num_nodes)
    assert torch.equal(m[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril()) and not m[:3, 3:].any()
    assert torch.equal(m[3:3 + tree.num_nodes], tree.attention_mask())
    assert m[-1].tolist() == [True] + [False] * (tree.num_nodes - 1)


def test_tree_attention_equals_each_path_run_as_a_chain():
    """The tree mask convention: a node's output equals a plain causal run over prefix + its path."""
    torch.manual_seed(3)
    tree = get_tree("eagle-small", 3)
    heads, kv_heads, dim, block, prefix = 4, 2, 8, 4, 5
    n = tree.num_nodes
    pre_k, pre_v = torch.randn(prefix, kv_heads, dim), torch.randn(prefix, kv_heads, dim)
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    backend = TorchAttentionBackend()

    def run(idx, tree_mask):
        k_cache, v_cache = torch.zeros(8, block, kv_heads, dim), torch.zeros(8, block, kv_heads, dim)
        table = torch.tensor([[3, 1, 6, 0, 2, 5, 7, 4]], dtype=torch.int32)
        slots = lambda pos: table[0, pos // block].long() * block + pos % block  # noqa: E731
        flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
        flat_k[slots(torch.arange(prefix))], flat_v[slots(torch.arange(prefix))] = pre_k, pre_v
        t = len(idx)
        batch = ForwardBatch(positions=torch.arange(prefix, prefix + t), slot_mapping=slots(torch.arange(prefix, prefix + t)),
                             query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                             seq_lens=torch.tensor([prefix + t], dtype=torch.int32), block_tables=table,
                             max_query_len=t, max_seq_len=prefix + t, query_lens_cpu=[t], seq_lens_cpu=[prefix + t],
                             tree_mask=tree_mask)
        return backend.forward(q[idx], k[idx], v[idx], k_cache, v_cache, batch, dim ** -0.5)

    tree_out = run(list(range(n)), batch_tree_mask([n], [tree.attention_mask()], n))
    for leaf in range(n):
        path, j = [], leaf
        while j >= 0:
            path.insert(0, j)
            j = tree.parents[j]
        chain_out = run(path, None)
        torch.testing.assert_close(tree_out[path], chain_out)


def test_fill_level_places_topk_by_rank():
    tree = get_tree("eagle-small", 3)
    tokens = torch.zeros(2, tree.num_nodes, dtype=torch.long)
    topk = torch.tensor([[[10, 11, 12]], [[20, 21, 22]]])
    fill_level(tree, 0, topk, tokens)
    for node in tree.level(1):
        assert tokens[:, node].tolist() == [10 + tree.ranks[node], 20 + tree.ranks[node]]


def tree_case():
    """binary depth 2: root 0; children 1 (rank 0), 2 (rank 1); grandchildren 3, 4 under 1 and 5, 6 under 2."""
    tree = get_tree("binary", 2)
    assert tree.children == ((1, 2), (3, 4), (5, 6), (), (), (), ())
    return tree


def test_tree_greedy_verify_paths():
    tree = tree_case()
    vocab = 10
    # node tokens:        root 1  2  3  4  5  6
    tokens = torch.tensor([[0, 4, 5, 7, 8, 1, 2],
                           [0, 4, 5, 7, 8, 1, 2],
                           [0, 4, 5, 7, 8, 1, 2]])
    # Request 0: argmax at root 5 -> node 2; at node 2 argmax 2 -> node 6 (leaf); bonus = argmax at 6 = 9.
    # Request 1: argmax at root 4 -> node 1; at node 1 argmax 3 matches no child: correction 3.
    # Request 2: argmax at root 6: nothing accepted.
    argmax = [[5, 0, 2, 0, 0, 0, 9], [4, 3, 0, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0, 0]]
    logits = one_hot_logits(sum(argmax, []), vocab)
    out = tree_greedy_verify(tree.batch(3), logits, tokens)
    assert out.token_lists() == [[5, 2, 9], [4, 3], [6]]
    assert out.lists()[1] == [[0, 2, 6], [0, 1], [0]]
    assert out.num_accepted.tolist() == [2, 1, 0]
    # Greedy rows through the sampled path give the same answer.
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    sampled = tree_rejection_verify(tree.batch(3), one_hot, tokens)
    assert sampled.token_lists() == out.token_lists() and sampled.lists()[1] == out.lists()[1]


@pytest.mark.parametrize("with_q", [False, True])
def test_tree_rejection_sampling_is_lossless(with_q):
    torch.manual_seed(4)
    tree = tree_case()
    vocab, trials, n = 5, 30000, tree.num_nodes
    p = torch.softmax(torch.randn(n, vocab) * 1.5, -1)
    q = torch.softmax(torch.randn(n, vocab) * 1.5, -1)
    tokens = torch.zeros(trials, n, dtype=torch.long)
    for parent, kids in enumerate(tree.children):
        if not kids:
            continue
        if with_q:   # children drawn from q without replacement
            picks = torch.multinomial(q[parent].expand(trials, -1), len(kids), replacement=False)
        else:        # the draft's top-k
            picks = q[parent].topk(len(kids)).indices.expand(trials, -1)
        for r, kid in enumerate(kids):
            tokens[:, kid] = picks[:, r]
    out = tree_rejection_verify(tree.batch(trials), p.repeat(trials, 1), tokens, q.repeat(trials, 1) if with_q else None)
    assert_distribution(out.token_ids[:, 0], p[0])
    for node in (1, 2):
        at = out.path_nodes[:, 1] == node
        assert int(at.sum()) > 300
        assert_distribution(out.token_ids[at, 1], p[node])
        assert torch.equal(out.token_ids[at, 0], tokens[at, node])
    leaf = out.path_nodes[:, 2] == 3
    assert_distribution(out.token_ids[leaf, 2], p[3])


def test_seeded_rows_verify_to_the_plain_samplers_tokens():
    """verify_probs makes a seeded sampled row one-hot at the token the plain sampler draws at that row's
    position, so tree and chain verification emit exactly the plain tokens along the accepted path."""
    from llmserve_core.layers.sampler import sample
    tree = tree_case()
    n = tree.num_nodes
    logits = torch.randn(n, 6)
    params = SamplingParams(temperature=1.0, seed=11)
    base = 40
    st = SamplingTensors.from_params([params], "cpu", positions=[base])
    depths = tree.batch(1).depths().tolist()
    probs = verify_probs(logits, st.repeat_rows(n, depths))
    plain = [int(sample(logits[i:i + 1], SamplingTensors.from_params([params], "cpu", positions=[base + d]))
                 .token_ids[0]) for i, d in enumerate(depths[0])]
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor(plain), 6).float())
    # Candidates that contain the plain choice at the root are accepted; the walk ends with a plain token.
    tokens = torch.tensor([[0] + [plain[0]] * (n - 1)])
    out = tree_rejection_verify(tree.batch(1), probs, tokens)
    path = out.path_nodes[0].tolist()
    emitted = [t for t in out.token_ids[0].tolist() if t >= 0]
    assert emitted[0] == plain[0] and emitted == [plain[node] for node in path if node >= 0][:len(emitted)]


def test_tree_kv_compaction_commits_the_path():
    assert tree_kv_moves([0, 2, 6]) == [(2, 1), (6, 2)]
    assert tree_kv_moves([0, 1, 3]) == [(3, 2)]
    k_cache = torch.arange(2 * 4 * 1 * 1, dtype=torch.float32).view(2, 4, 1, 1)
    pool = torch.stack([torch.stack([k_cache, -k_cache]), torch.stack([k_cache + 100, -k_cache - 100])])  # 2 layers
    compact_kv(pool, torch.tensor([6, 7]), torch.tensor([1, 2]))
    moved = [0, 6, 7, 3, 4, 5, 6, 7]
    assert pool[0, 0].flatten().tolist() == moved
    assert pool[0, 1].flatten().tolist() == [-v for v in moved]
    assert pool[1, 0].flatten().tolist() == [v + 100 for v in moved]
    assert pool[1, 1].flatten().tolist() == [-v - 100 for v in moved]
    # Overlapping moves (a destination that is also a source) read every source before writing.
    pool = torch.arange(8, dtype=torch.float32).view(1, 1, 2, 4, 1, 1).clone()
    compact_kv(pool, torch.tensor([2, 3]), torch.tensor([1, 2]))
    assert pool.flatten().tolist() == [0, 2, 3, 3, 4, 5, 6, 7]


def test_tree_rejection_many_siblings_drawn_without_replacement():
    """Four candidates at one node: only exact bookkeeping of p and q across rejections stays lossless."""
    torch.manual_seed(5)
    tree = CandidateTree.from_paths("wide", [(0,), (1,), (2,), (3,)])
    vocab, trials = 5, 60000
    p = torch.softmax(torch.randn(5, vocab) * 2, -1)
    q = torch.softmax(torch.randn(5, vocab) * 2, -1)
    tokens = torch.zeros(trials, 5, dtype=torch.long)
    tokens[:, 1:] = torch.multinomial(q[0].expand(trials, -1), 4, replacement=False)
    out = tree_rejection_verify(tree.batch(trials), p.repeat(trials, 1), tokens, q.repeat(trials, 1))
    assert_distribution(out.token_ids[:, 0], p[0])


# ---- EAGLE-3 draft head in the speculators format ------------------------------------------------------

import json  # noqa: E402
import shutil  # noqa: E402

from safetensors.torch import load_file, save_file  # noqa: E402

from helpers.batch import allocate_tables, make_batch  # noqa: E402
from llmserve_core.models.config import ModelConfig  # noqa: E402
from llmserve_core.models.eagle3_config import Eagle3Config, default_aux_layer_ids  # noqa: E402
from llmserve_core.models.eagle3_loader import load_eagle3  # noqa: E402
from llmserve_core.models.tiny_draft import make_tiny_draft  # noqa: E402
from llmserve_core.models.loader import load_model  # noqa: E402


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    return load_model(cfg, tiny_model_dir, attn_backend=TorchAttentionBackend())


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_model_dir, seed=1, aux_layer_ids=[0, 1, 1])


def load_draft(path, target):
    return load_eagle3(path, TorchAttentionBackend(), target_embed=target.model.embed_tokens.weight,
                       target_lm_head=target.lm_head_weight)


def reference_head(tensors, cfg, input_ids, fused, norm_before_residual=True):
    """Independent float64 EAGLE-3 layer straight from the checkpoint tensors, one sequence, causal."""
    t = {k: v.double() for k, v in tensors.items()}
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, pos):
        d = x.shape[-1]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos[:, None].double() * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    p = "layers.0."
    emb = rms(t["embed_tokens.weight"][input_ids], t[p + "input_layernorm.weight"])
    hid = fused.double()
    if norm_before_residual:
        hid = rms(hid, t[p + "hidden_norm.weight"])
        res = hid
    else:
        res, hid = hid, rms(hid, t[p + "hidden_norm.weight"])
    x = torch.cat([emb, hid], -1)
    s, h, kvh, d = len(input_ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pos = torch.arange(s)
    q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(s, h, d), pos)
    k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(s, kvh, d), pos).repeat_interleave(h // kvh, 1)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(s, kvh, d).repeat_interleave(h // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, h * d) @ t[p + "self_attn.o_proj.weight"].T
    stream = a + res
    m = rms(stream, t[p + "post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    stream = stream + m
    return rms(stream, t["norm.weight"]) @ t["lm_head.weight"].T, stream


def test_default_aux_layer_ids():
    assert default_aux_layer_ids(36) == (2, 18, 33)
    assert default_aux_layer_ids(2) == (1, 1, 0)


def test_speculators_config_fields(draft_dir):
    raw = json.loads(open(f"{draft_dir}/config.json").read())
    cfg = Eagle3Config.from_dict(raw)
    assert cfg.norm_before_residual and cfg.aux_layer_ids == (0, 1, 1)
    assert cfg.draft_vocab_size == cfg.vocab_size // 2 and cfg.speculative_tokens == 3
    raw.pop("norm_before_residual")
    assert Eagle3Config.from_dict(raw).norm_before_residual is True        # vLLM: absent means true
    flat = dict(raw["transformer_layer_config"], draft_vocab_size=cfg.draft_vocab_size)
    assert Eagle3Config.from_dict(flat).norm_before_residual is False      # older flat EAGLE-3 configs
    raw["eagle_aux_hidden_state_layer_ids"] = None
    assert Eagle3Config.from_dict(raw).resolve_aux_layer_ids(36) == (2, 18, 33)
    with pytest.raises(ValueError, match="out of range"):
        Eagle3Config.from_dict(dict(raw, eagle_aux_hidden_state_layer_ids=[1, 2, 40])).resolve_aux_layer_ids(36)
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3Config.from_dict(dict(raw, transformer_layer_config=dict(raw["transformer_layer_config"], hidden_size=0)))


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_draft_matches_independent_reference(target, draft_dir, tmp_path, norm_before_residual):
    path = tmp_path / "d"
    shutil.copytree(draft_dir, path)
    raw = json.loads((path / "config.json").read_text())
    raw["norm_before_residual"] = norm_before_residual
    (path / "config.json").write_text(json.dumps(raw))
    draft = load_draft(path, target)
    tensors = load_file(str(path / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    torch.manual_seed(6)
    ids = torch.randint(0, draft.cfg.vocab_size, (9,))
    aux = [torch.randn(9, draft.cfg.target_hidden_size) for _ in range(3)]
    fused = draft.combine_aux(aux)
    torch.testing.assert_close(fused.double(), torch.cat(aux, -1).double() @ tensors["fc.weight"].double().T,
                               rtol=1e-5, atol=1e-5)
    want_logits, want_pre = reference_head(tensors, draft.cfg, ids, fused, norm_before_residual)
    normed, pre, _ = draft.forward_dense(ids[None], fused[None])
    torch.testing.assert_close(pre[0].double(), want_pre, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(draft.compute_logits(normed[0]).double(), want_logits, rtol=1e-4, atol=1e-4)


def test_draft_paged_forward_matches_dense_including_second_step(target, draft_dir):
    """Prefill two sequences through the paged cache, then one more draft step fed with the draft's own
    pre-norm hidden: equal to the dense training-time-test reference (step 1 sees step 0's keys up to
    its chain start plus its own key)."""
    draft = load_draft(draft_dir, target)
    torch.manual_seed(7)
    block = 4
    lens = [7, 5]
    tables, num_blocks = allocate_tables([n + 1 for n in lens], block)
    kv = (torch.zeros(num_blocks, block, draft.cfg.num_key_value_heads, draft.cfg.head_dim),
          torch.zeros(num_blocks, block, draft.cfg.num_key_value_heads, draft.cfg.head_dim))
    ids = [torch.randint(0, draft.cfg.vocab_size, (n,)) for n in lens]
    fused = [torch.randn(n, draft.cfg.hidden_size) for n in lens]
    batch = make_batch([(0, n) for n in lens], tables, block)
    normed, pre = draft(torch.cat(ids), torch.cat(fused), batch, kv)
    next_ids = torch.randint(0, draft.cfg.vocab_size, (2,))
    last = torch.tensor([lens[0] - 1, sum(lens) - 1])
    step_batch = make_batch([(n, 1) for n in lens], tables, block)
    normed2, pre2 = draft(next_ids, pre[last], step_batch, kv)
    offset = 0
    for b, n in enumerate(lens):
        d_normed, d_pre, kv0 = draft.forward_dense(ids[b][None], fused[b][None])
        torch.testing.assert_close(normed[offset:offset + n], d_normed[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pre[offset:offset + n], d_pre[0], rtol=1e-5, atol=1e-5)
        # Dense step 1: row r continues the chain started at row r; the paged step continued row n - 1.
        ids1 = torch.cat([ids[b][1:], next_ids[b:b + 1]])[None]
        s_normed, _, _ = draft.forward_dense(ids1, d_pre, step=1, earlier=[kv0])
        torch.testing.assert_close(normed2[b], s_normed[0, n - 1], rtol=1e-5, atol=1e-5)
        offset += n


def test_draft_loader_names_sharing_and_vocab_mapping(target, draft_dir, tmp_path, tiny_model_dir):
    draft = load_draft(draft_dir, target)
    cfg = draft.cfg
    legacy = make_tiny_draft(tmp_path / "legacy", tiny_model_dir, seed=1, aux_layer_ids=[0, 1, 1], legacy_names=True)
    assert any(k.startswith("midlayer.") for k in load_file(f"{legacy}/model.safetensors"))
    old = load_draft(legacy, target)
    for (n1, p1), (n2, p2) in zip(draft.named_parameters(), old.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert draft.embed_weight is target.model.embed_tokens.weight                 # shared, not copied
    # d2t: target id = draft id + d2t[draft id]; the tiny draft takes every other target id.
    assert greedy_propose(torch.eye(cfg.draft_vocab_size)[[0, 1, 5]], draft.d2t).tolist() == [0, 2, 10]
    assert int(draft.t2d.sum()) == cfg.draft_vocab_size and bool(draft.t2d[10]) and not bool(draft.t2d[11])
    logits = torch.randn(2, cfg.draft_vocab_size)
    full = to_target_space(logits, draft.d2t, cfg.vocab_size)
    assert full.shape == (2, cfg.vocab_size) and torch.equal(full[:, 10], logits[:, 5]) and torch.isinf(full[:, 11]).all()
    with pytest.raises(ValueError, match="embed"):
        load_eagle3(draft_dir)                                                    # nothing to share
    # Full-vocabulary draft without its own head borrows the target's.
    nohead = make_tiny_draft(tmp_path / "nohead", tiny_model_dir, draft_vocab_size=cfg.vocab_size, include_lm_head=False,
                             include_embed=True)
    shared = load_draft(nohead, target)
    assert shared.lm_head_weight is target.lm_head_weight and shared.embed_tokens is not None


def test_draft_loader_errors_name_the_tensor(target, draft_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(draft_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop("layers.0.self_attn.k_proj.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors: layers.0.self_attn.qkv_proj"):
        load_draft(broken, target)
    tensors["layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.weight.*shape"):
        load_draft(broken, target)
    tensors["layers.0.self_attn.k_proj.weight"] = torch.zeros(target.cfg.kv_size, 2 * target.cfg.hidden_size)
    tensors["layers.0.surprise.weight"] = torch.zeros(1)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="surprise"):
        load_draft(broken, target)


def test_dummy_draft_from_config_alone(draft_dir):
    draft = load_eagle3(draft_dir, TorchAttentionBackend(), load_format="dummy", seed=3)
    assert draft.embed_tokens is not None and draft.lm_head is not None
    assert torch.isfinite(draft.fc.weight).all() and float(draft.fc.weight.std()) > 0


@pytest.mark.parametrize("qk_norm", [False, True])
@torch.no_grad()
def test_fused_draft_matches_the_eager_draft(draft_dir, qk_norm):
    """The draft's fast path (the fused rotary [+ q/k norm] + K/V store kernel, Triton attention) in the
    interpreter against its eager path on the torch backend: a prefill, then a decode step over its K/V."""
    from llmserve_core.layers.attention.triton_backend import TritonAttentionBackend
    from llmserve_core.layers.norm import RMSNorm
    eager = load_eagle3(draft_dir, TorchAttentionBackend(), load_format="dummy", seed=3)
    fused = load_eagle3(draft_dir, TritonAttentionBackend(), load_format="dummy", seed=3)
    cfg = eager.cfg
    if qk_norm:       # a Qwen3-style draft layer: give both copies the same q/k norms
        for model in (eager, fused):
            attn = model.layers[0].self_attn
            attn.q_norm, attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            attn.q_norm.weight.data.copy_(torch.linspace(0.5, 1.5, cfg.head_dim))
            attn.k_norm.weight.data.copy_(torch.linspace(1.5, 0.5, cfg.head_dim))
    fused.set_fused(True)
    lens, block = [5, 9], 4
    tables, num_blocks = allocate_tables([n + 1 for n in lens], block)
    shape = (num_blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(2)]
    g = torch.Generator().manual_seed(4)
    for seqs in ([(0, n) for n in lens], [(n, 1) for n in lens]):
        batch = make_batch(seqs, tables, block)
        ids = torch.randint(0, cfg.vocab_size, (batch.num_tokens,), generator=g)
        hidden = torch.randn(batch.num_tokens, cfg.hidden_size, generator=g)
        want = eager(ids, hidden, batch, caches[0])
        got = fused(ids, hidden, batch, caches[1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1][1], caches[0][1], atol=1e-5, rtol=1e-5)
    assert caches[0][0].abs().sum() > 0


# ---- proposal ------------------------------------------------------------------------------------------

from llmserve_core.speculative.propose import greedy_propose, sample_propose, to_target_space, topk_propose  # noqa: E402


def test_propose_maps_draft_ids_and_samples_from_q():
    torch.manual_seed(8)
    vocab, draft_vocab = 12, 4
    d2t = torch.tensor([1, 2, 4, 6])                       # draft id i -> target id i + d2t[i]: 1, 3, 6, 9
    logits = torch.randn(3, draft_vocab)
    assert greedy_propose(logits, d2t).tolist() == [int(i) + int(d2t[i]) for i in logits.argmax(-1)]
    top = topk_propose(logits, 2, d2t)
    assert top.shape == (3, 2) and top[:, 0].tolist() == greedy_propose(logits, d2t).tolist()
    trials = 20000
    st = sampling_tensors([SamplingParams(temperature=0.8)] * trials)
    ids, q = sample_propose(logits[:1].expand(trials, -1), st, d2t, vocab)
    assert q.shape == (trials, vocab) and torch.equal(q[:, [0, 2, 4, 5, 7, 8, 10, 11]], torch.zeros(trials, 8))
    torch.testing.assert_close(q[0, [1, 3, 6, 9]], torch.softmax(logits[0] / 0.8, -1))
    assert_distribution(ids, q[0])
    greedy_ids, greedy_q = sample_propose(logits, sampling_tensors([SamplingParams(temperature=0.0)] * 3), d2t, vocab)
    assert greedy_ids.tolist() == greedy_propose(logits, d2t).tolist()
    assert torch.equal(greedy_q.sum(-1), torch.ones(3)) and greedy_q.max(-1).values.eq(1).all()


# ---- the trained pair shipped in the repo -------------------------------------------------------------

from pathlib import Path  # noqa: E402

TRAINED_PAIR = Path(__file__).resolve().parents[1] / "llmserve_core/data/trained_pair"


def test_trained_pair_loads_and_the_draft_predicts_the_target():
    """The shipped pair through the engine's own loaders and paged forwards: on greedy continuations of
    prompts the training never saw, the draft's first proposal is the target's next token far more
    often than chance (1 / 512 draft tokens)."""
    from tokenizers import Tokenizer

    from llmserve_core.data import corpus_paragraphs

    target_dir, draft_dir = TRAINED_PAIR / "target", TRAINED_PAIR / "draft"
    cfg = ModelConfig.from_hf_dir(target_dir)
    backend = TorchAttentionBackend()
    model = load_model(cfg, target_dir, attn_backend=backend)
    draft = load_draft(draft_dir, model)
    assert draft.embed_tokens is None and draft.cfg.draft_vocab_size < cfg.vocab_size
    aux_ids = draft.cfg.resolve_aux_layer_ids(cfg.num_hidden_layers)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    held_out = [p for i, p in enumerate(corpus_paragraphs()) if i % 20 == 19]     # as the training script splits

    def forward(ids):
        n = len(ids)
        tables, num_blocks = allocate_tables([n], 16)
        kv = [(torch.zeros(num_blocks, 16, cfg.num_key_value_heads, cfg.head_dim),
               torch.zeros(num_blocks, 16, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
        return model(torch.tensor(ids), make_batch([(0, n)], tables, 16), kv, aux_layer_ids=aux_ids), tables, num_blocks

    agree = total = 0
    for text in held_out[:4]:
        prompt_len, ids = 24, tokenizer.encode(text).ids[:24]
        for _ in range(24):
            (hidden, _), _, _ = forward(ids)
            ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
        (hidden, aux), tables, num_blocks = forward(ids)
        greedy = model.compute_logits(hidden).argmax(-1)
        # Draft row r reads token r + 1 with the target's state at r and proposes token r + 2.
        n = len(ids)
        draft_kv = (torch.zeros(num_blocks, 16, draft.cfg.num_key_value_heads, draft.cfg.head_dim),
                    torch.zeros(num_blocks, 16, draft.cfg.num_key_value_heads, draft.cfg.head_dim))
        normed, _ = draft(torch.tensor(ids[1:]), draft.combine_aux([a[:-1] for a in aux]),
                          make_batch([(0, n - 1)], tables, 16), draft_kv)
        proposal = greedy_propose(draft.compute_logits(normed), draft.d2t)
        region = slice(prompt_len - 1, n - 1)                                    # proposals of generated tokens
        agree += int((proposal[region] == greedy[1:][region]).sum())
        total += len(range(n - 1)[region])
    assert agree / total > 0.4, f"draft agrees with the target on {agree}/{total} generated positions"
