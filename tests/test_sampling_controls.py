"""vLLM's logits processors: min_tokens, allowed_token_ids, bad_words, logit_bias and the
presence, frequency and repetition penalties.

Claims: greedy decoding under each of them gives the tokens of transformers' model run step
by step with the processor applied in NumPy (vLLM's formulas and order), with the
synchronous loop and with async scheduling, beside a request that has none (whose tokens
do not change); a forbidden token is never sampled; min_tokens holds EOS off (and stop
strings unchecked) until the output has that many tokens; a request with any of them is
never speculated and gets the tokens it gets without speculation; a step with masks only
compiles nothing new and each penalty-list width compiles one program once; preemption by
recompute changes no token; a grammar and the masks hold together; bad values are
ValueErrors offline and 400s naming the field over HTTP, vocabulary checks included."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import count_compilations, fresh_step_programs, hf_logits, tiny_async_engine
from engine import EngineRequest, SamplingParams
from llm import LLM
from protocol import ApiError, parse_sampling

SMALL = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128, num_kv_blocks=64, warmup=False)
# The tiny model's: test_engine's shapes, so a cold run compiles their programs once
TINY = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, warmup=False)
EOS = 2  # conftest's checkpoints


def reference(path: str, tokenizer, prompt: list[int], p: SamplingParams) -> list[int]:
    """transformers' greedy tokens with vLLM's processors applied in NumPy, in its order:
    allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition, frequency and
    presence penalties; a stop token ends the output only once it has min_tokens tokens."""
    bad = []
    for word in p.bad_words:  # vLLM's tokenization: as written, and spaced where that is a word of its own
        plain, spaced = (tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " "))
        bad += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    out: list[int] = []
    while len(out) < p.max_tokens:
        x = hf_logits(path, prompt + out)[-1].astype(np.float32)
        if p.allowed_token_ids is not None:
            keep = np.zeros_like(x, bool)
            keep[list(p.allowed_token_ids)] = True
            x[~keep] = -np.inf
        for w in bad:
            if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]):
                x[w[-1]] = -np.inf
        if len(out) < p.min_tokens:
            x[[EOS, *(p.stop_token_ids or ())]] = -np.inf
        for t, b in (p.logit_bias or {}).items():
            x[t] += np.float32(min(100.0, max(-100.0, b)))
        seen = sorted(set(prompt) | set(out))
        r = np.float32(p.repetition_penalty)
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
        counts = np.bincount(np.asarray(out, np.int64), minlength=len(x)).astype(np.float32)
        x -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
        tok = int(np.argmax(x))
        out.append(tok)
        if len(out) >= p.min_tokens and ((tok == EOS and not p.ignore_eos) or tok in (p.stop_token_ids or ())):
            break
    return out


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, **kw})


PROMPTS = [[5, 9, 5, 9, 5, 17, 33, 5], [40, 41, 42, 40, 41, 7], [100, 3, 100, 3, 250, 12, 12, 12], [8, 8, 8, 9]]


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("llama2", tokenizer=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_tokens_under_each_processor_are_transformers_with_it_applied_in_numpy(ckpt, async_scheduling):
    llm = LLM(ckpt, log=lambda *_: None, async_scheduling=async_scheduling, **SMALL)
    plain = reference(ckpt, llm.tokenizer, PROMPTS[0], greedy())
    # a bad word from the plain output's own tokens: two of them, so the prefix rule is exercised
    word = llm.tokenizer.decode(plain[2:4])
    params = [
        greedy(),  # no processor: batched with the others, its tokens do not change
        greedy(repetition_penalty=1.8),
        greedy(repetition_penalty=0.5),
        greedy(frequency_penalty=1.5, presence_penalty=0.7),
        greedy(presence_penalty=-2.0, frequency_penalty=-0.5),
        greedy(logit_bias={str(plain[0]): -100, plain[1]: 3.5, 77: 250}),  # 250: clamped to 100
        greedy(allowed_token_ids=[10, 11, 12, 13, 77, 200], repetition_penalty=1.3),
        greedy(bad_words=[word, llm.tokenizer.decode(plain[5:6])]),
        greedy(ignore_eos=False, min_tokens=6, logit_bias={EOS: 100}),  # EOS forced from token 7 on
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] if i else PROMPTS[0] for i in range(len(params))]
    prompts[7] = prompts[8] = PROMPTS[0]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    for prompt, p, o in zip(prompts, params, outs):
        assert o.token_ids == reference(ckpt, llm.tokenizer, prompt, p), p
    assert outs[0].token_ids == plain
    assert outs[5].token_ids != plain and plain[0] not in outs[5].token_ids and 77 in outs[5].token_ids
    assert set(outs[6].token_ids) <= {10, 11, 12, 13, 77, 200}
    assert outs[8].token_ids[-1] == EOS and len(outs[8].token_ids) == 7 and outs[8].finish_reason == "stop"


def test_bad_words_are_the_token_sequences_vllm_refuses(ckpt, monkeypatch):
    """vLLM (SamplingParams.update_from_tokenizer) refuses a bad word as written, and with a
    leading space only where that is a word of its own: a new first token, as many tokens.
    Here " fox" is one token and "fox" two: vLLM does not refuse " fox", which a logit_bias
    then makes every greedy token; " the" and "the" are one token each: both refused."""
    from logits_controls import bad_words_token_ids

    llm = LLM(ckpt, log=lambda *_: None, **SMALL)
    tok = llm.tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert (len(enc("fox")), len(enc(" fox")), len(enc("the")), len(enc(" the"))) == (2, 1, 1, 1)
    assert bad_words_token_ids(tok, ["fox", " the"]) == [enc("fox"), enc("the"), enc(" the")]
    [fox], [the] = enc(" fox"), enc(" the")
    o = llm.generate([PROMPTS[0]], greedy(max_tokens=4, bad_words=["fox"], logit_bias={fox: 100}))[0].outputs[0]
    assert o.token_ids == [fox] * 4
    o = llm.generate([PROMPTS[0]], greedy(max_tokens=4, bad_words=["the"], logit_bias={the: 100}))[0].outputs[0]
    assert the not in o.token_ids
    # Tokenized once per prompt, by validate, whatever n: its checks and each sample's
    # processors take those ids (three samples, each refusing both spellings).
    import engine
    import logits_controls

    calls = []

    def counted(tokenizer, words):
        calls.append(list(words))
        return bad_words_token_ids(tokenizer, words)
    for module in (engine, logits_controls):
        monkeypatch.setattr(module, "bad_words_token_ids", counted)
    outs = llm.generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=4, seed=1, bad_words=["the"],
                                                     logit_bias={the: 100}))[0].outputs
    assert calls == [["the"]] and len(outs) == 3 and all(the not in o.token_ids for o in outs)


def test_min_tokens_holds_off_eos_and_stop_strings_as_vllm(ckpt):
    llm = LLM(ckpt, log=lambda *_: None, **SMALL)
    forced = dict(temperature=0.0, max_tokens=20, logit_bias={EOS: 100})
    for n in (0, 1, 5):
        o = llm.generate([PROMPTS[1]], SamplingParams(min_tokens=n, **forced))[0].outputs[0]
        assert o.token_ids == [*o.token_ids[:-1], EOS] and len(o.token_ids) == max(n, 0) + 1, (n, o.token_ids)
        assert EOS not in o.token_ids[:-1]
    # stop strings: looked for once the output is longer than min_tokens (vLLM's detokenizer)
    free = llm.generate([PROMPTS[1]], greedy(max_tokens=12))[0].outputs[0].token_ids
    dec = llm.tokenizer.decode
    stop, k = next((c, j + 1) for j in range(2, len(free)) for c in dec(free[:j + 1])[len(dec(free[:j])):]
                   if c.strip() and c not in dec(free[:j]))  # a character that first shows in token k
    first = llm.generate([PROMPTS[1]], greedy(max_tokens=12, stop=[stop]))[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids == free[:k]
    held = llm.generate([PROMPTS[1]], greedy(max_tokens=12, stop=[stop], min_tokens=k - 1))[0].outputs[0]
    assert held.token_ids == free[:k]
    late = llm.generate([PROMPTS[1]], greedy(max_tokens=12, stop=[stop], min_tokens=k))[0].outputs[0]
    assert late.token_ids[:k] == free[:k] and (len(late.token_ids) > k or late.finish_reason == "length")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_min_tokens_only_request_samples_without_waiting_once_it_has_min_tokens(ckpt, async_scheduling):
    """min_tokens alone masks stop tokens only before output index min_tokens: from there its
    steps sample as an unconstrained request's do (no wait for the previous token), with the
    tokens of the reference; a request with another processor waits at every step."""
    llm = LLM(ckpt, log=lambda *_: None, async_scheduling=async_scheduling, **SMALL)
    plain = reference(ckpt, llm.tokenizer, PROMPTS[2], greedy(max_tokens=12))
    # a stop token the free output samples early: min_tokens holds it off, then it may end the request
    p = greedy(max_tokens=12, min_tokens=5, stop_token_ids=[plain[1], plain[6]])
    before = llm.stats.constrained_sample_steps
    out = llm.generate([PROMPTS[2]], p)[0].outputs[0]
    assert out.token_ids == reference(ckpt, llm.tokenizer, PROMPTS[2], p)
    assert llm.stats.constrained_sample_steps - before == 5  # output indices 0..4
    before = llm.stats.constrained_sample_steps
    out = llm.generate([PROMPTS[2]], greedy(max_tokens=12, min_tokens=5, repetition_penalty=1.2))[0].outputs[0]
    assert llm.stats.constrained_sample_steps - before == len(out.token_ids) == 12


def test_a_forbidden_token_is_never_sampled_at_any_temperature():
    llm = LLM("tiny", log=lambda *_: None, **TINY)
    allowed = [40, 41, 42, 43]
    outs = [o.outputs[0] for o in llm.generate([[5, 6, 7]] * 3, [
        SamplingParams(max_tokens=24, seed=1, allowed_token_ids=allowed),
        SamplingParams(max_tokens=24, seed=2, min_tokens=24, logit_bias={257: 100}),
        SamplingParams(max_tokens=24, seed=3, temperature=2.0, allowed_token_ids=allowed, logit_bias={40: -100}),
    ])]
    assert set(outs[0].token_ids) <= set(allowed) and len(outs[0].token_ids) == 24
    assert 257 not in outs[1].token_ids and len(outs[1].token_ids) == 24
    assert set(outs[2].token_ids) <= {41, 42, 43}


def test_numbers_past_float32_leave_every_row_finite_so_masks_hold():
    """The API takes any finite repetition penalty and a temperature up to 2 (vLLM's ranges);
    as float32 a penalty can be inf or 0, and a logit divided or multiplied by it inf or NaN:
    a NaN row draws any token, a forbidden one too."""
    llm = LLM("tiny", log=lambda *_: None, **TINY)
    allowed = [40, 41, 42, 43]
    extremes = [dict(temperature=2.0), dict(repetition_penalty=1e300), dict(repetition_penalty=1e-300),
                dict(temperature=0.5, repetition_penalty=1e-38)]
    params = [SamplingParams(max_tokens=12, seed=i, ignore_eos=True, allowed_token_ids=allowed, **kw, **extra)
              for i, kw in enumerate(extremes) for extra in ({}, dict(logit_bias={40: -100, 41: -100}))]
    outs = [o.outputs[0] for o in llm.generate([[40, 41, 5, 6, 7]] * len(params), params)]
    for p, out in zip(params, outs):
        assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed), (p, out.token_ids)


def test_a_request_with_processors_is_never_speculated_and_gets_the_tokens_it_gets_without():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompt = [5, 6, 7, 8] * 6
    p = greedy(max_tokens=20, repetition_penalty=1.2, presence_penalty=0.5)
    plain = LLM("tiny", log=lambda *_: None, **TINY)
    want = plain.generate([prompt], p)[0].outputs[0].token_ids
    llm = LLM("tiny", log=lambda *_: None, **TINY, speculative_config=spec)
    out = llm.generate([prompt], p)[0]
    assert out.outputs[0].token_ids == want
    assert llm.stats.spec_decode_num_drafts == 0 and out.metrics.spec_acceptance_rate is None
    # the same prompt without processors does get drafts (so the check above could fail)
    llm.generate([prompt], greedy(max_tokens=20))
    assert llm.stats.spec_decode_num_drafts > 0


def test_plain_steps_compile_nothing_new_and_a_penalty_width_compiles_once():
    fresh_step_programs()  # the programs of an earlier engine with this key compiled the width already
    # test_compilation's shapes: their warm-up's programs are in the persistent compilation cache
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64)
    with count_compilations() as compiled:
        llm.generate([[5, 6, 7], [8] * 30], [greedy(max_tokens=6), SamplingParams(max_tokens=6, seed=1)])
        [masked] = llm.generate([[5, 6, 7]], greedy(max_tokens=6, allowed_token_ids=[40, 41], min_tokens=3))[0].outputs
        assert compiled == [] and set(masked.token_ids) <= {40, 41}  # masks: the one sample program
        llm.generate([[5, 6, 7]], greedy(max_tokens=6, repetition_penalty=1.3))  # 3 + 6 tokens: width 16
        assert len(compiled) == 1
        llm.generate([[9, 9, 9, 9], [5]], [greedy(max_tokens=8, logit_bias={3: 2.0}),
                                           greedy(max_tokens=8, frequency_penalty=1.0)])
        assert len(compiled) == 1


def test_preemption_by_recompute_keeps_the_counts_with_the_outputs():
    """A cache too small for all four: preempted and recomputed, each request gets the tokens
    it gets alone (its counts were not reset, nor counted twice). Alone, one request's at
    most 69 tokens take 5 of the 13 blocks: nothing is preempted. Together, the four 29-token
    prompts take 8 blocks, 12 after 4 tokens each, and need 16 after 20: min_tokens keeps each
    going past that, so a request is preempted before its min_tokens count is met and is
    recomputed with its counts mid-way. (test_engine's and test_request_metrics' tight shapes:
    their programs are compiled once for all three.)"""
    params = [greedy(max_tokens=40, frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.1,
                     bad_words=["ab"], ignore_eos=False, min_tokens=30) for _ in range(4)]
    prompts = [[1] + [3 + i] * 28 for i in range(4)]
    llm = LLM("tiny", log=lambda *_: None, **TINY, num_kv_blocks=14)
    alone = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    assert llm.stats.num_preemptions == 0
    outs = llm.generate(prompts, params)
    assert llm.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone


def test_a_grammar_and_the_masks_both_hold():
    import re

    from sampling_params import StructuredOutputsParams as SO

    llm = LLM("tiny", log=lambda *_: None, **TINY)
    outs = [o.outputs[0] for o in llm.generate([[5, 6, 7]] * 2, [
        SamplingParams(max_tokens=30, seed=s, structured_outputs=SO(regex="[a-e]{10,20}"), bad_words=["c", "ab"],
                       allowed_token_ids=[ord(x) for x in "abcd"] + [257], min_tokens=12) for s in (1, 2)])]
    for o in outs:
        assert re.fullmatch("[abd]{12,20}", o.text) and "ab" not in o.text, o.text


A, B = ord("a"), ord("b")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_masks_that_part_mid_way_end_the_request_without_a_token_they_forbid(async_scheduling):
    """A grammar against allowed_token_ids or bad_words (or those against each other) can
    leave no token at some position: the request ends there with finish_reason "abort",
    outputs no token it forbids (ids, text, logprobs), frees its slot and KV blocks, and a
    request beside it gets the tokens it gets alone. Greedy, random and penalised rows."""
    from sampling_params import StructuredOutputsParams as SO

    log: list[str] = []
    llm = LLM("tiny", log=log.append, **TINY, async_scheduling=async_scheduling, enable_prefix_caching=False)
    free = SamplingParams(max_tokens=6, temperature=0.0)
    alone = llm.generate([[9, 8, 7]], free)[0].outputs[0].token_ids
    cases = [  # (masks, the tokens they allow at each position until they part)
        (dict(structured_outputs=SO(regex="ab"), allowed_token_ids=[A]), [{A}]),
        (dict(structured_outputs=SO(regex="ab"), bad_words=["b"]), [{A}]),
        (dict(structured_outputs=SO(regex="a[ab]b"), allowed_token_ids=[A, B], bad_words=["ab"]), [{A}, {A}]),
        (dict(allowed_token_ids=[A], bad_words=["aa"]), [{A}]),  # no grammar: the processors part alone
    ]
    for masks, allowed in cases:
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4,
                                                                                     repetition_penalty=1.3)):
            p = SamplingParams(max_tokens=8, logprobs=2, **sampling, **masks)
            out, beside = llm.generate([[1, 2, 3], [9, 8, 7]], [p, free])
            o = out.outputs[0]
            assert o.finish_reason == "abort", (masks, sampling, o)
            assert len(o.token_ids) == len(allowed) and all(t in ok for t, ok in zip(o.token_ids, allowed)), \
                (masks, sampling, o.token_ids)
            assert o.text == bytes(o.token_ids).decode() and "\x00" not in o.text
            assert [lp.token_id for lp in o.logprobs] == list(o.token_ids)
            assert beside.outputs[0].token_ids == alone
            sch = llm.engine.scheduler
            assert sch.num_running == sch.num_waiting == 0 and sch.allocator.usage == 0
            assert len(sch._free_slots) == 4
    assert sum("allow no token after" in line for line in log) == len(cases) * 3


def test_masks_that_leave_no_first_token_are_refused_naming_the_fields():
    """Where the conflict shows before the first token (the grammar's first tokens against
    allowed_token_ids, bad_words or min_tokens' stop tokens; or those against each other)
    the request is refused: a ValueError offline, a 400 naming the field over HTTP."""
    from aiohttp.test_utils import TestClient, TestServer

    import server
    from sampling_params import ParamError, StructuredOutputsParams as SO

    # tiny_async_engine's shapes: the two engines share their programs
    llm = LLM("tiny", log=lambda *_: None, max_num_seqs=2, max_model_len=128, warmup=False)
    eos = llm.engine.model_config.eos_token_ids[0]
    for masks, says, param in (
            (dict(structured_outputs=SO(regex="b"), allowed_token_ids=[A]),
             "the structured output constraint (regex) and allowed_token_ids", "allowed_token_ids"),
            (dict(structured_outputs=SO(choice=["b", "bc"]), bad_words=["b"]),
             "the structured output constraint (choice) and bad_words", "bad_words"),
            (dict(structured_outputs=SO(regex="b"), allowed_token_ids=[A, B], bad_words=["b"]),
             "the structured output constraint (regex) and bad_words", "bad_words"),  # allowed_token_ids keeps b
            (dict(allowed_token_ids=[A], bad_words=["a"]), "allowed_token_ids and bad_words", "allowed_token_ids"),
            (dict(allowed_token_ids=[eos], min_tokens=1), "allowed_token_ids and min_tokens", "allowed_token_ids")):
        with pytest.raises(ParamError, match=f"^{re_escape(says)} leave no token allowed") as e:
            llm.engine.validate(EngineRequest("check", [1, 2, 3], SamplingParams(max_tokens=4, **masks)))
        assert e.value.param == param
        with pytest.raises(ValueError, match=re_escape(says)):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **masks))
    assert llm.engine.scheduler.num_waiting == 0
    # ... where the grammar allows some of them, it runs
    o = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=SO(regex="[ab]"),
                                                 allowed_token_ids=[A, eos]))[0].outputs[0]
    assert o.token_ids[0] == A and o.finish_reason == "stop"

    with tiny_async_engine() as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())

        def post(body: dict) -> tuple[int, dict]:
            async def one():
                resp = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                                  "temperature": 0.0} | body)
                return resp.status, await resp.json()
            return loop.run_until_complete(asyncio.wait_for(one(), 300))

        try:
            status, body = post({"guided_regex": "b", "allowed_token_ids": [A]})
            assert status == 400 and body["error"]["param"] == "allowed_token_ids", body
            assert "the structured output constraint (regex) and allowed_token_ids leave no token allowed" \
                in body["error"]["message"], body
            status, body = post({"response_format": {"type": "json_object"}, "bad_words": ["{"]})
            assert status == 400 and body["error"]["param"] == "bad_words", body
            # mid-way: a clean end, no token the masks forbid
            status, body = post({"guided_regex": "ab", "allowed_token_ids": [A], "logprobs": 1})
            choice = body["choices"][0]
            assert status == 200 and choice["text"] == "a" and choice["finish_reason"] == "abort", body
            assert choice["logprobs"]["tokens"] == ["a"] and body["usage"]["completion_tokens"] == 1, body
        finally:
            loop.run_until_complete(client.close())


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ---- validation: offline ValueErrors, the server's 400s ---------------------------------------

BAD = [  # (field, value, message part): vLLM's checks
    ("min_tokens", -1, "min_tokens must be greater than or equal to 0"),
    ("min_tokens", 17, "min_tokens must be less than or equal to max_tokens=16"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be a finite number greater than zero"),
    ("allowed_token_ids", [], "allowed_token_ids is not None and empty"),
    ("bad_words", [""], "bad_words cannot contain an empty string"),
    ("logit_bias", {"x": 1}, "not an integer or string representing an integer"),
    ("logit_bias", {"5": "high"}, "must be a number"),
]


@pytest.mark.parametrize("name,value,message", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_values_are_vllms_value_errors_offline_and_400s_naming_the_field(name, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(max_tokens=16, **{name: value})
    with pytest.raises(ApiError) as e:
        parse_sampling({"max_tokens": 16, name: value}, 3, 256, chat=False)
    assert e.value.status == 400 and e.value.param == name, (e.value, e.value.param)


def test_offline_seed_is_int64_as_the_servers():
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-2**63).seed == -2**63


def test_server_takes_the_fields_and_refuses_out_of_vocabulary_ids():
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine() as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())

        def post(body: dict) -> tuple[int, dict]:
            async def one():
                resp = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "temperature": 0.0} | body)
                return resp.status, await resp.json()
            return loop.run_until_complete(asyncio.wait_for(one(), 300))

        try:
            status, body = post({"max_tokens": 6, "allowed_token_ids": [40, 41], "logit_bias": {"40": -100},
                                 "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                 "min_tokens": 2, "bad_words": ["zz"]})
            assert status == 200, body
            assert body["choices"][0]["text"] == chr(41) * 6, body
            for field_, value in (("logit_bias", {"512": 1}), ("logit_bias", {"-1": 1}),
                                  ("allowed_token_ids", [3, 512])):
                status, body = post({"max_tokens": 2, field_: value})
                assert status == 400 and "out-of-vocab" in body["error"]["message"], body
                assert body["error"]["param"] == field_, body
            status, body = post({"max_tokens": 2, "logit_bias": {"512": 1, "9" * 4000: 1}})  # one id, not 4,000 digits
            assert status == 400 and body["error"]["message"] == (
                "token_id(s) [512, 99999999...(4000 digits)] in logit_bias contain out-of-vocab token ids. "
                "Vocabulary size: 512"), body
            assert post({"max_tokens": 2})[0] == 200
        finally:
            loop.run_until_complete(client.close())
