"""prompt_logprobs: the logprob of every prompt token given the ones before it, as vLLM
returns it (first entry None), checked against transformers' logits."""

import numpy as np
import pytest

from conftest import hf_logits
from llm import LLM, SamplingParams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint("llama2")


@pytest.fixture(scope="module")
def llm(checkpoint):
    # A small token budget: a 70-token prompt is computed in several chunks, and a prefix
    # cached by an earlier request must not be used.
    return LLM(checkpoint, log=lambda _: None, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
               num_kv_blocks=64, warmup=False)


def test_prompt_logprobs_equal_log_softmax_of_transformers_logits(llm, checkpoint):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 250, 70).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))  # now its prefix is cached
    short = [5, 6, 7]
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=5)
    out, other, plain = llm.generate([prompt, short, prompt[:40]], [params, params, SamplingParams(max_tokens=2)])
    assert plain.prompt_logprobs is None
    assert out.num_cached_tokens == 0  # recomputed: a cache hit would skip those positions' logits
    ref = _log_softmax(hf_logits(checkpoint, prompt))
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for i in range(1, len(prompt)):
        lp = lps[i]
        assert lp.token_id == prompt[i]
        np.testing.assert_allclose(lp.logprob, ref[i - 1, prompt[i]], atol=2e-4)
        top = np.argsort(-ref[i - 1])[:5]
        assert [t for t, _ in lp.top] == top.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref[i - 1, top], atol=2e-4)
        assert lp.rank == 1 + int((ref[i - 1] > ref[i - 1, prompt[i]] + 1e-6).sum())
    assert len(other.prompt_logprobs) == 3 and other.prompt_logprobs[0] is None
    # the step that sampled also scored the prompt: tokens are unchanged by asking
    [again] = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_a_request_id_reused_after_an_abort_gets_its_own_prompt_logprobs(llm, checkpoint):
    """Async scheduling: the aborted request's first chunk is still in flight when its id
    names a new request; that chunk's logprobs are not the new prompt's (they ran past its
    end and killed the engine loop)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    eng.add_request("reused", list(range(3, 60)), params)
    assert eng.step() == []  # its first chunk is dispatched, not yet collected
    eng.abort("reused")
    short = [5, 6, 7]
    eng.add_request("reused", short, params)
    got = None
    while eng.has_unfinished():
        for d in eng.step():
            got = d.prompt_logprobs if d.prompt_logprobs is not None else got
    ref = _log_softmax(hf_logits(checkpoint, short))
    assert got[0] is None and [lp.token_id for lp in got[1:]] == short[1:]
    np.testing.assert_allclose([lp.logprob for lp in got[1:]], [ref[0, 6], ref[1, 7]], atol=2e-4)


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)  # (-1: the vocabulary, vLLM's)
    # (the most a request may ask is the engine's --max-logprobs: test_logprobs_mode.py)


def test_prompt_logprobs_in_row_chunks_with_a_ragged_last_chunk(checkpoint):
    """A 200-token bucket is scored 128 rows at a time (runner.PROMPT_LOGPROB_ROWS), the
    last chunk padded: every position still equals transformers'."""
    import runner

    assert 200 % runner.PROMPT_LOGPROB_ROWS
    llm = LLM(checkpoint, log=lambda _: None, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=200,
              num_kv_blocks=40, warmup=False, enable_prefix_caching=False)
    prompt = np.random.default_rng(1).integers(3, 250, 190).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    ref = _log_softmax(hf_logits(checkpoint, prompt))
    got = np.array([lp.logprob for lp in out.prompt_logprobs[1:]])
    np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-4)
    assert [lp.top[0][0] for lp in out.prompt_logprobs[1:]] == ref[:-1].argmax(-1).tolist()


def test_a_prompt_tokens_rank_counts_the_tokens_tied_with_it_as_vllm():
    """vLLM's rank (gather_logprobs' batched_count_greater_than) is the number of tokens at
    least as likely as the prompt token, itself included: a token tied with others for the
    lead is not rank 1. The logits are the program's hidden rows (an identity LM head),
    with ties; the reference counts them in NumPy."""
    from compilation import prompt_logprobs

    logits = np.array([[1, 3, 3, 0, 3, 2], [5, 5, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [4, 1, 3, 0, 2, 5]], np.float32)
    targets = np.array([2, 0, 4, 2], np.int32)
    lp, rank, ids, top = (np.asarray(x) for x in prompt_logprobs(lambda h: h, logits, targets, 4, 2))
    want = [int((row >= row[t]).sum()) for row, t in zip(logits, targets)]
    assert want == [3, 2, 6, 3]
    np.testing.assert_array_equal(rank, want)
    np.testing.assert_allclose(lp, [_log_softmax(row)[t] for row, t in zip(logits, targets)], atol=1e-6)
