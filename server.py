"""OpenAI-compatible HTTP server over AsyncEngine (aiohttp).

    python server.py                           # built-in smollm2 (a real chat model) on 127.0.0.1:8000
    python server.py --model tiny              # built-in random weights (tests)
    python server.py --model FILE.gguf         # a GGUF checkpoint (llama.cpp's format)
    python server.py --model /path/to/hf_dir   # a checkpoint, its tokenizer and chat template

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics (Prometheus text), POST /reset_prefix_cache
(?reset_running_requests=true preempts what runs first),
POST /tokenize, POST /detokenize, GET /version; each also under --root-path, and a path
that differs from one by a trailing slash is a 307 to it (FastAPI's routing, as vLLM's
server answers).

This module is the HTTP app: the handlers (which tokenize prompts, chat templates included,
off the event loop), the API key, routing, start-up and shutdown. Beside it, serving.py turns
a completion or chat request into its answer (generation.py: one engine request as text),
prometheus.py renders /metrics, and cli_args.py holds the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import socket
import ssl
import time
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import chat_format
import config_file
from cli_args import (api_keys, bind_address, build_parser, check_chat_template, check_log_flags,
                      check_root_path, check_server_flags, engine_config, listen_error)
from cors import CorsPolicy, on_response_prepare as cors_headers
from metrics import LoggingStatLogger
from prometheus import ENGINE, EngineCollector
from protocol import (MAX_BODY_BYTES, ApiError, field, integers, loads_checked, parse_prompts, rendered_tools,
                      route_path, tool_choice)
from reasoning_parsers import REASONING_PARSERS
from serving import respond
from tool_parsers import TOOL_PARSERS

# The engine (JAX, Flax) is imported where it is used: `server.py --help` and a bad flag
# answer in a fraction of a second instead of after seconds of importing JAX.
if TYPE_CHECKING:
    from async_engine import AsyncEngine

T = TypeVar("T")

log = logging.getLogger("taxirank.server")

LOG_STATS_INTERVAL = 10.0  # seconds between two stats lines (vLLM's VLLM_LOG_STATS_INTERVAL default)


# ---- handlers ---------------------------------------------------------------------

async def read_body(request: web.Request) -> dict:
    # vLLM's validate_json_request (its 400): a body is JSON, and says so
    if request.content_type != "application/json":  # the media type alone: "; charset=utf-8" is fine
        # vLLM's validate_json_request: its RequestValidationError handler names the type by the phrase
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed", type="Bad Request")
    if (request.content_length or 0) > MAX_BODY_BYTES:  # announced: refused before any of it is awaited
        raise ApiError(f"Maximum request body size {MAX_BODY_BYTES} exceeded, actual body size "
                       f"{request.content_length}", 413)
    # The bytes as JSON (UTF-8, or UTF-16/32 as RFC 8259's detection finds them), as vLLM
    # reads a body: a Content-Type charset is not read (aiohttp's request.json() would
    # decode by it, and a charset Python does not know would fail as a LookupError).
    try:
        data = await request.read()
    except web.RequestPayloadError as e:  # bytes its Content-Encoding (gzip, deflate) does not decode
        raise ApiError(f"request body cannot be read: {payload_error(e)}") from e
    body = loads_checked(data, "request body")
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    model = field(body, "model", (str,))
    if model and model not in request.app["model_names"]:  # vLLM's _is_model_supported: "" is the served model
        raise ApiError(f"The model `{model}` does not exist. This server serves {request.app['model_names']}.",
                       status=404, param="model")
    return body


def payload_error(e: web.RequestPayloadError) -> str:
    """What aiohttp found wrong with a body as it read it, in one line."""
    cause = e.__cause__
    return (cause.message if isinstance(cause, HttpProcessingError) else str(e)).strip()


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
    prompts, sent = await off_loop(request, parse_prompts, body, engine.tokenizer, engine.model_config.vocab_size)
    return await respond(request, body, prompts, chat=False, sent=sent)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    app = request.app
    choice, tools = tool_choice(body, chat=True, auto=app["tool_parser"] is not None)
    # (only "none" itself: a null tool_choice's tools still reach the template, as vLLM's)
    rendered = chat_format.chat_tools(choice, tools, app["exclude_tools_when_tool_choice_none"] and
                                      body.get("tool_choice") == "none")
    prompt_ids = await off_loop(request, chat_format.parse_messages, body, app["engine"].tokenizer, rendered,
                                app["chat_template"], app["trust_request_chat_template"],
                                app["chat_template_content_format"], app["default_chat_template_kwargs"])
    return await respond(request, body, [prompt_ids], chat=True, tools=choice)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a completions `prompt` (a string, with the tokenizer's special tokens
    unless add_special_tokens is false) or chat `messages` (through the chat template, as a
    chat request renders them, the tokenizer's special tokens on top only with
    add_special_tokens true) as token ids, with the count and, if asked, their strings."""
    body = await read_body(request)
    app, engine = request.app, request.app["engine"]
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    if body.get("messages") is not None:
        if body.get("prompt") is not None:  # one would be ignored
            raise ApiError("send either 'prompt' or 'messages', not both", param="prompt")
        # vLLM's tokenize renders whatever `tools` holds ([] too) and reads no tool_choice
        ids = await off_loop(request, chat_format.parse_messages, body, engine.tokenizer, rendered_tools(body),
                             app["chat_template"], app["trust_request_chat_template"],
                             app["chat_template_content_format"], app["default_chat_template_kwargs"])
    else:
        prompt = field(body, "prompt", (str,))
        if prompt is None:
            raise ApiError("'prompt' or 'messages' is required", param="prompt")
        special = field(body, "add_special_tokens", (bool,), True)
        ids = await off_loop(request, lambda: engine.tokenizer.encode(prompt, add_special_tokens=special))
    # No length limit, as vLLM's: a client asks how long a prompt is, often to cut one that
    # does not fit (the body's size bounds the work).
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                           "token_strs": None}
    if field(body, "return_token_strs", (bool,), False):
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids) if hasattr(
            engine.tokenizer, "convert_ids_to_tokens") else [engine.tokenizer.decode([t], skip_special_tokens=False)
                                                             for t in ids]
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: token ids back to text (special tokens kept, as vLLM decodes)."""
    body = await read_body(request)
    engine = request.app["engine"]
    if engine.tokenizer is None:
        raise ApiError("this model has no tokenizer")
    tokens = field(body, "tokens", (list,))
    vocab = engine.model_config.vocab_size
    tokens = None if tokens is None else integers(tokens)
    if tokens is None or not all(0 <= t < vocab for t in tokens):
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
    """vLLM's ModelList: a card per served name, with vLLM's parent (null: no LoRA adapter
    here, which would name its base model) and its one permission, the defaults of its
    ModelPermission."""
    engine, started = request.app["engine"], request.app["started"]
    data = [{"id": name, "object": "model", "created": started, "owned_by": "taxirank",
             "root": engine.config.model, "parent": None, "max_model_len": engine.config.max_model_len,
             "permission": [model_permission(started)]}
            for name in request.app["model_names"]]
    return web.json_response({"object": "list", "data": data})


def model_permission(created: int) -> dict[str, Any]:
    """vLLM's ModelPermission with its defaults: sampling, logprobs and viewing allowed,
    nothing else."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


