"""`llmserve-core`: serve a model over the llmserve protocol, or make a tiny test model.

    llmserve-core --model DIR [--listen ipc://PATH | tcp://127.0.0.1:PORT] [engine flags...]
    llmserve-core make-tiny-model DIR [--seed N] [--num-hidden-layers N] [--untied] [--moe] [--draft DRAFT_DIR]

Engine flags are generated from EngineConfig's fields (name -> --name-with-dashes, booleans get a --no-
form), with the help text taken from the comment beside each field, so a new knob needs no change here.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import inspect
import logging
import os
import re
import sys
import types
import typing

from llmserve_core.config import EngineConfig

DAEMON_FLAGS = {
    # name: (type, default, help)
    "listen": (str, None, "ipc://PATH or tcp://HOST:PORT (default: a 0600 socket in a private 0700 runtime dir)"),
    "allow_remote": (bool, False, "allow --listen tcp:// on a non-loopback address (the protocol has no auth)"),
    "heartbeat_interval": (float, 0.5, "seconds between heartbeats the core sends each client"),
    "client_timeout": (float, 15.0, "drop a client silent this many seconds and abort its requests"),
    "drain_timeout": (float, 30.0, "on SIGTERM/SIGINT, seconds running requests may take to finish"),
    "log_interval": (float, 10.0, "seconds between stats log lines (0: off)"),
    "max_unread_bytes": (int, 16 * 1024 * 1024, "disconnect a client (aborting its requests) once this many bytes "
                                                "sent to it sit unread, or any sit unread for --client-timeout"),
}


SHORT_FLAGS = {"tensor_parallel_size": ("-tp",)}     # the spelling vLLM and SGLang users type


def _field_comments() -> dict[str, str]:
    """The trailing `# ...` comment of each EngineConfig field, used as its --help text."""
    try:
        src = inspect.getsource(EngineConfig)
    except (OSError, TypeError):
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+):[^#\n]*#\s*(.*)$", src, re.M)}


def _scalar_type(hint):
    """(python type, optional) for hints like int, float | None, str | None."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    if args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return hint, False


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        typ, optional = _scalar_type(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        help_ = comments.get(f.name, "")
        if typ is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{help_} (default: {default})".strip())
        else:
            group.add_argument(flag, *SHORT_FLAGS.get(f.name, ()), type=typ, default=default,
                               required=f.default is dataclasses.MISSING,
                               metavar=f.name.upper(), help=f"{help_} (default: {default})".strip()
                               + (" (optional)" if optional else ""))


def _add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("daemon")
    for name, (typ, default, help_) in DAEMON_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(flag, type=typ, default=default, metavar=name.upper(), help=f"{help_} (default: {default})")
    group.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-core",
        description="Serve a Qwen3 model over the llmserve protocol (ZMQ + msgspec; see proto/PROTOCOL.md). "
                    "Subcommand: `llmserve-core make-tiny-model DIR` writes a small random Qwen3 for tests.")
    _add_engine_flags(p)
    _add_daemon_flags(p)
    return p


def _tiny_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-core make-tiny-model",
                                description="Write a tiny random-weight Qwen3 directory with a trained tokenizer.")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-hidden-layers", type=int, help="decoder layers (default: the tiny model's 2)")
    p.add_argument("--untied", action="store_true", help="a separate lm_head instead of tied embeddings")
    p.add_argument("--moe", action="store_true",
                   help="a Qwen3-MoE model (Qwen3MoeForCausalLM: 8 experts, 2 routed per token, every layer sparse)")
    p.add_argument("--embedding", action="store_true",
                   help="a Qwen3Model checkpoint (no lm_head: an embedding model, served by the pooling runner)")
    p.add_argument("--draft", metavar="DRAFT_DIR",
                   help="also write a matching random EAGLE-3 draft (speculators format) for --speculative-model")
    return p


def make_tiny_model_main(argv: list[str]) -> int:
    args = _tiny_parser().parse_args(argv)
    from llmserve_core.models.tiny import make_tiny_model
    overrides = {} if args.num_hidden_layers is None else {"num_hidden_layers": args.num_hidden_layers}
    print(make_tiny_model(args.dir, seed=args.seed, moe=args.moe, embedding=args.embedding,
                          tie_word_embeddings=not args.untied, **overrides))
    if args.draft:
        from llmserve_core.models.tiny_draft import make_tiny_draft
        print(make_tiny_draft(args.draft, args.dir, seed=args.seed + 1))
    return 0


def parse_serve_args(argv: list[str]):
    """argv -> (EngineConfig, DaemonConfig, log level); bad values exit 2 with a message naming the flag."""
    from llmserve_core.server import DaemonConfig
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    daemon_cfg = DaemonConfig(**{n: args[n] for n in DAEMON_FLAGS})
    try:
        engine_cfg = EngineConfig(**{n: args[n] for n in EngineConfig.field_names()})   # reads --speculative-config
        engine_cfg.validate()
    except ValueError as e:
        parser.error(_as_flag_error(str(e)))
    if not os.path.isdir(engine_cfg.model):
        parser.error(f"--model: {engine_cfg.model!r} is not a directory")
    for name in ("heartbeat_interval", "client_timeout", "drain_timeout", "max_unread_bytes"):
        if not getattr(daemon_cfg, name) > 0:
            parser.error(f"--{name.replace('_', '-')}: must be > 0")
    if daemon_cfg.client_timeout <= 2 * daemon_cfg.heartbeat_interval:
        parser.error("--client-timeout: must exceed twice --heartbeat-interval")
    if daemon_cfg.log_interval < 0:
        parser.error("--log-interval: must be >= 0")
    from llmserve_core.server import prepare_endpoint
    if engine_cfg.node_rank > 0:
        return engine_cfg, daemon_cfg, args["log_level"]      # serves no socket
    try:
        prepare_endpoint(daemon_cfg)
    except (ValueError, PermissionError) as e:
        # One line, no usage dump: the flags parsed fine, the address is what is wrong.
        print(f"llmserve-core: error: {e if str(e).startswith('listen') else f'listen: {e}'}", file=sys.stderr)
        sys.exit(2)
    return engine_cfg, daemon_cfg, args["log_level"]


def _as_flag_error(message: str) -> str:
    """EngineConfig says "block_size: ..."; a command line user typed --block-size."""
    name, sep, rest = message.partition(": ")
    return f"--{name.replace('_', '-')}: {rest}" if sep and name.isidentifier() else message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "make-tiny-model":
        return make_tiny_model_main(argv[1:])
    engine_cfg, daemon_cfg, level = parse_serve_args(argv)
    faulthandler.enable()                    # a native crash leaves the Python stacks in the log
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if engine_cfg.node_rank > 0:             # another host of a tensor-parallel group: workers only, no sockets
        from llmserve_core.distributed.launch import serve_node
        try:
            return serve_node(engine_cfg)
        except ValueError as e:
            logging.getLogger("llmserve_core").error("%s", e)
            return 2
    from llmserve_core.server import run_daemon
    try:
        return run_daemon(engine_cfg, daemon_cfg)
    except (ValueError, FileNotFoundError) as e:
        # Raised while loading (bad model dir, max_model_len beyond the model, ...): a config error, not a crash.
        logging.getLogger("llmserve_core").error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
