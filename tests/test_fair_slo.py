"""The fair (virtual token counter) and slo (goodput) policies, on the scheduler alone: who
is admitted first, who is preempted for whom (tests/test_policy.py's state machine runs
them under random traffic)."""

from __future__ import annotations

import json

import pytest
from conftest import fresh_step_programs, load_bench

from config import EngineConfig
from policy import ANONYMOUS
from sampling_params import SamplingParams
from scheduler import Scheduler
from sequence import Sequence

TOKEN = 7


def make(policy: str, max_num_seqs: int = 2, max_model_len: int = 64, block_size: int = 4, **kw) -> Scheduler:
    kw.setdefault("enable_chunked_prefill", False)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size, max_model_len=max_model_len,
                       scheduling_policy=policy, enable_prefix_caching=False, **kw).resolved(max_model_len)
    return Scheduler(cfg, max_num_seqs * cfg.max_blocks_per_seq + 1, (0,))


def fair_chunked(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> tuple[Scheduler, list[float]]:
    """A fair scheduler with chunked prefill and 16-token blocks, its clock now[0]."""
    s = make("fair", max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=16,
             enable_chunked_prefill=True, max_num_batched_tokens=max_num_batched_tokens)
    return s, clocked(s)


def seq(rid: str, prompt_len: int = 4, max_tokens: int = 8, arrival: float = 0.0, user: str | None = None,
        ttft: float | None = None, tpot: float | None = None) -> Sequence:
    base = 1000 * (sum(map(ord, rid)) % 100)
    return Sequence(rid, list(range(base + 1, base + prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    arrival_time=arrival, user=user, slo_ttft=ttft, slo_tpot=tpot)


def step(s: Scheduler, now: float | None = None) -> tuple[list[str], list[str]]:
    """One step; (scheduled ids, preempted ids). A sampled first token is stamped with `now`."""
    out = s.schedule()
    s.update(out, [TOKEN] * len(out.scheduled))
    for x in out.scheduled:
        if x.samples and x.seq.first_token_time is None:
            x.seq.first_token_time = now
    s.check_invariants()
    return [x.seq.request_id for x in out.scheduled], [q.request_id for q in out.preempted]


# ---- fair ------------------------------------------------------------------------------

def test_fair_seats_a_seatless_light_client_the_step_it_arrives():
    """Two seats, both the heavy client's; it queues six requests at once, the light one
    sends one at step 3. FCFS seats it after the whole flood; fair the step it arrives (it
    takes a seat from the heavy client: equal service, and heavy holds both seats), and
    with one seat each the heavy client's waiting requests do not take it back."""
    first: dict[str, dict[str, int]] = {}
    preempted: dict[str, list[str]] = {}
    for policy in ("fcfs", "fair"):
        s = make(policy)
        for i in range(6):
            s.add(seq(f"heavy{i}", max_tokens=10, user="heavy"))
        seen: dict[str, int] = {}
        preempted[policy] = []
        for t in range(200):
            if t == 3:
                s.add(seq("light", max_tokens=4, arrival=3.0, user="light"))
            scheduled, out = step(s)
            preempted[policy] += out
            for rid in scheduled:
                seen.setdefault(rid, t)
            if not s.has_unfinished():
                break
        first[policy] = seen
    assert first["fcfs"]["light"] > max(first["fcfs"][f"heavy{i}"] for i in range(6))
    assert first["fair"]["light"] == 3 and preempted["fair"] == ["heavy1"] and preempted["fcfs"] == []


def test_fair_seats_a_light_client_while_the_heavy_clients_capped_prompt_prefills_beside_its_decodes():
    """Four seats, all the heavy client's: three decode, one prefills 500 tokens at its
    prefill share of 16 a step. The budget of 64 leaves the light request 64 - 3 - 16
    tokens, not 64 - 3 - 500 (none): it takes a decode's seat at once."""
    s, now = fair_chunked(max_num_seqs=4, max_model_len=640, max_num_batched_tokens=64)
    for i in range(3):
        s.add(seq(f"heavy{i}", max_tokens=100, user="heavy"))
    step(s)
    step(s)
    s.add(seq("long", prompt_len=500, max_tokens=4, user="heavy"))
    step(s)
    step(s)
    s.add(seq("light", prompt_len=20, max_tokens=4, user="light"))
    scheduled, preempted = step(s)
    assert len(preempted) == 1 and preempted[0].startswith("heavy") and "light" in scheduled


def test_fair_preempts_a_client_served_far_more_and_charges_prompt_and_output_tokens():
    s = make("fair", max_model_len=512, max_num_batched_tokens=512)
    s.add(seq("light0", max_tokens=2, user="light"))
    while s.has_unfinished():
        step(s)
    light = s.policy.counters["light"]
    assert light == 4 * 1.0 + 2 * 2.0  # 4 prompt tokens at weight 1, 2 output tokens at weight 2
    for i in range(2):
        s.add(seq(f"heavy{i}", prompt_len=200, max_tokens=300, user="heavy"))
    for _ in range(250):  # both seats busy, nobody waiting: the heavy client's counter grows
        step(s)
    assert s.policy.counters["heavy"] > light + s.policy.preempt_gap
    s.add(seq("light1", max_tokens=2, user="light"))
    scheduled, preempted = step(s)
    assert preempted == ["heavy1"] and "light1" in scheduled  # the later of the heavy client's two
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_used == 0


def test_fair_prefill_share_caps_an_over_served_clients_prompts_only_while_the_light_client_has_a_request():
    """Chunked prefill, 4 seats, a 64-token budget: a heavy client keeps its seats full of
    long prompts. Alone it gets the whole budget a step. While a light client (2+ seats
    fewer) has a request in the system, the heavy client's prompt tokens a step are at most
    over_served_prefill; the light request's
    prompt is computed in its admission step. Once the light request has left, the heavy
    client has the budget again at once, though the light client is still within the window."""
    s, now = fair_chunked(4, 512, 64)
    cap = s.policy.over_served_prefill
    for i in range(12):
        s.add(seq(f"heavy{i}", prompt_len=300, max_tokens=40, user="heavy"))

    def heavy_prompt_tokens() -> tuple[int, dict[str, int]]:
        now[0] += 0.01
        out = s.schedule()
        by = {x.seq.request_id: x.num_new_tokens for x in out.scheduled}
        n = sum(x.num_new_tokens for x in out.scheduled if x.seq.user == "heavy" and not x.is_decode)
        s.update(out, [TOKEN] * len(out.scheduled))
        s.check_invariants()
        return n, by

    alone = [heavy_prompt_tokens()[0] for _ in range(30)]  # it fills all 4 seats
    assert max(alone) > cap and len(s.running) == 4  # no other client: uncapped
    s.add(seq("light", prompt_len=20, max_tokens=3, arrival=now[0], user="light"))
    n, by = heavy_prompt_tokens()
    assert by.get("light") == 20 and n <= cap  # its whole prompt, and at most a capped heavy share beside it
    during = []
    while any(q.user == "light" for q in [*s.running, *s.waiting]):
        during.append(heavy_prompt_tokens()[0])
    assert during and max(during) <= cap
    assert now[0] < s.policy.active_window_s + 0.4  # the light client is still within the window, yet:
    after = [heavy_prompt_tokens()[0] for _ in range(3)]
    assert max(after) > cap  # nothing of it in the system: the budget is the heavy client's again
    while s.has_unfinished():
        heavy_prompt_tokens()
    assert s.allocator.num_used == 0


def test_fair_over_served_clients_seated_prompt_finishes_under_a_steady_stream_of_other_clients():
    """The prefill share is work-conserving: an over-served client's seated prompt gets up to
    over_served_prefill tokens every step while budget is left, however many other clients'
    requests arrive, so it finishes within prompt_len / over_served_prefill steps or so."""
    s, now = fair_chunked(8, 4096, 256)
    for i in range(3):
        s.add(seq(f"heavy{i}", prompt_len=50, max_tokens=3000, user="heavy"))
    s.add(seq("heavyP", prompt_len=800, max_tokens=10, user="heavy"))
    step(s)
    heavy_p = next(q for q in s.running if q.request_id == "heavyP")
    bound = 800 // s.policy.over_served_prefill + 4
    for k in range(bound):
        now[0] += 0.05
        s.add(seq(f"light{k}", prompt_len=16, max_tokens=2, arrival=now[0], user=f"l{k}"))
        step(s)
        assert "heavy" in s.policy.over_served or heavy_p.num_computed_tokens >= 800
    assert heavy_p.num_computed_tokens >= 800  # its prompt done (a sampled token after it)


def test_fair_admission_walks_past_a_request_the_prefill_share_holds_back():
    """A capped client's request at the head of the queue, its share used up by its own
    seated prompts, waits with reason "policy"; the request behind it is admitted (free
    seats, budget left), and nobody is preempted for an admission that does not happen."""
    s, now = fair_chunked(6, 512, 64)
    s.add(seq("B0", prompt_len=40, max_tokens=5, user="B"))
    s.add(seq("B1", prompt_len=300, max_tokens=5, user="B"))
    step(s)  # B0's prompt and B1's first chunk: B holds 2 seats, B1 with prompt work left
    s.add(seq("B2", prompt_len=40, max_tokens=5, user="B"))
    s.add(seq("C0", prompt_len=8, max_tokens=5, user="C"))
    s.policy.counters["B"] = s.policy.counter("C") - 5000  # B least served: its request heads the queue
    now[0] += 0.01
    scheduled, preempted = step(s)
    assert s.waiting.peek().request_id == "B2" and s.waiting.reason_of(s.waiting.peek()) == "policy"
    assert "C0" in scheduled and not preempted
    while s.has_unfinished():
        now[0] += 0.01
        step(s)
    assert s.allocator.num_used == 0


def test_fair_does_not_preempt_for_a_request_whose_prompt_share_is_used_up():
    """preempt_for_waiting does not size a capped client's head request with a room admit()
    will not give it: no running sequence is preempted for a seat that then stays empty."""
    s, now = fair_chunked(6, 1024, 64)
    for i in range(4):
        s.add(seq(f"B{i}", prompt_len=8, max_tokens=500, user="B"))
    s.add(seq("A0", prompt_len=8, max_tokens=500, user="A"))
    for _ in range(3):
        now[0] += 0.01
        step(s)
    s.add(seq("A1", prompt_len=900, max_tokens=5, user="A"))
    for _ in range(2):
        now[0] += 0.01
        step(s)
    s.add(seq("A2", prompt_len=40, max_tokens=5, user="A"))
    s.add(seq("C0", prompt_len=8, max_tokens=5, user="C"))
    s.policy.counters["A"] = min(s.policy.counters.values()) - 5000  # A least served
    for _ in range(4):
        now[0] += 0.01
        seated = len(s.running)
        scheduled, preempted = step(s)
        assert not preempted or len(s.running) >= seated  # a preempted seat is taken by an admission
    while s.has_unfinished():
        now[0] += 0.01
        step(s)
    assert s.allocator.num_used == 0


def test_fair_requests_without_a_user_share_one_client_and_the_tracked_clients_are_bounded():
    s = make("fair", max_num_seqs=4)
    s.policy.max_clients = 3
    s.add(seq("a", user=None))
    s.add(seq("b", user=None))
    step(s)
    assert list(s.policy.counters) == [ANONYMOUS]
    for i in range(6):
        s.add(seq(f"u{i}", user=f"user{i}"))
        step(s)
        assert len(s.policy.counters) <= 3
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_used == 0


def test_fair_remembers_a_long_user_name_by_its_digest_one_client_per_name():
    """A client picks its `user`'s length and the policy remembers names after their requests
    leave: a long name is kept as its SHA-256 (hashlib's, computed here), so equal long names
    are one client and each remembered name is short."""
    import hashlib

    s = make("fair", max_num_seqs=4)
    long_a, long_b = "a" * 1_000_000, "a" * 999_999 + "b"
    for rid, user in (("x", long_a), ("y", long_a), ("z", long_b), ("w", "short")):
        s.add(seq(rid, user=user))
    step(s)
    digest = "sha256:" + hashlib.sha256(long_a.encode()).hexdigest()
    assert sorted(s.policy.counters) == sorted([digest, "sha256:" + hashlib.sha256(long_b.encode()).hexdigest(),
                                                "short"])
    step(s)
    assert s.policy.seats[digest] == 2  # (seats as the step began: after the first step's admissions)
    while s.has_unfinished():
        step(s)
    assert max(map(len, s.policy.counters)) <= 128 and s.allocator.num_used == 0


# ---- slo -------------------------------------------------------------------------------

def clocked(s: Scheduler) -> list[float]:
    """The policy reads now[0] as its clock."""
    now = [0.0]
    s.policy.clock = lambda: now[0]
    return now


def test_slo_admits_earliest_deadline_first_and_requests_that_missed_theirs_last():
    s = make("slo", max_num_seqs=1)
    now = clocked(s)
    s.add(seq("loose", ttft=100.0, arrival=0.0))
    s.add(seq("missed", ttft=1.0, arrival=0.0))
    s.add(seq("tight", ttft=20.0, arrival=1.0))
    s.add(seq("none", arrival=0.0))  # no target: never urgent, never lost
    now[0] = 5.0  # "missed" can no longer make its first token in time
    order = []
    while s.has_unfinished():
        for rid in step(s, now[0])[0]:
            if rid not in order:
                order.append(rid)
    assert order == ["tight", "loose", "none", "missed"]


def test_slo_preempts_a_running_request_that_missed_its_target_for_one_that_can_still_make_it():
    s = make("slo", max_num_seqs=1)
    now = clocked(s)
    s.add(seq("late", ttft=1.0, max_tokens=20))
    now[0] = 2.0
    step(s, now[0])  # its first token at 2.0: past its 1.0 target
    s.add(seq("fresh", ttft=5.0, arrival=2.0))
    scheduled, preempted = step(s, now[0])
    assert preempted == ["late"] and scheduled == ["fresh"]
    s.add(seq("fresh2", ttft=50.0, arrival=2.0))
    while s.has_unfinished():  # "late" still finishes, after those that could make it
        step(s, now[0])
    assert s.allocator.num_used == 0


def test_slo_is_refused_under_a_policy_that_does_not_read_it():
    import pytest

    from sampling_params import SLOTarget

    fcfs = make("fcfs")
    with pytest.raises(ValueError, match="does not read it"):
        fcfs.validate([1, 2], SamplingParams(), slo=SLOTarget(ttft_ms=100))
    make("slo").validate([1, 2], SamplingParams(), slo=SLOTarget(ttft_ms=100))
    with pytest.raises(ValueError, match="slo_ttft_ms is set"):
        EngineConfig(slo_ttft_ms=100)
    with pytest.raises(ValueError, match="slo.tpot_ms must be a number > 0"):
        SLOTarget(tpot_ms=0)


def test_fair_and_slo_change_who_runs_when_not_the_tokens():
    """The engine under each policy, two seats, a tight KV cache (preemptions), users and
    SLOs: every request's greedy tokens equal FCFS's."""
    import numpy as np

    from engine import LLMEngine
    from sampling_params import SLOTarget

    rng = np.random.default_rng(5)
    ps = [rng.integers(3, 250, rng.integers(4, 30)).tolist() for _ in range(6)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 6, 9, 15, 4)]
    kw = dict(model="tiny", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=6,
              warmup=False)
    tokens = {}
    for policy in ("fcfs", "fair", "slo"):
        engine = LLMEngine(EngineConfig(scheduling_policy=policy, **kw), log=lambda *_: None)
        extra = [{} if policy == "fcfs" else {"user": "heavy" if i < 3 else f"light{i}"} if policy == "fair"
                 else {"slo": SLOTarget(ttft_ms=1e-3 if i < 3 else 1e6)} for i in range(6)]
        seqs = [engine.add_request(f"r{i}", ps[i], params[i], **extra[i]) for i in range(6)]
        while engine.has_unfinished():
            engine.step()
        tokens[policy] = [s.output_token_ids for s in seqs]
        assert engine.scheduler.allocator.num_used == 0
        if policy == "slo":  # the first three missed their first-token target at once: they go last
            start = [s.first_scheduled_time for s in seqs]
            assert max(start[3:]) <= min(start[:3])
    assert tokens["fair"] == tokens["slo"] == tokens["fcfs"]


def test_the_simulator_gives_the_slo_policy_its_simulated_clock():
    """One seat, 1 s of simulated time a step. Four batch requests (2 tokens, 100 s target)
    at t=0, four interactive ones (1 token, 6 s target) at t=0.5. FCFS serves the batch
    first and every interactive request misses; slo seats them as the first batch request
    leaves, and all eight meet their targets (goodput 8 against 4)."""
    from conftest import load_bench

    sim = load_bench("simulate")
    prompt = list(range(1, 9))
    work = [sim.SimRequest(0.0, prompt, 2, cls="batch", slo_ttft_s=100.0) for _ in range(4)]
    work += [sim.SimRequest(0.5, prompt, 1, cls="interactive", slo_ttft_s=6.0) for _ in range(4)]
    cm = sim.CostModel({"decode": (1.0, 0, 0, 0), "ragged": (1.0, 0, 0, 0)}, "unit")
    met = {}
    for policy in ("fcfs", "slo"):
        cfg = EngineConfig(max_num_seqs=1, max_model_len=16, scheduling_policy=policy).resolved(16)
        res = sim.simulate(cfg, 3, work, cm)
        met[policy] = sum(r["ttft_s"] <= (6.0 if r["class"] == "interactive" else 100.0) for r in res.per_request)
    assert met == {"fcfs": 4, "slo": 8}


def test_the_recipe_for_a_policy_whose_order_moves_runs_as_written():
    """docs/ARCHITECTURE.md's second policy recipe (priority with aging), taken from the doc
    and run: a low-priority request that has waited 30 s outranks a fresh high-priority
    one (ranks move while requests wait: the queue is resorted as each step begins)."""
    from test_recipes import DOC, recipe_code

    from policy import POLICIES

    exec(compile(recipe_code("Adding a scheduling policy whose order moves"), str(DOC), "exec"), {"__name__": "recipe"})
    try:
        s = make("aging", max_num_seqs=1)
        now = clocked(s)
        s.add(seq("busy", max_tokens=40))
        step(s)
        old, new = seq("old", arrival=0.0), seq("new", arrival=0.0)
        old.priority, new.priority = 1, -1
        s.add(old)
        s.add(new)
        step(s)
        assert [q.request_id for q in s.waiting] == ["new", "old"]  # at t=0 priority decides
        now[0] = 30.0  # both waited 30 s, three levels each: "new" (-4) still ahead of "old" (-2)
        step(s)
        assert [q.request_id for q in s.waiting] == ["new", "old"]
        late = seq("late", arrival=30.0)
        late.priority = -1
        s.add(late)
        step(s)  # "old", low priority but long waiting (-2), ahead of a fresh high-priority one (-1)
        assert [q.request_id for q in s.waiting] == ["new", "old", "late"]
        while s.has_unfinished():
            step(s)
    finally:
        POLICIES.pop("aging")


def test_swap_preemption_compiles_nothing_after_warm_up():
    """The KV copy programs are compiled at warm-up, one pair per power-of-two block count a
    step can move; a tight cache that swaps many times then compiles nothing."""
    from engine import LLMEngine

    fresh_step_programs()  # the copy programs compiled by this warm-up, not an earlier engine's
    engine = LLMEngine(EngineConfig(model="tiny", max_num_seqs=4, max_model_len=128, num_kv_blocks=14,
                                    max_num_batched_tokens=128, preemption_mode="swap", swap_space=0.01,
                                    async_scheduling=False), log=lambda *_: None)
    warm = engine.stats.num_compilations
    for i in range(8):
        engine.add_request(f"r{i}", [3 + (7 * i + j) % 250 for j in range(30 + i)],
                           SamplingParams(max_tokens=60, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.swapped_out_blocks > 0 and engine.stats.recomputed_tokens == 0
    assert engine.stats.num_compilations == warm


def test_bench_policies_refuses_zero_repeats_at_the_flag(capsys):
    """bench/policies.py takes the median of --repeats runs: 0 is an argparse error, not an IndexError."""
    with pytest.raises(SystemExit) as e:
        load_bench("policies").main(["--repeats", "0", "--simulate", "gpu-like"])
    assert e.value.code == 2 and "argument --repeats: wants an integer >= 1" in capsys.readouterr().err


def test_bench_policies_swap_verdict_is_na_where_recompute_never_preempted(tmp_path):
    """Workload 3 compares swap with recompute under preemption: at sizes where the recompute
    run never preempts there is nothing to compare, and the verdict says so, not PASS."""
    load_bench("policies").main(["--simulate", "gpu-like", "--scale", "0.25", "--long", "16", "--out", str(tmp_path)])
    w3 = json.loads((tmp_path / "results.json").read_text())["preemption"]
    assert w3["recompute"]["preemptions"] == 0
    swap_row = next(line for line in (tmp_path / "policies.md").read_text().splitlines()
                    if line.startswith("| 3 tight KV | swap"))
    assert swap_row.rstrip(" |").endswith("n/a"), swap_row
