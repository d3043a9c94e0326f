"""Prefix caching: the allocator's properties, the scheduler's admission, and the engine's
greedy tokens with the cache on equal to those with it off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from config import EngineConfig
from kvcache import BlockAllocator, blocks_needed, hash_block_tokens
from sampling_params import SamplingParams
from scheduler import Scheduler
from sequence import WAITING, Sequence

# ---- allocator ---------------------------------------------------------------------------


def chain(tokens: list[int], bs: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // bs):
        out.append(hash_block_tokens(out[-1] if out else None, tokens[i * bs:(i + 1) * bs]))
    return out


def test_a_name_covers_the_whole_prefix_and_the_extra_key():
    a, b = chain([1, 2, 3, 4], 2), chain([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same tokens in block 1, different prefix: different name
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], extra_key=("lora", 1))
    assert hash_block_tokens(None, [1, 2]) == chain([1, 2], 2)[0]


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences over a two-token alphabet (so prefixes collide all the time) are added,
    shared, freed, preempted (freed and at once re-added) and aborted in any order. A
    simulated device records which prefix each block's K/V was computed for, so a hit
    that served the wrong K/V, or a block reused while referenced, is caught."""

    @initialize(num_blocks=st.integers(2, 14), bs=st.sampled_from([1, 2, 3]))
    def setup(self, num_blocks, bs):
        self.a, self.bs = BlockAllocator(num_blocks), bs
        self.live: dict[str, list[int]] = {}  # owner -> its tokens
        self.kv: dict[int, tuple[int, ...]] = {}  # block -> the prefix its K/V was computed for
        self.n = 0

    def _admit(self, owner: str, tokens: list[int]) -> list[int] | None:
        a, bs = self.a, self.bs
        hashes = chain(tokens, bs)
        hit = a.cached_prefix(hashes[:(len(tokens) - 1) // bs])
        for i, b in enumerate(hit):  # a hit is the K/V of exactly this prefix
            assert self.kv[b] == tuple(tokens[:(i + 1) * bs])
        new = blocks_needed(len(tokens), bs) - len(hit)
        if not a.can_allocate(new + a.num_revived(hit)):
            return None
        held = {b for blocks in (a.blocks_of(o) for o in self.live) for b in blocks}
        a.share(owner, hit)
        fresh = a.allocate(owner, new)
        assert not held & set(fresh), "a block still referenced was handed out"
        for i, b in enumerate(fresh, start=len(hit)):  # "compute" the rest
            self.kv[b] = tuple(tokens[:min((i + 1) * bs, len(tokens))])
        a.cache_blocks(owner, hashes)
        self.live[owner] = tokens
        return hit

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=12))
    def add(self, tokens):
        self.n += 1
        self._admit(f"r{self.n}", tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish_or_abort(self, i):
        owner = sorted(self.live)[i % len(self.live)]
        assert self.a.free(owner) == blocks_needed(len(self.live.pop(owner)), self.bs)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def preempt_and_readmit(self, i):
        """A preempted sequence finds its own blocks again when nothing evicted them."""
        owner = sorted(self.live)[i % len(self.live)]
        tokens = self.live.pop(owner)
        expected = self.a.cached_prefix(chain(tokens, self.bs)[:(len(tokens) - 1) // self.bs])
        self.a.free(owner)
        hit = self._admit(owner, tokens)
        assert hit is None or hit == expected

    @rule()
    def reset(self):
        assert self.a.reset_prefix_cache() == (self.a.num_used == 0)

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()  # ref counts = owners, free = unreferenced, one name per block and back
        for owner, tokens in self.live.items():  # no referenced block was overwritten
            for i, b in enumerate(self.a.blocks_of(owner)):
                assert self.kv[b] == tuple(tokens[:min((i + 1) * self.bs, len(tokens))])

    def teardown(self):
        if hasattr(self, "a"):
            for owner in list(self.live):
                self.a.free(owner)
            assert self.a.num_free == self.a.num_usable, "a block leaked"
            self.a.check_invariants()


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase


def test_eviction_is_lru_unnamed_first_then_tail_blocks_first():
    a = BlockAllocator(9)  # 8 usable; block size 2
    ta, tb, tc = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13]
    A, B, C = a.allocate("a", 3), a.allocate("b", 2), a.allocate("c", 2)
    a.cache_blocks("a", chain(ta, 2))
    a.cache_blocks("b", chain(tb, 2))
    a.cache_blocks("c", chain(tc, 2))  # its second block holds one token: never named
    a.free("a"), a.free("b"), a.free("c")
    assert a.num_used == 0 and a.num_cached == 6
    never_used = ({*range(1, 9)} - {*A, *B, *C}).pop()
    order = a.allocate("x", 8)
    assert order[:2] == [C[1], never_used]  # blocks holding nothing worth keeping go first
    assert order[2:] == [A[2], A[1], A[0], B[1], B[0], C[0]]  # then least recently freed, tail first
    assert a.num_evictions == 6 and a.num_cached == 0


def test_a_hit_refreshes_a_block_and_the_prefix_ends_at_the_first_evicted_block():
    a = BlockAllocator(4)  # 3 usable
    t = [1, 2, 3, 4, 5, 6]
    A = a.allocate("a", 3)
    a.cache_blocks("a", chain(t, 2))
    a.free("a")
    assert a.allocate("o", 1) == [A[2]]  # evicts A's tail block
    assert a.cached_prefix(chain(t, 2)) == A[:2]
    a.free("o")
    hit = a.cached_prefix(chain([1, 2, 9, 9], 2))
    assert hit == A[:1]
    a.share("b", hit)  # revived, then freed again: now the most recently used
    a.free("b")
    assert a.allocate("x", 3) == [A[2], A[1], A[0]]
    a.free("x")
    # A child whose parent was evicted is unreachable: the prefix stops at the parent.
    B = a.allocate("b", 2)
    a.cache_blocks("b", chain(t[:4], 2))
    a.free("b")
    a.share("c", [B[1]])  # the child stays referenced ...
    assert B[0] in a.allocate("y", 2)  # ... while its parent is evicted
    assert a.num_cached == 1 and a.cached_prefix(chain(t[:4], 2)) == []
    a.check_invariants()


def test_reset_forgets_every_name_only_when_nothing_is_in_use():
    a = BlockAllocator(5)
    a.allocate("a", 2)
    a.cache_blocks("a", chain([1, 2, 3, 4], 2))
    assert not a.reset_prefix_cache() and a.num_cached == 2
    a.free("a")
    assert a.reset_prefix_cache() and a.num_cached == 0 and a.cached_prefix(chain([1, 2, 3, 4], 2)) == []
    a.check_invariants()


def test_caching_off_names_nothing():
    a = BlockAllocator(5, enable_caching=False)
    a.allocate("a", 2)
    a.cache_blocks("a", chain([1, 2, 3, 4], 2))
    a.free("a")
    assert a.num_cached == 0 and a.cached_prefix(chain([1, 2, 3, 4], 2)) == []


# ---- scheduler ---------------------------------------------------------------------------


def make(num_blocks: int, **kw) -> Scheduler:
    cfg = EngineConfig(**{"max_num_seqs": 4, "block_size": 4, "max_model_len": 64, **kw}).resolved(64)
    return Scheduler(cfg, num_blocks, (0,))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, [token] * len(out.scheduled))
    s.check_invariants()
    return out


def test_a_request_admitted_in_the_same_step_shares_the_blocks_being_computed():
    s = make(64)
    prompt = list(range(1, 21))  # 5 full blocks of 4
    a, b = Sequence("a", prompt, SamplingParams(max_tokens=4)), Sequence("b", prompt, SamplingParams(max_tokens=4))
    s.add(a), s.add(b)
    out = step(s)
    # b takes a's first 4 blocks (16 tokens) and computes the last block, whose last token it must sample.
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 20), ("b", 4)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16)
    assert a.block_table[:4] == b.block_table[:4] and a.block_table[4] != b.block_table[4]
    assert s.allocator.num_used == 6  # 4 shared + one each: a shared block counts once


