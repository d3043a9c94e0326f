"""Cross-origin requests: the server's CORS answers are Starlette's CORSMiddleware's (what
vLLM's server runs), request for request, for vLLM's four flags; a preflight is answered
before the API key is asked for, and every cross-origin answer (errors and streams too)
carries the headers a browser needs to read it."""

from __future__ import annotations

import asyncio

import pytest

import cli_args
import config_file
import server
from conftest import tiny_async_engine
from cors import CorsPolicy

cors_reference = pytest.importorskip("starlette.middleware.cors")

ORIGIN, OTHER = "https://a.example", "https://b.example"
CORS_HEADERS = ("access-control-allow-origin", "access-control-allow-credentials", "access-control-allow-methods",
                "access-control-allow-headers", "access-control-max-age")
POLICIES = [
    CorsPolicy(),  # vLLM's defaults: any origin, method and header
    CorsPolicy(origins=[ORIGIN]),
    CorsPolicy(credentials=True),
    CorsPolicy(origins=[ORIGIN], credentials=True, methods=["GET", "POST"], headers=["X-Custom", "Authorization"]),
]


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": method} | (
        {"Access-Control-Request-Headers": headers} if headers is not None else {})


REQUESTS = [  # (method, path, headers)
    ("OPTIONS", "/v1/chat/completions", preflight(ORIGIN)),
    ("OPTIONS", "/v1/chat/completions", preflight(OTHER)),
    ("OPTIONS", "/v1/chat/completions", preflight(ORIGIN, "PUT")),
    ("OPTIONS", "/v1/chat/completions", preflight(ORIGIN, "POST", "Content-Type, X-Custom")),
    ("OPTIONS", "/v1/chat/completions", preflight(ORIGIN, "POST", "x-other")),
    ("OPTIONS", "/v1/models", preflight(OTHER, "DELETE", "authorization")),
    ("OPTIONS", "/v1/models", preflight(ORIGIN, "GET") | {"Access-Control-Request-Private-Network": "true"}),
    ("GET", "/v1/models", {"Origin": ORIGIN}),
    ("GET", "/v1/models", {"Origin": OTHER}),
    ("GET", "/v1/models", {"Origin": ORIGIN, "Cookie": "a=1"}),
    ("GET", "/v1/models", {}),
]


def starlette_answer(policy: CorsPolicy, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    """What Starlette's CORSMiddleware (vLLM's) answers, around an app that answers 200."""
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"inner"})

    app = cors_reference.CORSMiddleware(inner, allow_origins=list(policy.origins),
                                        allow_credentials=policy.credentials, allow_methods=list(policy.methods),
                                        allow_headers=list(policy.headers))
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": "", "http_version": "1.1"}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}


def cors_view(status: int, headers: dict[str, str], preflight: bool) -> tuple:
    """The parts of an answer CORS decides: a preflight's status, the Access-Control-*
    headers (header lists as sets), and whether the answer varies with the Origin."""
    def norm(name: str) -> object:
        value = headers.get(name)
        if value is not None and name in ("access-control-allow-methods", "access-control-allow-headers"):
            return frozenset(v.strip().lower() for v in value.split(","))
        return value
    return (status if preflight else None, tuple(norm(h) for h in CORS_HEADERS),
            "origin" in headers.get("vary", "").lower())


@pytest.fixture(scope="module")
def answers():
    """Each policy's app (with an API key: preflights never need it) asked every request."""
    from aiohttp.test_utils import TestClient, TestServer

    out = {}
    with tiny_async_engine() as (loop, engine):
        async def ask(policy: CorsPolicy) -> list[tuple[int, dict, str]]:
            async with TestClient(TestServer(server.build_app(engine, ["tiny"], api_key="K", cors=policy))) as c:
                got = []
                for method, path, headers in REQUESTS:
                    resp = await c.request(method, path, headers=headers | {"Authorization": "Bearer K"}
                                           if method != "OPTIONS" else headers)
                    got.append((resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.text()))
                wrong_key = await c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer no"})
                got.append((wrong_key.status, {k.lower(): v for k, v in wrong_key.headers.items()}, ""))
                stream = await c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "stream": True},
                                      headers={"Origin": ORIGIN, "Authorization": "Bearer K"})
                body = await stream.text()
                got.append((stream.status, {k.lower(): v for k, v in stream.headers.items()}, body))
                return got

        for i, policy in enumerate(POLICIES):
            out[i] = loop.run_until_complete(asyncio.wait_for(ask(policy), 300))
    return out


@pytest.mark.parametrize("p", range(len(POLICIES)))
def test_every_answer_is_starlettes_cors_answer(answers, p):
    policy = POLICIES[p]
    for (method, path, headers), (status, got, text) in zip(REQUESTS, answers[p]):
        is_preflight = method == "OPTIONS"
        want_status, want = starlette_answer(policy, method, path, headers)
        assert cors_view(status, got, is_preflight) == cors_view(want_status, want, is_preflight), \
            (policy, method, headers, got, want)
        if is_preflight and status == 400:
            assert text.startswith("Disallowed CORS "), text
        if not is_preflight:
            assert status == 200, (policy, headers, text)  # the API's own answer, the key checked


def test_errors_and_streams_carry_the_headers_a_browser_needs_to_read_them(answers):
    for p, policy in enumerate(POLICIES):
        *_, (key_status, key_headers, _), (stream_status, stream_headers, body) = answers[p]
        want = "*" if "*" in policy.origins and not policy.credentials else ORIGIN
        assert key_status == 401 and key_headers["access-control-allow-origin"] == want
        assert stream_status == 200 and stream_headers["access-control-allow-origin"] == want
        assert stream_headers["content-type"].startswith("text/event-stream") and body.rstrip().endswith("[DONE]")
        assert ("access-control-allow-credentials" in stream_headers) == policy.credentials


def test_the_flags_take_json_lists_on_the_command_line_and_yaml_lists_in_a_config_file(tmp_path, capsys):
    parser = cli_args.build_parser()
    args = parser.parse_args(["--allowed-origins", f'["{ORIGIN}"]', "--allow-credentials",
                              "--allowed-methods", '["GET", "POST"]'])
    assert (args.allowed_origins, args.allow_credentials, args.allowed_methods, args.allowed_headers) == \
        ([ORIGIN], True, ["GET", "POST"], ["*"])
    for bad in ("*", "[1]", '{"a": 1}', "[\"\"]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--allowed-origins", bad])
        assert "--allowed-origins: expected a JSON list of strings" in capsys.readouterr().err
    path = tmp_path / "c.yaml"
    path.write_text(f"allowed-origins: [{ORIGIN}]\nallowed-headers: [X-Custom]\n")
    args = config_file.parse_args(parser, ["--config", str(path)])
    assert (args.allowed_origins, args.allowed_headers) == ([ORIGIN], ["X-Custom"])
    path.write_text("allowed-origins: [1, 2]\n")
    with pytest.raises(SystemExit):
        config_file.parse_args(parser, ["--config", str(path)])
    with pytest.raises(ValueError, match="allowed origins must be a list of non-empty strings"):
        CorsPolicy(origins="*")
