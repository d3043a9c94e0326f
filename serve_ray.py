"""taxirank replicas under Ray Serve: one OpenAI endpoint, N engines, routed by prefix and load.

    python serve_ray.py --model tiny --num-replicas 2                  # a local Ray instance
    python serve_ray.py --model bench --min-replicas 1 --max-replicas 4  # autoscaled
    python serve_ray.py --ray-address auto ...                         # join a running cluster

Every server.py flag means the same here, but --uds, --ssl-* and the multi-host ones, refused;
`python serve_ray.py --help` lists the Ray ones.

Two deployments. `Engine` replicas each run one AsyncEngine behind server.py's own aiohttp
app (same routes, streaming, error JSON, /health, per-replica /metrics), bound to the node's
address on a free port. `Ingress` (one replica, no engine) takes HTTP from Ray Serve's proxy
and hands each request to an Engine replica through a deployment handle. The hop through a
handle is what lets a router read the prompt: Ray Serve's proxy routes on the URL alone. The
Engine replica relays the request to its own aiohttp app over loopback, so request handling
lives in server.py's app only. The Ingress answers GET /metrics itself, merging every
replica's metrics (each series labelled with its replica), and sends POST /reset_prefix_cache
to all.

Routing: PrefixAffinityRouter (the default) sends a prompt to the replica that was sent the
longest prefix of it, unless that replica's queue is longer than the shortest by more than
--imbalanced-threshold; otherwise to the least loaded. `--routing power-of-two` is Ray
Serve's default router, the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import random
import signal
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import config_file


# server.py's flags that Ray Serve's proxy cannot honour: it serves plain HTTP at --host and --port
NOT_UNDER_RAY = ("uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")


def build_parser() -> argparse.ArgumentParser:
    """server.py's flags (the same meaning per replica; --host/--port are Ray Serve's
    proxy) and the fleet's own."""
    import cli_args

    p = cli_args.build_parser()
    p.description = "taxirank: OpenAI-compatible server, N replicas under Ray Serve"
    for action in p._actions:  # server.py's words for these would promise what the proxy does not do
        if action.dest in NOT_UNDER_RAY:
            action.help = ("refused under Ray Serve unless left at its default: its proxy serves plain HTTP at "
                           "--host and --port")
    g = p.add_argument_group("Ray Serve")
    g.add_argument("--num-replicas", type=int, help="fixed number of engine replicas, exclusive with "
                   "--min-replicas/--max-replicas; None: 1 (without them)")
    g.add_argument("--min-replicas", type=int, help="autoscaling: fewest engine replicas; None: 1")
    g.add_argument("--max-replicas", type=int,
                   help="autoscaling: most engine replicas; None: --min-replicas (at least 1)")
    g.add_argument("--target-ongoing-requests", type=float,
                   help="autoscaling: requests per replica it aims at; None: --max-num-seqs")
    g.add_argument("--max-ongoing-requests", type=int,
                   help="requests one replica is sent at most; the rest wait in the router; None: 2 x --max-num-seqs, "
                        "or more than --max-num-seqs + --max-waiting-requests if that is more")
    g.add_argument("--routing", choices=["prefix", "power-of-two"], default="prefix",
                   help="prefix: the replica holding the longest prefix of the prompt unless its queue is more "
                        "than --imbalanced-threshold longer than the shortest, else the least loaded; "
                        "power-of-two: Ray Serve's default (the shorter queue of two random replicas)")
    g.add_argument("--imbalanced-threshold", type=int,
                   help="prefix routing: the queue-length lead above which load wins over a prefix; "
                        "None: --max-num-seqs")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per engine replica")
    g.add_argument("--replica-gpus", type=float, default=0.0,
                   help="Ray GPUs per engine replica: 0 (CPU replicas), a fraction of one (a shared GPU), "
                        "or a whole number >= --tensor-parallel-size")
    g.add_argument("--ray-address", help="join this Ray cluster ('auto': the one `ray start` runs here); "
                   "None: start a local Ray instance")
    return p


if __name__ == "__main__":
    config_file.parse_args(build_parser())  # --help and a refused flag answer before Ray loads (a second)