def test_a_cache_salt_names_only_the_first_block_and_the_rest_chain_from_it():
    """vLLM's cache_salt is the first block's extra key: every later name chains from that
    one, so a salted prompt shares no block with the same prompt unsalted or under another
    salt, and shares as before with its own salt (here within one step)."""
    s = make(64)
    prompt = list(range(1, 21))  # 5 full blocks of 4
    seqs = [Sequence(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt)
            for rid, salt in (("plain", None), ("a", "tenant-a"), ("b", "tenant-b"), ("a2", "tenant-a"))]
    for seq in seqs:
        s.add(seq)
    step(s)
    plain, a, b, a2 = seqs
    salted = [hash_block_tokens(None, prompt[:4], extra_key="tenant-a")]
    for i in range(1, 5):
        salted.append(hash_block_tokens(salted[-1], prompt[4 * i:4 * i + 4]))  # no extra key past the first
    assert plain.block_hashes == chain(prompt, 4) and a.block_hashes == a2.block_hashes == salted
    assert len({plain.block_hashes[0], a.block_hashes[0], b.block_hashes[0]}) == 3
    assert [q.num_cached_tokens for q in seqs] == [0, 0, 0, 16]
    assert a2.block_table[:4] == a.block_table[:4]
    assert not {*plain.block_table, *b.block_table} & set(a.block_table) and not set(plain.block_table) & set(b.block_table)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_static_batch_boards_a_request_sharing_a_boarded_prompts_prefix(chunked):
    """Static batching: a boarded prompt is scheduled as it boards, so its full blocks are
    named before the next request is sized, as continuous batching names them: b shares
    a's 4 blocks and needs 1 fresh (6 in all, 7 free), where unshared it would need 5 of
    the 2 left and wait a whole batch on kv_blocks."""
    s = make(8, scheduling="static", enable_chunked_prefill=chunked, max_num_batched_tokens=64)
    prefix = list(range(1, 17))  # 4 full blocks
    a, b = Sequence("a", prefix + [90], SamplingParams(max_tokens=4)), Sequence("b", prefix + [91], SamplingParams(max_tokens=4))
    s.add(a), s.add(b)
    out = step(s)
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 17), ("b", 1)]
    assert a.block_table[:4] == b.block_table[:4] and s.allocator.num_used == 6 and not s.waiting
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_used == 0


