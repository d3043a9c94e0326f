"""The server's tool flags as vLLM reads them, through the flags (server.app_from_args) and
HTTP, on the tiny model with a chat template that renders tools.

Claims: tool_choice "none" puts the tools in the prompt (vLLM's default: the template
renders them, the model calls nothing and the answer has no tool_calls), and
--exclude-tools-when-tool-choice-none keeps them out; "none" still checks the tools.
--tool-call-parser without --enable-auto-tool-choice parses nothing, as vLLM: "auto" (the
default with tools) is vLLM's 400, a named or "required" call still works (constrained, no
parser), and start-up says the parser is unused."""

from __future__ import annotations

import asyncio
import json
import logging

import jinja2
import pytest

from conftest import tiny_async_engine
from tokenizer import ByteTokenizer

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "f"}}
MESSAGES = [{"role": "user", "content": "hi"}]
CHATML = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
# What the template below writes for WEATHER, spelled out here, not rendered by it: vLLM's
# dump of the tool (ChatCompletionToolsParam.model_dump()), in its fields' order, nulls kept.
WITH_TOOLS = ('<tools>[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]'
              '</tools>\n' + CHATML)


def tojson(value: object) -> str:
    """transformers' tojson filter for chat templates: keys in their order (not sorted, as
    Jinja's own tojson would)."""
    return json.dumps(value, ensure_ascii=False)


class ToolsTemplate(ByteTokenizer):
    """Bytes, with a Jinja chat template that renders the tools first, as tool-calling
    models' templates do (SmolLM2's and the test tokenizers' render none)."""

    environment = jinja2.Environment()
    environment.filters["tojson"] = tojson
    TEMPLATE = environment.from_string(
        "{% if tools is not none %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None):
        text = self.TEMPLATE.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def post():
    """post(flags, body) -> (status, json): one request to an app built from `flags`, all
    on one tiny engine (test_request_metrics' shapes: its programs are cached)."""
    from aiohttp.test_utils import TestClient, TestServer

    import cli_args
    import server

    # ToolsTemplate: what the server renders chats with; same bytes as the engine's
    with tiny_async_engine(ToolsTemplate(), max_model_len=256) as (loop, engine):  # room for the tools
        async def one(flags: list[str], body: dict, path: str) -> tuple[int, dict]:
            app = server.app_from_args(engine, cli_args.build_parser().parse_args(flags))
            sampling = {"max_tokens": 1, "temperature": 0.0} if path == CHAT else {}
            async with TestClient(TestServer(app)) as client:
                resp = await client.post(path, json={"messages": MESSAGES} | sampling | body)
                return resp.status, json.loads(await resp.text())

        yield lambda flags, body, path=CHAT: loop.run_until_complete(asyncio.wait_for(one(flags, body, path), 300))


def prompt_tokens(text: str) -> int:
    return len(text.encode())  # one id per byte; the template's text carries no bos


@pytest.mark.parametrize("flags", [[], ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]])
def test_tool_choice_none_renders_the_tools_and_calls_nothing(post, flags):
    status, out = post(flags, {"tools": [WEATHER], "tool_choice": "none"})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == prompt_tokens(WITH_TOOLS)
    choice = out["choices"][0]
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "length"
    status, out = post(flags, {})  # no tools: none rendered
    assert status == 200 and out["usage"]["prompt_tokens"] == prompt_tokens(CHATML), out


@pytest.mark.parametrize("exclude", [False, True])
def test_exclude_tools_when_tool_choice_none_keeps_them_out_of_the_prompt_only_for_none(post, exclude):
    flags = ["--exclude-tools-when-tool-choice-none"] * exclude + ["--enable-auto-tool-choice", "--tool-call-parser",
                                                                   "hermes"]
    status, out = post(flags, {"tools": [WEATHER], "tool_choice": "none"})
    assert status == 200 and out["usage"]["prompt_tokens"] == prompt_tokens(CHATML if exclude else WITH_TOOLS), out
    for choice in ("required", "auto", {"type": "function", "function": {"name": "f"}}):  # the template sees them
        status, out = post(flags, {"tools": [WEATHER], "tool_choice": choice})
        assert status == 200 and out["usage"]["prompt_tokens"] == prompt_tokens(WITH_TOOLS), (choice, out)


@pytest.mark.parametrize("exclude", [False, True])
def test_a_null_tool_choice_without_auto_tool_choice_renders_the_tools_and_calls_nothing_as_vllm(post, exclude):
    """vLLM defaults only a left-out tool_choice to "auto" (check_tool_usage) and refuses
    "auto" alone without its flags (online_renderer.py): a null one passes, its tools
    rendered (not "none", so not left out), its output content."""
    status, out = post(["--exclude-tools-when-tool-choice-none"] * exclude, {"tools": [WEATHER], "tool_choice": None})
    assert status == 200 and out["usage"]["prompt_tokens"] == prompt_tokens(WITH_TOOLS), out
    assert not out["choices"][0]["message"].get("tool_calls")


