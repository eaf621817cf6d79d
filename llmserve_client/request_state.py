"""Client-side life of one request: outputs in, StreamChunks out (text, stop strings, usage, timings).

Shared by the sync and async clients; it only transforms messages and never touches a socket.
Stop strings are found on the detokenized text (the core never sees text). A match ends the request:
text is cut before the stop string, finish_reason becomes "stop", and `needs_abort` tells the caller
to abort the request in the engine. A stop token id's text is left out of the text likewise (the id stays
in the token ids). With include_stop_str_in_output the stop string or token stays in the text;
before min_tokens outputs no stop string counts. While streaming, the last len(longest stop) - 1 characters are held
back so a stop string split across steps never leaks into streamed text.
"""
from __future__ import annotations

from llmserve_proto import RequestOutput, SamplingParams
from llmserve_client.detokenizer import IncrementalDetokenizer
from llmserve_client.types import Completion, StreamChunk, Timings, Usage


class RequestState:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 *, detokenize: bool = True, skip_special_tokens: bool = True, sent_time: float = 0.0):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if detokenize else None
        self.stops = list(params.stop)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""              # text released by the detokenizer so far (trimmed at a stop string)
        self.emitted = 0            # characters of self.text already handed out
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.needs_abort = False    # a stop string ended it here; the engine is still generating
        self.timings = Timings(sent=sent_time)
        self.usage = Usage(prompt_tokens=len(prompt_token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def on_output(self, out: RequestOutput, recv_time: float) -> StreamChunk | None:
        """Fold one engine output in; return the chunk to hand out (None when there is nothing new)."""
        if self.finished:
            return None     # e.g. tokens already in flight when a stop string ended the request
        final = out.finish_reason is not None
        new_ids = self._take_tokens(list(out.token_ids), out.finish_reason)
        if new_ids:
            if self.timings.first_chunk is None:
                self.timings.first_chunk = recv_time
            self.timings.token_times.extend([recv_time] * len(new_ids))
        logprobs = out.logprobs[:len(new_ids)] if out.logprobs else out.logprobs
        if self.logprobs is not None and logprobs:
            self.logprobs.extend(logprobs)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and self.params.prompt_logprobs is not None:
            # The core sends one per prompt token after the first; vLLM's shape lines them up with the prompt.
            prompt_logprobs = self.prompt_logprobs = [None, *out.prompt_logprobs]
        if out.metrics is not None:
            m = out.metrics
            self.usage.prompt_tokens = m.num_prompt_tokens or self.usage.prompt_tokens
            self.usage.cached_tokens = m.num_cached_tokens
            self.timings.core_arrival, self.timings.core_first_token = m.arrival_time, m.first_token_time
            self.timings.core_finish = m.finish_time
        self.usage.completion_tokens = len(self.token_ids)
        if self.detok is not None and final and not self.finished:
            self._add_text(self.detok.flush())
        if final and not self.finished:
            self.finish_reason = out.finish_reason
            if out.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in self.params.stop_token_ids:
                self.stop_reason = self.token_ids[-1]
        if self.finished:
            self.timings.done = recv_time
        end = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted:end], end
        if not delta and not new_ids and not self.finished:
            return None
        return StreamChunk(self.request_id, delta, new_ids, self.finish_reason, self.stop_reason,
                           logprobs if self.logprobs is not None else None,
                           self.usage if self.finished else None, self.timings if self.finished else None,
                           prompt_logprobs)

    def _take_tokens(self, new_ids: list[int], finish_reason: str | None) -> list[int]:
        """Add an output's tokens and their text; return the tokens kept. With stop strings the text grows a
        token at a time, so a stop string ends the request at the token that completed it, as when tokens
        come one per output: tokens a step generated past it (accepted speculative drafts) are dropped,
        from the token ids and the usage as from the text."""
        if self.detok is None:
            self.token_ids.extend(new_ids)
            return new_ids
        # A stop token id ends the token ids but not the text (unless include_stop_str_in_output), as a stop
        # string does: "\n" as a stop token gives a line without its newline, as in vLLM.
        hidden = (finish_reason == "stop" and new_ids and new_ids[-1] in self.params.stop_token_ids
                  and not self.params.include_stop_str_in_output)
        text_ids = new_ids[:-1] if hidden else new_ids
        if not self.stops:      # nothing can end the request early: the output goes in whole, in one push
            self.token_ids.extend(new_ids)
            self._add_text(self.detok.push(text_ids))
            return new_ids
        for k, t in enumerate(text_ids):
            self.token_ids.append(t)
            self._add_text(self.detok.push([t]))
            if self.finished:
                return new_ids[:k + 1]
        self.token_ids.extend(new_ids[len(text_ids):])
        return new_ids

    def _add_text(self, delta: str) -> None:
        if not delta or self.finished:
            return
        start = max(0, len(self.text) - self.holdback)
        self.text += delta
        if not self.stops:
            return
        if len(self.token_ids) < self.params.min_tokens:
            return      # vLLM: stop strings count only once min_tokens are out
        # The stop string completed first wins (the one that ends earliest; of those, the longest): what
        # one token at a time would find, however many tokens a step brought.
        hits = [(i + len(s), i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            _, i, s = min(hits)
            self.text = self.text[:i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
            self.finish_reason, self.stop_reason, self.needs_abort = "stop", s, True

    def on_error(self, recv_time: float) -> None:
        self.timings.done = recv_time

    def completion(self) -> Completion:
        return Completion(self.request_id, self.text, self.token_ids, self.finish_reason, self.usage,
                          self.timings, self.stop_reason, self.prompt_token_ids, self.logprobs,
                          self.prompt_logprobs)
