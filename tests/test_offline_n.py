"""LLM.generate's outputs in vLLM's shape, and vLLM's `n` offline.

Claims: one RequestOutput per prompt, its `prompt` the text it was given (chat: the
rendered template), its `outputs` the n samples (CompletionOutput) in index order; the n
samples of a seeded request are what the server's n gives and what n single requests
seeded seed + i give; greedy n > 1 is refused, offline and over HTTP, as vLLM's
_verify_greedy_sampling (its samples would all be one), after the other fields' checks as
vLLM's, greedy being temperature 0 only: a
temperature in (0, 0.01) is raised to 0.01, as vLLM's __post_init__; cumulative_logprob is the sum of the
sampled tokens' log-probabilities (transformers' logits, NumPy's log-softmax) when logprobs
are asked, else None; n < 1 is refused where SamplingParams is built, and the engine
itself refuses n != 1 (its callers expand n)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from conftest import hf_logits, tiny_async_engine
from llm import LLM, CompletionOutput, RequestOutput, SamplingParams

# tiny_async_engine's shapes: the server below and these LLMs share compiled programs.
SHAPES = dict(max_num_seqs=2, max_model_len=128, warmup=False)
PROMPT = [1, 5, 9, 13]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", log=lambda *_: None, record_trace=True, **SHAPES)


def test_a_vllm_user_s_first_loop_reads_outputs_0_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # (the second with vLLM's detokenize=False: its tokens, no text)
    outs = llm.generate(["Hello", PROMPT], [params, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                                   detokenize=False, extra_args={"tag": 1})],
                        lora_request=None)  # vLLM's keyword, at the base model
    assert [type(o) for o in outs] == [RequestOutput] * 2
    hello, ids = outs
    assert (hello.prompt, ids.prompt) == ("Hello", None)  # text when given as text
    assert hello.prompt_token_ids == llm.tokenizer.encode("Hello") and ids.prompt_token_ids == PROMPT
    assert llm.get_tokenizer().encode("Hello") == hello.prompt_token_ids  # vLLM's accessor
    for o in outs:
        assert o.finished and o.prompt_logprobs is None and len(o.outputs) == 1
        (c,) = o.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
        assert len(c.token_ids) == 5 and c.text == (llm.tokenizer.decode(c.token_ids) if o is hello else "")
        assert (c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs) == ("length", None, None, None)
        assert o.metrics.num_preemptions == o.num_preemptions == 0
        assert o.arrival_time <= o.first_token_time <= o.finished_time
        # vLLM's fields for what is not run here, at vLLM's values for a plain text request
        assert (o.lora_request, o.encoder_prompt, o.encoder_prompt_token_ids, o.multi_modal_placeholders,
                o.kv_transfer_params, c.lora_request) == (None, None, None, {}, None, None)


def test_chat_s_prompt_is_the_rendered_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "hi"}]
    [out] = llm.chat(conversation, SamplingParams(max_tokens=2, temperature=0.0))
    want = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert out.prompt == want and out.prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)



@pytest.mark.parametrize("messages, kw, error, message", [
    ([{"content": "hi"}], {}, ValueError, r"conversation 0: messages\[0\] must be an object with string 'role'"),
    ([{"role": "user", "content": 5}], {}, ValueError, "must be an object with string 'role' and 'content'"),
    ([{"role": "user", "content": None}], {}, ValueError, "must be an object with string 'role' and 'content'"),
    ([{"role": "", "content": "x"}], {}, ValueError, "'role' must be a non-empty string"),
    ([[{"role": "user", "content": "x"}], []], {}, ValueError, "conversation 1: 'messages' must be a non-empty"),
    (["hi", "there"], {}, ValueError, "conversation 0: 'messages' must be a non-empty array"),
    ("hi", {}, TypeError, "messages must be a list"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": 5}, ValueError, "'chat_template_kwargs' must be"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tokenize": True}}, ValueError,
     "chat_template_kwargs may not set tokenize"),
    ([{"role": "user", "content": "x"}], {"chat_template": 5}, TypeError, "chat_template must be a string"),
    ([{"role": "user", "content": "x"}], {"chat_template": "{{ x }}"}, ValueError, "takes no other chat template"),
])
def test_chat_refuses_what_the_server_refuses_and_still_generates(llm: LLM, messages, kw, error, message) -> None:
    with pytest.raises(error, match=message):
        llm.chat(messages, SamplingParams(max_tokens=1), **kw)
    assert not llm.engine.has_unfinished()
    [out] = llm.chat(({"role": "user", "content": "hi"},), SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2


def _post(body: dict) -> tuple[int, dict]:
    """The server's status and JSON answer to `body` on /v1/completions."""
    from aiohttp.test_utils import TestClient, TestServer

    import cli_args
    import server

    with tiny_async_engine() as (loop, engine):
        async def post() -> tuple[int, dict]:
            app = server.app_from_args(engine, cli_args.build_parser().parse_args([]))
            async with TestClient(TestServer(app)) as client:
                resp = await client.post("/v1/completions", json=body)
                return resp.status, json.loads(await resp.text())

        return loop.run_until_complete(asyncio.wait_for(post(), 300))


