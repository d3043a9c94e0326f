"""Scheduling policies: the refactor changed nothing, priority does what vLLM's does, and every
policy, batching, KV admission and preemption mode keeps the scheduler's invariants (one machine)."""

from __future__ import annotations

import json

import pytest
from scheduler_traces import CASES, FIXTURE, MAX_MODEL_LEN, trace_of

with open(FIXTURE) as f:
    RECORDED = json.load(f)


@pytest.mark.parametrize("config,seed", CASES, ids=[f"{c}/{s}" for c, s in CASES])
def test_continuous_and_static_reproduce_the_recorded_step_traces(config, seed):
    """Recorded from the scheduler before the policy seam: same admissions, chunks,
    preemptions, releases, slots, blocks and wait reasons, step for step."""
    assert trace_of(config, seed) == RECORDED[f"{config}/{seed}"]


@pytest.mark.parametrize("config,seed", CASES, ids=[f"{c}/{s}" for c, s in CASES])
def test_a_long_prefill_token_threshold_that_caps_nothing_leaves_the_traces_unchanged(config, seed):
    """0 (vLLM's default) is off; with chunked prefill, a threshold no prompt (nor a
    recompute, under max_model_len) reaches changes no step."""
    assert trace_of(config, seed, long_prefill_token_threshold=0) == RECORDED[f"{config}/{seed}"]
    if "chunked" in config:
        assert trace_of(config, seed, long_prefill_token_threshold=MAX_MODEL_LEN) == RECORDED[f"{config}/{seed}"]


# ---- priority scheduling ---------------------------------------------------------------
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

from config import EngineConfig  # noqa: E402
from kvcache import blocks_needed  # noqa: E402
from policy import Priority  # noqa: E402
from sampling_params import SamplingParams  # noqa: E402
from scheduler import Scheduler  # noqa: E402
from sequence import FINISHED, WAITING, Sequence  # noqa: E402

TOKEN = 7


def make(max_num_seqs: int = 2, block_size: int = 4, max_model_len: int = 32, num_blocks: int | None = None,
         **kw) -> Scheduler:
    kw.setdefault("enable_chunked_prefill", False)  # whole-prompt steps: admissions are easy to count
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                       scheduling_policy="priority", enable_prefix_caching=False, **kw).resolved(max_model_len)
    if num_blocks is None:
        num_blocks = max_num_seqs * cfg.max_blocks_per_seq + 1
    return Scheduler(cfg, num_blocks, (0,))


