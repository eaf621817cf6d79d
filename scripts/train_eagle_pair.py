"""Train a small but real target/draft pair on the shipped corpus, on the CPU in a few minutes.

(a) A tiny Qwen3 (transformers' own model, the tiny tokenizer) learns next-token prediction on
    llmserve_core/data/corpus.txt, so its hidden states carry real structure.
(b) An EAGLE-3 head learns to predict the target's next-token distribution from the target's aux hidden
    states, with training-time test: steps 1..TTT-1 feed the head its own pre-norm output, as at
    inference. The loss is the KL to the target's distribution restricted to the draft vocabulary (the
    most frequent target tokens).
Then it runs greedy speculative decoding offline on held-out paragraphs (every 20th is never trained
on) and reports acceptance. Output: llmserve_core/data/trained_pair/{target,draft,metrics.json}.

    python scripts/train_eagle_pair.py [--target-minutes 4] [--draft-minutes 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve_core.data import corpus_paragraphs
from llmserve_core.models.eagle3 import Eagle3DraftModel
from llmserve_core.models.eagle3_config import Eagle3Config
from llmserve_core.models.eagle3_loader import init_dummy_weights
from llmserve_core.models.tiny_draft import checkpoint_tensors, speculators_config, vocab_mapping, write_eagle3_dir
from llmserve_core.models.tiny import make_tiny_model, train_tokenizer
from llmserve_core.speculative.types import SpecMetrics, SpecStepResult

# The tiny model's width with twice its depth: small enough to train on two shared CPU cores in minutes.
TARGET_SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
AUX_LAYER_IDS = [1, 2, 3]        # the default (2, L//2, L-3) repeats layers at L = 4
DRAFT_VOCAB = 512
SEQ_LEN = 128
HELD_OUT_EVERY = 20


def split_corpus(tokenizer):
    paragraphs = corpus_paragraphs()
    eot = tokenizer.token_to_id("<|endoftext|>")
    train, held = [], []
    for i, enc in enumerate(tokenizer.encode_batch(list(paragraphs))):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append(enc.ids)
    stream = torch.tensor([t for ids in train for t in ids + [eot]], dtype=torch.long)
    return stream, held


def batches(stream: torch.Tensor, batch: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (batch,), generator=generator)
        yield torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])


def cosine_lr(step: int, progress: float, peak: float, warmup: int = 50) -> float:
    """Warmup by steps, then cosine over the share of the time budget spent: the schedule completes
    however fast the (shared) CPU happens to run."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_target(model, stream, minutes: float, log) -> dict:
    """Time-boxed: runs for `minutes` of wall clock."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.05, betas=(0.9, 0.95))
    data = batches(stream, 16, gen)
    model.train()
    start, step, loss_ema, budget = time.time(), 0, None, minutes * 60
    while time.time() - start < budget:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, (time.time() - start) / budget, 5e-3)
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        step += 1
        if step % 200 == 0:
            log(f"target step {step} loss {loss_ema:.3f}")
    model.eval()
    return {"steps": step, "train_loss": loss_ema, "seconds": time.time() - start}


@torch.no_grad()
def target_features(model, x):
    out = model(input_ids=x, output_hidden_states=True)
    # hidden_states[i] is the stream entering layer i: the aux state qwen3.py captures for layer i.
    aux = torch.cat([out.hidden_states[i] for i in AUX_LAYER_IDS], dim=-1)
    return aux, out.logits.float()


def draft_loss(draft, x, aux, target_logits, draft_ids, ttt_steps: int):
    """Mean KL(target || draft) over the draft vocabulary, per TTT step; also top-1 agreement per step."""
    seq = x.shape[1] - 1
    fused = draft.combine_aux(aux[:, :-1])
    hidden, earlier, losses, agree = fused, [], [], []
    for s in range(ttt_steps):
        # Step s, row r: the chain begun after token r + 1; it reads token r + 1 + s and predicts what the
        # target predicts at position r + 1 + s. Rows past the sequence end are padding.
        ids = x[:, 1 + s:]
        ids = torch.cat([ids, ids[:, -1:].expand(-1, s)], dim=1) if s else ids
        normed, pre, kv = draft.forward_dense(ids, hidden, step=s, earlier=earlier)
        valid = seq - s
        logits = draft.compute_logits(normed[:, :valid])
        p = torch.softmax(target_logits[:, 1 + s:1 + s + valid][..., draft_ids], dim=-1)
        losses.append(F.kl_div(torch.log_softmax(logits, -1), p, reduction="batchmean") / valid)
        agree.append((logits.argmax(-1) == p.argmax(-1)).float().mean().item())
        earlier.append(kv)
        hidden = pre
    return losses, agree


def train_draft(draft, target, stream, draft_ids, minutes: float, ttt_steps: int, log) -> dict:
    gen = torch.Generator().manual_seed(1)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=4e-3, weight_decay=0.01, betas=(0.9, 0.95))
    data = batches(stream, 16, gen)
    start, step, ema, budget = time.time(), 0, None, minutes * 60
    while time.time() - start < budget:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, (time.time() - start) / budget, 4e-3)
        x = next(data)
        aux, tlogits = target_features(target, x)
        losses, agree = draft_loss(draft, x, aux, tlogits, draft_ids, ttt_steps)
        # Later steps matter less (they are only reached when earlier ones are accepted), as in EAGLE-3.
        loss = sum(l * (0.8 ** s) for s, l in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = agree if ema is None else [0.95 * e + 0.05 * a for e, a in zip(ema, agree)]
        step += 1
        if step % 100 == 0:
            log(f"draft step {step} loss {loss.item():.3f} top-1 agreement per step "
                + " ".join(f"{a:.2f}" for a in ema))
    return {"steps": step, "train_top1_agreement_per_step": ema, "seconds": time.time() - start}


@torch.no_grad()
def offline_acceptance(target, draft, held, gamma: int, max_new: int, num_prompts: int, prompt_len: int) -> dict:
    """Greedy speculative decoding with full recompute (dense forwards). The draft chain at each step is
    exactly what the paged executor computes (see test_draft_paged_forward_matches_dense...), and one
    target forward per step both verifies the drafts and yields the aux states of everything before them."""
    metrics = SpecMetrics()
    prompts = [ids[:prompt_len] for ids in held if len(ids) >= prompt_len][:num_prompts]
    for prompt in prompts:
        out = target(input_ids=torch.tensor([prompt]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in AUX_LAYER_IDS], dim=-1)[0]
        seq = list(prompt) + [int(out.logits[0, -1].argmax())]      # the first token comes from a plain prefill
        while len(seq) < len(prompt) + max_new:
            x = torch.tensor([seq])
            hidden, earlier, drafts = draft.combine_aux(aux[None, :len(seq) - 1]), [], []
            for s in range(gamma):
                ids = torch.cat([x[:, 1 + s:], torch.tensor([drafts], dtype=torch.long)], dim=1)
                normed, pre, kv = draft.forward_dense(ids, hidden, step=s, earlier=earlier)
                drafts.append(int(draft.to_target_ids(draft.compute_logits(normed[0, -1:]).argmax(-1))[0]))
                earlier.append(kv)
                hidden = pre
            out = target(input_ids=torch.tensor([seq + drafts]), output_hidden_states=True)
            verify = out.logits[0, len(seq) - 1:].argmax(-1).tolist()
            accepted = 0
            while accepted < gamma and drafts[accepted] == verify[accepted]:
                accepted += 1
            emitted = verify[:accepted + 1]
            metrics.record([SpecStepResult(emitted, gamma, accepted)])
            seq.extend(emitted)
            # Causal: the states of seq + accepted drafts are valid whatever came after them.
            aux = torch.cat([out.hidden_states[i] for i in AUX_LAYER_IDS], dim=-1)[0, :len(seq) - 1]
    result = {k: v for k, v in metrics.as_dict().items() if k != "spec_timings_s"}
    result.update(num_prompts=len(prompts), gamma=gamma, max_new_tokens=max_new, prompt_len=prompt_len)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "llmserve_core/data/trained_pair"))
    parser.add_argument("--target-minutes", type=float, default=4.0)
    parser.add_argument("--draft-minutes", type=float, default=5.0)
    parser.add_argument("--reuse-target", action="store_true", help="keep OUT/target and train only the draft")
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=3)
    # One thread: on a shared 2-core box, intra-op threads waiting on each other made steps 20x slower.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = Path(args.out)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    from transformers import Qwen3ForCausalLM

    tokenizer = train_tokenizer()
    stream, held = split_corpus(tokenizer)
    log(f"corpus: {len(stream)} training tokens, {len(held)} held-out paragraphs")

    target_dir = out / "target"
    if args.reuse_target:
        target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        target_report = json.loads((out / "metrics.json").read_text())["target"]
    else:
        if target_dir.exists():
            shutil.rmtree(target_dir)
        make_tiny_model(target_dir, seed=0, **TARGET_SHAPE)
        target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        target_report = train_target(target, stream, args.target_minutes, log)
        held_stream = torch.tensor([t for ids in held for t in ids], dtype=torch.long)
        with torch.no_grad():
            chunks = held_stream[:len(held_stream) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
            target_report["held_out_loss"] = float(target(input_ids=chunks, labels=chunks).loss)
        target.save_pretrained(target_dir, safe_serialization=True)
    target.eval()
    target.requires_grad_(False)
    log(f"target: {target_report}")

    counts = torch.bincount(stream, minlength=target.config.vocab_size)
    draft_token_ids = sorted(counts.topk(DRAFT_VOCAB).indices.tolist())
    coverage = float(counts[draft_token_ids].sum() / counts.sum())
    config = speculators_config(target.config.to_dict(), draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_LAYER_IDS,
                                intermediate_size=TARGET_SHAPE["intermediate_size"], speculative_tokens=args.gamma,
                                verifier="llmserve_core/data/trained_pair/target")
    draft = Eagle3DraftModel(Eagle3Config.from_dict(config), None, torch.float32, "cpu")
    init_dummy_weights(draft, seed=0)
    d2t, t2d = vocab_mapping(draft_token_ids, target.config.vocab_size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    draft.embed_tokens = None                       # shared with the target, as in RedHatAI's speculators
    draft.share_target_weights(target.model.embed_tokens.weight.detach(), None)
    draft.requires_grad_(True)
    draft_ids = torch.tensor(draft_token_ids)
    draft_report = train_draft(draft, target, stream, draft_ids, args.draft_minutes, args.ttt_steps, log)
    draft.requires_grad_(False)
    write_eagle3_dir(out / "draft", config, checkpoint_tensors(draft))
    log(f"draft: {draft_report}")

    acceptance = offline_acceptance(target, draft, held, args.gamma, max_new=40, num_prompts=32, prompt_len=24)
    log(f"offline acceptance on held-out text: {acceptance}")
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*.safetensors")}
    repo = Path(__file__).resolve().parents[1]
    args_out = out.resolve().relative_to(repo).as_posix() if out.resolve().is_relative_to(repo) else str(out)
    report = {"args": {**vars(args), "out": args_out}, "target": {**target_report, "shape": TARGET_SHAPE},
              "draft": {**draft_report, "draft_vocab_size": DRAFT_VOCAB,
              "draft_vocab_token_coverage": coverage, "aux_layer_ids": AUX_LAYER_IDS, "ttt_steps": args.ttt_steps},
              "offline_acceptance": acceptance, "weight_bytes": sizes, "total_seconds": time.time() - t0}
    (out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