def _server_choices(body: dict) -> list[list[int]]:
    """The server's n choices' token ids for `body` on /v1/completions."""
    status, out = _post(body)
    assert status == 200, out
    return [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def test_logprobs_read_as_vllm_s_dicts_of_token_id_to_logprob(llm: LLM) -> None:
    """vLLM's CompletionOutput.logprobs: per position a dict token id -> Logprob (logprob,
    rank, decoded_token), the sampled token first, then the top `logprobs` others; greedy,
    the sampled token is rank 1, and each text is its token's (the tokenizer's decode of it
    alone, where that is whole characters); with detokenize=False no text."""
    tok = llm.get_tokenizer()
    [out] = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 3
    for t, position in zip(c.token_ids, c.logprobs):
        assert next(iter(position)) == t and t in position and len(position) == 2  # greedy: itself in the top 2
        assert [e.rank for e in position.values()] == [1, 2]
        assert position[t].logprob == max(e.logprob for e in position.values())
        for i, e in position.items():  # (part of a character: vLLM's "" or the character it completes, never U+FFFD)
            alone = tok.decode([i])
            assert e.decoded_token == alone if not alone.endswith("\ufffd") else "\ufffd" not in e.decoded_token
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)))
    [raw] = llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, detokenize=False))
    assert {t: e.decoded_token for t, e in raw.outputs[0].logprobs[0].items()} == {c.token_ids[0]: None}


