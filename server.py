"""OpenAI-compatible HTTP server over AsyncEngine (aiohttp).

    python server.py                           # built-in smollm2 (a real chat model) on 127.0.0.1:8000
    python server.py --model tiny              # built-in random weights (tests)
    python server.py --model FILE.gguf         # a GGUF checkpoint (llama.cpp's format)
    python server.py --model /path/to/hf_dir   # a checkpoint, its tokenizer and chat template

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics (Prometheus text), POST /reset_prefix_cache;
each also under --root-path, and a path that differs from one by a trailing slash is a 307
to it (FastAPI's routing, as vLLM's server answers).

The engine speaks token ids only; everything textual happens here: tokenizing prompts,
chat templates and incremental detokenization (except for a request with stop strings: the
engine matches them on its own detokenized text, and hands that text over in its deltas).
A request the server no longer needs (client gone, shutdown) is aborted in the engine at
once, so its slot and KV blocks go to the next request within a step.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import dataclasses
import functools
import gc
import hmac
import inspect
import json
import logging
import signal
import socket
import ssl
import time
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

import chat_format
import config_file
from cors import CorsPolicy, on_response_prepare as cors_headers
from config import DISTRIBUTED_EXECUTOR_BACKENDS, VLLM_SPELLINGS, EngineConfig, SamplingParams
from metrics import EngineStats, LoggingStatLogger, RequestMetrics
from policy import REGISTRIES
from protocol import (INT64, MAX_BODY_BYTES, ApiError, chat_logprobs, client_request_id, completion_logprobs, field,
                      loads_checked, parse_beam_search, parse_messages, parse_prompt, parse_sampling, parse_slo,
                      prompt_logprobs_json, request_field, route_path, structured_field, text_part, thinking_enabled,
                      token_text, tool_choice, truncate_prompt, unknown_fields)
from reasoning_parsers import REASONING_PARSERS
from tokenizer import IncrementalDetokenizer
from tool_parsers import TOOL_PARSERS, ToolCallStream, ToolChoice

# The engine (JAX, Flax) is imported where it is used: `server.py --help` and a bad flag
# answer in a fraction of a second instead of after seconds of importing JAX.
if TYPE_CHECKING:
    from async_engine import AsyncEngine
    from engine import EngineRequest, TokenLogprob

T = TypeVar("T")

log = logging.getLogger("taxirank.server")

LOG_STATS_INTERVAL = 10.0  # seconds between two stats lines (vLLM's VLLM_LOG_STATS_INTERVAL default)


# ---- generation -------------------------------------------------------------------

@dataclass
class Chunk:
    """What one engine step added to a response."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the last chunk only
    num_output_tokens: int
    metrics: RequestMetrics | None = None  # on the last chunk, when the request asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked
    # vLLM's stop_reason, on the last chunk: the engine's (engine.stop_reason), which
    # LLM.generate's CompletionOutput carries too.
    stop_reason: str | int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # this step's, the ending token included


class Generation:
    """One engine request, seen as text.

    Created before any response byte is written, so a refusal by the engine (bad
    request, full queue, shutting down) still becomes a proper 4xx/503.
    """

    def __init__(self, engine: AsyncEngine, request: EngineRequest, want_metrics: bool = False) -> None:
        """want_metrics: the last chunk carries the request's RequestMetrics. A request with
        stop strings is detokenized by the engine, which matches them (its deltas carry the
        text, cut at the stop string); any other is detokenized here, off the engine thread."""
        self.engine, self.request_id, self.want_metrics = engine, request.request_id, want_metrics
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0  # of the prompt, served from the prefix cache
        self.params = params = request.params
        self.done = False  # the engine has ended the request, or close() aborted it
        self.detokenizer = None if params.stop else IncrementalDetokenizer(
            self.engine.tokenizer, request.prompt_token_ids, [], params, self.engine.model_config.eos_token_ids)
        with refusals_as_api_errors():
            self.stream = self.engine.add_request(request)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Use under contextlib.aclosing: leaving early (client gone) aborts the request."""
        try:
            async for delta in self.stream:
                self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
                ids = delta.new_token_ids
                if delta.new_text is not None:  # detokenized by the engine, which matched stop strings
                    text = delta.new_text
                else:  # one token at a time (a verified step's delta has several), as the engine's matcher
                    last = delta.finished or delta.ended  # (ended: static batching releases it later)
                    text = "".join(self.detokenizer.push(ids[j:j + 1], final=last and j >= len(ids) - 1)[0]
                                   for j in range(len(ids) or 1))
                self.done = done = delta.finished
                reason = delta.finish_reason if done else None
                metrics = delta.metrics if self.want_metrics else None
                yield Chunk(text, delta.new_logprobs, reason, delta.num_output_tokens, metrics,
                            delta.prompt_logprobs, delta.stop_reason, ids)
                if done:
                    return
        except ValueError as e:  # refused by the scheduler after add_request accepted it
            raise ApiError(str(e)) from e
        except RuntimeError as e:  # this request failed in the engine, or the engine loop died
            raise ApiError(str(e), 500, type="internal_server_error") from e
        finally:
            self.close()  # the client went away (its handler was cancelled): free the slot now

    def close(self) -> None:
        """Abort the request unless it has ended. respond() calls it however it leaves, since
        chunks() never started (the client gone before the first byte) cannot."""
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)


@contextlib.contextmanager
def refusals_as_api_errors() -> Iterator[None]:
    """The engine's refusal of a new request as the client's answer: a full queue or an
    engine that is shutting down (or died) a 503, a request it cannot run a 400."""
    from engine import QueueFullError

    try:
        yield
    except QueueFullError as e:
        raise ApiError(f"server is at capacity ({e}); retry later", status=503,
                       type="service_unavailable", code="queue_full") from e
    except ValueError as e:  # (a ParamError names the field)
        raise ApiError(str(e), param=getattr(e, "param", None)) from e
    except RuntimeError as e:  # shutting down, or the engine loop died
        raise ApiError(str(e), status=503, type="service_unavailable") from e


class BeamSearchRun:
    """vLLM's use_beam_search: one search (beam_search.run) for a request's n sequences,
    started by the first of its BeamGenerations to ask and shared by all of them."""

    def __init__(self, engine: AsyncEngine, request: EngineRequest, beam: dict) -> None:
        """request: its prompt, priority, user, SLO and cache_salt (params: the body's, for
        the text's decoding); beam: BeamSearchParams' fields (protocol.parse_beam_search).
        Checks here, before any byte is written, that the last step's requests can run."""
        from beam_search import BeamSearchParams

        self.engine, self.request, self.params = engine, request, BeamSearchParams(**beam)
        cap = engine.config.logprobs_width(engine.model_config.vocab_size)
        if 2 * self.params.beam_width > cap:
            raise ApiError(f"use_beam_search with n={self.params.beam_width} ranks 2 x n candidates a step, more "
                           f"than the {cap} logprobs this server computes (--max-logprobs): n must be at most "
                           f"{cap // 2}", param="n")
        limit = engine.config.max_waiting_requests
        if limit is not None and self.params.beam_width > limit:  # (a 503's "retry later" would never succeed)
            raise ApiError(f"use_beam_search with n={self.params.beam_width} adds up to n requests a step, more than "
                           f"the {limit} this server lets wait (--max-waiting-requests): n must be at most {limit}",
                           param="n")
        with refusals_as_api_errors():
            engine.validate(dataclasses.replace(request, params=self.params.search_params()))
        self.task: asyncio.Future | None = None

    async def sequences(self) -> tuple[Any, list[Any]]:
        """(the finished search, its best sequences, best first)."""
        import beam_search

        if self.task is None:
            self.task = asyncio.ensure_future(beam_search.run(self.engine, self.request, self.params))
        search = await asyncio.shield(self.task)  # (n readers: one's cancellation is not the search's)
        return search, search.best()

    def close(self) -> None:
        """The client is gone or the answer is out: a search still running stops (its step's
        requests are aborted)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


class BeamGeneration:
    """Sequence `index` of a BeamSearchRun, read by its Choice as a Generation is: one chunk,
    the whole sequence, once the search has ended (vLLM's beam search streams nothing sooner)."""

    def __init__(self, run: BeamSearchRun, index: int) -> None:
        self.run, self.index = run, index
        self.num_prompt_tokens = len(run.request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.params = run.request.params
        self.done = False

    async def chunks(self) -> AsyncIterator[Chunk]:
        from engine import decode_output

        with refusals_as_api_errors():  # a later step's request refused: the queue full, the engine stopping
            search, best = await self.run.sequences()
        seq = best[self.index]
        ids = search.output_ids(seq)
        engine = self.run.engine
        # vLLM's: an EOS kept by include_stop_str_in_output is a token id, never text
        text = "" if engine.tokenizer is None else decode_output(
            engine.tokenizer, ids, dataclasses.replace(self.params, include_stop_str_in_output=False),
            engine.model_config.eos_token_ids, self.run.request.prompt_token_ids)
        self.done = True
        logprobs = seq.logprobs[:len(ids)] if self.params.logprobs is not None else None  # (an EOS not kept: none)
        yield Chunk(text, logprobs, seq.finish_reason, len(ids), stop_reason=seq.stop_reason, token_ids=ids)

    def close(self) -> None:
        self.done = True
        self.run.close()


async def respond(request: web.Request, body: dict, prompt_ids: list[int], chat: bool,
                  tools: ToolChoice | None = None) -> web.StreamResponse:
    """Run one completion (chat or not) and answer it whole or as an SSE stream. tools: a
    chat request's tool_choice() (its calls come out as tool_calls).

    The body is read and checked first, every field before the first engine request starts
    (a 400 leaves nothing running); then the n samples' engine requests start (Generation),
    each one a Choice, which whole_response() or stream_response() writes out."""
    from engine import EngineRequest, child_requests

    app, engine = request.app, request.app["engine"]
    untruncated = prompt_ids
    prompt_ids = truncate_prompt(body, prompt_ids, engine.config.max_model_len, chat)
    # vLLM's echo with max_tokens 0 (scoring a text): one token is generated, and the answer
    # is the prompt alone (its text, its logprobs).
    prompt_only = not chat and field(body, "echo", (bool,), False) and field(body, "max_tokens", (int,)) == 0
    params = parse_sampling(body | {"max_tokens": 1} if prompt_only else body, len(prompt_ids),
                            engine.config.max_model_len, chat, engine.tokenizer is not None, tools,
                            engine.sampling_defaults)
    beam = parse_beam_search(body, params, engine.sampling_defaults, chat)
    stream, include_usage, continuous_usage = parse_stream_options(body, app["force_include_usage"])
    grammar = await compile_grammar(engine, params, body, tools)
    request_id, engine_request_id = request_ids(body, request.headers.get("X-Request-Id"), chat)
    priority = field(body, "priority", (int,), 0)  # vLLM's extra field: lower runs first
    if not INT64[0] <= priority <= INT64[1]:  # vLLM's range
        raise ApiError(f"'priority' must be a 64-bit integer, in [{INT64[0]}, {INT64[1]}]", param="priority")
    form = ChoiceFormat.read(app, body, chat, tools, params, prompt_ids, untruncated, prompt_only)
    if ignored := unknown_fields(body, chat):  # as vLLM: warned about, and ignored
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored)[:500])
    # vLLM's two gates: the server's --enable-per-request-metrics and the body's include_metrics.
    want_metrics = field(body, "include_metrics", (bool,), False) and app["per_request_metrics"]
    user = field(body, "user", (str,))  # OpenAI's field: the client, for the fair policy
    n = field(body, "n", (int,), 1)  # parse_sampling checked it
    if n > 1 and want_metrics:
        raise ApiError("'include_metrics' is for n=1 (each sample is a request of its own)", param="include_metrics")
    slo = parse_slo(body)
    cache_salt = body.get("cache_salt")  # vLLM's: checked with the rest of the request (LLMEngine.validate)
    if app["log_requests"]:
        log_request(engine_request_id, params, prompt_ids, app["max_log_len"])
    gens: list[Generation | BeamGeneration] = []
    # Whatever ends this handler (a reply, a sample the engine refused, the client gone before
    # the first byte, a cancellation) ends the requests: a stream never read has no frame to abort it.
    try:
        thinking = thinking_enabled(body, app["default_chat_template_kwargs"]) if chat else True
        # vLLM's n: one engine request per sample; their one prompt is shared in the prefix cache
        try:
            if beam is not None:  # n is the beam width: n sequences of one search
                run = BeamSearchRun(engine, EngineRequest(engine_request_id, prompt_ids, params, priority=priority,
                                                          user=user, slo=slo, cache_salt=cache_salt), beam)
                gens.extend(BeamGeneration(run, i) for i in range(n))
            for rid, p, parent in [] if beam else child_requests(engine_request_id, dataclasses.replace(params, n=n)):
                sample = EngineRequest(request_id=rid, prompt_token_ids=prompt_ids, params=p, priority=priority,
                                       user=user, slo=slo, grammar=grammar, parent=parent, thinking=thinking,
                                       cache_salt=cache_salt)
                gens.append(Generation(engine, sample, want_metrics))
        except ApiError as e:  # the engine names SamplingParams' fields: the 400 names the client's
            e.param = request_field(e.param, body, chat)
            raise
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else "")
        model = body.get("model") or app["model_names"][0]  # read_body checked it
        head = {"id": request_id, "object": kind, "created": int(time.time()), "model": model}
        choices = [Choice(i, g, form) for i, g in enumerate(gens)]
        details = app["prompt_tokens_details"]
        if app["log_outputs"]:  # (--enable-log-outputs, which needs --enable-log-requests)
            form.log_id, form.log_len, form.log_deltas = engine_request_id, app["max_log_len"], app["log_deltas"]
        if not stream:
            return await whole_response(head, choices, form, details)
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
    include_usage = field(stream_options, "include_usage", (bool,), False) or (stream and force_include_usage)
    # vLLM's extra: every chunk carries the usage so far; only with include_usage, as vLLM.
    continuous_usage = field(stream_options, "continuous_usage_stats", (bool,), False) and include_usage
    return stream, include_usage, continuous_usage


