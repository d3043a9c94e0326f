"""vLLM's frontend flags --enable-prompt-tokens-details, --root-path and --enable-log-outputs,
and FastAPI's trailing-slash redirects, over real HTTP (aiohttp's TestServer on a socket).

Claims: prompt_tokens_details is sent only with the flag (then always, 0 included, as vLLM's
`num_cached_tokens is not None`), null in a whole response and absent from a stream without
it, never in a continuous_usage_stats chunk (a chat one's has vLLM's completion_tokens_details,
null, as a whole response's usage); its cached_tokens is what the engine's prefix
cache counted as hits (an independent counter). Paths under --root-path and paths without
it are served as FastAPI(root_path=...) serves them, and a path with (or without) a trailing
slash redirects as FastAPI's router does: both checked against a FastAPI app with the same
routes. --enable-log-outputs logs vLLM's lines, cut to --max-log-len, and needs
--enable-log-requests. A bad value is refused at start-up naming its flag."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from conftest import tiny_async_engine

import cli_args
import server

PROMPT = list(range(3, 43))  # 40 token ids: 2 full blocks of 16 can come from the prefix cache
GREEDY = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with tiny_async_engine() as (loop, eng):
        yield loop, eng
        assert not eng.engine.has_unfinished()


@pytest.fixture(scope="module")
def call(engine):
    """call(flags, [(method, path, body, headers)...]) -> [(status, headers, JSON | SSE chunks | text)], sent in
    turn to one app built from the flags, without following redirects."""
    from aiohttp.test_utils import TestClient, TestServer

    loop, eng = engine

    async def run(flags: list[str], requests: list[tuple]) -> list[tuple[int, dict, object]]:
        app = server.app_from_args(eng, cli_args.build_parser().parse_args(flags))
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, path, body, headers in requests:
                resp = await client.request(method, path, json=body, headers=headers or {}, allow_redirects=False)
                text = await resp.text()
                if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    parsed: object = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
                else:
                    try:
                        parsed = json.loads(text)
                    except ValueError:
                        parsed = text
                out.append((resp.status, dict(resp.headers), parsed))
        return out

    def call(flags: list[str], *requests: tuple) -> list[tuple[int, dict, object]]:
        full = [r + (None,) * (4 - len(r)) for r in requests]
        return loop.run_until_complete(asyncio.wait_for(run(list(flags), full), 300))

    return call


def hits(engine) -> int:
    return engine[1].stats.snapshot().prefix_cache_hits


# ---- --enable-prompt-tokens-details -----------------------------------------------------

def test_without_the_flag_usage_has_no_prompt_tokens_details_null_whole_absent_streamed(call) -> None:
    completion = {"prompt": PROMPT} | GREEDY
    chat = {"messages": [{"role": "user", "content": "taxi " * 10}]} | GREEDY
    (_, _, whole), (_, _, streamed), (_, _, chat_whole), (_, _, chat_streamed) = call(
        [], ("POST", "/v1/completions", completion),
        ("POST", "/v1/completions", completion | {"stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", chat | {"stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    ((_, _, forced),) = call(["--enable-force-include-usage"],
                             ("POST", "/v1/completions", completion | {"stream": True}))
    # vLLM: a whole response is model_dump()ed (the None fields are null), a stream's usage without Nones
    for body in (whole, chat_whole):
        assert body["usage"]["prompt_tokens_details"] is None and body["usage"]["completion_tokens_details"] is None
    counts = {"prompt_tokens", "completion_tokens", "total_tokens"}
    for chunks in (streamed, chat_streamed, forced):
        assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) == counts
    assert all(set(c["usage"]) == counts for c in streamed)
    # a chat chunk's continuous usage sets vLLM's completion_tokens_details (None, so null) and no prompt details
    assert all(c["usage"] == {k: c["usage"][k] for k in counts} | {"completion_tokens_details": None}
               for c in chat_streamed[:-1])


def test_with_the_flag_cached_tokens_are_the_prefix_caches_hits_whole_and_streamed(call, engine) -> None:
    flags = ["--enable-prompt-tokens-details"]
    completion = {"prompt": PROMPT} | GREEDY
    call(flags, ("POST", "/reset_prefix_cache"))
    before = hits(engine)
    (_, _, first), (_, _, second) = call(flags, ("POST", "/v1/completions", completion),
                                         ("POST", "/v1/completions", completion))
    # vLLM sends the count whenever the flag is on, a miss's 0 too
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": hits(engine) - before} == \
        {"cached_tokens": 32}

    before = hits(engine)
    ((_, _, chunks),) = call(flags, ("POST", "/v1/completions", completion | {
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == \
        {"cached_tokens": hits(engine) - before} == {"cached_tokens": 32}
    assert not any("prompt_tokens_details" in c["usage"] for c in chunks[:-1])  # as vLLM's continuous chunks

    # chat, the same long conversation twice; and --enable-force-include-usage's usage chunk
    chat = {"messages": [{"role": "user", "content": "the taxi rank " * 5}]} | GREEDY
    (_, _, chat_first), = call(flags, ("POST", "/v1/chat/completions", chat))
    before = hits(engine)
    (_, _, chat_again), = call(flags + ["--enable-force-include-usage"],
                               ("POST", "/v1/chat/completions", chat | {"stream": True}))
    cached = chat_again[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == hits(engine) - before == (chat_first["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0


# ---- --root-path and trailing slashes, against FastAPI's own router ----------------------

ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"), ("POST", "/tokenize")]
PROBES = [("GET", p) for p in ("/v1/models", "/v1/models/", "/v1/models//", "/v1/models/?a=1&b=x%20y", "/health/",
                               "/nope", "/nope/", "/", "//", "/v1/completions/", "/v1/models/x")] + \
         [("POST", p) for p in ("/v1/completions/", "/v1/models/", "/tokenize/", "/v1/models")]
ROOTED = [("GET", p) for p in ("/llm/v1/models", "/llm/v1/models/", "/llm/health", "/llmx/v1/models", "/llm", "/llm/",
                               "/llm//v1/models", "/llm/llm/v1/models", "/v1/llm/models", "/llm/v1/models/?q=1")] + \
         [("POST", "/llm/v1/completions/")]


def fastapi_answers(root_path: str, probes: list[tuple[str, str]]) -> list[tuple[int, str | None]]:
    """(status, Location's path and query) of each probe from a FastAPI app with ROUTES: what
    vLLM's server (FastAPI(root_path=args.root_path), redirect_slashes on) answers."""
    import warnings

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FastAPI's root_path argument is deprecated in favour of the server's
        app = FastAPI(root_path=root_path) if root_path else FastAPI()
    for method, path in ROUTES:
        app.add_api_route(path, lambda: {}, methods=[method])
    client = TestClient(app, follow_redirects=False)
    out = []
    for method, path in probes:
        r = client.request(method, path, json={})
        out.append((r.status_code, location(r.headers.get("location"))))
    return out


def location(value: str | None) -> str | None:
    return None if value is None else re.sub(r"^https?://[^/]+", "", value)


def taxirank_answers(call, flags: list[str], probes: list[tuple[str, str]]) -> list[tuple[int, str | None]]:
    body = {"prompt": [1, 2], "max_tokens": 1}
    answers = call(flags, *[(m, p, body if m == "POST" else None) for m, p in probes])
    # a route's 400 (this body is not its kind) counts as served: FastAPI's handler here takes anything
    return [(200 if s == 400 else s, location(h.get("Location"))) for s, h, _ in answers]


def test_trailing_slash_redirects_as_fastapi_does(call) -> None:
    want = fastapi_answers("", PROBES)
    got = taxirank_answers(call, [], PROBES)
    assert got == want
    assert got[1] == (307, "/v1/models") and got[3] == (307, "/v1/models?a=1&b=x%20y")  # (a check on the check)


def test_root_path_serves_prefixed_and_plain_paths_as_fastapi_does(call) -> None:
    probes = ROOTED + PROBES
    want = fastapi_answers("/llm", probes)
    got = taxirank_answers(call, ["--root-path", "/llm"], probes)
    assert got == want
    assert got[:4] == [(200, None), (307, "/llm/v1/models"), (200, None), (404, None)]


def test_redirect_location_is_absolute_on_the_clients_host_and_the_post_lands(call) -> None:
    body = {"prompt": [1, 2], "max_tokens": 1}
    (status, headers, _), (landed, _, answer) = call(
        ["--root-path", "/llm"], ("POST", "/llm/v1/completions/", body, {"Host": "proxy.example:81"}),
        ("POST", "/llm/v1/completions", body))
    assert status == 307 and headers["Location"] == "http://proxy.example:81/llm/v1/completions"
    assert landed == 200 and answer["usage"]["completion_tokens"] == 1


def test_api_key_guards_v1_under_the_root_path_before_any_redirect(call) -> None:
    flags = ["--root-path", "/llm", "--api-key", "k"]
    answers = call(flags, ("GET", "/llm/v1/models"), ("GET", "/llm/v1/models/"), ("GET", "/v1/models/"),
                   ("GET", "/llm/health"), ("GET", "/llm/v1/models", None, {"Authorization": "Bearer k"}),
                   ("POST", "/llm/reset_prefix_cache"))
    assert [a[0] for a in answers] == [401, 401, 401, 200, 200, 401]


@pytest.mark.parametrize("value, error", [("llm", "must start with '/'"), ("/llm/", "must not end with '/'"),
                                          ("/l m", "must be a URL path"), ("/llm?x", "must be a URL path")])
def test_a_bad_root_path_is_refused_naming_the_flag(value: str, error: str, capsys) -> None:
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--root-path", value])
    err = capsys.readouterr().err
    assert "--root-path" in err and error in err, err
    with pytest.raises(ValueError, match="--root-path"):
        cli_args.check_root_path(value)


def test_root_path_slash_or_empty_is_no_prefix() -> None:
    assert [cli_args.build_parser().parse_args(a).root_path for a in ([], ["--root-path", "/"], ["--root-path", ""])] \
        == ["", "", ""]
    assert cli_args.build_parser().parse_args(["--root-path", "/a/b"]).root_path == "/a/b"


# ---- --enable-log-outputs -----------------------------------------------------------------

def generated(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "taxirank.server" and r.levelno == level
            and r.getMessage().startswith("Generated response")]


def received_id(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")]
    return line.split()[2].rstrip(":")


def test_log_outputs_logs_whole_and_streamed_answers_cut_to_max_log_len(call, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="taxirank.server")
    flags = ["--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    ((_, _, whole),) = call(flags, ("POST", "/v1/chat/completions", chat))
    rid, choice = received_id(caplog), whole["choices"][0]
    assert generated(caplog) == [f"Generated response {rid}: output: {choice['message']['content'][:5]!r}, "
                                 f"finish_reason: length"]
    assert generated(caplog, logging.DEBUG) == [f"Generated response {rid} details: output_token_ids: "
                                                f"{choice['token_ids'][:5]}"]

    caplog.clear()
    ((_, _, chunks),) = call(flags, ("POST", "/v1/completions", {"prompt": "taxi", "max_tokens": 8, "temperature": 0.0,
                                                                 "ignore_eos": True, "stream": True}))
    rid = received_id(caplog)
    parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    text = "".join(p["text"] for p in parts)
    assert parts
    lines = generated(caplog)
    assert lines[:-1] == [f"Generated response {rid} (streaming delta): output: {p['text'][:5]!r}, finish_reason: "
                          f"{p['finish_reason']}" for p in parts]
    assert lines[-1] == f"Generated response {rid} (streaming complete): output: {text[:5]!r}, " \
                        f"finish_reason: streaming_complete"

    caplog.clear()  # --no-enable-log-deltas: a stream's line once complete only
    ((_, _, again),) = call(flags + ["--no-enable-log-deltas"], ("POST", "/v1/completions", {
        "prompt": "taxi", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True}))
    rid = received_id(caplog)
    assert "".join(c["choices"][0]["text"] for c in again if c["choices"]) == text
    assert generated(caplog) == [f"Generated response {rid} (streaming complete): output: {text[:5]!r}, "
                                 f"finish_reason: streaming_complete"]

    caplog.clear()
    call(["--enable-log-requests"], ("POST", "/v1/completions", {"prompt": "taxi", "max_tokens": 2}))
    assert received_id(caplog) and generated(caplog) == []  # requests logged, outputs not


def test_log_outputs_requires_log_requests_at_start_up(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        server.main(["--model", "tiny", "--port", "0", "--enable-log-outputs"])
    assert e.value.code == 2
    assert "--enable-log-outputs requires --enable-log-requests" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--enable-log-outputs requires --enable-log-requests"):
        cli_args.check_log_flags(cli_args.build_parser().parse_args(["--enable-log-outputs",
                                                                     "--no-enable-log-requests"]))
