"""vLLM's semantics where a vLLM user would expect them, and the engine's defence in depth:
SamplingParams defaults and normalisation, exact reserve admission, the CPU KV default,
one request's failure ending that request alone, LLM.generate validating before adding."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import re

import numpy as np
import pytest

from async_engine import AsyncEngine
from config import EngineConfig
from engine import EngineRequest, LLMEngine, QueueFullError, child_requests
from kvcache import CPU_DEFAULT_KV_BYTES, kv_cache_bytes_per_block, num_kv_blocks_for
from llm import LLM
from model import ModelConfig
from policy import Fair
from sampling_params import SamplingParams
from scheduler import Scheduler
from sequence import Sequence

SMALL = dict(model="tiny", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64, warmup=False)


def quiet(*_: object) -> None:
    pass


def test_sampling_params_defaults_and_normalisation_are_vllms() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.greedy
    assert SamplingParams(top_k=0).top_k == -1 and SamplingParams(temperature=0).greedy
    # vLLM's __post_init__ raises a temperature in (0, 0.01) to 0.01: only 0 is greedy
    assert not SamplingParams(temperature=1e-6).greedy
    # vLLM's _verify_args (and OpenAI's range): at most 2, with vLLM's message
    assert SamplingParams(temperature=2).temperature == 2
    with pytest.raises(ValueError, match=re.escape("temperature must be in [0, 2], got 2.0001.")):
        SamplingParams(temperature=2.0001)
    for bad in (dict(seed=1.5), dict(seed=True), dict(max_tokens=True), dict(temperature=float("nan")),
                dict(top_p=float("inf")), dict(temperature=10**400), dict(top_k=-2), dict(stop_token_ids=[1.0]),
                dict(stop_token_ids=5), dict(stop_token_ids="12"), dict(ignore_eos="no"), dict(ignore_eos=None),
                dict(skip_special_tokens=5), dict(spaces_between_special_tokens=None),
                dict(include_stop_str_in_output=1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=(3,)).stop_token_ids == (3,)
    # vLLM's __post_init__ reads True as 1 (its bool is an int); a vLLM user writes logprobs=True
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)


def test_chunked_prefill_is_on_by_default_and_the_flag_turns_it_off() -> None:
    from cli_args import build_parser

    assert EngineConfig().enable_chunked_prefill
    assert build_parser().parse_args([]).enable_chunked_prefill
    assert not build_parser().parse_args(["--no-enable-chunked-prefill"]).enable_chunked_prefill
    assert build_parser().parse_args([]).model == "smollm2"


def test_reserve_holds_exactly_the_blocks_a_sequence_can_write() -> None:
    """The last sampled token is never computed: 16 prompt tokens + max_tokens 1 at block
    size 16 is one block; + max_tokens 2 is two."""
    for admission, max_tokens, blocks in [("reserve", 1, 1), ("reserve", 2, 2), ("reserve", 17, 2),
                                          ("reserve-max-len", 1, 2)]:
        cfg = EngineConfig(max_num_seqs=2, block_size=16, max_model_len=33, max_num_batched_tokens=64,
                           kv_admission=admission).resolved(4096)
        s = Scheduler(cfg, 10, eos_token_ids=())
        s.add(Sequence("a", list(range(1, 17)), SamplingParams(max_tokens=max_tokens)))
        s.schedule()
        assert len(s.running[0].block_table) == blocks, (admission, max_tokens)


def test_cpu_kv_default_is_a_budget_not_max_num_seqs_times_max_model_len() -> None:
    big = ModelConfig("llama", vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=16,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)
    cfg = EngineConfig(max_num_seqs=4, max_model_len=32768).resolved(big.max_model_len)
    per_block = kv_cache_bytes_per_block(big, 16, np.float32)
    assert num_kv_blocks_for(cfg, big, np.float32, 0) == CPU_DEFAULT_KV_BYTES // per_block + 1  # 4 GiB, not 4 x 32768
    small_need = EngineConfig(max_num_seqs=2, max_model_len=256).resolved(big.max_model_len)
    assert num_kv_blocks_for(small_need, big, np.float32, 0) == 2 * 16 + 1  # never more than can be used
    too_long = EngineConfig(max_num_seqs=1).resolved(big.max_model_len)  # one 131,072-token sequence: 8 GiB
    with pytest.raises(ValueError, match="one sequence of max_model_len 131072 needs"):
        num_kv_blocks_for(too_long, big, np.float32, 0)


def test_generate_validates_every_prompt_before_adding_any() -> None:
    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"})
    with pytest.raises(ValueError, match="prompt 2: token id 100000"):
        llm.generate([[5, 6], [7, 8], [100000]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="prompt 0: token id 1.5"):
        llm.generate([[1.5]], SamplingParams(max_tokens=2))


def test_generate_refuses_what_is_not_a_prompt_or_sampling_params_before_adding_any() -> None:
    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"})
    for params in ({"max_tokens": 2}, [None], "x"):
        with pytest.raises(TypeError, match="expected SamplingParams"):
            llm.generate([[5, 6]], params)
    for prompt in (b"abc", None, 7.5):
        with pytest.raises(TypeError, match="a prompt is a string or a list of token ids"):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    for prompts in (None, 7, b"abc"):  # not a prompt, nor an iterable of prompts
        with pytest.raises(TypeError, match="prompts must be a string, a list of token ids or a list of such"):
            llm.generate(prompts, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="priority must be a list"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), priority=5)
    # A bad prompt fails before its n samples (the most SamplingParams takes) are made or queued.
    with pytest.raises(ValueError, match="prompt 0: token id 100000"):
        llm.generate([[100000]], SamplingParams(max_tokens=2, n=2**14))
    assert not llm.engine.has_unfinished()
    # vLLM's: a single string is one prompt (not one prompt per character).
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    one = llm.generate("hello", greedy)
    assert len(one) == 1 and one[0].prompt == "hello"
    assert one[0].outputs[0].token_ids == llm.generate(["hello"], greedy)[0].outputs[0].token_ids
    text = llm.generate({"prompt": "hello"}, greedy)  # so is vLLM's prompt dict (TextPrompt, TokensPrompt)
    assert [(o.prompt, o.outputs[0].token_ids) for o in text] == [("hello", one[0].outputs[0].token_ids)]
    tokens = llm.generate([{"prompt_token_ids": llm.tokenizer.encode("hello"), "prompt": "hello"}], greedy)
    assert [(o.prompt, o.outputs[0].token_ids) for o in tokens] == [("hello", one[0].outputs[0].token_ids)]
    ids = llm.generate([5, 6], greedy)  # so is a list of token ids
    assert len(ids) == 1 and ids[0].prompt_token_ids == [5, 6]
    assert ids[0].outputs[0].token_ids == llm.generate([[5, 6]], greedy)[0].outputs[0].token_ids
    # a generator of prompts is read once: every prompt gets its output
    outs = llm.generate((p for p in ["hello", [5, 6]]), greedy)
    assert [o.prompt for o in outs] == ["hello", None] and all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_numpy_values_in_sampling_params_and_prompts_are_their_python_values() -> None:
    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"})
    plain = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, seed=11, stop_token_ids=[9], ignore_eos=True,
                           logit_bias={7: 2.5})
    arrays = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3), seed=np.uint64(11),
                            stop_token_ids=np.array([9]), ignore_eos=np.bool_(True),
                            logit_bias={np.int64(7): np.float32(2.5)})
    assert arrays == plain and type(arrays.max_tokens) is int and type(arrays.ignore_eos) is bool
    want = llm.generate([[5, 6]], plain)[0].outputs[0].token_ids
    assert llm.generate(np.array([[5, 6]]), arrays)[0].outputs[0].token_ids == want
    assert llm.generate([[5, 6]], plain, priority=[np.int64(0)])[0].outputs[0].token_ids == want
    assert llm.generate([[5, 6]], plain, priority=np.array([0]))[0].outputs[0].token_ids == want
    for bad in ({"max_tokens": np.float64(4.0)}, {"stop_token_ids": np.array([[1, 2]])}):
        with pytest.raises(ValueError, match="must be"):  # a float count, a nested list: refused as their lists
            SamplingParams(**bad)


def test_any_64_bit_seed_and_huge_top_k_run() -> None:
    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"})
    outs = llm.generate([[5, 6]] * 4, [SamplingParams(max_tokens=4, seed=s, top_k=k, ignore_eos=True)
                                       for s, k in [(-1, 2**40), (2**32 - 1, 0), (2**63 - 1, -1), (-(2**63), 7)]])
    for seed in (2**63, -(2**63) - 1):  # vLLM's range, offline as over HTTP
        with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
            SamplingParams(seed=seed)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2  # vLLM's: -1 is no seed
    assert SamplingParams(seed=None).seed is None


def test_a_failure_preparing_one_request_ends_it_alone(monkeypatch) -> None:
    prompts = {f"r{i}": [5 + i, 6, 7] for i in range(3)}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(poison: str | None) -> tuple[dict[str, list[int]], list[str]]:
        eng = LLMEngine(EngineConfig(**SMALL), log=quiet)
        real = eng.runner.execute

        def execute(out):  # a fault in one request's inputs, before the device runs
            if any(s.seq.request_id == poison for s in out.scheduled):
                raise OverflowError("bad input for " + str(poison))
            return real(out)
        monkeypatch.setattr(eng.runner, "execute", execute)
        for rid, p in prompts.items():
            eng.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        failed = []
        for _ in range(50):
            if not eng.has_unfinished():
                break
            for d in eng.step():
                tokens[d.request_id] += d.new_token_ids
                if d.finish_reason == "error":  # its last delta, reported once, with what it failed with
                    assert d.finished and d.new_token_ids == [] and isinstance(d.error, OverflowError), d
                    failed.append(d.request_id)
                else:
                    assert d.error is None, d
        eng.scheduler.check_invariants()
        assert eng.scheduler.allocator.num_used == 0
        # vLLM's finished_reason "error" for the one that failed, not "abort" (no client ended it)
        assert eng.stats.snapshot().request_success == {"stop": 0, "length": 3 - len(failed), "abort": 0,
                                                        "error": len(failed)}
        return tokens, failed

    clean, none = run(None)
    got, failed = run("r1")
    assert none == [] and failed == ["r1"] and got["r1"] == []
    assert got["r0"] == clean["r0"] and got["r2"] == clean["r2"]  # the others are served as if nothing happened


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failure_in_the_step_after_a_request_ended_ends_only_the_failing_one(monkeypatch, async_scheduling) -> None:
    """Under async scheduling a step is scheduled while the one before it runs: a request
    that a stop token ends in that earlier step still has a row in it. When the step then
    fails on another request's inputs, the ended request is no culprit (it has no slot to
    run alone in): the failing request ends with "error", the others as they would."""
    def run(poison_at: int | None, stops: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, str]]:
        eng = LLMEngine(EngineConfig(**SMALL, async_scheduling=async_scheduling), log=quiet)
        real = eng.runner.execute

        def execute(out):
            if any(s.seq.request_id == "poison" for s in out.scheduled):
                raise OverflowError("bad input")
            return real(out)
        monkeypatch.setattr(eng.runner, "execute", execute)
        for rid, prompt in (("a", [5, 6, 7]), ("b", [9, 3]), ("c", [4, 4, 8, 1])):
            eng.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=stops.get(rid)))
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        for i in range(50):
            if i == poison_at:
                eng.add_request("poison", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
            if not eng.has_unfinished() and (poison_at is None or i > poison_at):
                break
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
                if d.finished:
                    assert d.request_id not in reasons, d  # one last delta per request
                    reasons[d.request_id] = d.finish_reason
        eng.scheduler.check_invariants()
        assert eng.scheduler.allocator.num_used == 0
        return tokens, reasons

    greedy, _ = run(None, {})
    # each request stopped by a token it samples (not known when its next step is scheduled)
    stops = {rid: [t[k]] for rid, t, k in (("a", greedy["a"], 1), ("b", greedy["b"], 2), ("c", greedy["c"], 3))
             if t[k] not in t[:k]}
    assert len(stops) >= 2, greedy
    clean, clean_reasons = run(None, stops)
    assert [clean_reasons[r] for r in stops] == ["stop"] * len(stops)
    for at in range(5):
        got, reasons = run(at, stops)
        assert reasons == clean_reasons | {"poison": "error"}, (at, reasons)
        assert {k: got[k] for k in clean} == clean and got.get("poison", []) == [], at


def test_a_failure_on_the_row_of_a_request_that_ended_meanwhile_ends_nothing(monkeypatch) -> None:
    """Under async scheduling a request's next step is scheduled while the step that ends it
    runs. When preparing that next step fails on the ended request's own row, the culprit
    has gone (its row runs nowhere) and every other row runs alone: the engine serves
    them as if nothing happened, rather than dying. Under the fair policy the row that ran
    nowhere is no service: its client's counter is one output token below the clean run's,
    where that row ran (and was discarded)."""
    prompts = {"a": [5, 6, 7], "b": [9, 3], "c": [4, 4, 8, 1]}
    fired = [0]
    counters: list[dict[str, float]] = []

    def run(stops: dict[str, list[int]], poison: bool) -> tuple[dict[str, list[int]], dict[str, str]]:
        eng = LLMEngine(EngineConfig(**SMALL, async_scheduling=True, scheduling_policy="fair"), log=quiet)
        real = eng.runner.execute

        def execute(out):  # a's row in the step after its last token (scheduled while that token was in flight)
            if poison and any(s.seq.request_id == "a" and s.seq.num_output_placeholders == 2
                              and len(s.seq.output_token_ids) == 1 for s in out.scheduled):
                fired[0] += 1
                raise OverflowError("bad input")
            return real(out)
        monkeypatch.setattr(eng.runner, "execute", execute)
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        stop_token_ids=stops.get(rid)), user=rid)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        reasons: dict[str, str] = {}
        while eng.has_unfinished():
            for d in eng.step():
                tokens[d.request_id] += d.new_token_ids
                if d.finished:
                    reasons[d.request_id] = d.finish_reason
        eng.scheduler.check_invariants()
        assert eng.scheduler.allocator.num_used == 0
        counters.append(dict(eng.scheduler.policy.counters))
        return tokens, reasons

    greedy, _ = run({}, False)
    stops = {"a": [greedy["a"][1]]}  # a ends on its second token
    assert greedy["a"][1] != greedy["a"][0]
    clean = run(stops, False)
    assert clean[1]["a"] == "stop" and clean[0]["a"] == greedy["a"][:2]
    assert run(stops, True) == clean
    assert fired[0] == 1  # the failure happened, once: a's row ran nowhere after it
    assert counters[-1] == counters[-2] | {"a": counters[-2]["a"] - Fair.output_weight}, counters[-2:]


def fail_request(monkeypatch, eng, request_id: str) -> None:
    """eng's runner raises for every step holding request_id, before the device runs (a fault
    in that request's inputs)."""
    real = eng.runner.execute

    def execute(out):
        if any(s.seq.request_id == request_id for s in out.scheduled):
            raise OverflowError("bad input")
        return real(out)
    monkeypatch.setattr(eng.runner, "execute", execute)


