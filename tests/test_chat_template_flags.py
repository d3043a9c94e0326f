"""vLLM's --chat-template-content-format and --default-chat-template-kwargs (chat_format.py),
served and offline (LLM.chat's chat_template_content_format).

Claims: a template that loops over a message's content parts is detected as "openai" and
gets every content as a list of {"type": "text"} parts (a plain string as one part, a tool
result joined, as vLLM hands them over), one that prints the content whole stays "string":
the prompt is what transformers' apply_chat_template renders from the messages in that
form, token for token, under "auto" and under the format named; start-up logs the format
detected. The default template variables reach the template, a request's key overrides
its default (a request's null or "auto" leaves it), and the reasoning parser reads the variables the
template got. A bad flag value is a start-up error naming the flag."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from conftest import make_hf_tokenizer, tiny_async_engine

import chat_format
import cli_args
import server
from chat_format import render_chat, thinking_enabled
from protocol import ApiError

# Loops over the parts (as Llama 4's, Gemma 3's, Qwen2-VL's templates do), and marks a
# string content "S:", so the prompt shows which form each message came in.
PARTS = ("{% for message in messages %}<{{ message['role'] }}>"
         "{% if message['content'] is string %}S:{{ message['content'] }}"
         "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
# Prints the content whole: a list would show as Python's repr under it.
WHOLE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
# Prints its variables, to see which reach it.
VARIABLES = ("{% for m in messages %}{{ m.content }}{% endfor %}|thinking={{ enable_thinking }}"
             "|effort={{ reasoning_effort }}|style={{ style }}")

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "fox"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"}, "b"]}]


def fresh() -> list[dict]:
    """A copy of MESSAGES (transformers' reference rewrites tool calls in place)."""
    return json.loads(json.dumps(MESSAGES))


def openai_form(messages: list[dict]) -> list[dict]:
    """The messages as vLLM's "openai" format hands them to a template, written out from
    its rule: text parts listed, a string content as one part, null beside tool calls as
    no parts, a tool result's parts joined by newlines."""
    out = []
    for m in messages:
        content = m["content"]
        parts = [] if content is None else [content] if isinstance(content, str) else [
            p if isinstance(p, str) else p["text"] for p in content]
        content = "\n".join(parts) if m["role"] == "tool" else [{"type": "text", "text": t} for t in parts]
        out.append({**m, "content": content})
    return out


def string_form(messages: list[dict]) -> list[dict]:
    """The messages as the "string" format hands them over: text parts joined by newlines."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "\n".join(p if isinstance(p, str) else p["text"] for p in content)
        out.append({**m, "content": "" if content is None else content})
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    make_hf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def reference(tokenizer, template: str, messages: list[dict], **kw) -> str:
    """transformers' rendering: the independent reference."""
    for m in messages:  # transformers' convention for tool calls: arguments an object
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=True, **kw)


def render(tokenizer, template: str, content_format: str, messages=MESSAGES, **body) -> str:
    return render_chat({"messages": json.loads(json.dumps(messages))} | body, tokenizer, chat_template=template,
                       content_format=content_format)


def test_a_template_that_loops_over_parts_is_detected_and_gets_them(tokenizer):
    assert chat_format.detect_content_format(PARTS) == "openai"
    want = reference(tokenizer, PARTS, openai_form(fresh()))
    assert "[the quick][fox]" in want and "<tool>S:a\nb" in want and "<system>[be brief]" in want  # the form's point
    assert render(tokenizer, PARTS, "auto") == render(tokenizer, PARTS, "openai") == want
    # as "string" every message takes the template's string branch
    assert render(tokenizer, PARTS, "string") != want
    assert render(tokenizer, PARTS, "string") == reference(tokenizer, PARTS, string_form(fresh()))


