"""Speculative decoding: the config, the ngram proposer, the exactness of verification,
and the engine's output with speculation equal to its output without.

The rejection sampler is checked at the function level against the exact filtered
distributions of tests/test_sampling.py: with synthetic target logits per position and a
draft distribution q deliberately far from the target's p, every emitted token at run
position j (among the runs that reach j) must follow p_j, whatever was accepted before.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Iterator

import jax
import numpy as np
import pytest

from config import EngineConfig
from sampler import SamplingTensors, empty_sampling_arrays, rejection_sample
from spec_decode import SpeculativeConfig, ngram_lookup
from test_sampling import LOGITS, chi_square, draw, exact


# ---- config -----------------------------------------------------------------------------

def test_speculative_config_follows_vllm_and_names_bad_keys():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.options.prompt_lookup_min, c.options.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.parse({"model": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.model, c.options.prompt_lookup_min, c.options.prompt_lookup_max) == ("ngram", None, 4, 4)
    assert SpeculativeConfig.parse({"model": "draft.gguf", "num_speculative_tokens": 2}).method == "draft_model"
    c = SpeculativeConfig.parse({"model": "draft.gguf", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    assert c.draft_tensor_parallel_size == 1  # vLLM's key, where it asks what runs here
    for alias in ({"model": "[ngram]"}, {"method": "[ngram]"}, {"method": "[ngram]", "model": "[ngram]"}):
        c = SpeculativeConfig.parse({**alias, "num_speculative_tokens": 2})  # vLLM's other spelling of ngram
        assert (c.method, c.model) == ("ngram", None), alias
    bad = {'{"method": "ngram"}': "num_speculative_tokens",
           '{"method": "eagle", "num_speculative_tokens": 2}': "method",
           '{"method": [], "num_speculative_tokens": 2}': "method must be one of",  # not a TypeError (unhashable)
           '{"method": {}, "model": "d.gguf", "num_speculative_tokens": 2}': "method must be one of",
           '{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}': "bogus",
           # options is how a built config holds ngram's keys, not a JSON key: no way around their checks
           '{"method": "ngram", "num_speculative_tokens": 2, "options": {"prompt_lookup_min": 0}}':
               "unsupported key.*'options'",
           '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}':
               "prompt_lookup_min",
           '{"method": "ngram", "num_speculative_tokens": true}': "num_speculative_tokens",
           '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}': "disable_by_batch_size",
           '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}': "disable_by_batch_size",
           '{"model": "d.gguf", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}':
               "draft_tensor_parallel_size",
           '{"model": "d.gguf", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0}':
               "draft_tensor_parallel_size",
           '{"method": "draft_model", "num_speculative_tokens": 2}': "model",
           '{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5}': "min_acceptance_rate",
           '[1, 2]': "JSON object", '{"method": ': "not valid JSON"}
    for text, word in bad.items():
        with pytest.raises(ValueError, match=word):
            EngineConfig(speculative_config=text)


def test_a_built_configs_options_survive_replace_and_a_bad_options_value_is_a_value_error():
    """options is the method's dataclass once built: dataclasses.replace (which runs
    __post_init__ again) and a SpeculativeConfig made with that dataclass keep it; a value
    of another type is a ValueError naming options, not a TypeError."""
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    r = dataclasses.replace(c, num_speculative_tokens=2)
    assert (r.k, r.options.prompt_lookup_min, r.options.prompt_lookup_max) == (2, 2, 2)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2, options=c.options).options == c.options
    for options in ([["prompt_lookup_min"]], "abc", 3, c.options):
        method = {"method": "draft_model", "model": "d.gguf"} if options is c.options else {"method": "ngram"}
        with pytest.raises(ValueError, match="speculative_config.options"):
            SpeculativeConfig(**method, num_speculative_tokens=2, options=options)


def test_an_ngram_config_is_checked_without_jax_and_a_draft_models_module_loads_when_named():
    """The registry knows draft_model by name and module: an ngram config, in any of vLLM's
    spellings, is checked without importing it (and JAX); a config naming a draft model
    imports the module, whose import registers the class."""
    code = """import sys
from config import EngineConfig
from spec_decode import PROPOSERS
jax = lambda: [m for m in sys.modules if m.split('.')[0] == 'jax']
for spec in ({"method": "ngram"}, {"model": "[ngram]"}, {"method": "[ngram]", "model": "ngram"}):
    assert EngineConfig(speculative_config={**spec, "num_speculative_tokens": 2}).speculative_config.method == "ngram"
try:  # refused for ngram's own reason, not by importing every proposer to ask who takes a model
    EngineConfig(speculative_config={"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 2})
except ValueError as e:
    assert "model is not taken by method ngram" in str(e), e
assert PROPOSERS.names() == ["draft_model", "ngram"] and not jax(), jax()
assert EngineConfig(speculative_config={"model": "d.gguf", "num_speculative_tokens": 2}).speculative_config.method \
    == "draft_model"
assert PROPOSERS["draft_model"].__name__ == "DraftModelProposer" and "draft_model" in sys.modules and jax()
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root}, check=True)


# ---- ngram ------------------------------------------------------------------------------