def test_a_lora_request_or_multimodal_input_is_refused_naming_it(llm: LLM) -> None:
    """vLLM's lora_request (generate, chat, beam_search) and chat's mm_processor_kwargs: None
    runs the base model; anything else is a ValueError, not an adapter left unapplied. A
    prompt dict's multimodal data or embeddings: a ValueError naming the key."""
    from beam_search import BeamSearchParams

    conversation = [{"role": "user", "content": "hi"}]
    for call in (lambda: llm.generate([PROMPT], lora_request=object()),
                 lambda: llm.chat(conversation, lora_request=object()),
                 lambda: llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())):
        with pytest.raises(ValueError, match="lora_request is not supported: taxirank has no LoRA"):
            call()
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):
        llm.chat(conversation, mm_processor_kwargs={"num_crops": 4})
    # vLLM's multimodal TextPrompt and its EmbedsPrompt, named, before anything runs
    for prompt, key in [({"prompt": "hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),
                        ({"prompt_token_ids": PROMPT, "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
                        ({"prompt_embeds": np.zeros((2, 8))}, "prompt_embeds")]:
        with pytest.raises(ValueError, match=f"{key} is not supported: taxirank takes text and token ids only"):
            llm.generate(["Hello", prompt])
    assert not llm.engine.has_unfinished()


def test_sampling_params_take_vllm_s_detokenize_extra_args_and_clone() -> None:
    """vLLM's SamplingParams fields and method beyond the sampling ones: detokenize (stop
    strings need it: vLLM's message), extra_args (a dict, kept for the caller: vLLM's
    in-tree sampling reads none either), clone (a deep copy); thinking_token_budget,
    logprob_token_ids and flat_logprobs unset only, else a ValueError naming them."""
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True. Set "
                                         "detokenize=True to use stop."):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a bool"):
        SamplingParams(detokenize="no")
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])
    # vLLM's fields for what is not run here: unset only (a thinking budget of -1 is vLLM's unset)
    assert SamplingParams(thinking_token_budget=-1, logprob_token_ids=None, flat_logprobs=False) == SamplingParams()
    for field, value in [("thinking_token_budget", 64), ("logprob_token_ids", [5, 6]), ("flat_logprobs", True)]:
        with pytest.raises(ValueError, match=f"{field} is not supported: "):
            SamplingParams(**{field: value})
    p = SamplingParams(seed=3, logit_bias={5: 1.0}, extra_args={"k": [1]})
    q = p.clone()
    assert q == p and q is not p and q.extra_args is not p.extra_args and q.logit_bias is not p.logit_bias
    assert SamplingParams().detokenize and SamplingParams().extra_args is None


@pytest.mark.parametrize("temperature", [0.0, 0])
def test_greedy_n_above_one_is_refused_as_vllm_offline_and_over_http(llm: LLM, temperature: float) -> None:
    """vLLM's SamplingParams._verify_greedy_sampling, with its message, where SamplingParams
    is built; over HTTP a 400 naming `n`. Greedy n = 1 still runs."""
    message = "n must be 1 when using greedy sampling, got 3."
    with pytest.raises(ValueError) as err:
        SamplingParams(n=3, max_tokens=6, temperature=temperature, ignore_eos=True)
    assert str(err.value) == message
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=temperature))[0].outputs) == 1
    status, out = _post({"prompt": PROMPT, "n": 3, "max_tokens": 6, "temperature": temperature})
    assert status == 400 and (out["error"]["message"], out["error"]["param"]) == (message, "n")