async def compile_grammar(engine: AsyncEngine, params: SamplingParams, body: dict, tools: ToolChoice | None) -> Any:
    """params' structured-output constraint, compiled off the event loop (a large schema takes
    tens of ms) and handed to the engine, which copies it (the cache may have evicted it by
    then); None without one. One that does not compile is a 400 naming the field it came in
    (protocol.structured_field: tool_choice for a forced call's)."""
    if params.structured_outputs is None:
        return None
    try:
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
             prompt_ids: list[int], untruncated: list[int], prompt_only: bool) -> ChoiceFormat:
        """The body's fields that shape the answer, checked (a 400 names a bad one)."""
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
        echoed = echo_text(body, untruncated, prompt_ids, tokenizer, role) if echo and (chat or not return_ids) else ""
        return cls(chat, tokenizer, params, prompt_ids, prompt_only, role, echo, echoed, return_ids, as_ids, tools,
                   app["tool_parser"], parallel, reasoning_parser, include_reasoning)

    def message_stream(self) -> ToolCallStream:
        """A chat choice's parsers of its text (tool calls, reasoning): one per choice, as
        they keep the text so far."""
        reasoning = self.reasoning_parser() if self.reasoning_parser is not None else None
        return ToolCallStream(self.tools, self.tool_parser, self.parallel, reasoning, self.include_reasoning)

    def logprobs(self, lps: list[TokenLogprob | int] | None, offset: int) -> dict | None:
        """lps as the response's logprobs (chat's or completions'); offset: completions'
        text_offset of the first."""
        if lps is None:
            return None
        return chat_logprobs(self.tokenizer, lps, self.as_ids) if self.chat else \
            completion_logprobs(self.tokenizer, lps, offset, self.params.logprobs, self.as_ids)

    def echoed_logprobs(self, prompt_lps: list[TokenLogprob | None] | None) -> list[TokenLogprob | int]:
        """The logprobs an echoed completion's start with: the prompt's, the first token a
        bare id (no logprob); none without echo or logprobs."""
        if not self.echo or self.chat or self.params.logprobs is None:
            return []
        return [self.prompt_ids[0], *(prompt_lps or [None])[1:]]


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
        self.text = ""  # streamed: the output's text so far, for --enable-log-outputs
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
        lp = f.logprobs(f.echoed_logprobs(prompt_lps) + lps, 0) if f.params.logprobs is not None else None
        answer, reason = self.whole_message(text, last.finish_reason) if f.chat else \
            ({"text": f.echoed + text}, last.finish_reason)
        choice = {"index": self.index, "logprobs": lp, "finish_reason": reason, "stop_reason": last.stop_reason}
        if f.params.prompt_logprobs is not None:  # vLLM's extra field of the choice
            choice["prompt_logprobs"] = prompt_logprobs_json(f.tokenizer, prompt_lps or [])
        choice |= answer
        if f.return_ids:  # vLLM's places: the choice's token_ids; the prompt's on the choice, or chat's response
            choice["token_ids"] = ids
            if not f.chat:
                choice["prompt_token_ids"] = f.prompt_ids
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

    def whole_message(self, text: str, reason: str) -> tuple[dict, str]:
        """A whole chat answer's {"message": ...}, its tool calls and reasoning parsed out of
        the text, and its finish_reason (tool_calls when it called one)."""
        message, reason = self.message.message(text, reason)
        message["role"] = self.form.role
        if self.form.echo:
            message["content"] = self.form.echoed + (message.get("content") or "")
        return {"message": message}, reason

    async def stream(self) -> AsyncIterator[dict]:
        """This choice's part of each stream chunk, as its request's chunks come. Use under
        contextlib.aclosing, as Generation.chunks."""
        async with contextlib.aclosing(self.gen.chunks()) as chunks:
            async for c in chunks:
                if not (self.echo_pending or c.text or c.logprobs or c.finish_reason or c.prompt_logprobs
                        or (self.form.return_ids and c.token_ids)):
                    continue  # held back: part of a character, or maybe the start of a stop string
                choice = self.stream_chunk(c)
                self.num_output_tokens, self.metrics = c.num_output_tokens, metrics_json(c)
                if self.form.log_id is not None:
                    self.log_delta(c, choice)
                yield choice

    def log_delta(self, c: Chunk, choice: dict) -> None:
        """--enable-log-outputs, streamed: vLLM's line per chunk that says something (a chat
        delta's content, [reasoning: ...] and [tool_calls: <arguments>]), and the text so far
        for the line once the stream is complete (stream_response)."""
        self.text += c.text
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
        """This choice's part of the stream chunk of one engine chunk."""
        f, echo_now, first_of_completion = self.form, self.echo_pending, self.first and not self.form.chat
        lps = c.logprobs if not echo_now or c.logprobs is None else \
            f.echoed_logprobs(c.prompt_logprobs) + ([] if f.prompt_only else c.logprobs)
        choice = {"index": self.index, "logprobs": f.logprobs(lps, self.offset), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if c.prompt_logprobs is not None:  # once, with the first token
            choice["prompt_logprobs"] = prompt_logprobs_json(f.tokenizer, c.prompt_logprobs)
        if f.chat:
            choice["delta"], choice["finish_reason"] = self.message.delta(c.text, c.finish_reason)
        else:
            choice["text"] = (f.echoed if echo_now else "") + ("" if f.prompt_only else c.text)
        if first_of_completion and f.return_ids:
            choice["prompt_token_ids"] = f.prompt_ids
        if f.return_ids:
            choice["token_ids"] = c.token_ids
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


def usage(choices: list[Choice], details: bool | None = None) -> dict:
    """OpenAI's usage of the choices' tokens so far, the prompt counted once (vLLM's usage
    for n samples). details: --enable-prompt-tokens-details, which adds vLLM's
    prompt_tokens_details (the prompt tokens the prefix cache served, 0 included); without
    it a whole response says null and a stream's usage chunk leaves the field out (vLLM
    dumps the one whole and the other without its None fields). None: neither (vLLM's
    continuous_usage_stats chunks never carry it)."""
    first, completion_tokens = choices[0].gen, sum(c.num_output_tokens for c in choices)
    out: dict[str, Any] = {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": first.num_prompt_tokens + completion_tokens}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": first.num_cached_tokens}
    return out


async def whole_response(head: dict, choices: list[Choice], form: ChoiceFormat, details: bool) -> web.Response:
    """The response as one JSON object, once every choice has ended (details:
    --enable-prompt-tokens-details)."""
    await all_of(c.collect() for c in choices)
    extra = choices[0].metrics  # (include_metrics is for n = 1)
    if form.chat and form.return_ids:  # vLLM's place of a chat response's prompt ids
        extra = extra | {"prompt_token_ids": form.prompt_ids}
    use = usage(choices, details)
    use.setdefault("prompt_tokens_details", None)
    return await json_in_pieces(head, [c.whole for c in choices], {"usage": use} | extra)


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
            await events.send([], usage=usage(choices, details), **choices[0].metrics)
        form = choices[0].form
        for c in choices if form.log_id is not None else ():  # vLLM's line per choice: its whole text
            log_output(form.log_id, c.text, None, "streaming_complete", form.log_len, " (streaming complete)")
    except ConnectionResetError:
        return response  # the client left; the request is aborted already
    except Exception as e:  # the status line is gone: report the error in the stream
        err = e if isinstance(e, ApiError) else ApiError("internal server error (see the server log)", 500,
                                                         type="internal_server_error")
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

    def usage_so_far(self) -> dict:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far."""
        return {"usage": usage(self.choices)} if self.continuous_usage else {}  # (no prompt_tokens_details)

    async def open_messages(self) -> None:
        """A chat answer's first chunks, per choice: its role (the first with the prompt's ids
        when asked), then the echoed message, a chunk of its own (vLLM's)."""
        form = self.choices[0].form
        for c in self.choices:
            ids = {"prompt_token_ids": form.prompt_ids} if form.return_ids and c.index == 0 else {}
            await self.send([{"index": c.index, "delta": {"role": form.role, "content": ""}, "logprobs": None,
                              "finish_reason": None}], **self.usage_so_far(), **ids)
            if form.echoed:
                await self.send([{"index": c.index, "delta": {"content": form.echoed}, "logprobs": None,
                                  "finish_reason": None}], **self.usage_so_far())

    async def send_choice(self, choice: Choice) -> None:
        """One choice's chunks, sent as they come; without usage, the metrics ride on the
        chunk with the finish_reason."""
        async with contextlib.aclosing(choice.stream()) as parts:
            async for part in parts:
                await self.send([part], **self.usage_so_far(), **({} if self.include_usage else choice.metrics))


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


def echo_text(body: dict, untruncated: list[int], prompt_ids: list[int], tokenizer: Any, role: str | None) -> str:
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
    prompt = body["prompt"]
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
    if isinstance(prompt, str) and len(prompt_ids) == len(untruncated):
        return prompt
    return tokenizer.decode(prompt_ids, skip_special_tokens=False) if tokenizer is not None else ""


# ---- handlers ---------------------------------------------------------------------

async def read_body(request: web.Request) -> dict:
    # vLLM's validate_json_request (its 400): a body is JSON, and says so
    if request.content_type != "application/json":  # the media type alone: "; charset=utf-8" is fine
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed")
    if (request.content_length or 0) > MAX_BODY_BYTES:  # announced: refused before any of it is awaited
        raise ApiError(f"Maximum request body size {MAX_BODY_BYTES} exceeded, actual body size "
                       f"{request.content_length}", 413)
    # The bytes as JSON (UTF-8, or UTF-16/32 as RFC 8259's detection finds them), as vLLM
    # reads a body: a Content-Type charset is not read (aiohttp's request.json() would
    # decode by it, and a charset Python does not know would fail as a LookupError).
    body = loads_checked(await request.read(), "request body")
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    model = field(body, "model", (str,))
    if model is not None and model not in request.app["model_names"]:
        raise ApiError(f"model '{model}' does not exist; this server serves {request.app['model_names']}",
                       status=404, param="model", type="not_found_error", code="model_not_found")
    return body


async def off_loop(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the app's tokenizer thread (vLLM's tokenizer executor): a prompt of a
    few MB takes seconds to tokenize, during which no stream, /health or /metrics would be
    served on the event loop. One thread, so prompts are tokenized one at a time (the event
    loop only decodes meanwhile, which HF's fast tokenizers allow)."""
    return await asyncio.get_running_loop().run_in_executor(request.app["tokenizer_executor"], fn, *args)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    engine = request.app["engine"]
    tool_choice(body, chat=False, auto=False)  # refuses tools here
    prompt_ids = await off_loop(request, parse_prompt, body, engine.tokenizer, engine.model_config.vocab_size)
    return await respond(request, body, prompt_ids, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    app = request.app
    tools = tool_choice(body, chat=True, auto=app["tool_parser"] is not None)
    prompt_ids = await off_loop(request, parse_messages, body, app["engine"].tokenizer, tools,
                                app["exclude_tools_when_tool_choice_none"], app["chat_template"],
                                app["trust_request_chat_template"], app["chat_template_content_format"],
                                app["default_chat_template_kwargs"])
    return await respond(request, body, prompt_ids, chat=True, tools=tools)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a completions `prompt` (a string, with the tokenizer's special tokens
    unless add_special_tokens is false) or chat `messages` (through the chat template, as a
    chat request renders them) as token ids, with the count and, if asked, their strings."""
    body = await read_body(request)
    app, engine = request.app, request.app["engine"]
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    if body.get("messages") is not None:
        if body.get("prompt") is not None:  # one would be ignored
            raise ApiError("send either 'prompt' or 'messages', not both", param="prompt")
        if field(body, "add_special_tokens", (bool,), False):  # the template writes them, as for chat
            raise ApiError("'add_special_tokens' must be false for messages", param="add_special_tokens")
        tools = tool_choice(body, chat=True, auto=True)  # only rendered: no call is made
        ids = await off_loop(request, parse_messages, body, engine.tokenizer, tools,
                             app["exclude_tools_when_tool_choice_none"], app["chat_template"],
                             app["trust_request_chat_template"], app["chat_template_content_format"],
                             app["default_chat_template_kwargs"])
    else:
        prompt = field(body, "prompt", (str,))
        if prompt is None:
            raise ApiError("'prompt' or 'messages' is required", param="prompt")
        special = field(body, "add_special_tokens", (bool,), True)
        ids = await off_loop(request, lambda: engine.tokenizer.encode(prompt, add_special_tokens=special))
    limit = engine.config.max_model_len
    if len(ids) > limit:
        raise ApiError(f"This model's maximum context length is {limit} tokens, but the prompt has {len(ids)}",
                       param="messages" if "messages" in body else "prompt")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
    if field(body, "return_token_strs", (bool,), False):
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids) if hasattr(
            engine.tokenizer, "convert_ids_to_tokens") else [token_text(engine.tokenizer, t) for t in ids]
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids back to text (special tokens kept, as vLLM decodes)."""
    body = await read_body(request)
    engine = request.app["engine"]
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    tokens = field(body, "tokens", (list,))
    vocab = engine.model_config.vocab_size
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise ApiError(f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    text = await off_loop(request, lambda: engine.tokenizer.decode(tokens, skip_special_tokens=False))
    return web.json_response({"prompt": text})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


def package_version() -> str:
    """taxirank's version: the installed package's, else this checkout's pyproject.toml's."""
    import importlib.metadata
    import os
    import tomllib

    try:
        return importlib.metadata.version("taxirank")
    except importlib.metadata.PackageNotFoundError:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyproject.toml"), "rb") as f:
            return tomllib.load(f)["project"]["version"]


async def models(request: web.Request) -> web.Response:
    engine = request.app["engine"]
    data = [{"id": name, "object": "model", "created": request.app["started"], "owned_by": "taxirank",
             "root": engine.config.model, "max_model_len": engine.config.max_model_len}
            for name in request.app["model_names"]]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    # The server listens only once the engine has warmed up (AsyncEngine.__init__).
    error = request.app["engine"].error
    if error is not None:
        raise ApiError(f"the engine loop died: {error!r}", 503, type="service_unavailable")
    return web.json_response({"status": "ok"})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's POST /reset_prefix_cache: 200 once every cached prefix is forgotten; 409
    while requests hold KV blocks (nothing is reset then)."""
    if request.query:
        raise ApiError(f"query parameters are not supported here, got {sorted(request.query)}")
    try:
        ok = await request.app["engine"].reset_prefix_cache()
    except RuntimeError as e:  # shutting down, or the engine loop died
        raise ApiError(str(e), status=503, type="service_unavailable") from e
    if not ok:
        raise ApiError("the prefix cache cannot be reset while requests hold KV blocks; retry when idle", 409,
                       type="conflict_error")
    return web.Response(status=200)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's XRequestIdMiddleware: the request's X-Request-Id header back, else a random
    uuid4 hex, on every response (errors and streams too: this runs before the headers go)."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", uuid.uuid4().hex)


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app["registry"])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def api_keys(api_key: str | typing.Sequence[str] | None) -> tuple[str, ...]:
    """--api-key's keys (one or several; none: no key asked for), each a non-empty string."""
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("--api-key: a key must be a non-empty string")
    return keys


def api_key_matches(authorization: str, key: str) -> bool:
    """vLLM's check of an Authorization header: the Bearer scheme in any case (RFC 9110),
    the key compared in constant time. A header that is not UTF-8 (aiohttp keeps its bytes
    as surrogates, which no key has) is a wrong key."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode("utf-8", "surrogatepass"),
                                                              key.encode("utf-8"))


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Shutdown, --api-key and every error as OpenAI's error JSON, never a crash."""
    app = request.app
    try:
        if app["stopping"].is_set():
            raise ApiError("server is shutting down", status=503, type="service_unavailable")
        keys, path = app["api_keys"], route_path(request.path, app["root_path"])
        if keys and (path.startswith("/v1/") or path == "/reset_prefix_cache") and \
                not any([api_key_matches(request.headers.get("Authorization", ""), k) for k in keys]):  # each compared
            raise ApiError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401,
                           type="authentication_error", code="invalid_api_key")
        await redirect_slashes(request, path)
        task = asyncio.current_task()  # admitted: a shutdown lets it finish (--shutdown-timeout)
        app["in_flight"].add(task)
        try:
            return await handler(request)
        finally:
            app["in_flight"].discard(task)
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body over the limit
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        message = e.text or e.reason
        if isinstance(e, web.HTTPMethodNotAllowed):  # its Allow header goes out too (RFC 9110), as from vLLM
            message = f"method {request.method} is not allowed on {request.path[:100]}; allowed: " + \
                ", ".join(sorted(e.allowed_methods))
        return web.json_response(ApiError(message, e.status).body(), status=e.status, headers=headers)
    except ApiError as e:
        error = e
    except ConnectionError:  # the client left: nothing to log, and this reply (nginx's 499) is never sent
        return web.Response(status=499)
    except Exception:
        log.exception("error serving %s %s", request.method, request.path)
        error = ApiError("internal server error (see the server log)", 500, type="internal_server_error")
    return web.json_response(error.body(), status=error.status)


def check_root_path(root_path: str | None) -> str:
    """--root-path: "" (none), or a path that starts with "/" and does not end with one.
    FastAPI takes any string, but a value without the leading "/" never matches a request
    path, and one with a trailing "/" strips the "/" the route starts with, so both would
    leave the prefixed paths unserved; "/" alone means none. ValueError names the flag."""
    root_path = root_path or ""
    if root_path in ("", "/"):
        return ""
    bad = "must start with '/'" if not root_path.startswith("/") else \
        "must not end with '/'" if root_path.endswith("/") else \
        "must be a URL path: no '?', '#', whitespace or control characters" \
        if any(c in "?#" or c.isspace() or not c.isprintable() for c in root_path) else None
    if bad:
        raise ValueError(f"--root-path {bad} (e.g. /llm), got {root_path!r}")
    return root_path


class RootPathRouting:
    """An app's router that also serves every route under root_path (--root-path): a
    request whose path starts with it is resolved by the rest of the path (route_path), as
    Starlette routes under FastAPI's root_path; the handler sees the request's own path."""

    def __init__(self, resolve: Callable[[web.Request], Awaitable[Any]], root_path: str) -> None:
        self.resolve_path, self.root_path = resolve, root_path

    @classmethod
    def install(cls, router: web.UrlDispatcher, root_path: str) -> None:
        if root_path:  # the instance's resolve is wrapped: aiohttp's Application(router=...) is deprecated
            router.resolve = cls(router.resolve, root_path)  # type: ignore[method-assign]

    async def __call__(self, request: web.Request) -> Any:
        path = route_path(request.rel_url.path, self.root_path)
        if path != request.rel_url.path:  # (root_path itself is the empty path, which no route has, as in Starlette)
            request = request.clone(rel_url=request.rel_url.with_path(path))
        return await self.resolve_path(request)


async def redirect_slashes(request: web.Request, path: str) -> None:
    """FastAPI's redirect_slashes (Starlette's router): a path no route has, whose twin with
    or without the trailing slash(es) has one (for any method), is a 307 to that twin, the
    query kept; "/" is never redirected."""
    if path in ("", "/") or not isinstance(request.match_info.http_exception, web.HTTPNotFound):
        return
    raw = request.rel_url.raw_path
    twin = raw.rstrip("/") if raw.endswith("/") else raw + "/"
    if not twin:
        return
    match = await request.app.router.resolve(request.clone(rel_url=request.rel_url.with_path(twin, encoded=True)))
    if not isinstance(match.http_exception, web.HTTPNotFound):  # a route, even one for another method
        query = f"?{request.rel_url.raw_query_string}" if request.rel_url.raw_query_string else ""
        raise web.HTTPTemporaryRedirect(f"{request.scheme}://{request.host}{twin}{query}")


# ---- metrics ----------------------------------------------------------------------

async def log_stats_periodically(app: web.Application) -> AsyncIterator[None]:
    """vLLM's stats logging task: app["stat_logger"] logs every LOG_STATS_INTERVAL seconds
    while the app runs. An interval whose line fails is logged with its traceback and
    skipped: the task goes on (an exception would end it, and the stats lines with it,
    silently) and never reaches the server."""
    async def loop() -> None:
        while True:
            await asyncio.sleep(LOG_STATS_INTERVAL)
            try:
                app["stat_logger"].log()
            except Exception:
                log.exception("logging the engine's stats failed; trying again in %s s", LOG_STATS_INTERVAL)

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


PREFIX = "taxirank:"
ENGINE = "0"  # vLLM's engine label (its data-parallel rank): one engine per server
_GAUGES = [  # (metric, EngineStats attribute, help)
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be admitted."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of usable KV cache blocks in use (0..1)."),
    ("slot_utilization", "slot_utilization", "Useful slot-steps / total slot-steps since start."),
    ("num_kv_blocks", "num_kv_blocks", "Usable KV cache blocks (the null block excluded)."),
    ("weight_bytes", "weight_bytes", "Device bytes of the weights, a draft model's included, from the arrays' "
     "shards (all local devices)."),
    ("kv_cache_bytes", "kv_cache_bytes", "Device bytes of the KV cache, a draft model's included, from the arrays' "
     "shards (all local devices)."),
]
_COUNTERS = [  # vLLM's names first; the rest have no vLLM counterpart
    ("num_preemptions", "num_preemptions", "Sequences preempted (recompute or swap)."),
    ("recomputed_tokens", "recomputed_tokens", "Tokens computed again after a preemption dropped them."),
    ("swapped_out_blocks", "swapped_out_blocks", "KV blocks copied to the host pool by swap preemption."),
    ("swapped_in_blocks", "swapped_in_blocks", "KV blocks copied back from the host pool."),
    ("swapped_out_bytes", "swapped_out_bytes", "Bytes of KV copied to the host pool."),
    ("swapped_in_bytes", "swapped_in_bytes", "Bytes of KV copied back from the host pool."),
    ("swap_fallbacks", "swap_fallbacks", "Swap preemptions that recomputed: the host pool was full."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("generation_tokens", "generation_tokens", "Generated tokens."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admissions)."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache (first admissions)."),
    ("num_compilations", "num_compilations", "XLA compilations of step functions."),
    ("num_steps", "num_steps", "Engine steps."),
    ("num_decode_steps", "num_decode_steps", "Engine steps that carried no prompt tokens."),
    ("prefill_tokens", "prefill_tokens", "Prompt tokens computed, recompute after preemption included."),
    ("decode_tokens", "decode_tokens", "Decode tokens computed."),
    ("padded_tokens", "padded_tokens", "Token rows computed only to fill a shape bucket."),
    ("computed_tokens", "computed_tokens", "Token rows computed by the model, bucket padding included."),
    ("useful_tokens", "useful_tokens", "Token rows computed for a scheduled sequence's real token."),
    ("computed_logit_rows", "computed_logit_rows", "Rows the LM head and sampler computed, padding included."),
    ("useful_logit_rows", "useful_logit_rows", "LM-head rows whose token was sampled."),
    ("useful_slot_steps", "useful_slot_steps", "Slot-steps whose sequence made progress."),
    ("total_slot_steps", "total_slot_steps", "Slot-steps run (max_num_seqs per step)."),
    ("structured_output_steps", "structured_output_steps",
     "Steps that sampled a row under a structured-output bitmask."),
    ("structured_output_bitmask_seconds", "structured_output_bitmask_seconds",
     "Host time filling structured-output bitmasks (it overlaps the step's forward)."),
    ("constrained_sample_steps", "constrained_sample_steps",
     "Steps whose sampling waited for the previous step's tokens (grammars, logits processors)."),
]
# vLLM's SpecDecodingProm: exported only by an engine with a speculative config
_SPEC_COUNTERS = [
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative proposals verified."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
]
_HISTOGRAMS = [
    ("time_to_first_token_seconds", "time_to_first_token", "Time to first token."),
    ("inter_token_latency_seconds", "inter_token_latency", "Time between consecutive output tokens."),
    ("e2e_request_latency_seconds", "e2e_request_latency", "Arrival to last token."),
    ("request_queue_time_seconds", "request_queue_time", "Arrival to first scheduled."),
    ("iteration_tokens_total", "iteration_tokens", "Tokens per engine step: prompts completed and tokens generated."),
    # per finished request (aborts not observed, as e2e)
    ("request_prompt_tokens", "request_prompt_tokens", "Prompt tokens per finished request."),
    ("request_generation_tokens", "request_generation_tokens", "Generated tokens per finished request."),
    ("request_params_max_tokens", "request_params_max_tokens", "The max_tokens parameter per finished request."),
    # per request of n samples, once its last sample has finished
    ("request_params_n", "request_params_n", "The n parameter per finished request."),
    ("request_max_num_generation_tokens", "request_max_num_generation_tokens",
     "Per finished request: the most tokens one of its n samples generated."),
    ("request_time_per_output_token_seconds", "request_time_per_output_token",
     "Per request: decode time / (generated tokens - 1)."),
    ("request_inference_time_seconds", "request_inference_time", "First scheduled to last token (RUNNING phase)."),
    ("request_prefill_time_seconds", "request_prefill_time", "First scheduled to first token (PREFILL phase)."),
    ("request_decode_time_seconds", "request_decode_time", "First token to last token (DECODE phase)."),
]


class EngineCollector:
    """Renders EngineStats.snapshot() at scrape time, so there is one set of numbers: the engine's.

    `labels` go on every sample (the server's: vLLM's model_name and engine, and which replica
    of a fleet), so one scrape of several engines keeps their series apart. `spec_decode`:
    the engine has a speculative config, so the spec_decode_* counters are exported (as
    vLLM's SpecDecodingProm, not otherwise), one per-position series per draft position."""

    def __init__(self, stats: EngineStats, labels: dict[str, str] | None = None, spec_decode: bool = False) -> None:
        self.stats, self.labels, self.spec_decode = stats, labels or {}, spec_decode

    def collect(self) -> Iterator[Metric]:
        # vLLM's cache_config_info is labelled by its config and engine, without model_name
        info = {k: v for k, v in self.labels.items() if k != "model_name"}
        for family in self._families():
            labels = info if family.name == PREFIX + "cache_config_info" else self.labels
            family.samples = [s._replace(labels=labels | s.labels) for s in family.samples]
            yield family

    def _families(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        for name, attr, doc in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(s, attr))
        for name, attr, doc in _COUNTERS + (_SPEC_COUNTERS if self.spec_decode else []):
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(s, attr))
        # vLLM's info gauge: its CacheConfig's fields and the engine's index as labels, value 1
        info_labels = s.cache_config | {"engine": ENGINE}
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache configuration as labels (value 1).",
                                 labels=list(info_labels))
        info.add_metric(list(info_labels.values()), 1)
        yield info
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                      "Waiting requests by what they wait for.", labels=["reason"])
        for reason, n in s.waiting_by_reason.items():
            by_reason.add_metric([reason], n)
        yield by_reason
        if self.spec_decode:  # startup sized the list: one series per draft position from the start
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the proposal.", labels=["position"])
            for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([str(pos)], n)
            yield per_pos
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                      labels=["finished_reason"])
        for reason, n in s.request_success.items():
            success.add_metric([reason], n)
        yield success
        for name, attr, doc in _HISTOGRAMS:
            h = getattr(s, attr)
            yield HistogramMetricFamily(PREFIX + name, doc, sum_value=h.sum,
                                        buckets=[(floatToGoString(le), n) for le, n in h.cumulative()])