def test_a_template_that_prints_the_content_stays_string(tokenizer):
    assert chat_format.detect_content_format(WHOLE) == "string"
    want = reference(tokenizer, WHOLE, string_form(fresh()))
    assert "<user>the quick\nfox" in want
    assert render(tokenizer, WHOLE, "auto") == render(tokenizer, WHOLE, "string") == want
    # named "openai", it gets the lists (vLLM's rule: the flag wins over the detection)
    assert render(tokenizer, WHOLE, "openai") == reference(tokenizer, WHOLE, openai_form(fresh()))
    # the model's own template (make_hf_tokenizer's ChatML) is the one in effect without one
    assert chat_format.resolve_content_format("auto", tokenizer) == "string"


@pytest.mark.parametrize("template, want", [
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for p in m.content | list %}"
     "{{ p.text }}{% endfor %}{% endfor %}", "openai"),  # through a variable, a slice and a filter
    ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endgeneration %}"
     "{% endfor %}", "openai"),  # transformers' generation tag
    ("{% for c in messages[0]['content'] %}{{ c }}{% endfor %}", "string"),  # not a loop's message
    ("{% for m in history %}{% for p in m.content %}{% endfor %}{% endfor %}", "string"),  # not the messages
    ("{% for m in messages %}{{ m.content[0].text }}{% endfor %}", "string"),  # indexing is not looping (vLLM's)
    ("{% for m in messages %", "string"),  # no Jinja: rendering says so
])
def test_detection_follows_the_messages_as_vllms(template, want):
    assert chat_format.detect_content_format(template) == want


def test_non_text_parts_stay_refused_in_either_format(tokenizer):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    for fmt in ("auto", "openai", "string"):
        with pytest.raises(ApiError, match="'image_url' are not supported") as e:
            render(tokenizer, PARTS, fmt, image)
        assert e.value.param == "messages"


def test_default_kwargs_reach_the_template_and_the_request_overrides_them(tokenizer):
    defaults = {"enable_thinking": False, "style": "terse"}
    messages = [{"role": "user", "content": "hi"}]

    def both(body: dict) -> tuple[str, bool]:
        text = render_chat({"messages": messages} | body, tokenizer, chat_template=VARIABLES, default_kwargs=defaults)
        return text, thinking_enabled(body, defaults)

    def want(**variables) -> str:
        return reference(tokenizer, VARIABLES, [{"role": "user", "content": "hi"}], **variables)

    assert both({}) == (want(enable_thinking=False, style="terse"), False)
    assert both({"chat_template_kwargs": {"style": "long"}}) == (want(enable_thinking=False, style="long"), False)
    assert both({"chat_template_kwargs": {"enable_thinking": True}}) == (
        want(enable_thinking=True, style="terse"), True)
    # vLLM's merge (merge_kwargs' unset_values): a request's null or "auto" leaves the default
    assert both({"chat_template_kwargs": {"style": None}}) == (want(enable_thinking=False, style="terse"), False)
    assert both({"chat_template_kwargs": {"style": "auto", "enable_thinking": "auto"}}) == (
        want(enable_thinking=False, style="terse"), False)
    assert both({"chat_template_kwargs": {"style": "autos"}}) == (want(enable_thinking=False, style="autos"), False)
    # with no defaults, vLLM hands the request's variables over as they are, "auto" included
    text = render_chat({"messages": messages, "chat_template_kwargs": {"style": "auto"}}, tokenizer,
                       chat_template=VARIABLES)
    assert text == want(style="auto") and "|style=auto" in text
    # the request's reasoning_effort is the request's too: over the default, under its own kwargs
    assert both({"reasoning_effort": "high"}) == (
        want(enable_thinking=True, reasoning_effort="high", style="terse"), True)
    assert both({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}) == (
        want(enable_thinking=False, reasoning_effort="high", style="terse"), False)
    assert "thinking=False|effort=|style=terse" in both({})[0]  # the reference renders what is meant