def test_a_static_batch_boards_a_request_sharing_a_swapped_in_sequences_prefix():
    """A swapped-out sequence's blocks are named as its K/V is copied back in (as a cache
    hit's are), also when it boards with only a decode left: c, boarding after it in the
    same batch, shares a's 3 prompt blocks and needs 1 fresh (4 + 1 of 7), where unshared
    it would need 4 of the 3 left and wait a whole batch on kv_blocks."""
    cfg = EngineConfig(max_num_seqs=2, block_size=2, max_model_len=16, scheduling="static", enable_prefix_caching=True,
                       enable_chunked_prefill=False, preemption_mode="swap").resolved(16)
    s = Scheduler(cfg, 8, (0,), num_swap_blocks=8)  # 7 usable blocks
    b = Sequence("b", list(range(100, 106)), SamplingParams(max_tokens=3, ignore_eos=True))
    a = Sequence("a", list(range(1, 7)), SamplingParams(max_tokens=8, ignore_eos=True))
    s.add(b), s.add(a)
    step(s)
    out = step(s)  # both decodes need a 4th block, one is free: a, admitted last, is swapped out
    assert out.preempted == [a] and out.preempted_swapped == [True] and a.swapped is not None
    s.add(c := Sequence("c", list(range(1, 7)) + [50, 51], SamplingParams(max_tokens=2, ignore_eos=True)))
    step(s)  # b's last token: the batch leaves
    out = step(s)  # a (swapped in, a decode left) and c board together
    assert out.swap_in and [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("c", 2)]
    assert c.block_table[:3] == a.block_table[:3] and not s.waiting
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_used == 0 and len(s._host_free) == 8


def test_an_exact_block_multiple_prompt_recomputes_its_last_block():
    s = make(64)
    prompt = list(range(1, 17))  # exactly 4 blocks
    s.add(Sequence("a", prompt, SamplingParams(max_tokens=2)))
    while s.has_unfinished():
        step(s)
    b = Sequence("b", prompt, SamplingParams(max_tokens=2))  # a prompt equal to a cached one
    s.add(b)
    out = step(s)
    assert out.scheduled[0].num_new_tokens == 4 and b.num_cached_tokens == 12