@pytest.mark.parametrize("config", [dict(async_scheduling=True), dict(async_scheduling=False),
                                    # the second prompt boards beside the first without a row (no budget left)
                                    dict(scheduling="static", max_num_batched_tokens=40)])
def test_a_request_that_failed_alone_leaves_no_cached_prefix_it_never_computed(monkeypatch, config) -> None:
    """The full blocks a prompt chunk completes are named in the prefix cache when its step
    is scheduled, and a request admitted later in that step already shares them. A request
    that fails alone computed nothing in that step: the request that shared its blocks then,
    and one with its prompt afterwards, each compute the prompt instead of reading K/V
    nobody wrote. Their logprobs are the prompt's on an engine without prefix caching."""
    prompt = [5 + (7 * i) % 200 for i in range(40)]  # two full blocks of 16, and a partial one
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(eng: LLMEngine, rids: list[str]) -> dict[str, tuple[list[int], list[float], str]]:
        for rid in rids:  # admitted in one step (the budget takes both prompts but the shared blocks)
            eng.add_request(rid, prompt, params)
        got: dict[str, tuple[list[int], list[float], str]] = {rid: ([], [], "") for rid in rids}
        while eng.has_unfinished():
            for d in eng.step():
                tokens, lps, _ = got[d.request_id]
                got[d.request_id] = (tokens + d.new_token_ids, lps + [x.logprob for x in d.new_logprobs or ()],
                                     d.finish_reason or "")
        return got

    ref = run(LLMEngine(EngineConfig(**SMALL, enable_prefix_caching=False), log=quiet), ["ref"])["ref"]
    eng = LLMEngine(EngineConfig(**{**SMALL, **config}), log=quiet)
    fail_request(monkeypatch, eng, "bad")
    got = run(eng, ["bad", "shared"]) | run(eng, ["later"])
    assert got.pop("bad") == ([], [], "error")
    for rid, (tokens, lps, reason) in got.items():
        assert (tokens, reason) == (ref[0], ref[2]), rid
        assert lps == pytest.approx(ref[1], abs=1e-4), rid
    eng.scheduler.check_invariants()
    assert eng.scheduler.allocator.num_used == 0