def test_ngram_lookup_is_vllms_prompt_lookup():
    a = lambda *x: np.array(x)  # noqa: E731
    assert ngram_lookup(a(1, 2, 3, 4, 2, 3), 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert ngram_lookup(a(1, 2, 3, 4, 1, 2, 3, 5, 6), 2, 2, 2) == []  # [5, 6] never occurred before
    assert ngram_lookup(a(1, 2, 3, 4, 1, 2, 3), 2, 2, 2) == [4, 1]  # the earliest occurrence
    # the longest match wins over an earlier shorter one: [9, 2, 3] matches at 4, [2, 3] at 0
    assert ngram_lookup(a(2, 3, 7, 9, 9, 2, 3, 8, 9, 2, 3), 1, 3, 2) == [8, 9]
    assert ngram_lookup(a(5, 5, 5), 1, 1, 3) == [5, 5]  # overlapping the suffix is allowed
    assert ngram_lookup(a(1, 2, 1, 2), 3, 4, 2) == []  # shorter than prompt_lookup_min
    assert ngram_lookup(a(1, 2, 1, 2), 1, 4, 0) == []


def brute_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_ngram_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        toks = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert ngram_lookup(np.array(toks), lo, hi, 3) == brute_ngram(toks, lo, hi, 3), (toks, lo, hi)


# ---- verification: exact ---------------------------------------------------------------

K = 3
V = len(LOGITS)
_verify = jax.jit(rejection_sample)


def position_logits() -> np.ndarray:
    """[K+1, V]: a different target distribution at each run position."""
    return np.stack([np.roll(LOGITS, 5 * j) for j in range(K + 1)])


def verify(n: int, draft: np.ndarray, draft_probs: np.ndarray | None, **params) -> tuple[np.ndarray, np.ndarray]:
    arrays = empty_sampling_arrays(n)
    for name, value in params.items():
        arrays[name][:] = value
    arrays["seed"][:] = np.arange(n, dtype=np.uint32)
    t = SamplingTensors(**arrays, want_logprobs=np.bool_(False))
    logits = np.broadcast_to(position_logits(), (n, K + 1, V)).copy()
    tokens, num = _verify(logits, draft.astype(np.int32), np.full(n, K, np.int32), t, draft_probs)
    return np.asarray(tokens), np.asarray(num)


def check_positions(tokens: np.ndarray, num: np.ndarray, params: dict) -> None:
    assert ((num >= 1) & (num <= K + 1)).all()
    for j in range(K + 1):
        p = exact(position_logits()[j], **params)
        reached = num > j
        assert reached.sum() >= 1000, f"position {j}: only {reached.sum()} runs reach it"
        counts = np.bincount(tokens[reached, j], minlength=V)
        assert counts[p == 0].sum() == 0, f"position {j}: a token outside the filtered set was emitted"
        stat, limit = chi_square(counts, p)
        assert stat < limit, f"position {j}: chi-square {stat:.1f} over {limit:.1f} ({reached.sum()} runs)"


FILTERS = [dict(temperature=1.0), dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02)]


@pytest.mark.parametrize("params", FILTERS)
def test_a_draft_far_from_the_target_still_emits_the_target_distribution(params):
    """Half of q's mass is the reversed target (the target's unlikely tokens made
    likely): a total variation of about half from p. Drafts are drawn from q, as a draft
    model draws them."""
    n, rng = 40_000, np.random.default_rng(1)
    q = np.stack([0.5 * exact(-position_logits()[j], temperature=1.0) + 0.5 * exact(position_logits()[j], **params)
                  for j in range(K)])  # [K, V]
    draft = np.stack([rng.choice(V, size=n, p=q[j]) for j in range(K)], axis=1)
    tokens, num = verify(n, draft, np.broadcast_to(q, (n, K, V)).astype(np.float32).copy(), **params)
    check_positions(tokens, num, params)
    assert 0.2 < (num == 1).mean() < 0.8  # the draft is far: many runs are rejected at once


@pytest.mark.parametrize("params", FILTERS)
def test_deterministic_proposals_emit_the_target_distribution(params):
    """ngram's q is one-hot at its proposal, whatever the proposal is: here the target's
    most likely token 90% of the time, an arbitrary one otherwise."""
    n, rng = 200_000, np.random.default_rng(2)
    best = position_logits()[:K].argmax(axis=1)
    draft = np.where(rng.random((n, K)) < 0.9, best[None, :], rng.integers(0, V, (n, K)))
    tokens, num = verify(n, draft, None, **params)
    check_positions(tokens, num, params)
    assert (num == K + 1).mean() > 0.01  # some runs are accepted whole (and sample the bonus)


@pytest.mark.parametrize("params", [*FILTERS, dict(temperature=0.0)])
def test_deterministic_proposals_emit_the_very_tokens_plain_sampling_draws(params):
    """Under one-hot proposals a run emits, position by position, what sample() draws for
    the same seed at that output index (step + j): the leading drafts equal to those draws,
    then the first draw that differs (or the bonus). Drafts are the plain draws with one
    position changed, or none."""
    n, step, rng = 2_000, 7, np.random.default_rng(3)
    plain = np.stack([draw(position_logits()[j], n, step=step + j, **params) for j in range(K + 1)], axis=1)
    draft = plain[:, :K].copy()
    change = rng.integers(0, K + 1, n)  # K: every draft is the plain draw
    rows = np.flatnonzero(change < K)
    draft[rows, change[rows]] = (draft[rows, change[rows]] + rng.integers(1, V, len(rows))) % V
    tokens, num = verify(n, draft, None, step=step, **params)
    assert num.tolist() == (change + 1).tolist()
    for r in range(n):
        assert tokens[r, :num[r]].tolist() == plain[r, :num[r]].tolist(), r


@pytest.mark.parametrize("params", FILTERS)
def test_a_draft_models_bonus_is_the_plain_draw_of_its_index(params):
    """q = p accepts every draft; the bonus after them is what sample() draws for the same
    seed at that output index (its noise is keyed by the index, not by the run)."""
    n, step = 2_000, 7
    q = np.stack([exact(position_logits()[j], **params) for j in range(K)]).astype(np.float32)
    draft = np.broadcast_to(position_logits()[:K].argmax(axis=1), (n, K))  # kept by every filter
    tokens, num = verify(n, draft, np.broadcast_to(q, (n, K, V)).copy(), step=step, **params)
    assert (num == K + 1).all()
    assert tokens[:, K].tolist() == draw(position_logits()[K], n, step=step + K, **params).tolist()


