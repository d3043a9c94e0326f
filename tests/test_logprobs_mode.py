"""vLLM's --logprobs-mode and --max-logprobs.

Claims: in each of the four modes a sampled token's logprob, rank and top logprobs are,
against transformers' logits with vLLM's processors, temperature and top-k applied in
NumPy: raw_logprobs the log_softmax of the model's logits (before logit_bias, penalties,
temperature and top-k: vLLM V1's default), raw_logits those logits, processed_logprobs
the log_softmax of the logits the token was drawn from (a filtered-out token at -inf),
processed_logits those; so do a verified row's under ngram speculation; prompt logprobs
are raw logprobs in every mode (vLLM's); raw logprobs see a grammar's mask but not
allowed_token_ids' (vLLM applies the grammar before its sampler). A request asking more
logprobs or prompt_logprobs than --max-logprobs is vLLM's ValueError offline and a 400
naming the field the client sent (chat's top_logprobs); -1 lifts the cap to the
vocabulary, and a request's -1 (vLLM's) asks the whole vocabulary. Both flags are checked
where they enter and are server flags."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from conftest import hf_logits, tiny_async_engine
from config import EngineConfig
from llm import LLM, SamplingParams
from sampling_params import StructuredOutputsParams

# test_sampling_controls' shapes (and checkpoint): a cold run compiles their programs once for both
SMALL = dict(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128, num_kv_blocks=64, warmup=False)
MODES = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
PROMPT = [5, 9, 5, 9, 5, 17, 33, 5, 40, 41]


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("llama2", tokenizer=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def processed(raw: np.ndarray, p: SamplingParams, prompt: list[int], out: list[int]) -> np.ndarray:
    """vLLM's processed logits: logit_bias, then the repetition, frequency and presence
    penalties; a random row's then at its temperature with all but its top_k at -inf."""
    x = raw.astype(np.float32).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += np.float32(b)
    seen = sorted(set(prompt) | set(out))
    r = np.float32(p.repetition_penalty)
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    counts = np.bincount(np.asarray(out, np.int64), minlength=len(x)).astype(np.float32)
    x -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * (counts > 0)
    if p.temperature == 0:
        return x
    x = x / np.float32(p.temperature)
    if p.top_k > 0:
        x[x < np.sort(x)[-p.top_k]] = -np.inf
    return x


def want(mode: str, raw: np.ndarray, proc: np.ndarray) -> np.ndarray:
    x = (raw if mode.startswith("raw") else proc).astype(np.float64)
    return x if mode.endswith("logits") else log_softmax(x)


