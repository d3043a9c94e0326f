"""Structured outputs (structured.py, the bitmask in sampler.py, the matcher in scheduler.py).

Claims: with smollm2 at temperature 0 and 1, every output under a JSON schema, regex or
choice parses and validates, streamed or not, through the OpenAI API (response_format,
structured_outputs, guided_*, a forced tool call); a bad constraint is a 400 with
llguidance's message before admission; on random small grammars over the tiny model's
vocabulary no sampled token is ever outside llguidance's mask and the mask the step
applies is llguidance's; unconstrained requests in a batch with constrained ones give the
tokens they give alone; preemption leaves the matcher consistent; nothing compiles after
warm-up."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Iterator

import jsonschema
import llguidance
import llguidance.numpy as llnp
import numpy as np
import openai
import pytest
from conftest import count_compilations
from hypothesis import HealthCheck, given, settings, strategies as st

from config import StructuredOutputsParams as SO
from engine import LLM, SamplingParams
from distributed import SAMPLE, SAMPLE_MASKED

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


# ---- smollm2 behind the OpenAI API ------------------------------------------------

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
    text, reason = chat(client, "Is water wet?", False, 0.0, 0, extra_body={"guided_grammar": grammar})
    assert reason == "stop" and text in ("The answer is yes.", "The answer is no."), text
    gbnf = 'root ::= "x" [0-9] [0-9]'  # llama.cpp's GBNF is converted to Lark
    text, reason = chat(client, "Go.", True, 1.0, 0, extra_body={"structured_outputs": {"grammar": gbnf}})
    assert reason == "stop" and re.fullmatch(r"x[0-9]{2}", text), text
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A JSON object."}],
                                       max_tokens=MAX_TOKENS, temperature=0.0, response_format={"type": "json_object"})
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


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_comes_back_as_tool_calls(client, stream):
    # named: the arguments follow that function's parameters; finish_reason the engine's (vLLM)
    _, calls, reason, *early = tool_calls(client, stream, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    assert reason == "stop" and [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    # required: one or more calls of any of the tools; finish_reason "tool_calls"; streamed,
    # each call is named, then its arguments come, in chunks before the last
    _, calls, reason, *early = tool_calls(client, stream, tool_choice="required")
    assert reason == "tool_calls" and calls
    for name, args in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[name]
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])
    if stream:
        assert early[0] >= 2 * len(calls), "the calls came whole with the last chunk"


HERMES = (r'(I will check\. )?<tool_call>\n\{"name": "get_weather", "arguments": '
          r'\{"city": "(Paris|Oslo)", "unit": "(C|F)"\}\}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_finds_the_hermes_call_in_the_output(servers, stream):
    """The output is made a hermes tool call by a regex (SmolLM2-135M's chat template renders
    no tools, so the model would not write one by itself): the server's hermes parser turns
    it into tool_calls, content the text before it; plain text stays content."""
    plain, hermes = servers
    content, calls, reason, *early = tool_calls(hermes, stream, temperature=1.0, seed=3,
                                                extra_body={"structured_outputs": {"regex": HERMES}})
    assert reason == "tool_calls" and [n for n, _ in calls] == ["get_weather"], (content, calls)
    jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
    assert content in (None, "I will check. ")
    if stream:
        assert early[0] >= 2  # the name, then argument deltas before the last chunk
    content, calls, reason, *_ = tool_calls(hermes, stream, extra_body={"guided_choice": ["Sunny.", "Rain."]})
    assert (content, calls, reason) in (("Sunny.", [], "stop"), ("Rain.", [], "stop"))
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        tool_calls(plain, stream)


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "undefined_rule"),
    ({"guided_choice": []}, "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one output constraint"),
    ({"guided_regex": "a" * 70000}, "over the limit"),
    ({"structured_outputs": {"structural_tag": "x"}}, "unsupported"),
    ({"tool_choice": "auto", "tools": [WEATHER]}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "nope"),
])
def test_a_bad_constraint_is_a_400_with_the_reason(client, body, message):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, "Hi.", stream, 0.0, 0, extra_body=body)
        assert message in str(e.value), (body, str(e.value))


# ---- the tiny model: the mask, the batch, preemption, compilation ---------------

@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)


ALPHABET = "ab01"


def regexes() -> st.SearchStrategy[str]:
    """Small regexes over a few bytes: literals, classes, alternation, bounded repeats."""
    atom = st.sampled_from(list(ALPHABET) + ["[ab]", "[01]", "."])
    return st.recursive(atom, lambda inner: st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(inner, st.integers(0, 3)).map(lambda t: f"({t[0]}){{0,{t[1]}}}")), max_leaves=6)


def unpack(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(patterns=st.lists(regexes(), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_no_sampled_token_is_outside_the_mask_and_the_step_applies_llguidances_mask(tiny, monkeypatch, patterns,
                                                                                    seed):
    runner = tiny.engine.runner
    vocab = tiny.engine.model_config.vocab_size
    applied: list[np.ndarray] = []  # every constrained step's bitmask, as passed to the jitted program
    call = runner._call

    def spy(kind, args):
        if kind == SAMPLE_MASKED:
            applied.append(np.array(args[2]))
        return call(kind, args)

    specs = [SO(regex=p) for p in patterns]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=seed + i, structured_outputs=s)
              for i, s in enumerate(specs)]
    with monkeypatch.context() as patch:
        patch.setattr(runner, "_call", spy)
        outs = tiny.generate([[1, 2, 3 + i] for i in range(len(specs))], params)
    # Replay each output on a fresh matcher: every token was allowed when it was sampled,
    # and the mask llguidance computes at each position is one the step applied.
    tok = tiny.engine.grammars._tokenizer_for_llguidance()
    applied_rows = {r.tobytes() for a in applied for r in a}
    for spec, out in zip(specs, outs):
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_regex(spec.regex), log_level=0)
        mask = llnp.allocate_token_bitmask(1, vocab)
        for t in out.token_ids:
            llnp.fill_next_token_bitmask(m, mask, 0)
            assert unpack(mask[0], vocab)[t], (spec.regex, out.token_ids, t)
            assert mask[0].tobytes() in applied_rows, "the step applied a different mask"
            assert m.consume_token(t)
        if out.finish_reason == "stop":  # the grammar's end, or EOS where it accepts
            assert m.is_stopped() or m.is_accepting(), (spec.regex, out.token_ids)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_sampler_applies_the_packed_bitmask_as_llguidance_does():
    from sampler import apply_token_bitmask

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    want = logits.copy()
    llnp.apply_token_bitmask_inplace(want, bitmask)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(logits, bitmask)), want)


def test_unconstrained_outputs_are_the_same_with_constrained_requests_in_the_batch(tiny):
    prompts = [[1, 5, 9], [1, 7], [1, 4, 4, 4], [1, 8]]
    free = [SamplingParams(max_tokens=16, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1.0)]
    alone = tiny.generate(prompts[:2], free)
    constrained = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, structured_outputs=SO(regex="[ab]{3,9}")),
                   SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=SO(choice=["yes", "no"]))]
    mixed = tiny.generate(prompts, free + constrained)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch("[ab]{3,9}", mixed[2].text) and mixed[3].text in ("yes", "no")


def test_preemption_by_recompute_keeps_the_matcher_with_the_outputs():
    """A cache too small for all four: sequences are preempted and recomputed, and each
    constrained output still matches (its matcher was not reset, nor advanced twice)."""
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
              num_kv_blocks=9)
    rx = "[ab]{20,30}"
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=SO(regex=rx))
              for i in range(4)]
    outs = llm.generate([[1] + [3 + i] * 12 for i in range(4)], params)
    assert llm.stats.num_preemptions > 0
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(rx, o.text), (o.text, o.finish_reason)


def test_max_tokens_before_the_grammar_ends_is_length_and_its_end_is_stop(tiny):
    short, whole = tiny.generate([[1, 2], [1, 3]], [
        SamplingParams(max_tokens=3, structured_outputs=SO(regex="abcdef")),
        SamplingParams(max_tokens=30, structured_outputs=SO(regex="abcdef"))])
    assert (short.text, short.finish_reason) == ("abc", "length")
    assert (whole.text, whole.finish_reason, len(whole.token_ids)) == ("abcdef", "stop", 6)


def test_nothing_compiles_after_warm_up_with_constraints(tiny):
    params = [SamplingParams(max_tokens=10, temperature=t, seed=i, logprobs=1 if i == 2 else None,
                             structured_outputs=SO(regex="[01]{2,8}") if i % 2 else None)
              for i, t in enumerate([0.0, 1.0, 1.0, 0.0, 1.0])]
    with count_compilations() as compiled:
        tiny.generate([[1] * n for n in (3, 20, 5, 40, 2)], params)
    assert compiled == []


def test_offline_refuses_an_invalid_constraint_before_anything_is_queued(tiny):
    with pytest.raises(ValueError, match="unclosed group"):
        tiny.generate([[1, 2], [1, 3]], [SamplingParams(), SamplingParams(structured_outputs=SO(regex="a(b"))])
    assert not tiny.engine.has_unfinished()


def test_async_scheduling_gives_constrained_and_free_rows_the_tokens_of_the_synchronous_loop(tiny, monkeypatch):
    """Under async scheduling a constrained step's forward is dispatched before the step in
    flight is collected; its sample program waits for the matchers (LLMEngine._execute).
    Every row still advances one token a step and draws what the synchronous loop draws."""
    import runner as runner_module

    sync = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
               async_scheduling=False, warmup=False)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=i == 0,
                             structured_outputs=SO(regex="[ab]{4,12}(x|y)") if i % 2 else None) for i in range(4)]
    prompts = [[1, 9 + i] for i in range(4)]
    events: list[str] = []  # the host's order: forwards, sample programs, results read back
    call, result = tiny.engine.runner._call, runner_module.InFlightStep.result

    def spy_call(kind, args):
        events.append({SAMPLE: "sample", SAMPLE_MASKED: "masked"}.get(kind, "forward"))
        return call(kind, args)

    def spy_result(step):
        events.append("result")
        return result(step)

    steps, masked_steps = tiny.stats.num_steps, tiny.stats.structured_output_steps
    fill_s = tiny.stats.structured_output_bitmask_seconds
    with monkeypatch.context() as patch:
        patch.setattr(tiny.engine.runner, "_call", spy_call)
        patch.setattr(runner_module.InFlightStep, "result", spy_result)
        got = tiny.generate(prompts, params)
    assert tiny.stats.num_steps - steps == 20  # the prefill samples token 1, then one token a step: 20 for the longest
    masked = [i for i, e in enumerate(events) if e == "masked"]
    assert len(masked) >= 5  # the constrained outputs are at least 5 tokens long
    assert tiny.stats.structured_output_steps - masked_steps == len(masked)  # the engine counts them
    assert tiny.stats.structured_output_bitmask_seconds > fill_s
    # After the first step, each masked sample comes after its own forward and the previous
    # step's result: the forward ran while the host waited for that result and filled the mask.
    assert all(events[i - 2:i] == ["forward", "result"] for i in masked[1:]), events
    want = sync.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]


def test_multi_host_posts_each_program_and_the_bitmask_only_when_a_row_is_constrained(tiny, monkeypatch):
    """Process 0's posts (distributed.StepChannel, over an in-memory key-value store) read
    back, with the follower's templates, as exactly the inputs process 0 ran; a step is a
    forward then a sample program, and only a step with a constrained row sends a bitmask."""
    import jax

    from distributed import DECODE, RAGGED, StepChannel

    store: dict[str, bytes] = {}

    class Store:  # the coordination service's key-value calls StepChannel makes
        def key_value_set_bytes(self, key: str, value: bytes) -> None:
            store[key] = value

        def key_value_delete(self, key: str) -> None:
            pass  # kept: the follower below reads them all afterwards

        def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
            return store[key]

    def channel(process_index: int) -> StepChannel:
        ch = object.__new__(StepChannel)
        ch.client, ch.process_index, ch.n = Store(), process_index, 0
        return ch

    runner = tiny.engine.runner
    ran: list[tuple[int, tuple]] = []
    call = runner._call

    def spy(kind, args):
        ran.append((kind, args))
        return call(kind, args)

    with monkeypatch.context() as patch:
        patch.setattr(runner, "channel", channel(0))
        patch.setattr(runner, "_call", spy)
        tiny.generate([[1, 2, 3], [1, 4]], [SamplingParams(max_tokens=4, structured_outputs=SO(regex="[ab]{3}")),
                                            SamplingParams(max_tokens=12, ignore_eos=True)])
    follower = channel(1)
    taken = [follower.take(runner._idle_args) for _ in range(len(store))]
    assert [k for k, _ in taken] == [k for k, _ in ran]
    for (_, got), (_, want) in zip(taken, ran):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    kinds = [k for k, _ in ran]
    assert all(k in (DECODE, RAGGED) for k in kinds[::2]) and all(k in (SAMPLE, SAMPLE_MASKED) for k in kinds[1::2])
    assert kinds[1::2].count(SAMPLE_MASKED) == 3  # the constrained row's 3 letters (then its grammar stops it)
    for i in range(1, len(kinds), 2):  # header, sample_slot and 6 sampling numbers per row, want_logprobs
        body = store[f"taxirank/step/{i}"]
        rows = int(np.frombuffer(body[8:16], np.int64)[0])
        mask = rows * runner._mask_width * 4 if kinds[i] == SAMPLE_MASKED else 0
        assert len(body) == 24 + 28 * rows + 1 + mask
