"""Structured outputs on the real model, smollm2, behind the OpenAI API (its own file so
that it alone compiles at full optimisation: tests/conftest.py's REAL_MODEL_FILES).

Claims: at temperature 0 and 1, every output under a JSON schema, regex or choice parses
and validates, streamed or not (response_format, structured_outputs, guided_*, a forced
tool call); tool_choice auto finds the hermes call in the output; a bad constraint is a
400 with llguidance's message before admission."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Iterator

import jsonschema
import openai
import pytest

OBJ = {"type": "object", "additionalProperties": False}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return OBJ | {"properties": props, "required": list(props) if required is None else required}


NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"city": NAME, "country": NAME}),
    obj({"answer": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"level": {"type": "integer", "minimum": 1, "maximum": 5}, "ok": {"type": "boolean"}}),
    obj({"score": {"type": "number", "minimum": 0, "maximum": 10}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    obj({"point": obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                       "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    obj({"user": obj({"name": NAME, "admin": {"type": "boolean"}})}),
    obj({"items": {"type": "array", "maxItems": 2, "items": obj({"id": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}})}}),
    obj({"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0, "maximum": 50}}),
    obj({"a": NAME, "b": NAME}, required=["a"]),
    obj({"temperature": {"type": "integer", "minimum": -40, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    obj({"yes": {"type": "boolean"}, "no": {"type": "boolean"}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"enum": ["cat", "dog", "bird"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                              "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}}}}),
    obj({"day": {"type": "string", "pattern": "^(mon|tue|wed)$"}}),
    obj({"first": NAME, "last": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    obj({"price": {"type": "number", "minimum": 1, "maximum": 100}, "currency": {"enum": ["EUR", "USD"]}}),
    obj({"address": obj({"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
]
REGEXES = [r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])",  # a date
           r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",  # an email
           r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",  # a phone number
           r"(yes|no), because [a-z ]{1,20}\."]
CHOICES = [["Paris", "London", "Berlin"], ["positive", "negative", "neutral"]]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """One smollm2 engine for the module, in a thread with its own event loop, behind two
    servers: a plain one, and one with --enable-auto-tool-choice --tool-call-parser hermes."""
    from aiohttp import web

    from async_engine import AsyncEngine
    from engine import EngineConfig
    from server import build_app

    started, stop, port = threading.Event(), None, []

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        # test_real_model.py's shapes: their programs are in the persistent compilation cache
        engine = AsyncEngine(EngineConfig(model="smollm2", max_num_seqs=4, max_model_len=512,
                                          max_num_batched_tokens=128, num_kv_blocks=96, warmup=False),
                             log=lambda *_: None)
        await engine.start()
        runners = [web.AppRunner(build_app(engine, ["smollm2"], tool_call_parser=p)) for p in (None, "hermes")]
        for runner in runners:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port.append(runner.addresses[0][1])
        started.set()
        await stop.wait()
        await engine.shutdown()
        for runner in runners:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(600), "the server did not start"
    yield tuple(openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="x", max_retries=0, timeout=300)
                for p in port)
    loop.call_soon_threadsafe(stop.set)
    thread.join(60)


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return servers[0]


def chat(client: openai.OpenAI, question: str, stream: bool, temperature: float, seed: int, **extra) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    kw = dict(model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
              temperature=temperature, seed=seed, stream=stream, extra_body=extra.pop("extra_body", None), **extra)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**kw):
        text += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def run_all(jobs: list) -> list:
    """Run the jobs 4 at a time (the engine's max_num_seqs): one engine run, batched."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda job: job(), jobs))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_output_parses_and_validates_streamed_or_not(client, temperature):
    jobs, checks = [], []
    for i, schema in enumerate(SCHEMAS):
        stream = i % 2 == 1
        # OpenAI's response_format, vLLM's structured_outputs and guided_json in turn
        how = [dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                              "strict": True}}),
               dict(extra_body={"structured_outputs": {"json": schema}}),
               dict(extra_body={"guided_json": schema})][i % 3]
        jobs.append(lambda s=stream, h=how, i=i: chat(client, "Describe something as JSON.", s, temperature, i, **h))
        checks.append(lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
    for i, rx in enumerate(REGEXES):
        how = {"extra_body": {"structured_outputs": {"regex": rx}} if i % 2 else {"guided_regex": rx}}
        jobs.append(lambda s=i % 2 == 0, h=how, i=i: chat(client, "Give an example.", s, temperature, i, **h))
        checks.append(lambda text, rx=rx: re.fullmatch(rx, text) or pytest.fail(f"{text!r} !~ {rx}"))
    for i, choice in enumerate(CHOICES):
        how = {"extra_body": {"structured_outputs": {"choice": choice}} if i % 2 else {"guided_choice": choice}}
        jobs.append(lambda s=i % 2 == 1, h=how, i=i: chat(client, "Pick one.", s, temperature, i, **h))
        checks.append(lambda text, choice=choice: text in choice or pytest.fail(f"{text!r} not in {choice}"))
    results = run_all(jobs)
    for (text, reason), check in zip(results, checks):
        assert reason == "stop", (text, reason)
        check(text)


def test_json_object_and_a_grammar(client):
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    gbnf = 'root ::= "x" [0-9] [0-9]'  # llama.cpp's GBNF is converted to Lark
    (text, reason), (gtext, greason), r = run_all([
        lambda: chat(client, "Is water wet?", False, 0.0, 0, extra_body={"guided_grammar": grammar}),
        lambda: chat(client, "Go.", True, 1.0, 0, extra_body={"structured_outputs": {"grammar": gbnf}}),
        lambda: client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A JSON object."}],
                                               max_tokens=MAX_TOKENS, temperature=0.0,
                                               response_format={"type": "json_object"})])
    assert reason == "stop" and text in ("The answer is yes.", "The answer is no."), text
    assert greason == "stop" and re.fullmatch(r"x[0-9]{2}", gtext), gtext
    if r.choices[0].finish_reason == "stop":  # any object: the model may run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": obj(
    {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}})}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": obj({"zone": {"enum": ["UTC", "CET"]}})}}