def test_a_row_that_ran_nowhere_is_no_service_and_its_rerun_waits_for_no_kv_blocks(monkeypatch) -> None:
    """Under the fair policy a client is charged for the tokens computed for it. A request
    that fails alone computed nothing, and the request that shared its blocks in that step
    computes its prompt once, in the step after: each client's counter is the service it
    got (prompt_weight per prompt token, output_weight per output token), and while the
    rerun waits for that step nothing has refused it KV blocks (no wait reason yet)."""
    eng = LLMEngine(EngineConfig(**SMALL, scheduling_policy="fair", async_scheduling=False), log=quiet)
    fail_request(monkeypatch, eng, "bad")
    prompt = [5 + (7 * i) % 200 for i in range(40)]  # two full blocks of 16, and a partial one
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    # admitted in one step: "shared" reads the two blocks "bad" was to compute
    eng.add_request("bad", prompt, params, user="x")
    eng.add_request("shared", prompt, params, user="y")
    ends = {d.request_id: d.finish_reason for d in eng.step() if d.finished}
    assert ends == {"bad": "error"}
    assert [q.request_id for q in eng.scheduler.waiting] == ["shared"] and not eng.scheduler.running
    snap = eng.stats.snapshot()
    assert snap.num_requests_waiting == 1 and sum(snap.waiting_by_reason.values()) == 0, snap.waiting_by_reason
    tokens = 0
    while eng.has_unfinished():
        tokens += sum(len(d.new_token_ids) for d in eng.step())
    assert tokens == 3
    fair = eng.scheduler.policy
    assert fair.counter("x") == 0
    assert fair.counter("y") == fair.prompt_weight * len(prompt) + fair.output_weight * 3