def seq(rid: str, priority: int = 0, prompt_len: int = 4, max_tokens: int = 8, arrival: float = 0.0) -> Sequence:
    base = 100 * (hash(rid) % 1000)
    return Sequence(rid, list(range(base + 1, base + prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    arrival_time=arrival, priority=priority)


def run(s: Scheduler, arrivals: dict[int, list[Sequence]] | None = None, max_steps: int = 5000) -> dict[str, dict]:
    """Step to the end; per request: the step it was first scheduled, first sampled, finished."""
    arrivals = arrivals or {}
    seen: dict[str, dict] = {}
    step = 0
    while s.has_unfinished() or any(k >= step for k in arrivals):
        for q in arrivals.get(step, []):
            s.add(q)
            seen[q.request_id] = {"arrived": step}
        out = s.schedule()
        for x in out.scheduled:
            seen[x.seq.request_id].setdefault("scheduled", step)
            if x.samples:
                seen[x.seq.request_id].setdefault("first_token", step)
        for r in s.update(out, [TOKEN] * len(out.scheduled)).finished:
            seen[r.request_id]["finished"] = step
        s.check_invariants()
        step += 1
        assert step < max_steps, "no progress"
    return seen


def test_priority_is_refused_unless_the_priority_policy_is_on():
    fcfs = Scheduler(EngineConfig(max_num_seqs=2, max_model_len=32).resolved(32), 20, (0,))
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.validate([1, 2], SamplingParams(), priority=1)
    fcfs.validate([1, 2], SamplingParams(), priority=0)  # the default is fine
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs, priority, fair or slo"):
        EngineConfig(scheduling_policy="sjf")


def test_under_load_high_priority_requests_queue_and_wait_for_their_first_token_far_less():
    """2 seats, 12 low-priority requests queued first; 4 high-priority ones arrive at
    step 3 and step 20. Counted in steps, not seconds."""
    s = make(max_num_seqs=2)
    low = [seq(f"low{i}", priority=1, max_tokens=10, arrival=0) for i in range(12)]
    high = [seq(f"high{i}", priority=0, max_tokens=10, arrival=t) for i, t in enumerate((3, 3, 20, 20))]
    seen = run(s, {0: low, 3: high[:2], 20: high[2:]})
    queue = {r: v["scheduled"] - v["arrived"] for r, v in seen.items()}
    ttft = {r: v["first_token"] - v["arrived"] for r, v in seen.items()}
    hi, lo = [q.request_id for q in high], [q.request_id for q in low]
    assert max(queue[r] for r in hi) == 0  # they take a seat the step they arrive ...
    assert max(ttft[r] for r in hi) == 0
    assert sum(queue[r] for r in lo) / len(lo) > 20  # ... while the low ones queue for dozens of steps
    assert sum(s.allocator.num_used for _ in [0]) == 0
    assert all(q.status is FINISHED and q.num_output_tokens == 10 for q in low + high)
    assert sum(q.num_preemptions for q in low) >= 2 and not any(q.num_preemptions for q in high)


def test_a_preempted_request_keeps_its_place_by_priority_and_arrival():
    """The victim goes back where (priority, arrival) puts it, not to the
    front (it would jump a higher-priority request) nor to the back (behind later ones)."""
    s = make(max_num_seqs=2)
    s.add(seq("mid-early", priority=1, arrival=0))
    s.add(seq("low", priority=2, arrival=1))
    s.schedule()  # both seated
    for rid, prio, t in (("mid-late", 1, 5), ("high", 0, 6), ("low-late", 2, 7)):
        s.add(seq(rid, priority=prio, arrival=t))
    out = s.schedule()
    # high outranks low (the lowest ranked running) and takes its seat; low waits in its place
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [x.seq.request_id for x in out.scheduled] == ["high"]
    assert [q.request_id for q in s.waiting] == ["mid-late", "low", "low-late"]
    assert all(q.status is WAITING for q in s.waiting)


def test_no_preemption_when_it_would_not_make_room():
    """A waiting request outranks only a running one whose blocks are too few for it: it
    waits, and nobody is preempted for nothing."""
    s = make(max_num_seqs=3, max_model_len=32, num_blocks=11)  # 10 usable blocks of 4
    s.add(seq("big", priority=0, prompt_len=24, max_tokens=4))  # 6 blocks, and it ranks above urgent
    s.add(seq("small", priority=5, prompt_len=4, max_tokens=4))  # 1 block
    s.schedule()
    s.add(seq("urgent", priority=0, prompt_len=20, max_tokens=4, arrival=1))  # 5 blocks; 3 free + small's 1 = 4
    out = s.schedule()
    assert out.preempted == [] and "urgent" not in [x.seq.request_id for x in out.scheduled]
    assert s.waiting_by_reason()["kv_blocks"] == 1


def test_preempt_for_waiting_keeps_only_the_victims_the_admission_needs():
    """urgent needs 3 blocks and none is free. low (the lowest ranked) frees 1, not
    enough; mid frees 4, enough alone: only mid is preempted, low is not for nothing."""
    s = make(max_num_seqs=3, num_blocks=6)  # 5 usable blocks of 4
    s.add(seq("mid", priority=5, prompt_len=16))  # 4 blocks
    s.add(seq("low", priority=9))  # 1 block
    out = s.schedule()
    s.update(out, [TOKEN] * len(out.scheduled))
    assert s.allocator.num_free == 0
    s.add(seq("urgent", priority=0, prompt_len=12, max_tokens=4, arrival=1))
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["mid"]
    assert [x.seq.request_id for x in out.scheduled] == ["urgent"]
    assert [q.request_id for q in s.running] == ["low", "urgent"]
    s.update(out, [TOKEN])
    s.check_invariants()


def test_preempt_for_waiting_takes_the_lowest_ranked_victims_that_suffice():
    """urgent needs 3 blocks, none is free. The lowest ranked two (v1, v2: 1 block each)
    are not enough, so v3 (2 blocks) must go, and with it one more: v1 or v2 would do, and
    the lower ranked, v1, goes; v2 keeps running (never more victims than needed, the
    least important first)."""
    s = make(max_num_seqs=3, num_blocks=5)  # 4 usable blocks of 4
    s.add(seq("v3", priority=7, prompt_len=6))  # 2 blocks
    s.add(seq("v2", priority=8, prompt_len=2))  # 1 block
    s.add(seq("v1", priority=9, prompt_len=2))  # 1 block
    out = s.schedule()
    s.update(out, [TOKEN] * len(out.scheduled))
    assert s.allocator.num_free == 0
    s.add(seq("urgent", priority=0, prompt_len=10, max_tokens=2, arrival=1))  # 3 blocks
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["v1", "v3"]
    assert [x.seq.request_id for x in out.scheduled] == ["urgent"]
    assert [q.request_id for q in s.running] == ["v2", "urgent"]


def test_preempt_for_waiting_spares_a_victim_a_later_admissions_victim_made_unneeded():
    """6 blocks and a seat are free. u1 needs 8: b (the lowest ranked, 3 blocks) is enough
    for it; u2 then needs 2 and a seat, and only a (4 blocks) is left to take. But a alone
    frees room for both (10 blocks: 8 + 2), and a's seat leaves one for each: b keeps
    running, as it is needed by neither once a goes."""
    s = make(max_num_seqs=3, max_model_len=64, num_blocks=14)  # 13 usable blocks of 4
    s.add(seq("a", priority=8, prompt_len=14))  # 4 blocks, its next token fits
    s.add(seq("b", priority=9, prompt_len=10))  # 3 blocks, its next token fits
    out = s.schedule()
    s.update(out, [TOKEN] * len(out.scheduled))
    assert s.allocator.num_free == 6
    s.add(seq("u1", priority=0, prompt_len=30, max_tokens=2, arrival=1))  # 8 blocks
    s.add(seq("u2", priority=1, prompt_len=6, max_tokens=2, arrival=2))  # 2 blocks
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["a"]
    assert [x.seq.request_id for x in out.scheduled] == ["u1", "u2"]
    assert [q.request_id for q in s.running] == ["b", "u1", "u2"]
    s.update(out, [TOKEN] * len(out.scheduled))
    s.check_invariants()


def test_preempt_for_waiting_plans_no_admission_behind_a_requeued_victim():
    """No block and one seat are free. u1 (2 blocks) and u2 (4) outrank everyone running;
    a alone (6 blocks) makes room for both. late (priority 3) would fit in what is left
    if d (priority 3, 2 blocks) went too, but d ranks above late: requeued, it stops
    admission before late. So only a goes: d keeps running and late waits."""
    s = make(max_num_seqs=4, max_model_len=64, num_blocks=10)  # 9 usable blocks of 4
    s.add(seq("a", priority=2, prompt_len=22, arrival=0))  # 6 blocks, its next token fits
    s.add(seq("c", priority=3, prompt_len=2, arrival=1))  # 1 block
    s.add(seq("d", priority=3, prompt_len=6, arrival=2))  # 2 blocks
    out = s.schedule()
    s.update(out, [TOKEN] * len(out.scheduled))
    assert s.allocator.num_free == 0
    s.add(seq("late", priority=3, prompt_len=8, arrival=3))  # 2 blocks
    s.add(seq("u1", priority=0, prompt_len=5, max_tokens=2, arrival=4))  # 2 blocks
    s.add(seq("u2", priority=0, prompt_len=16, max_tokens=2, arrival=5))  # 4 blocks
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["a"]
    assert [x.seq.request_id for x in out.scheduled] == ["u1", "u2"]
    assert [q.request_id for q in s.running] == ["c", "d", "u1", "u2"]
    assert [q.request_id for q in s.waiting] == ["a", "late"]


def test_a_victim_is_not_admitted_again_in_the_step_that_preempted_it():
    """vLLM's rule: a step that preempts schedules no waiting request but those it made
    room for. low (10 blocks, decoding) goes for urgent (3 blocks; 1 is free). 8 blocks and
    4 tokens of the budget are left after urgent's prompt, enough for a 4-token first chunk
    of low's recompute: admitting it would drop its 40 tokens of K/V only to start again.
    It boards in the next step."""
    s = make(max_num_seqs=4, max_model_len=64, num_blocks=12, enable_chunked_prefill=True, max_num_batched_tokens=16)
    low = seq("low", priority=5, prompt_len=40)
    s.add(low)
    for _ in range(3):  # 16 + 16 + 8 tokens: its prompt is in, 10 blocks
        out = s.schedule()
        s.update(out, [TOKEN] * len(out.scheduled))
    assert s.allocator.num_free == 1 and low.is_decode
    s.add(seq("urgent", priority=0, prompt_len=12, max_tokens=4, arrival=1))
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("urgent", 12)]
    assert [q.request_id for q in s.waiting] == ["low"] and s.waiting.reason_of(low) == "kv_blocks"
    s.update(out, [TOKEN])
    s.check_invariants()
    out = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("urgent", 1), ("low", 15)]


