"""Speculative decoding on the real model, smollm2 (its own file so that it alone compiles
at full optimisation: tests/conftest.py's REAL_MODEL_FILES): asked to repeat and to edit a
passage, its greedy tokens with ngram speculation and with a layer-skip draft of itself
are the tokens without speculation, under preemption, chunked prefill, prefix caching and
async scheduling."""

from __future__ import annotations

import pytest

from llm import LLM
from sampling_params import SamplingParams

PASSAGE = ("The river rises in the northern hills, runs south past the old mill and the stone bridge, "
           "and reaches the sea at the harbour town, where the fishing boats wait for the tide.")


# A KV budget that preempts (3 seats x 7 blocks of 16 for 48 tokens each, 13 in the cache),
# chunked prefill, prefix caching (the chat template's shared prefix), async scheduling.
# A step budget of 16 tokens is the one token bucket: every prefill or mixed step of an
# engine (and every catch-up pass of the draft) is one program, each compiled per engine with
# its verifier (cold, the file is mostly compiling); a 71-82-token prompt takes several chunks.
SMOLLM2 = dict(max_num_seqs=3, max_model_len=192, num_kv_blocks=14, max_num_batched_tokens=16, warmup=False,
               async_scheduling=True, log=lambda *_: None)
SMOLLM2_PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_reference() -> tuple[list[list[int]], list[list[int]]]:
    """The real model asked to repeat and to edit a passage (where prompt lookup pays):
    (prompts, greedy tokens with speculation off)."""
    base = LLM("smollm2", **SMOLLM2)
    tok = base.tokenizer
    asks = [f"Repeat this text exactly: {PASSAGE}", f"Rewrite this text with 'river' replaced by 'canal': {PASSAGE}",
            f"Copy this sentence: {PASSAGE}"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for a in asks]
    return prompts, [o.outputs[0].token_ids for o in base.generate(prompts, SMOLLM2_PARAMS)]


def test_smollm2_greedy_output_is_the_same_with_ngram_speculation(smollm2_reference):
    prompts, want = smollm2_reference
    spec = LLM("smollm2", speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_max": 3, "prompt_lookup_min": 2}, **SMOLLM2)
    got = spec.generate(prompts, SMOLLM2_PARAMS)
    assert [g.outputs[0].token_ids for g in got] == want
    s = spec.stats.snapshot()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert s.spec_decode_num_accepted_tokens > 0.3 * s.spec_decode_num_draft_tokens  # repeating pays


def test_smollm2_greedy_output_is_the_same_with_a_draft_model(smollm2_reference, smollm2_layer_skip):
    """A layer-skip draft of smollm2 itself (its first and last layers, untrained: it
    agrees with the target about once in a hundred tokens, so nearly every draft is
    rejected; tests/test_draft_model.py covers accepted runs): the tokens are
    speculation-off's, with the draft's cache following preemptions (free, then a full
    catch-up) and prefix-cache admissions."""
    prompts, want = smollm2_reference
    spec = LLM("smollm2", speculative_config={"method": "draft_model", "model": smollm2_layer_skip,
                                              "num_speculative_tokens": 2}, **SMOLLM2)
    got = spec.generate(prompts, SMOLLM2_PARAMS)
    assert [g.outputs[0].token_ids for g in got] == want
    s = spec.stats.snapshot()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.spec_decode_num_drafts > 0
    assert spec.engine.scheduler.allocator.num_used == 0