def check_output(ckpt: str, mode: str, prompt: list[int], p: SamplingParams, o) -> None:
    """Each position's logprob and top logprobs against transformers' logits, as `mode` says."""
    assert len(o.logprobs) == len(o.token_ids) > 0
    for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        raw = hf_logits(ckpt, prompt + o.token_ids[:j])[-1]
        w = want(mode, raw, processed(raw, p, prompt, o.token_ids[:j]))
        assert lp.token_id == tok
        np.testing.assert_allclose(lp.logprob, w[tok], atol=5e-4, rtol=1e-4)
        ids = [i for i, _ in lp.top]
        assert len(ids) == p.logprobs and ids == np.argsort(-w, kind="stable")[:p.logprobs].tolist(), (j, ids)
        np.testing.assert_allclose([v for _, v in lp.top], w[ids], atol=5e-4, rtol=1e-4)
        # vLLM's rank: the tokens at least as likely in the mode's distribution (within float32's reach)
        assert 1 + np.sum(w > w[tok] + 5e-4) <= lp.rank <= np.sum(w >= w[tok] - 5e-4), (j, lp.rank)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_gives_vllms_logprobs_of_transformers_logits(ckpt, mode):
    llm = LLM(ckpt, log=lambda *_: None, logprobs_mode=mode, **SMALL)
    # the raw top tokens of the first position: biased, so that processing reorders them
    first = np.argsort(-hf_logits(ckpt, PROMPT)[-1])
    bias = {int(first[3]): 2.5, int(first[0]): -1.5}
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=7, logprobs=5, logit_bias=bias,
                             repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, logit_bias=bias, frequency_penalty=0.7,
                             ignore_eos=True, prompt_logprobs=3)]
    outs = llm.generate([PROMPT, PROMPT], params)
    for p, o in zip(params, outs):
        check_output(ckpt, mode, PROMPT, p, o.outputs[0])
    # prompt logprobs: raw logprobs whatever the mode, as vLLM's
    ref = np.stack([log_softmax(x) for x in hf_logits(ckpt, PROMPT)])
    got = outs[1].prompt_logprobs
    assert got[0] is None and len(got) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        assert got[i].token_id == PROMPT[i]
        np.testing.assert_allclose(got[i].logprob, ref[i - 1, PROMPT[i]], atol=5e-4)
        assert [t for t, _ in got[i].top] == np.argsort(-ref[i - 1], kind="stable")[:3].tolist()


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs"])
def test_verified_rows_logprobs_follow_the_mode(ckpt, mode):
    """ngram speculation: every emitted token's logprobs (drafts accepted or not) as the mode says."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(ckpt, log=lambda *_: None, logprobs_mode=mode, speculative_config=spec, **SMALL)
    prompt = [5, 6, 7, 8] * 6
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_k=4, seed=3, logprobs=3, ignore_eos=True)]
    outs = llm.generate([prompt, prompt], params)
    assert llm.stats.spec_decode_num_drafts > 0
    for p, o in zip(params, outs):
        check_output(ckpt, mode, prompt, p, o.outputs[0])


def test_raw_logprobs_see_a_grammars_mask_but_not_allowed_token_ids(ckpt, monkeypatch):
    """vLLM masks a grammar's tokens before its sampler and allowed_token_ids inside it: the
    raw top logprobs of the first position are those of the tokens the regex allows, some of
    them outside allowed_token_ids. The step passes the grammar's rows as a second bitmask,
    in the inputs a multi-host follower's template reads."""
    import jax

    from distributed import SAMPLE_MASKED

    llm = LLM(ckpt, log=lambda *_: None, **SMALL)
    runner, posted = llm.engine.runner, []
    run = runner._run

    def spy(kind, rows, T, args):
        posted.append((kind, rows, T, args))
        return run(kind, rows, T, args)

    monkeypatch.setattr(runner, "_run", spy)
    tok = llm.tokenizer
    vocab = llm.engine.model_config.vocab_size
    ok = np.array([re.fullmatch("[a-e]{1,3}", tok.decode([i])) is not None for i in range(vocab)])
    allowed = [tok.convert_tokens_to_ids(c) for c in "ab"]
    p = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, allowed_token_ids=allowed,
                       structured_outputs=StructuredOutputsParams(regex="[a-e]{3}"))
    o = llm.generate([PROMPT], p)[0].outputs[0]
    assert set(o.token_ids) <= set(allowed), o.token_ids
    w = log_softmax(np.where(ok, hf_logits(ckpt, PROMPT)[-1], -np.inf))
    lp = o.logprobs[0]
    ids = [i for i, _ in lp.top]
    assert ids == np.argsort(-w, kind="stable")[:5].tolist()
    np.testing.assert_allclose([v for _, v in lp.top], w[ids], atol=5e-4)
    np.testing.assert_allclose(lp.logprob, w[o.token_ids[0]], atol=5e-4)
    assert any(i not in allowed for i in ids) and all(np.isfinite(v) for _, v in lp.top)
    masked = [(rows, T, args) for kind, rows, T, args in posted if kind == SAMPLE_MASKED]
    assert masked and all(T == 1 and len(args) == 4 for _, T, args in masked)
    for rows, T, args in masked:
        template = runner._idle_args(SAMPLE_MASKED, rows, T)
        assert jax.tree.structure(template) == jax.tree.structure(args)
        assert [np.shape(x) for x in jax.tree.leaves(template)] == [np.shape(x) for x in jax.tree.leaves(args)]
        assert (args[2][0] != args[3][0]).any()  # the processors' mask is not in the second


