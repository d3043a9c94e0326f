"""Beam search (beam_search.py, LLM.beam_search) against a search written here over
transformers' logits of the same checkpoint: vLLM's algorithm (each step the 2 x width most
likely tokens of every beam, an EOS among them set aside as ended, the best width of the
rest go on; the ended and live sequences ranked by cum_logprob / length ** length_penalty),
computed in float64 NumPy from the reference model, not from the engine's logprobs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_greedy, hf_logits

from beam_search import BeamSearchParams
from engine import LLM

SMALL = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=128, block_size=4, warmup=False)
PROMPTS = [[5, 17, 42, 99, 7, 23], [200, 3, 3, 150]]


def reference(path: str, prompt: list[int], width: int, steps: int, eos: set[int], *, length_penalty: float = 1.0,
              include_stop: bool = False, ignore_eos: bool = False) -> tuple[list[tuple[list[int], float, str]], int]:
    """(the best `width` of (tokens, cum_logprob, finish_reason), best first; how many ended on EOS)."""
    beams, ended = [(list(prompt), 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            logits = hf_logits(path, tokens)[-1].astype(np.float64)
            logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            for t in np.argsort(-logprobs, kind="stable")[:2 * width].tolist():
                if t in eos and not ignore_eos:
                    ended.append((tokens + [t] if include_stop else tokens, cum + logprobs[t], "stop"))
                else:
                    candidates.append((tokens + [t], cum + logprobs[t]))
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
        if not beams:
            break
    pool = ended + [(t, c, "length") for t, c in beams]

    def score(s: tuple[list[int], float, str]) -> float:
        return s[1] / (len(s[0]) - (s[0][-1] in eos)) ** length_penalty
    return sorted(pool, key=lambda s: -score(s))[:width], len(ended)


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> tuple[str, str, int]:
    """(a checkpoint, the same weights with the second token of PROMPTS[0]'s greedy answer as
    its EOS (so that searches meet it), that token)."""
    plain = hf_checkpoint("llama2")
    eos = hf_greedy(plain, PROMPTS[0], 2)[1]
    return plain, hf_checkpoint("llama2", eos_token_id=eos), eos


def check(outputs, path: str, width: int, steps: int, eos: set[int], **kw) -> int:
    total_ended = 0
    for prompt, out in zip(PROMPTS, outputs):
        want, num_ended = reference(path, prompt, width, steps, eos, **kw)
        total_ended += num_ended
        got = out.sequences
        assert [s.tokens for s in got] == [t for t, _, _ in want]
        assert [s.finish_reason for s in got] == [f for _, _, f in want]
        np.testing.assert_allclose([s.cum_logprob for s in got], [c for _, c, _ in want], rtol=1e-4, atol=1e-4)
        for s in got:  # a logprob per step (an EOS left out of the tokens included): the sum is cum_logprob
            dropped_eos = s.finish_reason == "stop" and not kw.get("include_stop", False)
            assert len(s.logprobs) == len(s.tokens) - len(prompt) + dropped_eos
            assert abs(sum(t.logprob for t in s.logprobs) - s.cum_logprob) < 1e-4
    return total_ended


@pytest.mark.parametrize("kw", [dict(), dict(length_penalty=0.3, include_stop=True), dict(length_penalty=2.0),
                                dict(ignore_eos=True)])
def test_beam_search_matches_a_reference_search_over_transformers_logits(checkpoints, kw):
    _, path, eos = checkpoints
    width, steps = 3, 5
    llm = LLM(path, log=lambda *_: None, **SMALL)
    params = BeamSearchParams(width, steps, length_penalty=kw.get("length_penalty", 1.0),
                              include_stop_str_in_output=kw.get("include_stop", False),
                              ignore_eos=kw.get("ignore_eos", False))
    outputs = llm.beam_search(PROMPTS, params)
    assert len(outputs) == len(PROMPTS) and all(len(o.sequences) == width for o in outputs)
    num_ended = check(outputs, path, width, steps, {eos}, **kw)
    assert (num_ended == 0) == kw.get("ignore_eos", False)  # the EOS path is exercised
    # every step's beams of both prompts ran as one batch, the beams' shared prefixes from the cache
    assert llm.stats.prefix_cache_hits > 0


def test_width_one_ignoring_eos_is_greedy_decoding(checkpoints):
    path, _, _ = checkpoints
    llm = LLM(path, log=lambda *_: None, **SMALL)
    out = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, BeamSearchParams(1, 8, ignore_eos=True))
    assert out[0].sequences[0].tokens == PROMPTS[0] + hf_greedy(path, PROMPTS[0], 8)


def test_text_is_the_whole_sequence_decoded():
    llm = LLM("tiny", log=lambda *_: None, **SMALL)
    out = llm.beam_search(["hello", "ab"], BeamSearchParams(2, 4))
    for o in out:
        assert len(o.sequences) == 2
        for s in o.sequences:
            assert s.text == llm.tokenizer.decode(s.tokens) and s.text.startswith(("hello", "ab"))


@pytest.mark.parametrize("kw, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=10**400), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be a boolean"),
])
def test_bad_params_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kw)


def test_a_search_the_engine_cannot_run_is_refused_before_any_step():
    llm = LLM("tiny", log=lambda *_: None, **SMALL)
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):  # the last step's beams would not fit
        llm.beam_search([[5, 6], list(range(3, 60))], BeamSearchParams(2, 10))
    with pytest.raises(ValueError, match="logprobs"):  # 2 x 11 candidates > max_logprobs 20 (vLLM's limit too)
        llm.beam_search([[5, 6]], BeamSearchParams(11, 2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[5, 6]], None)
    assert llm.stats.prompt_tokens == 0  # nothing ran