import aiohttp  # noqa: E402
import yarl  # noqa: E402
import ray  # noqa: E402
from aiohttp import web  # noqa: E402
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.core import Metric  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.config import AutoscalingConfig, RequestRouterConfig  # noqa: E402
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator  # noqa: E402
from ray.serve.schema import LoggingConfig  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica  # noqa: E402
from starlette.requests import ClientDisconnect, Request  # noqa: E402
from starlette.responses import Response, StreamingResponse  # noqa: E402

from cors import CorsPolicy  # noqa: E402
from protocol import MAX_BODY_BYTES, ApiError, route_path  # noqa: E402

# The engine side (server.py, cli_args.py, the engine, JAX) is imported where it is used: by
# the driver (flags, plan) and by the Engine replicas. The Ingress process imports this module
# to run its deployment and the router, and holds no engine: importing JAX there would cost
# each Ingress replica seconds of CPU at start and the memory of a second JAX runtime.
if TYPE_CHECKING:
    from config import EngineConfig

log = logging.getLogger("taxirank.serve_ray")

APP_NAME = "taxirank"
REPLICA_HEADER = "x-taxirank-replica"  # which replica answered: for clients, tests and benches
ANNOUNCE_INTERVAL_S = 5.0  # an Engine replica re-announces its address to the Ingress this often
# Headers that belong to one HTTP hop, not to the request or response they travel with.
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
# Headers Ray Serve's proxy (uvicorn) puts on every response it sends: a replica's own would
# go out beside them, two Date fields (a field HTTP allows once) and two Server fields.
PROXY_HEADERS = {"date", "server"}


# ---- the request as it travels from the Ingress to an Engine replica ---------------

@dataclass(frozen=True)
class HttpRequest:
    """One HTTP request, relayed whole. `prompt` is what the router matches prefixes on
    (None: nothing to match; the name is the one Ray Serve LLM's routers read too), among
    the requests of the same `cache_salt` only (vLLM's field: a replica shares their blocks
    with no other request)."""

    method: str
    path: str  # with the query string
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prompt: str | None
    cache_salt: str | None


@dataclass(frozen=True)
class HttpHead:
    status: int
    headers: tuple[tuple[str, str], ...]


