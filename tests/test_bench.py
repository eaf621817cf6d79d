"""llmserve-bench: metric math on synthetic records, workloads, argument checks, and both modes end to end
against a real llmserve-core subprocess on the CPU tiny model."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmserve_bench.cli import main
from llmserve_bench.compare import compare
from llmserve_bench.core_process import CoreProcess, model_max_len
from llmserve_bench.metrics import (RequestRecord, parse_slo, percentile, stats_summary, summarize,
                                    window_summary)
from llmserve_bench.workload import TokenizerInfo, Workload, WorkloadConfig, corpus_token_ids, parse_mix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE_ARGS = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "512", "--block-size", "16",
             "--log-interval", "0"]


# ---------------------------------------------------------------- metric math

def rec(index, sent, times, done=None, prompt_len=10, **kw) -> RequestRecord:
    return RequestRecord(index, prompt_len, len(times), sent=sent, token_times=list(times),
                         done=times[-1] if done is None and times else done, **kw)


def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for p in (0, 50, 90, 99, 99.9, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) == 0.0


def test_summary_follows_vllm_definitions():
    # Two tokens arrive in one message at 0.3 (e.g. accepted speculative tokens): one ITL arrival.
    a = rec(0, 0.0, [0.1, 0.2, 0.3, 0.3, 0.5], in_flight_at_send=1)
    b = rec(1, 0.2, [0.6, 1.0], prompt_len=20, in_flight_at_send=2)
    c = RequestRecord(2, 5, 3, sent=0.3, error="prompt_token_ids: too long", in_flight_at_send=2)
    s = summarize([a, b, c], duration=1.0, slo={"ttft": 150.0})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(7.0)
    assert s["total_token_throughput"] == pytest.approx(37.0)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 400) / 2)
    assert s["median_ttft_ms"] == pytest.approx(250)
    assert s["mean_e2el_ms"] == pytest.approx((500 + 800) / 2)
    # TPOT = (E2E - TTFT) / (n - 1): a: 0.4 / 4, b: 0.4 / 1.
    assert s["mean_tpot_ms"] == pytest.approx((100 + 400) / 2)
    # ITL over distinct arrivals: a: 0.1, 0.1, 0.2; b: 0.4.
    assert s["mean_itl_ms"] == pytest.approx((100 + 100 + 200 + 400) / 4)
    assert s["median_itl_ms"] == pytest.approx(150)
    assert s["p99_e2el_ms"] >= s["p90_e2el_ms"] >= s["median_e2el_ms"]
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(1.0)   # b's TTFT 400 > 150
    assert s["max_concurrent_requests"] == 2
    assert summarize([a, b], 1.0, {"ttft": 1000, "tpot": 1000, "e2el": 1000})["good_requests"] == 2


def test_window_counts_only_what_happened_inside():
    before = rec(0, 0.0, [0.5, 1.5, 2.5])            # straddles the start: only 2 of its tokens count
    inside = rec(1, 1.2, [1.4, 1.6, 1.8, 2.0])        # sent and finished inside: latencies come from it
    after = rec(2, 2.5, [2.9, 3.5, 4.0])              # straddles the end: 1 token counts, and its latencies
    s = window_summary([before, inside, after], 1.0, 3.0)
    assert s["window_output_tokens"] == 2 + 4 + 1
    assert s["output_throughput"] == pytest.approx(7 / 2.0)
    assert s["window_prefill_tokens"] == 20              # first tokens of `inside` and `after` arrived inside
    assert s["total_token_throughput"] == pytest.approx((20 + 7) / 2.0)
    assert s["window_finished_requests"] == 2 and s["request_throughput"] == pytest.approx(1.0)
    assert s["window_requests"] == s["completed"] == 2
    assert s["mean_ttft_ms"] == pytest.approx(300) and s["mean_e2el_ms"] == pytest.approx(1150)


def test_window_latencies_cover_every_request_sent_inside_it():
    # Only requests sent and finished inside the window used to count: a request of duration D fits only if
    # sent before end - D, so the slow ones were the ones left out and latencies came out too good.
    fast = [rec(i, 1.0 + 0.5 * i, [1.1 + 0.5 * i, 1.2 + 0.5 * i]) for i in range(3)]   # 0.2 s each
    slow = rec(3, 2.5, [3.5, 4.5])                    # sent inside, finished after the end (the load held)
    warm = rec(4, 0.5, [1.5, 2.0])                    # sent in the warm-up: not measured, but finished inside
    s = window_summary([*fast, slow, warm], 1.0, 3.0, slo={"e2el": 2500})
    assert s["window_requests"] == s["completed"] == 4
    assert s["mean_e2el_ms"] == pytest.approx((3 * 200 + 2000) / 4)
    assert s["mean_ttft_ms"] == pytest.approx((3 * 100 + 1000) / 4)
    # Goodput counts the requests request throughput counts (finished inside), so their ratio is the share
    # that met the SLO: all of them here.
    assert s["window_finished_requests"] == 4 and s["request_throughput"] == pytest.approx(2.0)
    assert s["good_requests"] == 4 and s["request_goodput"] == pytest.approx(s["request_throughput"])
    assert window_summary([*fast, warm], 1.0, 3.0, slo={"e2el": 1000})["good_requests"] == 3   # warm: 1.5 s


def test_latencies_without_samples_are_not_shown_or_compared_as_zero():
    # One-token outputs (a prefill study) have no TPOT and no ITL: their 0 (vLLM's JSON value for no samples)
    # printed as "0.00 ms" and won comparisons as the lower latency.
    from llmserve_bench.report import format_columns
    one = summarize([rec(i, 0.0, [0.1 * (i + 1)]) for i in range(3)], duration=1.0)
    two = summarize([rec(i, 0.0, [0.1, 0.2 + 0.1 * i]) for i in range(3)], duration=1.0)
    assert one["tpot_samples"] == one["itl_samples"] == 0 and one["ttft_samples"] == 3
    lines = {line.split(":")[0]: line.split()[-1] for line in format_columns([("", one)]).splitlines() if ":" in line}
    assert lines["Mean TPOT (ms)"] == lines["P99 ITL (ms)"] == "-" and lines["Mean TTFT (ms)"] == "200.00"
    from llmserve_bench.report import format_groups
    assert "TPOT median - ms, ITL p99 - ms" in format_groups({"by_group": {"8:1": one, "8:2": two}}, "whole run")
    for a, b in ((one, two), (two, one)):
        rows, _ = compare({"summary": a}, {"summary": b})
        metrics = {r["metric"] for r in rows}
        assert "mean_ttft_ms" in metrics and not any("tpot" in m or "itl" in m for m in metrics)


def test_stats_summary_uses_counter_deltas_and_spec_keys():
    samples = [(0.0, {"running": 2, "waiting": 0, "kv_usage": 0.1, "prefix_hits": 10, "prefix_queries": 100,
                      "num_steps": 5, "total_generated_tokens": 10}),
               (1.0, {"running": 4, "waiting": 3, "kv_usage": 0.3, "prefix_hits": 40, "prefix_queries": 200,
                      "num_steps": 15, "total_generated_tokens": 50, "spec_acceptance_rate": 0.7,
                      "prefix_hit_rate": 0.2})]
    s = stats_summary(samples)
    assert s["core_mean_batch_size"] == 3 and s["core_max_batch_size"] == 4
    assert s["core_mean_queue_depth"] == 1.5 and s["core_max_queue_depth"] == 3
    assert s["core_max_kv_usage"] == pytest.approx(0.3)
    assert s["core_prefix_hit_rate"] == pytest.approx(30 / 100)     # over the span, not since start
    assert s["core_generated_tokens_per_step"] == pytest.approx(4.0)
    assert s["core_spec_acceptance_rate"] == 0.7          # the core's own figure when it sends no counters
    assert "core_jit_compilations" not in s              # an older core that does not count them
    jit = [(t, {**d, "jit_compilations": n}) for (t, d), n in zip(samples, (41, 43))]
    assert stats_summary(jit)["core_jit_compilations"] == 2  # compiled inside the span, not since start
    counters = [(t, {**d, "spec_num_draft_tokens": 30 * i, "spec_num_accepted_tokens": 12 * i,
                     "spec_num_steps": 10 * i, "spec_num_emitted_tokens": 22 * i, "spec_acceptance_rate": 0.9})
                for i, (t, d) in enumerate(samples, start=1)]
    s = stats_summary(counters)
    assert s["core_spec_acceptance_rate"] == pytest.approx(12 / 30)
    assert s["core_spec_mean_acceptance_length"] == pytest.approx(2.2)
    assert s["core_spec_num_draft_tokens"] == 30 and s["core_spec_num_steps"] == 10   # growth over the span
    assert stats_summary(samples, start=5.0) == {"core_stats_samples": 0}
    # The speculation policy's decisions: step counters as growth, the latest depth as reported, all in the table.
    policy = [(t, {**d, "spec_num_plain_steps": 100 * i, "spec_num_drafted_steps": 7 * i, "spec_num_probe_steps": i,
                   "spec_policy_gamma": i - 1}) for i, (t, d) in enumerate(counters, start=1)]
    s = stats_summary(policy)
    assert (s["core_spec_num_plain_steps"], s["core_spec_num_drafted_steps"], s["core_spec_num_probe_steps"]) == (100, 7, 1)
    assert s["core_spec_policy_gamma"] == 1
    from llmserve_bench.report import format_columns
    table = format_columns([("run", s)])
    assert "spec_num_plain_steps:" in table and "spec_policy_gamma:" in table


def test_slo_and_mix_parsing():
    assert parse_slo(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["ttft:0"], ["e2el:-3"]):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    mix = parse_mix("0.8:128:128, 0.2:4096:128")
    assert [(m.weight, m.input_len, m.output_len) for m in mix] == [(0.8, 128, 128), (0.2, 4096, 128)]
    for bad in ("0.8:128", "a:1:1", "0:1:1", "1:0:1", "1:1:1,"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


# ---------------------------------------------------------------- workloads

@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return TokenizerInfo(tiny_model_dir)


def test_random_prompts_are_exact_valid_and_seeded(tok):
    cfg = WorkloadConfig(input_len=37, output_len=5, seed=3)
    w = Workload(cfg, vocab_size=tok.vocab_size, special_ids=tok.special_ids, tokenizer=tok)
    specs = w.take(50)
    assert all(len(s.prompt_token_ids) == 37 and s.max_tokens == 5 for s in specs)
    ids = {t for s in specs for t in s.prompt_token_ids}
    assert ids and max(ids) < tok.vocab_size and not ids & tok.special_ids
    again = Workload(cfg, vocab_size=tok.vocab_size, special_ids=tok.special_ids, tokenizer=tok).take(50)
    assert [s.prompt_token_ids for s in again] == [s.prompt_token_ids for s in specs]


def test_natural_prompts_are_corpus_slices(tok):
    corpus = corpus_token_ids(tok)
    w = Workload(WorkloadConfig(prompt_mode="natural", input_len=64, output_len=8), vocab_size=tok.vocab_size,
                 special_ids=tok.special_ids, tokenizer=tok)
    joined = ",".join(map(str, corpus))
    for s in w.take(5):
        assert len(s.prompt_token_ids) == 64
        assert ",".join(map(str, s.prompt_token_ids)) in joined


def test_mix_and_shared_prefixes(tok):
    cfg = WorkloadConfig(mix=parse_mix("0.75:40:4,0.25:90:8"), shared_prefix_len=32, num_prefixes=2, seed=1)
    w = Workload(cfg, vocab_size=tok.vocab_size, special_ids=tok.special_ids, tokenizer=tok)
    specs = w.take(400)
    long = [s for s in specs if len(s.prompt_token_ids) == 90]
    assert all(len(s.prompt_token_ids) in (40, 90) for s in specs)
    assert all(s.max_tokens == (8 if len(s.prompt_token_ids) == 90 else 4) for s in specs)
    assert 0.15 < len(long) / len(specs) < 0.35
    prefixes = {tuple(s.prompt_token_ids[:32]) for s in specs}
    assert prefixes == {tuple(p) for p in w.prefixes} and len(prefixes) == 2
    assert len({tuple(s.prompt_token_ids[32:]) for s in specs}) > 300     # suffixes are not shared


def test_sharegpt_dataset(tok, tmp_path):
    data = [{"conversations": [{"from": "human", "value": "How do I open a file?"},
                               {"from": "gpt", "value": "Use the built-in open function with a mode."}]},
            {"conversations": [{"from": "human", "value": "x " * 600}, {"from": "gpt", "value": "too long"}]},
            {"conversations": [{"from": "human", "value": "no reply"}]},
            {"id": "not a conversation"}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    w = Workload(WorkloadConfig(dataset=str(path), output_len=None), vocab_size=tok.vocab_size,
                 special_ids=tok.special_ids, tokenizer=tok, max_model_len=256)
    assert len(w.dataset) == 1
    s = w.next()
    assert s.prompt_token_ids == tok.encode("How do I open a file?")
    assert s.max_tokens == len(tok.encode("Use the built-in open function with a mode."))
    with pytest.raises(ValueError, match="--dataset"):
        Workload(WorkloadConfig(dataset=str(path), output_len=None), vocab_size=tok.vocab_size, tokenizer=tok,
                 max_model_len=4)


def test_dataset_prompts_are_drawn_without_replacement(tok, tmp_path):
    # Drawing with replacement repeats prompts long before the dataset is used up, and a repeat is a full
    # prefix-cache hit: TTFT too good, and the "seen these prompts before" note blaming the core.
    data = [{"conversations": [{"from": "human", "value": f"question number {i}"},
                               {"from": "gpt", "value": f"answer {i}"}]} for i in range(20)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    cfg = WorkloadConfig(dataset=str(path), output_len=None, seed=5)
    w = Workload(cfg, vocab_size=tok.vocab_size, special_ids=tok.special_ids, tokenizer=tok, max_model_len=256)
    prompts = [tuple(s.prompt_token_ids) for s in w.take(40)]
    assert len(set(prompts[:20])) == 20 and set(prompts[20:]) == set(prompts[:20])   # each once per pass
    assert prompts[:20] != [tuple(ids) for ids, _ in w.dataset]                           # in a seeded random order
    again = Workload(cfg, vocab_size=tok.vocab_size, special_ids=tok.special_ids, tokenizer=tok, max_model_len=256)
    assert [tuple(s.prompt_token_ids) for s in again.take(40)] == prompts


def test_bench_imports_neither_torch_nor_core():
    code = ("import sys, llmserve_bench, llmserve_bench.cli, llmserve_bench.report, llmserve_bench.compare; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('llmserve_core')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


# ---------------------------------------------------------------- the runners against a scripted client

class FakeClient:
    """Answers every request with max_tokens tokens, one every `token_s` seconds after `ttft_s` (or per-request
    durations from `ttft_for(prompt_len)`): the runners' scheduling and bookkeeping without a core."""

    def __init__(self, ttft_s=0.0, token_s=0.0, ttft_for=None):
        from types import SimpleNamespace
        self.model_info = SimpleNamespace(model="fake", name="fake", vocab_size=100, max_model_len=4096,
                                          eos_token_ids=[], speculative=None, speculative_model=None)
        self.ttft_for = ttft_for or (lambda _n: ttft_s)
        self.token_s = token_s
        self.in_flight = self.max_in_flight = 0

    async def stats(self, timeout=None):
        return {"running": self.in_flight}

    async def stream(self, ids, detokenize=False, max_tokens=1, **_):
        return FakeStream(self, len(ids), max_tokens)


