"""--chat-template, --trust-request-chat-template and --response-role, and the /tokenize,
/detokenize and /version endpoints that render with them, as vLLM's.

Claims: the server's template (inline, or a file's) replaces the model's: the prompt is
what Jinja renders from it, token for token; a request's own template is vLLM's 400
unless trusted, then used; a chat answer's role is --response-role for a new turn and the
continued message's otherwise, whole and streamed; a template that is no Jinja, a path
that is no file, or a tokenizer that takes no template are refused at start-up."""

from __future__ import annotations

import argparse
import asyncio
import json

import jinja2
import pytest
from conftest import make_hf_checkpoint

from config import EngineConfig

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox"}]


def rendered_ids(tokenizer, template: str, add_generation_prompt: bool = True) -> list[int]:
    text = jinja2.Template(template).render(messages=MESSAGES, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def post(tmp_path_factory):
    """post(flags, body) -> (status, whole response, first stream delta or None)."""
    from aiohttp.test_utils import TestClient, TestServer

    import cli_args
    import server
    from async_engine import AsyncEngine

    path = make_hf_checkpoint(tmp_path_factory.mktemp("tpl"), tokenizer=True)
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(EngineConfig(model=path, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128,
                                      num_kv_blocks=24, warmup=False), log=lambda *_: None)
    loop.run_until_complete(engine.start())

    async def one(flags: list[str], body: dict) -> tuple[int, dict, dict | None]:
        app = server.app_from_args(engine, cli_args.build_parser().parse_args(flags))
        body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0.0} | body
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/chat/completions", json=body)
            out = json.loads(await resp.text())
            if resp.status != 200:
                return resp.status, out, None
            resp = await client.post("/v1/chat/completions", json=body | {"stream": True})
            first = json.loads((await resp.text()).split("\n\n")[0][6:])
            return 200, out, first["choices"][0]["delta"]

    yield engine, lambda flags, body: loop.run_until_complete(asyncio.wait_for(one(flags, body), 300))
    loop.run_until_complete(engine.shutdown())
    loop.close()


def test_the_servers_template_inline_or_from_a_file_is_what_the_prompt_renders(post, tmp_path):
    engine, run = post
    want = len(rendered_ids(engine.tokenizer, TEMPLATE))
    status, out, _ = run([], {})
    assert status == 200 and out["usage"]["prompt_tokens"] != want  # the model's own ChatML template
    status, out, _ = run(["--chat-template", TEMPLATE], {})
    assert status == 200 and out["usage"]["prompt_tokens"] == want, out
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    status, out, _ = run(["--chat-template", str(tmp_path / "t.jinja")], {})
    assert status == 200 and out["usage"]["prompt_tokens"] == want, out


def test_a_requests_own_template_needs_the_trust_flag(post):
    engine, run = post
    status, out, _ = run([], {"chat_template": TEMPLATE})
    assert status == 400 and out["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template is not set" in out["error"]["message"]
    status, out, _ = run(["--trust-request-chat-template"], {"chat_template": TEMPLATE})
    assert status == 200 and out["usage"]["prompt_tokens"] == len(rendered_ids(engine.tokenizer, TEMPLATE))
    status, out, _ = run(["--trust-request-chat-template"], {"chat_template": 5})
    assert status == 400 and out["error"]["param"] == "chat_template"


def test_the_answers_role_is_the_response_role_or_the_continued_messages(post):
    _, run = post
    status, out, first = run(["--response-role", "bot"], {})
    assert status == 200 and out["choices"][0]["message"]["role"] == "bot" and first["role"] == "bot"
    status, out, first = run(["--response-role", "bot"], {"add_generation_prompt": False})
    assert status == 200 and out["choices"][0]["message"]["role"] == "user" and first["role"] == "user"
    status, out, first = run([], {})
    assert out["choices"][0]["message"]["role"] == "assistant" == first["role"]


def test_a_template_file_that_is_not_utf8_is_refused_naming_it(tmp_path, capsys):
    import cli_args

    path = tmp_path / "t.jinja"
    path.write_bytes(b"\xff\xfe{{ messages }}")  # (a UTF-16 byte-order mark)
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--chat-template", str(path)])
    assert f"argument --chat-template: '{path}' is not UTF-8 text (" in capsys.readouterr().err


def test_bad_templates_are_refused_at_start_up(post, capsys):
    import cli_args
    import server
    from tokenizer import ByteTokenizer

    engine, _ = post
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--chat-template", "no/such/template.jinja"])
    assert "looks like a file path, but it cannot be opened" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        cli_args.load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        server.build_app(engine, ["m"], chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer; this model has ByteTokenizer"):
        cli_args.check_chat_template(TEMPLATE, ByteTokenizer())


def test_tokenize_and_detokenize_as_vllms(post):
    """/tokenize renders messages as a chat request does (its template flags too) and
    encodes a prompt with the tokenizer's special tokens; /detokenize inverts it."""
    from aiohttp.test_utils import TestClient, TestServer

    import cli_args
    import server

    engine, _ = post
    tok = engine.tokenizer

    async def call(flags: list[str], path: str, body: dict) -> tuple[int, dict]:
        app = server.app_from_args(engine, cli_args.build_parser().parse_args(flags))
        async with TestClient(TestServer(app)) as client:
            resp = await client.post(path, json=body)
            return resp.status, json.loads(await resp.text())

    def run(flags: list[str], path: str, body: dict) -> tuple[int, dict]:
        return asyncio.run(call(flags, path, body))

    status, out = run(["--chat-template", TEMPLATE], "/tokenize", {"messages": MESSAGES, "return_token_strs": True})
    want = rendered_ids(tok, TEMPLATE)
    assert status == 200 and out == {"count": len(want), "max_model_len": 128, "tokens": want,
                                     "token_strs": tok.convert_ids_to_tokens(want)}, out
    status, out = run([], "/tokenize", {"prompt": "the lazy dog"})
    assert status == 200 and out["tokens"] == tok.encode("the lazy dog") and out["token_strs"] is None
    # longer than max_model_len: counted all the same (vLLM's tokenize checks no length)
    status, out = run([], "/tokenize", {"prompt": "the lazy dog " * 50})
    assert status == 200 and out["tokens"] == tok.encode("the lazy dog " * 50) and out["count"] > 128, out
    status, out = run([], "/tokenize", {"prompt": "the lazy dog", "add_special_tokens": False})
    assert out["tokens"] == tok.encode("the lazy dog", add_special_tokens=False)
    status, back = run([], "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(out["tokens"])}
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/tokenize", {"messages": MESSAGES, "add_special_tokens": "yes"}, "add_special_tokens")):
        status, out = run([], path, body)
        assert status == 400 and out["error"]["param"] == param, (path, body, out)

    async def version() -> dict:
        async with TestClient(TestServer(server.build_app(engine, ["m"]))) as client:
            return await (await client.get("/version")).json()

    assert asyncio.run(version()) == {"version": "0.1.0"}