# ---- app, CLI, main ---------------------------------------------------------------

def build_app(engine: AsyncEngine, model_names: list[str], api_key: str | typing.Sequence[str] | None = None,
              metric_labels: dict[str, str] | None = None, per_request_metrics: bool = False,
              tool_call_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
              request_id_headers: bool = False, return_tokens_as_token_ids: bool = False,
              chat_template: str | None = None,
              trust_request_chat_template: bool = False, response_role: str = "assistant",
              chat_template_content_format: str = "auto", default_chat_template_kwargs: dict | None = None,
              log_stats: bool = False, log_requests: bool = False, max_log_len: int | None = None,
              cors: CorsPolicy = CorsPolicy(), force_include_usage: bool = False,
              prompt_tokens_details: bool = False, log_outputs: bool = False, log_deltas: bool = True,
              root_path: str = "") -> web.Application:
    """api_key: one key or several (vLLM's --api-key takes several): /v1/* and
    /reset_prefix_cache answer a request bearing any of them.
    per_request_metrics: a request may ask for its RequestMetrics (`include_metrics`).
    tool_call_parser: a TOOL_PARSERS name: tool_choice "auto" finds calls in the output
    (vLLM's --enable-auto-tool-choice --tool-call-parser NAME); None: "auto" is refused.
    exclude_tools_when_tool_choice_none: tool_choice "none" keeps the tools out of the prompt.
    request_id_headers: every response carries an X-Request-Id header (vLLM's
    --enable-request-id-headers): the request's own, else a new one.
    return_tokens_as_token_ids: logprobs' tokens are "token_id:N" unless a request's
    return_tokens_as_token_ids says otherwise (vLLM's --return-tokens-as-token-ids).
    chat_template: a Jinja chat template to use instead of the model's (--chat-template's
    text); trust_request_chat_template: a request may bring its own; response_role: the
    role of chat answers that open a new turn (vLLM's --response-role).
    chat_template_content_format: "string", "openai" or "auto" (chat_format; vLLM's
    --chat-template-content-format): how message contents reach the template; start-up
    logs the format detected. default_chat_template_kwargs: template variables a request's
    chat_template_kwargs override key by key (vLLM's --default-chat-template-kwargs). log_stats: log the
    engine's stats line every LOG_STATS_INTERVAL seconds while the app runs
    (metrics.LoggingStatLogger; the server's default, off with --disable-log-stats).
    log_requests: log each request's id and parameters as it arrives (and, at debug level,
    its prompt's first max_log_len token ids): vLLM's --enable-log-requests, --max-log-len.
    cors: which other origins' pages may call the API (cors.py; vLLM's default: any).
    force_include_usage: every stream ends with a usage chunk, asked for or not (vLLM's
    --enable-force-include-usage). prompt_tokens_details: usage carries
    prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details). log_outputs:
    log each request's output too (vLLM's --enable-log-outputs; with log_requests); log_deltas: a
    stream's line per chunk too (vLLM's --enable-log-deltas).
    root_path: the path prefix a proxy serves this app under (vLLM's --root-path, FastAPI's
    root_path): a request under it is routed without it, any other as it is (RootPathRouting)."""
    keys = api_keys(api_key)
    root_path = check_root_path(root_path)
    check_log_flags(argparse.Namespace(enable_log_outputs=log_outputs, enable_log_requests=log_requests))
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
    if chat_template is not None:
        check_chat_template(chat_template, engine.tokenizer)
    chat_format.check_content_format(chat_template_content_format, engine.tokenizer)
    default_chat_template_kwargs = chat_format.check_default_kwargs(default_chat_template_kwargs or {},
                                                                    engine.tokenizer)
    if engine.tokenizer is not None:
        log_content_format(chat_template_content_format, engine.tokenizer, chat_template)
    app = web.Application(middlewares=[cors.middleware(), guard], client_max_size=MAX_BODY_BYTES)
    app.on_response_prepare.append(cors_headers)
    RootPathRouting.install(app.router, root_path)
    registry = CollectorRegistry(auto_describe=False)
    # vLLM's labels on every series: the served model's (first) name and the engine's index
    registry.register(EngineCollector(engine.stats, {"model_name": model_names[0], "engine": ENGINE}
                                      | (metric_labels or {}), spec_decode=engine.config.speculative_config is not None))
    app.update(engine=engine, model_names=model_names, api_keys=keys, registry=registry,
               started=int(time.time()), stopping=asyncio.Event(), in_flight=set(),
               per_request_metrics=per_request_metrics,
               tool_parser=TOOL_PARSERS[tool_call_parser] if tool_call_parser is not None else None,
               exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
               return_tokens_as_token_ids=return_tokens_as_token_ids,
               # chat messages carry the model's thinking as `reasoning` (--reasoning-parser)
               reasoning_parser=REASONING_PARSERS.get(engine.config.reasoning_parser),
               chat_template=chat_template, trust_request_chat_template=trust_request_chat_template,
               chat_template_content_format=chat_template_content_format,
               default_chat_template_kwargs=default_chat_template_kwargs,
               response_role=response_role, log_requests=log_requests, max_log_len=max_log_len,
               force_include_usage=force_include_usage, prompt_tokens_details=prompt_tokens_details,
               log_outputs=log_outputs, log_deltas=log_deltas, root_path=root_path)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app["tokenizer_executor"] = ThreadPoolExecutor(1, thread_name_prefix="taxirank-tokenizer")
    if request_id_headers:
        app.on_response_prepare.append(echo_request_id)
    app["stat_logger"] = LoggingStatLogger(engine.stats, log) if log_stats else None
    if log_stats:
        app.cleanup_ctx.append(log_stats_periodically)

    async def stop_tokenizer(app: web.Application) -> None:
        app["tokenizer_executor"].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_tokenizer)
    return app