def test_bad_values_are_refused_at_start_up(tokenizer, capsys):
    from tokenizer import ByteTokenizer

    parser = cli_args.build_parser()
    for value, says in (("{bad", "not valid JSON"), ("[1]", "expected a JSON object"), ("3", "expected a JSON object")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--default-chat-template-kwargs", value])
        assert f"argument --default-chat-template-kwargs: {says}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--chat-template-content-format", "json"])
    assert "argument --chat-template-content-format: invalid choice: 'json'" in capsys.readouterr().err
    # the render's own arguments, refused before the model loads (main), and against the model's tokenizer
    with pytest.raises(SystemExit):
        server.main(["--model", "no/such/model", "--default-chat-template-kwargs", '{"return_dict": true}'])
    assert "--default-chat-template-kwargs may not set return_dict" in capsys.readouterr().err
    for kwargs in ({"tokenize": True}, {"chat_template": "x", "messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(ValueError, match="--default-chat-template-kwargs may not set"):
            chat_format.check_default_kwargs(kwargs, tokenizer)
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: this model's ByteTokenizer takes no"):
        chat_format.check_default_kwargs({"enable_thinking": False}, ByteTokenizer())
    with pytest.raises(ValueError, match="--chat-template-content-format 'openai' needs a Jinja chat template"):
        chat_format.check_content_format("openai", ByteTokenizer())
    assert chat_format.resolve_content_format("auto", ByteTokenizer()) == "string"


def test_a_config_file_may_write_the_defaults_as_a_mapping(tmp_path):
    import config_file

    (tmp_path / "c.yaml").write_text("default-chat-template-kwargs: {enable_thinking: false}\n"
                                     "chat-template-content-format: openai\n")
    args = config_file.parse_args(cli_args.build_parser(), ["--config", str(tmp_path / "c.yaml")])
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert args.chat_template_content_format == "openai"


@pytest.fixture(scope="module")
def served(tokenizer):
    """call(flags, path, body) -> (status, JSON) from an app on the tiny model that renders
    with the HF tokenizer, with the qwen3 reasoning parser."""
    from aiohttp.test_utils import TestClient, TestServer

    with tiny_async_engine(tokenizer=tokenizer, reasoning_parser="qwen3") as (loop, engine):
        async def one(flags: list[str], path: str, body: dict) -> tuple[int, dict]:
            app = server.app_from_args(engine, cli_args.build_parser().parse_args(flags))
            async with TestClient(TestServer(app)) as client:
                resp = await client.post(path, json=body)
                return resp.status, json.loads(await resp.text())

        yield lambda flags, path, body: loop.run_until_complete(asyncio.wait_for(one(flags, path, body), 300))


def test_the_server_renders_with_the_flags_and_logs_the_format(served, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="taxirank.server")
    body = {"messages": MESSAGES}
    want = tokenizer.encode(reference(tokenizer, PARTS, openai_form(fresh())),
                            add_special_tokens=False)
    for fmt in ("auto", "openai"):
        status, out = served(["--chat-template", PARTS, "--chat-template-content-format", fmt], "/tokenize", body)
        assert status == 200 and out["tokens"] == want, out
    logged = [r.getMessage() for r in caplog.records if r.name == "taxirank.server"]
    assert ("Detected the chat template content format to be 'openai'. You can set "
            "`--chat-template-content-format` to override this.") in logged
    caplog.clear()
    hi = [{"role": "user", "content": "hi"}]
    status, out = served(["--chat-template-content-format", "openai"], "/tokenize", {"messages": hi})
    # the model's ChatML prints the list whole, as transformers renders it; start-up said so
    text = tokenizer.apply_chat_template(openai_form(hi), tokenize=False, add_generation_prompt=True)
    assert "[{'type': 'text', 'text': 'hi'}]" in text
    assert status == 200 and out["tokens"] == tokenizer.encode(text, add_special_tokens=False), out
    assert any("`--chat-template-content-format openai` which is different from the detected format 'string'"
               in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    # a trusted request's own template is detected when it comes
    status, out = served(["--trust-request-chat-template"], "/tokenize", body | {"chat_template": PARTS})
    assert status == 200 and out["tokens"] == want
    # the defaults reach the template; the request's key overrides
    flags = ["--chat-template", VARIABLES, "--default-chat-template-kwargs", '{"enable_thinking": false, "style": "x"}']
    for kwargs, variables in (({}, {"enable_thinking": False, "style": "x"}),
                              ({"style": "y"}, {"enable_thinking": False, "style": "y"})):
        status, out = served(flags, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                                  "chat_template_kwargs": kwargs})
        text = reference(tokenizer, VARIABLES, [{"role": "user", "content": "hi"}], **variables)
        assert status == 200 and out["tokens"] == tokenizer.encode(text, add_special_tokens=False), (kwargs, text)
    with pytest.raises(ValueError, match="--default-chat-template-kwargs may not set tokenize"):
        served(["--default-chat-template-kwargs", '{"tokenize": true}'], "/tokenize", body)


# transformers' `{% generation %}` tag (SmolLM3's, for training masks): its chat-template
# environment adds the extension, so it renders; plain jinja2 knows no such tag.
GENERATION = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}"
              "{% generation %}{{ m.content }}<|end|>{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_start_up_accepts_what_transformers_renders_and_refuses_what_it_refuses(served, tokenizer):
    import jinja2

    with pytest.raises(jinja2.TemplateSyntaxError, match="generation"):
        jinja2.Environment().parse(GENERATION)  # what start-up parsed with before
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    text = reference(tokenizer, GENERATION, json.loads(json.dumps(chat)))
    # transformers' trim_blocks takes the newline after {% endif %}
    assert text == "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|><|user|>again<|end|><|assistant|>"
    want = tokenizer.encode(text, add_special_tokens=False)
    status, out = served(["--chat-template", GENERATION], "/tokenize", {"messages": chat})
    assert status == 200 and out["tokens"] == want, out
    status, out = served(["--chat-template", GENERATION], "/v1/chat/completions",
                         {"messages": chat, "max_tokens": 1, "temperature": 0.0})
    assert status == 200 and out["usage"]["prompt_tokens"] == len(want), out

    # start-up's verdict is transformers': each template renders there exactly when start-up takes it
    for template in (GENERATION, "{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}",
                     "{{ messages | no_such_filter }}", "{% for m in messages %}{% break %}{% endfor %}",
                     "{% no_such_tag %}", "{{ messages[0].content | tojson(indent=2) }}"):
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template, tokenize=False)
            renders = True
        except jinja2.TemplateError:
            renders = False
        try:
            cli_args.check_chat_template(template, tokenizer)
            taken = True
        except ValueError as e:
            assert str(e).startswith("--chat-template is not a valid Jinja template: "), e
            taken = False
        assert taken == renders, template