def test_a_victims_blocks_in_the_waiting_requests_cached_prefix_make_no_room_for_it():
    """Prefix caching: the waiting request's cached prefix is the victim's own blocks, so
    preempting the victim frees them only for the request to take them back. 1 block is
    free, urgent needs 4 fresh blocks besides its 4 cached ones, and low holds those 4 and
    1 more: preempting low leaves urgent short, so low keeps running."""
    cfg = EngineConfig(max_num_seqs=3, block_size=4, max_model_len=40, scheduling_policy="priority",
                       enable_chunked_prefill=False, enable_prefix_caching=True).resolved(40)
    s = Scheduler(cfg, 11, (0,))  # 10 usable blocks
    prefix = list(range(1, 17))  # 4 full blocks
    s.add(Sequence("high", list(range(500, 515)), SamplingParams(max_tokens=8), priority=0))  # 4 blocks
    s.add(Sequence("low", prefix + [90, 91, 92], SamplingParams(max_tokens=8), priority=5))  # 5 blocks
    out = s.schedule()
    s.update(out, [7] * len(out.scheduled))
    assert s.allocator.num_free == 1
    s.add(Sequence("urgent", prefix + list(range(200, 216)), SamplingParams(max_tokens=4), priority=1))
    out = s.schedule()
    assert out.preempted == [] and [x.seq.request_id for x in out.scheduled] == ["high", "low"]
    assert [q.request_id for q in s.waiting] == ["urgent"]