@pytest.mark.parametrize("bad, message", [
    (dict(top_p=2.0), "top_p must be in (0, 1], got 2.0"),
    (dict(top_k=-2), "top_k must be -1 or 0 (disabled) or >= 1, got -2"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0"),
    (dict(min_tokens=9), "min_tokens must be less than or equal to max_tokens=6, got 9"),
])
def test_greedy_n_is_checked_after_the_other_fields_as_vllm(bad: dict, message: str) -> None:
    """vLLM's __post_init__ runs _verify_args (n, penalties, temperature, top_p, top_k,
    min_p, max_tokens, min_tokens, logprobs, stop, bad_words) before _verify_greedy_sampling:
    a greedy n = 3 request with another bad field hears of that field, offline and over HTTP."""
    from protocol import ApiError, parse_sampling

    with pytest.raises(ValueError) as err:
        SamplingParams(n=3, max_tokens=6, temperature=0.0, **bad)
    assert str(err.value) == message
    with pytest.raises(ApiError) as api:
        parse_sampling({"n": 3, "max_tokens": 6, "temperature": 0} | bad, len(PROMPT), 128, chat=False)
    assert (str(api.value), api.value.param) == (message, next(iter(bad)))


def test_a_greedy_n_request_with_a_bad_top_p_is_a_400_naming_top_p() -> None:
    status, out = _post({"prompt": PROMPT, "n": 3, "max_tokens": 6, "temperature": 0, "top_p": 2})
    assert status == 400 and out["error"]["param"] == "top_p", out


def test_a_temperature_below_0_01_is_raised_to_it_and_samples_n_offline_and_over_http(llm: LLM, caplog) -> None:
    """vLLM's __post_init__ raises a temperature in (0, _MAX_TEMP = 0.01) to 0.01, with its
    warning: such a request samples (n > 1 included), greedy being temperature 0 alone."""
    for t in (5e-6, 1e-300, 0.009):
        caplog.clear()
        p = SamplingParams(n=2, temperature=t)
        assert (p.temperature, p.greedy) == (0.01, False)
        assert f"temperature {t} is less than 0.01, which may cause numerical errors nan or inf in tensors. " \
               "We have maxed it out to 0.01." in caplog.text
    assert SamplingParams(temperature=0.01).temperature == 0.01 and SamplingParams(temperature=0.0).greedy
    [out] = llm.generate([PROMPT], SamplingParams(n=2, seed=7, max_tokens=3, temperature=5e-6, ignore_eos=True))
    got = [c.token_ids for c in out.outputs]
    assert [len(t) for t in got] == [3, 3]
    # over HTTP too, and the samples are temperature 0.01's
    body = {"prompt": PROMPT, "n": 2, "seed": 7, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}
    assert _server_choices(body | {"temperature": 5e-6}) == got == _server_choices(body | {"temperature": 0.01})


def test_n_samples_are_child_requests_in_index_order(llm: LLM) -> None:
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    alone = [llm.generate([PROMPT], SamplingParams(seed=11 + i, **sampled))[0].outputs[0] for i in range(3)]
    llm.engine.trace.clear()
    [out] = llm.generate([PROMPT], SamplingParams(n=3, seed=11, **sampled))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # sample i is the prompt alone seeded 11 + i: the outputs come in index order
    assert [(c.token_ids, c.text) for c in out.outputs] == [(a.token_ids, a.text) for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) == 3  # three different draws: an order to check
    # vLLM's child ids, i_<parent>; the parent's id is the output's
    scheduled = {rid for t in llm.engine.trace for rid, _ in t.scheduled}
    assert scheduled == {f"{i}_{out.request_id}" for i in range(3)}
    assert out.num_preemptions == 0 and not llm.engine.has_unfinished()


def test_seeded_samples_are_the_server_s_and_single_requests_seeded_seed_plus_i(llm: LLM) -> None:
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    # a prompt with n = 3 beside one with n = 1: each gets its own samples back
    many, one = llm.generate([PROMPT, [1, 7]], [SamplingParams(n=3, seed=5, **sampled),
                                                SamplingParams(seed=9, **sampled)])
    got = [c.token_ids for c in many.outputs]
    singles = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, [SamplingParams(seed=5 + i, **sampled)
                                                                           for i in range(3)])]
    assert got == singles and len({tuple(t) for t in got}) == 3  # seeds 5, 6, 7: three different draws
    assert len(one.outputs) == 1
    assert one.outputs[0].token_ids == llm.generate([[1, 7]], SamplingParams(seed=9, **sampled))[0].outputs[0].token_ids
    assert _server_choices({"prompt": PROMPT, "n": 3, "seed": 5, "return_token_ids": True, **sampled}) == got
    # seed + i wraps into the 64-bit seeds, as the server's
    [top] = llm.generate([PROMPT], SamplingParams(n=2, seed=2**63 - 1, **sampled))
    [wrapped] = llm.generate([PROMPT], SamplingParams(seed=-2**63, **sampled))
    assert top.outputs[1].token_ids == wrapped.outputs[0].token_ids


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens_logprobs(hf_checkpoint) -> None:
    path = hf_checkpoint("llama2")
    # test_prompt_logprobs' shapes (its programs are cached)
    llm = LLM(path, log=lambda _: None, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              num_kv_blocks=64, warmup=False)
    prompt = [5, 17, 42, 99, 7]
    # temperature 1, no filters: the sampled distribution is the model's own
    [out] = llm.generate([prompt], SamplingParams(n=2, seed=3, max_tokens=8, ignore_eos=True, logprobs=0))
    for c in out.outputs:
        logits = hf_logits(path, prompt + c.token_ids).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        rows = np.arange(len(prompt) - 1, len(prompt) + len(c.token_ids) - 1)
        want = log_softmax[rows, c.token_ids].sum()
        assert c.cumulative_logprob == pytest.approx(want, abs=2e-3)
        assert c.cumulative_logprob == pytest.approx(np.sum([lp.logprob for lp in c.logprobs]), abs=1e-9)
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, seed=3))
    assert plain.outputs[0].cumulative_logprob is None  # not asked, as vLLM