def test_the_reasoning_parser_reads_the_merged_variables(served):
    """qwen3's parser: with thinking off, output that opens no <think> is content; on, with
    no end tag, all of it is reasoning. Whether it is off is the merged enable_thinking."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.0,
            "allowed_token_ids": list(range(70, 90))}  # letters of the byte-level alphabet: no tag, no EOS

    def answer(flags: list[str], kwargs: dict) -> dict:
        status, out = served(flags, "/v1/chat/completions", body | {"chat_template_kwargs": kwargs})
        assert status == 200, out
        return out["choices"][0]["message"]

    off = ["--default-chat-template-kwargs", '{"enable_thinking": false}']
    on_by_default, off_by_flag = answer([], {}), answer(off, {})
    assert on_by_default["reasoning"] and not on_by_default["content"]
    assert off_by_flag["content"] == on_by_default["reasoning"] and not off_by_flag.get("reasoning")
    on_by_request = answer(off, {"enable_thinking": True})
    assert on_by_request["reasoning"] == on_by_default["reasoning"] and not on_by_request["content"]


def test_offline_chat_takes_the_content_format(tokenizer):
    from llm import LLM
    from sampling_params import SamplingParams

    llm = LLM("tiny", max_num_seqs=2, max_model_len=128, warmup=False, log=lambda *_: None)
    with pytest.raises(ValueError, match="chat_template_content_format 'openai' needs a Jinja chat template"):
        llm.chat(MESSAGES[:2], chat_template_content_format="openai")
    llm.tokenizer = tokenizer  # renders with the HF tokenizer from here on
    params = SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=list(range(70, 90)))
    want = reference(tokenizer, PARTS, openai_form(fresh()))
    for fmt in ("auto", "openai"):  # vLLM's default: auto
        (out,) = llm.chat(fresh(), params, chat_template=PARTS,
                          **({} if fmt == "auto" else {"chat_template_content_format": fmt}))
        assert out.prompt == want and out.prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)
    (out,) = llm.chat(fresh(), params, chat_template=PARTS,
                      chat_template_content_format="string")
    assert out.prompt == reference(tokenizer, PARTS, string_form(fresh()))
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        llm.chat(MESSAGES[:2], chat_template_content_format="json")
    # vLLM's tools argument: rendered by a template that shows them, checked as a request's
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    shows = "{{ tools | tojson }}|" + WHOLE
    (out,) = llm.chat(MESSAGES[:1], params, chat_template=shows, tools=tools)
    assert out.prompt == tokenizer.apply_chat_template(MESSAGES[:1], tools=tools, chat_template=shows,
                                                       tokenize=False, add_generation_prompt=True)
    # tools=[] reaches the template as [] (vLLM's LLM.chat hands it to transformers as it is)
    (out,) = llm.chat(MESSAGES[:1], params, chat_template=shows, tools=[])
    assert out.prompt == tokenizer.apply_chat_template(MESSAGES[:1], tools=[], chat_template=shows,
                                                       tokenize=False, add_generation_prompt=True)
    assert out.prompt.startswith("[]|")
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        llm.chat(MESSAGES[:1], params, chat_template=shows, tools=[{"type": "retrieval"}])


def test_an_assistant_message_with_null_content_and_no_calls_renders_empty_as_vllms(tokenizer):
    """A reasoning-only answer (content null, as the server sends one back) replayed as
    history: no parts, as vLLM hands over a null content, in either format."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "reasoning": "hmm"},
                {"role": "user", "content": "and?"}]
    for template, form in ((WHOLE, string_form), (PARTS, openai_form)):
        want = reference(tokenizer, template, form(json.loads(json.dumps(messages))))
        assert render(tokenizer, template, "auto", messages) == want


