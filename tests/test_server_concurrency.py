"""Concurrency over HTTP: streams in flight together each get exactly the tokens
LLM.generate gives for the same requests (greedy and seeded), and a stopping server
answers 503.

The server runs a tokenizer-less checkpoint, so the completions' logprobs name each
token by id ("token_id:N"): the streamed ids are compared exactly, not through text."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import open_stream, request

from async_engine import AsyncEngine
from engine import EngineConfig, EngineRequest, SamplingParams
from llm import LLM

PROMPTS = [[1, 5, 7, 9], [1, 42], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 30],
           [1, 8, 16, 32, 64, 128], [1, 100, 101], [1, 2], [1, 77, 66, 55, 44], [1, 250, 251, 252]]
# 8 requests over 4 slots: some wait, join mid-flight, share steps with prefills.
BODIES = [dict(prompt=p, max_tokens=12 + 3 * i, ignore_eos=True, logprobs=0,
               **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": 1000 + i}))
          for i, p in enumerate(PROMPTS)]
# tiny_async_engine's shapes (their programs compiled once in a run, by many files): two
# seats, as each test below uses at most; its requests of a few tokens fit 128.
TWO = dict(model="tiny", max_num_seqs=2, max_model_len=128, warmup=False)


def stream_ids(server, body: dict) -> tuple[list[int], str]:
    """One streamed completion: its token ids (from the logprobs) and finish reason."""
    ids, reason = [], None
    with open_stream(server, body) as events:
        for ev in events:
            choice = ev["choices"][0]
            ids += [int(t.removeprefix("token_id:")) for t in (choice["logprobs"] or {}).get("tokens", [])]
            reason = choice["finish_reason"] or reason
    return ids, reason


def test_concurrent_streams_each_get_exactly_what_llm_generate_gives(hf_checkpoint, hf_server):
    path = hf_checkpoint("llama2")
    # The server's shapes (so its programs come from the compilation cache this run
    # fills), but all eight requests queued at once: other batches than the server's.
    ref = LLM(path, log=lambda *_: None, max_num_seqs=4, enable_chunked_prefill=True, max_model_len=128,
              max_num_batched_tokens=128, num_kv_blocks=64, warmup=False).generate(PROMPTS, [SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"],
                                                              top_p=b.get("top_p", 1.0), seed=b.get("seed"),
                                                              ignore_eos=True) for b in BODIES])
    with ThreadPoolExecutor(len(BODIES)) as pool:
        got = list(pool.map(lambda b: stream_ids(hf_server, b), BODIES))
    status, metrics = request(hf_server, "GET", "/metrics", key=None)
    assert [reason for _, reason in got] == ["length"] * len(BODIES)
    assert [ids for ids, _ in got] == [o.outputs[0].token_ids for o in ref]
    assert status == 200 and re.search(r'^taxirank:num_requests_running\{[^}]*model_name=[^}]*\} 0\.0$', metrics, re.M)


def test_a_stopping_server_answers_503_to_new_requests():
    """Between SIGTERM and the listener closing, the server refuses new work with an
    OpenAI error body (server.guard), /health included."""
    from aiohttp.test_utils import TestClient, TestServer

    from server import build_app

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        await engine.start()
        app = build_app(engine, ["tiny"])
        async with TestClient(TestServer(app)) as client:
            ok = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0.0})
            assert ok.status == 200, await ok.text()
            app["stopping"].set()  # what SIGTERM does (server.serve)
            for method, path, body in (("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}),
                                       ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                       ("GET", "/health", None)):
                resp = await client.request(method, path, json=body)
                err = json.loads(await resp.text())
                assert resp.status == 503, (path, err)
                assert err["error"]["type"] == "Service Unavailable" and "shutting down" in err["error"]["message"]
        await engine.shutdown()

    asyncio.run(main())


def test_tokenization_and_chat_templates_run_off_the_event_loop():
    """A prompt of a few MB takes seconds to tokenize: on the event loop, every stream,
    /health and /metrics would wait for it. The server runs both on its tokenizer thread."""
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from server import build_app

    class Recording:
        def __init__(self, inner: object) -> None:
            self.inner, self.threads = inner, []

        def __getattr__(self, name: str) -> object:
            attr = getattr(self.inner, name)
            if name in ("encode", "apply_chat_template"):
                def recorded(*args, **kwargs):
                    self.threads.append((name, threading.current_thread()))
                    return attr(*args, **kwargs)
                return recorded
            return attr

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        engine.tokenizer = tokenizer = Recording(engine.tokenizer)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as client:
                for path, body in (("/v1/completions", {"prompt": "hello"}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                    resp = await client.post(path, json=body | {"max_tokens": 2, "temperature": 0.0})
                    assert resp.status == 200, await resp.text()
        finally:
            await engine.shutdown()
        assert {name for name, _ in tokenizer.threads} == {"encode", "apply_chat_template"}, tokenizer.threads
        assert all(t is not threading.main_thread() for _, t in tokenizer.threads), tokenizer.threads

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's own death
def test_after_shutdown_or_the_loop_dying_no_call_waits_forever():
    """reset_prefix_cache queued while the loop dies gets the loop's error, and after a
    shutdown or a death every new call is refused at once, not left pending."""
    import threading

    from engine import EngineDeadError

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        in_step, release = threading.Event(), threading.Event()

        def dying_step():
            in_step.set()
            release.wait(60)
            raise RuntimeError("injected step failure")
        engine.engine.step = dying_step
        await engine.start()
        stream = engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)))
        first = asyncio.ensure_future(stream.__anext__())
        assert await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 60)
        reset = asyncio.ensure_future(engine.reset_prefix_cache())  # queued behind the failing step
        await asyncio.sleep(0)
        release.set()
        for pending in (first, reset):
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(pending, 60)
        with pytest.raises(RuntimeError, match="loop died"):
            await asyncio.wait_for(engine.reset_prefix_cache(), 60)
        with pytest.raises(RuntimeError, match="loop died"):
            engine.add_request(EngineRequest("b", [1], SamplingParams()))

        stopped = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        await stopped.start()
        await stopped.shutdown()
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(stopped.reset_prefix_cache(), 60)
        with pytest.raises(RuntimeError, match="shutting down"):
            stopped.add_request(EngineRequest("c", [1], SamplingParams()))

    asyncio.run(main())


def test_a_stream_whose_client_left_before_its_first_byte_is_aborted(monkeypatch):
    """The request is queued before the response starts (a refusal is still a 4xx), so a
    client gone before the first byte (the status line's write fails) must end it: its
    stream is never read, and nothing else would. Nor is a client leaving a server error."""
    import logging

    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from server import build_app

    async def gone(self, request):
        raise ConnectionResetError("Cannot write to closing transport")
    monkeypatch.setattr(web.StreamResponse, "prepare", gone)
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger().addHandler(handler)  # the server's own log and aiohttp's

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=256, max_num_batched_tokens=64,
                                          warmup=False), log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as client:
                for path, body in (("/v1/completions", {"prompt": [1, 2, 3]}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                    ended = sum(engine.stats.snapshot().request_success.values())
                    with pytest.raises(aiohttp.ClientError):
                        await client.post(path, json=body | {"max_tokens": 200, "ignore_eos": True, "stream": True})
                    while sum(engine.stats.snapshot().request_success.values()) == ended:
                        await asyncio.sleep(0.02)
                    stats = engine.stats.snapshot()
                    assert dict(stats.request_success).get("length", 0) == 0, (path, stats.request_success)
                    assert stats.generation_tokens < 200, path
        finally:
            await engine.shutdown()
        assert engine.engine.scheduler.allocator.num_used == 0
        assert {k: v for k, v in engine.stats.snapshot().request_success.items() if v} == {"abort": 2}
    try:
        asyncio.run(main())
    finally:
        logging.getLogger().removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


def test_work_queued_while_the_loop_decides_to_stop_is_still_ended():
    """A request and a reset queued after the loop's last drain, just before shutdown()
    sets _stop: the loop must serve them (the request ends aborted, the reset answers)
    before it exits, not leave them waiting forever."""
    import threading

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        drain, armed, drained, go = engine._drain_inbox, threading.Event(), threading.Event(), threading.Event()

        def paused_drain() -> None:  # holds the loop between its drain and its stop check
            drain()
            if armed.is_set():
                armed.clear()
                drained.set()
                go.wait(60)
        engine._drain_inbox = paused_drain
        await engine.start()
        armed.set()
        engine._wake.set()
        assert await asyncio.get_running_loop().run_in_executor(None, drained.wait, 60)
        stream = engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=4)))
        reset = asyncio.ensure_future(engine.reset_prefix_cache())
        await asyncio.sleep(0)
        stop = asyncio.ensure_future(engine.shutdown())
        await asyncio.sleep(0)  # shutdown has set _stop and queued its abort
        go.set()
        await asyncio.wait_for(stop, 60)
        last = await asyncio.wait_for(stream.__anext__(), 60)
        assert last.finished and last.finish_reason == "abort", last
        assert await asyncio.wait_for(reset, 60) in (True, False)

    asyncio.run(main())


@pytest.mark.parametrize("end", ["failed", "finished"])
def test_a_streams_late_cleanup_leaves_a_new_request_under_its_id_alone(end):
    """A request ends (refused by the scheduler, or finished) while its consumer is away;
    before that stream's cleanup runs, a new request takes the same id. The cleanup's abort
    (queued behind the new request's add: the loop's drain is held until both are in its
    inbox) must not end the new request, nor send it the old one's events: it runs to its
    max_tokens."""
    import threading

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        drain, hold = engine._drain_inbox, threading.Event()
        hold.set()

        def held_drain() -> None:
            hold.wait(60)
            drain()
        engine._drain_inbox = held_drain
        enqueue = engine.engine.enqueue
        if end == "failed":
            def refuse_once(request: EngineRequest, place_reserved: bool = False) -> None:
                engine.engine.enqueue = enqueue
                raise ValueError("refused by the scheduler")
            engine.engine.enqueue = refuse_once
        await engine.start()
        try:
            old = engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
            if end == "finished":  # its consumer reads the first event, then goes quiet
                await asyncio.wait_for(old.__anext__(), 60)
            while "x" in engine._queues:  # ended in the engine: the id is free again
                await asyncio.sleep(0.01)
            hold.clear()  # the loop's next drain waits
            await asyncio.sleep(0.1)  # (a drain already past the wait takes an empty inbox)
            new = engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)))
            if end == "failed":
                with pytest.raises(ValueError):
                    await asyncio.wait_for(old.__anext__(), 60)
            else:
                await old.aclose()  # the consumer leaves before the last event: the stream's cleanup
            hold.set()
            events = [d async for d in new]
            assert events[-1].finished and events[-1].finish_reason == "length", events[-1]
            assert sum(len(d.new_token_ids) for d in events) == 6
        finally:
            hold.set()
            await engine.shutdown()
        assert engine.engine.scheduler.allocator.num_used == 0

    asyncio.run(main())


def test_a_request_whose_inputs_fail_ends_its_own_stream_with_an_error_and_nothing_else():
    """The engine ends a request that failed alone with a last delta of finish_reason
    "error"; AsyncEngine raises it on that request's stream (the server's 500), and the
    other streams, the loop and later requests go on."""
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        real = engine.engine.runner.execute

        def execute(out):  # a fault in one request's inputs, before the device runs
            if any(s.seq.request_id == "bad" for s in out.scheduled):
                raise OverflowError("bad input")
            return real(out)
        engine.engine.runner.execute = execute
        await engine.start()
        try:
            params = SamplingParams(max_tokens=5, ignore_eos=True)
            bad = engine.add_request(EngineRequest("bad", [1, 2, 3], params))
            ok = engine.add_request(EngineRequest("ok", [1, 4, 5], params))
            with pytest.raises(RuntimeError, match=r"request failed: OverflowError\('bad input'\)"):
                async for _ in bad:
                    pass
            events = [d async for d in ok]
            assert events[-1].finish_reason == "length" and sum(len(d.new_token_ids) for d in events) == 5
            again = [d async for d in engine.add_request(EngineRequest("bad2", [1, 2, 3], params))]
            assert again[-1].finish_reason == "length" and engine.error is None and not engine._queues
        finally:
            await engine.shutdown()
        assert engine.engine.scheduler.allocator.num_used == 0
        assert {k: v for k, v in engine.stats.snapshot().request_success.items() if v} == {"error": 1, "length": 2}

    asyncio.run(main())


def test_a_request_is_checked_once_on_its_callers_thread_never_on_the_engine_loop():
    """AsyncEngine.add_request runs LLMEngine.validate (a grammar's compile and first-token
    mask among its checks) on the caller's thread; the loop queues what it returned and does
    not check it again."""
    import threading

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(**TWO), log=lambda *_: None)
        validate, threads = engine.engine.validate, []

        def recording(request: EngineRequest) -> EngineRequest:
            threads.append(threading.current_thread().name)
            return validate(request)
        engine.engine.validate = recording
        await engine.start()
        try:
            for rid in ("a", "b"):
                events = [d async for d in engine.add_request(
                    EngineRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))]
                assert events[-1].finished and sum(len(d.new_token_ids) for d in events) == 3
        finally:
            await engine.shutdown()
        assert threads == [threading.current_thread().name] * 2, threads

    asyncio.run(main())
