"""How one OpenAI API request becomes its answer (vLLM's serving_completion and serving_chat).

respond() reads and checks the whole body first, then starts each prompt's n samples' engine
requests (generation.py) and writes each as a choice (Choice, shaped by the body's ChoiceFormat): in
one JSON object once all have ended, or as server-sent events as their chunks come.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from chat_format import text_part, thinking_enabled
from generation import BeamGeneration, BeamSearchRun, Chunk, Generation
from protocol import (INT64, MAX_SAMPLES, ApiError, cache_salt, chat_logprobs, client_request_id, completion_logprobs,
                      field, parse_beam_search, parse_sampling, parse_slo, prompt_logprobs_json, request_field,
                      structured_field, truncate_prompt, unknown_fields)
from sampling_params import SamplingParams
from tokenizer import IncrementalDetokenizer
from tool_parsers import ToolCallStream, ToolChoice

if TYPE_CHECKING:
    from async_engine import AsyncEngine
    from outputs import TokenLogprob
    from reasoning_parsers import ThinkReasoningParser

T = TypeVar("T")

# The server's logger, not one of this module's own: every line about a request (its
# parameters, its output, the fields it sent that were ignored) goes out under the one name
# the server's log is filtered by.
log = logging.getLogger("taxirank.server")


async def respond(request: web.Request, body: dict, prompts: list[list[int]], chat: bool,
                  tools: ToolChoice | None = None, sent: list[str | list] | None = None) -> web.StreamResponse:
    """Run one completion (chat or not) and answer it whole or as an SSE stream. prompts: a
    chat request's one, or a completions request's batch (vLLM's: the n samples of prompt k
    are choices k * n to k * n + n - 1); tools: a chat request's ToolChoice, from tool_choice() (its calls
    come out as tool_calls); sent: a completions request's prompts as the body has them
    (protocol.parse_prompts), which echo returns.

    The body is read and checked first, every field before the first engine request starts
    (a 400 leaves nothing running); then each prompt's n samples' engine requests start
    (Generation), each one a Choice, which whole_response() or stream_response() writes out."""
    from engine import EngineRequest, child_requests

    app, engine = request.app, request.app["engine"]
    untruncated, max_len = prompts, engine.config.max_model_len
    prompts = [truncate_prompt(body, ids, max_len, chat) for ids in prompts]
    # vLLM's echo with max_tokens 0 (scoring a text): one token is generated, and the answer
    # is the prompt alone (its text, its logprobs).
    prompt_only = not chat and field(body, "echo", (bool,), False) and field(body, "max_tokens", (int,)) == 0
    # (per prompt: a max_tokens left to the context is each prompt's room)
    params = [parse_sampling(body | {"max_tokens": 1} if prompt_only else body, len(ids), max_len, chat, tools,
                             engine.sampling_defaults) for ids in prompts]
    beams = [parse_beam_search(body, p, engine.sampling_defaults, chat, tools) for p in params]
    stream, include_usage, continuous_usage = parse_stream_options(body, app["force_include_usage"])
    # (cache_salt's type: checked with the rest of the request, LLMEngine.validate; its
    # length and characters here, before a grammar is compiled for a request refused anyway)
    salt = cache_salt(body)
    # Its arrival, as vLLM's: once tokenized, before its grammar compiles (vLLM compiles it in
    # the engine while the request waits), so its queue time, TTFT and e2e include the compile.
    arrival = time.monotonic()
    # (every prompt's one constraint; its engine requests wait meanwhile)
    grammar = await compile_grammar(engine, params[0], body, tools, sum(p.n for p in params))
    request_id, engine_request_id = request_ids(body, request.headers.get("X-Request-Id"), chat)
    # vLLM's engine ids of a batch's prompts: the request's, each with its index
    engine_ids = [engine_request_id] if len(prompts) == 1 else [f"{engine_request_id}-{k}" for k in range(len(prompts))]
    priority = field(body, "priority", (int,), 0)  # vLLM's extra field: lower runs first
    if not INT64[0] <= priority <= INT64[1]:  # vLLM's range
        raise ApiError(f"'priority' must be a 64-bit integer, in [{INT64[0]}, {INT64[1]}]", param="priority")
    assert (sent is None) == chat and (chat or len(sent) == len(prompts)), "completions pass their prompts as sent"
    forms = [ChoiceFormat.read(app, body, chat, tools, p, ids, raw, prompt_only, text)
             for p, ids, raw, text in zip(params, prompts, untruncated, [None] if chat else sent)]
    if ignored := unknown_fields(body, chat):  # as vLLM: warned about, and ignored
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored)[:500])
    # vLLM's two gates: the server's --enable-per-request-metrics and the body's include_metrics.
    want_metrics = field(body, "include_metrics", (bool,), False) and app["per_request_metrics"]
    user = field(body, "user", (str,))  # OpenAI's field: the client, for the fair policy
    n = field(body, "n", (int,), 1)  # parse_sampling checked it
    if n * len(prompts) > MAX_SAMPLES:
        raise ApiError(f"{len(prompts)} prompts of n={n} samples each are more than the {MAX_SAMPLES} a request may "
                       "ask", param="n")
    # n samples, or a beam search's n requests a step, per prompt: more than may wait is a
    # 400, as a 503's "retry later" would never succeed
    limit = engine.config.max_waiting_requests
    if limit is not None and n * len(prompts) > limit:
        raise ApiError(f"{len(prompts)} prompt(s) at n={n} are {n * len(prompts)} engine requests at once, more than "
                       f"the {limit} this server lets wait (--max-waiting-requests)",
                       param="prompt" if len(prompts) > 1 else "n")
    if n * len(prompts) > 1 and want_metrics:
        raise ApiError("'include_metrics' is for one prompt and n=1 (each sample is a request of its own)",
                       param="include_metrics")
    slo = parse_slo(body)
    if app["log_requests"]:
        for rid, p, ids in zip(engine_ids, params, prompts):
            log_request(rid, p, ids, app["max_log_len"])
    gens: list[Generation | BeamGeneration] = []
    choices: list[Choice] = []
    # Whatever ends this handler (a reply, a sample the engine refused, the client gone before
    # the first byte, a cancellation) ends the requests: a stream never read has no frame to abort it.
    try:
        thinking = thinking_enabled(body, app["default_chat_template_kwargs"]) if chat else True
        # vLLM's n: one engine request per sample; their one prompt is shared in the prefix cache
        for rid, ids, p, beam, form in zip(engine_ids, prompts, params, beams, forms):
            try:
                if beam is not None:  # n is the beam width: n sequences of one search
                    run = BeamSearchRun(engine, EngineRequest(rid, ids, p, priority=priority, user=user, slo=slo,
                                                              cache_salt=salt), beam)
                    gens.extend(BeamGeneration(run, i) for i in range(n))
                for sample_id, sp, parent in [] if beam else child_requests(rid, p):
                    sample = EngineRequest(request_id=sample_id, prompt_token_ids=ids, params=sp, priority=priority,
                                           user=user, slo=slo, grammar=grammar, parent=parent, thinking=thinking,
                                           cache_salt=salt, arrival_time=arrival)
                    gens.append(Generation(engine, sample, want_metrics))
            except ApiError as e:  # the engine names SamplingParams' fields: the 400 names the client's
                e.param = request_field(e.param, body, chat)
                raise
            start = len(choices)  # this prompt's choices: indices start.. (vLLM's k * n + i)
            choices += [Choice(start + i, g, form) for i, g in enumerate(gens[start:])]
            if app["log_outputs"]:  # (--enable-log-outputs, which needs --enable-log-requests)
                form.log_id, form.log_len, form.log_deltas = rid, app["max_log_len"], app["log_deltas"]
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else "")
        model = body.get("model") or app["model_names"][0]  # server.read_body checked it
        head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        details = app["prompt_tokens_details"]
        if not stream:
            return await whole_response(head, choices, forms[0], details)
        return await stream_response(request, head, choices, include_usage, continuous_usage, details)
    finally:
        for g in gens:
            g.close()


def log_request(request_id: str, params: SamplingParams, prompt_ids: list[int], max_log_len: int | None) -> None:
    """vLLM's request log (--enable-log-requests): the request's parameters at info level,
    its prompt's token ids at debug level only (a prompt is the client's data), the first
    max_log_len of them."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("Request %s details: prompt_token_ids: %s.", request_id, prompt_ids[:max_log_len])
    log.info("Received request %s: params: %s.", request_id, params)