async def health(request: web.Request) -> web.Response:
    # The server listens only once the engine has warmed up (AsyncEngine.__init__).
    error = request.app["engine"].error
    if error is not None:
        raise ApiError(f"the engine loop died: {error!r}", 503)
    return web.json_response({"status": "ok"})


# FastAPI's reading of a bool query parameter (pydantic's), as vLLM's routes take them
QUERY_BOOLS = {**dict.fromkeys(("1", "true", "t", "yes", "y", "on"), True),
               **dict.fromkeys(("0", "false", "f", "no", "n", "off"), False)}


def query_bool(request: web.Request, name: str) -> bool:
    value = request.query.getall(name, ["false"])
    if len(value) != 1 or value[0].lower() not in QUERY_BOOLS:
        raise ApiError(f"query parameter {name} must be one boolean (true or false), got {value!r}"[:300])
    return QUERY_BOOLS[value[0].lower()]


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's POST /reset_prefix_cache: 200 once every cached prefix is forgotten; 409
    while requests hold KV blocks (nothing is reset then), unless
    ?reset_running_requests=true: every running request is preempted first (recompute).
    ?reset_external=true (a KV connector's cache) is refused: there is no connector."""
    unknown = sorted(set(request.query) - {"reset_running_requests", "reset_external"})
    if unknown:  # (names a client chose: cut to a readable length)
        raise ApiError(f"unknown query parameters {', '.join(unknown)[:200]}; this route takes "
                       "reset_running_requests and reset_external")
    reset_running = query_bool(request, "reset_running_requests")
    if query_bool(request, "reset_external"):
        raise ApiError("reset_external=true is not supported: taxirank has no KV connector (external cache)")
    try:
        ok = await request.app["engine"].reset_prefix_cache(reset_running)
    except ValueError as e:  # engine.PreemptionRefusedError: static batching never preempts
        raise ApiError(str(e)) from e
    except RuntimeError as e:  # shutting down, or the engine loop died
        raise ApiError(str(e), status=503) from e
    if not ok:
        raise ApiError("the prefix cache cannot be reset while requests hold KV blocks; retry when idle", 409)
    return web.Response(status=200)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's XRequestIdMiddleware: the request's X-Request-Id header back, else a random
    uuid4 hex, on every response (errors and streams too: this runs before the headers go)."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id", uuid.uuid4().hex)


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(request.app["registry"])
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def api_key_matches(authorization: str, key: str) -> bool:
    """vLLM's check of an Authorization header: the Bearer scheme in any case (RFC 9110),
    the key compared in constant time. A header that is not UTF-8 (aiohttp keeps its bytes
    as surrogates, which no key has) is a wrong key."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode("utf-8", "surrogatepass"),
                                                              key.encode("utf-8"))


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Shutdown, --api-key and every error as vLLM's error JSON, never a crash."""
    app = request.app
    try:
        if app["stopping"].is_set():
            raise ApiError("server is shutting down", status=503)
        keys, path = app["api_keys"], route_path(request.path, app["root_path"])
        # vLLM's AuthenticationMiddleware asks no key of an OPTIONS request (a CORS preflight or not)
        if keys and request.method != "OPTIONS" and (path.startswith("/v1/") or path == "/reset_prefix_cache") and \
                not any([api_key_matches(request.headers.get("Authorization", ""), k) for k in keys]):  # each compared
            raise ApiError("missing or wrong API key: send 'Authorization: Bearer <key>'", status=401)
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
        error = ApiError("internal server error (see the server log)", 500)
    return web.json_response(error.body(), status=error.status)


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