# Prints each assistant's calls, or that it has none.
CALLS = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.tool_calls is defined %}"
         "{% for c in m.tool_calls %}[{{ c.function.name }}({{ c.function.arguments | tojson }})]{% endfor %}"
         "{% else %}(no calls){% endif %}\n{% endfor %}")


def test_earlier_calls_without_arguments_reach_the_template_as_an_empty_object_as_vllms(tokenizer):
    """vLLM's rule for an assistant's earlier calls: arguments left out, null, "", or JSON
    that is no object (null, 42, a list, a string, true) or no JSON at all (a model's own
    broken call, sent back) are {}; an empty tool_calls list is none (the template's plain path)."""
    def turn(calls: list | None) -> dict:
        return {"role": "assistant", "content": None} | ({} if calls is None else {"tool_calls": calls})

    def call(name: str, **arguments) -> dict:
        return {"id": name, "type": "function", "function": {"name": name, **arguments}}

    sent = [{"role": "user", "content": "hi"},
            turn([call("a"), call("b", arguments=None), call("c", arguments=""), call("d", arguments="null"),
                  call("e", arguments="42"), call("f", arguments="[1]"), call("g", arguments='"x"'),
                  call("h", arguments="true"), call("i", arguments='{"q": '), call("j", arguments="  ")]),
            turn([]), {"role": "user", "content": "x"}]
    want = [sent[0], {"role": "assistant", "content": "", "tool_calls": [
        call(n, arguments={}) for n in "abcdefghij"]}, {"role": "assistant", "content": ""}, sent[3]]
    assert render(tokenizer, CALLS, "auto", sent) == tokenizer.apply_chat_template(
        want, chat_template=CALLS, tokenize=False, add_generation_prompt=True)
