"""Structured outputs (structured.py, the bitmask in sampler.py, the matcher in scheduler.py)
on the tiny model; smollm2 behind the OpenAI API is tests/test_structured_smollm2.py.

Claims: on random small grammars over the tiny model's vocabulary no sampled token is
ever outside llguidance's mask and the mask the step applies is llguidance's; unconstrained
requests in a batch with constrained ones give the tokens they give alone; preemption
leaves the matcher consistent; nothing compiles after warm-up."""

from __future__ import annotations

import re

import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest
from conftest import count_compilations, fresh_step_programs
from hypothesis import HealthCheck, given, settings, strategies as st

from distributed import SAMPLE, SAMPLE_MASKED
from llm import LLM, SamplingParams
from sampling_params import StructuredOutputsParams as SO

@pytest.fixture(scope="module")
def tiny() -> LLM:
    fresh_step_programs()  # nothing compiles after this engine's own warm-up
    return LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128)


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
        outs = [o.outputs[0] for o in tiny.generate([[1, 2, 3 + i] for i in range(len(specs))], params)]
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
    alone = [o.outputs[0] for o in tiny.generate(prompts[:2], free)]
    constrained = [SamplingParams(max_tokens=16, temperature=1.0, seed=1, structured_outputs=SO(regex="[ab]{3,9}")),
                   SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=SO(choice=["yes", "no"]))]
    mixed = [o.outputs[0] for o in tiny.generate(prompts, free + constrained)]
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch("[ab]{3,9}", mixed[2].text) and mixed[3].text in ("yes", "no")