def test_tool_choice_none_still_checks_the_tools(post):
    status, out = post([], {"tools": [{"type": "function"}], "tool_choice": "none"})
    assert status == 400 and out["error"]["param"] == "tools", out
    status, out = post([], {"tool_choice": "none"})  # "none" without tools is fine, as vLLM
    assert status == 200, out


def test_a_tool_or_tool_choice_without_its_type_is_a_function_as_vllms(post):
    """vLLM's default type "function": a tool left without one is rendered with it (the
    same prompt as WEATHER's), and a named tool_choice without one names that function."""
    untyped = {"function": {"name": "f"}}
    status, out = post([], {"tools": [untyped], "tool_choice": "none"})
    assert status == 200 and out["usage"]["prompt_tokens"] == prompt_tokens(WITH_TOOLS), out
    status, out = post([], {"tools": [untyped], "tool_choice": {"function": {"name": "f"}}})
    assert status == 200 and out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f", out
    for tools, choice in (([{"type": "retrieval", "function": {"name": "f"}}], "none"),
                          ([WEATHER], {"type": "tool", "function": {"name": "f"}})):
        status, out = post([], {"tools": tools, "tool_choice": choice})
        assert status == 400, out


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_an_empty_tools_array_is_a_400_as_vllms_and_openais(post, choice):
    """vLLM's check_tool_usage (and OpenAI): `tools: []` is refused, whatever tool_choice
    says, rather than served as a request without tools."""
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    status, out = post(flags, {"tools": []} | ({} if choice is None else {"tool_choice": choice}))
    assert status == 400 and out["error"]["param"] == "tools", out
    assert "`tools` must not be an empty array" in out["error"]["message"]


def test_tokenize_renders_whatever_tools_it_gets_and_reads_no_tool_choice_as_vllm(post):
    """vLLM's tokenize request has `tools` and no tool_choice: the tools reach the template
    as they are, [] included, whatever tool_choice (an unread field there) or
    --exclude-tools-when-tool-choice-none say; bad tools are still a 400."""
    for flags, body in (([], {"tools": [WEATHER]}), ([], {"tools": [WEATHER], "tool_choice": "auto"}),
                        (["--exclude-tools-when-tool-choice-none"], {"tools": [WEATHER], "tool_choice": "none"})):
        status, out = post(flags, body, "/tokenize")
        assert status == 200 and out["count"] == prompt_tokens(WITH_TOOLS), (body, out)
    status, out = post([], {"tools": [], "tool_choice": "required"}, "/tokenize")
    assert status == 200 and out["count"] == prompt_tokens("<tools>[]</tools>\n" + CHATML), out  # [], not none
    status, out = post([], {"tools": [{"type": "retrieval"}]}, "/tokenize")
    assert status == 400 and out["error"]["param"] == "tools", out


def test_a_tool_call_parser_without_auto_tool_choice_parses_nothing(post, caplog):
    parser_only = ["--tool-call-parser", "hermes"]
    with caplog.at_level(logging.WARNING, logger="taxirank.server"):
        status, out = post(parser_only, {"tools": [WEATHER]})  # tool_choice left out: "auto"
    assert "--tool-call-parser hermes is unused without --enable-auto-tool-choice" in caplog.text
    assert status == 400 and out["error"]["param"] == "tool_choice", out
    assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser' in out["error"]["message"]
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):  # constrained: no parser needed
        status, out = post(parser_only, {"tools": [WEATHER], "tool_choice": choice})
        assert status == 200, (choice, out)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="taxirank.server"):
        status, out = post(["--enable-auto-tool-choice"] + parser_only, {"tools": [WEATHER]})
    assert status == 200 and "unused" not in caplog.text, out


def test_tools_reach_the_template_as_vllms_dump_of_them(post):
    """vLLM parses `tools` into ChatCompletionToolsParam and hands the template
    tool.model_dump(): its own fields only (a client's extra keys dropped), in its order
    (type, function; name, description, parameters), description and parameters null
    where left out, strict and defer_loading only where set, a tool's defer_loading its
    function's too. A chat request and /tokenize render the same text."""
    params = {"properties": {}, "type": "object"}  # as sent, in its order
    sent = {"function": {"parameters": params, "name": "f", "strict": True, "x-extra": 1}, "defer_loading": True,
            "type": "function", "extra": 2}
    dumped = {"type": "function", "function": {"name": "f", "description": None, "parameters": params, "strict": True,
                                               "defer_loading": True}, "defer_loading": True}
    want = "<tools>" + tojson([dumped]) + "</tools>\n" + CHATML
    status, out = post([], {"tools": [sent]}, "/tokenize")
    assert status == 200 and bytes(out["tokens"]).decode() == want, out
    status, out = post([], {"tools": [sent], "tool_choice": "none", "return_token_ids": True})
    assert status == 200 and bytes(out["prompt_token_ids"]).decode() == want, out
    for bad in ({"strict": "yes"}, {"defer_loading": 1}):
        tool = {"type": "function", "function": {"name": "f"} | bad}
        status, out = post([], {"tools": [tool]}, "/tokenize")
        assert status == 400 and out["error"]["param"] == "tools", out