@pytest.mark.parametrize("kv_admission", ["reserve", "reserve-max-len"])
def test_reserve_modes_count_a_shared_block_once(kv_admission):
    # 20-token prompt + 4 tokens: reserve holds 6 blocks, reserve-max-len 64/4 = 16.
    lifetime = 6 if kv_admission == "reserve" else 16
    prompt = list(range(1, 21))
    for caching in (False, True):
        s = make(1 + 2 * lifetime - 4, kv_admission=kv_admission, enable_prefix_caching=caching)
        s.add(Sequence("a", prompt, SamplingParams(max_tokens=4)))
        s.add(Sequence("b", prompt, SamplingParams(max_tokens=4)))
        step(s)
        if caching:  # b shares a's 4 cached blocks and reserves only the rest
            assert s.num_running == 2 and s.allocator.num_used == lifetime + lifetime - 4
        else:
            assert s.num_running == 1 and s.waiting_by_reason()["kv_blocks"] == 1
        while s.has_unfinished():
            step(s)
        assert s.allocator.num_used == 0


def test_a_preempted_sequence_finds_its_own_blocks_again_head_kept_tail_evicted_first():
    # Two sequences of 8 prompt tokens grow into 9 usable blocks of 4: b (the latest) is preempted.
    s = make(10, max_num_seqs=2)
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=24))
    b = Sequence("b", list(range(101, 109)), SamplingParams(max_tokens=24))
    s.add(a), s.add(b)
    while not b.num_preemptions:
        held = list(b.block_table)
        step(s)
    assert b.status is WAITING and s.allocator.num_cached >= len(held) - 1
    while b.status is WAITING:  # a grows meanwhile, evicting what b left behind, tail first
        expect = s.allocator.cached_prefix(s._block_hashes(b, (b.num_tokens - 1) // 4))
        num_tokens = b.num_tokens
        out = step(s)
    assert s.allocator.num_evictions > 0
    assert expect and expect == held[:len(expect)]  # its own first blocks survived
    assert b.block_table[:len(expect)] == expect
    assert next(x for x in out.scheduled if x.seq is b).num_new_tokens == num_tokens - 4 * len(expect)
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_used == 0


def test_prefix_caching_off_changes_nothing_in_admission():
    s = make(64, enable_prefix_caching=False)
    prompt = list(range(1, 21))
    s.add(Sequence("a", prompt, SamplingParams(max_tokens=2)))
    s.add(Sequence("b", prompt, SamplingParams(max_tokens=2)))
    out = step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [20, 20] and s.allocator.num_cached == 0


# ---- engine: greedy tokens with the cache on equal those with it off ------------------------

# test_request_metrics' and test_kvcache's shapes (the workload's longest sequence, a second
# turn, is 98 tokens): their step programs are compilation-cache hits in one run.
SMALL = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, warmup=False)


def make_llm(**kw):
    from llm import LLM

    return LLM("tiny", log=lambda *_: None, **{**SMALL, **kw})


def workload() -> tuple[list[list[int]], list[SamplingParams], list[list[int]]]:
    """First call: a shared 40-token system prompt before 6 different questions, and a
    32-token prompt (an exact multiple of the block size 16). Second call: the 32-token
    prompt again (equal to a cached one), and 3 conversations' second turns (each resends
    turn one: system + question + answer, then a new question)."""
    rng = np.random.default_rng(0)
    system = rng.integers(3, 500, 40).tolist()
    questions = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(4, 12, 6)]
    exact = rng.integers(3, 500, 32).tolist()
    first = [system + q for q in questions] + [exact]
    params = [SamplingParams(max_tokens=int(n), temperature=0.0, ignore_eos=True) for n in (30, 40, 20, 50, 35, 25, 40)]
    return first, params, exact


def run(llm) -> tuple[list[list[int]], list[list[int]], list]:
    first, params, exact = workload()
    outs1 = llm.generate(first, params)
    rng = np.random.default_rng(1)
    turns = [first[i] + outs1[i].outputs[0].token_ids + rng.integers(3, 500, 6).tolist() for i in range(3)]
    outs2 = llm.generate([exact] + turns, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs1], [o.outputs[0].token_ids for o in outs2], outs1 + outs2


@pytest.fixture(scope="module")
def reference():
    off = make_llm(enable_prefix_caching=False)
    r = run(off)
    assert off.stats.prefix_cache_queries == off.stats.prefix_cache_hits == 0
    assert all(o.num_cached_tokens == 0 for o in r[2])
    return r