def letter_tag() -> dict:
    """A structural tag whose triggers are the 26 lower-case letters (about one byte in ten
    the tiny model samples): each letter must be followed by one digit and ';'."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    return {"type": "structural_tag", "triggers": letters,
            "structures": [{"begin": c, "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": ";"}
                           for c in letters]}


def test_a_structural_tag_constrains_the_text_after_each_trigger_and_nothing_else(tiny):
    """vLLM's structural tag: free text in which each trigger starts its structure (begin,
    JSON under its schema, end). Checked on the sampled bytes by a plain regular expression."""
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured_outputs=SO(structural_tag=letter_tag()))
              for s in range(6)]
    outs = [o.outputs[0] for o in tiny.generate([[1, 2 + i] for i in range(6)], params)]
    texts = [bytes(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids) for o in outs]
    assert all(t < 256 for o in outs for t in o.token_ids[:-1])  # bytes only (no special token is text)
    for text in texts:  # a cut at max_tokens may end inside a structure
        assert re.fullmatch(rb"([^a-z]*[a-z][0-9];)*[^a-z]*([a-z][0-9]?)?", text, re.S), text
    assert sum(len(re.findall(rb"[a-z][0-9];", t)) for t in texts) >= 6  # the triggers did fire
    assert len({t for t in texts}) == 6


def test_a_malformed_structural_tag_is_a_value_error_naming_the_part():
    tag = letter_tag()
    for bad, part in ((tag | {"format": {}}, "'format' form"), (tag | {"triggers": []}, "triggers"),
                      (tag | {"triggers": ["x"]}, r"structures\[0\]\.begin 'a' starts with none"),
                      (tag | {"structures": [{"begin": "a", "end": ";"}]}, r"structures\[0\] must be"),
                      ("{", "structural_tag is not valid JSON")):
        with pytest.raises(ValueError, match=part):
            SO(structural_tag=bad)


def test_preemption_by_recompute_keeps_the_matcher_with_the_outputs():
    """A cache too small for all four: sequences are preempted and recomputed, and each
    constrained output still matches (its matcher was not reset, nor advanced twice)."""
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
              num_kv_blocks=9)
    rx = "[ab]{20,30}"
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=SO(regex=rx))
              for i in range(4)]
    outs = [o.outputs[0] for o in llm.generate([[1] + [3 + i] * 12 for i in range(4)], params)]
    assert llm.stats.num_preemptions > 0
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(rx, o.text), (o.text, o.finish_reason)


def test_max_tokens_before_the_grammar_ends_is_length_and_its_end_is_stop(tiny):
    short, whole = [o.outputs[0] for o in tiny.generate([[1, 2], [1, 3]], [
        SamplingParams(max_tokens=3, structured_outputs=SO(regex="abcdef")),
        SamplingParams(max_tokens=30, structured_outputs=SO(regex="abcdef"))])]
    assert (short.text, short.finish_reason) == ("abc", "length")
    assert (whole.text, whole.finish_reason, len(whole.token_ids)) == ("abcdef", "stop", 6)


def test_nothing_compiles_after_warm_up_with_constraints(tiny):
    params = [SamplingParams(max_tokens=10, temperature=t, seed=i, logprobs=1 if i == 2 else None,
                             structured_outputs=SO(regex="[01]{2,8}") if i % 2 else None)
              for i, t in enumerate([0.0, 1.0, 1.0, 0.0, 1.0])]
    # The first step is 3 + 20 + 5 + 64 tokens (80 less its cached first block): the largest
    # bucket, 128. The fifth prompt joins whole beside at most 3 decodes: 40 to 43 tokens, 64.
    # Then decodes of 4, 2 and 1 rows.
    with count_compilations() as compiled:
        tiny.generate([[1] * n for n in (3, 20, 5, 80)] + [[2] * 40], params)
    assert compiled == []


def test_offline_refuses_an_invalid_constraint_before_anything_is_queued(tiny):
    with pytest.raises(ValueError, match="unclosed group"):
        tiny.generate([[1, 2], [1, 3]], [SamplingParams(), SamplingParams(structured_outputs=SO(regex="a(b"))])
    assert not tiny.engine.has_unfinished()


def test_a_schema_nested_past_the_json_codec_is_a_value_error():
    """Otherwise a RecursionError out of SamplingParams' constructor (offline; the server's
    body check stops such nesting first)."""
    schema: dict = {"type": "string"}
    for _ in range(1000):
        schema = {"type": "array", "items": schema}
    for given in (schema, None):
        with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
            SO(json=schema if given is not None else "[" * 100_000 + "]" * 100_000)


def test_a_schema_number_past_a_float_s_range_is_named_out_of_range():
    """Python's JSON reads 1e400 as Infinity, and takes NaN and Infinity literals, which JSON
    has not: the error says which number is wrong, not llguidance's "expected value"."""
    tag = {"structures": [{"begin": "<a>", "schema": {"maximum": 1e400}, "end": "</a>"}], "triggers": ["<a"]}
    for kw, constant in ((dict(json='{"type": "number", "maximum": 1e400}'), "Infinity"),
                         (dict(json={"type": "number", "minimum": -float("inf")}), "-Infinity"),
                         (dict(json='{"enum": [1, NaN]}'), "NaN"),
                         (dict(json={"items": [{"const": [1e400]}]}), "Infinity"),
                         (dict(structural_tag=tag), "Infinity")):
        with pytest.raises(ValueError) as e:
            SO(**kw)
        assert str(e.value) == (f"structured_outputs.{next(iter(kw))} has a number out of range ({constant}): "
                                "JSON numbers must be finite, within a 64-bit float's range (about 1.8e308 either "
                                "side of 0)")
    # the words in a string are no numbers; 1e308 is in range
    assert SO(json={"const": "Infinity or NaN", "maximum": 1e308}).json == \
        '{"const":"Infinity or NaN","maximum":1e+308}'