def test_a_broken_runner_still_kills_the_loop_when_its_requests_share_a_prefix(monkeypatch) -> None:
    """Every step fails, whatever it holds: no request is to blame, so step() raises. The
    second request shares blocks the first was to compute in the same step; it still runs
    alone (and fails), so its failure counts as the engine's."""
    eng = LLMEngine(EngineConfig(**SMALL), log=quiet)

    def execute(out):
        raise RuntimeError("the runner is broken")
    monkeypatch.setattr(eng.runner, "execute", execute)
    prompt = [5 + (7 * i) % 200 for i in range(40)]
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="the runner is broken"):
        eng.step()


@pytest.mark.parametrize("prompt_len", [10, 40])  # 40: the second sample shares the first's blocks
def test_the_n_samples_of_one_bad_request_end_it_alone_and_the_engine_serves_on(monkeypatch, prompt_len) -> None:
    """Every row of the step fails alone, but they are the n samples of one request: that
    request is the culprit, not the engine. Each sample ends with "error"; the next request
    is served."""
    eng = LLMEngine(EngineConfig(**SMALL), log=quiet)
    real = eng.runner.execute
    bad = [5 + (7 * i) % 200 for i in range(prompt_len)]

    def execute(out):  # a fault in the bad prompt's inputs, before the device runs
        if any(s.seq.prompt_token_ids == bad for s in out.scheduled):
            raise OverflowError("bad input")
        return real(out)
    monkeypatch.setattr(eng.runner, "execute", execute)
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
    request = eng.validate(EngineRequest("r", bad, params))
    for rid, p, parent in child_requests("r", dataclasses.replace(params, n=2)):
        eng.enqueue(dataclasses.replace(request, request_id=rid, params=p, parent=parent))
    ends = {}
    while eng.has_unfinished():
        ends |= {d.request_id: d.finish_reason for d in eng.step() if d.finished}
    assert ends == {"0_r": "error", "1_r": "error"}
    eng.add_request("next", [7, 8, 9], params)
    tokens = []
    while eng.has_unfinished():
        tokens += [t for d in eng.step() for t in d.new_token_ids]
    assert len(tokens) == 3
    eng.scheduler.check_invariants()
    assert eng.scheduler.allocator.num_used == 0


