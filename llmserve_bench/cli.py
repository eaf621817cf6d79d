"""`llmserve-bench`: serving benchmarks against llmserve-core over its IPC protocol.

    llmserve-bench run         --endpoint ipc://PATH --num-requests 200 --input-len 512 --output-len 128 --request-rate 8
    llmserve-bench closed-loop --model DIR --max-concurrency 16 --warmup-seconds 5 --measurement-seconds 30 -- --max-num-seqs 64
    llmserve-bench compare A.json B.json
    llmserve-bench soak        --duration 1800 --result-json soak.json      # a core + HTTP frontend of its own
    llmserve-bench flood       --model DIR --phase-seconds 40 -- --max-num-seqs 256   # one client's flood beside another's probes
    llmserve-bench embed       --model DIR --lengths 128,512 --batch-sizes 1,32 --num-documents 256

With --model the bench starts its own core (flags after `--` go to it) and stops it afterwards; otherwise
it drives the core at --endpoint (default: the core's default endpoint). Exit codes: 0 done, 1 the run failed,
2 bad arguments (nothing was started), 130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

from llmserve_bench.interrupt import EXIT_INTERRUPTED, bounded_interrupt
from llmserve_bench.metrics import parse_slo
from llmserve_bench.workload import WorkloadConfig, length_classes, parse_mix

DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 128


class ConfigError(ValueError):
    """A problem with the arguments found once the model is known (exit 2)."""


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v > 0 or math.isnan(v):
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def _int_list(s: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {s}")
    return values


def _tasks(s: str) -> tuple[str, ...]:
    from llmserve_bench.embed import TASKS
    values = tuple(s.split(","))
    if not values or any(v not in TASKS for v in values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(TASKS)}, got {s!r}")
    return values


def _core_source(p: argparse.ArgumentParser):
    g = p.add_argument_group("core")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--endpoint", help="a running core (ipc://PATH or tcp://HOST:PORT); default: the core's default")
    src.add_argument("--model", help="start a core on this model directory for the run (its flags after `--`)")
    return g


def _common(p: argparse.ArgumentParser) -> None:
    g = _core_source(p)
    g.add_argument("--tokenizer", help="tokenizer directory (default: the one the core announces, else the model's)")
    g.add_argument("--connect-timeout", type=_positive_float,
                   help="seconds to wait for the core to be ready (default: 60 with --endpoint; 300 with --model, "
                        "which includes loading the model)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-mode", choices=["random", "natural"], default="random",
                   help="random: random token ids (no special tokens); natural: text from the shipped corpus")
    w.add_argument("--input-len", type=_positive_int, help=f"prompt tokens (default: {DEFAULT_INPUT_LEN})")
    w.add_argument("--output-len", type=_positive_int,
                   help=f"output tokens (default: {DEFAULT_OUTPUT_LEN}; with --dataset: the reply's length)")
    w.add_argument("--mix", help="weighted length classes WEIGHT:INPUT:OUTPUT,..., e.g. 0.8:128:128,0.2:4096:128")
    w.add_argument("--dataset", help="ShareGPT-format JSON: first human turn is the prompt, the reply sets the length")
    w.add_argument("--shared-prefix-len", type=_nonneg_int, default=0,
                   help="the first N prompt tokens come from one of --num-prefixes shared prefixes")
    w.add_argument("--num-prefixes", type=_positive_int, default=1)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the output length (default: on unless lengths come from --dataset)")
    w.add_argument("--temperature", type=_nonneg_float, default=0.0, help="sampling temperature (default: 0, greedy)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (prompts, lengths, arrivals)")
    o = p.add_argument_group("output")
    o.add_argument("--slo", nargs="+", default=[], metavar="NAME:MS",
                   help="goodput bounds, e.g. --slo ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    o.add_argument("--result-json", metavar="PATH", help="write config, environment, per-request records and summary")
    o.add_argument("--plot", metavar="PATH.png", help="latency CDFs and throughput over time (needs matplotlib)")
    o.add_argument("--stats-interval", type=_positive_float, default=0.5, help="seconds between stats() polls")
    o.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-bench", description=__doc__.split("\n\n")[0],
                                epilog="Flags after `--` go to llmserve-core when --model starts one.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="a finite workload (all at once, or Poisson/gamma arrivals)")
    r.add_argument("--num-requests", type=_positive_int, default=100)
    r.add_argument("--arrival", choices=["all", "poisson"],
                   help="all: send every request at once; poisson: gamma inter-arrivals at --request-rate "
                        "(default: poisson when --request-rate is given, else all)")
    r.add_argument("--request-rate", type=_positive_float, help="requests per second (mean)")
    r.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more regular")
    r.add_argument("--max-concurrency", type=_positive_int, help="cap on requests in flight (default: none)")
    _common(r)
    c = sub.add_parser("closed-loop", help="fixed concurrency, a finished request replaced at once")
    c.add_argument("--max-concurrency", type=_positive_int, default=8)
    c.add_argument("--warmup-seconds", type=_nonneg_float, default=5.0)
    c.add_argument("--measurement-seconds", type=_positive_float, default=30.0)
    _common(c)
    cmp = sub.add_parser("compare", help="ratios of the main metrics of two result JSONs (B/A)")
    cmp.add_argument("a", metavar="A.json")
    cmp.add_argument("b", metavar="B.json")
    s = sub.add_parser("soak", help="randomized soak of a core and HTTP frontend it starts; exit 1 if it fails",
                       description=_soak_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--duration", type=_positive_float, default=60.0, help="seconds of load (default: 60)")
    s.add_argument("--model", help="model directory (default: the tiny trained Qwen3 shipped with llmserve_core, "
                                   "on the CPU)")
    s.add_argument("--well-behaved", type=_positive_int, default=2,
                   help="well-behaved clients per transport, IPC and HTTP (default: 2)")
    s.add_argument("--chaos", type=_nonneg_int, default=2,
                   help="clients with random parameters, aborts and dropped streams, per transport (default: 2)")
    s.add_argument("--flood-inflight", type=_nonneg_int, default=128,
                   help="requests the flooding client keeps queued (default: 128, four times the core's "
                        "--max-num-seqs of 32; 0: no flood)")
    s.add_argument("--never-reader-rate", type=_nonneg_int, default=1,
                   help="requests per second from the client that never reads (default: 1; 0: none)")
    s.add_argument("--kill-every", type=_nonneg_float, default=10.0,
                   help="mean seconds between SIGKILLed client processes (default: 10; 0: none)")
    s.add_argument("--max-wait", type=_positive_float, default=60.0,
                   help="bound on any well-behaved request's or stats call's wait, seconds (default: 60)")
    s.add_argument("--max-rss-growth-mb", type=_positive_float, default=300.0,
                   help="bound on the core's and the frontend's RSS growth after the warm-up (default: 300)")
    s.add_argument("--seed", type=_nonneg_int, default=0)
    s.add_argument("--result-json", help="write the summary here")
    f = sub.add_parser("flood", help="one client floods, another probes: the prober's TTFT and the flood's "
                                     "throughput, each against running alone",
                       description=_flood_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    src = f.add_mutually_exclusive_group()
    src.add_argument("--endpoint", help="a running core (default: the core's default endpoint)")
    src.add_argument("--model", help="start a core on this model directory for the run (its flags after `--`)")
    f.add_argument("--tokenizer", help="tokenizer directory (default: the one the core announces, if any)")
    f.add_argument("--connect-timeout", type=_positive_float,
                   help="seconds to wait for the core (default: 60 with --endpoint; 900 with --model)")
    f.add_argument("--flood-concurrency", type=_positive_int, default=1024,
                   help="requests the flooder keeps in flight (default: 1024; past the core's "
                        "--max-queued-requests-per-client the rest are refused and retried)")
    f.add_argument("--input-len", type=_positive_int, default=512, help="flood prompt tokens (default: 512)")
    f.add_argument("--output-len", type=_positive_int, default=400, help="flood output tokens (default: 400)")
    f.add_argument("--probe-rate", type=_positive_float, default=1.0, help="probes per second (default: 1)")
    f.add_argument("--probe-input-len", type=_positive_int, default=32, help="probe prompt tokens (default: 32)")
    f.add_argument("--probe-output-len", type=_positive_int, default=8, help="probe output tokens (default: 8)")
    f.add_argument("--phase-seconds", type=_positive_float, default=40.0,
                   help="length of each of the three phases (default: 40)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--result-json", metavar="PATH", help="write config, environment, phases and summary")
    e = sub.add_parser("embed", help="embedding and rerank throughput (documents/s, tokens/s) over IPC",
                       description=_embed_doc(), formatter_class=argparse.RawDescriptionHelpFormatter)
    g = _core_source(e)
    g.add_argument("--connect-timeout", type=_positive_float,
                   help="seconds to wait for the core to be ready (default: 60 with --endpoint, 300 with --model)")
    e.add_argument("--tasks", type=_tasks,
                   help="embed, rerank or both, comma-separated (default: what the core serves)")
    e.add_argument("--lengths", type=_int_list, default="512", help="document lengths in tokens (default: 512)")
    e.add_argument("--batch-sizes", type=_int_list, default="1,32", help="documents per call (default: 1,32)")
    e.add_argument("--num-documents", type=_positive_int, default=256, help="documents per point (default: 256)")
    e.add_argument("--concurrency", type=_positive_int, default=1, help="calls in flight (default: 1)")
    e.add_argument("--dimensions", type=_positive_int, help="embed: keep the first N values (default: all)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random documents")
    e.add_argument("--result-json", metavar="PATH", help="write config, environment and every point")
    e.add_argument("--no-progress", action="store_true", help="no line on stderr per finished point")
    p.subcommands = {"run": r, "closed-loop": c, "compare": cmp, "soak": s, "flood": f, "embed": e}
    return p


def _embed_doc() -> str:
    from llmserve_bench import embed
    return embed.__doc__


def _flood_doc() -> str:
    from llmserve_bench import flood
    return flood.__doc__.split("\n\n", 1)[1]


def check_core_and_output(parser, args, core_args: list[str]) -> None:
    """The checks every subcommand that may start a core and writes a result makes before anything runs."""
    if core_args and not args.model:
        parser.error("flags after `--` go to a core the bench starts; they need --model")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model: {args.model}: not a model directory (no config.json)")
    if args.result_json and not os.path.isdir(os.path.dirname(os.path.abspath(args.result_json))):
        parser.error(f"--result-json: the directory of {args.result_json} does not exist")


def _flood_main(parser, args, core_args: list[str]) -> int:
    from llmserve_bench import flood
    from llmserve_bench.report import environment
    check_core_and_output(parser, args, core_args)
    cfg = flood.FloodConfig(flood_concurrency=args.flood_concurrency, input_len=args.input_len,
                            output_len=args.output_len, probe_rate=args.probe_rate,
                            probe_input_len=args.probe_input_len, probe_output_len=args.probe_output_len,
                            phase_seconds=args.phase_seconds, seed=args.seed)
    timeout = args.connect_timeout or (900.0 if args.model else 60.0)
    log = lambda line: print(line, file=sys.stderr, flush=True)    # noqa: E731
    code, result = _run_with_core(args, core_args, timeout, (ValueError,),
                                  lambda endpoint: flood.run_flood(endpoint, cfg, timeout, args.tokenizer, log))
    if code is not None:
        return code
    print(flood.format_table(result))
    if args.result_json:
        import json
        result["environment"] = environment()
        result["core_args"] = core_args
        with open(args.result_json, "w") as fh:
            json.dump(result, fh, indent=1)
        log(f"llmserve-bench: results written to {args.result_json}")
    return 0


def _soak_doc() -> str:
    from llmserve_bench import soak
    return soak.__doc__.split("\n\n", 1)[1]


def _soak_main(parser, args, core_args: list[str]) -> int:
    from llmserve_bench import soak
    from llmserve_client.core_flags import flag_value
    model = args.model or soak.default_model()
    if model is None or not os.path.isdir(model):
        parser.error(f"--model: {model!r} is not a directory" if model else "--model: no shipped tiny model found")
    draft = soak.default_draft() if args.model is None else None
    if draft and flag_value(core_args, "--speculative-model") is None:
        core_args = ["--speculative-model", draft, *core_args]
    cfg = soak.SoakConfig(model=model, duration_s=args.duration, core_args=core_args,
                          well_behaved=args.well_behaved, chaos=args.chaos, flood_inflight=args.flood_inflight,
                          never_reader_per_s=args.never_reader_rate, kill_every_s=args.kill_every,
                          max_wait_s=args.max_wait, max_rss_growth_mb=args.max_rss_growth_mb, seed=args.seed)
    try:
        result = soak.run_soak(cfg)
    except KeyboardInterrupt:
        print("\nllmserve-bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(result.table())
    if args.result_json:
        soak.write_json(result, args.result_json)
        print(f"llmserve-bench: results written to {args.result_json}", file=sys.stderr)
    return 0 if result.passed else 1


def check_args(parser: argparse.ArgumentParser, args, core_args: list[str]) -> tuple[WorkloadConfig, dict]:
    """Everything that can be checked before starting anything; parser.error() exits 2."""
    err = parser.error
    if args.cmd == "run":
        if args.arrival == "poisson" and args.request_rate is None:
            err("--arrival poisson needs --request-rate")
        if args.arrival == "all" and args.request_rate is not None:
            err("--arrival all sends everything at once; drop --request-rate or use --arrival poisson")
        if args.request_rate is None and args.burstiness != 1.0:
            err("--burstiness shapes arrivals at a --request-rate; give one")
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        err(str(e))
    mix = []
    if args.mix is not None:
        try:
            mix = parse_mix(args.mix)
        except ValueError as e:
            err(str(e))
        if args.input_len is not None or args.output_len is not None:
            err("--mix sets input and output lengths; drop --input-len/--output-len")
    if args.dataset is not None:
        if not os.path.isfile(args.dataset):
            err(f"--dataset: {args.dataset}: no such file")
        if mix:
            err("--mix and --dataset cannot be combined")
        if args.shared_prefix_len:
            err("--shared-prefix-len works with generated prompts, not --dataset")
        if args.input_len is not None:
            err("--input-len: prompt lengths come from --dataset")
    wl = WorkloadConfig(
        prompt_mode=args.prompt_mode,
        input_len=args.input_len or DEFAULT_INPUT_LEN,
        output_len=args.output_len if args.dataset else (args.output_len or DEFAULT_OUTPUT_LEN),
        mix=mix, dataset=args.dataset, shared_prefix_len=args.shared_prefix_len,
        num_prefixes=args.num_prefixes, seed=args.seed)
    if args.num_prefixes > 1 and not args.shared_prefix_len:
        err("--num-prefixes needs --shared-prefix-len")
    if args.shared_prefix_len:
        shortest = min(i for i, _ in length_classes(wl))
        if args.shared_prefix_len >= shortest:
            err(f"--shared-prefix-len {args.shared_prefix_len} must be shorter than the input length {shortest}")
    if args.connect_timeout is None:
        args.connect_timeout = 300.0 if args.model else 60.0
    if args.ignore_eos is None:
        args.ignore_eos = wl.output_len is not None
    if core_args and not args.model:
        err("flags after `--` go to a core the bench starts; they need --model")
    if args.model:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            err(f"--model: {args.model}: not a model directory (no config.json)")
        from llmserve_bench.core_process import model_max_len
        limit = model_max_len(args.model, core_args)
        if limit:
            from llmserve_bench.workload import check_lengths
            try:
                check_lengths(wl, limit)
            except ValueError as e:
                err(str(e))
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        err(f"--tokenizer: {args.tokenizer}: not a directory")
    for flag, path in (("--result-json", args.result_json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            err(f"{flag}: the directory of {path} does not exist")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        err("--plot needs matplotlib: pip install matplotlib (or llmserve[bench])")
    return wl, slo


def run_config(args, wl: WorkloadConfig, slo: dict, core_args: list[str]) -> dict:
    import dataclasses
    cfg = {k: v for k, v in vars(args).items() if k not in ("slo",)}
    cfg["workload"] = dataclasses.asdict(wl)
    cfg["slo"] = slo
    cfg["core_args"] = core_args
    return cfg


async def _bench(args, endpoint: str, wl: WorkloadConfig, slo: dict, config: dict):
    from llmserve_client import AsyncClient
    from llmserve_bench.runner import Sampling, make_workload, probe, run_closed_loop_async, run_finite
    async with AsyncClient(endpoint, connect_timeout=args.connect_timeout, client_name="llmserve-bench") as client:
        try:
            workload = make_workload(wl, client.model_info, args.tokenizer)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
        sampling = Sampling(args.ignore_eos, args.temperature)
        await probe(client, workload, sampling)
        common = dict(sampling=sampling, slo=slo, stats_interval=args.stats_interval,
                      progress=not args.no_progress, config=config)
        if args.cmd == "run":
            rate = args.request_rate if args.request_rate is not None else float("inf")
            return await run_finite(client, workload, num_requests=args.num_requests, request_rate=rate,
                                    burstiness=args.burstiness, max_concurrency=args.max_concurrency, **common)
        return await run_closed_loop_async(client, workload, max_concurrency=args.max_concurrency,
                                           warmup_seconds=args.warmup_seconds,
                                           measurement_seconds=args.measurement_seconds, **common)


def _compare_main(args) -> int:
    from llmserve_bench.compare import compare, load
    try:
        a, b = load(args.a), load(args.b)
    except ValueError as e:
        print(f"llmserve-bench compare: error: {e}", file=sys.stderr)
        return 2
    print(compare(a, b, args.a, args.b)[1])
    return 0


def warn_seen_prompts(wl: WorkloadConfig, summary: dict) -> None:
    """Prefix-cache hits in a workload without shared prefixes mean the core has served these very prompts
    before (the same --seed against a core that kept running): the numbers are not cold-cache ones."""
    total, cached = summary.get("total_input_tokens", 0), summary.get("cached_prompt_tokens", 0)
    if not wl.shared_prefix_len and total and cached / total > 0.05:
        print(f"llmserve-bench: note: the prefix cache served {100 * cached / total:.0f}% of the prompt tokens, "
              "though this workload shares no prefixes: the core has seen these prompts before (same --seed on a "
              "running core?). Use another --seed, or restart the core, for cold-cache numbers.", file=sys.stderr)


def _run_with_core(args, core_args: list[str], timeout: float, config_errors: tuple, coro_for):
    """Run coro_for(endpoint) at --endpoint, or at a core started on --model (and stopped afterwards).
    Returns (exit code, None) when the run could not be done, else (None, its result)."""
    from llmserve_client import LLMServeError, run
    from llmserve_bench.core_process import CoreProcess, CoreStartError
    from llmserve_bench.runner import BenchError
    core = None
    # Ctrl-C stops the bench and its core within a bounded time, even if asyncio's unwinding hangs.
    with bounded_interrupt(lambda: core.stop() if core is not None else None):
        try:
            endpoint = args.endpoint
            if args.model:
                core = CoreProcess(args.model, core_args).start()
                print(f"llmserve-bench: started llmserve-core (pid {core.proc.pid}) on {args.model}; log: {core.log_path}",
                      file=sys.stderr)
                core.wait_socket(timeout)
                endpoint = core.endpoint
            return None, run(coro_for(endpoint))
        except config_errors as e:
            print(f"llmserve-bench {args.cmd}: error: {e}", file=sys.stderr)
            return 2, None
        except CoreStartError as e:
            print(f"llmserve-bench: {e}", file=sys.stderr)
            return (2 if e.returncode == 2 else 1), None
        except (BenchError, LLMServeError) as e:
            tail = f"\ncore log:\n{core.log_tail()}" if core is not None else ""
            print(f"llmserve-bench: the run failed: {e}{tail}", file=sys.stderr)
            return 1, None
        except KeyboardInterrupt:
            print("\nllmserve-bench: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED, None
        finally:
            if core is not None:
                core.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    core_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, core_args = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "compare":
        return _compare_main(args)
    if args.cmd == "soak":
        return _soak_main(parser.subcommands["soak"], args, core_args)
    if args.cmd == "flood":
        return _flood_main(parser.subcommands["flood"], args, core_args)
    if args.cmd == "embed":
        from llmserve_bench.embed import embed_main
        return embed_main(parser.subcommands["embed"], args, core_args)
    wl, slo = check_args(parser.subcommands[args.cmd], args, core_args)   # errors name the subcommand
    config = run_config(args, wl, slo, core_args)
    code, result = _run_with_core(args, core_args, args.connect_timeout, (ConfigError,),
                                  lambda endpoint: _bench(args, endpoint, wl, slo, config))
    if code is not None:
        return code
    from llmserve_bench.report import write_json, write_plot
    print(result.table())
    if args.result_json:
        write_json(result, args.result_json)
        print(f"llmserve-bench: results written to {args.result_json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"llmserve-bench: plot written to {args.plot}", file=sys.stderr)
    warn_seen_prompts(wl, result.summary)
    failed = result.summary.get("failed", 0)
    if failed:
        print(f"llmserve-bench: {failed} requests failed (see --result-json for their errors)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