def test_a_constraint_that_cannot_start_is_refused_at_compile_not_answered(tiny):
    """A regex whose language is empty: llguidance fails on its first mask, so admitted it
    would be answered with EOS alone (finish_reason "stop", empty text), a silent wrong answer."""
    with pytest.raises(ValueError, match="invalid regex"):
        tiny.generate([[1, 2]], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[^\\x00-\\U0010FFFF]")))
    assert not tiny.engine.has_unfinished()
    ok = tiny.generate([[1, 2]], SamplingParams(max_tokens=8, structured_outputs=SO(regex="[ab]{3}")))[0].outputs[0]
    assert ok.finish_reason == "stop" and re.fullmatch("[ab]{3}", ok.text)


def test_async_scheduling_gives_constrained_and_free_rows_the_tokens_of_the_synchronous_loop(tiny, monkeypatch):
    """Under async scheduling a constrained step's forward is dispatched before the step in
    flight is collected; its sample program waits for the matchers (LLMEngine._execute).
    Every row still advances one token a step and draws what the synchronous loop draws."""
    import runner as runner_module

    sync = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
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
        got = [o.outputs[0] for o in tiny.generate(prompts, params)]
    assert tiny.stats.num_steps - steps == 20  # the prefill samples token 1, then one token a step: 20 for the longest
    masked = [i for i, e in enumerate(events) if e == "masked"]
    assert len(masked) >= 5  # the constrained outputs are at least 5 tokens long
    assert tiny.stats.structured_output_steps - masked_steps == len(masked)  # the engine counts them
    assert tiny.stats.structured_output_bitmask_seconds > fill_s
    # After the first step, each masked sample comes after its own forward and the previous
    # step's result: the forward ran while the host waited for that result and filled the mask.
    assert all(events[i - 2:i] == ["forward", "result"] for i in masked[1:]), events
    want = [o.outputs[0] for o in sync.generate(prompts, params)]
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


def test_a_constraint_is_compiled_once_off_the_loops_however_many_others_fill_the_cache(monkeypatch):
    """The server compiles a request's constraint on its executor; the engine must copy that
    matcher, not look it up again in the LRU cache: with more distinct grammars compiled
    meanwhile than it holds, it would compile again, on the event loop (AsyncEngine's
    validate) and on the engine loop. Offline, every constraint is compiled once too."""
    import asyncio
    import threading

    import structured
    from aiohttp.test_utils import TestClient, TestServer

    import server
    from conftest import tiny_async_engine

    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMARS", 1)
    compiled: list[tuple[str, str]] = []  # (regex, thread) of each cache miss
    grammar_text = structured.grammar_text
    monkeypatch.setattr(structured, "grammar_text", lambda spec: compiled.append(
        (spec.regex, threading.current_thread().name)) or grammar_text(spec))
    with tiny_async_engine() as (loop, engine):
        compile_ = engine.grammars.compile

        def compile_then_another(spec: SO):  # another request's compile lands before this one reaches the engine
            matcher = compile_(spec)
            if spec.regex == "[ab]{4}":
                compile_(SO(regex="[01]{4}"))
            return matcher
        monkeypatch.setattr(engine.grammars, "compile", compile_then_another)
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())
        try:
            async def post() -> dict:
                resp = await client.post("/v1/completions", json={
                    "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[ab]{4}"}})
                assert resp.status == 200, await resp.text()
                return await resp.json()
            out = loop.run_until_complete(asyncio.wait_for(post(), 300))
        finally:
            loop.run_until_complete(client.close())
        assert re.fullmatch("[ab]{4}", out["choices"][0]["text"])
        mine = [thread for regex, thread in compiled if regex == "[ab]{4}"]
        assert len(mine) == 1 and mine[0] not in (threading.main_thread().name, "taxirank-engine"), compiled

    compiled.clear()  # offline: validated (compiled) before any is added, then added
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128)
    specs = [SO(regex=r) for r in ("a{2}", "b{2}", "0{2}")]
    outs = [o.outputs[0] for o in llm.generate(["x"] * 3, [SamplingParams(max_tokens=4, structured_outputs=s)
                                                           for s in specs])]
    assert [o.text for o in outs] == ["aa", "bb", "00"]
    assert sorted(r for r, _ in compiled) == sorted(s.regex for s in specs)


def test_vllms_400s_for_json_object_false_a_nul_in_a_regex_and_a_blank_grammar():
    """vLLM's StructuredOutputsParams checks: json_object counts as set whenever it is not
    null and must then be true; a regex may not hold NUL; a grammar of blanks has no rules.
    (A regex of blanks is a regex: it matches them.)"""
    for kw, msg in ((dict(json_object=False), "json_object must be True if set"),
                    (dict(json_object=False, regex="a"), "exactly one of .* got regex, json_object"),
                    (dict(regex="a\x00b"), "must not contain a NUL character"),
                    (dict(grammar=" \n\t"), "grammar must be a non-empty string")):
        with pytest.raises(ValueError, match=msg):
            SO(**kw)
    assert SO(regex=" ").regex == " " and SO(json_object=True).kind == "json_object"


def test_llguidances_parser_state_stays_out_of_a_refusal():
    """llguidance appends its parser's internal state to some errors (rows, lexer costs,
    ...); the client's 400 says what is wrong and no more."""
    from structured import GrammarCompiler
    from tokenizer import ByteTokenizer

    compiler = GrammarCompiler(ByteTokenizer(), 512, [ByteTokenizer.eos_token_id])
    for spec, want in ((SO(grammar="start: start"), "invalid grammar: no output satisfies it"),
                       (SO(regex="[^\\x00-\\U0010FFFF]"), "invalid regex: no output satisfies it")):
        with pytest.raises(ValueError) as e:
            compiler.compile(spec)
        assert str(e.value) == want