def parse_stream_options(body: dict, force_include_usage: bool = False) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats) from the body's stream and stream_options;
    force_include_usage: a stream's usage whether asked for or not (--enable-force-include-usage)."""
    stream = field(body, "stream", (bool,), False)
    stream_options = field(body, "stream_options", (dict,), {})
    if stream_options and not stream:
        raise ApiError("'stream_options' is only allowed with stream=true", param="stream_options")
    # include_obfuscation: OpenAI's random padding against side channels, which changes no content
    unknown = sorted(set(stream_options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"})
    if unknown:
        raise ApiError(f"stream_options: {unknown[0][:40]!r} is not supported by this server", param="stream_options")
    field(stream_options, "include_obfuscation", (bool,))
    # vLLM's StreamOptions: include_usage defaults to true once stream_options is sent (so
    # {"continuous_usage_stats": true} alone streams the usage); an explicit null is false.
    asked = body.get("stream_options") is not None and \
        field(stream_options, "include_usage", (bool,), "include_usage" not in stream_options)
    include_usage = stream and (asked or force_include_usage)
    # vLLM's extra: every chunk carries the usage so far; only with include_usage, as vLLM.
    continuous_usage = field(stream_options, "continuous_usage_stats", (bool,), False) and include_usage
    return stream, include_usage, continuous_usage


async def compile_grammar(engine: AsyncEngine, params: SamplingParams, body: dict, tools: ToolChoice | None,
                          waiting: int = 1) -> Any:
    """params' structured-output constraint, compiled off the event loop (a large schema takes
    tens of ms) and handed to the engine, which copies it (the cache may have evicted it by
    then); None without one. One that does not compile is a 400 naming the field it came in
    (protocol.structured_field: tool_choice for a forced call's). waiting: the engine
    requests that wait for it, counted waiting (deferred) meanwhile, as vLLM's engine counts
    its requests waiting for their grammar."""
    if params.structured_outputs is None:
        return None
    try:
        with engine.stats.deferred(waiting):
            return await asyncio.get_running_loop().run_in_executor(None, engine.grammars.compile,
                                                                    params.structured_outputs)
    except ValueError as e:
        raise ApiError(str(e), param=structured_field(body, tools)) from e


def request_ids(body: dict, header: str | None, chat: bool) -> tuple[str, str]:
    """(the response's id, the engine's). vLLM's: the client's id (X-Request-Id, else the
    body's request_id) is the visible one, and the engine's is it with a unique suffix, so
    that two requests sent with the same id (retries, a client's fixed id) never meet in the engine."""
    client_id = client_request_id(body, header)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{client_id or uuid.uuid4().hex}"
    return request_id, request_id if client_id is None else f"{request_id}-{uuid.uuid4().hex}"


@dataclass
class ChoiceFormat:
    """What the body asks of each choice's JSON beyond sampling: read once, shared by the n
    samples' Choices."""

    chat: bool
    tokenizer: Any
    params: SamplingParams  # the request's (its logprobs and prompt_logprobs are every sample's)
    prompt_ids: list[int]  # as the engine got them (truncated)
    prompt_only: bool  # echo with max_tokens 0: the answer is the prompt alone
    role: str | None  # chat: the answer's role
    echo: bool
    echoed: str  # what echo puts before the answer ("" when nothing)
    return_ids: bool  # vLLM's return_token_ids
    as_ids: bool  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    tools: ToolChoice | None
    tool_parser: Callable[[], Any] | None  # --tool-call-parser's class (tool_choice auto)
    parallel: bool  # OpenAI's parallel_tool_calls
    reasoning_parser: Callable[[], Any] | None  # a new --reasoning-parser for this prompt (chat), else None
    include_reasoning: bool
    # --enable-log-outputs: the id each choice's output is logged under (None: not logged),
    # and --max-log-len, the most characters and token ids a line shows
    log_id: str | None = None
    log_len: int | None = None
    log_deltas: bool = True  # --enable-log-deltas: a stream's line per chunk too

    @classmethod
    def read(cls, app: web.Application, body: dict, chat: bool, tools: ToolChoice | None, params: SamplingParams,
             prompt_ids: list[int], untruncated: list[int], prompt_only: bool, sent: str | list | None
             ) -> ChoiceFormat:
        """The body's fields that shape the answer to one prompt, checked (a 400 names a bad
        one); sent: a completion's prompt as the body has it (one of a batch's)."""
        tokenizer = app["engine"].tokenizer
        # vLLM's parallel_tool_calls false: only the first call of the answer goes out
        parallel = field(body, "parallel_tool_calls", (bool,), True)
        include_reasoning = field(body, "include_reasoning", (bool,), True)
        # vLLM's role of the answer: --response-role for a new turn, else the continued message's
        role = (app["response_role"] if field(body, "add_generation_prompt", (bool,), True)
                else body["messages"][-1]["role"]) if chat else None
        reasoning_parser = None
        if chat and app["reasoning_parser"] is not None:
            # the prompt's end says whether the template closed the think block; decoded once for n samples
            prompt_end = tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
            reasoning_parser = functools.partial(app["reasoning_parser"], prompt_end,
                                                 thinking_enabled(body, app["default_chat_template_kwargs"]))
        # vLLM's echo: a completion's text starts with the prompt's (its logprobs with the
        # prompt's, the first token's null); a chat answer with the last message's content
        # when that message has the answer's role.
        echo = field(body, "echo", (bool,), False)
        # vLLM's return_token_ids: the prompt's and the answer's token ids beside the text
        # (streamed: the prompt's once, each chunk its own); an echoed completion then leaves
        # the prompt's text out, as vLLM.
        return_ids = field(body, "return_token_ids", (bool,), False)
        as_ids = field(body, "return_tokens_as_token_ids", (bool,), app["return_tokens_as_token_ids"])
        echoed = echo_text(body, sent, untruncated, prompt_ids, tokenizer, role) if echo and (chat or not return_ids) \
            else ""
        return cls(chat, tokenizer, params, prompt_ids, prompt_only, role, echo, echoed, return_ids, as_ids, tools,
                   app["tool_parser"], parallel, reasoning_parser, include_reasoning)

    @property
    def hides_tokens(self) -> bool:
        """vLLM's include_reasoning false under a reasoning parser: no logprobs and no token ids
        in the answer, whole or streamed, as they would show the reasoning it leaves out."""
        return self.chat and not self.include_reasoning and self.reasoning_parser is not None

    def message_stream(self) -> ToolCallStream:
        """A chat choice's parsers of its text (tool calls, reasoning): one per choice, as
        they keep the text so far."""
        reasoning = self.reasoning_parser() if self.reasoning_parser is not None else None
        return ToolCallStream(self.tools, self.tool_parser, self.parallel, reasoning, self.include_reasoning)

    def logprobs(self, lps: list[TokenLogprob | int] | None, offset: int, before: Sequence[int] = ()) -> dict | None:
        """lps as the response's logprobs (chat's or completions'); offset: completions'
        text_offset of the first; before: the tokens a stream's earlier chunks sampled (the
        context that gives a token ending part of a character its text)."""
        if lps is None:
            return None
        return chat_logprobs(self.tokenizer, lps, self.params.logprobs, self.as_ids, before) if self.chat else \
            completion_logprobs(self.tokenizer, lps, offset, self.params.logprobs, self.as_ids, before)

    def echoed_logprobs(self, prompt_lps: list[TokenLogprob | None] | None) -> list[TokenLogprob | int]:
        """The logprobs an echoed completion's start with: the prompt's, the first token a
        bare id (no logprob); none without echo or logprobs."""
        if not self.echo or self.chat or self.params.logprobs is None:
            return []
        return [self.prompt_ids[0], *(prompt_lps or [None])[1:]]


# vLLM's ChatMessage: every field it defines in its order, null where the answer has none
# (tool_calls: left out then, by its serializer)
CHAT_MESSAGE = {"role": None, "content": None, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": [], "reasoning": None}


class Choice:
    """One sample of a response, `choices[index]`: its engine request's chunks (text,
    logprobs, token ids, finish) as that choice's JSON, whole (whole()) or a stream chunk at
    a time (stream())."""

    def __init__(self, index: int, gen: Generation, form: ChoiceFormat) -> None:
        self.index, self.gen, self.form = index, gen, form
        self.num_output_tokens = 0  # as of the last chunk written: what usage counts
        self.metrics: dict = {}  # the last chunk's {"metrics": ...}, when the request asked for them
        # streamed: a completion's first chunk carries the echo and the prompt's ids; text_offset
        # of the next token; a chat answer's parsers
        self.first, self.offset, self.message = True, 0, form.message_stream() if form.chat else None
        self.sampled: list[int] = []  # streamed: the last tokens sent with logprobs, the next chunk's context
        # streamed: the output's text so far, for --enable-log-outputs, and with its token ids
        # under a reasoning parser, for the usage's reasoning tokens
        self.text = ""
        self.ids: list[int] | None = [] if form.chat and form.reasoning_parser is not None else None
        self.collected: tuple | None = None  # whole: what collect() gathered for whole()

    async def collect(self) -> None:
        """A whole response's choice: its request's output, once the request has ended
        (whole() builds the choice from it)."""
        text, ids, lps, prompt_lps, last = "", [], [], None, None
        async with contextlib.aclosing(self.gen.chunks()) as chunks:
            async for last in chunks:
                text += last.text
                ids += last.token_ids
                lps += last.logprobs or []
                prompt_lps = last.prompt_logprobs or prompt_lps
        assert last is not None and last.finish_reason is not None
        self.num_output_tokens, self.metrics = last.num_output_tokens, metrics_json(last)
        self.collected = text, ids, lps, prompt_lps, last

    def whole(self) -> dict:
        """The choice of a whole response, from what collect() gathered."""
        f = self.form
        text, ids, lps, prompt_lps, last = self.collected
        if f.prompt_only:
            text, lps = "", []
        lp = f.logprobs(f.echoed_logprobs(prompt_lps) + lps, 0) if f.params.logprobs is not None and not f.hides_tokens \
            else None
        answer, reason = self.whole_message(text, last.finish_reason) if f.chat else \
            ({"text": f.echoed + text}, last.finish_reason)
        # vLLM dumps its response choice whole: its fields null where unused. A completion's
        # carries the prompt's logprobs and ids (a chat response has them at its top level).
        choice = {"index": self.index, "logprobs": lp, "finish_reason": reason, "stop_reason": last.stop_reason}
        choice |= answer
        choice["token_ids"] = ids if f.return_ids and not f.hides_tokens else None
        if not f.chat:
            choice["prompt_logprobs"] = None if f.params.prompt_logprobs is None else \
                prompt_logprobs_json(f.tokenizer, prompt_lps or [])
            choice["prompt_token_ids"] = f.prompt_ids if f.return_ids else None
        choice["routed_experts"] = None  # (a mixture of experts' routing: no model here has one)
        if f.log_id is not None:
            if f.chat:  # vLLM's: the content, else the tool calls; nothing for an empty answer
                calls = ", ".join(f"{c['function']['name']}({c['function']['arguments']})"
                                  for c in answer["message"].get("tool_calls") or [])
                logged = answer["message"].get("content") or (f"[tool_calls: {calls}]" if calls else "")
            else:
                logged = answer["text"]
            if logged:
                log_output(f.log_id, logged, ids, reason, f.log_len)
        return choice

    def reasoning_tokens(self) -> int:
        """Its output tokens in its reasoning (count_reasoning_tokens), whole or streamed so far."""
        f = self.form
        text, ids = (self.collected[0], self.collected[1]) if self.collected is not None else (self.text, self.ids)
        return count_reasoning_tokens(f.reasoning_parser(), text, ids, f.tokenizer, f.prompt_ids, f.params)

    def whole_message(self, text: str, reason: str) -> tuple[dict, str]:
        """A whole chat answer's {"message": ...}, its tool calls and reasoning parsed out of
        the text, and its finish_reason (tool_calls when it called one)."""
        parsed, reason = self.message.message(text, reason)
        message = CHAT_MESSAGE | parsed | {"role": self.form.role}
        if not message["tool_calls"]:
            del message["tool_calls"]
        if self.form.echo:
            message["content"] = self.form.echoed + (message.get("content") or "")
        return {"message": message}, reason

    async def stream(self) -> AsyncIterator[dict]:
        """This choice's part of each stream chunk, as its request's chunks come. Use under
        contextlib.aclosing, as Generation.chunks."""
        async with contextlib.aclosing(self.gen.chunks()) as chunks:
            async for c in chunks:
                if not (self.echo_pending or c.text or c.token_ids or c.finish_reason):
                    continue  # no token yet (vLLM's chunked-prefill case); a step whose text is held back still goes
                choice = self.stream_chunk(c)
                self.num_output_tokens, self.metrics = c.num_output_tokens, metrics_json(c)
                if self.ids is not None or self.form.log_id is not None:
                    self.text += c.text
                if self.ids is not None:
                    self.ids += c.token_ids
                if self.form.log_id is not None:
                    self.log_delta(c, choice)
                if self.form.chat and not (choice["delta"] or choice["finish_reason"] or choice["token_ids"] is not None
                                           or choice["logprobs"]):
                    # the parsers hold this text back (a call's name or a tag not complete yet),
                    # or it is reasoning left out: no chunk, as vLLM's (one with logprobs or ids
                    # still goes out, so they add up)
                    continue
                yield choice

    def log_delta(self, c: Chunk, choice: dict) -> None:
        """--enable-log-outputs, streamed: vLLM's line per chunk that says something (a chat
        delta's content, [reasoning: ...] and [tool_calls: <arguments>]), and the text so far
        for the line once the stream is complete (stream_response: stream() keeps it)."""
        if not self.form.log_deltas:
            return
        if self.form.chat:
            delta = choice["delta"]
            parts = [delta["content"]] if delta.get("content") else []
            if delta.get("reasoning"):
                parts.append(f"[reasoning: {delta['reasoning']}]")
            args = "".join(t["function"].get("arguments") or "" for t in delta.get("tool_calls") or []
                           if t.get("function"))
            if args:
                parts.append(f"[tool_calls: {args}]")
        else:
            parts = [choice["text"]] if choice["text"] else []
        if parts:
            log_output(self.form.log_id, " ".join(parts), c.token_ids, c.finish_reason, self.form.log_len,
                       " (streaming delta)")

    @property
    def echo_pending(self) -> bool:
        """A streamed completion's echo rides on its first chunk."""
        return self.first and self.form.echo and not self.form.chat

    def stream_chunk(self, c: Chunk) -> dict:
        """This choice's part of the stream chunk of one engine chunk, with the fields vLLM's
        stream choice sets (it dumps them with exclude_unset): a completion's every field,
        null where unused, prompt_token_ids on its first chunk only (with return_token_ids, or
        echo, as vLLM's echo path sets them too), and no prompt_logprobs (its stream choice
        has no such field); a chat choice's stop_reason only on its last chunk, its token_ids
        on every chunk, null unless asked for."""
        f, echo_now = self.form, self.echo_pending
        lps = c.logprobs if not echo_now or c.logprobs is None else \
            f.echoed_logprobs(c.prompt_logprobs) + ([] if f.prompt_only else c.logprobs)
        logprobs = None if f.hides_tokens else f.logprobs(lps, self.offset, self.sampled)
        if lps:
            self.sampled = (self.sampled + [lp if isinstance(lp, int) else lp.token_id for lp in lps])[-4:]
        token_ids = c.token_ids if f.return_ids and not f.hides_tokens else None
        if f.chat:
            delta, reason = self.message.delta(c.text, c.finish_reason)
            if self.message.tools is None and self.message.reasoning is None:
                delta = {"content": c.text}  # vLLM's DeltaMessage(content=delta_text), "" included
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["stop_reason"] = c.stop_reason
            choice["token_ids"] = token_ids
        else:
            choice = {"index": self.index, "text": (f.echoed if echo_now else "") + ("" if f.prompt_only else c.text),
                      "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "prompt_token_ids": f.prompt_ids if self.first and (f.return_ids or f.echo) else None,
                      "token_ids": token_ids}
        # text_offset counts the tokens' own texts, as the whole response's does; the
        # text sent so far lags it (held back: part of a character, a maybe-stop string).
        if not f.chat and choice["logprobs"] and choice["logprobs"]["tokens"]:
            self.offset = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1])
        self.first = False
        return choice


def log_output(request_id: str, text: str, token_ids: list[int] | None, finish_reason: str | None,
               max_log_len: int | None, stream_info: str = "") -> None:
    """vLLM's output log (--enable-log-outputs): the output's text (its first max_log_len
    characters) and finish reason at info level, its token ids (the first max_log_len) at
    debug level only. stream_info: " (streaming delta)" or " (streaming complete)"."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("Generated response %s%s details: output_token_ids: %s", request_id, stream_info,
                  None if token_ids is None else list(token_ids)[:max_log_len])
    log.info("Generated response %s%s: output: %r, finish_reason: %s", request_id, stream_info, text[:max_log_len],
             finish_reason)


def metrics_json(chunk: Chunk) -> dict:
    """{"metrics": ...} beside the choices when the chunk carries the request's metrics, else {}."""
    return {"metrics": dataclasses.asdict(chunk.metrics)} if chunk.metrics else {}


def count_reasoning_tokens(parser: ThinkReasoningParser, text: str, token_ids: Sequence[int], tokenizer: Any,
                           prompt_ids: list[int], params: SamplingParams) -> int:
    """vLLM's usage.completion_tokens_details.reasoning_tokens of one choice: its output
    tokens inside the reasoning, the tags' own tokens left out (vLLM counts the ids between
    the <think> and </think> token ids). The reasoning is where parser.span finds it in the
    text, so a tag spelled in several tokens and a block the prompt opened count as the
    message's reasoning reads; a token is in it when the text it adds (decoded as the engine
    decodes, a character going to the token that completes it) is."""
    begin, end = parser.span(text) or (0, 0)
    if begin >= end or not token_ids:
        return 0
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, [], params)
    count, last = 0, len(token_ids) - 1
    for i, token in enumerate(token_ids):
        before = len(detok.text)
        detok.advance([token], final=i == last)
        count += begin <= before and len(detok.text) <= end
    return count