class FakeStream:
    def __init__(self, client, n_in, n_out):
        from types import SimpleNamespace
        self.client, self.n_in, self.n_out = client, n_in, n_out
        self.completion = SimpleNamespace(timings=SimpleNamespace(sent=time.monotonic(), token_times=[], done=None),
                                          finish_reason="length", usage=SimpleNamespace(cached_tokens=0))

    async def __aenter__(self):
        self.client.in_flight += 1
        self.client.max_in_flight = max(self.client.max_in_flight, self.client.in_flight)
        return self

    async def __aexit__(self, *exc):
        self.client.in_flight -= 1

    async def __aiter__(self):
        import asyncio
        from types import SimpleNamespace
        t = self.completion.timings
        for i in range(self.n_out):
            await asyncio.sleep(self.client.ttft_for(self.n_in) if i == 0 else self.client.token_s)
            t.token_times.append(time.monotonic())
            yield SimpleNamespace(token_ids=[1])
        t.done = time.monotonic()


def _fake_workload(**kw):
    return Workload(WorkloadConfig(**{"input_len": 8, "output_len": 2, **kw}), vocab_size=100)


def test_poisson_arrivals_start_with_the_first_request():
    # vLLM sends the first request at the start and waits the drawn gaps between requests. Waiting one gap
    # before the first request added an idle stretch (mean 1 / rate) to the benchmark duration, so every
    # throughput came out low.
    import asyncio
    from llmserve_bench.runner import run_finite
    rng = random.Random(1 + 1)                         # the arrival generator of --seed 1
    gaps = [rng.gammavariate(1.0, 1.0 / 5.0) for _ in range(3)]
    assert gaps[0] > 0.5                               # a first gap that would show
    res = asyncio.run(run_finite(FakeClient(), _fake_workload(seed=1), num_requests=3, request_rate=5.0,
                                 progress=False, stats_interval=0.05))
    sent = [r.sent - res.t0 for r in res.records]
    assert sent[0] < gaps[0] / 2
    assert sent[1] == pytest.approx(gaps[0], abs=0.2) and sent[2] == pytest.approx(gaps[0] + gaps[1], abs=0.2)