def test_max_logprobs_caps_requests_with_vllms_message_and_minus_one_is_the_vocabulary(ckpt):
    llm = LLM(ckpt, log=lambda *_: None, **SMALL)  # the default, 20
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        with pytest.raises(ValueError, match=f"Requested {kind} logprobs of 21, which is greater than max allowed: 20"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: 21}))
    assert len(llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=20))[0].outputs[0].logprobs[0].top) == 20

    llm = LLM(ckpt, log=lambda *_: None, max_logprobs=-1, **SMALL)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"Requested sample logprobs of {vocab + 1}, which is greater than max "
                                         f"allowed: {vocab}"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=vocab + 1))
    p = SamplingParams(max_tokens=3, temperature=0.0, logprobs=40, prompt_logprobs=vocab, ignore_eos=True)
    o = llm.generate([PROMPT], p)[0]
    check_output(ckpt, "raw_logprobs", PROMPT, p, o.outputs[0])
    ref = log_softmax(hf_logits(ckpt, PROMPT)[0])
    top = o.prompt_logprobs[1].top
    assert len(top) == vocab and [t for t, _ in top] == np.argsort(-ref, kind="stable").tolist()
    np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1], atol=5e-4)


def test_minus_one_asks_the_whole_vocabulary_within_max_logprobs(ckpt):
    """vLLM's logprobs=-1 and prompt_logprobs=-1: every token's logprob, in order; a
    --max-logprobs below the vocabulary refuses them with vLLM's message, the vocabulary's size."""
    llm = LLM(ckpt, log=lambda *_: None, **SMALL)  # the default, 20
    vocab = llm.engine.model_config.vocab_size
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        with pytest.raises(ValueError, match=f"Requested {kind} logprobs of {vocab}, which is greater than max "
                                             "allowed: 20"):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: -1}))

    llm = LLM(ckpt, log=lambda *_: None, max_logprobs=-1, **SMALL)
    o = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, prompt_logprobs=-1))[0]
    logits = hf_logits(ckpt, PROMPT)
    for top, ref in ((o.prompt_logprobs[1].top, log_softmax(logits[0])), (o.outputs[0].logprobs[0].top,
                                                                         log_softmax(logits[-1]))):
        assert len(top) == vocab and [t for t, _ in top] == np.argsort(-ref, kind="stable").tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(ref)[::-1], atol=5e-4)
    assert o.outputs[0].cumulative_logprob == o.outputs[0].logprobs[0].logprob  # asked: -1 is not "none"


@pytest.fixture(scope="module")
def capped_post():
    """post(path, body) -> (status, JSON) on a tiny engine's server with --max-logprobs 5."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine(max_logprobs=5) as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())

        def post(path: str, body: dict) -> tuple[int, dict]:
            async def one():
                resp = await client.post(path, json=body)
                return resp.status, await resp.json()
            return loop.run_until_complete(asyncio.wait_for(one(), 300))

        try:
            yield post
        finally:
            loop.run_until_complete(client.close())


COMPLETION, CHAT = ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}), \
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_the_server_refuses_more_than_max_logprobs_with_a_400_naming_the_field(capped_post):
    path, base = COMPLETION
    for field in ("logprobs", "prompt_logprobs"):
        status, body = capped_post(path, base | {field: 6})
        assert status == 400 and body["error"]["param"] == field, body
        assert "greater than max allowed: 5" in body["error"]["message"], body
    # (as token ids: two tokens of the byte tokenizer may have the same text, one key)
    status, body = capped_post(path, base | {"logprobs": 5, "temperature": 0.0, "return_tokens_as_token_ids": True})
    assert status == 200 and all(len(t) == 5 for t in body["choices"][0]["logprobs"]["top_logprobs"]), body


def test_a_chat_400_over_max_logprobs_names_top_logprobs_the_field_sent(capped_post):
    path, base = CHAT
    for top in (6, -1):  # -1: the vocabulary, over the cap
        status, body = capped_post(path, base | {"logprobs": True, "top_logprobs": top})
        assert status == 400 and body["error"]["param"] == "top_logprobs", body
        assert "greater than max allowed: 5" in body["error"]["message"], body
    status, body = capped_post(path, base | {"prompt_logprobs": 6})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs", body


def test_minus_one_over_http_as_far_as_vllms_api_takes_it(capped_post):
    """vLLM's API: -1 for chat's top_logprobs and both endpoints' prompt_logprobs (the
    vocabulary, refused here by the cap), never for completions' logprobs."""
    from protocol import ApiError, parse_sampling

    def parse(body: dict, chat: bool):
        return parse_sampling(body, 3, 256, chat=chat)

    assert parse({"logprobs": True, "top_logprobs": -1}, True).logprobs == -1
    for chat in (False, True):
        assert parse({"prompt_logprobs": -1}, chat).prompt_logprobs == -1
        with pytest.raises(ApiError) as e:
            parse({"prompt_logprobs": -2}, chat)
        assert e.value.param == "prompt_logprobs"
    with pytest.raises(ApiError) as e:
        parse({"logprobs": -1}, False)
    assert e.value.status == 400 and e.value.param == "logprobs"
    path, base = COMPLETION
    status, body = capped_post(path, base | {"prompt_logprobs": -1})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs", body
    assert re.search(r"Requested prompt logprobs of \d+, which is greater than max allowed: 5",
                     body["error"]["message"]), body