# ---- app and main -----------------------------------------------------------------

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
    TOOL_PARSERS.check(tool_call_parser)
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


def app_from_args(engine: AsyncEngine, args: argparse.Namespace,
                  metric_labels: dict[str, str] | None = None) -> web.Application:
    """The app the flags of cli_args.build_parser() describe, serving `engine` (`metric_labels`:
    added to every metric it exports, e.g. a Ray Serve replica's id)."""
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


class CannotListen(Exception):
    """The address the flags name cannot be served: one error line, as a bad flag's."""


async def listen(runner: web.AppRunner, args: argparse.Namespace, tls: ssl.SSLContext | None,
                 socks: list[socket.socket]) -> str:
    """Start serving the runner's app on --uds, else on the sockets that bind_address bound
    to --host and --port (HTTPS with `tls`); returns the address it serves at."""
    try:
        if args.uds is not None:
            await web.UnixSite(runner, args.uds, ssl_context=tls).start()
            return f"{'https' if tls else 'http'}+unix://{args.uds}"
        for sock in socks:
            await web.SockSite(runner, sock, ssl_context=tls).start()
    except OSError as e:  # --uds: a path that cannot be bound; else a server that took the port meanwhile
        flags = f"--uds {args.uds}" if args.uds is not None else f"--host {args.host} --port {args.port}"
        raise CannotListen(f"{flags}: {listen_error(e)}") from None
    port = runner.addresses[0][1]  # the bound one: --port 0 lets the OS pick a free port
    return f"{'https' if tls else 'http'}://{args.host}:{port}"


async def serve(engine: AsyncEngine, args: argparse.Namespace, tls: ssl.SSLContext | None,
                socks: list[socket.socket]) -> None:
    app = app_from_args(engine, args)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # request in the engine (generation.Generation.chunks) instead of generating on for nobody.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0,
                           access_log=logging.getLogger("taxirank.access") if args.log_level == "debug" else None)
    await engine.start()
    await runner.setup()
    try:
        address = await listen(runner, args, tls, socks)
    except CannotListen:
        await engine.shutdown()
        await runner.cleanup()
        raise
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


def quiet_bad_http(record: logging.LogRecord) -> bool:
    """A logging filter for aiohttp's server logger: a request it cannot parse (framing,
    headers past its limits, a Content-Encoding it cannot decode) is the client's error, which
    aiohttp answers with a 400 and logs at ERROR with a traceback, so any client could fill
    the log with them. It becomes one warning line, as uvicorn's (vLLM's) "Invalid HTTP request"."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, web.RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
        exc = exc.__cause__  # a body read_body refused already, read again to end the request
    if isinstance(exc, HttpProcessingError):
        reason = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")[:200]
        record.msg, record.args = "%s: invalid HTTP request (%s)", (record.getMessage(), reason)
        record.levelno = min(record.levelno, logging.WARNING)  # (aiohttp logs a non-HTTP client at debug)
        record.levelname, record.exc_info, record.exc_text = logging.getLevelName(record.levelno), None, None
    return True


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = config_file.parse_args(parser, argv)
    # Before the model loads and compiles (minutes).
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    try:
        check_server_flags(args)
        tls = tls_context(args)
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
        # Only process 0 serves: the others of a multi-host run follow its steps.
        socks = bind_address(args.host, args.port) if config.process_id == 0 and args.uds is None else []
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
        asyncio.run(serve(engine, args, tls, socks))
    except CannotListen as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:  # a signal before serve() took the signals over: nothing was admitted yet
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