def test_greedy_accepts_while_the_draft_is_the_argmax():
    best = position_logits().argmax(axis=1)  # [K+1]
    draft = np.array([best[:K], [best[0], best[1], (best[2] + 1) % V], [(best[0] + 1) % V, best[1], best[2]]])
    tokens, num = verify(3, draft, None, temperature=0.0)
    assert num.tolist() == [K + 1, 3, 1]
    for row in range(3):
        assert tokens[row, :num[row]].tolist() == best[:num[row]].tolist()


# ---- the scheduler: speculative allocation and rejection ---------------------------------

from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

from kvcache import blocks_needed, hash_block_tokens  # noqa: E402
from sampling_params import SamplingParams  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from sequence import Sequence  # noqa: E402

EOS = 0


def token(data: st.DataObject) -> int:
    """A sampled token: EOS one time in eight."""
    return EOS if data.draw(st.integers(0, 7)) == 0 else 7


class SpeculativeAllocatorMachine(RuleBasedStateMachine):
    """Random traffic under a tight KV budget with random proposals and random
    acceptance: no block or slot leaks, every computed token has its block, a sequence
    holds no block past what it needs, a named block holds only accepted tokens (its name
    is the hash of the sequence's own tokens), and everything finishes."""

    @initialize(chunked=st.booleans(), max_num_seqs=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4]),
                max_model_len=st.integers(8, 24), spare_blocks=st.integers(0, 6), caching=st.booleans(),
                k=st.integers(1, 4), budget_extra=st.integers(0, 6), ngram=st.booleans())
    def setup(self, chunked, max_num_seqs, block_size, max_model_len, spare_blocks, caching, k, budget_extra, ngram):
        # ngram reserves what its lookup proposes; a draft model (never loaded here) all k
        spec = ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2} if ngram
                else {"method": "draft_model", "model": "draft"})
        num_blocks = blocks_needed(max_model_len, block_size) + 1 + spare_blocks
        cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                           enable_chunked_prefill=chunked,
                           max_num_batched_tokens=max_num_seqs + budget_extra if chunked else max_model_len,
                           enable_prefix_caching=caching,
                           speculative_config={**spec, "num_speculative_tokens": k})
        self.s = Scheduler(cfg.resolved(max_model_len), num_blocks, (EOS,))
        self.seqs: list[Sequence] = []
        self.ngram, self.k = ngram, k

    @rule(prompt_len=st.integers(1, 23), max_tokens=st.integers(1, 23), shared=st.booleans())
    def add(self, prompt_len, max_tokens, shared):
        mml = self.s.config.max_model_len
        prompt_len = min(prompt_len, mml - 1)
        max_tokens = min(max_tokens, mml - prompt_len)
        n = len(self.seqs)
        prompt = [5 + j % 3 for j in range(prompt_len)] if shared else [1000 * (n + 1) + j for j in range(prompt_len)]
        self.seqs.append(Sequence(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens)))
        self.s.add(self.seqs[-1])

    @rule(data=st.data())
    def step(self, data):
        out = self.s.schedule()
        assert sum(x.num_new_tokens for x in out.scheduled) <= self.s.config.max_num_batched_tokens
        rows = [x for x in out.scheduled if x.num_spec_tokens]
        if self.ngram:  # the scheduler took the lookup's drafts: those of a brute-force search
            for x in rows:
                want = brute_ngram(x.seq.all_token_ids, 1, 2, self.k)
                assert list(x.spec_token_ids) == want[:len(x.spec_token_ids)], x.seq.request_id
        else:
            # mostly as many drafts as reserved, sometimes fewer (none: a plain decode) or more (cut)
            proposals = [data.draw(st.lists(st.integers(3, 9),
                                            min_size=data.draw(st.integers(0, x.num_spec_tokens + 1)),
                                            max_size=x.num_spec_tokens + 1)) for x in rows]
            self.s.take_proposals(out, proposals)
        for x in out.scheduled:  # blocks cover what the step computes, drafts included
            assert len(x.seq.block_table) * self.s.config.block_size >= x.seq.num_computed_tokens
        spec = {}
        for i, x in enumerate(out.scheduled):
            if x.spec_token_ids:
                a = data.draw(st.integers(0, len(x.spec_token_ids)))
                spec[i] = list(x.spec_token_ids[:a]) + [token(data)]
        self.s.update(out, [token(data) for _ in out.scheduled], spec)

    @rule(index=st.integers(0, 30))
    def abort(self, index):
        if index < len(self.seqs):
            self.s.abort(self.seqs[index].request_id)

    @invariant()
    def nothing_leaks_and_names_are_of_accepted_tokens(self):
        if not hasattr(self, "s"):
            return
        s = self.s
        s.check_invariants()
        bs = s.config.block_size
        for seq in s.running:
            if seq.finished:
                continue
            # no block past its computed tokens': rejected drafts gave theirs back
            assert len(seq.block_table) <= blocks_needed(seq.num_computed_tokens, bs), seq.request_id
            tokens, h = seq.all_token_ids, None
            for i in range(s.allocator.num_named(seq.request_id)):
                h = hash_block_tokens(h, tokens[i * bs:(i + 1) * bs])
                name = s.allocator._block_hash[seq.block_table[i]]
                assert name is None or name == h, f"{seq.request_id}: block {i} named for tokens it does not hold"

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(3000):
            if not self.s.has_unfinished():
                break
            out = self.s.schedule()
            if not self.ngram:
                self.s.take_proposals(out, [[] for x in out.scheduled if x.num_spec_tokens])
            self.s.update(out, [7] * len(out.scheduled), {i: [7] for i, x in enumerate(out.scheduled)
                                                         if x.spec_token_ids})
        assert not self.s.has_unfinished(), "a request starved"
        assert self.s.allocator.num_used == 0
        assert all(q.finish_reason is not None for q in self.seqs)


SpeculativeAllocatorMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
test_speculative_allocation_state_machine = SpeculativeAllocatorMachine.TestCase


# ---- the engine: the same greedy tokens, fewer steps -------------------------------------

from conftest import count_compilations, fresh_step_programs, pinned_decode_buckets  # noqa: E402

from llm import LLM  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Tight: 4 running sequences of up to 96 tokens need 96 blocks of 4; the cache has 47.
TIGHT = dict(max_num_seqs=4, max_model_len=128, block_size=4, num_kv_blocks=48, max_num_batched_tokens=32,
             enable_chunked_prefill=True, enable_prefix_caching=True, async_scheduling=True, log=lambda *_: None)


def grounded_prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    """Input-grounded prompts: a shared prefix (prefix-cache hits) and a passage repeated
    (prompt lookup pays), of several lengths."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, 8).tolist()
    return [shared + rng.integers(3, 250, int(rng.integers(6, 14))).tolist() * 3 for _ in range(n)]


@pytest.fixture(scope="module")
def one_decode_bucket() -> Iterator[None]:
    """Engines built while it is up (this module's) pad every decode step, and every step
    that verifies drafts alone, to max_num_seqs rows: one decode and one verify program
    where the row buckets (1, 2, 4) made three of each (a verify program is a ragged one,
    about a CPU-second to compile). The tokens, counters and draft budgets these tests
    check are the same at any padding; test_draft_model's and test_spec_decode_smollm2's
    speculative engines keep every bucket."""
    with pinned_decode_buckets(lambda cfg: (cfg.max_num_seqs,)):
        yield


@pytest.fixture(scope="module")
def tiny_pair(one_decode_bucket) -> tuple[LLM, LLM]:
    fresh_step_programs()  # nothing compiles after these engines' own warm-ups
    return LLM("tiny", **TIGHT), LLM("tiny", speculative_config=NGRAM, **TIGHT)


def test_greedy_tokens_and_logprobs_are_the_same_with_ngram_speculation(tiny_pair):
    """Under preemption (tight KV), chunked prefill, prefix caching and async scheduling;
    max_tokens of every length, logprobs on half of the requests; nothing compiles after
    warm-up."""
    base, spec = tiny_pair
    prompts = grounded_prompts()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i, m in enumerate([40, 7, 33, 1, 50, 21])]
    # (the module's engines: the other tests' counts are taken away)
    b0, s0 = base.stats.snapshot(), spec.stats.snapshot()
    want = base.generate(prompts, params)
    with count_compilations() as compiled:
        got = spec.generate(prompts, params)
    assert compiled == []
    for w, g in zip([o.outputs[0] for o in want], [o.outputs[0] for o in got]):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert [x.token_id for x in g.logprobs] == w.token_ids
            np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in w.logprobs], atol=2e-4)
            assert [[i for i, _ in x.top] for x in g.logprobs] == [[i for i, _ in x.top] for x in w.logprobs]
    s, b = spec.stats.snapshot(), base.stats.snapshot()
    d = {k: getattr(s, k) - getattr(s0, k) for k in ("num_preemptions", "prefix_cache_hits", "num_steps",
                                                      "generation_tokens", "spec_decode_num_accepted_tokens",
                                                      "spec_decode_num_draft_tokens")}
    assert d["num_preemptions"] > 0 and d["prefix_cache_hits"] > 0  # the budget was tight, the prefix shared
    assert d["spec_decode_num_accepted_tokens"] > 0 and d["num_steps"] < b.num_steps - b0.num_steps
    per_pos = [x - y for x, y in zip(s.spec_decode_num_accepted_tokens_per_pos,
                                     s0.spec_decode_num_accepted_tokens_per_pos + [0] * 64)]
    assert sum(per_pos) == d["spec_decode_num_accepted_tokens"] <= d["spec_decode_num_draft_tokens"]
    assert d["generation_tokens"] == b.generation_tokens - b0.generation_tokens == sum(
        len(w.outputs[0].token_ids) for w in want)
    assert all(g.metrics.spec_acceptance_rate is None or 0 <= g.metrics.spec_acceptance_rate <= 1 for g in got)
    assert spec.engine.scheduler.allocator.num_used == 0


def test_a_stop_token_inside_an_accepted_run_ends_the_sequence_there(tiny_pair):
    base, spec = tiny_pair
    prompt = grounded_prompts(1, seed=7)[0]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = base.generate([prompt], greedy)[0].outputs[0].token_ids
    stop = free[20]  # a token of the repeating part: proposed and accepted inside runs
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want, got = base.generate([prompt], params)[0].outputs[0], spec.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == want.token_ids == free[:free.index(stop) + 1] and got.finish_reason == "stop"


def test_spec_decode_counters_are_exact_for_a_request_alone(tiny_pair):
    """vLLM's counters on a scripted case: one greedy request alone (no preemption, room
    for every draft), its steps replayed from its greedy output with the brute-force
    prompt lookup: each decode step proposes up to k (at most what max_tokens leaves),
    accepts the drafts that match the greedy continuation, and emits one more."""
    base, spec = tiny_pair
    k, lo, hi = NGRAM["num_speculative_tokens"], NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]
    total = 0
    for prompt, max_tokens in zip(grounded_prompts(), [40, 7, 33, 1, 50, 21]):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        greedy = base.generate([prompt], params)[0].outputs[0].token_ids
        drafts = draft_tokens = accepted = 0
        per_pos = [0] * k
        out = greedy[:1]  # the prompt's step emits the first token
        while len(out) < max_tokens:
            d = brute_ngram(prompt + out, lo, hi, min(k, max_tokens - len(out) - 1))
            a = next((j for j, t in enumerate(d) if t != greedy[len(out) + j]), len(d))
            if d:
                drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(d), accepted + a
                per_pos = [n + (j < a) for j, n in enumerate(per_pos)]
            out = greedy[:len(out) + a + 1]
        before = spec.stats.snapshot()
        got = spec.generate([prompt], params)[0]
        after = spec.stats.snapshot()
        assert got.outputs[0].token_ids == greedy
        total += accepted
        assert (after.spec_decode_num_drafts - before.spec_decode_num_drafts,
                after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                [x - y for x, y in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                       before.spec_decode_num_accepted_tokens_per_pos)]) == \
            (drafts, draft_tokens, accepted, per_pos)
        assert got.metrics.spec_acceptance_rate == (pytest.approx(accepted / draft_tokens) if draft_tokens else None)
    assert total > 0  # the scripted case exercises acceptance


def test_seeded_sampling_with_speculation_is_reproducible(tiny_pair):
    _, spec = tiny_pair
    prompts = grounded_prompts(3, seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=5, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts[::-1], params)][::-1]  # other rows, other batch order
    assert a == b and all(len(t) == 24 for t in a)


# Four seats and a budget of four tokens: beside three decoding neighbours a decode has no
# budget left for drafts; alone it has three.
STARVED = dict(max_num_seqs=4, max_model_len=128, block_size=4, max_num_batched_tokens=4,
               enable_chunked_prefill=True, async_scheduling=True, log=lambda *_: None)


@pytest.fixture(scope="module")
def starved(one_decode_bucket) -> LLM:
    return LLM("tiny", speculative_config=NGRAM, record_trace=True, **STARVED)


def drafts_of(trace: list, request_id: str) -> int:
    """The draft tokens verified for a request (never preempted): each step that samples it
    after its first token computes its latest token and its drafts."""
    steps = [n for st in trace for r, n in st.scheduled if r == request_id and r in st.sampled]
    return sum(n - 1 for n in steps[1:])


# The tiny random model is nearly uniform at temperature 1: its draws never repeat, so ngram's
# drafts are proposed and all rejected (each run emits the first mismatching draw). A low
# temperature, or top_k, sharpens it into the loops prompt lookup predicts, so drafts are
# accepted too; temperature only scales the logits the same draw reads.
SEEDED = [dict(temperature=1.0), dict(temperature=0.1), dict(temperature=1.0, top_k=2, top_p=0.95)]


@pytest.mark.parametrize("params", SEEDED)
def test_a_seeded_request_draws_the_same_tokens_with_and_without_ngram_speculation(tiny_pair, starved, params):
    """Alone (three drafts a step where ngram proposes) and beside three greedy decodes that
    leave it no budget for drafts, a seeded random request emits the tokens it emits
    without speculation."""
    base, _ = tiny_pair
    params = SamplingParams(max_tokens=40, seed=5, ignore_eos=True, **params)
    prompt = grounded_prompts(1, seed=11)[0]
    want = base.generate([prompt], params)[0].outputs[0].token_ids
    trace, before = starved.engine.trace, starved.stats.snapshot()
    trace.clear()
    alone = starved.generate([prompt], params)[0]
    mid = starved.stats.snapshot()
    drafted, accepted = (mid.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                         mid.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    assert alone.outputs[0].token_ids == want
    assert drafted == drafts_of(trace, alone.request_id) > 0
    assert accepted > 0 or params.temperature == 1.0 and params.top_k < 0  # see SEEDED
    trace.clear()
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    beside = starved.generate([prompt, [7, 8, 9], [10, 11, 12], [13, 14, 15]], [params, greedy, greedy, greedy])[0]
    assert beside.outputs[0].token_ids == want
    assert drafts_of(trace, beside.request_id) < drafted
    assert starved.stats.num_preemptions == 0  # drafts_of counts a sequence never recomputed


# ---- knowing when not to ----------------------------------------------------------------

def scheduler(spec: dict, max_num_seqs: int = 4, max_num_batched_tokens: int = 64) -> Scheduler:
    """A scheduler that reserves all k draft tokens: a draft model's (never loaded here)."""
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=4, max_model_len=64,
                       max_num_batched_tokens=max_num_batched_tokens,
                       speculative_config={"method": "draft_model", "model": "draft", "num_speculative_tokens": 2,
                                           **spec})
    return Scheduler(cfg.resolved(64), 64, (EOS,))


