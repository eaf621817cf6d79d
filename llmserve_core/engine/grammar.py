"""Guided decoding with xgrammar: parse, compile (off the busy loop, cached), and one matcher per request.

The core never tokenizes text, but xgrammar needs the vocabulary's byte strings to know which tokens can
continue a grammar, so the tokenizer's vocabulary is loaded here (once, on the compile thread).

- `GrammarService.prepare` builds what xgrammar needs once per vocabulary (the tokenizer, its TokenizerInfo
  and the GrammarCompiler): the daemon calls it before it says it is ready, so no request pays for it.
- `GrammarService.submit` parses the request's grammar on the caller's thread (fast: it catches invalid
  schemas, regexes and grammars as a ValidationError naming the field) and hands the expensive part,
  compiling against the vocabulary, to a worker thread. Compiled grammars are cached by their spec, so
  repeated schemas compile once per model; the scheduler keeps a request waiting until its grammar is ready,
  and each compilation's end calls the service's listeners, so a step loop with nothing else to do sleeps
  until then instead of spinning (a spinning loop also starves the compiler's Python parts of the GIL).
- `RequestGrammar` holds the request's matcher: it fills the request's row of the step's token bitmask
  and advances on every accepted token. The mask depends on the previous token, so with async scheduling
  a step with grammar rows launches its forward first, then reads the previous step back (each matcher
  accepts its token) and fills the masks while that forward runs, then samples (Engine._step). Such
  requests never draft while the grammar holds (EAGLE-3 verify rows would need a mask per draft position
  and a rollback on rejection).
- A grammar with `start_after` (an end-of-reasoning marker) holds only from the token after that sequence
  first shows in the output: until then its request gets no mask, its matcher does not move, and it may
  draft; a verified run that closes the reasoning is cut after the marker (Verified.stop_at_grammars), so every token
  after it is sampled under the mask.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from llmserve_proto import GuidedDecoding, ValidationError

log = logging.getLogger("llmserve.grammar")

CACHE_ENTRIES = 512


def _xgr():
    try:
        import xgrammar
    except ImportError as e:   # pragma: no cover - xgrammar is a dependency; the message says what to do
        raise ValidationError("guided", "structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def grammars_available(tokenizer_dir: str) -> bool:
    """Structured outputs can be served: xgrammar imports and the folder has a tokenizer."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return any(os.path.exists(os.path.join(tokenizer_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def ebnf_literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly (JSON's escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def bounded_strings_as_patterns(schema):
    """xgrammar 0.2.9 compiles a string with minLength/maxLength into a character class that lets raw
    control characters through (invalid JSON). Such strings get an equivalent pattern instead, which
    excludes them (and quotes and backslashes: bounded strings are generated without escapes)."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & set(out):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{lo},{hi}}}$'
    return out


def parse_grammar(g: GuidedDecoding):
    """The xgrammar Grammar for a request's spec; ValidationError naming `guided.<kind>` if it is invalid."""
    xgr = _xgr()
    field = f"guided.{g.kind}"
    try:
        if g.kind == "json":
            schema = bounded_strings_as_patterns(json.loads(g.spec))
            # Compact JSON: with free whitespace a model could pad forever and never close the object.
            core = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        elif g.kind == "json_object":
            core = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        elif g.kind == "regex":
            core = xgr.Grammar.from_regex(g.spec)
        elif g.kind == "choice":
            core = xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in g.choices))
        else:
            core = xgr.Grammar.from_ebnf(g.spec)
    except ValidationError:
        raise
    except json.JSONDecodeError as e:
        raise ValidationError(field, f"is not valid JSON: {e}") from None
    except Exception as e:       # xgrammar raises RuntimeError / ValueError subclasses with its parser's message
        raise ValidationError(field, f"is invalid: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}") from None
    parts = ([xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(g.prefix)}")] if g.prefix else []) + [core] + \
            ([xgr.Grammar.from_ebnf(f"root ::= {ebnf_literal(g.suffix)}")] if g.suffix else [])
    return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)