@pytest.mark.parametrize("case", [
    dict(),
    dict(num_kv_blocks=14),  # as test_engine: evict, preempt
    dict(enable_chunked_prefill=True, max_num_batched_tokens=32),
    dict(scheduling="static"),
])
def test_greedy_tokens_are_identical_with_prefix_caching_on_and_off(reference, case):
    llm = make_llm(**case)
    toks1, toks2, outs = run(llm)
    assert (toks1, toks2) == reference[:2]
    st, alloc = llm.stats, llm.engine.scheduler.allocator
    # The metrics and cached_tokens move by exactly the reused tokens.
    assert st.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outs)
    assert st.prefix_cache_hits == sum(o.num_cached_tokens for o in outs) > 0
    assert alloc.num_used == 0
    if "num_kv_blocks" in case:
        assert st.num_preemptions > 0 and alloc.num_evictions > 0
        assert st.prefix_cache_evictions == alloc.num_evictions  # exported as taxirank:prefix_cache_evictions_total
    else:
        first, _, _ = workload()
        # The equal prompt reuses its first block (the last is recomputed); each second turn
        # reuses the full blocks of turn one that were computed (all but the last sampled token).
        assert outs[7].num_cached_tokens == 16
        for i in range(3):
            assert outs[8 + i].num_cached_tokens == (len(first[i]) + len(toks1[i]) - 1) // 16 * 16
    if case == {}:
        assert [o.num_cached_tokens for o in outs[:7]] == [0] + [32] * 5 + [0]  # the system prompt's 2 full blocks
        assert st.prefill_tokens == reference_prefill(outs)


def test_async_scheduling_names_a_block_only_once_its_tokens_are_known(reference):
    """Async scheduling: a block whose last token is still in flight (a placeholder) gets
    its name a step later, never a name over the placeholder (that name would match
    another sequence's block whose real token differs). Same tokens as sync, same hits on
    the prompts."""
    llm = make_llm(async_scheduling=True)
    toks1, toks2, outs = run(llm)
    assert (toks1, toks2) == reference[:2]
    st = llm.stats
    assert st.prefix_cache_hits == sum(o.num_cached_tokens for o in outs) > 0
    assert [o.num_cached_tokens for o in outs[:7]] == [0] + [32] * 5 + [0]
    assert outs[7].num_cached_tokens == 16
    assert llm.engine.scheduler.allocator.num_used == 0


def test_a_block_holding_a_token_in_flight_is_not_named():
    s = Scheduler(EngineConfig(max_num_seqs=2, block_size=4, max_model_len=32).resolved(32), 17, (0,))
    seq = Sequence("a", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=8))
    seq.output_token_ids, seq.num_output_placeholders = [11], 1
    assert len(s._block_hashes(seq, 2)) == 1  # tokens 4..7 hold the one in flight
    seq.output_token_ids.append(12)
    seq.num_output_placeholders = 0
    assert s._block_hashes(seq, 2)[1] == hash_block_tokens(s._block_hashes(seq, 1)[0], [9, 10, 11, 12])
    assert len(s._block_hashes(seq, 2)) == 2


def reference_prefill(outs) -> int:
    return sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)


def test_reset_prefix_cache_forgets_everything():
    llm = make_llm()
    prompt = list(range(3, 40))
    llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0