_HELP = {  # EngineConfig fields; config.py says more
    "reasoning_parser": "split the model's thinking (<think>...</think>) off chat answers into the message's "
                        "`reasoning` (deepseek_r1: DeepSeek-R1 and QwQ; qwen3: Qwen3), and apply a structured-output "
                        "constraint once thinking ends, as vLLM",
    "generation_config": "the sampling defaults of requests that leave them out (repetition_penalty, temperature, "
                         "top_p, top_k, min_p, "
                         "max_new_tokens as max_tokens): auto: the model folder's generation_config.json; vllm: "
                         "none (OpenAI's defaults); or a folder holding one",
    "override_generation_config": "JSON over those defaults, e.g. '{\"temperature\": 0.5}'",
    "model": "'smollm2' (built-in SmolLM2-135M-Instruct, fetched on first use), 'tiny', 'bench' (built-in "
             "random weights), a .gguf file or a Hugging Face model directory",
    "tokenizer": "a folder holding a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json or "
                 "tokenizer.model), or a .gguf file's, used instead of the model's own: encoding, decoding, the chat "
                 "template, its EOS beside the model's stop ids, structured outputs' vocabulary; at most the model's "
                 "vocab_size ids. For a GGUF model, its base model's tokenizer (vLLM's advice). None or '': the model's",
    "dtype": "weights and KV cache dtype: float32, bfloat16, or auto: bfloat16 for a bfloat16 checkpoint, else "
             "float32 (a float16 one too: no fp16 overflow)",
    "seed": "weights seed of the built-in models, and sampling seed of unseeded requests",
    "max_num_seqs": "slots: most sequences in one step",
    "max_model_len": "longest prompt + output; None: the model's max_position_embeddings",
    "block_size": "tokens per KV cache block (a power of two)",
    "num_kv_blocks": "KV cache size in blocks, the null block 0 included; None: from the memory budget",
    "kv_cache_memory": "KV cache budget in bytes; None: --gpu-memory-utilization on an accelerator, 4 GiB on CPU",
    "gpu_memory_utilization": "fraction of device memory for weights, activations and the KV cache",
    "max_num_batched_tokens": "token budget of one step; None: depends on --enable-chunked-prefill",
    "enable_chunked_prefill": "split long prompts across steps, decodes first",
    "enable_prefix_caching": "reuse the cached KV blocks of a shared prompt prefix",
    "long_prefill_token_threshold": "most prompt tokens of one sequence in a step (its chunk), so a long prompt "
                                    "shares steps with others; 0: no cap but the step's budget (vLLM's)",
    "scheduling": "how a step is composed and when a finished sequence's seat frees (policy.BATCHING)",
    "scheduling_policy": "the waiting queue's order, the KV victim, who may preempt whom (policy.POLICIES)",
    "kv_admission": "the KV blocks a sequence holds from admission (policy.KV_ADMISSION)",
    "preemption_mode": "how a preempted sequence gives up its KV: recompute (dropped, computed again) or swap "
                       "(copied to a host pool of --swap-space GiB and back; recompute when it is full)",
    "swap_space": "GiB of host memory for KV blocks swapped out by --preemption-mode swap",
    "slo_ttft_ms": "--scheduling-policy slo: a request's time-to-first-token target when its body sets none",
    "slo_tpot_ms": "--scheduling-policy slo: a request's time-per-output-token target when its body sets none",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype), or 8 bits (fp8 = fp8_e4m3, fp8_e5m2, int8) with an "
                      "f32 scale per token and KV head: ~4x (from f32) or ~2x (from bf16) the blocks in the same memory",
    "attention_backend": "paged attention: auto (the first registered backend for this platform that passes its "
                         "start-up check, else the jnp reference) or a name in attention_backend.BACKENDS",
    "logprobs_mode": "what logprobs hold: raw_logprobs (the model's, before logit_bias, penalties, temperature and "
                     "top-k/top-p/min-p; a grammar's mask applies), raw_logits, processed_logprobs or processed_logits "
                     "(what the token was drawn from), as vLLM's",
    "max_logprobs": "most logprobs and prompt_logprobs a request may ask for (the width of the top-logprob arrays); "
                    "-1: the vocabulary, which a request then asks with -1 (as vLLM's)",
    "max_waiting_requests": "answer 503 at once while this many requests wait; None: no limit",
    "warmup": "compile every step shape before serving",
    "compilation_cache_dir": "persistent cache of compiled step programs (fast restarts); None: $TAXIRANK_CACHE/jax "
                             "(TAXIRANK_CACHE defaults to ~/.cache/taxirank); '' turns it off",
    "async_scheduling": "schedule step N+1 while the device runs step N (sampled tokens stay on the device)",
    "tensor_parallel_size": "devices the model is sharded over (Megatron-style, KV cache by KV heads)",
    "distributed_coordinator": "HOST:PORT of process 0 for a multi-host run (jax.distributed); None: one process",
    "num_processes": "processes in a multi-host run (one per host); process 0 schedules and serves HTTP",
    "process_id": "this process's rank in a multi-host run",
    "pipeline_parallel_size": "vLLM's; 1 only: taxirank does not split layers over devices (use "
                              "--tensor-parallel-size)",
    "data_parallel_size": "vLLM's; 1 only: for data parallelism run replicas (serve_ray.py --num-replicas N)",
    "distributed_executor_backend": "vLLM's; uni only (or unset): the model runs in this process, one JAX "
                                    "controller over all its devices; more hosts join through jax.distributed "
                                    "(--distributed-coordinator)",
    "quantization": "weight-only quantization of the decoder layers' linears: int8 (per output channel, any "
                    "checkpoint) or gguf (a GGUF file's Q8_0/Q4_0/Q4_1 blocks as stored); None: the model dtype "
                    "(a GGUF file dequantized)",
    "speculative_config": "speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": ..., "
                          "\"num_speculative_tokens\": 4}; also disable_by_batch_size, min_acceptance_rate "
                          "(spec_decode.SpeculativeConfig)",
}


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or (vLLM's rule) the value itself when it holds
    Jinja's characters; a value that names no file and looks like a path is an error."""
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise argparse.ArgumentTypeError(f"{value!r} looks like a file path, but it cannot be opened "
                                             f"({e.strerror})") from None
    return codecs.decode(value, "unicode_escape")  # a one-line template's \n, as vLLM reads it


def log_content_format(given: str, tokenizer: Any, chat_template: str | None) -> None:
    """Start-up's line on the content format of the server's template (--chat-template's, else
    the model's), in vLLM's words; a warning where --chat-template-content-format names
    another than the one detected. A request's own template is detected when it comes."""
    detected = chat_format.resolve_content_format("auto", tokenizer, chat_template)
    if given == "auto":
        log.info("Detected the chat template content format to be '%s'. You can set "
                 "`--chat-template-content-format` to override this.", detected)
    elif given != detected:
        log.warning("You specified `--chat-template-content-format %s` which is different from the detected "
                    "format '%s': the messages go to the template as '%s'", given, detected, given)


def check_chat_template(template: str, tokenizer: Any) -> None:
    """A template the model's tokenizer can render with, compiled as transformers compiles it
    for apply_chat_template (chat_format.compile_template: its extensions, `{% generation %}`
    included, its filters), checked at start-up, not at the first chat request."""
    import jinja2

    if tokenizer is None or "chat_template" not in inspect.signature(tokenizer.apply_chat_template).parameters:
        raise ValueError("--chat-template needs a Hugging Face tokenizer; this model has "
                         f"{type(tokenizer).__name__ if tokenizer is not None else 'none'}")
    try:
        chat_format.compile_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e} (line {e.lineno})") from None


