"""docs/ARCHITECTURE.md's recipe "Adding a speculative proposer", run from the page's own
text: the test executes the recipe's code block as written, then speculates with the new
method through LLM with no other edit. A recipe that needs an edit elsewhere fails here."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_recipes import recipe_code

from config import EngineConfig
from llm import LLM
from sampling_params import SamplingParams
from spec_decode import PROPOSERS

KW = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=65, warmup=False)
K, MAX_MATCH, MAX_TOKENS = 3, 3, 40


@pytest.fixture
def suffix_registered():
    code = recipe_code("Adding a speculative proposer")
    # as its own module would run it: without this file's `from __future__ import annotations`
    exec(compile(code, "docs/ARCHITECTURE.md: Adding a speculative proposer", "exec", dont_inherit=True), {})
    try:
        yield
    finally:
        PROPOSERS.pop("suffix")


def suffix_rule(out: list[int], k: int) -> list[int]:
    """The recipe's rule, written again from its description: over every (n, start) with an
    earlier occurrence of the output's last n tokens, the longest n, then the latest start."""
    hits = [(n, s) for n in range(1, MAX_MATCH + 1) for s in range(len(out) - n)
            if out[s:s + n] == out[len(out) - n:]]
    if not hits:
        return []
    n, s = max(hits)
    return out[s + n:s + n + k]


def expected_counters(outputs: list[list[int]]) -> tuple[int, int, int, list[int]]:
    """Drafts, draft tokens, accepted tokens and accepted per position of greedy speculation
    that emits `outputs`: after the prefill's token, each step proposes from the tokens
    emitted so far (at most k, and never past max_tokens), keeps the drafts that match the
    output, and emits one token more."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * K
    for out in outputs:
        m = 1
        while m < len(out):
            d = suffix_rule(out[:m], min(K, len(out) - m - 1))
            a = next((j for j, t in enumerate(d) if t != out[m + j]), len(d))
            if d:
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(d), accepted + a
                for j in range(a):
                    per_pos[j] += 1
            m += a + 1
    return drafts, draft_tokens, accepted, per_pos


def test_adding_a_speculative_proposer_is_one_class_and_one_registration(suffix_registered):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 9, 14, 7)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM("tiny", log=lambda *_: None, **KW).generate(prompts, params)]
    spec = LLM("tiny", log=lambda *_: None, speculative_config={"method": "suffix", "num_speculative_tokens": K},
               **KW)
    assert type(spec.engine.proposer).__name__ == "SuffixProposer"
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == plain  # speculation never changes greedy tokens
    s = spec.stats
    counters = (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens,
                s.spec_decode_num_accepted_tokens_per_pos)
    assert counters == expected_counters(plain)
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens  # both outcomes happen


def test_a_method_or_key_nobody_registered_is_refused_by_name(suffix_registered):
    with pytest.raises(ValueError, match=re.escape(
            "speculative_config.method must be one of draft_model, ngram, suffix, got 'eagle'")):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.suffix_max_match is for method suffix, not ngram"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "suffix_max_match": 2})
    with pytest.raises(ValueError, match="speculative_config.prompt_lookup_min is for method ngram, not suffix"):
        EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    with pytest.raises(ValueError, match="speculative_config.suffix_max_match must be an integer >= 1"):
        EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 2, "suffix_max_match": 0})
    with pytest.raises(ValueError, match="speculative_config.model is not taken by method suffix"):
        EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 2, "model": "d.gguf"})
    spec = EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 2,
                                            "suffix_max_match": 2}).speculative_config
    assert spec.options.suffix_max_match == 2