def test_the_probe_prompt_is_no_other_seeds_workload_prompt():
    # random.Random seeds an int by its absolute value, so a probe seeded with -1 - seed drew the very first
    # prompt of --seed + 1: in a seed sweep on one core, that run's first request hit the prefix cache.
    import asyncio
    from llmserve_bench.runner import Sampling, probe
    sent = []

    class Recorder:
        async def generate(self, ids, **_):
            sent.append(list(ids))

    firsts = {tuple(_fake_workload(seed=s, input_len=16).next().prompt_token_ids) for s in range(-3, 5)}
    for seed in range(-2, 4):
        asyncio.run(probe(Recorder(), _fake_workload(seed=seed, input_len=16), Sampling()))
        assert len(sent[-1]) == 16 and tuple(sent[-1]) not in firsts, seed


def test_closed_loop_holds_its_concurrency_until_the_measured_requests_finish():
    import asyncio
    from llmserve_bench.runner import run_closed_loop_async
    client = FakeClient(token_s=0.01, ttft_for=lambda n: 0.02 if n == 8 else 0.4)   # short and long requests
    wl = Workload(WorkloadConfig(mix=parse_mix("0.5:8:2,0.5:64:2"), seed=0), vocab_size=100)
    res = asyncio.run(run_closed_loop_async(client, wl, max_concurrency=2, warmup_seconds=0.2,
                                            measurement_seconds=1.0, progress=False, stats_interval=0.05))
    t_w, t_e = res.window
    st, measured = res.steady_state, [r for r in res.records if t_w <= r.sent < t_e]
    assert client.max_in_flight == 2 and any(r.done > t_e for r in measured)
    assert st["window_requests"] == len(measured)
    assert st["mean_e2el_ms"] == pytest.approx(1000 * sum(r.e2el for r in measured) / len(measured))
    # Each measured request ran at the requested concurrency to its end: when it finished, the other worker
    # still had a request in flight (one sent after the window if need be, which is not measured).
    for r in measured:
        assert any(q is not r and q.sent <= r.done <= q.done for q in res.records), r
    assert not any(r.sent >= t_e and r.sent > max(q.done for q in measured) for r in res.records)
    # Per class, the steady state counts as the window does: the classes add up to the whole.
    groups = st["by_group"]
    assert set(groups) == {"8:2", "64:2"}
    assert sum(g["window_output_tokens"] for g in groups.values()) == st["window_output_tokens"]
    assert sum(g["request_throughput"] for g in groups.values()) == pytest.approx(st["request_throughput"])
    assert sum(g["window_requests"] for g in groups.values()) == st["window_requests"]