def root_path_arg(value: str) -> str:
    """--root-path's value, checked (check_root_path) as argparse reads it."""
    try:
        return check_root_path(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--root-path ")) from None


def check_log_flags(args: argparse.Namespace) -> None:
    """vLLM's rule (ValueError): --enable-log-outputs logs through --enable-log-requests's logger."""
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs requires --enable-log-requests")


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """One flag per EngineConfig field (same name, dashes for underscores), then the server's own."""
    p = argparse.ArgumentParser(description="taxirank: OpenAI-compatible server",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(EngineConfig)
    registries = {r.field: r for r in REGISTRIES}
    for f in dataclasses.fields(EngineConfig):
        kind, kw = hints[f.name], {"default": f.default, "help": _HELP.get(f.name, f"EngineConfig.{f.name}")}
        if f.name in registries:  # every registered name, read when the parser is built
            kw["choices"] = list(registries[f.name])
        elif f.name == "reasoning_parser":
            kw["choices"] = list(REASONING_PARSERS)
        elif f.name == "distributed_executor_backend":  # vLLM's names; EngineConfig says which run here
            kw["choices"] = list(DISTRIBUTED_EXECUTOR_BACKENDS)
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = typing.get_args(kind)
        else:  # int, float, str, or `X | None`; a type that parses its own text gets the text
            arg = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            kw["type"] = config_file.json_text if hasattr(arg, "parse") else arg
        p.add_argument("--" + f.name.replace("_", "-"), *VLLM_SPELLINGS.get(f.name, ()), **kw)
    p.add_argument("--config", help="a YAML file of flags (max-model-len: 1024, ...), as vLLM's; flags given on the "
                                    "command line win over the file's")
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use; default: the model's name")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only; vLLM's default is every "
                        "interface: 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", nargs="+", help="require 'Authorization: Bearer <key>' on /v1/* and "
                   "/reset_prefix_cache, with one of these keys")
    p.add_argument("--uds", help="serve on this Unix domain socket instead of --host and --port, as vLLM")
    p.add_argument("--ssl-keyfile", help="HTTPS: the private key's file (PEM), for --ssl-certfile")
    p.add_argument("--ssl-certfile", help="HTTPS: the certificate chain's file (PEM; it may hold the key too)")
    p.add_argument("--ssl-ca-certs", help="HTTPS: the CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
                   help="client certificates: 0 not asked for, 1 checked if sent, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, whether stream_options asks for it or not")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache "
                        "served (off: null in a whole response, left out of a stream's usage chunk); vLLM's flag")
    p.add_argument("--root-path", type=root_path_arg, default="",
                   help="the path prefix a proxy serves this server under (e.g. /llm): a request path under it "
                        "is served as the path without it, any other path as it is (FastAPI's root_path, as vLLM)")
    p.add_argument("--allowed-origins", type=config_file.json_list, default=["*"],
                   help='origins whose pages may call the API (CORS), as a JSON list, e.g. \'["https://a.example"]\'; '
                        '["*"]: any, as vLLM')
    p.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin pages send credentials (cookies, Authorization): CORS's "
                        "Access-Control-Allow-Credentials")
    p.add_argument("--allowed-methods", type=config_file.json_list, default=["*"],
                   help='HTTP methods a cross-origin page may use, as a JSON list ("*": any)')
    p.add_argument("--allowed-headers", type=config_file.json_list, default=["*"],
                   help='request headers a cross-origin page may send, as a JSON list ("*": any)')
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="a request with \"include_metrics\": true gets its timings and scheduling history "
                        "(metrics.RequestMetrics) in the response, or in the last chunk of a stream")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\" (the default with tools): the model may call tools, found in its "
                        "output by --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS),
                   help="how tool calls are written in the model's output (hermes: <tool_call>{...}</tool_call>); "
                        "used only with --enable-auto-tool-choice, as vLLM")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice \"none\" keeps the tool definitions out of the prompt (default: the chat "
                        "template renders them, as for any other tool_choice)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="add an X-Request-Id header to every response: the request's own X-Request-Id, else a "
                        "random one (vLLM's flag)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name their tokens \"token_id:N\" (a request's return_tokens_as_token_ids wins; "
                        "vLLM's flag)")
    p.add_argument("--chat-template", type=load_chat_template,
                   help="a Jinja chat template, or the path of a file holding one, to use instead of the model's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="a request may bring its own chat_template (refused otherwise, as vLLM)")
    p.add_argument("--chat-template-content-format", choices=chat_format.CONTENT_FORMATS, default="auto",
                   help="how a message's content reaches the chat template: 'string' (its text parts joined by "
                        "newlines), 'openai' (a list of {\"type\": \"text\", \"text\": ...} parts), or 'auto': "
                        "'openai' when the template loops over a message's content (vLLM's flag)")
    p.add_argument("--default-chat-template-kwargs", type=config_file.json_object,
                   help="JSON object of chat template variables, e.g. '{\"enable_thinking\": false}', which a "
                        "request's chat_template_kwargs override key by key (vLLM's flag)")
    p.add_argument("--response-role", default="assistant",
                   help="the role of a chat answer that opens a new turn (add_generation_prompt true; otherwise "
                        "the role of the last message it continues)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="default: %(default)s")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (every 10 s: prompt and generation throughput, running and "
                        "waiting requests, preemptions, KV cache usage, prefix cache hit rate, speculative "
                        "acceptance); vLLM's flag")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request's id and sampling parameters as it arrives (at debug level also its "
                        "prompt's token ids); vLLM's flag")
    p.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="also log each request's output: its text and finish reason (a stream: each chunk's and, "
                        "once complete, the whole text), at debug level also its token ids; needs "
                        "--enable-log-requests (vLLM's flag)")
    p.add_argument("--enable-log-deltas", action=argparse.BooleanOptionalAction, default=True,
                   help="with --enable-log-outputs, a stream's line per chunk ('streaming delta'); "
                        "--no-enable-log-deltas: only its line once complete (vLLM's flag)")
    p.add_argument("--max-log-len", type=non_negative_int,
                   help="most prompt token ids, output characters and output token ids a request's log lines "
                        "show; None: all (vLLM's flag)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or SIGINT, new requests get 503 at once and those in flight get this many "
                        "seconds to finish before the rest are aborted (0: abort at once; a second signal "
                        "also aborts at once)")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags of build_parser() describe (raises ValueError if invalid)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def app_from_args(engine: AsyncEngine, args: argparse.Namespace,
                  metric_labels: dict[str, str] | None = None) -> web.Application:
    """The app the flags of build_parser() describe, serving `engine` (`metric_labels`: added
    to every metric it exports, e.g. a Ray Serve replica's id)."""
    # As vLLM: a --tool-call-parser without --enable-auto-tool-choice parses nothing, so
    # "auto" stays refused; "required" and a named function need no parser (their output
    # is constrained to the calls' JSON). vLLM says nothing; a warning says it here.
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        log.warning("--tool-call-parser %s is unused without --enable-auto-tool-choice: tool_choice \"auto\" "
                    "(the default with tools) is refused", args.tool_call_parser)
    return build_app(engine, args.served_model_name or [engine.model_name], args.api_key,
                     metric_labels=metric_labels, per_request_metrics=args.enable_per_request_metrics,
                     tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                     exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                     request_id_headers=args.enable_request_id_headers,
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                     chat_template=args.chat_template,
                     trust_request_chat_template=args.trust_request_chat_template, response_role=args.response_role,
                     chat_template_content_format=args.chat_template_content_format,
                     default_chat_template_kwargs=args.default_chat_template_kwargs,
                     log_stats=not args.disable_log_stats, log_requests=args.enable_log_requests,
                     max_log_len=args.max_log_len,
                     cors=CorsPolicy.from_args(args), force_include_usage=args.enable_force_include_usage,
                     prompt_tokens_details=args.enable_prompt_tokens_details,
                     log_outputs=args.enable_log_outputs, log_deltas=args.enable_log_deltas, root_path=args.root_path)


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """HTTPS from the --ssl-* flags, as vLLM's (uvicorn's) reads them; None: plain HTTP.
    ValueError naming the flag for a file that does not load, before the model does."""
    if args.ssl_certfile is None:
        for flag in ("ssl_keyfile", "ssl_ca_certs"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --ssl-certfile")
        if args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-cert-reqs needs --ssl-certfile")
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)

    def no_password() -> bytes:  # else OpenSSL would stop start-up to ask for one on the terminal
        raise ValueError(f"--ssl-keyfile {args.ssl_keyfile or args.ssl_certfile!r} is encrypted: give an "
                         "unencrypted key (no flag takes its password, as vLLM)")

    try:
        ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=no_password)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {args.ssl_certfile!r} / --ssl-keyfile {args.ssl_keyfile!r}: {e}") from None
    if args.ssl_ca_certs is not None:
        try:
            ctx.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {args.ssl_ca_certs!r}: {e}") from None
    elif args.ssl_cert_reqs != ssl.CERT_NONE:  # no client certificate could be checked
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (what client certificates are checked against)")
    ctx.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return ctx


