"""OpenAI's `n` over HTTP, as vLLM's parallel sampling: n samples of one prompt, each an
engine request of its own, seeded seed + i when the request is seeded.

Claims: each choice is the answer the same request gives alone with seed + i (the
independent reference: n single requests); usage counts the prompt once and every
sample's tokens; streamed, each index adds up to its whole choice and the usage chunk
comes last; a bad n, or per-request metrics with n > 1, is a 400; a queue that fills
mid-way is a 503 and leaves no sample behind."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import tiny_async_engine

PROMPT = {"prompt": [1, 5, 9, 13], "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def post():
    """post(path, body, flags=()) -> (status, JSON answer, or the stream's chunks); post.engine:
    the AsyncEngine behind it."""
    from aiohttp.test_utils import TestClient, TestServer

    import cli_args
    import server

    with tiny_async_engine(max_waiting_requests=4) as (loop, engine):
        async def one(path: str, body: dict, flags: list[str]) -> tuple[int, object]:
            app = server.app_from_args(engine, cli_args.build_parser().parse_args(flags))
            async with TestClient(TestServer(app)) as client:
                resp = await client.post(path, json=body)
                text = await resp.text()
                if not body.get("stream") or resp.status != 200:
                    return resp.status, json.loads(text)
                return resp.status, [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]

        def run(path: str, body: dict, flags: list[str] | tuple = ()) -> tuple[int, object]:
            return loop.run_until_complete(asyncio.wait_for(one(path, body, list(flags)), 300))
        run.engine = engine  # (its waiting places, for the full-queue test)
        yield run
        assert not engine.engine.has_unfinished()


def test_each_choice_is_the_request_alone_with_seed_plus_its_index(post):
    status, out = post("/v1/completions", PROMPT | {"n": 3, "seed": 5})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    alone = [post("/v1/completions", PROMPT | {"seed": 5 + i})[1]["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in out["choices"]] == alone and len(set(alone)) == 3
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 18


def test_streamed_each_index_adds_up_to_its_whole_choice(post):
    status, whole = post("/v1/chat/completions", CHAT | {"n": 2, "seed": 11})
    assert status == 200
    status, chunks = post("/v1/chat/completions", CHAT | {"n": 2, "seed": 11, "stream": True,
                                                          "stream_options": {"include_usage": True}},
                          ["--enable-prompt-tokens-details"])
    content, roles, reasons = {0: "", 1: ""}, {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        content[choice["index"]] += choice["delta"].get("content", "")
        roles.setdefault(choice["index"], choice["delta"].get("role"))
        reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    assert roles == {0: "assistant", 1: "assistant"} and reasons == {0: "length", 1: "length"}
    assert [content[i] for i in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
    streamed_usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and streamed_usage.pop("prompt_tokens_details")["cached_tokens"] > 0  # (cached)
    assert streamed_usage == {k: v for k, v in whole["usage"].items() if not k.endswith("_details")}
    assert whole["usage"]["completion_tokens"] == 10


def test_bad_n_and_a_full_queue_are_refused_and_leave_nothing_behind(post):
    for n in (0, 129, "2", 2.5):
        status, out = post("/v1/completions", PROMPT | {"n": n})
        assert status == 400 and out["error"]["param"] == "n", (n, out)
    status, out = post("/v1/completions", PROMPT | {"n": 2, "include_metrics": True},
                       ["--enable-per-request-metrics"])
    assert status == 400 and out["error"]["param"] == "include_metrics"
    # max_waiting_requests 4: 6 samples could never all wait, whatever the queue holds
    status, out = post("/v1/completions", PROMPT | {"n": 6})
    assert status == 400 and out["error"]["param"] == "n" and "--max-waiting-requests" in out["error"]["message"], out
    engine = post.engine
    engine.reserve_waiting(3)  # three places held (as a beam search holds them): the second sample is refused
    try:
        status, out = post("/v1/completions", PROMPT | {"n": 4})
        assert status == 503 and out["error"]["code"] == 503 and "at capacity" in out["error"]["message"], out
    finally:
        engine.release_waiting(3)
    # The first sample, added before the second was refused, is withdrawn by the engine's
    # loop, which takes the abort at its next turn: until then it holds its place (a queue
    # never holds more than its limit), so a retry sent at once can still be refused.
    def waiting() -> int:
        with engine._lock:
            return engine._num_waiting()

    deadline = time.monotonic() + 60
    while waiting():
        assert time.monotonic() < deadline, "the refused request's first sample is still waiting"
        time.sleep(0.01)
    status, out = post("/v1/completions", PROMPT | {"n": 4})  # and the first was withdrawn
    assert status == 200 and len(out["choices"]) == 4