def routing_prompt(body: bytes) -> tuple[str | None, str | None]:
    """The body's prompt (completions) or messages (chat) as one string whose prefixes are
    shared exactly when the requests' prompts share a prefix, and its cache_salt. JSON keeps
    the structure: a shared system message is a shared prefix of the serialized message list."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None, None  # the replica answers the 400
    if not isinstance(parsed, dict):
        return None, None
    prompt = parsed.get("messages", parsed.get("prompt"))
    salt = parsed.get("cache_salt")  # any but a string is the replica's 400
    return (None if prompt is None else json.dumps(prompt, ensure_ascii=False, separators=(",", ":")),
            salt if isinstance(salt, str) else None)


# ---- routing ----------------------------------------------------------------------

class PrefixAffinityRouter(RequestRouter):
    """Prefers the replica that holds the longest prefix of the prompt, unless its queue is
    longer than the shortest by more than `imbalanced_threshold`; else the least loaded.

    What a replica holds is what was routed to it: the chained hashes of the prompt's first
    k * `chunk_chars` characters, k = 1, 2, ..., kept per replica up to `max_chunks` (LRU),
    as SGLang's cache-aware router and Ray Serve LLM's PrefixCacheAffinityRouter keep theirs.
    It runs in the caller's process (the Ingress) and asks the replicas nothing beyond the
    queue lengths Ray Serve already tracks; a replica's own LRU may have evicted a prefix the
    router still credits it with, which costs one miss, never a wrong answer.
    """

    def initialize_state(self, imbalanced_threshold: int = 8, chunk_chars: int = 64,
                         max_chunks: int = 1 << 16) -> None:
        if imbalanced_threshold < 0 or chunk_chars < 1 or max_chunks < 1:
            raise ValueError(f"PrefixAffinityRouter: imbalanced_threshold >= 0, chunk_chars >= 1 and "
                             f"max_chunks >= 1, got {imbalanced_threshold}, {chunk_chars}, {max_chunks}")
        self.imbalanced_threshold, self.chunk_chars, self.max_chunks = imbalanced_threshold, chunk_chars, max_chunks
        self.held: dict[ReplicaID, collections.OrderedDict[int, None]] = {}

    def _chunk_hashes(self, request: PendingRequest | None) -> list[int]:
        # Read by attribute, as Ray Serve LLM's routers do: Ray Serve ships a router class by
        # value, so HttpRequest here is a copy of the class the Ingress builds its requests from.
        relayed = next((a for a in request.args if isinstance(getattr(a, "prompt", None), str)), None) \
            if request else None
        prompt, salt = (relayed.prompt, getattr(relayed, "cache_salt", None)) if relayed else (None, None)
        # A salt seeds the chain, as it does the replica's block names (its first block's):
        # no chunk of a salted prompt matches an unsalted or otherwise salted one's.
        hashes, h, n = [], 0 if salt is None else hash(("cache_salt", salt)), self.chunk_chars
        for i in range(0, len(prompt or "") - n + 1, n):  # whole chunks only
            h = hash((h, prompt[i:i + n]))
            hashes.append(h)
        return hashes

    def _held_prefix(self, replica_id: ReplicaID, hashes: list[int]) -> int:
        held, n = self.held.get(replica_id, {}), 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        # The choice is made (and recorded) here rather than left to Ray Serve's pick within
        # a rank, because the record must be in place before the next request is routed: a
        # burst that shares a new prefix then follows its first request instead of spreading.
        # Ray Serve tracks queue lengths from what it sent and what finished; unknown is idle.
        queue = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        room = [r for r in candidate_replicas if queue[r.replica_id] < r.max_ongoing_requests] or candidate_replicas
        shortest = min(queue[r.replica_id] for r in room)
        hashes = self._chunk_hashes(pending_request)
        held = {r.replica_id: self._held_prefix(r.replica_id, hashes) for r in room
                if queue[r.replica_id] - shortest <= self.imbalanced_threshold}
        longest = max(held.values(), default=0)
        if longest > 0:
            best = [r for r in room if held.get(r.replica_id) == longest]
        else:  # nothing held, or only by replicas too far behind: the least loaded
            best = [r for r in room if queue[r.replica_id] == shortest]
        best = [r for r in best if queue[r.replica_id] == min(queue[b.replica_id] for b in best)]
        chosen = random.choice(best)
        self._record(chosen.replica_id, hashes)
        # Should the chosen one turn the request down (full), Ray Serve tries the rest,
        # shortest queue first.
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def _record(self, replica_id: ReplicaID, hashes: list[int]) -> None:
        held = self.held.setdefault(replica_id, collections.OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_chunks:
            held.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self.held) - {r.replica_id for r in replicas}:
            del self.held[gone]  # a replaced replica starts with an empty cache


# ---- the deployments --------------------------------------------------------------

@serve.deployment(name="Engine", health_check_period_s=2.0, health_check_timeout_s=30.0)
class EngineReplica:
    """One AsyncEngine behind server.py's app, on this node's address and a free port."""

    async def __init__(self, args: argparse.Namespace, config: EngineConfig) -> None:
        import server
        from async_engine import AsyncEngine

        logging.getLogger("taxirank").setLevel(args.log_level.upper())
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        # Loading and warm-up block for a while: off the event loop, so Ray Serve's calls
        # into this replica are answered meanwhile.
        self.engine = await asyncio.to_thread(AsyncEngine, config, log=log.info)
        self.engine.on_death = lambda e: log.error("engine loop died: %r; check_health fails from now on", e)
        app = server.app_from_args(self.engine, args, metric_labels={"replica": self.replica})
        # handler_cancellation: a relay that goes away (client gone) aborts the request in the engine.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5.0, access_log=None)
        await self.engine.start()
        await self.runner.setup()
        host = ray.util.get_node_ip_address()
        await web.TCPSite(self.runner, host, 0).start()
        self.url = f"http://{host}:{self.runner.addresses[0][1]}"
        self.session = relay_session()
        ingress = serve.get_deployment_handle("Ingress", app_name=context.app_name)
        self.announcer = asyncio.create_task(self._announce(ingress))
        log.info("replica %s ready at %s", self.replica, self.url)

    async def _announce(self, ingress: DeploymentHandle) -> None:
        while True:  # again and again: a restarted Ingress learns the fleet within one interval
            try:
                await ingress.register.remote(self.url)
            except Exception as e:  # the Ingress is (re)starting; the next round tells it
                log.debug("announcing to the Ingress failed: %r", e)
            await asyncio.sleep(ANNOUNCE_INTERVAL_S)

    async def handle(self, request: HttpRequest) -> AsyncIterator[HttpHead | bytes]:
        """The response to `request` from this replica's app: its head, then body bytes as
        the app writes them (an SSE stream event by event)."""
        async with self.session.request(request.method, self.url + request.path, headers=list(request.headers),
                                        data=request.body) as resp:
            headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS | PROXY_HEADERS]
            yield HttpHead(resp.status, tuple(headers) + ((REPLICA_HEADER, self.replica),))
            async for data in resp.content.iter_any():
                yield data

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose check fails; its open streams already have
        their error event (AsyncEngine ends each one when the loop dies)."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine loop died: {self.engine.error!r}")

    async def __del__(self) -> None:
        # Ray Serve calls this after a constructor that raised too (a model that does not
        # load): only what was set up is torn down.
        if hasattr(self, "announcer"):
            self.announcer.cancel()
        if hasattr(self, "engine"):
            await self.engine.shutdown()  # every in-flight stream gets its last event
        if hasattr(self, "runner"):
            await self.runner.cleanup()
        if hasattr(self, "session"):
            await self.session.close()


def relay_session() -> aiohttp.ClientSession:
    """An Engine replica's client of its own app. No connection cap (aiohttp's default is
    100): Ray's max_ongoing_requests bounds what reaches the replica, and a request parked in
    a client pool is one that the engine's queue, its max_waiting_requests and its queue-time
    metric would never see."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