async def listen(runner: web.AppRunner, args: argparse.Namespace, tls: ssl.SSLContext | None) -> str:
    """Start serving the runner's app where the flags say (--uds, else --host and --port;
    HTTPS with `tls`); returns the address it serves at."""
    if args.uds is not None:
        await web.UnixSite(runner, args.uds, ssl_context=tls).start()
        return f"{'https' if tls else 'http'}+unix://{args.uds}"
    await web.TCPSite(runner, args.host, args.port, ssl_context=tls).start()
    port = runner.addresses[0][1]  # the bound one: --port 0 lets the OS pick a free port
    return f"{'https' if tls else 'http'}://{args.host}:{port}"


async def serve(engine: AsyncEngine, args: argparse.Namespace, tls: ssl.SSLContext | None = None) -> None:
    app = app_from_args(engine, args)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts
    # its request in the engine (Generation.chunks) instead of generating on for nobody.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger("taxirank.access") if args.log_level == "debug" else None)
    await engine.start()
    await runner.setup()
    address = await listen(runner, args, tls)
    log.info("ready: %s  (model names: %s)", address, ", ".join(app["model_names"]))

    loop = asyncio.get_running_loop()
    abort_now = asyncio.Event()

    def on_signal() -> None:
        if app["stopping"].is_set():
            abort_now.set()  # a second signal: do not wait out the grace period
        app["stopping"].set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    died: list[BaseException] = []

    def on_death(error: BaseException) -> None:
        # As vLLM: a dead engine loop ends the process (non-zero) so a supervisor restarts
        # it; every open stream has its error event queued already. /health says 503 meanwhile.
        log.error("engine loop died: %r; exiting", error)
        died.append(error)
        app["stopping"].set()

    engine.on_death = on_death
    await app["stopping"].wait()  # from here on, new requests (and /health) get a 503
    if not died:
        await drain(app, args.shutdown_timeout, abort_now)
        await engine.shutdown()  # what is left ends now: each stream's last event says finish_reason "abort"
    await runner.cleanup()  # lets the handlers send their last event (up to 5 s)
    if died:
        raise SystemExit(1)