async def reasoning_tokens(choices: list[Choice]) -> int | None:
    """The choices' reasoning tokens summed (vLLM's usage.completion_tokens_details under a
    --reasoning-parser: a chat answer's only), None without a parser. Counted off the event
    loop: it decodes the output again, token by token (about 10 ms per 1,000 tokens of a BPE tokenizer)."""
    if not choices or not choices[0].form.chat or choices[0].form.reasoning_parser is None:
        return None
    return await asyncio.to_thread(lambda: sum(c.reasoning_tokens() for c in choices))


def usage(choices: list[Choice], details: bool | None = None, reasoning: int | None = None) -> dict:
    """OpenAI's usage of the choices' tokens so far, each prompt counted once (vLLM's usage
    for n samples of a batch of prompts). details: --enable-prompt-tokens-details, which adds vLLM's
    prompt_tokens_details (the prompt tokens the prefix cache served, 0 included); without
    it a whole response says null and a stream's usage chunk leaves the field out (vLLM
    dumps the one whole and the other without its None fields). None: neither (vLLM's
    continuous_usage_stats chunks never carry it). reasoning: a response's final usage's
    reasoning tokens (reasoning_tokens()), as vLLM's completion_tokens_details; None: none."""
    # a prompt's first sample stands for its prompt: its n samples share one ChoiceFormat
    firsts = list({id(c.form): c.gen for c in reversed(choices)}.values())
    prompt_tokens = sum(g.num_prompt_tokens for g in firsts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": sum(g.num_cached_tokens for g in firsts)}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


async def whole_response(head: dict, choices: list[Choice], form: ChoiceFormat, details: bool) -> web.Response:
    """The response as one JSON object, once every choice has ended (details:
    --enable-prompt-tokens-details)."""
    await all_of(c.collect() for c in choices)
    # vLLM's UsageInfo, dumped whole: its details null where unset
    use = usage(choices, details, await reasoning_tokens(choices))
    use.setdefault("prompt_tokens_details", None)
    use.setdefault("completion_tokens_details", None)
    # the rest of vLLM's CompletionResponse or ChatCompletionResponse, null where unused (it dumps its None fields)
    tail = {"service_tier": None, "system_fingerprint": None, "usage": use}
    if form.chat:
        prompt_lps = choices[0].collected[3]
        tail |= {"prompt_logprobs": None if form.params.prompt_logprobs is None else
                 prompt_logprobs_json(form.tokenizer, prompt_lps or []),
                 "prompt_token_ids": form.prompt_ids if form.return_ids else None,
                 "prompt_text": None}  # (return_prompt_text is refused)
    tail |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
    tail |= choices[0].metrics  # (include_metrics is for n = 1)
    return await json_in_pieces(head, [c.whole for c in choices], tail)


async def json_in_pieces(head: dict, choices: list[Callable[[], dict]], tail: dict) -> web.Response:
    """web.json_response(head | {"choices": [c() for c in choices]} | tail), each choice built
    and serialized in an event-loop turn of its own. n samples with prompt logprobs make
    tens of MB, building their dicts and json.dumps hold the GIL (in a thread too), and n
    requests that end together would otherwise be built back to back in one turn: every
    other request, /health included, would wait seconds."""
    pieces = []
    for build in choices:
        pieces.append(json.dumps(build()))
        await asyncio.sleep(0)
    text = json.dumps(head)[:-1] + ', "choices": [' + ", ".join(pieces) + "], " + json.dumps(tail)[1:]
    return web.Response(text=text, content_type="application/json")


async def stream_response(request: web.Request, head: dict, choices: list[Choice], include_usage: bool,
                          continuous_usage: bool, details: bool) -> web.StreamResponse:
    """The response as server-sent events: a chat answer's opening chunks, the choices'
    chunks as they come (interleaved, each naming its index), the usage when asked, [DONE].
    An error once the status line is out is an event of its own. details:
    --enable-prompt-tokens-details."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    events = EventStream(response, head, choices, include_usage, continuous_usage)
    try:
        if choices[0].form.chat:
            await events.open_messages()
        await all_of(events.send_choice(c) for c in choices)
        if include_usage:
            await events.send([], usage=usage(choices, details, await reasoning_tokens(choices)),
                              **choices[0].metrics)
        for c in choices if choices[0].form.log_id is not None else ():  # vLLM's line per choice: its whole text
            log_output(c.form.log_id, c.text, None, "streaming_complete", c.form.log_len, " (streaming complete)")
    except ConnectionResetError:
        return response  # the client left; the request is aborted already
    except Exception as e:  # the status line is gone: report the error in the stream
        err = e if isinstance(e, ApiError) else ApiError("internal server error (see the server log)", 500)
        if err is not e:
            log.exception("error while streaming %s", head["id"])
        await response.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


class EventStream:
    """The events of one streamed response, each `head` with its choices."""

    def __init__(self, response: web.StreamResponse, head: dict, choices: list[Choice], include_usage: bool,
                 continuous_usage: bool) -> None:
        self.response, self.head, self.choices = response, head, choices
        self.include_usage, self.continuous_usage = include_usage, continuous_usage

    async def send(self, choices: list[dict], **extra: Any) -> None:
        await self.response.write(b"data: " + json.dumps(self.head | {"choices": choices} | extra).encode() + b"\n\n")

    def usage_so_far(self, choice: Choice) -> dict:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far of the choice it
        is a chunk of (its own tokens, not its siblings'; the final usage chunk sums them). A
        chat chunk's has vLLM's completion_tokens_details, null (set, so dumped), a completion's
        not; neither has prompt_tokens_details."""
        if not self.continuous_usage:
            return {}
        return {"usage": usage([choice]) | ({"completion_tokens_details": None} if choice.form.chat else {})}

    async def open_messages(self) -> None:
        """A chat answer's first chunks, per choice: its role, with the prompt's ids (null
        unless asked) and prompt_text (null: return_prompt_text is refused), as vLLM sets
        them on each choice's first chunk; then, once every choice has its role, the echoed
        message, a chunk of its own per choice."""
        form = self.choices[0].form
        prompt = {"prompt_token_ids": form.prompt_ids if form.return_ids else None, "prompt_text": None}
        for c in self.choices:
            await self.send([{"index": c.index, "delta": {"role": form.role, "content": ""}, "logprobs": None,
                              "finish_reason": None}], **self.usage_so_far(c), **prompt)
        for c in self.choices if form.echoed else ():
            await self.send([{"index": c.index, "delta": {"content": form.echoed}, "logprobs": None,
                              "finish_reason": None}], **self.usage_so_far(c))

    async def send_choice(self, choice: Choice) -> None:
        """One choice's chunks, sent as they come; without usage, the metrics ride on the
        chunk with the finish_reason."""
        async with contextlib.aclosing(choice.stream()) as parts:
            async for part in parts:
                await self.send([part], **self.usage_so_far(choice),
                                **({} if self.include_usage else choice.metrics))


async def all_of(coroutines: Iterable[Awaitable[T]]) -> list[T]:
    """Their results, run concurrently; the first failure cancels the rest (asyncio.gather
    would leave them running, each holding its engine request)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def echo_text(body: dict, sent: str | list | None, untruncated: list[int], prompt_ids: list[int], tokenizer: Any,
              role: str | None) -> str:
    """What vLLM's echo puts before the answer. Chat (role: the answer's): the last
    message's content when its role is the answer's, else nothing. Completions (role None):
    the prompt as sent, or the prompt's tokens as text when it came as token ids or was
    truncated."""
    if role is not None:
        last = body["messages"][-1]  # parse_messages checked them
        content = last.get("content")
        if isinstance(content, list):  # any text parts (a string, a refusal...), joined as parse_messages joins them
            content = "\n".join(text_part(p, len(body["messages"]) - 1) for p in content)
        return content if last["role"] == role and isinstance(content, str) else ""
    if isinstance(sent, str) and len(prompt_ids) == len(untruncated):
        return sent
    return tokenizer.decode(prompt_ids, skip_special_tokens=False) if tokenizer is not None else ""