def tool_calls(client: openai.OpenAI, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]], str, int]:
    """(content, [(name, arguments)], finish_reason, chunks that named a call or sent its
    arguments before the last chunk) of one chat completion, as the OpenAI client sees it."""
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=MAX_TOKENS,
              temperature=0.0, tools=[WEATHER, TIME], stream=stream) | kw
    if not stream:
        m = client.chat.completions.create(**kw).choices[0]
        return (m.message.content, [(c.function.name, c.function.arguments) for c in m.message.tool_calls or []],
                m.finish_reason)
    content, calls, reason, early = "", {}, None, 0
    for chunk in client.chat.completions.create(**kw):
        for c in chunk.choices[0].delta.tool_calls or []:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
            early += chunk.choices[0].finish_reason is None
        content += chunk.choices[0].delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [calls[i] for i in sorted(calls)], reason, early


def test_a_forced_tool_call_comes_back_as_tool_calls(client):
    """Named and required, streamed or not (the four requests batched)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(stream, choice) for stream in (False, True) for choice in (named, "required")]
    results = run_all([lambda s=stream, c=choice: tool_calls(client, s, tool_choice=c) for stream, choice in cases])
    for (stream, choice), (_, calls, reason, *early) in zip(cases, results):
        if choice is named:
            # named: the arguments follow that function's parameters; finish_reason the engine's (vLLM)
            assert reason == "stop" and [n for n, _ in calls] == ["get_weather"], (stream, calls)
            jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
            continue
        # required: one or more calls of any of the tools; finish_reason "tool_calls"; streamed,
        # each call is named, then its arguments come, in chunks before the last
        assert reason == "tool_calls" and calls, (stream, calls)
        for name, args in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[name]
            jsonschema.validate(json.loads(args), tool["function"]["parameters"])
        if stream:
            assert early[0] >= 2 * len(calls), "the calls came whole with the last chunk"


HERMES = (r'(I will check\. )?<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Oslo)", "unit": "(C|F)"\}\}\n</tool_call>')


def test_tool_choice_auto_finds_the_hermes_call_in_the_output(servers):
    """The output is made a hermes tool call by a regex (SmolLM2-135M's chat template renders
    no tools, so the model would not write one by itself): the server's hermes parser turns
    it into tool_calls, content the text before it; plain text stays content. Streamed or
    not (the four requests batched)."""
    plain, hermes = servers
    streams = (False, True)
    called = run_all([lambda s=stream: tool_calls(hermes, s, temperature=1.0, seed=3,
                                                  extra_body={"structured_outputs": {"regex": HERMES}})
                      for stream in streams] +
                     [lambda s=stream: tool_calls(hermes, s, extra_body={"guided_choice": ["Sunny.", "Rain."]})
                      for stream in streams])
    for stream, (content, calls, reason, *early) in zip(streams, called):
        assert reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"], (stream, content, calls)
        jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
        assert content in (None, "I will check. ")
        if stream:
            assert early[0] >= 2  # the name, then argument deltas before the last chunk
    for stream, (content, calls, reason, *_) in zip(streams, called[len(streams):]):
        assert (content, calls, reason) in (("Sunny.", [], "stop"), ("Rain.", [], "stop")), stream
    for stream in streams:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            tool_calls(plain, stream)


def test_a_structural_tag_shapes_what_follows_each_trigger(client):
    """vLLM's response_format structural_tag: free text, but each "The" (the model's first
    word here) must go on as ' answer is ' + one of the choices as a JSON string + '.'.
    Streamed or not (the two requests batched)."""
    tag = {"type": "structural_tag", "triggers": ["The"],
           "structures": [{"begin": "The answer is ", "schema": {"enum": CHOICES[0]}, "end": "."}]}
    for text, reason in run_all([lambda s=stream: chat(client, "What is the capital of France?", s, 0.0, 0,
                                                       response_format=tag) for stream in (False, True)]):
        starts = [m.start() for m in re.finditer("The", text)]
        assert starts and starts[0] == 0, text  # the trigger fired (at temperature 0 the answer starts "The")
        for i in starts:
            after = text[i:]
            done = re.match(r'The answer is "(Paris|London|Berlin)"\.', after)
            assert done or (reason == "length" and re.match(r'The( answer is "?[A-Za-z]*)?$', after)), text


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
    ({"guided_choice": []}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one output constraint"),
    ({"guided_regex": "a" * 70000}, "over the limit"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag is not valid JSON"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}},
     "'format' form (xgrammar's) is not supported"),
    ({"structured_outputs": {"unknown": "x"}}, "unsupported key(s) unknown"),
    ({"tool_choice": "auto", "tools": [WEATHER]}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "nope"),
])
def test_a_bad_constraint_is_a_400_with_the_reason(client, body, message):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "Hi.", stream, 0.0, 0, extra_body=body)
        assert message in str(e.value), (body, str(e.value))