def run_step(s: Scheduler, accept: bool) -> list:
    out = s.schedule()
    rows = [x for x in out.scheduled if x.num_spec_tokens]
    s.take_proposals(out, [[9, 9] for _ in rows])
    spec = {i: ([9, 9, 7] if accept else [7]) for i, x in enumerate(out.scheduled) if x.spec_token_ids}
    s.update(out, [7] * len(out.scheduled), spec)
    return rows


def test_a_row_drafted_after_scheduling_counts_its_room_and_holds_no_tokens_until_take_proposals():
    """A proposer that drafts after scheduling (a draft model) gets room for k drafts a
    row: the row counts it (num_spec_tokens) and carries no draft tokens until
    take_proposals, which trims the count to the drafts proposed."""
    s = scheduler({})
    s.add(Sequence("a", [5, 6, 7], SamplingParams(max_tokens=10)))
    run_step(s, False)  # the prompt
    out = s.schedule()
    [x] = out.scheduled
    assert (x.num_new_tokens, x.num_spec_tokens, x.spec_token_ids, out.num_spec_tokens) == (3, 2, (), 2)
    s.take_proposals(out, [[9]])
    assert (x.num_new_tokens, x.num_spec_tokens, list(x.spec_token_ids), out.num_spec_tokens) == (2, 1, [9], 1)