def test_a_prompt_longer_than_the_budget_left_by_the_decodes_still_preempts_for_its_first_chunk():
    """Chunked prefill: four sequences decode in a budget of 8, so a waiting request's first
    chunk is at most 4 tokens; a 20-token prompt that outranks one of them takes its seat
    and prefills in chunks, rather than waiting for a whole step's budget that never comes."""
    s = make(max_num_seqs=4, max_model_len=64, enable_chunked_prefill=True, max_num_batched_tokens=8)
    for rid, prio in (("a", 0), ("b", 0), ("c", 0), ("low", 5)):
        s.add(seq(rid, priority=prio, prompt_len=2, max_tokens=30))
    for _ in range(2):
        out = s.schedule()
        s.update(out, [7] * len(out.scheduled))
    s.add(seq("urgent", priority=1, prompt_len=20, max_tokens=4, arrival=1))
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 1), ("c", 1), ("urgent", 5)]


def test_no_preemption_for_a_request_the_running_prompt_chunks_leave_no_budget_to():
    """Chunked prefill: a running prompt (that outranks urgent) takes the budget its decode
    partner leaves, every step until it is in. Preempting low for urgent would not start
    urgent any sooner: low keeps its seat and decodes beside the chunks."""
    s = make(max_num_seqs=2, max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=8)
    s.add(seq("low", priority=5, prompt_len=2, max_tokens=30))
    for _ in range(2):
        out = s.schedule()
        s.update(out, [7] * len(out.scheduled))
    s.add(seq("long", priority=0, prompt_len=80, max_tokens=4, arrival=1))
    out = s.schedule()
    s.update(out, [7] * len(out.scheduled))
    s.add(seq("urgent", priority=1, prompt_len=5, max_tokens=4, arrival=2))  # a whole budget's worth: 5 + 3 decodes
    out = s.schedule()
    assert out.preempted == [] and [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("low", 1), ("long", 7)]
    assert [(q.request_id, s.waiting.reason_of(q)) for q in s.waiting] == [("urgent", "max_num_seqs")]