def test_a_slow_compile_on_another_thread_leaves_the_engine_loop_stepping(tiny):
    """The server compiles on its executor while the engine loop steps. llguidance must let
    go of the GIL while it builds a large regex's automaton, or every other request's steps
    stall for the whole compile (about a second for this one): counted in steps the loop
    runs while the compile is under way, not timed."""
    import threading

    eng = tiny.engine
    done = threading.Event()
    compiled: list = []

    def compile_() -> None:
        try:
            compiled.append(eng.grammars.compile(SO(regex="b{200000}")))  # (b{300000} is past the lexer's limits)
        finally:
            done.set()
    worker = threading.Thread(target=compile_)
    steps = 0
    i = 0
    worker.start()
    while not done.is_set():
        if not eng.has_unfinished():
            eng.add_request(f"free-{i}", [1, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True))
            i += 1
        eng.step()
        steps += 1
    worker.join()
    while eng.has_unfinished():
        eng.step()
    assert compiled and steps >= 10, steps


def test_a_json_schema_of_true_is_any_json_and_one_of_false_is_refused(tiny):
    """JSON Schema's boolean schemas: `true` allows any value (llguidance takes objects
    only, so it is `{}`), `false` none; so too under a structural tag."""
    import json

    tag = {"triggers": ["<"], "structures": [{"begin": "<a>", "schema": True, "end": "</a>"}]}
    assert SO(json=True) == SO(json={}) and '"schema":{}' in SO(structural_tag=tag).structural_tag
    assert tag["structures"][0]["schema"] is True  # the caller's dict is left as it was
    outs = tiny.generate([[1, 2], [1, 3]], [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=s)
                                             for s in (SO(json=True), SO(structural_tag=tag))])
    assert outs[0].outputs[0].finish_reason == "stop"
    json.loads(outs[0].outputs[0].text)
    for bad, where in ((dict(json=False), "structured_outputs.json"), (dict(json="false"), "structured_outputs.json"),
                       (dict(structural_tag=tag | {"structures": [tag["structures"][0] | {"schema": False}]}),
                        r"structural_tag.structures\[0\].schema")):
        with pytest.raises(ValueError, match=f"{where} is false: no output satisfies it"):
            SO(**bad)


def test_a_constraint_that_does_not_compile_names_the_field_it_came_in():
    """tool_choice only when a forced call made it: "auto" constrains nothing (its calls are
    parsed from free text), so a constraint beside it that does not compile is the request's
    own field's fault (structured_outputs, response_format or a guided_* field)."""
    import asyncio
    import types

    from protocol import ApiError
    from serving import compile_grammar
    from structured import GrammarCompiler
    from tokenizer import ByteTokenizer
    from tool_parsers import ToolChoice

    from metrics import EngineStats

    engine = types.SimpleNamespace(grammars=GrammarCompiler(ByteTokenizer(), 512, [ByteTokenizer.eos_token_id]),
                                   stats=EngineStats())
    params = SamplingParams(structured_outputs=SO(regex="(a"))
    cases = [({"structured_outputs": {"regex": "(a"}}, "auto", "structured_outputs"),
             ({"guided_regex": "(a"}, None, "guided_regex"),
             ({"response_format": {"type": "text"}, "guided_regex": "(a"}, None, "guided_regex"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, None, "response_format"),
             ({}, "named", "tool_choice"), ({}, "required", "tool_choice")]
    for body, mode, param in cases:
        tools = None if mode is None else ToolChoice(mode, {"f": {"type": "object"}})
        with pytest.raises(ApiError, match="unclosed group") as e:
            asyncio.run(compile_grammar(engine, params, body, tools))
        assert e.value.param == param, (body, mode)