def test_a_row_whose_masks_leave_no_token_ends_without_one_in_strict_json():
    """processed_logprobs of a row with no token left would be NaN: the request ends there
    ("abort") without that row's token or logprobs, whole and streamed, in strict JSON. Here
    allowed_token_ids allows only "a" and bad_words forbids "aa", so the second position has
    nothing left; the first token's processed logprob is 0 (the one token allowed)."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:300]}"))

    masks = {"max_tokens": 3, "allowed_token_ids": [ord("a")], "bad_words": ["aa"]}
    with tiny_async_engine(logprobs_mode="processed_logprobs") as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)

        async def run() -> list[dict]:
            await client.start_server()
            try:
                whole = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "logprobs": 1, **masks})
                streamed = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
                    "stream": True, **masks})
                assert whole.status == streamed.status == 200
                events = [line[6:] for line in (await streamed.text()).split("\n\n") if line.startswith("data: {")]
                return [strict(await whole.text())] + [strict(e) for e in events]
            finally:
                await client.close()
        answers = loop.run_until_complete(asyncio.wait_for(run(), 300))
    choice = answers[0]["choices"][0]
    assert choice["text"] == "a" and choice["finish_reason"] == "abort", choice
    assert choice["logprobs"]["token_logprobs"] == [0.0], choice["logprobs"]
    chat = [c for a in answers[1:] for ch in a["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]
    assert [(c["token"], c["logprob"]) for c in chat] == [("a", 0.0)], chat
    assert [ch["finish_reason"] for a in answers[1:] for ch in a["choices"] if ch["finish_reason"]] == ["abort"]


def test_the_flags_are_checked_where_they_enter_and_are_server_flags():
    import cli_args

    for bad, message in (({"logprobs_mode": "processed"}, "logprobs_mode must be one of raw_logprobs, "),
                         ({"max_logprobs": -2}, "max_logprobs must be >= 0, or -1"),
                         ({"max_logprobs": 2.0}, "max_logprobs must be an integer")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="tiny", **bad)
    for bad in ({"logprobs": -2}, {"prompt_logprobs": -3}, {"logprobs": 1.5}):
        with pytest.raises(ValueError, match="logprobs must be non-negative or -1"):
            SamplingParams(**bad)
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1  # vLLM's: the vocabulary
    assert SamplingParams(logprobs=500).logprobs == 500  # the engine's --max-logprobs decides
    help_text = cli_args.build_parser().format_help()
    assert "--logprobs-mode" in help_text and "--max-logprobs" in help_text
    args = cli_args.build_parser().parse_args(["--logprobs-mode", "processed_logits", "--max-logprobs", "-1"])
    config = cli_args.engine_config(args)
    assert config.logprobs_mode == "processed_logits" and config.max_logprobs == -1
    assert cli_args.engine_config(cli_args.build_parser().parse_args([])).logprobs_mode == "raw_logprobs"
    assert EngineConfig().max_logprobs == 20
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--logprobs-mode", "raw"])