def test_no_step_preempts_for_waiting_requests_it_then_does_not_admit():
    """Random traffic, seeded, under every ranked policy x chunked prefill or not x prefix
    caching (shared prompts) or not x every KV admission x swap or recompute, scheduled
    synchronously or with one step in flight (async): in every step where
    preempt_for_waiting preempted, a waiting request other than its victims was admitted."""
    import random

    for seed in range(300):
        for in_flight in (False, True):
            rng = random.Random(seed)
            policy = rng.choice(["priority", "priority", "fair", "slo"])
            chunked, caching = rng.random() < 0.7, rng.random() < 0.5
            admission = rng.choice(["on-demand", "on-demand", "reserve", "reserve-max-len"])
            mns, bs, mml = rng.randint(1, 4), rng.choice([1, 2, 4]), rng.randint(8, 24)
            cfg = EngineConfig(max_num_seqs=mns, block_size=bs, max_model_len=mml, scheduling_policy=policy,
                               enable_chunked_prefill=chunked, enable_prefix_caching=caching, kv_admission=admission,
                               max_num_batched_tokens=rng.randint(mns, mns + 8) if chunked else mml,
                               preemption_mode="swap" if admission == "on-demand" and rng.random() < 0.3 else "recompute")
            s = Scheduler(cfg.resolved(mml), blocks_needed(mml, bs) + 1 + rng.randint(0, 6), (0,),
                          num_swap_blocks=rng.randint(0, 16))
            now = [0.0]
            s.policy.clock = lambda: now[0]
            if policy == "fair":  # small enough to bind within a few steps
                s.policy.preempt_gap, s.policy.over_served_prefill = 4.0, rng.choice([1, 4, 100])
                s.policy.active_window_s = 3.0
            walked: list[list[Sequence]] = []
            plan = s.preempt_for_waiting

            def recording(out, plan=plan, walked=walked):
                k = len(out.preempted)
                plan(out)
                walked.append(out.preempted[k:])

            s.preempt_for_waiting = recording
            pending, n = None, 0
            for _ in range(60):
                now[0] += 1.0
                for _ in range(rng.choice([0, 0, 1, 2])):
                    pl = rng.randint(1, mml - 1)
                    prompt = list(range(1, pl + 1)) if rng.random() < 0.4 else [1000 * (n + 1) + j for j in range(pl)]
                    params = SamplingParams(max_tokens=rng.randint(1, mml - pl))
                    try:
                        s.validate(prompt, params)
                    except ValueError:
                        continue  # more blocks than the cache has, under a reserving admission
                    s.add(Sequence(f"r{n}", prompt, params, arrival_time=now[0], user=rng.choice([None, "a", "b"]),
                                   priority=rng.randint(-2, 2) if policy == "priority" else 0,
                                   slo_ttft=rng.choice([None, 0.5, 2.0, 10.0]) if policy == "slo" else None))
                    n += 1
                waiting = {q.request_id for q in s.waiting}
                walked.clear()
                out = s.schedule()
                victims = {v.request_id for v in (walked[0] if walked else [])}
                if victims:
                    admitted = {q.request_id for q in s.running} & waiting - victims
                    assert admitted, (seed, in_flight, policy, chunked, caching, admission, "preempted", victims)
                tokens = [0 if rng.random() < 0.08 else TOKEN for _ in out.scheduled]
                if in_flight:  # async: this step is scheduled before the previous one's update
                    if pending is not None:
                        s.update(*pending)
                    pending = (out, tokens)
                else:
                    s.update(out, tokens)
                s.check_invariants()