def test_a_constraint_whose_first_token_overflows_the_parser_row_is_refused_at_compile():
    """llguidance's Earley row limit fails when the first byte is scanned, not on the first
    mask: a schema of 600 optional properties was admitted and ended with "abort" after
    one token. The compile takes a few allowed first tokens on copies and refuses it; a
    schema of the same shape under the limit still compiles."""
    from structured import GrammarCompiler
    from tokenizer import ByteTokenizer

    compiler = GrammarCompiler(ByteTokenizer(), 512, [ByteTokenizer.eos_token_id])

    def props(n: int) -> SO:
        return SO(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})
    with pytest.raises(ValueError, match=r"invalid json: Parser Error: Current row has \d+ items; max is 2000"):
        compiler.compile(props(600))
    m = compiler.compile(props(100)).deep_copy()
    assert m.consume_token(ord("{")) and not m.is_error()


def test_vllms_json_options_set_the_whitespace_and_close_the_objects(tiny):
    """vLLM's StructuredOutputsParams takes disable_any_whitespace, whitespace_pattern and
    disable_additional_properties beside a JSON constraint (they were a TypeError here, and
    a 400 over HTTP). Newlines and spaces favoured by logit_bias: under whitespace_pattern
    "\\n" the JSON holds newlines between its tokens and no space, with
    disable_any_whitespace none; every object that lists properties takes no others."""
    import json

    import jsonschema

    from protocol import ApiError, parse_structured

    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "object", "properties": {"properties": {"type": "boolean"}}}}}
    closed = {**schema, "additionalProperties": False, "properties": {**schema["properties"], "b": {
        **schema["properties"]["b"], "additionalProperties": False}}}
    bias = {ord("\n"): 8.0, ord(" "): 8.0}
    kinds = [dict(whitespace_pattern="\n"), dict(whitespace_pattern="\n", disable_any_whitespace=True)]
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=i, logit_bias=bias, structured_outputs=SO(
        json=schema, disable_additional_properties=True, **kinds[i % 2])) for i in range(4)]
    outs = [o.outputs[0] for o in tiny.generate([[1, 2 + i] for i in range(4)], params)]
    for i, o in enumerate(outs):
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        jsonschema.validate(json.loads(o.text), closed)
        assert " " not in o.text and ("\n" in o.text) == (i % 2 == 0), o.text
    assert parse_structured({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, None).regex == "a"
    with pytest.raises(ApiError, match="got none"):  # options alone, as vLLM, even beside another constraint
        parse_structured({"structured_outputs": {"disable_any_whitespace": True},
                          "response_format": {"type": "json_object"}}, None)
    with pytest.raises(ValueError, match="disable_additional_properties must be a boolean"):
        SO(json_object=True, disable_additional_properties="yes")


def test_tool_choice_required_resolves_each_tools_defs_as_vllm_moves_them_to_the_top():
    """Under "required" a tool's parameters sit inside an array of calls, where its own
    `#/$defs/...` references (pydantic writes them) would point at the root: vLLM moves
    every tool's $defs there. The grammar takes a call as jsonschema does, on the tool's
    own schema; one name two tools define differently is vLLM's 400."""
    import json

    import jsonschema

    from protocol import ApiError, parse_structured, tool_choice
    from structured import GrammarCompiler
    from tokenizer import ByteTokenizer

    unit = {"type": "object", "$defs": {"U": {"enum": ["c", "f"]}}, "properties": {"u": {"$ref": "#/$defs/U"}},
            "required": ["u"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "t", "parameters": unit}},
             {"type": "function", "function": {"name": "n", "parameters": {"$defs": {}, "type": "object"}}}]
    body = {"tools": tools, "tool_choice": "required"}
    spec = parse_structured(body, tool_choice(body, chat=True, auto=False)[0])
    grammar = GrammarCompiler(ByteTokenizer(), 512, [ByteTokenizer.eos_token_id]).compile(spec)
    for u in ("c", "f", "k"):
        text = json.dumps([{"name": "t", "parameters": {"u": u}}], separators=(",", ":"))
        m = grammar.deep_copy()
        took = all(m.consume_token(b) for b in text.encode()) and m.is_accepting()
        assert took == jsonschema.Draft202012Validator(unit).is_valid({"u": u}), u
    assert "$defs" in tools[0]["function"]["parameters"]  # the tools as sent (the template's) keep theirs
    clash = {"type": "function", "function": {"name": "v", "parameters": {"$defs": {"U": {"enum": ["k"]}}}}}
    body = {"tools": [*tools, clash], "tool_choice": "required"}
    with pytest.raises(ApiError, match="Tool definition 'U' has multiple schemas") as e:
        parse_structured(body, tool_choice(body, chat=True, auto=False)[0])
    assert e.value.param == "tools"