@pytest.mark.parametrize("aborted", ["first", "second"])
def test_aborting_a_request_whose_blocks_are_shared_leaks_nothing_and_the_other_finishes_alike(aborted):
    """Two requests share their first two blocks through the prefix cache. Aborting
    either one mid-decode: the other still gives the tokens it gives alone, every block
    comes back, and the shared prefix stays cached for the next request."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, 32).tolist()
    prompts = {"first": prefix + rng.integers(3, 500, 5).tolist(), "second": prefix + rng.integers(3, 500, 7).tolist()}
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = make_llm(enable_prefix_caching=False)
    alone = {rid: ref.generate([p], params)[0].outputs[0].token_ids for rid, p in prompts.items()}

    llm = make_llm()
    eng = llm.engine
    got: dict[str, list[int]] = {"first": [], "second": []}

    def step() -> None:
        for d in eng.step():
            got[d.request_id] += d.new_token_ids
    eng.add_request("first", prompts["first"], params)
    while len(got["first"]) < 3:
        step()
    eng.add_request("second", prompts["second"], params)
    while len(got["second"]) < 3:
        step()
    first, second = eng.scheduler._seqs["first"], eng.scheduler._seqs["second"]
    assert second.num_cached_tokens == 32 and first.block_table[:2] == second.block_table[:2]
    eng.abort(aborted)
    while eng.has_unfinished():
        step()
    other = "second" if aborted == "first" else "first"
    assert got[other] == alone[other]
    assert got[aborted] == alone[aborted][:len(got[aborted])] and len(got[aborted]) < 30
    assert eng.scheduler.allocator.num_used == 0 and llm.stats.request_success["abort"] == 1
    again = llm.generate([prompts[aborted]], params)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == alone[aborted]
    assert eng.scheduler.allocator.num_used == 0


def test_offline_cache_salts_hit_only_their_own_salts_blocks_and_change_no_token():
    """LLM.generate's vLLM prompt dicts: the same 40-token prompt unsalted, under two salts,
    then again under each: only a salt (or no salt) seen before hits, its 2 full blocks; the
    greedy tokens are those of the prompt with prefix caching off."""
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = make_llm(enable_prefix_caching=False).generate([prompt], params)[0].outputs[0].token_ids
    llm = make_llm()
    got = []
    for salt in (None, "tenant-a", "tenant-b", "tenant-a", None, "tenant-b"):
        out = llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params)[0]
        got.append((out.num_cached_tokens, out.outputs[0].token_ids))
    assert got == [(0, want)] * 3 + [(32, want)] * 3
    # n samples of one salted prompt share its blocks among themselves
    hits = llm.stats.prefix_cache_hits
    out = llm.generate([{"prompt_token_ids": prompt[::-1], "cache_salt": "tenant-c"}],
                       dataclasses.replace(params, n=2, temperature=1.0, seed=0))[0]
    assert llm.stats.prefix_cache_hits - hits == 32 and len(out.outputs) == 2


@pytest.mark.parametrize("prompt", [
    {"prompt_token_ids": [5, 6], "cache_salt": ""}, {"prompt_token_ids": [5, 6], "cache_salt": 5},
    {"prompt_token_ids": [5, 6], "cache_salt": []}, {"prompt_token_ids": [5, 6], "cache_salt": {"a": 1}},
    {"prompt_token_ids": [5, 6], "salt": "x"}, {"prompt": [5, 6], "cache_salt": "x"}])
def test_a_bad_prompt_dict_or_cache_salt_is_refused_offline_before_anything_runs(prompt):
    llm = make_llm()
    with pytest.raises((ValueError, TypeError), match="cache_salt|prompt"):
        llm.generate([{"prompt_token_ids": [7, 8]}, prompt], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


def test_a_request_asking_prompt_logprobs_makes_no_prefix_cache_query():
    """As vLLM (skip_reading_prefix_cache): a request that may not read the cache is no
    lookup, so it counts neither as a query nor as a miss; the other requests' lookups
    and hits are their prompt lengths and their usage's cached tokens."""
    llm = make_llm()
    prompt = list(range(3, 40))
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate([prompt], plain)[0]
    lp = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
    again = llm.generate([prompt], plain)[0]
    assert (first.num_cached_tokens, lp.num_cached_tokens, again.num_cached_tokens) == (0, 0, 32)
    assert llm.stats.prefix_cache_queries == 2 * len(prompt)
    assert llm.stats.prefix_cache_hits == 32


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_completed_by_accepted_drafts_are_named(async_scheduling):
    """Prompt lookup (greedy: deterministic): a block that a verified step's accepted
    drafts complete is named as a decode's block is, also in the step that finishes the
    request (no later step names it then). A prompt resending the first request's prompt
    and output hits every full block of it whose K/V was computed (all but the last
    sampled token), and generates what the engine does without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    base, llm = make_llm(**kw), make_llm(speculative_config=spec, **kw)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 250, 8).tolist() + rng.integers(3, 250, 9).tolist() * 3  # a passage repeated
    for max_tokens in range(13, 17):  # the run that ends the request accepts drafts completing a block
        assert llm.reset_prefix_cache() and base.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        first = llm.generate([prompt], params)[0].outputs[0]
        assert first.token_ids == base.generate([prompt], params)[0].outputs[0].token_ids
        again = prompt + first.token_ids
        hits = llm.stats.prefix_cache_hits
        second = llm.generate([again], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert second.num_cached_tokens == llm.stats.prefix_cache_hits - hits == (len(again) - 1) // 4 * 4, max_tokens
        assert second.outputs[0].token_ids == base.generate([again], SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    assert llm.stats.spec_decode_num_accepted_tokens > 0
    assert llm.engine.scheduler.allocator.num_used == 0