def test_a_reserving_admission_keeps_its_blocks_when_drafts_are_cut_or_rejected():
    """--kv-admission reserve never preempts: a sequence holds prompt + max_tokens from
    admission. Drafts that are not proposed or not accepted give back only blocks taken
    past that; were the reservation given back, a request admitted into it would leave
    the first one no block to grow into (and nobody to preempt)."""
    cfg = EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64, max_num_batched_tokens=32,
                       kv_admission="reserve", speculative_config={
                           "method": "draft_model", "model": "draft", "num_speculative_tokens": 2}).resolved(64)
    s = Scheduler(cfg, 17, (EOS,))  # 16 usable blocks: room for one of the two at a time
    for rid in ("a", "b"):
        s.add(Sequence(rid, [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=30)))  # 35 tokens: 9 blocks
    for i in range(80):
        out = s.schedule()
        rows = [x for x in out.scheduled if x.num_spec_tokens]
        s.take_proposals(out, [[9] if i % 2 else [] for _ in rows])  # cut to one draft, or none
        s.update(out, [7] * len(out.scheduled), {j: [7] for j, x in enumerate(out.scheduled) if x.spec_token_ids})
        assert all(len(q.block_table) == 9 for q in s.running)
        if not s.has_unfinished():
            break
    assert not s.has_unfinished() and s.allocator.num_used == 0


def test_drafts_do_not_take_the_budget_a_priority_preemption_made_room_for():
    """Priority scheduling: urgent outranks low and takes its seat. The step's budget of 8
    less the 3 other decodes leaves 5 for urgent's first chunk, which drafts of up to 3
    tokens per decode would take whole: low would be preempted for nothing, and urgent
    wait with its seat empty for as long as the others speculate."""
    cfg = EngineConfig(max_num_seqs=4, block_size=4, max_model_len=64, max_num_batched_tokens=8,
                       scheduling_policy="priority", speculative_config={
                           "method": "draft_model", "model": "draft", "num_speculative_tokens": 3}).resolved(64)
    s = Scheduler(cfg, 64, (EOS,))
    for rid, prio in (("a", 0), ("b", 0), ("c", 0), ("low", 5)):
        s.add(Sequence(rid, [5, 6], SamplingParams(max_tokens=30), priority=prio))
    run_step(s, False)
    run_step(s, False)
    s.add(Sequence("urgent", list(range(10, 30)), SamplingParams(max_tokens=4), priority=1))
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 1), ("urgent", 5)]


def test_draft_room_never_takes_the_block_a_running_prompts_chunk_needs():
    """Drafts are the last claim on KV blocks: a is decoding and b, seated, has 4 prompt
    tokens left, which need b's second block; one block is free. a's drafts (positions
    6..8) would need a new block too: they go without, and b's chunk gets the block rather
    than b being preempted (its K/V dropped) for tokens that may all be rejected."""
    cfg = EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64, max_num_batched_tokens=8,
                       enable_prefix_caching=False, speculative_config={
                           "method": "draft_model", "model": "draft", "num_speculative_tokens": 3}).resolved(64)
    s = Scheduler(cfg, 5, (EOS,))  # 4 usable blocks
    a = Sequence("a", [5, 6, 5, 6], SamplingParams(max_tokens=8))  # 11 tokens at most: 3 blocks
    b = Sequence("b", list(range(10, 18)), SamplingParams(max_tokens=1))  # 8 tokens: 2 blocks
    s.add(a)
    run_step(s, False)  # a's prompt
    s.add(b)
    out = s.schedule()  # a: 1 + 3 drafts (positions 4..7, its second block); b: its first chunk, 4 tokens
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 4), ("b", 4)]
    s.take_proposals(out, [[9, 9, 9]])
    s.update(out, [7, 7], {0: [7]})  # every draft rejected: a computed 5, in 2 blocks
    assert s.allocator.num_free == 1 and len(a.block_table) == 2 and len(b.block_table) == 1
    out = s.schedule()
    assert out.preempted == [] and out.num_spec_tokens == 0
    assert [(x.seq.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [("a", 1, True), ("b", 4, True)]


@pytest.mark.parametrize("threshold, drafts", [(0, 3), (3, 2), (1, 0)])
def test_long_prefill_token_threshold_caps_a_decode_and_its_drafts_as_vllm(threshold, drafts):
    """vLLM caps every running request's new tokens at the threshold, a decode's 1 + k
    included: a decode keeps its token and verifies at most threshold - 1 drafts."""
    cfg = EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64, max_num_batched_tokens=32,
                       long_prefill_token_threshold=threshold, speculative_config={
                           "method": "draft_model", "model": "draft", "num_speculative_tokens": 3}).resolved(64)
    s = Scheduler(cfg, 17, (EOS,))
    s.add(Sequence("a", [5, 6, 5, 6], SamplingParams(max_tokens=20)))
    while s.running == [] or s.running[0].num_computed_tokens < 4:
        run_step(s, False)  # the prompt, in chunks of at most the threshold
    out = s.schedule()
    assert [(x.num_new_tokens, x.num_spec_tokens) for x in out.scheduled] == [(1 + drafts, drafts)]
    assert out.num_spec_tokens == drafts


def test_an_abort_between_schedule_and_update_of_a_step_verifying_drafts():
    """A step that verifies drafts computes them past the latest token until update()
    keeps the accepted ones: an abort while it runs (async scheduling: a client leaving)
    finds the others' drafts computed, and the invariants hold."""
    s = scheduler({})
    for rid in "ab":
        s.add(Sequence(rid, [5, 6, 7], SamplingParams(max_tokens=10)))
    run_step(s, True)  # the prompts
    out = s.schedule()
    s.take_proposals(out, [[9, 9], [9, 9]])
    assert out.num_spec_tokens == 4
    s.abort("a")
    s.update(out, [7, 7], {0: [9, 7], 1: [9, 9, 7]})
    s.check_invariants()
    b = s.running[0]
    assert b.output_token_ids == [7, 9, 9, 7] and b.num_computed_tokens == 3 + 3


def test_no_speculation_at_or_above_disable_by_batch_size():
    s = scheduler({"disable_by_batch_size": 3})
    for i in range(3):
        s.add(Sequence(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=20)))
    run_step(s, True)  # the prompts
    assert run_step(s, True) == []  # 3 running: off
    s.abort("r0")
    assert len(run_step(s, True)) == 2  # 2 running: on