async def drain(app: web.Application, timeout: float, abort_now: asyncio.Event) -> None:
    """Wait for the requests in flight to finish, for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    if app["in_flight"]:
        log.info("shutting down: refusing new requests; %d in flight get up to %.0f s to finish",
                 len(app["in_flight"]), timeout)
    while app["in_flight"] and time.monotonic() < deadline and not abort_now.is_set():
        await asyncio.sleep(0.05)
    if app["in_flight"]:
        log.info("shutting down: aborting %d request(s) still in flight", len(app["in_flight"]))
    else:
        log.info("shutting down: no request in flight")


def check_host(host: str, port: int) -> None:
    """--host: an address this machine can bind (ValueError if it does not resolve), checked
    before the model loads and compiles (minutes), not when the server binds after it."""
    try:
        # "" binds every interface (asyncio, aiohttp and vLLM alike), as a passive lookup of None does
        socket.getaddrinfo(host or None, port, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None


def quiet_bad_http(record: logging.LogRecord) -> bool:
    """A logging filter for aiohttp's server logger: a request it cannot parse (framing,
    headers past its limits, a Content-Encoding it cannot decode) is the client's error, which
    aiohttp answers with a 400 and logs at ERROR with a traceback, so any client could fill
    the log with them. It becomes one warning line, as uvicorn's (vLLM's) "Invalid HTTP request"."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, HttpProcessingError):
        reason = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")[:200]
        record.msg, record.args = "%s: invalid HTTP request (%s)", (record.getMessage(), reason)
        record.levelno = min(record.levelno, logging.WARNING)  # (aiohttp logs a non-HTTP client at debug)
        record.levelname, record.exc_info, record.exc_text = logging.getLevelName(record.levelno), None, None
    return True


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = config_file.parse_args(parser, argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # vLLM's rule
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    # also refuses nan; inf too: a stream that never ends would hold the shutdown forever
    if not 0 <= args.shutdown_timeout < float("inf"):
        parser.error(f"--shutdown-timeout must be a finite number of seconds >= 0, got {args.shutdown_timeout}")
    # Before the model loads and compiles (minutes), not when the server binds after it.
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    try:
        check_host(args.host, args.port)
        check_log_flags(args)
        tls = tls_context(args)
        api_keys(args.api_key)
        if args.default_chat_template_kwargs is not None:  # the model's own tokenizer is checked once it loads
            chat_format.check_default_kwargs(args.default_chat_template_kwargs)
    except ValueError as e:
        parser.error(str(e))
    # Other libraries (JAX, aiohttp) speak only from warnings up; --log-level is ours.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("taxirank").setLevel(args.log_level.upper())
    logging.getLogger("aiohttp.server").addFilter(quiet_bad_http)
    # A signal during start-up (download, warm-up) stops it as Ctrl-C does: nothing is in
    # flight yet, so there is nothing to wait for; the exit is as clean as a later one.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from async_engine import AsyncEngine

        config = engine_config(args)
        # Loads, sizes the KV cache and compiles every shape (blocking); it logs the model,
        # dtype, KV blocks and tokens, and the max concurrency at max_model_len as it goes.
        engine = AsyncEngine(config, log=log.info)
    except (ValueError, OSError, RuntimeError) as e:  # a bad flag value, model file or download
        # one line saying so: argparse's usage (60 lines of flags) would bury it
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:
        log.info("stopped during start-up")
        raise SystemExit(0) from None
    # As vLLM after warm-up (freeze_gc_heap): the start-up heap (the model's Python objects,
    # the tokenizer, JAX's caches) moves to the permanent generation, so the collections
    # the step loop's per-step objects trigger never walk it again.
    gc.collect()
    gc.freeze()
    if config.process_id > 0:  # multi-host: only process 0 serves; the others run its steps
        engine.follow()
        return
    try:
        asyncio.run(serve(engine, args, tls))
    except KeyboardInterrupt:  # a signal before serve() took the signals over: nothing was admitted yet
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