# ---------------------------------------------------------------- bad arguments: exit 2, nothing started

@pytest.mark.parametrize("argv, message", [
    (["run", "--num-requests", "0"], "--num-requests"),
    (["run", "--request-rate", "-1"], "--request-rate"),
    (["run", "--request-rate", "nan"], "--request-rate"),
    (["run", "--arrival", "poisson"], "needs --request-rate"),
    (["run", "--arrival", "all", "--request-rate", "3"], "--arrival all"),
    (["run", "--request-rate", "2", "--burstiness", "0"], "--burstiness"),
    (["run", "--mix", "0.8:128"], "--mix"),
    (["run", "--mix", "1:8:8", "--input-len", "8"], "--mix"),
    (["run", "--slo", "ttft=5"], "--slo"),
    (["run", "--slo", "tpot:-5"], "--slo"),
    (["run", "--dataset", "/nonexistent/sharegpt.json"], "--dataset"),
    (["run", "--shared-prefix-len", "100", "--input-len", "100"], "--shared-prefix-len"),
    (["run", "--num-prefixes", "4"], "--num-prefixes needs --shared-prefix-len"),
    (["run", "--endpoint", "ipc:///tmp/x", "--", "--device", "cpu"], "need --model"),
    (["run", "--endpoint", "ipc:///tmp/x", "--model", "/tmp"], "not allowed with"),
    (["run", "--model", "/nonexistent"], "--model"),
    (["run", "--result-json", "/dev/null/r.json"], "--result-json"),     # (no directory can be made there)
    (["closed-loop", "--max-concurrency", "0"], "--max-concurrency"),
    (["closed-loop", "--measurement-seconds", "0"], "--measurement-seconds"),
    (["closed-loop", "--warmup-seconds", "-1"], "--warmup-seconds"),
    (["bogus"], "invalid choice"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_too_long_prompt_for_the_model_exits_2_before_starting_a_core(tiny_model_dir, capsys):
    t = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", tiny_model_dir, "--input-len", "200", "--output-len", "100", "--",
              "--max-model-len", "256"])
    assert e.value.code == 2 and time.monotonic() - t < 5
    assert "exceeds the model's max_model_len 256" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end against a real core

@pytest.fixture(scope="module")
def core(tiny_model_dir):
    c = CoreProcess(tiny_model_dir, CORE_ARGS).start()
    try:
        c.wait_socket(180)
        from llmserve_client import Client
        with Client(c.endpoint, connect_timeout=180) as client:
            client.generate([5] * 8, max_tokens=2, detokenize=False)    # first-request costs, outside the tests
        yield c
    finally:
        assert c.stop() == 0, c.log_tail()


@pytest.fixture(scope="module")
def finite_json(core, tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("bench-run")
    path, png = str(d / "run.json"), str(d / "run.png")
    assert main(["run", "--endpoint", core.endpoint, "--num-requests", "10", "--prompt-mode", "natural",
                 "--input-len", "24", "--output-len", "6", "--request-rate", "50", "--burstiness", "0.5",
                 "--slo", "ttft:60000", "tpot:60000", "--result-json", path, "--plot", png, "--no-progress",
                 "--stats-interval", "0.05"]) == 0
    return path


@pytest.fixture(scope="module")
def closed_json(core, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench-closed") / "closed.json")
    assert main(["closed-loop", "--endpoint", core.endpoint, "--max-concurrency", "3", "--warmup-seconds", "0.3",
                 "--measurement-seconds", "3", "--input-len", "16", "--output-len", "2",
                 "--result-json", path, "--no-progress", "--stats-interval", "0.1"]) == 0
    return path


def _per_request_invariants(data):
    for r in data["requests"]:
        assert r["error"] is None and r["finish_reason"] == "length"
        assert r["output_len"] == r["max_tokens"]                          # ignore_eos is on by default
        assert len(r["token_times"]) == r["output_len"]
        assert 0 <= r["ttft_ms"] <= r["e2el_ms"]
        assert r["sent"] <= r["token_times"][0] <= r["token_times"][-1] <= r["done"] + 1e-6


def test_finite_run_end_to_end(finite_json, capsys):
    data = json.load(open(finite_json))
    s = data["summary"]
    assert data["mode"] == "run" and len(data["requests"]) == 10
    _per_request_invariants(data)
    assert s["completed"] == 10 and s["failed"] == 0
    assert s["total_input_tokens"] == 240 and s["total_output_tokens"] == 60
    assert s["request_throughput"] * s["duration"] == pytest.approx(10)
    assert s["output_throughput"] * s["duration"] == pytest.approx(60)
    assert s["total_token_throughput"] * s["duration"] == pytest.approx(300)
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])        # every request meets the SLO
    assert 0 < s["mean_ttft_ms"] <= s["mean_e2el_ms"] and s["median_ttft_ms"] <= s["p99_ttft_ms"]
    # What each request's own token times give (the JSON keeps them to the microsecond). Not "> 0": a busy
    # client can read all six tokens of a request in one message, and then its time per output token is 0.
    tpots = [(r["done"] - r["token_times"][0]) * 1000 / (len(r["token_times"]) - 1) for r in data["requests"]]
    assert s["mean_tpot_ms"] == pytest.approx(sum(tpots) / len(tpots), abs=0.01)
    arrivals = [sorted(set(r["token_times"])) for r in data["requests"]]
    gaps = [(b - a) * 1000 for times in arrivals for a, b in zip(times, times[1:])]
    assert s["median_itl_ms"] == pytest.approx(percentile(gaps, 50), abs=0.01)
    # The batch-size gauge is sampled: a busy machine can run all ten short requests between two polls, so
    # the core's work shows in its counters (first poll before the first request, last after the last).
    assert s["core_stats_samples"] >= 2 and s["core_max_batch_size"] >= 0
    assert s["core_generated_tokens_per_step"] > 0
    sent = [r["sent"] for r in data["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0                                  # gamma arrivals, not all at once
    env = data["environment"]
    assert env["python"] and env["host"] and env["torch_version"] and "git_commit" in env
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert len(env["git_commit"]) == 40
    assert data["config"]["workload"]["prompt_mode"] == "natural"
    assert os.path.getsize(finite_json[:-4] + "png") > 10_000


def test_closed_loop_end_to_end(closed_json):
    data = json.load(open(closed_json))
    st, whole, reqs = data["steady_state"], data["summary"], data["requests"]
    start, end = data["window"]["start"], data["window"]["end"]
    assert end - start == pytest.approx(3.0, abs=1e-3)
    _per_request_invariants(data)
    # Concurrency: never more than 3 in flight, as sent and as the engine saw it.
    assert data["max_in_flight"] == 3 and max(r["in_flight_at_send"] for r in reqs) == 3
    assert all(s["running"] + s["waiting"] <= 3 for s in data["core_stats"])
    # After the window the loop holds its concurrency while measured requests are in flight (the scripted
    # client's test checks that), then every request drains.
    measured = [r for r in reqs if start <= r["sent"] < end]
    assert whole["completed"] == len(reqs)
    # Window throughput counts exactly the tokens received inside it.
    in_window = sum(1 for r in reqs for t in r["token_times"] if start <= t <= end)
    assert st["window_output_tokens"] == in_window > 0
    assert st["output_throughput"] * st["window_seconds"] == pytest.approx(in_window)
    assert st["window_requests"] == st["completed"] == len(measured) >= 1
    assert st["mean_e2el_ms"] == pytest.approx(sum(r["e2el_ms"] for r in measured) / len(measured), rel=1e-4)
    assert st["core_stats_samples"] >= 2 and st["core_max_batch_size"] <= 3


def test_compare(finite_json, closed_json, capsys):
    assert main(["compare", finite_json, closed_json]) == 0
    out = capsys.readouterr().out
    assert "output_throughput" in out and "B/A" in out
    a, b = json.load(open(finite_json)), json.load(open(closed_json))
    rows, _ = compare(b, b)
    assert rows and all(r["ratio"] == pytest.approx(1.0) for r in rows if r["ratio"] is not None)
    rows, text = compare(a, b)
    thr = next(r for r in rows if r["metric"] == "output_throughput")
    assert thr["ratio"] == pytest.approx(b["summary"]["output_throughput"] / a["summary"]["output_throughput"])
    assert main(["compare", finite_json, "/nonexistent.json"]) == 2


def test_shared_prefix_run_hits_the_prefix_cache(core, tmp_path):
    path = str(tmp_path / "prefix.json")
    assert main(["run", "--endpoint", core.endpoint, "--num-requests", "6", "--max-concurrency", "1",
                 "--input-len", "40", "--output-len", "2", "--shared-prefix-len", "32", "--seed", "7",
                 "--result-json", path, "--no-progress"]) == 0
    s = json.load(open(path))["summary"]
    assert s["cached_prompt_tokens"] >= 5 * 32 and s["core_prefix_hit_rate"] > 0.3
    assert s["max_concurrent_requests"] == 1


def test_mix_reports_each_class(core, tmp_path, capsys):
    path = str(tmp_path / "mix.json")
    assert main(["run", "--endpoint", core.endpoint, "--num-requests", "8", "--mix", "0.5:8:2,0.5:64:3",
                 "--result-json", path, "--no-progress"]) == 0
    data = json.load(open(path))
    groups = data["summary"]["by_group"]
    assert set(groups) == {"8:2", "64:3"} and sum(g["completed"] for g in groups.values()) == 8
    for r in data["requests"]:
        assert (r["prompt_len"], r["output_len"]) == {"8:2": (8, 2), "64:3": (64, 3)}[r["group"]]
    assert groups["64:3"]["total_input_tokens"] == 64 * groups["64:3"]["completed"]
    assert "Per class (whole run)" in capsys.readouterr().out


def test_prompt_too_long_for_a_running_core_exits_2(core, capsys):
    assert main(["run", "--endpoint", core.endpoint, "--input-len", "250", "--output-len", "16",
                 "--no-progress"]) == 2
    assert "max_model_len 256" in capsys.readouterr().err


def test_run_closed_loop_api(core):
    from llmserve_bench import run_closed_loop
    result = run_closed_loop(core.endpoint, max_concurrency=2, warmup_seconds=0.2, measurement_seconds=1.0,
                             input_len=16, output_len=3)
    assert result.max_in_flight <= 2 and result.steady_state["window_seconds"] == pytest.approx(1.0)
    table = result.table()
    assert "steady state" in table and "Output token throughput (tok/s)" in table


def _python(*argv) -> subprocess.Popen:
    """A Python child that imports this checkout's packages, its output piped as text."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start_bench(model_dir, *argv):
    return _python("-m", "llmserve_bench", *argv, "--no-progress", "--model", model_dir, "--", *CORE_ARGS)


@contextlib.contextmanager
def _killed_on_failure(p: subprocess.Popen):
    """Whatever fails inside, the child does not outlive the test."""
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _core_pid(stderr_line: str) -> int:
    return int(stderr_line.split("(pid ")[1].split(")")[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_bench_starts_its_own_core_and_stops_it_afterwards(tiny_model_dir, tmp_path):
    path = str(tmp_path / "own.json")
    p = _start_bench(tiny_model_dir, "run", "--num-requests", "4", "--input-len", "8", "--output-len", "2",
                     "--result-json", path)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "Serving Benchmark Result" in out and json.load(open(path))["summary"]["completed"] == 4
    assert _gone(_core_pid(err.splitlines()[0]))


def test_bench_starts_its_own_core_and_stops_it_on_ctrl_c(tiny_model_dir):
    # Readiness, not sleeps: the core's socket, then the core's own count of requests received, with
    # deadlines a busy 2-core machine can meet (a core that loads in 5 s alone may take a minute there).
    p = _start_bench(tiny_model_dir, "closed-loop", "--max-concurrency", "2", "--warmup-seconds", "0",
                     "--measurement-seconds", "600", "--input-len", "8", "--output-len", "64")
    with _killed_on_failure(p):
        line = p.stderr.readline()
        assert "started llmserve-core" in line, line + p.stderr.read()
        pid = _core_pid(line)
        sock = os.path.join(os.path.dirname(line.rsplit("log: ", 1)[1].strip()), "core.sock")
        deadline = time.monotonic() + 180
        while not os.path.exists(sock):                                  # the core binds once loaded
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
            time.sleep(0.1)
        from llmserve_client import Client
        with Client("ipc://" + sock, connect_timeout=180) as watcher:
            while watcher.stats()["requests_received"] < 2:               # the bench's requests are in flight
                assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
                time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=180)
    assert p.returncode == 130, err
    assert "interrupted" in err
    deadline = time.monotonic() + 60
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


def test_warns_when_a_workload_without_shared_prefixes_hits_the_cache(capsys):
    from llmserve_bench.cli import warn_seen_prompts
    warn_seen_prompts(WorkloadConfig(), {"total_input_tokens": 1000, "cached_prompt_tokens": 600})
    assert "seen these prompts before" in capsys.readouterr().err
    warn_seen_prompts(WorkloadConfig(shared_prefix_len=32), {"total_input_tokens": 1000, "cached_prompt_tokens": 600})
    warn_seen_prompts(WorkloadConfig(), {"total_input_tokens": 1000, "cached_prompt_tokens": 0})
    assert capsys.readouterr().err == ""


def test_sigterm_unwinds_the_bench_as_ctrl_c_does():
    """`timeout` and `kill` send SIGTERM; without a handler Python ends at once without unwinding, which
    left the core a bench had started running (and holding the GPU)."""
    returncode, out, err = _interrupted(signal.SIGTERM, stubborn=False, grace_s=600)
    assert returncode == 0, err
    assert "unwound" in out and "returned normally" in out


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (an orphan's reaper may be slow or absent in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_owner_is_killed():
    """llmserve-bench's core, the HTTP frontend's cores and the benchmarks' cores are started this way, so
    a SIGKILLed owner does not leave a core running."""
    code = textwrap.dedent("""
        import subprocess, sys, time
        from llmserve_client.child_process import die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=die_with_parent)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    with _killed_on_failure(_python("-c", code)) as p:
        child = int(p.stdout.readline())
        assert not _exited(child)
        p.kill()
        p.wait()
    deadline = time.monotonic() + 60
    while not _exited(child):
        assert time.monotonic() < deadline, "the child outlived its SIGKILLed owner"
        time.sleep(0.1)


def _interrupted(sig: int, stubborn: bool, grace_s: float) -> tuple[int, str, str]:
    """A script inside bounded_interrupt whose asyncio loop gets `sig` once it runs (with a task that
    swallows its cancellation if `stubborn`): its exit code, stdout and stderr."""
    code = textwrap.dedent(f"""
        import asyncio
        from llmserve_bench.interrupt import bounded_interrupt

        async def stubborn():
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    pass

        async def main():
            if {stubborn}:
                asyncio.create_task(stubborn())
                await asyncio.sleep(0.1)                # stubborn() is inside its sleep now
            print("ready", flush=True)
            await asyncio.sleep(3600)

        with bounded_interrupt(lambda: print("core stopped", flush=True), grace_s={grace_s}):
            try:
                asyncio.run(main())
            except KeyboardInterrupt:
                print("unwound", flush=True)
        print("returned normally", flush=True)
    """)
    with _killed_on_failure(_python("-c", code)) as p:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()      # the loop runs: interrupt it now
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def test_ctrl_c_ends_the_bench_even_when_a_task_swallows_its_cancellation():
    """asyncio's unwinding after Ctrl-C cancels every task and waits for it; a task that swallows its
    cancellation would hang the bench (and leave its core running) for good. The watchdog stops the core
    and exits 130 once the grace period has passed."""
    returncode, out, err = _interrupted(signal.SIGINT, stubborn=True, grace_s=1.0)
    assert returncode == 130, err
    assert "core stopped" in out and "returned normally" not in out
    assert "cleanup did not finish" in err


@pytest.mark.parametrize("rope,want", [
    (None, 40960),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, None),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, None),
])
def test_the_early_length_check_leaves_yarn_models_to_the_core(tmp_path, rope, want):
    # Under YaRN the core serves factor x original positions, more than max_position_embeddings: the bench
    # must not refuse up front what the core would serve.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 40960, "rope_scaling": rope}))
    assert model_max_len(str(tmp_path), []) == want
    assert model_max_len(str(tmp_path), ["--max-model-len", "100"]) == 100
    # Repeated, the core's parser keeps the last one; so does the check.
    assert model_max_len(str(tmp_path), ["--max-model-len", "100", "--max-model-len=300"]) == 300