def test_a_sequence_whose_drafts_keep_failing_stops_speculating():
    s = scheduler({"min_acceptance_rate": 0.3, "acceptance_window": 4}, max_num_seqs=2)
    s.add(Sequence("bad", [5, 6, 7], SamplingParams(max_tokens=40)))
    s.add(Sequence("good", [5, 6, 8], SamplingParams(max_tokens=40)))
    run_step(s, True)
    for _ in range(4):
        out = s.schedule()
        rows = [x for x in out.scheduled if x.num_spec_tokens]
        s.take_proposals(out, [[9, 9] for _ in rows])
        s.update(out, [7] * len(out.scheduled),
                 {i: ([7] if x.seq.request_id == "bad" else [9, 9, 7]) for i, x in enumerate(out.scheduled)})
    bad, good = (next(q for q in s.running if q.request_id == r) for r in ("bad", "good"))
    assert (bad.num_drafts, bad.num_accepted_tokens) == (4, 0) and not bad.speculates
    assert good.speculates and [x.seq.request_id for x in run_step(s, True)] == ["good"]


def test_ngram_reserves_only_what_it_proposes_and_a_prompt_chunk_takes_the_rest():
    """The scheduler takes ngram's drafts when it reserves their room (the lookup reads
    host tokens): the budget and blocks a short proposal leaves go to a prompt chunk of
    the same step, and nothing is left for the engine to propose."""
    cfg = EngineConfig(max_num_seqs=3, block_size=4, max_model_len=64, max_num_batched_tokens=10,
                       enable_chunked_prefill=True, enable_prefix_caching=False, speculative_config={
                           "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 2}).resolved(64)
    s = Scheduler(cfg, 64, (EOS,))
    s.add(Sequence("two", list(range(10, 17)), SamplingParams(max_tokens=20)))
    s.add(Sequence("none", list(range(20, 26)), SamplingParams(max_tokens=20)))
    sampled = iter([15, 16, 7])  # two's, two's, none's: 10..16, 15, 16 repeats [15, 16]
    for _ in range(2):  # both prompts (13 tokens in steps of 10), no n-gram repeats yet
        out = s.schedule()
        assert not out.num_spec_tokens
        s.update(out, [next(sampled) if x.samples else 0 for x in out.scheduled])
    two, none = (next(q for q in s.running if q.request_id == r) for r in ("two", "none"))
    assert two.output_token_ids == [15, 16] and none.output_token_ids == [7]
    s.add(Sequence("long", list(range(100, 130)), SamplingParams(max_tokens=1)))
    out = s.schedule()
    rows = {x.seq.request_id: x for x in out.scheduled}
    assert {r: list(x.spec_token_ids) for r, x in rows.items()} == {"two": [15, 16], "none": [], "long": []}
    # 1 + 2 for "two", 1 for "none": the prompt chunk has the other 6 of the budget of 10
    # (with all k reserved it had 10 - 5 - 5 = 0, and waited a step)
    assert rows["long"].num_new_tokens == 10 - 3 - 1
    assert out.num_spec_tokens == 2 and sum(x.num_new_tokens for x in out.scheduled) == 10
    s.update(out, [7] * len(out.scheduled), {list(rows).index("two"): [15, 7]})
    s.check_invariants()
    assert two.output_token_ids == [15, 16, 15, 7]
    assert two.token_array().tolist() == [*range(10, 17), 15, 16, 15, 7]


# ---- the server's flag and metrics ------------------------------------------------------

def test_the_flag_takes_vllms_json_and_refuses_bad_json_clearly():
    from cli_args import build_parser, engine_config

    parse = build_parser().parse_args
    cfg = engine_config(parse(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']))
    assert cfg.speculative_config.k == 4
    assert engine_config(parse([])).speculative_config is None
    for bad, word in (('{"method": "ngram"', "not valid JSON"), ('{"num_speculative_tokens": 4}', "method"),
                      ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens")):
        with pytest.raises(ValueError, match=word):
            engine_config(parse(["--speculative-config", bad]))


def test_the_flag_takes_vllms_dotted_keys():
    """vLLM's parser (vllm/utils/argparse_utils.py FlexibleArgumentParser) reads
    `--json-arg.key value` as that key of the flag's JSON object: values JSON where they
    parse, strings otherwise, `key+ a,b` a list; the dotted words of a flag make one
    object, given after the rest of the command line (so over a whole JSON value before them)."""
    from cli_args import build_parser, engine_config
    from config_file import parse_args

    def spec(*argv: str) -> SpeculativeConfig:
        return engine_config(parse_args(build_parser(), list(argv))).speculative_config

    c = spec("--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=3",
             "--speculative-config.prompt_lookup_max", "2", "--max-model-len", "64")
    assert (c.method, c.k, c.options.prompt_lookup_min, c.options.prompt_lookup_max) == ("ngram", 3, 2, 2)
    c = spec("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
             "--speculative-config.method=ngram", "--speculative-config.num_speculative_tokens", "2")
    assert (c.method, c.k) == ("ngram", 2)
    args = parse_args(build_parser(), ["--default-chat-template-kwargs.enable_thinking", "false",
                                       "--default-chat-template-kwargs.a.b", "x", "--default-chat-template-kwargs.l+",
                                       "1,2", "--default-chat-template-kwargs.l+=3"])
    assert args.default_chat_template_kwargs == {"enable_thinking": False, "a": {"b": "x"}, "l": ["1", "2", "3"]}
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec("--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "x")


def test_metrics_carry_vllms_spec_decode_names(tiny_pair):
    from prometheus_client import CollectorRegistry, generate_latest

    from prometheus import EngineCollector

    _, spec = tiny_pair
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(spec.stats, spec_decode=True))
    text = generate_latest(registry).decode()
    s = spec.stats.snapshot()
    assert f"taxirank:spec_decode_num_drafts_total {float(s.spec_decode_num_drafts)}" in text
    assert f"taxirank:spec_decode_num_accepted_tokens_total {float(s.spec_decode_num_accepted_tokens)}" in text
    assert "taxirank:spec_decode_num_draft_tokens_total" in text
    assert f'taxirank:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} ' \
           f'{float(s.spec_decode_num_accepted_tokens_per_pos[0])}' in text


def test_constrained_rows_never_speculate():
    """A constrained row's next mask depends on each token: it decodes one token a step."""

    class AnyToken:  # a constraint that allows everything and never completes
        stopped = False

        def accept(self, token: int) -> bool:
            return True

    s = scheduler({})
    free, constrained = Sequence("free", [5, 6, 7], SamplingParams(max_tokens=20)), \
        Sequence("json", [5, 6, 7], SamplingParams(max_tokens=20))
    constrained.constraint = AnyToken()
    s.add(free)
    s.add(constrained)
    run_step(s, True)
    assert [x.seq.request_id for x in run_step(s, True)] == ["free"]


def test_a_stop_string_completed_inside_a_verified_step_ends_the_request_at_its_token():
    """A verified step emits several tokens; the engine's stop-string matcher reads them one
    by one, as sampled ones, so the request ends "stop" at the token that completes the
    string and the tokens after it in the step are not emitted."""
    from tokenizer import ByteTokenizer, IncrementalDetokenizer

    s = scheduler({})
    params = SamplingParams(max_tokens=20, stop=("ab",))
    seq = Sequence("s", [5, 6, 7], params)
    seq.stop_matcher = IncrementalDetokenizer(ByteTokenizer(), seq.prompt_token_ids, list(params.stop), params, (EOS,))
    s.add(seq)
    out = s.schedule()
    s.update(out, [ord("x")])  # the prompt, and its first token
    out = s.schedule()
    assert out.scheduled[0].num_spec_tokens == 2
    s.take_proposals(out, [[ord("a"), ord("b")]])
    outcome = s.update(out, [0], {0: [ord("a"), ord("b"), ord("c")]})  # both drafts accepted, and one more
    assert outcome.emitted == {"s": [ord("a"), ord("b")]} and outcome.finished == [seq]
    assert (seq.finish_reason, seq.output_token_ids) == ("stop", [ord("x"), ord("a"), ord("b")])
    assert (seq.stop_matcher.text, seq.stop_matcher.stop_reason) == ("x", "ab")


def test_a_step_verifying_drafts_with_no_prompt_tokens_is_a_decode_step(one_decode_bucket):
    """num_decode_steps counts the steps that carried no prompt tokens, as its HELP says:
    with ngram speculation that includes the steps verifying drafts (from the trace)."""
    llm = LLM("tiny", speculative_config=NGRAM, record_trace=True, **{**TIGHT, "warmup": False})
    llm.generate(grounded_prompts(2), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    s, trace = llm.stats, llm.engine.trace
    verifying = [t for t in trace if t.num_prefill_tokens == 0 and sum(n for _, n in t.scheduled) > t.num_decode_tokens]
    assert s.spec_decode_num_drafts > 0 and verifying, "some decode steps verified drafts"
    assert s.num_decode_steps == sum(1 for t in trace if t.num_prefill_tokens == 0)


def test_each_proposer_is_exactly_the_protocol_its_drafts_at_scheduling_names():
    """Two Protocols, told apart by drafts_at_scheduling (what the engine and the scheduler
    dispatch on): each registered proposer has every member of its own kind's, and not the
    method only the other kind has (no stub that would never be called)."""
    import typing_extensions

    import draft_model  # noqa: F401  (registers draft_model)
    from spec_decode import PROPOSERS, SchedulingProposer, StepProposer

    assert set(PROPOSERS) == {"ngram", "draft_model"} and PROPOSERS.names() == ["draft_model", "ngram"]
    members = {kind: typing_extensions.get_protocol_members(kind) for kind in (SchedulingProposer, StepProposer)}
    for name, cls in PROPOSERS.items():
        kind, other = (SchedulingProposer, StepProposer) if cls.drafts_at_scheduling else (StepProposer, SchedulingProposer)
        assert cls.drafts_at_scheduling is (kind is SchedulingProposer), name
        assert [m for m in members[kind] if not hasattr(cls, m)] == [], name
        assert [m for m in members[other] - members[kind] if hasattr(cls, m)] == [], name
    assert PROPOSERS["ngram"].drafts_at_scheduling and not PROPOSERS["draft_model"].drafts_at_scheduling