class RelayedStream(StreamingResponse):
    """A relayed SSE stream that cancels the replica's request however the response ends.
    The relay generator's own `finally` runs only once starlette has started iterating it;
    a client gone before the first chunk (starlette's disconnect listener wins, or sending
    the status line fails) leaves it never started, and the request would keep its engine
    slot to its last token."""

    def __init__(self, responses: DeploymentResponseGenerator, content: AsyncIterator[bytes], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.responses = responses

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.responses.cancel()  # after a whole stream: a no-op


async def read_body(request: Request) -> bytes:
    """The request's body, refused (server.py's 413) as soon as it is known to be larger than
    a replica's app takes: from its Content-Length before any byte is read, else as it
    comes. Read whole, it would sit in the Ingress's memory and then travel to a replica
    only to be refused there."""
    too_large = ApiError(f"Maximum request body size {MAX_BODY_BYTES} exceeded.", 413)  # aiohttp's words
    announced = request.headers.get("content-length", "")
    if announced.isascii() and announced.isdigit() and int(announced) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _error(e: ApiError) -> Response:
    return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json")


def _replica_died(e: BaseException) -> ApiError:
    return ApiError(f"the replica serving this request failed ({type(e).__name__}); retry it", 503)


@serve.deployment(name="Ingress", num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class Ingress:
    """HTTP in, one Engine replica's answer out; /metrics and /reset_prefix_cache span all."""

    def __init__(self, engines: DeploymentHandle, cors: CorsPolicy = CorsPolicy(), root_path: str = "") -> None:
        self.engines = engines.options(stream=True)
        self.cors = cors  # for its own answers: a replica's carry their CORS headers already
        self.root_path = root_path  # --root-path, which the replicas' apps serve under too
        self.replica_urls: set[str] = set()  # as each Engine replica announced itself
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    def register(self, url: str) -> None:
        self.replica_urls.add(url)

    async def __call__(self, request: Request) -> Response:
        response = await self.answer(request)
        # A replica's answer has its CORS headers already: its app varies every answer with
        # the Origin (cors.py). Any other answer is the Ingress's own.
        if "origin" not in response.headers.get("vary", "").lower():
            response.headers.update(self.cors.answer_headers(request.headers.get("origin")))
            response.headers.append("Vary", "Origin")
        return response

    async def answer(self, request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS)
        route = route_path(request.url.path, self.root_path)  # as the replicas' apps route it
        if request.method == "GET" and route == "/metrics":
            return await self.fleet_metrics()
        try:
            body = await read_body(request)
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:  # the client left mid-body: nothing to answer (server.py's 499)
            return Response(status_code=499)
        if request.method == "POST" and route == "/reset_prefix_cache":
            return await self.reset_every_prefix_cache(path, headers)
        responses: DeploymentResponseGenerator = self.engines.handle.remote(
            HttpRequest(request.method, path, headers, body, *routing_prompt(body)))
        try:
            head = await responses.__anext__()
        except Exception as e:
            log.warning("request to %s failed before its answer began: %r", path, e)
            return _error(_replica_died(e))
        head = self.client_redirect(request, head)
        if dict((k.lower(), v) for k, v in head.headers).get("content-type", "").startswith("text/event-stream"):
            return RelayedStream(responses, self._relay(responses), status_code=head.status,
                                 headers=dict(head.headers))
        try:
            data = b"".join([chunk async for chunk in responses])
        except Exception as e:
            log.warning("request to %s failed mid-answer: %r", path, e)
            return _error(_replica_died(e))
        return Response(data, status_code=head.status, headers=dict(head.headers))

    @staticmethod
    def client_redirect(request: Request, head: HttpHead) -> HttpHead:
        """A replica's redirect (its app's 307 to a path's twin without the trailing slash)
        names the replica's own address, which it was called at: the client's comes back
        instead, scheme and Host as the client sent them."""
        if not 300 <= head.status < 400:
            return head
        base = f"{request.url.scheme}://{request.url.netloc}"
        headers = tuple((k, base + str(yarl.URL(v).relative()) if k.lower() == "location" and yarl.URL(v).absolute
                         else v) for k, v in head.headers)
        return dataclasses.replace(head, headers=headers)

    async def _relay(self, responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        """An SSE stream as it comes; if the replica dies, an error event and [DONE], as
        serving.py ends a stream whose request failed after the status line went out."""
        last = b"\n\n"
        try:
            async for last in responses:
                yield last
        except Exception as e:
            log.warning("stream failed mid-answer: %r", e)
            event = b"data: " + json.dumps(_replica_died(e).body()).encode() + b"\n\n"
            yield (b"" if last.endswith(b"\n\n") else b"\n\n") + event + b"data: [DONE]\n\n"
        finally:
            responses.cancel()  # the client left early: the replica aborts the request

    async def _each_replica(self, method: str, path: str, headers: tuple = ()) -> dict[str, tuple[int, bytes]]:
        """`method path` on every announced replica: url -> (status, body); a replica that
        does not answer is dropped until it announces itself again."""

        async def one(url: str) -> tuple[int, bytes]:
            async with self.session.request(method, url + path, headers=list(headers)) as resp:
                return resp.status, await resp.read()

        urls = sorted(self.replica_urls)
        results = await asyncio.gather(*(one(url) for url in urls), return_exceptions=True)
        answers = {}
        for url, result in zip(urls, results):
            if isinstance(result, BaseException):
                log.info("replica at %s did not answer (%r); forgotten until it announces itself", url, result)
                self.replica_urls.discard(url)
            else:
                answers[url] = result
        return answers

    async def fleet_metrics(self) -> Response:
        families: dict[str, Metric] = {}
        for status, text in (await self._each_replica("GET", "/metrics")).values():
            for family in text_string_to_metric_families(text.decode()) if status == 200 else ():
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(list(families.values())))
        return Response(generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_every_prefix_cache(self, path: str, headers: tuple) -> Response:
        answers = await self._each_replica("POST", path, headers)
        if not answers:
            return _error(ApiError("no replica is ready", 503))
        status, body = max(answers.values(), key=lambda a: a[0])  # any refusal wins over the 200s
        return Response(body, status_code=status, media_type="application/json" if body else None)


class _Families:
    """Already-collected metric families, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# ---- the application, CLI, main -------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The Engine deployment's options, from validated flags."""

    config: EngineConfig
    options: dict[str, Any]


def plan(args: argparse.Namespace) -> Plan:
    """Validate the flags (ValueError says which and why) and turn them into deployment options."""
    import cli_args

    # before EngineConfig, whose multi-host checks would speak of a setup that cannot run here at all
    if args.num_processes > 1 or args.distributed_coordinator is not None:
        flag = (f"--num-processes {args.num_processes}" if args.num_processes > 1
                else f"--distributed-coordinator {args.distributed_coordinator!r}")
        raise ValueError(f"{flag}: multi-host replicas are not supported under Ray Serve: one replica is one "
                         "process (use --tensor-parallel-size over its local devices)")
    for flag in NOT_UNDER_RAY:
        if getattr(args, flag) not in (None, ssl.CERT_NONE):  # --ssl-cert-reqs's default is CERT_NONE
            raise ValueError(f"--{flag.replace('_', '-')} is not supported under Ray Serve: its proxy serves plain "
                             "HTTP at --host and --port (put TLS in front of it)")
    config = cli_args.engine_config(args)
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be a fixed port (1..65535) for Ray Serve's proxy, got {args.port}")
    cli_args.check_server_flags(args)  # Ray Serve's proxy binds --host; a replica would fail on the rest
    if args.default_chat_template_kwargs is not None:  # server.py's check before the model loads
        import chat_format

        chat_format.check_default_kwargs(args.default_chat_template_kwargs)
    autoscale = args.min_replicas is not None or args.max_replicas is not None
    if autoscale and args.num_replicas is not None:
        raise ValueError("--num-replicas is a fixed count; --min-replicas/--max-replicas autoscale: give one or the other")
    if args.target_ongoing_requests is not None:
        if not 0 < args.target_ongoing_requests < math.inf:  # also refuses nan
            raise ValueError(f"--target-ongoing-requests must be a finite number > 0, got {args.target_ongoing_requests}")
        if not autoscale:
            raise ValueError("--target-ongoing-requests needs autoscaling (--min-replicas/--max-replicas)")
    if args.imbalanced_threshold is not None and args.routing != "prefix":
        raise ValueError("--imbalanced-threshold applies to --routing prefix only")
    for name in ("num_replicas", "max_ongoing_requests"):
        if (v := getattr(args, name)) is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("replica_cpus", "replica_gpus", "imbalanced_threshold"):
        if (v := getattr(args, name)) is not None and not 0 <= v < math.inf:  # also refuses nan
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    gpus, tp = args.replica_gpus, config.tensor_parallel_size
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(f"--replica-gpus above 1 must be a whole number of GPUs (Ray's rule), got {gpus}")
    if 0 < gpus and math.ceil(gpus) < tp:  # a fraction of one GPU (a shared GPU) is one visible device
        # Ray makes only a replica's own GPUs visible to it: the mesh would not find its devices.
        raise ValueError(f"--replica-gpus {gpus:g} is fewer GPUs than --tensor-parallel-size {tp} shards each "
                         f"replica over: give --replica-gpus >= {tp} (or 0 for CPU replicas)")
    ongoing = args.max_ongoing_requests or 2 * config.max_num_seqs
    if args.max_ongoing_requests is None and config.max_waiting_requests is not None:
        # A replica sent no more than it runs and lets wait would never answer the 503 of
        # --max-waiting-requests: the rest would wait in Ray Serve's router, unbounded.
        ongoing = max(ongoing, config.max_num_seqs + config.max_waiting_requests + 1)
    options: dict[str, Any] = {
        "max_ongoing_requests": ongoing,
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
        # server.py's --shutdown-timeout, kept by Ray Serve: a stopping replica takes no new
        # requests and gives those in flight this long before __del__ aborts the rest.
        "graceful_shutdown_timeout_s": args.shutdown_timeout,
    }
    if autoscale:
        lo = args.min_replicas if args.min_replicas is not None else 1
        hi = args.max_replicas if args.max_replicas is not None else max(lo, 1)
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got {lo}, {hi}")
        target = float(config.max_num_seqs) if args.target_ongoing_requests is None else args.target_ongoing_requests
        options["autoscaling_config"] = AutoscalingConfig(min_replicas=lo, max_replicas=hi,
                                                          target_ongoing_requests=target)
    else:
        options["num_replicas"] = args.num_replicas or 1
    if args.routing == "prefix":
        threshold = config.max_num_seqs if args.imbalanced_threshold is None else args.imbalanced_threshold
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalanced_threshold": threshold})
    return Plan(config, options)


def start(args: argparse.Namespace, the_plan: Plan) -> str:
    """Deploy the application on the connected Ray cluster; returns its base URL once every
    replica has warmed up."""
    # Ray Serve's own INFO lines (one per request and per call) only under --log-level debug.
    ray_logging = LoggingConfig(log_level="INFO" if args.log_level == "debug" else "WARNING",
                                enable_access_log=args.log_level == "debug")
    serve.start(http_options={"host": args.host, "port": args.port}, logging_config=ray_logging)
    engines = EngineReplica.options(**the_plan.options).bind(args, the_plan.config)
    # The Ingress relays what the Engine replicas answer: it drains as long as they do.
    ingress = Ingress.options(graceful_shutdown_timeout_s=args.shutdown_timeout)
    serve.run(ingress.bind(engines, CorsPolicy.from_args(args), args.root_path), name=APP_NAME, route_prefix="/",
              logging_config=ray_logging)
    return f"http://{args.host}:{args.port}"


def drain(timeout_s: float) -> None:
    """Delete the application, letting the requests in flight finish for up to `timeout_s`
    (--shutdown-timeout, each replica's graceful_shutdown_timeout_s) as server.py drains,
    and wait for it. serve.shutdown alone stops the proxy first, which drops every open
    connection at once, and gives the controller 30 s whatever the timeout."""
    serve.delete(APP_NAME, _blocking=False)
    deadline = time.monotonic() + timeout_s + 30.0  # the replicas' own stopping beyond their grace
    while APP_NAME in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.2)


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (a Ray cluster's GCS,
# or its Ray Client server for ray://) answers with a SETTINGS frame of its own.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4  # the frame type, the 4th byte of a frame's 9-byte header


def check_ray_address(address: str | None, timeout_s: float = 10.0) -> None:
    """A ValueError unless a cluster address given as [ray://]host:port takes a connection
    and speaks gRPC there: ray.init (which has no timeout argument) retries an address in its
    GCS client's reconnect loop for many minutes, whether nothing listens there or something
    else does (the dashboard's HTTP port, a Redis). 'auto' (and none), and an address without
    a port (Ray's default port then), Ray resolves, and refuses, itself; under RAY_USE_TLS the
    cluster speaks TLS first, so only the connection is checked."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return
            conn.sendall(_H2_PREFACE)
            reply = b""
            while len(reply) < 9 and (part := conn.recv(9 - len(reply))):
                reply += part
    except (OSError, ValueError) as e:
        raise ValueError(f"--ray-address {address}: no Ray cluster answers there ({e})") from None
    if len(reply) < 9 or reply[3] != _H2_SETTINGS:
        # (a cluster under TLS hangs up on a client that does not start TLS)
        said = (f"it answered {reply[:9]!r}" if reply else
                "it closed the connection; a cluster under TLS needs RAY_USE_TLS=1")
        raise ValueError(f"--ray-address {address}: something listens there, but no Ray cluster (a Ray address "
                         f"speaks gRPC; {said})")


def check_resources(the_plan: Plan, resources: dict[str, float]) -> None:
    """A ValueError unless a Ray instance with `resources` (ray.cluster_resources()) can place
    the replicas the plan starts with (at least one): serve.run would wait for them forever,
    Ray Serve saying only that they take long to be scheduled. For a local instance, whose
    resources nothing adds to; a cluster's autoscaler may add the nodes they wait for."""
    options = the_plan.options
    n = options.get("num_replicas") or max(options["autoscaling_config"].min_replicas, 1)
    cpus, gpus = options["ray_actor_options"]["num_cpus"], options["ray_actor_options"]["num_gpus"]
    have_cpus, have_gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    # a fraction of a GPU shares one GPU with others of its size: floor(1 / fraction) of them fit on one
    fit = (math.floor(have_gpus) * math.floor(1 / gpus + 1e-9) if gpus < 1 else math.floor(have_gpus / gpus + 1e-9)) \
        if gpus > 0 else n
    if fit < n:
        raise ValueError(f"--replica-gpus {gpus:g}: this machine's Ray instance has {have_gpus:g} GPU(s), room for "
                         f"{fit} of the {n} replica(s) (give fewer replicas, or --ray-address a cluster that has them)")
    if n * cpus > have_cpus + 1e-9:
        raise ValueError(f"--replica-cpus {cpus:g}: {n} replica(s) need {n * cpus:g} CPUs, this machine's Ray instance "
                         f"has {have_cpus:g} (give fewer replicas or a smaller --replica-cpus)")


def replica_start_error(e: RuntimeError) -> str:
    """Why serve.run failed: the error a failed replica's constructor raised (e.g. a model that
    does not load), from Ray Serve's status, whose message for the deployment ends with that
    replica's traceback; else serve.run's own words."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments.values()
    except Exception:  # the controller is gone too: its words are all there is
        return str(e)
    for deployment in deployments:
        lines = [line.strip() for line in deployment.message.splitlines() if line.strip()]
        if deployment.status == "DEPLOY_FAILED" and lines:
            return f"a replica failed to start: {lines[-1]}"
    return str(e)


def main(argv: list[str] | None = None) -> None:
    import cli_args

    parser = build_parser()
    args = config_file.parse_args(parser, argv)
    try:
        the_plan = plan(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("taxirank").setLevel(args.log_level.upper())
    if args.ray_address is None:
        # A local instance's workers start from this process's environment: let them import
        # this checkout's modules as we do. On a cluster, install taxirank[ray] on every node.
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    try:
        if args.ray_address is None:  # Ray Serve's proxy binds the port here, once Ray has started
            for sock in cli_args.bind_address(args.host, args.port):
                sock.close()
        check_ray_address(args.ray_address)
        ray.init(address=args.ray_address, include_dashboard=False)
    except (ValueError, ConnectionError) as e:  # no cluster there ('auto': Ray's ConnectionError)
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    # A signal during start-up (replicas loading, or waiting for resources) stops it as Ctrl-C
    # does, as under server.py: serve.run waits for the replicas with no timeout.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stop = threading.Event()
    try:
        if args.ray_address is None:
            try:
                check_resources(the_plan, ray.cluster_resources())
            except ValueError as e:
                parser.exit(2, f"{parser.prog}: error: {e}\n")
        try:
            url = start(args, the_plan)
        except RuntimeError as e:  # the replicas failed to start: server.py's one line, not Ray's traceback
            parser.exit(2, f"{parser.prog}: error: {replica_start_error(e)}\n")
        except KeyboardInterrupt:
            log.info("stopped during start-up")
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        log.info("ready: %s  (%s)", url, "autoscaling" if "autoscaling_config" in the_plan.options
                 else f"{the_plan.options['num_replicas']} replicas")
        stop.wait()
        log.info("shutting down: the requests in flight get up to %g s to finish (--shutdown-timeout)",
                 args.shutdown_timeout)
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: do not wait out the grace period
            signal.signal(sig, signal.default_int_handler)
        try:
            drain(args.shutdown_timeout)
        except KeyboardInterrupt:
            log.info("shutting down now: aborting what is still in flight")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    # Through the module, not __main__: Ray pickles __main__'s classes by value, and the
    # replicas must see the same HttpRequest class as the router.
    import serve_ray

    serve_ray.main()