class PolicyMachine(RuleBasedStateMachine):
    """Random traffic under every policy (random priorities, clients, SLO targets) x
    continuous or static batching x chunked prefill or not x prefix caching or not x every
    KV admission x preemption by recompute or by swap into a host pool of 0-16 blocks, on a
    tight KV cache (fair: with its prefill share's cap and activity window small enough to bind): no slot, device block or host block leaks after any step, a swapped-in
    sequence resumes into blocks covering its tokens, the priority queue stays in (priority,
    arrival) order and admits equal priorities first come first served, and everything
    finishes."""

    @initialize(policy=st.sampled_from(["fcfs", "priority", "fair", "slo"]), static=st.booleans(),
                chunked=st.booleans(), caching=st.booleans(),
                kv_admission=st.sampled_from(["on-demand", "on-demand", "reserve", "reserve-max-len"]),
                swap=st.booleans(), swap_blocks=st.integers(0, 16), max_num_seqs=st.integers(1, 4),
                block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(8, 24),
                spare_blocks=st.integers(0, 6), max_clients=st.integers(1, 3))
    def setup(self, policy, static, chunked, caching, kv_admission, swap, swap_blocks, max_num_seqs, block_size,
              max_model_len, spare_blocks, max_clients):
        swap = swap and kv_admission == "on-demand"  # a reserving admission never preempts: nothing to swap
        num_blocks = blocks_needed(max_model_len, block_size) + 1 + spare_blocks
        cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                           scheduling_policy=policy, enable_chunked_prefill=chunked,
                           max_num_batched_tokens=max_num_seqs if chunked else max_model_len,
                           enable_prefix_caching=caching, scheduling="static" if static else "continuous",
                           kv_admission=kv_admission, preemption_mode="swap" if swap else "recompute")
        self.s = Scheduler(cfg.resolved(max_model_len), num_blocks, (0,), num_swap_blocks=swap_blocks)
        self.now = 0.0
        self.s.policy.clock = lambda: self.now  # slo reads the step count as its clock
        if policy == "fair":
            self.s.policy.max_clients = max_clients
            self.s.policy.preempt_gap = 4.0  # small: the service-gap preemptions happen within a few steps
            self.s.policy.over_served_prefill = 1  # below the budget: the prefill share's cap binds
            self.s.policy.active_window_s = 3.0  # steps: a client stays active a while after its last request
        self.seqs: list[Sequence] = []
        self.first_admitted: dict[str, float] = {}

    @rule(prompt_len=st.integers(1, 23), max_tokens=st.integers(1, 23), priority=st.integers(-2, 2),
          user=st.sampled_from([None, "a", "b", "c"]), ttft=st.sampled_from([None, 0.5, 2.0, 10.0]),
          tpot=st.sampled_from([None, 0.5, 3.0]), shared=st.booleans())
    def add(self, prompt_len, max_tokens, priority, user, ttft, tpot, shared):
        mml = self.s.config.max_model_len
        prompt_len = min(prompt_len, mml - 1)
        max_tokens = min(max_tokens, mml - prompt_len)
        n = len(self.seqs)
        prompt = list(range(1, prompt_len + 1)) if shared else [1000 * (n + 1) + j for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens)
        try:
            self.s.validate(prompt, params)
        except ValueError:
            return  # more blocks than the cache has, under a reserving admission
        pol = self.s.policy
        self.seqs.append(Sequence(f"r{n}", prompt, params, arrival_time=self.now, user=user,
                                  priority=priority if pol.uses_priority else 0,
                                  slo_ttft=ttft if pol.uses_slo else None, slo_tpot=tpot if pol.uses_slo else None))
        self.s.add(self.seqs[-1])

    @rule(eos=st.booleans())
    def step(self, eos):
        self.now += 1.0
        out = self.s.schedule()
        assert sum(x.num_new_tokens for x in out.scheduled) <= self.s.config.max_num_batched_tokens
        bs = self.s.config.block_size
        for dev, host in out.swap_in:  # back into the first blocks of a running sequence, covering its tokens
            owner = next(q for q in self.s.running if q.block_table[:len(dev)] == dev)
            assert len(dev) == len(host) and blocks_needed(owner.num_computed_tokens, bs) >= len(dev)
        for x in out.scheduled:
            self.first_admitted.setdefault(x.seq.request_id, self.now)
        self.s.update(out, [0 if eos else TOKEN] * len(out.scheduled))
        for x in out.scheduled:
            if x.samples and x.seq.first_token_time is None:
                x.seq.first_token_time = self.now

    @rule(index=st.integers(0, 30))
    def abort(self, index):
        if index < len(self.seqs):
            self.s.abort(self.seqs[index].request_id)

    @invariant()
    def nothing_leaks(self):
        if hasattr(self, "s"):
            self.s.check_invariants()

    @invariant()
    def priority_queues_in_rank_order_and_admits_equal_priorities_first_come_first_served(self):
        if not hasattr(self, "s") or self.s.policy.name != "priority":
            return
        keys = [Priority.key(q) for q in self.s.waiting]
        assert keys == sorted(keys)
        first = self.first_admitted
        for a in self.seqs:
            for b in self.seqs:
                if (a.priority == b.priority and a.arrival_order < b.arrival_order and b.request_id in first
                        and a.finish_reason != "abort" and a.request_id in first):
                    assert first[a.request_id] <= first[b.request_id]

    def teardown(self):
        if not hasattr(self, "s"):
            return
        steps = 0
        while self.s.has_unfinished():
            self.step(eos=False)
            steps += 1
            assert steps < 3000, "a request starved"
        assert self.s.allocator.num_used == 0 and len(self.s._host_free) == self.s.num_swap_blocks
        assert all(q.status is FINISHED for q in self.seqs)


PolicyMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_every_policy_batching_admission_and_preemption_mode_state_machine = PolicyMachine.TestCase


def test_priority_changes_who_runs_when_not_the_tokens():
    """The engine: low-priority requests run, high-priority ones arrive and preempt them
    (slots full); every request's greedy tokens equal the FCFS engine's."""
    import numpy as np

    from engine import LLMEngine
    from llm import LLM

    rng = np.random.default_rng(5)
    ps = [rng.integers(3, 250, rng.integers(4, 30)).tolist() for _ in range(6)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 20, 6, 9, 15, 4)]
    # test_engine.py's shapes with 2 seats: the persistent compilation cache serves most programs
    kw = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=65, warmup=False)
    fcfs = LLM("tiny", log=lambda *_: None, **kw)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(ps, params)]
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.generate(ps[:1], params[:1], priority=[1])

    engine = LLMEngine(EngineConfig(model="tiny", scheduling_policy="priority", **kw), log=lambda *_: None)
    seqs = [engine.add_request(f"low{i}", ps[i], params[i], priority=1) for i in range(3)]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(f"high{i}", ps[i], params[i], priority=-1) for i in range(3, 6)]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_preemptions >= 2  # both seats were taken from low-priority requests
    assert [s.output_token_ids for s in seqs] == expected
    high_done = max(s.finished_time for s in seqs[3:])
    assert sum(s.finished_time > high_done for s in seqs[:3]) >= 2  # the low ones mostly finish last
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("bad", ps[0], params[0], priority=True)


# ---- the waiting queue's count --------------------------------------------------------
import collections.abc  # noqa: E402

from hypothesis import given  # noqa: E402

from policy import POLICIES  # noqa: E402

QUEUE_OPS = st.lists(st.tuples(st.sampled_from(["add", "requeue", "pop_head", "remove", "wait_all"]), st.booleans(),
                               st.integers(0, 3), st.integers(0, 7)), max_size=40)
