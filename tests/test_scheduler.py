"""The scheduler's claims, checked on the scheduler alone (pure Python, no model)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from config import EngineConfig
from kvcache import blocks_needed
from sampling_params import SamplingParams
from scheduler import Scheduler
from scheduler_output import SchedulerOutput
from sequence import FINISHED, RUNNING, WAITING, Sequence

EOS = 0
TOKEN = 7  # any token that is not EOS


def make(max_num_seqs: int = 4, block_size: int = 4, max_model_len: int = 64, num_blocks: int | None = None,
         **kw) -> Scheduler:
    kw.setdefault("enable_chunked_prefill", False)  # these tests start from vLLM v0's whole-prompt steps
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                       **kw).resolved(max_model_len)
    if num_blocks is None:
        num_blocks = max_num_seqs * cfg.max_blocks_per_seq + 1
    return Scheduler(cfg, num_blocks, (EOS,))


def seq(rid: str, prompt_len: int = 4, max_tokens: int = 8, **params) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **params))


def step(s: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[Sequence]]:
    out = s.schedule()
    released = s.update(out, [token] * len(out.scheduled)).finished
    s.check_invariants()
    return out, released


def ids(out: SchedulerOutput) -> list[str]:
    return [x.seq.request_id for x in out.scheduled]


def run_all(s: Scheduler, max_steps: int = 20_000) -> list[SchedulerOutput]:
    trace = []
    while s.has_unfinished():
        trace.append(step(s)[0])
        assert len(trace) < max_steps, "the scheduler stopped making progress"
    assert s.allocator.num_used == 0
    return trace


def test_the_scheduler_imports_no_jax():
    code = "import sys, scheduler; assert not [m for m in sys.modules if m.split('.')[0] == 'jax']"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, check=True)


# ---- admission checks ------------------------------------------------------------------
def validate(s: Scheduler, x: Sequence) -> None:
    s.validate(x.prompt_token_ids, x.params)


def test_validate_refuses_requests_that_can_never_run_saying_why():
    s = make(max_model_len=32, num_blocks=9)  # 8 usable blocks of 4 = 32 tokens
    with pytest.raises(ValueError, match="empty"):
        validate(s, seq("a", prompt_len=0))
    too_long = r"\(30 tokens\) plus max_tokens \(3\) is 33 tokens, over max_model_len \(32\)"
    with pytest.raises(ValueError, match=too_long):
        validate(s, seq("a", prompt_len=30, max_tokens=3))
    s.add(seq("a"))
    with pytest.raises(ValueError, match="already in flight"):
        s.add(seq("a"))
    small = make(max_model_len=32, num_blocks=5)  # 4 usable blocks: 16 tokens
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens \\(on-demand\\), the whole cache has 4"):
        validate(small, seq("b", prompt_len=10, max_tokens=10))
    rml = make(max_model_len=32, num_blocks=5, kv_admission="reserve-max-len")
    with pytest.raises(ValueError, match="needs 8 KV blocks .*reserve-max-len"):
        validate(rml, seq("c", prompt_len=1, max_tokens=1))


# ---- continuous: the taxi rank -----------------------------------------------------------
def test_a_finished_sequence_frees_its_slot_that_step_and_a_queued_request_joins_the_very_next_step():
    s = make(max_num_seqs=2)
    for rid, n in [("short", 3), ("long", 20), ("queued", 5)]:
        s.add(seq(rid, max_tokens=n))
    out, _ = step(s)
    assert ids(out) == ["short", "long"] and s.waiting_by_reason()["max_num_seqs"] == 1
    short_slot = s.running[0].slot
    released: list[Sequence] = []
    while not released:
        out, released = step(s)
    assert [r.request_id for r in released] == ["short"] and released[0].finish_reason == "length"
    assert released[0].slot is None and s.allocator.blocks_of("short") == []  # freed in that update
    assert s.num_running == 1
    out, _ = step(s)
    assert "queued" in ids(out)
    assert s.running[-1].request_id == "queued" and s.running[-1].slot == short_slot


def test_finish_reasons_eos_stop_tokens_ignore_eos_and_max_tokens():
    s = make()
    streams = {"eos": [EOS], "ignore_eos": [EOS, EOS, EOS], "stop_id": [1, TOKEN], "length": [1, 1]}
    s.add(seq("eos"))
    s.add(seq("ignore_eos", max_tokens=3, ignore_eos=True))
    s.add(seq("stop_id", stop_token_ids=[TOKEN]))
    s.add(seq("length", max_tokens=2))
    reasons: dict[str, tuple[str, int]] = {}
    while s.has_unfinished():
        out = s.schedule()
        sampled = [streams[x.seq.request_id][x.seq.num_output_tokens] for x in out.scheduled]
        for r in s.update(out, sampled).finished:
            reasons[r.request_id] = (r.finish_reason, r.num_output_tokens)
    assert reasons == {"eos": ("stop", 1), "ignore_eos": ("length", 3), "stop_id": ("stop", 2),
                       "length": ("length", 2)}


# ---- static: the bus ---------------------------------------------------------------------
def test_static_holds_finished_sequences_as_padding_and_releases_the_batch_at_once():
    s = make(max_num_seqs=2, scheduling="static")
    s.add(seq("a", max_tokens=2))
    s.add(seq("b", max_tokens=5))
    s.add(seq("c", max_tokens=1))
    step(s)
    assert s.waiting_by_reason()["max_num_seqs"] == 1
    _, released = step(s)
    a = s.running[0]
    assert released == [] and a.status is FINISHED  # a is done ...
    assert a.slot is not None and s.allocator.blocks_of("a")  # ... but still rides as padding
    out, released = step(s)
    assert ids(out) == ["b"] and released == []
    assert s.waiting_by_reason()["static_batch"] == 1  # c waits for the bus, though a is done
    while not released:
        _, released = step(s)
    assert [r.request_id for r in released] == ["a", "b"] and s.num_running == 0
    assert s.allocator.num_used == 0
    out, _ = step(s)
    assert ids(out) == ["c"]


def useful_and_total_slot_steps(scheduling: str, lengths: list[int]) -> tuple[int, int]:
    s = make(max_num_seqs=8, block_size=16, max_model_len=1024, scheduling=scheduling)
    for i, n in enumerate(lengths):
        s.add(seq(f"r{i}", max_tokens=n))
    trace = run_all(s)
    return sum(len(out.scheduled) for out in trace), 8 * len(trace)


def test_static_batching_wastes_73_percent_of_slot_steps_on_skewed_lengths():
    useful, total = useful_and_total_slot_steps("static", [20, 25, 30, 40, 50, 60, 700, 800])
    assert (useful, total) == (1725, 6400)


def test_continuous_batching_fills_the_seats_static_leaves_empty():
    lengths = [20, 25, 30, 40, 50, 60, 700, 800] * 2
    static_useful, static_total = useful_and_total_slot_steps("static", lengths)
    cont_useful, cont_total = useful_and_total_slot_steps("continuous", lengths)
    assert static_useful == cont_useful == 2 * 1725
    assert static_total == 2 * 6400
    # Deterministic: 866 steps. The second 800-token request boards at step 51, when the
    # sixth slot frees, and each of the 8 admission steps (unchunked) stalls the decodes.
    assert cont_total == 8 * 866


# ---- KV admission ----------------------------------------------------------------------------
def three_requests(kv_admission: str) -> Scheduler:
    """Three requests that each grow to 4 blocks, in a cache of 8: not all fit at once."""
    s = make(max_num_seqs=3, max_model_len=32, num_blocks=9, kv_admission=kv_admission)
    for rid in "abc":
        s.add(seq(rid, prompt_len=4, max_tokens=12))
    return s


def test_on_demand_preempts_the_latest_admitted_by_recompute_and_everything_completes():
    s = three_requests("on-demand")
    first_victim = None
    while s.has_unfinished():
        before = {r.request_id: r.admitted_seq_no for r in s.running}
        out, released = step(s)
        for victim in out.preempted:
            still_running = [before[r.request_id] for r in s.running if r.request_id in before]
            assert before[victim.request_id] > max(still_running, default=-1), "the victim is the latest admitted"
            assert victim.num_computed_tokens == 0 and victim.output_token_ids  # outputs are kept
            assert victim.status is WAITING and victim.slot is None and not victim.block_table
            first_victim = first_victim or victim
        # the step's victims wait at the front of the queue, the latest preempted first
        assert list(s.waiting)[:len(out.preempted)] == out.preempted[::-1]
        for x in out.scheduled:  # a re-admitted victim recomputes its prompt and its outputs
            if x.seq.num_preemptions and x.seq.num_computed_tokens == 0:
                assert x.num_new_tokens == x.seq.num_tokens and x.samples
    assert first_victim is not None and first_victim.request_id == "c"
    assert first_victim.num_output_tokens == 12 and first_victim.finish_reason == "length"


def test_reserve_never_preempts_it_admits_fewer_instead():
    s = three_requests("reserve")
    step(s)
    assert s.num_running == 2 and s.waiting_by_reason()["kv_blocks"] == 1  # 2 x (4 + 12 tokens) fill 8 blocks
    trace = run_all(s)
    assert not any(out.preempted for out in trace)


def test_reserve_max_len_concurrency_is_blocks_over_blocks_per_max_model_len():
    # max_model_len 32 / block 4 = 8 blocks a request; 29 usable blocks hold 3 requests.
    s = make(max_num_seqs=8, max_model_len=32, num_blocks=30, kv_admission="reserve-max-len")
    for i in range(6):
        s.add(seq(f"r{i}", prompt_len=1, max_tokens=1))
    out, _ = step(s)
    assert len(out.scheduled) == 3 == 29 // blocks_needed(32, 4)
    assert s.waiting_by_reason()["kv_blocks"] == 3


def test_halving_max_model_len_doubles_reserve_max_len_concurrency_at_every_length():
    """What halving max-model-len does to admission, on the scheduler: the same 64 usable
    blocks of 4 tokens hold 2, 4, 8, 16, 32 requests at max_model_len 128, 64, 32, 16, 8."""
    def admitted(max_model_len: int) -> int:
        s = make(max_num_seqs=64, max_model_len=max_model_len, num_blocks=65, kv_admission="reserve-max-len")
        for i in range(64):
            s.add(seq(f"r{i}", prompt_len=1, max_tokens=1))
        return len(step(s)[0].scheduled)

    lengths = [128, 64, 32, 16, 8]
    assert [admitted(n) for n in lengths] == [2, 4, 8, 16, 32]


# ---- prefill: stall vs chunks -------------------------------------------------------------
def test_without_chunking_a_step_that_admits_a_prompt_stalls_the_decodes():
    s = make()
    s.add(seq("streaming", max_tokens=20))
    step(s)
    assert ids(step(s)[0]) == ["streaming"]
    s.add(seq("newcomer", prompt_len=30))
    out, _ = step(s)
    assert ids(out) == ["newcomer"] and not out.is_decode_only  # streaming's token hitches here
    out, _ = step(s)
    assert ids(out) == ["streaming", "newcomer"] and out.is_decode_only


def test_chunked_prefill_splits_a_long_prompt_decodes_first_within_the_budget():
    # Prefix caching off: the two prompts start alike (tests/test_prefix_cache.py covers sharing).
    s = make(max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=False)
    s.add(seq("streaming", max_tokens=50))
    step(s)
    s.add(seq("long", prompt_len=50))
    chunks = []
    while not chunks or chunks[-1].samples is False:
        out, _ = step(s)
        assert sum(x.num_new_tokens for x in out.scheduled) <= 16
        assert ids(out) == ["streaming", "long"]  # the decode first, then the chunk
        assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, out.scheduled[1].num_new_tokens)
        chunks.append(out.scheduled[1])
    assert [c.num_new_tokens for c in chunks] == [15, 15, 15, 5]
    assert [c.samples for c in chunks] == [False, False, False, True]
    out, _ = step(s)  # the step after its last chunk, it decodes
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("streaming", 1), ("long", 1)]
    assert out.is_decode_only


def test_long_prefill_token_threshold_caps_every_chunk_while_the_decodes_keep_running():
    """vLLM's --long-prefill-token-threshold 8: a 30-token prompt computes 8 tokens a step
    (its first chunk at admission, then each later one) though the budget has room for it
    whole; the streaming decode runs every step, and a short prompt arriving with the long
    one gets its first token in the same step rather than waiting behind it."""
    s = make(max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False,
             long_prefill_token_threshold=8)
    s.add(seq("streaming", max_tokens=50))
    step(s)
    s.add(seq("long", prompt_len=30))
    s.add(seq("short", prompt_len=6))
    rows = []
    for _ in range(4):
        out, _ = step(s)
        rows.append([(x.seq.request_id, x.num_new_tokens, x.samples) for x in out.scheduled])
    assert rows == [
        [("streaming", 1, True), ("long", 8, False), ("short", 6, True)],
        [("streaming", 1, True), ("short", 1, True), ("long", 8, False)],
        [("streaming", 1, True), ("short", 1, True), ("long", 8, False)],
        [("streaming", 1, True), ("short", 1, True), ("long", 6, True)],
    ]
    # Off (0, vLLM's default): the long prompt takes what the decode leaves, the short one the rest.
    s = make(max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False)
    s.add(seq("streaming", max_tokens=50))
    step(s)
    s.add(seq("long", prompt_len=30))
    s.add(seq("short", prompt_len=6))
    out, _ = step(s)
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("streaming", 1), ("long", 30), ("short", 1)]


def test_long_prefill_token_threshold_caps_a_preempted_sequences_recompute():
    """A preempted sequence's recompute (prompt and outputs) is a prefill like any other:
    each re-admission computes at most the threshold a step. b is preempted after its
    first token, and again partway through two recomputes (a's decodes take the blocks);
    the last recomputes its 13 tokens as 5, 5, 3 and samples."""
    s = make(max_num_seqs=2, max_model_len=64, num_blocks=8, enable_chunked_prefill=True, max_num_batched_tokens=16,
             enable_prefix_caching=False, long_prefill_token_threshold=5)  # 7 usable blocks of 4
    for rid in ("a", "b"):  # 25 tokens each at most: 7 blocks, the whole cache
        x = seq(rid, prompt_len=12, max_tokens=14)
        s.validate(x.prompt_token_ids, x.params)
        s.add(x)
    b, chunks = s.waiting[1], []
    while not b.num_preemptions or not chunks or not chunks[-1][1]:
        out, _ = step(s)
        chunks += [(x.num_new_tokens, x.samples) for x in out.scheduled if x.seq is b and b.num_preemptions]
    assert b.num_preemptions == 4 and b.num_tokens == 14
    assert chunks == [(5, False), (5, False), (5, False), (5, False), (5, False), (5, False), (3, True)]
    run_all(s)


def test_long_prefill_token_threshold_under_static_batching_one_chunk_a_sequence_a_step():
    """The bus boards both prompts and schedules a first chunk of each (4 tokens, the
    threshold); the budget left (8) gives neither a second chunk in the same step."""
    s = make(scheduling="static", enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=False,
             long_prefill_token_threshold=4)
    s.add(seq("a", prompt_len=10))
    s.add(seq("b", prompt_len=10))
    rows = [[(x.seq.request_id, x.num_new_tokens) for x in step(s)[0].scheduled] for _ in range(3)]
    assert rows == [[("a", 4), ("b", 4)], [("a", 4), ("b", 4)], [("a", 2), ("b", 2)]]


# ---- why requests wait -----------------------------------------------------------------------
def test_waiting_reports_max_num_seqs_when_slots_hold_a_request_back():
    s = make(max_num_seqs=1)
    s.add(seq("a"))
    s.add(seq("b"))
    step(s)
    assert s.waiting_by_reason() == {"kv_blocks": 0, "max_num_seqs": 1, "token_budget": 0, "static_batch": 0,
                                    "policy": 0}


def test_waiting_reports_kv_blocks_when_blocks_not_slots_hold_a_request_back():
    s = make(max_num_seqs=4, max_model_len=32, num_blocks=9, kv_admission="reserve")
    s.add(seq("a", prompt_len=4, max_tokens=28))  # reserves all 8 blocks
    s.add(seq("b"))
    step(s)
    assert s.num_running == 1 and s.waiting_by_reason()["kv_blocks"] == 1


def test_waiting_reports_token_budget_when_the_step_is_full():
    s = make(max_num_seqs=4, max_model_len=32, max_num_batched_tokens=32, enable_prefix_caching=False)
    s.add(seq("a", prompt_len=20))
    s.add(seq("b", prompt_len=20))
    out, _ = step(s)
    assert ids(out) == ["a"] and s.waiting_by_reason()["token_budget"] == 1
    chunked = make(max_num_seqs=4, enable_chunked_prefill=True, max_num_batched_tokens=8)
    chunked.add(seq("a", prompt_len=20))
    chunked.add(seq("b", prompt_len=20))
    out, _ = step(chunked)
    assert [x.num_new_tokens for x in out.scheduled] == [8] and chunked.waiting_by_reason()["token_budget"] == 1


def test_waiting_reports_static_batch_when_the_bus_has_left():
    s = make(max_num_seqs=4, scheduling="static")
    s.add(seq("a"))
    step(s)
    s.add(seq("b"))
    step(s)
    assert s.num_running == 1 and s.waiting_by_reason()["static_batch"] == 1


def test_a_decode_preempted_after_admission_found_the_seats_full_leaves_the_queue_waiting_for_blocks():
    """Without chunked prefill admission runs before the decodes: it finds the seats full,
    then a decode preempts another for a block. A seat is free by the step's end and
    blocks are short: every waiting request waits on kv_blocks, as in a chunked step."""
    s = make(max_num_seqs=2, num_blocks=4, enable_prefix_caching=False)  # 3 usable blocks of 4
    for rid in "abc":
        s.add(seq(rid))
    step(s)  # a and b take a block each for their prompts; c finds no seat
    assert s.waiting_by_reason()["max_num_seqs"] == 1
    out = s.schedule()  # a's decode takes the last block; b's finds none and b is preempted
    assert ids(out) == ["a"] and [q.request_id for q in out.preempted] == ["b"] and len(s._free_slots) == 1
    assert [(q.request_id, s.waiting.reason_of(q)) for q in s.waiting] == [("b", "kv_blocks"), ("c", "kv_blocks")]



@pytest.mark.parametrize("chunked", [False, True])
def test_a_step_reads_the_waiting_requests_it_walks_not_the_whole_queue(monkeypatch, chunked):
    """An offline batch queues every prompt at once: a step that read every waiting request
    (to record why it waits, to count the reasons for the gauges) would cost the queue's
    length, so the whole batch the square of it. Counted by the queue's reads, with
    the every-step invariant checks off (they read it all, by design)."""
    import scheduler as scheduler_mod
    from policy import FCFSQueue

    monkeypatch.setattr(scheduler_mod, "CHECK_ALL_INVARIANTS", False)
    reads = [0]

    class CountingQueue(FCFSQueue):
        def __iter__(self):
            for q in super().__iter__():
                reads[0] += 1
                yield q

        def __getitem__(self, i):
            reads[0] += 1
            return super().__getitem__(i)

    s = make(max_num_seqs=4, enable_chunked_prefill=chunked)
    s.waiting.__class__ = CountingQueue
    for i in range(2000):
        s.add(seq(f"r{i}"))
    for _ in range(30):
        reads[0] = 0
        out = s.schedule()
        by_reason = s.waiting_by_reason()
        s.update(out, [TOKEN] * len(out.scheduled))
        assert reads[0] <= 2 * (len(out.scheduled) + 1), reads[0]  # what admission walked
        assert sum(by_reason.values()) == len(s.waiting) and by_reason["max_num_seqs"] > 1900, by_reason


# ---- abort -------------------------------------------------------------------------------------
def test_abort_is_idempotent_and_frees_slot_and_blocks_at_once():
    s = make(max_num_seqs=1)
    s.add(seq("a"))
    s.add(seq("b"))
    out = s.schedule()
    assert s.abort("b").finish_reason == "abort" and s.num_waiting == 0  # from the queue
    aborted = s.abort("a")  # from the running list, between schedule() and update()
    assert aborted.status is FINISHED and aborted.slot is None and s.allocator.num_used == 0
    assert s.abort("a") is None and s.abort("never-seen") is None
    assert s.update(out, [TOKEN]).finished == [] and aborted.num_output_tokens == 0
    s.check_invariants()
    assert not s.has_unfinished()


def test_static_batch_whose_last_runner_is_aborted_is_released_by_the_next_update():
    s = make(max_num_seqs=2, scheduling="static")
    s.add(seq("a", max_tokens=1))
    s.add(seq("b", max_tokens=10))
    step(s)  # a finishes at its prefill and rides as padding
    s.abort("b")
    out = s.schedule()
    assert out.scheduled == []
    assert [r.request_id for r in s.update(out, []).finished] == ["a"] and not s.has_unfinished()


# ---- every mode, random traffic: the invariants hold and everything completes -----------------
class SchedulerMachine(RuleBasedStateMachine):
    @initialize(scheduling=st.sampled_from(["continuous", "static"]),
                kv_admission=st.sampled_from(["on-demand", "reserve", "reserve-max-len"]),
                chunked=st.booleans(), max_num_seqs=st.integers(1, 4), block_size=st.sampled_from([1, 2, 4]),
                max_model_len=st.integers(8, 24), spare_blocks=st.integers(0, 4), budget_extra=st.integers(0, 16),
                prefix_caching=st.booleans())
    def setup(self, scheduling, kv_admission, chunked, max_num_seqs, block_size, max_model_len, spare_blocks,
              budget_extra, prefix_caching):
        # Just enough blocks for one max_model_len sequence, plus a few: preemption is common.
        num_blocks = blocks_needed(max_model_len, block_size) + 1 + spare_blocks
        floor = max_num_seqs if chunked else max_model_len
        self.s = make(max_num_seqs, block_size, max_model_len, num_blocks, scheduling=scheduling,
                      kv_admission=kv_admission, enable_chunked_prefill=chunked,
                      max_num_batched_tokens=floor + budget_extra, enable_prefix_caching=prefix_caching)
        self.seqs: list[Sequence] = []
        self.released: list[Sequence] = []

    @rule(prompt_len=st.integers(1, 23), max_tokens=st.integers(1, 23))
    def add(self, prompt_len, max_tokens):
        # Long sequences in a small cache: on-demand must preempt.
        prompt_len = min(prompt_len, self.s.config.max_model_len - 1)
        max_tokens = min(max_tokens, self.s.config.max_model_len - prompt_len)
        self.seqs.append(seq(f"r{len(self.seqs)}", prompt_len, max_tokens))
        self.s.add(self.seqs[-1])

    @rule(tokens=st.lists(st.integers(EOS, 15), min_size=4, max_size=4), abort_mid_step=st.integers(-1, 3))
    def step(self, tokens, abort_mid_step):
        cfg = self.s.config
        riding = [r.request_id for r in self.s.running]
        out = self.s.schedule()
        assert sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
        kinds = [x.seq.is_decode for x in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "decodes come first"
        for x in out.scheduled:  # blocks are allocated for this step's tokens, before it runs
            seq = x.seq
            lifetime = self.s.kv_admission.lifetime_tokens(seq.num_prompt_tokens, seq.params.max_tokens, cfg)
            covered = seq.num_computed_tokens  # schedule() advanced it past this step's tokens
            if cfg.kv_admission == "on-demand":  # as it goes (static boards a whole prompt's worth)
                lo, hi = covered, covered if cfg.scheduling == "continuous" else max(covered, seq.num_tokens)
            else:  # everything it will ever hold, from admission
                lo = hi = lifetime
            held = len(seq.block_table)
            assert blocks_needed(lo, cfg.block_size) <= held <= blocks_needed(hi, cfg.block_size), seq.request_id
        if cfg.scheduling == "static" and riding:  # the bus admits nobody while it runs
            assert {r.request_id for r in self.s.running} <= set(riding)
            assert {x.seq.request_id for x in out.scheduled} <= set(riding)
        if 0 <= abort_mid_step < len(out.scheduled):
            self.released.append(self.s.abort(out.scheduled[abort_mid_step].seq.request_id))
        aboard = [r.request_id for r in self.s.running]
        sampled = [tokens[x.seq.slot or 0] for x in out.scheduled]
        released = self.s.update(out, sampled).finished
        if cfg.scheduling == "static" and released:  # ... and releases its batch together
            assert [r.request_id for r in released] == aboard and not self.s.running
        self.released += released

    @rule(index=st.integers(0, 30))
    def abort(self, index):
        if index < len(self.seqs):
            aborted = self.s.abort(self.seqs[index].request_id)
            if aborted is not None:
                self.released.append(aborted)

    @invariant()
    def blocks_and_slots_are_accounted_for(self):
        if not hasattr(self, "s"):
            return
        self.s.check_invariants()  # free + used == usable, no block owned twice, one distinct slot each
        for r in self.released:
            assert r.status is FINISHED and r.slot is None and not r.block_table
            assert not self.s.allocator.blocks_of(r.request_id)
        assert all(r.status is RUNNING for r in self.s.running) or self.s.config.scheduling == "static"
        assert all(r.status is WAITING for r in self.s.waiting)

    def teardown(self):
        if hasattr(self, "s"):
            run_all(self.s, max_steps=2_000)
            assert all(r.finish_reason is not None for r in self.seqs)


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_the_suite_checks_the_block_leak_invariant_every_step():
    """tests/conftest.py turns on the per-step global invariant checks that production skips;
    a block held by no running sequence then fails the very next update()."""
    import scheduler as scheduler_mod

    assert scheduler_mod.CHECK_ALL_INVARIANTS, "tests/conftest.py sets TAXIRANK_CHECK_INVARIANTS=1"
    s = make()
    s.add(seq("a"))
    step(s)
    s.allocator.allocate("ghost", 1)  # a block in use that no running sequence holds
    out = s.schedule()
    with pytest.raises(AssertionError, match="KV block leaked"):
        s.update(out, [TOKEN] * len(out.scheduled))


def test_the_leak_check_is_off_in_a_process_without_the_flag():
    code = ("import scheduler; assert not scheduler.CHECK_ALL_INVARIANTS")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TAXIRANK_CHECK_INVARIANTS"}
    subprocess.run([sys.executable, "-c", code], cwd=root, env={**env, "PYTHONPATH": str(root)}, check=True)


def test_fcfs_a_prompt_chunk_short_of_a_block_preempts_the_latest_admitted_even_when_its_decode_is_in_the_step():
    """vLLM V1 (vllm/v1/core/sched/scheduler.py) steps through its running requests in
    admission order and preempts the last (self.running.pop()): B, admitted after A. Here
    decodes are scheduled first, so B's decode is in the step when A's chunk finds no block:
    B's row is taken back and B preempted, not A preempting itself."""
    cfg = EngineConfig(max_num_seqs=2, block_size=4, max_model_len=32, enable_prefix_caching=False,
                       enable_chunked_prefill=True, max_num_batched_tokens=8,
                       long_prefill_token_threshold=4).resolved(32)
    s = Scheduler(cfg, 6, (0,))  # 5 usable blocks
    a = Sequence("A", list(range(1, 17)), SamplingParams(max_tokens=4))
    b = Sequence("B", list(range(21, 25)), SamplingParams(max_tokens=8))
    s.add(a)
    s.add(b)
    for _ in range(3):
        out = s.schedule()
        assert not out.preempted
        s.update(out, [7] * len(out.scheduled))
    out = s.schedule()  # A's last chunk needs a 5th block, B's decode took the 4th
    assert [q.request_id for q in out.preempted] == ["B"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("A", 4)]
    assert out.num_decode_tokens == 0 and b.num_output_placeholders == 0 and b.num_preemptions == 1
    s.update(out, [7] * len(out.scheduled))
    s.check_invariants()
