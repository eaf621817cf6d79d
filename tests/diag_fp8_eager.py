"""Device diagnostic (not committed): which of eager / graphs drifts on the block-scaled FP8 checkpoint."""
import torch
from llmserve_core import Engine, EngineConfig
from llmserve_proto import SamplingParams
from test_fp8_loading import qwen_fp8_config, write_fp8_checkpoint
from test_gpu_engine import MID, prompts


def test_diag(make_random_qwen3_dir, tmp_path_factory):
    src = make_random_qwen3_dir(seed=11, **MID)
    path, twin = write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8") / "ckpt", qwen_fp8_config((128, 128)))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for name, model, eager, seqs in (("eager", path, True, 8), ("graphs", path, False, 8), ("eager1", path, True, 1),
                                     ("twin_eager", twin, True, 8), ("twin_graphs", twin, False, 8)):
        engine = Engine(EngineConfig(model=model, device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                     max_model_len=1024, max_num_seqs=seqs, enforce_eager=eager))
        outs[name] = [c.token_ids for c in engine.generate(prompts(engine.model_info.vocab_size), params)]
        del engine
        torch.cuda.empty_cache()
    for name, toks in outs.items():
        firsts = []
        for a, b in zip(toks, outs["twin_graphs"]):
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
        print(f"DIAG {name:12s} first divergence from twin_graphs per prompt: {firsts}  head {[t[:4] for t in toks[:3]]}")
