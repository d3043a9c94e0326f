"""taxirank under Ray Serve (serve_ray.py): two replicas of the tiny model on a local Ray
instance that this module starts and stops. The same server tests run against it as
against server.py (imported from tests/test_server.py, so they are the same code), then
what only a fleet has: prefix routing, one /metrics for every replica, a replica killed
mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import http.server
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (the test extra has it)")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")

import serve_ray  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402
from test_server import (API_KEY, ROOT, SMALL, Server, client, request, scrape,  # noqa: E402,F401
                         test_api_key_missing_or_wrong_gets_401, test_bad_input_gets_a_clear_error_and_the_next_request_is_served,
                         test_chat_completion_whole_and_streamed, test_completion_carries_text_usage_and_length_finish,
                         test_health_and_models_list_the_served_model, test_logprobs_cover_each_sampled_token,
                         test_prompt_as_token_ids, test_seeded_sampling_is_reproducible,
                         test_stop_string_across_token_boundaries_is_cut_and_never_partly_streamed,
                         test_streamed_completion_equals_the_whole_one_and_ends_with_usage, test_too_long_says_both_numbers)


def free_port() -> int:
    """A free port that Ray will not take: Ray Serve's proxy binds it only once Ray is up, and
    Ray's own processes bind ports of the kernel's ephemeral range as they start, and its
    workers' default range (10002-19999), so a port of either could be gone by then."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except OSError:  # not Linux: the IANA range
        ephemeral = 49152
    # (a host whose ephemeral range starts lower has none outside it: any above Ray's then)
    candidates = range(20000, ephemeral) if ephemeral > 20100 else range(20000, 65536)
    for port in random.Random().sample(candidates, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {candidates}")


# The fleet's drain (the last test of the fixture's) lets its requests in flight finish
# within it; nothing else waits for it: a replica stops as soon as it has none.
SHUTDOWN_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """The Ray app, as a Server the imported tests can talk to."""
    # The replicas are Ray workers started from this process's environment: they import
    # this checkout's modules (and share the tests' JAX compilation cache) through it.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # Ray Serve kills its HTTP proxy when it is not ready within 5 s three times running
    # (then every test here errors): on 2 cores shared with the other test worker and its
    # compiles, the proxy's start-up alone took longer (measured in a CI run).
    # A replica whose constructor fails is tried once, not Ray Serve's 3 times (the last test's model)
    os.environ.setdefault("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
    # Ray's own metrics (every process exporting its gauges, Serve's per-request counters
    # and histograms in the proxy and the replicas) are read by nothing here: the fleet's
    # /metrics is the replicas' own text, merged by the Ingress. Off, the file took about
    # 5% less CPU (every Ray process included, back-to-back pairs: 76.0 -> 70.3 and 73.3 CPU-s).
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    port = free_port()
    args = serve_ray.build_parser().parse_args([*SMALL, "--num-replicas", "2", "--port", str(port),
                                                "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                                                "--api-key", API_KEY, "--no-warmup",
                                                "--enable-prompt-tokens-details"])
    the_plan = serve_ray.plan(args)
    ray.init(num_cpus=2, include_dashboard=False)  # before JAX starts its threads here: it forks
    try:
        # The replicas (and the two that replace killed ones) start without a warm-up: each
        # compiles, or loads from the compilation cache they share, only the programs its
        # requests run, not every bucket's. The tests send one request at a time until the
        # fleet tests, whose programs the earlier ones compiled: a program is compiled once,
        # by the first replica that runs it, and the other loads it from the cache.
        serve_ray.start(args, the_plan)
        yield Server(port, None, "")
    finally:
        serve_ray.serve.shutdown()
        ray.shutdown()


# ---- what only a fleet has -------------------------------------------------------------

def by_replica(samples: dict, name: str) -> dict[str, float]:
    """replica -> value of an unlabelled-per-replica metric in a fleet scrape."""
    return {dict(labels)["replica"]: v for (n, labels), v in samples.items() if n == "taxirank:" + name}


def post(server: Server, body: dict) -> tuple[int, dict, str]:
    """POST /v1/completions: (status, JSON body, the replica that answered)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read()), resp.getheader(serve_ray.REPLICA_HEADER)
    finally:
        conn.close()


def wait_for(cond, what: str, timeout: float = 600.0, every: float = 0.2, at_most: float = 1.0) -> None:
    """Polls `cond` until true; the interval grows from `every` to `at_most`. Most conditions
    here scrape /metrics, which costs the Ingress and every replica CPU each time (parsing
    and merging their text): a replacement replica takes seconds to start, and polls at a
    fixed 0.2 s would spend that CPU while it starts."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not reached: {what}"
        time.sleep(every)
        every = min(every * 1.5, at_most)


def two_replicas_announced(server: Server) -> dict[str, float]:
    wait_for(lambda: len(by_replica(scrape(server), "num_kv_blocks")) == 2, "both replicas in /metrics")
    return by_replica(scrape(server), "num_kv_blocks")


def test_one_metrics_scrape_sees_every_replica_by_label(server: Server) -> None:
    replicas = two_replicas_announced(server)
    samples = scrape(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count"):
        assert set(by_replica(samples, name)) == set(replicas), name


SYSTEM = "You are the dispatcher of a taxi rank. Answer in one short sentence, naming the rank. " * 3


def test_prompts_sharing_a_prefix_go_to_the_replica_that_holds_it(server: Server) -> None:
    two_replicas_announced(server)
    first = post(server, {"prompt": SYSTEM + "Where is the rank?", "max_tokens": 2})
    assert first[0] == 200
    for question in ("How far is it?", "Is it open at night?", "Who runs it?"):
        status, body, replica = post(server, {"prompt": SYSTEM + question, "max_tokens": 2})
        assert (status, replica) == (200, first[2])
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // 16 * 16 - 16


def test_reset_prefix_cache_reaches_every_replica(server: Server) -> None:
    two_replicas_announced(server)
    assert request(server, "POST", "/reset_prefix_cache")[0] == 200
    status, body, _ = post(server, {"prompt": SYSTEM + "Where is the rank?", "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # its query goes to each replica too: vLLM's reset_running_requests, and a refusal
    assert request(server, "POST", "/reset_prefix_cache?reset_running_requests=true")[0] == 200
    status, body = request(server, "POST", "/reset_prefix_cache?reset_running_requests=maybe")
    assert status == 400 and "boolean" in body["error"]["message"], body


@contextlib.contextmanager
def streaming(server: Server, body: dict) -> Iterator[dict]:
    """A streaming completion read on a thread: `state` has the replica once the head is in,
    `events` as they come, `done` once the stream ended."""
    state: dict = {"events": [], "done": threading.Event(), "replica": None, "head": threading.Event()}

    def read() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                         {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            resp = conn.getresponse()
            state["status"], state["replica"] = resp.status, resp.getheader(serve_ray.REPLICA_HEADER)
            state["head"].set()
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    state["events"].append(json.loads(line[6:]))
        finally:
            conn.close()
            state["head"].set()
            state["done"].set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        thread.join(600)


def replica_pid(replica: str) -> int:
    actor = ray.get_actor(f"SERVE_REPLICA::{serve_ray.APP_NAME}#Engine#{replica}", namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def test_a_killed_replica_fails_its_requests_cleanly_the_other_serves_on_and_it_comes_back(server: Server) -> None:
    replicas = set(two_replicas_announced(server))
    # Two prompts held by different replicas: prefix routing then keeps each on its own.
    homes: dict[str, str] = {}
    for i in range(40):
        prompt = f"Rank {i}: " + SYSTEM
        status, _, replica = post(server, {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        homes.setdefault(replica, prompt)
        if len(homes) == 2:
            break
    assert len(homes) == 2, "40 fresh prompts all went to one replica: the router does not balance"
    victim, survivor = sorted(homes)
    long = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    short = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with contextlib.ExitStack() as stack:
        doomed = [stack.enter_context(streaming(server, {"prompt": homes[victim] + f" {i}"} | long)) for i in range(2)]
        spared = [stack.enter_context(streaming(server, {"prompt": homes[survivor] + f" {i}"} | short))
                  for i in range(2)]
        wait_for(lambda: all(s["events"] or s["done"].is_set() for s in doomed + spared), "every stream under way",
                 at_most=0.2)
        assert [(s["status"], s["replica"]) for s in doomed + spared] == [(200, victim)] * 2 + [(200, survivor)] * 2
        assert not any(s["done"].is_set() for s in doomed)
        killed = time.monotonic()
        os.kill(replica_pid(victim), signal.SIGKILL)
        wait_for(lambda: all(s["done"].is_set() for s in doomed), "the victim's streams ended", at_most=0.2)
        failed = time.monotonic() - killed
        for s in doomed:  # a clear error event, after the tokens that made it out
            last = s["events"][-1]
            assert s["status"] == 200 and "replica serving this request failed" in last["error"]["message"], last
        wait_for(lambda: all(s["done"].is_set() for s in spared), "the survivor's streams ended", at_most=0.2)
    for s in spared:
        assert s["events"][-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in s["events"])
    # The fleet serves on while the victim is replaced.
    status, _, replica = post(server, {"prompt": "still there?", "max_tokens": 2})
    assert (status, replica) == (200, survivor)
    wait_for(lambda: len(fleet := by_replica(scrape(server), "num_kv_blocks")) == 2 and set(fleet) != replicas,
             "a new replica in /metrics")
    back = time.monotonic() - killed
    assert victim not in by_replica(scrape(server), "num_kv_blocks")

    def idle() -> bool:
        samples = scrape(server)
        return all(set(by_replica(samples, name).values()) == {0.0}
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    wait_for(idle, "every replica's running, waiting and KV usage back to 0")
    print(f"\nkilled replica: its streams ended with an error {failed:.2f} s after the kill; "
          f"a replacement was serving {back:.1f} s after it")



def test_a_replica_whose_engine_loop_dies_fails_its_health_check_and_is_replaced(server: Server) -> None:
    two_replicas_announced(server)
    prompt = "Engine room: " + SYSTEM
    status, _, victim = post(server, {"prompt": prompt, "max_tokens": 1})
    assert status == 200

    def break_the_engine(replica_actor: object) -> None:  # runs inside the replica's process
        from ray import serve as ray_serve

        def step() -> None:
            raise RuntimeError("injected: the device fell over")
        ray_serve.get_replica_context().servable_object.engine.engine.step = step

    actor = ray.get_actor(f"SERVE_REPLICA::{serve_ray.APP_NAME}#Engine#{victim}", namespace="serve")
    ray.get(actor.__ray_call__.remote(break_the_engine))
    status, body, replica = post(server, {"prompt": prompt + " again", "max_tokens": 4})  # the prefix's home
    assert (status, replica) == (500, victim) and body["error"]["type"] == "InternalServerError", body
    wait_for(lambda: len(fleet := by_replica(scrape(server), "num_kv_blocks")) == 2 and victim not in fleet,
             "Ray Serve replaced the replica whose engine died")
    assert post(server, {"prompt": prompt, "max_tokens": 2})[0] == 200

# ---- flags, and the plain install ------------------------------------------------------

def test_fleet_flags_become_deployment_options_and_bad_combinations_are_refused() -> None:
    def plan(*flags: str) -> serve_ray.Plan:
        return serve_ray.plan(serve_ray.build_parser().parse_args(["--model", "tiny", *flags]))

    fixed = plan("--num-replicas", "3", "--max-num-seqs", "8")
    assert fixed.options["num_replicas"] == 3 and fixed.options["max_ongoing_requests"] == 16
    assert fixed.options["request_router_config"].request_router_kwargs == {"imbalanced_threshold": 8}
    assert fixed.options["graceful_shutdown_timeout_s"] == 30.0  # server.py's --shutdown-timeout default
    assert plan("--shutdown-timeout", "2.5").options["graceful_shutdown_timeout_s"] == 2.5
    # A replica must be sent more than it runs and lets wait, or --max-waiting-requests's 503 never comes
    for waiting in ("1", "4", "16"):
        assert plan("--max-num-seqs", "4", "--max-waiting-requests", waiting).options["max_ongoing_requests"] \
            >= 4 + int(waiting) + 1
    assert plan("--max-num-seqs", "4", "--max-waiting-requests", "16",
                "--max-ongoing-requests", "6").options["max_ongoing_requests"] == 6  # as asked
    auto = plan("--min-replicas", "1", "--max-replicas", "4", "--target-ongoing-requests", "6")
    assert "num_replicas" not in auto.options
    scaling = auto.options["autoscaling_config"]
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 4, 6)
    default = plan("--max-replicas", "2", "--max-num-seqs", "8").options["autoscaling_config"]
    assert default.target_ongoing_requests == 8  # --max-num-seqs
    assert "request_router_config" not in plan("--routing", "power-of-two").options  # Ray Serve's default
    for gpus, tp in (("0", "2"), ("0.5", "1"), ("2", "2"), ("4", "2")):  # CPU replicas, a shared GPU, enough GPUs
        assert plan("--replica-gpus", gpus, "--tensor-parallel-size", tp).options["ray_actor_options"]["num_gpus"] \
            == float(gpus)
    for flags, says in [(("--num-replicas", "2", "--max-replicas", "3"), "one or the other"),
                        (("--target-ongoing-requests", "4"), "needs autoscaling"),
                        (("--min-replicas", "3", "--max-replicas", "2"), "min-replicas"),
                        (("--routing", "power-of-two", "--imbalanced-threshold", "2"), "prefix only"),
                        (("--num-replicas", "0"), "num-replicas must be >= 1"),
                        (("--replica-gpus", "-1"), "replica-gpus must be a finite number >= 0"),
                        (("--replica-gpus", "nan"), "replica-gpus must be a finite number >= 0"),
                        # no node has infinitely many: the replica would wait for one forever
                        (("--replica-gpus", "inf"), "replica-gpus must be a finite number >= 0"),
                        (("--replica-cpus", "inf"), "replica-cpus must be a finite number >= 0"),
                        (("--max-replicas", "2", "--target-ongoing-requests", "inf"), "finite number > 0"),
                        (("--max-replicas", "2", "--target-ongoing-requests", "nan"), "finite number > 0"),
                        # 0 is no target (not the default's stand-in), negative neither, with autoscaling or not
                        (("--max-replicas", "2", "--target-ongoing-requests", "0"), "finite number > 0, got 0.0"),
                        (("--max-replicas", "2", "--target-ongoing-requests", "-1"), "finite number > 0, got -1.0"),
                        (("--target-ongoing-requests", "0"), "finite number > 0, got 0.0"),
                        (("--host", "no-such-host.invalid"), "--host 'no-such-host.invalid' does not resolve"),
                        (("-dp", "2"), "run replicas instead: serve_ray.py --num-replicas"),
                        (("-pp", "2"), "does not support pipeline parallelism"),
                        (("--distributed-executor-backend", "ray"), "supports only uni"),
                        (("-tp", "2", "--replica-gpus", "1"), "fewer GPUs than --tensor-parallel"),
                        (("--replica-gpus", "1", "--tensor-parallel-size", "2"), "fewer GPUs than --tensor-parallel"),
                        (("--replica-gpus", "0.5", "--tensor-parallel-size", "2"), "fewer GPUs than --tensor-parallel"),
                        (("--replica-gpus", "2.5", "--tensor-parallel-size", "2"), "whole number"),
                        (("--shutdown-timeout", "-1"), "shutdown-timeout must be a finite number of seconds >= 0"),
                        (("--shutdown-timeout", "inf"), "shutdown-timeout must be a finite number of seconds >= 0"),
                        (("--port", "0"), "fixed port"),
                        (("--distributed-coordinator", "h:1", "--num-processes", "2"),
                         "--num-processes 2: multi-host replicas are not supported under Ray Serve"),
                        (("--distributed-coordinator", "h:1"),  # named, whichever of the two was given
                         "--distributed-coordinator 'h:1': multi-host replicas are not supported"),
                        (("--max-num-seqs", "0"), "max_num_seqs"),
                        (("--enable-auto-tool-choice",), "requires --tool-call-parser"),
                        (("--enable-log-outputs",), "--enable-log-outputs requires --enable-log-requests"),
                        # server.py's check before the model loads; else each replica's start fails on it
                        (("--default-chat-template-kwargs", '{"add_generation_prompt": false}'),
                         "--default-chat-template-kwargs may not set add_generation_prompt"),
                        (("--uds", "/tmp/x.sock"), "--uds is not supported under Ray Serve"),
                        (("--api-key", "k", ""), "--api-key: a key must be a non-empty string"),
                        (("--ssl-certfile", "c.pem"), "--ssl-certfile is not supported under Ray Serve"),
                        # server.py refuses it without a certificate; here it would ask clients for none
                        (("--ssl-cert-reqs", "2"), "--ssl-cert-reqs is not supported under Ray Serve")]:
        with pytest.raises(ValueError, match=says):
            plan(*flags)
    plan("--ssl-cert-reqs", "0")  # no client certificates: what the proxy does
    helps = {a.dest: a.help for a in serve_ray.build_parser()._actions}
    assert [f for f in ("uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs")
            if not helps[f].startswith("refused under Ray Serve")] == []  # --help promises nothing it refuses
    with pytest.raises(SystemExit) as exit_:  # main says so before it starts Ray
        serve_ray.main(["--model", "tiny", "--port", "0"])
    assert exit_.value.code == 2


def test_a_replica_relays_more_concurrent_requests_than_aiohttps_default_pool() -> None:
    """Ray lets max_ongoing_requests (2 x --max-num-seqs) reach a replica: every one of
    them must reach its app, not wait in the relay's connection pool (100 by default)."""
    from aiohttp import web

    async def main() -> None:
        n, inside, all_in = 150, 0, asyncio.Event()

        async def hold(request: web.Request) -> web.Response:
            nonlocal inside
            inside += 1
            if inside == n:
                all_in.set()
            await all_in.wait()  # answered only once all n are inside at the same time
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/v1/completions", hold)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        session = serve_ray.relay_session()

        async def relay() -> str:
            async with session.post(url, data=b"{}") as resp:
                return await resp.text()
        try:
            assert await asyncio.wait_for(asyncio.gather(*(relay() for _ in range(n))), 60) == ["ok"] * n
        finally:
            await session.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_response_is_named_by_the_clients_x_request_id_or_else_by_ray_serves(server: Server) -> None:
    """Ray Serve's proxy gives a request sent without an X-Request-Id its own (a uuid4, sent back
    as the response's header); a client's own id, dashed uuid4 or not, names its response as
    under server.py."""
    for path, prefix, body in (("/v1/completions", "cmpl-", {"prompt": "Where is the rank?"}),
                               ("/v1/chat/completions", "chatcmpl-",
                                {"messages": [{"role": "user", "content": "Where is the rank?"}]})):
        for header in (None, "rank-7", "3f2b8c1e-9a4d-4e6f-8b2a-1c5d7e9f0a3b"):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            try:
                conn.request("POST", path, json.dumps(body | {"max_tokens": 1}),
                             {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
                             | ({"X-Request-Id": header} if header else {}))
                resp = conn.getresponse()
                answer = json.loads(resp.read())
            finally:
                conn.close()
            assert resp.status == 200, answer
            assert answer["id"] == prefix + (header or resp.getheader("x-request-id")), (path, header, answer)


def test_a_relayed_answer_carries_one_date_and_one_server_header(server: Server) -> None:
    """Ray Serve's proxy (uvicorn) sets Date and Server on every response; a replica's app
    sets its own, which must not go out beside them (Date is a field HTTP allows once)."""
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", b"{bad"),
                               ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}'), ("GET", "/metrics", None)):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            conn.request(method, path, body, {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        names = [k.lower() for k, _ in resp.getheaders()]
        assert (names.count("date"), names.count("server")) == (1, 1), (method, path, resp.getheaders())


def test_an_address_where_no_ray_cluster_listens_is_one_error_line_not_a_wait() -> None:
    """ray.init retries such an address in its GCS client's reconnect loop for many minutes."""
    port = free_port()  # bound and closed again: nothing listens there
    out = subprocess.run([sys.executable, "serve_ray.py", "--model", "tiny", "--ray-address", f"127.0.0.1:{port}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900,  # a guard only: it answers in seconds
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith(f"serve_ray.py: error: --ray-address 127.0.0.1:{port}: "), out.stderr
    assert "Traceback" not in out.stderr


def test_a_port_that_speaks_no_grpc_is_no_ray_cluster_and_the_clusters_own_gcs_is(server: Server) -> None:
    """The address check asks in HTTP/2 as Ray's GCS client would: the running cluster's GCS
    passes, and a port where an HTTP/1 server (the dashboard's kind), a silent server, or one
    that hangs up listens is an error (the silent one's after timeout_s), not ray.init's
    reconnect loop."""
    serve_ray.check_ray_address(ray.get_runtime_context().gcs_address)

    class Http1(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass
    http1 = http.server.HTTPServer(("127.0.0.1", 0), Http1)
    threading.Thread(target=http1.serve_forever, daemon=True).start()
    quiet, closing = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:  # having read what it was sent (unread, the close would be a reset)
        conn, _ = closing.accept()
        conn.recv(1024)
        conn.close()
    threading.Thread(target=hang_up, daemon=True).start()
    try:
        for listener, said in ((http1.socket, "but no Ray cluster (a Ray address speaks gRPC; it answered b'"),
                               (quiet, "no Ray cluster answers there ("),
                               (closing, "it closed the connection; a cluster under TLS needs RAY_USE_TLS=1")):
            address = f"127.0.0.1:{listener.getsockname()[1]}"
            with pytest.raises(ValueError, match=re.escape(said)) as e:
                serve_ray.check_ray_address(address, timeout_s=1.0)
            assert str(e.value).startswith(f"--ray-address {address}: "), e.value
    finally:
        http1.shutdown()
        http1.server_close()
        quiet.close()
        closing.close()


def test_the_drain_lets_the_requests_in_flight_finish_within_the_shutdown_timeout(server: Server) -> None:
    """server.py's drain, as main() runs it on SIGTERM (serve_ray.drain): the requests in
    flight get up to --shutdown-timeout (the fixture's) to finish. serve.shutdown alone
    stops Ray Serve's proxy first, which dropped every open connection at once.
    The fixture's fleet's last test: it deletes its application."""
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with contextlib.ExitStack() as stack:
        streams = [stack.enter_context(streaming(server, {"prompt": f"rank {i}"} | body)) for i in range(3)]
        wait_for(lambda: all(s["events"] or s["done"].is_set() for s in streams), "every stream under way",
                 at_most=0.2)
        serve_ray.drain(SHUTDOWN_TIMEOUT)
    for s in streams:
        assert s["status"] == 200 and s["events"][-1]["choices"][0]["finish_reason"] == "length", s["events"][-1:]
    assert serve_ray.APP_NAME not in serve_ray.serve.status().applications


def test_a_model_the_replicas_cannot_load_is_one_error_line_naming_the_replicas_error(
        server: Server, tmp_path, monkeypatch, capsys) -> None:
    """server.py exits 2 with one line when the engine cannot be built (a model that does not
    load); under Ray Serve that happens in each replica's constructor, and serve.run says only
    that the deployment failed: the line must name the replica's error. After the drain: it
    deploys in the fixture's application's place (one try a replica: the fixture's
    RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT)."""
    model = tmp_path / "nothing"
    argv = ["--model", str(model), "--port", str(free_port())]
    args = serve_ray.build_parser().parse_args(argv)
    with pytest.raises(RuntimeError) as failed:
        serve_ray.start(args, serve_ray.plan(args))

    def start(*_: Any) -> str:  # main() on the same failure, Ray itself already up here
        raise failed.value
    monkeypatch.setattr(serve_ray.ray, "init", lambda **_: None)
    monkeypatch.setattr(serve_ray, "start", start)
    monkeypatch.setattr(serve_ray.ray, "shutdown", lambda: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            serve_ray.main(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert e.value.code == 2
    err = capsys.readouterr().err
    # Ray Serve runs a replica's __del__ after its constructor raised too: no traceback of its own
    assert "object has no attribute" not in err, err[-3000:]
    said = [line for line in err.splitlines() if ": error: " in line]  # (Ray's logs beside it)
    assert len(said) == 1 and (f": error: a replica failed to start: FileNotFoundError: model '{model}' is neither "
                               "a built-in model") in said[0], said


def test_a_port_another_process_holds_is_one_error_line_before_ray_starts(monkeypatch, capsys) -> None:
    """Ray Serve's proxy binds --port only once Ray and the proxy actor have started (a port
    another process holds is a RayTaskError from serve.start there): the driver checks it first."""
    def no_ray(**_: object) -> None:
        raise AssertionError("ray.init was called")
    monkeypatch.setattr(serve_ray.ray, "init", no_ray)
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            serve_ray.main(["--model", "tiny", "--port", str(port)])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(  # after the program's name
        f": error: --host 127.0.0.1 --port {port}: cannot listen there: Address already in use "
        "(is another server running there?)")


def test_a_signal_while_the_replicas_start_stops_the_driver(monkeypatch) -> None:
    """serve.run waits for the replicas with no timeout (a model loading, replicas waiting
    for resources): SIGTERM or Ctrl-C then must stop it, and Serve and Ray be shut down,
    as server.py stops during start-up."""
    calls: list[str] = []

    def slow_start(args: Any, the_plan: Any) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)  # a guard only: the signal interrupts it
        calls.append("started")
        return "http://unused"
    monkeypatch.setattr(serve_ray.ray, "init", lambda **_: calls.append("init"))
    monkeypatch.setattr(serve_ray.ray, "cluster_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr(serve_ray, "start", slow_start)
    monkeypatch.setattr(serve_ray.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve_ray.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve_ray.main(["--model", "tiny", "--port", str(free_port())])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert calls == ["init", "serve.shutdown", "ray.shutdown"]


def test_replicas_a_local_ray_instance_cannot_place_are_one_error_line_not_a_wait(monkeypatch, capsys) -> None:
    """A local Ray instance's resources are all it will have: replicas that do not fit would
    wait to be scheduled forever (serve.run with them)."""
    def fits(resources: dict[str, float], *flags: str) -> bool:
        the_plan = serve_ray.plan(serve_ray.build_parser().parse_args(["--model", "tiny", *flags]))
        try:
            serve_ray.check_resources(the_plan, resources)
        except ValueError:
            return False
        return True

    two_cpus, one_gpu = {"CPU": 2.0}, {"CPU": 16.0, "GPU": 1.0}
    assert fits(two_cpus, "--num-replicas", "2") and not fits(two_cpus, "--num-replicas", "3")
    assert fits(two_cpus, "--num-replicas", "4", "--replica-cpus", "0.5")
    assert not fits(two_cpus, "--replica-cpus", "3")
    assert fits(two_cpus, "--min-replicas", "0", "--max-replicas", "8")  # starts one (on the first request)
    assert not fits(two_cpus, "--min-replicas", "3", "--max-replicas", "8")
    assert not fits(two_cpus, "--replica-gpus", "1") and fits(one_gpu, "--replica-gpus", "1")
    assert not fits(one_gpu, "--num-replicas", "2", "--replica-gpus", "1")
    # fractions of one GPU share it by size: two halves or three thirds fit on one, three 0.4s do not
    assert fits(one_gpu, "--num-replicas", "2", "--replica-gpus", "0.5")
    assert fits(one_gpu, "--num-replicas", "3", "--replica-gpus", "0.333333")
    assert not fits(one_gpu, "--num-replicas", "3", "--replica-gpus", "0.4")
    assert not fits({"CPU": 16.0, "GPU": 2.0}, "--num-replicas", "3", "--replica-gpus", "0.6")
    assert fits({"CPU": 16.0, "GPU": 4.0}, "--num-replicas", "2", "--replica-gpus", "2")

    calls: list[str] = []
    monkeypatch.setattr(serve_ray.ray, "init", lambda **_: calls.append("init"))
    monkeypatch.setattr(serve_ray.ray, "cluster_resources", lambda: dict(two_cpus))
    monkeypatch.setattr(serve_ray, "start", lambda *_: calls.append("started"))
    monkeypatch.setattr(serve_ray.serve, "shutdown", lambda: calls.append("serve.shutdown"))
    monkeypatch.setattr(serve_ray.ray, "shutdown", lambda: calls.append("ray.shutdown"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            serve_ray.main(["--model", "tiny", "--port", str(free_port()), "--replica-gpus", "1"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert e.value.code == 2 and calls == ["init", "serve.shutdown", "ray.shutdown"]
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(  # after the program's name
        ": error: --replica-gpus 1: this machine's Ray instance has 0 GPU(s), room for 0 of the 1 "
        "replica(s) (give fewer replicas, or --ray-address a cluster that has them)")


def test_server_py_never_imports_ray() -> None:
    code = "import sys, server; assert not [m for m in sys.modules if m.split('.')[0] == 'ray'], 'ray imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env=os.environ | {"PYTHONPATH": str(ROOT)})


# ---- the routing policy alone ----------------------------------------------------------

@dataclass
class FakeReplica:
    replica_id: str
    max_ongoing_requests: int = 16


class FakeQueueLengths(dict):
    def get(self, replica_id: str) -> int | None:  # Ray Serve's cache: None when it does not know
        return super().get(replica_id)


def pending(prompt: str, cache_salt: str | None = None) -> PendingRequest:
    body = json.dumps({"prompt": prompt} | ({"cache_salt": cache_salt} if cache_salt else {})).encode()
    request = serve_ray.HttpRequest("POST", "/v1/completions", (), body, *serve_ray.routing_prompt(body))
    return PendingRequest(args=[request], kwargs={}, metadata=None, future=None)


def routed(router: serve_ray.PrefixAffinityRouter, replicas: list[FakeReplica], prompt: str,
           cache_salt: str | None = None) -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, pending(prompt, cache_salt)))
    assert len(ranks[0]) == 1 and {r.replica_id for rank in ranks for r in rank} == {r.replica_id for r in replicas}
    return ranks[0][0].replica_id


def test_router_follows_the_longest_held_prefix_until_its_queue_runs_ahead_then_the_least_loaded() -> None:
    router = serve_ray.PrefixAffinityRouter.__new__(serve_ray.PrefixAffinityRouter)
    router.initialize_state(imbalanced_threshold=2)
    router._replica_queue_len_cache = queue = FakeQueueLengths(a=0, b=1, c=5)
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    assert routed(router, replicas, "fresh " * 40) == "a"  # nothing held anywhere: the shortest queue
    router.held.clear()
    router._record("c", router._chunk_hashes(pending(SYSTEM)))
    queue.update(a=0, b=0, c=1)
    assert routed(router, replicas, SYSTEM + "one") == "c"  # held by c, within the threshold
    queue["c"] = 3  # now 3 ahead of the shortest: load wins
    second = routed(router, replicas, SYSTEM + "two")
    assert second in {"a", "b"}  # which now holds the prefix too
    queue.update(a=1, b=1)
    del queue["c"]  # unknown counts as idle
    assert routed(router, replicas, SYSTEM + "three") == "c"
    queue["c"] = 1
    assert routed(router, replicas, "x" * 10) in {"a", "b", "c"}  # too short to match: the least loaded
    assert routed(router, replicas, SYSTEM + "four") in {"c", second}  # a holder, never the third replica


def test_router_credits_a_held_prefix_only_to_requests_of_the_same_cache_salt() -> None:
    """A replica shares a salted prompt's blocks only with the same salt (vLLM's cache_salt):
    holding the prefix under another salt, or none, is holding nothing."""
    router = serve_ray.PrefixAffinityRouter.__new__(serve_ray.PrefixAffinityRouter)
    router.initialize_state(imbalanced_threshold=2)
    router._replica_queue_len_cache = FakeQueueLengths(a=0, b=1, c=1)
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router._record("b", router._chunk_hashes(pending(SYSTEM, "tenant-1")))
    router._record("c", router._chunk_hashes(pending(SYSTEM)))
    assert routed(router, replicas, SYSTEM + "one", "tenant-1") == "b"
    assert routed(router, replicas, SYSTEM + "one", "tenant-2") == "a"  # held by nobody: the shortest queue
    assert routed(router, replicas, SYSTEM + "one") == "c"


class FakeEngines:
    """What the Ingress holds of the Engine deployment (a handle), answering each relayed
    request with make(request): the Ingress alone, without Ray."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def options(self, **_: Any) -> FakeEngines:
        return self

    @property
    def handle(self) -> FakeEngines:
        return self

    def remote(self, request: serve_ray.HttpRequest) -> Any:
        return self.make(request)


class Parts:
    """A DeploymentResponseGenerator that yields these parts (the head first), then ends."""

    def __init__(self, *parts: Any) -> None:
        self.parts = list(parts)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.parts:
            raise StopAsyncIteration
        return self.parts.pop(0)


def test_a_stream_whose_client_left_before_its_first_chunk_is_cancelled_at_the_replica() -> None:
    """The Ingress relays an SSE stream through an async generator; a client gone before the
    body starts (starlette's disconnect listener wins, or the first send fails) means that
    generator never runs, so its `finally` cannot cancel the replica's request: the response
    itself must, or the request holds its engine slot to its last token."""
    cancelled = []

    class Responses:  # a DeploymentResponseGenerator: the head, then an event that never comes
        async def __anext__(self):
            if not hasattr(self, "head"):
                self.head = True
                return serve_ray.HttpHead(200, (("content-type", "text/event-stream"),))
            await asyncio.sleep(3600)

        def __aiter__(self):
            return self

        def cancel(self) -> None:
            cancelled.append(True)

    async def run(spec_version: str) -> None:
        from starlette.requests import Request

        ingress = serve_ray.Ingress.func_or_class(FakeEngines(lambda _request: Responses()))
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": [],
                 "asgi": {"spec_version": spec_version}}

        async def receive() -> dict:
            return {"type": "http.disconnect"} if body_read else body_read.append(1) or {
                "type": "http.request", "body": b'{"prompt": "hi", "stream": true}', "more_body": False}

        async def send(message: dict) -> None:  # the client is gone
            await asyncio.sleep(0.05)
            raise OSError("connection reset")
        body_read: list[int] = []
        response = await ingress(Request(scope, receive))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(response(scope, receive, send), 10)
        await ingress.session.close()

    for spec_version in ("2.0", "2.4"):  # starlette's two ways of streaming
        cancelled.clear()
        asyncio.run(run(spec_version))
        assert cancelled, spec_version


def test_the_ingress_refuses_a_body_over_the_limit_before_it_reaches_a_replica() -> None:
    """server.py's 413 (aiohttp's client_max_size), given by the Ingress itself: from the
    Content-Length before a byte is read, else once the body read so far is over the
    limit; it is neither held whole in the Ingress nor relayed. A body within the limit is
    relayed as it came; a client gone mid-body is no error."""
    from starlette.requests import Request

    from cors import CorsPolicy
    from protocol import MAX_BODY_BYTES

    relayed: list[serve_ray.HttpRequest] = []

    async def call(headers: list[tuple[bytes, bytes]], messages: list[dict],
                   cors: CorsPolicy = CorsPolicy()) -> tuple[int, bytes, int]:
        """(status, body, messages left unread); the answer's headers go to answered"""
        engines = FakeEngines(lambda request: relayed.append(request) or Parts(serve_ray.HttpHead(200, ()), b"ok"))
        ingress = serve_ray.Ingress.func_or_class(engines, cors)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": headers}

        async def receive() -> dict:
            assert messages, "read past the body"
            return messages.pop(0)
        try:
            response = await ingress(Request(scope, receive))
        finally:
            await ingress.session.close()
        answered.append({k.lower(): v for k, v in response.headers.items()})
        return response.status_code, response.body, len(messages)

    answered: list[dict[str, str]] = []
    mib = {"type": "http.request", "body": b" " * 2**20, "more_body": True}
    too_large = f"Maximum request body size {MAX_BODY_BYTES} exceeded.".encode()
    status, body, unread = asyncio.run(call([(b"content-length", str(10**9).encode())], [mib] * 3))
    assert (status, unread) == (413, 3) and too_large in body, body
    last = {"type": "http.request", "body": b"", "more_body": False}
    status, body, unread = asyncio.run(call([], [mib] * 6 + [last]))  # read up to the first MiB past the limit
    assert (status, unread) == (413, 7 - MAX_BODY_BYTES // 2**20 - 1) and too_large in body, body
    assert not relayed
    small = b'{"prompt": "hi"}'
    status, body, _ = asyncio.run(call([(b"content-length", b"%d" % len(small))],
                                       [{"type": "http.request", "body": small[:5], "more_body": True},
                                        {"type": "http.request", "body": small[5:], "more_body": False}]))
    assert (status, body) == (200, b"ok") and [r.body for r in relayed] == [small]
    status, _, _ = asyncio.run(call([], [{"type": "http.request", "body": b"{", "more_body": True},
                                         {"type": "http.disconnect"}]))
    assert status == 499 and len(relayed) == 1
    # The Ingress's own answers carry server.py's CORS headers (--allowed-origins ...): a
    # browser reads its 413 as it reads a replica's answers.
    for cors, origin, want in [(CorsPolicy(), b"https://a.example", "*"),
                               (CorsPolicy(origins=["https://a.example"]), b"https://a.example", "https://a.example"),
                               (CorsPolicy(origins=["https://a.example"]), b"https://b.example", None)]:
        status, _, _ = asyncio.run(call([(b"content-length", str(10**9).encode()), (b"origin", origin)], [mib], cors))
        assert status == 413 and answered[-1].get("access-control-allow-origin") == want, answered[-1]
        assert answered[-1]["vary"] == "Origin"


def test_the_ingress_routes_under_root_path_and_sends_a_replicas_redirect_to_the_clients_host() -> None:
    """--root-path under Ray Serve: the Ingress relays every path as it came (each replica's
    app strips the prefix), answers /metrics under the prefix itself, and a replica's 307
    (its app's trailing-slash redirect, which names the replica's own address: Host is not
    relayed) goes out naming the address the client called."""
    from starlette.requests import Request

    from cors import CorsPolicy

    relayed: list[serve_ray.HttpRequest] = []

    def answer(request: serve_ray.HttpRequest) -> Responses:
        relayed.append(request)
        return Parts(serve_ray.HttpHead(307, (("location", "http://10.0.0.7:40123/llm/v1/models?x=1"),)))

    async def call(method: str, path: str, query: bytes = b"") -> Any:
        ingress = serve_ray.Ingress.func_or_class(FakeEngines(answer), CorsPolicy(), "/llm")
        scope = {"type": "http", "method": method, "path": path, "query_string": query, "scheme": "https",
                 "headers": [(b"host", b"proxy.example:8443")]}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}
        try:
            return await ingress(Request(scope, receive))
        finally:
            await ingress.session.close()

    response = asyncio.run(call("GET", "/llm/v1/models/", b"x=1"))
    assert response.status_code == 307
    assert response.headers["location"] == "https://proxy.example:8443/llm/v1/models?x=1"
    assert [r.path for r in relayed] == ["/llm/v1/models/?x=1"]
    response = asyncio.run(call("GET", "/llm/metrics"))  # the fleet's (no replica announced yet: none)
    assert response.status_code == 200 and response.body == b"" and len(relayed) == 1
    assert asyncio.run(call("GET", "/llmx/metrics")).status_code == 307 and len(relayed) == 2  # not under it