def test_generate_raises_for_a_request_that_failed_and_leaves_nothing_running(monkeypatch) -> None:
    """Offline there is no stream to end: LLM.generate aborts the other prompts and raises,
    naming the request and what it failed with; the engine serves the next call."""
    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"})
    real = llm.engine.runner.execute
    thresholds = []

    def execute(out):  # a fault in one request's inputs, before the device runs
        thresholds.append(gc.get_threshold())
        if any(s.seq.prompt_token_ids == [9, 9] for s in out.scheduled):
            raise OverflowError("bad input")
        return real(out)
    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"request offline-\d+ failed: OverflowError\('bad input'\)"):
        llm.generate([[5, 6], [9, 9], [7, 8]], params)
    # (a step may still be in flight: the next step() collects it, its rows discarded)
    assert not llm.engine.scheduler.has_unfinished() and llm.engine.scheduler.allocator.num_used == 0
    assert len(llm.generate([[5, 6]], params)[0].outputs[0].token_ids) == 4
    # The call's steps ran with no full collection due (the oldest generation's threshold
    # raised), and every call, the failed one too, put the caller's thresholds back.
    mine = gc.get_threshold()
    assert thresholds and all(t[:2] == mine[:2] and t[2] >= 10**9 > mine[2] for t in thresholds)
    gc.set_threshold(mine[0], mine[1], mine[2] + 1)  # a caller's own change is what comes back
    try:
        llm.generate([[5, 6]], params)
        assert gc.get_threshold() == (mine[0], mine[1], mine[2] + 1)
    finally:
        gc.set_threshold(*mine)

    # An interrupt (Ctrl-C) in a step's preparation propagates as it is; the call's requests
    # are aborted (the next call would otherwise wait forever on their tokens), and the full
    # blocks that step named were never written: no later prompt may hit them.
    def interrupted(out):
        raise KeyboardInterrupt
    monkeypatch.setattr(llm.engine.runner, "execute", interrupted)
    prompt = list(range(10, 50))  # two full blocks of 16, named when scheduled
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt, [5, 6]], greedy)
    monkeypatch.setattr(llm.engine.runner, "execute", real)
    assert llm.engine.scheduler.num_running == llm.engine.scheduler.num_waiting == 0
    assert llm.engine.scheduler.allocator.num_used == 0
    real_enqueue = llm.engine.enqueue

    def enqueue(request):  # an interrupt while the call adds its samples: none stays queued
        if not request.request_id.startswith("0_"):
            raise KeyboardInterrupt
        return real_enqueue(request)
    monkeypatch.setattr(llm.engine, "enqueue", enqueue)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6]], SamplingParams(n=3, max_tokens=4, seed=0, ignore_eos=True))
    monkeypatch.setattr(llm.engine, "enqueue", real_enqueue)
    assert not llm.engine.has_unfinished()
    again = llm.generate([prompt], greedy)[0]
    assert again.num_cached_tokens == 0
    assert llm.reset_prefix_cache()
    assert again.outputs[0].token_ids == llm.generate([prompt], greedy)[0].outputs[0].token_ids
    # The same for an interrupt while the step is prepared (drafts proposed, blocks swapped).
    assert llm.reset_prefix_cache()
    eng = llm.engine
    eng.add_request("prepared", prompt, greedy)
    out = eng.scheduler.schedule()

    def swap(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(eng.runner, "swap", swap)
    out.swap_in.append(([], []))  # a copy to make: _prepare calls runner.swap
    with pytest.raises(KeyboardInterrupt):
        eng._prepare(out)
    eng.abort("prepared")
    assert eng.scheduler.allocator.num_used == 0
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 0


@pytest.mark.parametrize("where", ["dispatch", "result"])
def test_an_interrupt_while_an_async_step_is_in_flight_leaves_nothing_behind(monkeypatch, where) -> None:
    """Async scheduling keeps step N on the device while step N+1 is dispatched: Ctrl-C may
    land while N+1 is dispatched (N in flight) or while the host waits for a step's tokens
    (where it mostly waits). Either way generate() raises it as it is, its requests end,
    every KV block comes back, and the next call gets the tokens of a run never interrupted,
    prefix-cache hits included (its blocks hold what they are named for)."""
    import runner_output

    llm = LLM(log=quiet, **{k: v for k, v in SMALL.items() if k != "model"}, block_size=16,
              enable_prefix_caching=True)
    eng = llm.engine
    assert eng.config.async_scheduling
    # 64 tokens a step: the first step runs the 40-token prompt and 24 of the 50-token one, the
    # second the rest of it, naming two full blocks its forward writes.
    prompts = [list(range(10, 50)), list(range(60, 110)), [5, 6, 7]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert llm.reset_prefix_cache()
    calls = [0]
    if where == "dispatch":  # the second step's dispatch, the first still in flight
        real = eng.runner.execute

        def execute(out):
            calls[0] += 1
            if calls[0] == 2:
                assert eng._in_flight, "the first step should be in flight"
                raise KeyboardInterrupt
            return real(out)
        monkeypatch.setattr(eng.runner, "execute", execute)
    else:  # waiting for the second step's tokens (the step ran; its update never happens)
        real = runner_output.InFlightStep.result

        def result(self):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            return real(self)
        monkeypatch.setattr(runner_output.InFlightStep, "result", result)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy)
    assert calls[0] == 2
    monkeypatch.undo()
    # (a step may still be in flight: the next step() collects it, its rows discarded)
    while eng.has_unfinished():
        assert eng.step() == []
    eng.scheduler.check_invariants()
    assert eng.scheduler.allocator.num_used == 0
    got = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == want
    assert eng.scheduler.allocator.num_used == 0
    # What the interrupted call's steps wrote is named and read only where it was written.
    again = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in again] == want and again[0].num_cached_tokens >= 32