@pytest.mark.parametrize("n, message", [(0, "at least 1, got 0"), (-1, "at least 1, got -1"),
                                        (True, "an int"), (1.5, "an int"), ("2", "an int"),
                                        (2**14 + 1, "at most 16384, got 16385")])  # vLLM's VLLM_MAX_N_SEQUENCES
def test_n_out_of_vllm_s_range_or_not_an_integer_is_refused(n, message) -> None:
    with pytest.raises(ValueError, match=f"n must be {message}"):
        SamplingParams(n=n)


def test_the_engine_refuses_n_other_than_one_and_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="n=2") as err:
        llm.engine.add_request("many", PROMPT, SamplingParams(n=2, max_tokens=2))
    assert err.value.param == "n"  # the server's 400 names the field
    assert not llm.engine.has_unfinished()


def test_max_tokens_none_is_the_room_each_prompt_leaves_as_vllm(llm: LLM) -> None:
    """vLLM's SamplingParams(max_tokens=None): each sample runs until the context is full
    (max_model_len 128 here), per prompt; a prompt that fills the context is still refused."""
    params = SamplingParams(max_tokens=None, n=2, seed=0, ignore_eos=True, min_tokens=100)
    outs = llm.generate([PROMPT, list(range(1, 101))], params)
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[128 - 4] * 2, [128 - 100] * 2]
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    with pytest.raises(ValueError, match="over max_model_len"):
        llm.generate([list(range(1, 129))], SamplingParams(max_tokens=None))
    assert not llm.engine.has_unfinished()
    for bad in (0, -1, 2.0, "16"):
        with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
            SamplingParams(max_tokens=bad)


def test_generate_takes_vllm_s_keywords(llm: LLM) -> None:
    """vLLM's LLM.generate(prompts, sampling_params=None, *, use_tqdm, priority): a vLLM
    script that names its arguments runs unchanged, and gets what the positional call gets."""
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (named,) = llm.generate(prompts=PROMPT, sampling_params=params, use_tqdm=False, priority=[0])
    (positional,) = llm.generate(PROMPT, params)
    assert named.outputs[0].token_ids == positional.outputs[0].token_ids and len(named.outputs[0].token_ids) == 3


def test_use_tqdm_may_be_the_bar_factory_as_vllm(llm: LLM) -> None:
    """vLLM's use_tqdm: bool | Callable[..., tqdm]: a callable makes the progress bar, which
    counts every prompt once and is closed."""
    made = []

    class Bar:
        def __init__(self, **kwargs) -> None:
            self.kwargs, self.n, self.closed = kwargs, 0, False
            made.append(self)

        def update(self, k: int = 1) -> None:
            self.n += k

        def close(self) -> None:
            self.closed = True

    outs = llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2, n=2), use_tqdm=Bar)
    assert len(outs) == 2 and len(made) == 1
    assert made[0].kwargs["total"] == 2 and made[0].n == 2 and made[0].closed
    from beam_search import BeamSearchParams
    llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=Bar)
    assert len(made) == 2 and made[1].kwargs["total"] == 3 and made[1].n == 3 and made[1].closed


def test_stop_and_bad_words_none_are_none_as_vllm(llm: LLM) -> None:
    """vLLM's SamplingParams(stop=None, bad_words=None), as a script that passes optional
    settings through writes them: no stop strings, no bad words."""
    params = SamplingParams(stop=None, bad_words=None, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert params == SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(PROMPT, params)[0].outputs[0].token_ids) == 3