class GrammarService:
    """Compiles grammars for one model's vocabulary on a worker thread, caching the results."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], max_workers: int = 1):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[bytes, Future] = OrderedDict()
        # Requests holding each compilation, so the last one to end cancels it if it has not started: the
        # worker never works through a queue of grammars that every request waiting on them left.
        self._holders: dict[Future, int] = {}
        self._prepared: Future | None = None
        # Called (on the compile thread) whenever a compilation ends, however it ends.
        self.listeners: list[Callable[[], None]] = []
        self.num_compiled = 0
        self.num_cache_hits = 0

    def prepare_async(self) -> None:
        """Start building the compiler on the worker thread (a first compilation would wait for it)."""
        if self._prepared is None:
            self._prepared = self._pool.submit(self._get_compiler)

    def prepare(self) -> BaseException | None:
        """Build the compiler now (or wait for prepare_async's build); the error if it cannot be built
        (then each guided request fails with it, and the engine serves everything else)."""
        self.prepare_async()
        return self._prepared.exception()

    def submit(self, g: GuidedDecoding) -> "RequestGrammar":
        """Parse now (raising ValidationError), compile later; the result is shared through the cache."""
        # start_after gates the matcher, not the compiled grammar: requests differing only there share it.
        key = msgspec.msgpack.encode(msgspec.structs.replace(g, start_after=[]))
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
        else:
            grammar = parse_grammar(g)
            fut = self._pool.submit(self._compile, grammar)
            fut.add_done_callback(self._notify)
            self._cache[key] = fut
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        self._holders[fut] = self._holders.get(fut, 0) + 1
        return RequestGrammar(fut, lambda: self._release(key, fut), g.start_after)

    def _release(self, key: bytes, fut: Future) -> None:
        """A request holding `fut` ended. The last one cancels a compilation still queued (and drops it
        from the cache: a cancelled future would fail the next request for the same spec)."""
        n = self._holders.pop(fut) - 1
        if n:
            self._holders[fut] = n
        elif fut.cancel() and self._cache.get(key) is fut:
            del self._cache[key]

    def _notify(self, _fut: Future) -> None:
        for listener in list(self.listeners):
            listener()

    def _compile(self, grammar):
        compiled = self._get_compiler().compile_grammar(grammar)
        self.num_compiled += 1
        return compiled

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgr()
                from transformers import AutoTokenizer
                tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def reset_counters(self) -> None:
        self.num_compiled = self.num_cache_hits = 0

    def stats(self) -> dict:
        return {"grammars_compiled": self.num_compiled, "grammar_cache_hits": self.num_cache_hits}


class RequestGrammar:
    """One request's grammar: ready once compiled; then a matcher that follows the accepted tokens."""

    def __init__(self, future: Future, release=lambda: None, start_after: list[int] = ()):
        self.future = future
        self.matcher = None
        self._release = release
        self.start_after = list(start_after)
        self.active = not self.start_after     # the grammar holds (from the first token, or past start_after)
        self._recent: list[int] = []           # the last len(start_after) tokens while waiting for them

    def release(self) -> None:
        """The request ended (finished, aborted or failed): it no longer needs the compilation. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()

    @property
    def ready(self) -> bool:
        """Compiled. A failed compilation never is: it may land after this step dropped the failed grammars
        (Engine._drop_failed_grammars), and a started request would fail its whole batch at its mask."""
        return self.future.done() and self.future.exception() is None

    @property
    def failed(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    def _matcher(self):
        if self.matcher is None:
            self.matcher = _xgr().GrammarMatcher(self.future.result())
        return self.matcher

    def _ends_marker(self, recent: list[int], token_id: int) -> bool:
        """Push token_id onto recent (kept to the marker's length): does the output now end with it?"""
        recent.append(token_id)
        del recent[:-len(self.start_after)]
        return recent == self.start_after

    def unmasked_run(self, tokens: list[int]) -> int:
        """How many of `tokens` (about to be appended, in order, while the grammar does not hold yet) were
        rightly chosen without a mask: all of them, or those up to and including the end of start_after."""
        recent = list(self._recent)
        for i, t in enumerate(tokens):
            if self._ends_marker(recent, t):
                return i + 1
        return len(tokens)

    def accept(self, token_id: int) -> str | None:
        """Advance by one sampled token. "stop" once the grammar has ended (its EOS accepted, or nothing
        may follow); "abort" for a token the grammar refuses, which the mask makes impossible. Before
        start_after has shown, the token only moves the wait along."""
        if not self.active:
            self.active = self._ends_marker(self._recent, token_id)
            return None
        m = self._matcher()
        if not m.accept_token(token_id):
            log.error("grammar refused token %d although the mask allowed it", token_id)
            return "abort"
        return "stop" if m.is_terminated() else None


class MaskBuilder:
    """Fills the token bitmask of a step's grammar rows (host, pinned) and moves it to the device."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, pin: bool):
        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self.host = torch.full((max_rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
        self._batch = None

    def build(self, grammars: list[tuple[int, RequestGrammar]], num_rows: int):
        """grammars: (row, grammar) pairs; returns the TokenMask for the sampler."""
        from llmserve_core.layers.logits_processors import TokenMask
        rows = [r for r, _ in grammars]
        matchers = [g._matcher() for _, g in grammars]
        host = self.host[:num_rows]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(host, rows[0])
        else:
            if self._batch is None:
                self._batch = _xgr().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, host, rows)
        bitmask = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host.clone()
        return TokenMask(rows, bitmask)
