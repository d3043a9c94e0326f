"""No request can take the engine down: a table of hostile and unusual requests against
one real server, a flood of streams whose clients hang up at random, and the death path
(a fault injected into the step: every open stream gets an error event, the process exits
non-zero).

The fault is the test's own: the server process starts with a sitecustomize module on
its path that wraps ModelRunner.execute to raise once a file exists (production code has
no hook for it).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import socket
from collections.abc import Iterator

import pytest
from test_server import Server, metric, open_stream, request, running_server, scrape, wait_for

FLAGS = ["--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "64", "--num-kv-blocks", "256"]
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def raw(text: str) -> bytes:
    return text.encode()


# (path, body: a JSON-able object or raw bytes, expected status)
HOSTILE: list[tuple[str, object, int]] = [
    # seeds: any 64-bit integer, as vLLM (chat UIs send -1 for "random")
    (C, {"prompt": "hi", "seed": -1}, 200),
    (C, {"prompt": "hi", "seed": 2**32}, 200),
    (C, {"prompt": "hi", "seed": 2**63 - 1}, 200),
    (C, {"prompt": "hi", "seed": -(2**63)}, 200),
    (C, {"prompt": "hi", "seed": 2**64 + 5}, 400),
    (C, {"prompt": "hi", "seed": -(2**70)}, 400),
    (CHAT, {"messages": MSG, "seed": -1, "max_tokens": 3, "stream": True}, 200),
    (C, {"prompt": "hi", "seed": 1.5}, 400),
    (C, {"prompt": "hi", "seed": True}, 400),
    # top_k: 0 and -1 disable, above the vocabulary is clipped
    (C, {"prompt": "hi", "top_k": 2**40}, 200),
    (C, {"prompt": "hi", "top_k": 0}, 200),
    (C, {"prompt": "hi", "top_k": -1}, 200),
    (C, {"prompt": "hi", "top_k": -5}, 400),
    # NaN / Infinity / numbers past float range
    (C, raw('{"prompt": "hi", "temperature": NaN}'), 400),
    (C, raw('{"prompt": "hi", "temperature": Infinity}'), 400),
    (C, raw('{"prompt": "hi", "top_p": -Infinity}'), 400),
    (C, raw('{"prompt": "hi", "min_p": NaN}'), 400),
    (C, {"prompt": "hi", "temperature": 10**400}, 400),
    (C, {"prompt": "hi", "temperature": 1e300}, 400),  # vLLM's range: [0, 2]
    (C, {"prompt": "hi", "temperature": 2}, 200),
    (C, {"prompt": "hi", "slo": {"ttft_ms": 10**400}}, 400),  # an integer no float holds, where a number is due
    (C, {"prompt": "hi", "slo": {"tpot_ms": -(10**400)}}, 400),
    (C, {"prompt": "hi", "min_p": 2}, 400),
    (C, {"prompt": "hi", "top_p": 0}, 400),
    # wrong types: booleans are not integers, nor is a number with a fraction
    (C, {"prompt": "hi", "max_tokens": True}, 400),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400),
    (C, {"prompt": "hi", "max_tokens": 10**30}, 400),
    (C, {"prompt": "hi", "max_tokens": 0}, 400),
    (C, {"prompt": [1.0, 2.0]}, 200),  # whole numbers are token ids, as vLLM's pydantic takes them
    (C, {"prompt": [1.0, 2.5]}, 400),
    # whole numbers past any range: the same answers their integers get
    (C, {"prompt": "hi", "n": 2.0, "max_tokens": 2.0}, 200),
    (C, {"prompt": "hi", "top_k": 1e300}, 200),  # above the vocabulary: all kept, as vLLM
    (C, {"prompt": "hi", "logprobs": 1e300}, 400),
    (C, {"prompt": "hi", "prompt_logprobs": 1e300}, 400),
    (C, {"prompt": "hi", "min_tokens": 1e300}, 400),
    (C, {"prompt": [1e300]}, 400),
    (C, {"prompt": [True, 5]}, 400),
    (C, {"prompt": [-1]}, 400),
    (C, {"prompt": [2**63]}, 400),
    (C, {"prompt": "hi", "ignore_eos": "true"}, 400),
    (C, {"prompt": "hi", "stream": "yes"}, 400),
    (C, {"prompt": "hi", "logprobs": 10**6}, 400),
    (C, {"prompt": "hi", "logprobs": -1}, 400),
    (C, {"prompt": "hi", "n": 1000}, 400),
    (C, {"prompt": "hi", "stop_token_ids": [1.5]}, 400),
    (C, {"prompt": "hi", "stop_token_ids": [2**80]}, 200),
    # vLLM's logits processors: OpenAI's bias range is clamped, everything else checked
    (C, {"prompt": "hi", "logit_bias": {"1": 5}}, 200),
    (C, {"prompt": "hi", "logit_bias": {"1": 1e308, "3": -1e308}}, 200),
    (C, {"prompt": "hi", "logit_bias": {"1": 10**400}}, 400),
    (C, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400),
    (C, {"prompt": "hi", "logit_bias": {"1.5": 1}}, 400),
    (C, {"prompt": "hi", "logit_bias": [1]}, 400),
    (C, {"prompt": "hi", "min_tokens": 4}, 200),
    (C, {"prompt": "hi", "min_tokens": 0}, 200),
    (C, {"prompt": "hi", "min_tokens": 10**30}, 400),
    (C, {"prompt": "hi", "min_tokens": True}, 400),
    (C, {"prompt": "hi", "repetition_penalty": 10**400}, 400),
    (C, raw('{"prompt": "hi", "presence_penalty": NaN}'), 400),
    (C, {"prompt": "hi", "frequency_penalty": "1"}, 400),
    (C, {"prompt": "hi", "allowed_token_ids": [2**80]}, 400),
    (C, {"prompt": "hi", "allowed_token_ids": [True]}, 400),
    (C, {"prompt": "hi", "bad_words": "hi"}, 400),
    (C, {"prompt": "hi", "bad_words": [5]}, 400),
    (C, {"prompt": "hi", "bad_words": ["x"] * 257}, 400),
    # vLLM's caps on the words as token sequences (a byte each here): 128 of them, 1024 tokens in all
    (C, {"prompt": "hi", "bad_words": [f"w{i}" for i in range(128)], "max_tokens": 2}, 200),
    (C, {"prompt": "hi", "bad_words": [f"w{i}" for i in range(129)]}, 400),
    (C, {"prompt": "hi", "bad_words": [c * 256 for c in "abcd"], "max_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "bad_words": [c * 256 for c in "abcde"]}, 400),
    (C, {"prompt": "hi", "bad_words": ["x" * 256] * 5, "max_tokens": 2}, 200),  # one word, given 5 times
    (C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, 400),
    (C, {"prompt": "hi", "allowed_token_ids": list(range(1025))}, 400),
    (C, {"prompt": "hi", "bad_words": ["\u00ff" * 100], "stop_token_ids": [2**80], "min_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "add_special_tokens": "true"}, 400),
    (C, {"prompt": "hi", "add_special_tokens": "no"}, 400),
    (CHAT, {"messages": MSG, "documents": [{"title": "t", "text": "x"}]}, 400),
    (C, {"prompt": "hi", "return_tokens_as_token_ids": "yes"}, 400),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "x"}}, 400),
    # lone surrogates (JSON escapes that are not Unicode)
    (C, raw('{"prompt": "a\\ud800b"}'), 400),
    (CHAT, raw('{"messages": [{"role": "user", "content": "x\\udfff"}]}'), 400),
    (C, raw('{"prompt": "hi", "stop": ["\\ud83d"]}'), 400),
    # empty, missing, not an object, not JSON, not UTF-8, deeply nested, too large
    (C, {"prompt": ""}, 400),
    (C, {"prompt": []}, 400),
    (C, {}, 400),
    (C, [], 400),
    (C, raw("null"), 400),
    (C, raw("{not json"), 400),
    (C, b"\xff\xfe{}", 400),
    (C, {"prompt": "hi", "store": True}, 400),  # an OpenAI field taxirank does not implement: refused
    # vLLM's cache_salt: a non-empty string of at most 128 characters, none of them '@', '/', '\\' or NUL
    (C, {"prompt": "hi", "cache_salt": ""}, 400),
    (CHAT, {"messages": MSG, "cache_salt": {"a": 1}}, 400),
    (C, {"prompt": "hi", "cache_salt": "s" * 128, "max_tokens": 2}, 200),
    (C, {"prompt": "hi", "cache_salt": "s" * 129}, 400),
    (C, {"prompt": "hi", "cache_salt": "s" * 100_000}, 400),
    (CHAT, {"messages": MSG, "cache_salt": "tenant@a"}, 400),
    (C, {"prompt": "hi", "cache_salt": "a/b"}, 400),
    (C, {"prompt": "hi", "cache_salt": "a\\b"}, 400),
    (C, {"prompt": "hi", "cache_salt": "a\x00b"}, 400),
    (C, {"prompt": "hi", "cache_salt": "\u00e9\U0001F600", "max_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "cache_salt": None, "max_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, 400),
    # vLLM's extras that need a server flag taxirank lacks: its 400, never ignored
    (C, {"prompt": "hi", "logits_processors": ["my.Processor"]}, 400),
    (CHAT, {"messages": MSG, "logits_processors": [{"qualname": "my.Processor"}]}, 400),
    (C, {"prompt": "hi", "logits_processors": [], "max_tokens": 2}, 200),
    (C, {"prompt": "hi", "prompt_embeds": "AAAA"}, 400),
    (C, raw("[" * 100_000 + "]" * 100_000), 400),
    (C, raw('{"prompt": "hi", "user": ' + "[" * 50_000 + "]" * 50_000 + "}"), 400),
    (C, raw('{"prompt": "' + "a" * (5 * 2**20) + '"}'), 413),
    (C, {"prompt": "hi", "model": "nope"}, 404),
    (C, {"prompt": "hi", "some_unknown_field": {"a": [1, 2]}}, 200),  # ignored, as vLLM
    # chat: roles and content parts
    (CHAT, {"messages": [{"role": "", "content": "hi"}]}, 400),
    (CHAT, {"messages": [{"role": "ipython", "content": "hi"}], "max_tokens": 2}, 200),  # a template's own role
    (CHAT, {"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}, {"role": "user", "content": "x"}]}, 400),
    # a function's parameters are optional (vLLM's `dict | None`): null is a function of none
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": None}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "max_tokens": 4}, 200),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": None}}],
            "tool_choice": "none", "max_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tool_choice": "none"}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "description": {"x": 1}}}],
            "tool_choice": "none"}, 400),  # vLLM's: a string or null, never handed to the template as is
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "description": None}}],
            "tool_choice": "none", "max_tokens": 2}, 200),
    # a json_schema response_format names its schema (OpenAI's and vLLM's required field)
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
            "max_tokens": 2}, 400),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "s"}},
            "max_tokens": 2}, 200),
    (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, 400),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400),  # vLLM's: a string, for the template
    # an assistant's earlier calls: OpenAI's shape, as vLLM validates them
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{}]}, {"role": "user", "content": "x"}]}, 400),
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": 5}}]}, {"role": "user", "content": "x"}]}, 400),
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{"id": 7, "type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}, {"role": "user", "content": "x"}]}, 400),
    (CHAT, {"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}]}, {"role": "tool", "content": "1", "tool_call_id": "c",
            "name": "f"}], "max_tokens": 2}, 200),
    # a lone surrogate escaped inside the arguments' JSON string: past read_body's check, no tokenizer encodes it
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments":
            '{"a": "\\ud800"}'}}]}, {"role": "user", "content": "x"}], "max_tokens": 2}, 400),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400),  # left out it is "", as vLLM
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}],
            "max_tokens": 4}, 200),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    # echo repeats a last assistant message's parts, whatever text parts they are (a string, a refusal)
    (CHAT, {"messages": MSG + [{"role": "assistant", "content": ["x", {"type": "refusal", "refusal": "no"}]}],
            "echo": True, "max_tokens": 2}, 200),
    (CHAT, {"messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "x"},
                         {"role": "user", "content": "hi"}], "max_tokens": 4}, 200),
    # stop strings: capped in count (vLLM's VLLM_MAX_STOP_STRINGS, 4) and length
    (C, {"prompt": "hi", "stop": ["s"] * 100}, 400),
    (C, {"prompt": "hi", "stop": ["a", "b", "c", "d"], "max_tokens": 2}, 200),
    (CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400),
    (C, {"prompt": "hi", "stop": "x" * 10_000}, 400),
    (C, {"prompt": "hi", "stop": [""]}, 400),
    (C, {"prompt": "hi", "stop": ["a", 5]}, 400),
    (C, {"prompt": "hi", "stop": ["a" * 200, "ab" * 100], "max_tokens": 20}, 200),
    (C, {"prompt": "hi", "skip_special_tokens": False, "spaces_between_special_tokens": False}, 200),
    ("/tokenize", {"prompt": "hi", "messages": MSG}, 400),  # which one? (neither is ignored)
]


# Refused past the body's own checks (the scheduler, the grammar compiler): still named
# (path, body, the 400's param)
NAMED: list[tuple[str, dict, str]] = [
    (C, {"prompt": "hi", "priority": 5}, "priority"),  # fcfs reads no priority
    (CHAT, {"messages": MSG, "slo": {"ttft_ms": 100}}, "slo"),  # nor an slo
    # the tiny model's fixed ChatML takes no template variables (as --default-chat-template-kwargs says)
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments":
            '"\\udfff"'}}]}, {"role": "user", "content": "x"}]}, "messages"),
    (C, {"prompt": "hi", "guided_regex": "(a"}, "guided_regex"),
    (C, {"prompt": "hi", "structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format"),
]


def raw_request(port: int, method: str, path: str, headers: dict[str, str | bytes],
                body: bytes = b"") -> tuple[int, dict[str, str], dict]:
    """One request with headers as given (bytes go out as they are): (status, headers, JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path)
        for name, value in ({"Content-Length": str(len(body))} | headers).items():  # a case may announce more
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def test_headers_and_charsets_get_vllms_answers_never_a_500() -> None:
    """Over a socket, with --api-key: the Bearer scheme in any case is the key (vLLM's check,
    RFC 9110's rule), an Authorization header that is not UTF-8 is a wrong key; a body is
    JSON as vLLM reads it, whatever charset its Content-Type names, and one announced past
    the limit is a 413 before any of it arrives; a wrong method's 405
    says which the route takes, in its Allow header too."""
    from aiohttp.test_utils import TestServer
    from conftest import tiny_async_engine

    import server

    auth = {"Authorization": "Bearer K"}
    hi = b'{"prompt": "h\xc3\xa9"}'  # UTF-8, whatever the header says
    cases = [  # (method, path, headers, body, status)
        ("GET", "/v1/models", {"Authorization": "bearer K"}, b"", 200),
        ("GET", "/v1/models", {"Authorization": "BEARER K"}, b"", 200),
        ("GET", "/v1/models", {"Authorization": "Bearer k"}, b"", 401),
        ("GET", "/v1/models", {"Authorization": b"Bearer \xff\xfe"}, b"", 401),
        ("GET", "/v1/models", {"Authorization": b"Bearer K\xff"}, b"", 401),
        ("POST", "/tokenize", {"Content-Type": "application/json; charset=nope"}, hi, 200),
        # a body announced past the limit is refused at once, not awaited
        ("POST", "/tokenize", {"Content-Type": "application/json", "Content-Length": str(10**9)}, b"", 413),
        ("POST", "/tokenize", {"Content-Type": "application/json; charset=utf-16"}, hi, 200),
        ("POST", "/tokenize", {"Content-Type": "application/json; charset=latin-1"}, hi, 200),
        ("GET", "/reset_prefix_cache", auth, b"", 405),
        ("POST", "/v1/models", auth, b"{}", 405),
    ]
    with tiny_async_engine() as (loop, engine):
        async def run() -> list[tuple[int, dict, dict]]:
            app = TestServer(server.build_app(engine, ["tiny"], api_key="K"))
            await app.start_server()
            try:
                return await asyncio.to_thread(lambda: [raw_request(app.port, m, p, h, b) for m, p, h, b, _ in cases]
                                               + [raw_request(app.port, "GET", "/health", {})])
            finally:
                await app.close()
        answers = loop.run_until_complete(asyncio.wait_for(run(), 300))
    assert [a[0] for a in answers] == [c[-1] for c in cases] + [200], answers
    for (_, path, _, _, status), (_, _, out) in zip(cases, answers):
        if path == "/tokenize" and status == 200:
            assert out["tokens"] == engine.tokenizer.encode("h\u00e9"), out
        if status >= 400:
            assert set(out["error"]) == {"message", "type", "param", "code"}, out
    assert answers[-3][1]["Allow"] == "POST" and "allowed: POST" in answers[-3][2]["error"]["message"]
    assert set(answers[-2][1]["Allow"].replace(" ", "").split(",")) == {"GET", "HEAD"}
    assert "allowed: GET, HEAD" in answers[-2][2]["error"]["message"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(*FLAGS) as s:
        yield s


def send(server: Server, path: str, body: object) -> tuple[int, dict | str]:
    return request(server, "POST", path, **({"raw": body} if isinstance(body, bytes) else {"body": body}))


def test_every_hostile_request_is_answered_and_the_engine_lives_on(server: Server) -> None:
    assert len(HOSTILE) >= 30
    failures = []
    for i, (path, body, want) in enumerate(HOSTILE):
        status, answer = send(server, path, body)
        if status != want:
            failures.append((i, status, want, str(answer)[:200]))
        if status >= 400:  # OpenAI's error JSON, always
            assert isinstance(answer, dict) and set(answer["error"]) == {"message", "type", "param", "code"}, (i, answer)
            assert answer["error"]["message"], i
        assert request(server, "GET", "/health")[0] == 200, (i, server.log()[-3000:])
        ok, out = send(server, C, {"prompt": "ok", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        assert ok == 200 and out["choices"][0]["finish_reason"] == "length", (i, out)
    assert not failures, failures
    assert "Traceback" not in server.log()


def test_a_request_refused_past_the_body_checks_names_its_field(server: Server) -> None:
    for path, body, param in NAMED:
        status, answer = send(server, path, body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_a_request_http_cannot_parse_is_a_400_and_one_warning_line(server: Server) -> None:
    """Framing aiohttp's parser refuses (a bad chunk size, Content-Length beside chunked, a
    negative length, a header past its limit) is its 400 before any handler runs, and a body
    its Content-Encoding does not decode is the handler's (as vLLM's for a body that is not
    JSON); the log gets one warning line for each, never a traceback, which any client could
    fill it with."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    bad = [b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
           b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
           b"Content-Length: -5\r\n\r\n",
           b"X-Big: " + b"a" * 10_000 + b"\r\nContent-Length: 0\r\n\r\n",
           b"Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}"]
    before = server.log().count("invalid HTTP request")
    for tail in bad:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(head + tail)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"400", (tail[:60], answer[:200])
    ok, out = send(server, C, {"prompt": "ok", "max_tokens": 2})
    assert ok == 200, out
    wait_for(lambda: server.log().count("invalid HTTP request") - before == len(bad), timeout=30)
    assert "Traceback" not in server.log()


def test_a_flood_with_random_hang_ups_serves_everyone_who_stays_and_leaks_nothing(server: Server) -> None:
    import aiohttp

    n, rng = 240, random.Random(0)
    plans = [(rng.randint(4, 24), rng.random() < 1 / 3) for _ in range(n)]
    hang_at = [rng.randint(0, mt - 1) for mt, _ in plans]

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None] | None:
        max_tokens, leaves = plans[i]
        body = {"prompt": f"flood {i}", "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0,
                "stream": True, "temperature": 0.8, "seed": i}
        async with session.post(f"{server.base}{C}", json=body) as resp:
            assert resp.status == 200
            tokens, reason, done = 0, None, False
            async for line in resp.content:
                if leaves and tokens >= hang_at[i]:
                    resp.close()  # the client hangs up mid-stream
                    return None
                line = line.strip()
                done = done or line == b"data: [DONE]"
                if not line.startswith(b"data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                tokens += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
                reason = choice["finish_reason"] or reason
            return tokens, reason if done else "no [DONE]"

    async def flood() -> list:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = asyncio.run(flood())
    stayed = [(r, plans[i][0]) for i, r in enumerate(results) if not plans[i][1]]
    assert len(stayed) > n // 2 and sum(1 for _, leaves in plans if leaves) > n // 5
    assert all(r == (max_tokens, "length") for r, max_tokens in stayed), [x for x in stayed if x[0][0] != x[1]][:5]

    def drained() -> bool:
        m = scrape(server)
        return (metric(m, "num_requests_running"), metric(m, "num_requests_waiting"),
                metric(m, "kv_cache_usage_perc")) == (0, 0, 0)
    wait_for(drained, timeout=120)
    assert request(server, "GET", "/health")[0] == 200


FAULT_HOOK = """
import os
import runner

_execute = runner.ModelRunner.execute


def execute(self, out):  # every step fails once the file exists, as on a broken device
    if os.path.exists({fault!r}):
        raise RuntimeError("injected fault")
    return _execute(self, out)


runner.ModelRunner.execute = execute
"""


def test_an_engine_that_dies_sends_an_error_on_every_stream_and_exits_non_zero(tmp_path, monkeypatch) -> None:
    fault = tmp_path / "fault"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK.format(fault=str(fault)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(hook), root, os.environ.get("PYTHONPATH")) if p))
    with running_server(*FLAGS, "--no-warmup") as srv:
        body = {"prompt": "long", "max_tokens": 400, "ignore_eos": True, "logprobs": 0}
        with open_stream(srv, body) as a, open_stream(srv, body) as b, open_stream(srv, body) as c:
            streams = [a, b, c]
            for s in streams:
                next(s)  # every stream is open and has produced
            fault.touch()
            for s in streams:
                events = list(s)  # ends with [DONE]
                assert "error" in events[-1] and "injected fault" in events[-1]["error"]["message"], events[-1]
        assert srv.proc.wait(60) != 0
        assert "engine loop died" in srv.log()


DEEP = "[" * 30_000 + "]" * 30_000  # past the JSON decoder's (and PyYAML's) recursion


@pytest.mark.parametrize("where", ["--speculative-config", "--override-generation-config", "--allowed-origins",
                                   "--allowed-methods", "--config"])
def test_a_flag_or_config_file_nested_past_the_parsers_stack_is_an_error_naming_it(where, tmp_path, capsys):
    """JSON flags and the YAML config file nested deeper than their decoders recurse: an
    error naming the flag, never a RecursionError's traceback."""
    import cli_args
    import config_file
    from config import EngineConfig
    from spec_decode import SpeculativeConfig

    if where == "--speculative-config":
        with pytest.raises(ValueError, match="speculative_config is nested too deeply"):
            SpeculativeConfig.parse(DEEP)
    elif where == "--override-generation-config":
        with pytest.raises(ValueError, match="override_generation_config is nested too deeply"):
            EngineConfig(override_generation_config=DEEP)
    else:
        path = tmp_path / "c.yaml"
        path.write_text(f"speculative-config: {DEEP}\n")
        with pytest.raises(SystemExit) as exit_:
            config_file.parse_args(cli_args.build_parser(), [where, str(path) if where == "--config" else DEEP])
        assert exit_.value.code == 2
        assert ("c.yaml: nested too deeply" if where == "--config" else
                f"{where}: expected a JSON list of strings") in capsys.readouterr().err


def test_a_whole_response_of_many_large_choices_leaves_the_event_loop_free_between_them() -> None:
    """n samples with prompt logprobs make a response of tens of MB, and building its dicts
    and json.dumps hold the GIL: the server builds and serializes one choice per event-loop
    turn, so other requests (/health, the streams) run in between. The body is byte for
    byte json.dumps's of the whole."""
    import serving

    choices = [{"index": i, "text": "x" * 100, "prompt_logprobs": [None] + [
        {str(t): {"logprob": -1.5, "rank": t, "decoded_token": "\u00e9\"\n"}} for t in range(50)]} for i in range(16)]
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    tail = {"usage": {"prompt_tokens": 50, "completion_tokens": 16, "total_tokens": 66}, "metrics": {"a": 1.0}}
    built: list[int] = []

    async def run() -> tuple[bytes, str]:
        ticks = 0

        async def other_request() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        def builder(i: int):
            def build() -> dict:
                built.append(ticks)  # the other request's turns so far
                return choices[i]
            return build
        task = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        response = await serving.json_in_pieces(head, [builder(i) for i in range(len(choices))], tail)
        task.cancel()
        return response.body, response.content_type

    data, content_type = asyncio.run(run())
    assert data == json.dumps(head | {"choices": choices} | tail).encode() and content_type == "application/json"
    assert all(b > a for a, b in zip(built, built[1:]))  # the other request ran between any two builds