def test_max_waiting_requests_counts_requests_not_yet_scheduled() -> None:
    async def go() -> None:
        eng = AsyncEngine(EngineConfig(max_waiting_requests=2, **SMALL), log=quiet)
        # The loop thread is not started: everything handed over is still unscheduled.
        eng.add_request(EngineRequest("a", [5], SamplingParams(max_tokens=2)))
        eng.add_request(EngineRequest("b", [5], SamplingParams(max_tokens=2)))
        with pytest.raises(QueueFullError):
            eng.add_request(EngineRequest("c", [5], SamplingParams(max_tokens=2)))
        eng._drain_inbox()  # now in the scheduler's waiting queue: still not scheduled
        with pytest.raises(QueueFullError):
            eng.add_request(EngineRequest("c", [5], SamplingParams(max_tokens=2)))
        eng.engine.step()  # both scheduled: room again
        eng.add_request(EngineRequest("c", [5], SamplingParams(max_tokens=2)))
    asyncio.run(go())


def test_a_request_static_batching_holds_after_its_last_token_ends_as_an_abort_when_aborted() -> None:
    # Static: a finished sequence keeps its seat (padding) and its result until the batch is
    # done; a client that leaves before then got nothing: an abort, counted once, no latency.
    eng = LLMEngine(EngineConfig(**SMALL, scheduling="static", async_scheduling=False), log=quiet)
    short = eng.add_request("short", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_request("long", [7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    while len(short.output_token_ids) < 2:
        assert not [d for d in eng.step() if d.finished]
    last = eng.abort("short")
    assert last is not None and last.finished and last.finish_reason == "abort" and eng.abort("short") is None
    done = []
    while eng.has_unfinished():
        done += [(d.request_id, d.finish_reason) for d in eng.step() if d.finished]
    st = eng.stats
    assert done == [("long", "length")]
    assert st.request_success["length"] == 1 and st.request_success["abort"] == 1
    assert sum(st.request_success.values()) == 2
    assert st.e2e_request_latency.count == 1


def test_decode_output_drops_the_eos_that_ended_it() -> None:
    from engine import decode_output
    from tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = [*b"hi", tok.eos_token_id]
    assert decode_output(tok, ids, SamplingParams(), (tok.eos_token_id,)) == "hi"
    assert decode_output(tok, ids, SamplingParams(skip_special_tokens=False), (tok.eos_token_id,)) == "hi"
    mid = [*b"a", tok.bos_token_id, *b"b"]
    assert decode_output(tok, mid, SamplingParams(skip_special_tokens=False)) == "a<|bos|>b"
    ignored = dataclasses.replace(SamplingParams(), ignore_eos=True)
    assert decode_output(tok, ids, ignored, (tok.eos_token_id,)) == "hi"  # skipped as special anyway