REASONS = [None, "kv_blocks", "max_num_seqs", "token_budget"]


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=QUEUE_OPS)
def test_every_policys_waiting_queue_counts_the_places_no_caller_reserved_through_any_change(name, ops):
    """What a limit on waiting requests reads (num_unreserved) and each request's wait reason,
    against a plain list of the queue's requests and a dict of their reasons: add, requeue,
    pop_head, remove and wait_all keep them, and the queue offers no container method (a
    deque's append, clear, pop...) that would change it uncounted."""
    q = POLICIES[name]().new_queue()
    model: list[Sequence] = []
    reasons: dict[str, str | None] = {}
    for i, (op, reserved, user, priority) in enumerate(ops):
        if op in ("add", "requeue"):
            s = seq(f"r{i}", priority=priority)
            s.place_reserved, s.user, s.arrival_order = reserved, f"u{user}", i
            if op == "add":
                q.add(s)
                reasons[s.request_id] = None  # no schedule() has looked at it
            else:
                q.requeue(s, REASONS[user])
                reasons[s.request_id] = REASONS[user]
            model.append(s)
        elif op == "wait_all":  # every `priority`-th request is held back, the rest wait for one reason
            held = model[::priority + 1] if user else []
            q.wait_all(REASONS[priority % 4], held)
            reasons = {s.request_id: REASONS[priority % 4] for s in model} | {s.request_id: "policy" for s in held}
        elif model and op == "pop_head":
            model.remove(q.pop_head())
        elif model:
            victim = model.pop(priority % len(model))
            q.remove(victim)
        assert sorted(id(s) for s in q) == sorted(id(s) for s in model) and len(q) == len(model)
        assert q.num_unreserved == sum(not s.place_reserved for s in model)
        assert {s.request_id: q.reason_of(s) for s in model} == {s.request_id: reasons[s.request_id] for s in model}
        counted = q.count_reasons(dict.fromkeys([*REASONS[1:], "policy"], 0))
        assert counted == {r: sum(reasons[s.request_id] == r for s in model) for r in [*REASONS[1:], "policy"]}
        q.check_invariants()
    mutable = (collections.abc.MutableSequence, collections.abc.MutableSet, collections.deque, list)
    assert not isinstance(q, mutable) and not hasattr(q, "__setitem__") and not hasattr(q, "__delitem__")
    methods = {m for m in dir(q) if not m.startswith("_") and callable(getattr(q, m))}
    assert methods <= {"add", "requeue", "pop_head", "remove", "peek", "resort", "wait_all", "reason_of",
                       "count_reasons", "check_invariants"}, methods


def test_a_decode_short_of_a_block_preempts_the_lowest_priority_request_even_one_admitted_first():
    """vLLM V1 (vllm/v1/core/sched/scheduler.py): the victim is the max of every running
    request by (priority, arrival), already in the step or not. Here the low-priority request
    was admitted first and takes the last free block for its decode; the high-priority one,
    short of a block, must take it back from it, not preempt itself."""
    s = make(max_num_seqs=2, num_blocks=4)  # 3 usable blocks of 4 tokens
    low, high = seq("low", priority=1, arrival=0), seq("high", priority=0, arrival=1)
    s.add(low)
    s.update(out := s.schedule(), [TOKEN] * len(out.scheduled))
    s.add(high)
    s.update(out := s.schedule(), [TOKEN] * len(out.scheduled))
    out = s.schedule()  # both decodes need a second block; one is free
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [x.seq.request_id for x in out.scheduled] == ["high"]
    assert low.num_preemptions == 1 and high.num_preemptions == 0
    s.check_invariants()


def test_a_prompt_chunk_short_of_a_block_preempts_a_lower_priority_decode_already_in_the_step():
    """Chunked prefill schedules the decodes first; the high-priority prompt's second chunk
    finds no block. vLLM V1 takes the lowest-priority running request, already scheduled in
    the step or not (its tokens handed back), so the high one goes on; it must not preempt
    itself step after step while the low one keeps decoding."""
    s = make(max_num_seqs=2, num_blocks=6, enable_chunked_prefill=True, max_num_batched_tokens=8)
    low, high = seq("low", priority=1, max_tokens=16, arrival=0), seq("high", priority=0, prompt_len=16,
                                                                       max_tokens=4, arrival=1)
    s.add(low)
    s.update(out := s.schedule(), [TOKEN] * len(out.scheduled))
    s.add(high)
    s.update(out := s.schedule(), [TOKEN] * len(out.scheduled))  # low decodes, high's first chunk
    computed, placeholders = low.num_computed_tokens, low.num_output_placeholders
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["low"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("high", 7)]
    assert out.num_decode_tokens == 0 and out.num_prefill_tokens == 7
    assert out.preempted_tokens == [computed] and placeholders == 0 and low.num_output_placeholders == 0
    s.update(out, [TOKEN] * len(out.scheduled))
    s.check_invariants()
    order = []
    for _ in range(100):  # each fits alone (5 blocks), so both finish
        if not s.has_unfinished():
            break
        out = s.schedule()
        order += [q.request_id for q in s.update(out, [TOKEN] * len(out.scheduled)).finished]
        s.check_invariants()
    assert order == ["high", "low"] and high.num_preemptions == 0 and low.num_preemptions == 1
    assert low.num_output_tokens == 16 and high.num_output_tokens == 4
