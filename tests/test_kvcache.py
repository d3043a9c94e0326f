"""The block allocator's invariants and the KV cache's sizing arithmetic."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import fresh_step_programs
from config import EngineConfig
from kvcache import (BlockAllocator, OutOfBlocksError, blocks_needed, create_kv_caches, describe,
                     kv_cache_bytes_per_block, measure_activation_bytes, num_kv_blocks_for)
from sampling_params import SamplingParams

# Only the attributes kvcache reads from model.ModelConfig.
CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
# The unit of the sizing tests: the bytes one block of 16 tokens really takes, measured.
PER_BLOCK_F32 = sum(k.nbytes + v.nbytes for k, v in create_kv_caches(CFG, 1, 16, jnp.float32))


def config(**kw) -> EngineConfig:
    return EngineConfig(**{"max_model_len": 256, "max_num_seqs": 4, **kw}).resolved(4096)


# ---- allocator --------------------------------------------------------------------------
def test_the_null_block_is_never_handed_out():
    a = BlockAllocator(5)
    assert a.num_usable == 4
    assert sorted(a.allocate("r", 4)) == [1, 2, 3, 4]
    assert a.num_free == 0 and a.usage == 1.0


def test_allocate_appends_to_the_owners_list_and_free_returns_them_all_once():
    a = BlockAllocator(8)
    first = a.allocate("r", 2)
    second = a.allocate("r", 3)
    assert a.blocks_of("r") == first + second
    assert a.num_used == 5
    assert a.free("r") == 5
    assert a.free("r") == 0  # idempotent
    assert a.num_free == 7 and a.blocks_of("r") == []
    a.check_invariants()


def test_allocating_more_than_is_free_is_a_clear_error_that_changes_nothing():
    a = BlockAllocator(4)
    a.allocate("r", 2)
    assert not a.can_allocate(2) and a.can_allocate(1)
    with pytest.raises(OutOfBlocksError, match="needs 2 KV blocks, only 1 of 3 are free"):
        a.allocate("s", 2)
    assert a.num_free == 1 and a.blocks_of("s") == []
    a.check_invariants()


def test_fewer_than_two_blocks_is_refused():
    with pytest.raises(ValueError, match="null block"):
        BlockAllocator(1)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(2, 20),
       ops=st.lists(st.tuples(st.booleans(), st.sampled_from("abcd"), st.integers(0, 6)), max_size=40))
def test_random_allocate_and_free_keep_every_invariant(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    held: dict[str, int] = {}
    for is_alloc, owner, n in ops:
        if is_alloc:
            if a.can_allocate(n):
                assert len(a.allocate(owner, n)) == n
                held[owner] = held.get(owner, 0) + n
            else:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(owner, n)
        else:
            assert a.free(owner) == held.pop(owner, 0)
        a.check_invariants()
        assert a.num_used == sum(held.values())
    for owner in list(held):
        a.free(owner)
    assert a.num_free == a.num_usable  # nothing leaked


# ---- sizing -------------------------------------------------------------------------------
def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bytes_per_block_are_what_the_created_cache_takes(dtype):
    """On a real model config whose head_dim (32) is not hidden_size / heads (16), GQA with
    one KV head: the sizing arithmetic equals the nbytes of the arrays created."""
    import transformers
    from conftest import _BASE, FAMILIES

    from model import ModelConfig

    cfg = ModelConfig.from_hf(transformers.Qwen3Config(**{**_BASE, **FAMILIES["qwen3"][1]}).to_dict())
    assert cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads
    caches = create_kv_caches(cfg, num_blocks=5, block_size=16, dtype=dtype)
    k, v = caches
    assert k.shape == v.shape == (cfg.num_hidden_layers, 5, 16, cfg.num_key_value_heads, cfg.head_dim)
    assert 5 * kv_cache_bytes_per_block(cfg, 16, dtype) == sum(x.nbytes for x in jax.tree.leaves(caches))
    assert kv_cache_bytes_per_block(cfg, 16, jnp.dtype(dtype).name) == kv_cache_bytes_per_block(cfg, 16, dtype)


def test_num_kv_blocks_is_taken_as_given():
    assert num_kv_blocks_for(config(num_kv_blocks=100), CFG, jnp.float32, weight_bytes=0) == 100


def test_kv_cache_memory_buys_whole_blocks_plus_the_null_block():
    cfg = config(kv_cache_memory=40 * PER_BLOCK_F32 + 1)
    assert num_kv_blocks_for(cfg, CFG, jnp.float32, weight_bytes=0) == 41


def test_cpu_default_holds_max_num_seqs_sequences_of_max_model_len():
    assert num_kv_blocks_for(config(), CFG, jnp.float32, weight_bytes=0) == 4 * 256 // 16 + 1


def test_gpu_budget_is_utilization_times_the_limit_minus_weights_and_activations(monkeypatch):
    limit = 1000 * PER_BLOCK_F32
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": limit})
    monkeypatch.setattr(jax, "devices", lambda: [device])
    cfg = config(gpu_memory_utilization=0.5)
    got = num_kv_blocks_for(cfg, CFG, jnp.float32, weight_bytes=100 * PER_BLOCK_F32,
                            activation_bytes=50 * PER_BLOCK_F32)
    assert got == 500 - 100 - 50


def test_a_budget_below_one_max_model_len_sequence_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="gives 10 usable blocks .* max_model_len 256 needs 16: .* at most 160, "
                                         "the longest sequence it holds"):
        num_kv_blocks_for(config(num_kv_blocks=11), CFG, jnp.float32, weight_bytes=0)
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 10 * PER_BLOCK_F32})
    monkeypatch.setattr(jax, "devices", lambda: [device])
    with pytest.raises(ValueError, match="weights"):  # the weights alone exceed the budget
        num_kv_blocks_for(config(), CFG, jnp.float32, weight_bytes=20 * PER_BLOCK_F32)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_logprob_arrays_are_reserved_where_no_activation_peak_holds_them(monkeypatch, async_scheduling):
    """A step's logprob arrays (vocabulary-wide under --max-logprobs -1) are part of its
    activations: a measured peak holds them; without one (a device without counters, an
    explicit budget) they are reserved themselves. Under async scheduling the step before's
    are still on the device while a step runs: reserved once more."""
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 1000 * PER_BLOCK_F32})
    monkeypatch.setattr(jax, "devices", lambda: [device])
    weights, logprobs, more = 100 * PER_BLOCK_F32, 60 * PER_BLOCK_F32, 60 * async_scheduling
    budget = config(gpu_memory_utilization=0.5, async_scheduling=async_scheduling)
    assert num_kv_blocks_for(budget, CFG, jnp.float32, weights, logprobs_bytes=logprobs) == 500 - 100 - 60 - more
    assert num_kv_blocks_for(budget, CFG, jnp.float32, weights, 80 * PER_BLOCK_F32, logprobs_bytes=logprobs) \
        == 500 - 100 - 80 - more  # the measured peak, which holds one step's
    blocks = 861 - more  # with the weights it fits; with the arrays too, 1,021 (+ 60) blocks do not
    explicit = config(num_kv_blocks=blocks, async_scheduling=async_scheduling)
    assert num_kv_blocks_for(explicit, CFG, jnp.float32, weights) == blocks
    with pytest.raises(ValueError, match=f"--num-kv-blocks/--num-gpu-blocks-override {blocks}: .* of activations "
                                         ".* does not fit"):
        num_kv_blocks_for(explicit, CFG, jnp.float32, weights, logprobs_bytes=logprobs)


def test_the_engine_reserves_its_logprob_arrays_when_the_device_has_no_counters(monkeypatch):
    """The start-up path on a fake device that reports a limit but no counters: the KV
    budget leaves room for the logprob arrays at --max-logprobs' width."""
    from llm import LLM
    from model_loader import BUILTIN_MODELS
    from runner import logprobs_bytes

    tiny = BUILTIN_MODELS["tiny"]
    per_block = kv_cache_bytes_per_block(tiny, 16, jnp.float32)
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 4000 * per_block})
    monkeypatch.setattr(jax, "devices", lambda: [device])
    monkeypatch.setattr("startup.param_bytes", lambda model: 40 * per_block)
    kw = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, warmup=False,
              gpu_memory_utilization=0.5)
    blocks = {}
    for width in (20, -1):
        eng = LLM("tiny", log=lambda *_: None, max_logprobs=width, **kw).engine
        arrays = 2 * sum(logprobs_bytes(eng.config, tiny).values())  # async scheduling: two steps' arrays
        assert eng.num_kv_blocks == (2000 * per_block - 40 * per_block - arrays) // per_block
        blocks[width] = eng.num_kv_blocks
    assert blocks[20] - blocks[-1] > 60  # vocabulary-wide: [128, 259] ids and values, and more


def test_create_kv_caches_stacks_layers_blocks_tokens_heads_dims():
    from kernels_pallas import from_bits

    k, v = create_kv_caches(CFG, num_blocks=3, block_size=16, dtype=jnp.bfloat16)
    assert k.shape == v.shape == (CFG.num_hidden_layers, 3, 16, 4, 8) and k.dtype == jnp.bfloat16
    k, v = from_bits((k, v))  # on CPU a bf16 cache is held as its bits (kernels_pallas.as_bits)
    assert k.dtype == v.dtype == jnp.bfloat16 and not k.any() and not v.any()


@pytest.mark.parametrize("admission, concurrency, at_once", [
    ("on-demand", "2.50x (on-demand", "2.50"),  # 40 usable blocks x 16 = 640 tokens / 256
    ("reserve", "2.50x (reserve", "2.50"),
    ("reserve-max-len", "2x (reserve-max-len", "2"),  # whole max_model_len reservations only
])
def test_describe_states_blocks_tokens_memory_and_concurrency(admission, concurrency, at_once):
    line = describe(config(kv_admission=admission), CFG, 41, jnp.float32)
    assert line.startswith(f"KV cache (float32): 40 blocks x 16 tokens = 640 tokens ({41 * PER_BLOCK_F32 / 2**20:.1f} MiB); "
                           "max concurrency at max_model_len 256: ")
    assert concurrency in line and line.endswith(f"with max_num_seqs 4, sequences at once: {at_once} (KV-bound)")


# ---- the activation peak (GPU sizing), with the device's counters faked ------------------
def fake_memory_stats(before: dict, after: dict, ran: list):
    """A memory_stats source: `before` until the step has run, `after` from then on."""
    return lambda: dict(after if ran else before)


def test_activation_bytes_are_the_steps_peak_above_what_was_in_use_before():
    ran: list = []
    stats = fake_memory_stats({"bytes_in_use": 700, "peak_bytes_in_use": 750},
                              {"bytes_in_use": 710, "peak_bytes_in_use": 1000}, ran)
    profile = measure_activation_bytes(lambda: ran.append(1), stats)
    assert ran == [1]  # the step ran once, between the two readings
    assert (profile.bytes_in_use_before, profile.peak_before, profile.peak_after) == (700, 750, 1000)
    assert profile.activation_bytes == 300 and not profile.is_upper_bound
    assert profile.describe(4096).startswith("activation peak of a 4096-token step: ")


def test_a_step_below_an_earlier_peak_gives_a_safe_upper_bound():
    ran: list = []
    stats = fake_memory_stats({"bytes_in_use": 700, "peak_bytes_in_use": 2000},
                              {"bytes_in_use": 700, "peak_bytes_in_use": 2000}, ran)
    profile = measure_activation_bytes(lambda: ran.append(1), stats)
    assert profile.activation_bytes == 1300 and profile.is_upper_bound
    assert "upper bound" in profile.describe(16)


@pytest.mark.parametrize("stats", [None, {}, {"bytes_limit": 10}])
def test_no_memory_counters_means_no_measurement_and_no_step(stats):
    ran: list = []
    assert measure_activation_bytes(lambda: ran.append(1), lambda: stats) is None
    assert ran == []


def test_the_engine_sizes_the_cache_with_the_measured_activation_peak(monkeypatch):
    """The GPU start-up path, run on CPU with a fake device: the engine profiles the
    largest step on a one-sequence cache, subtracts its peak, rebuilds the cache at the
    budgeted size, and then generates exactly as an engine sized by --num-kv-blocks."""
    from llm import LLM
    from model_loader import BUILTIN_MODELS
    from runner import logprobs_bytes

    tiny = BUILTIN_MODELS["tiny"]
    per_block = kv_cache_bytes_per_block(tiny, 16, jnp.float32)
    weights, in_use, act = 40 * per_block, 50 * per_block, 30 * per_block
    calls: list = []
    ran: list = []

    def memory_stats():
        calls.append(1)
        after = len(calls) > 1  # the first reading is the one before the step
        return {"bytes_limit": 1000 * per_block, "bytes_in_use": in_use,
                "peak_bytes_in_use": in_use + (act if after else 0)}

    device = SimpleNamespace(platform="gpu", memory_stats=memory_stats)
    monkeypatch.setattr(jax, "devices", lambda: [device])
    monkeypatch.setattr("startup.param_bytes", lambda model: weights)
    import startup
    real = startup.ModelRunner

    def spy(config, loaded, num_blocks, stats, *mesh):
        ran.append(num_blocks)
        return real(config, loaded, num_blocks, stats, *mesh)

    monkeypatch.setattr(startup, "ModelRunner", spy)
    logs: list[str] = []
    kw = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128, warmup=True)
    fresh_step_programs()  # the count below is of programs this engine compiles itself
    llm = LLM("tiny", log=logs.append, gpu_memory_utilization=0.5, **kw)
    eng = llm.engine
    assert ran == [128 // 16 + 1]  # one runner, built with the one-sequence cache
    # 0.5 x limit - weights - activations, in blocks, and (async scheduling) the step before's logprob arrays
    arrays = sum(logprobs_bytes(eng.config, tiny).values())
    assert eng.num_kv_blocks == (500 * per_block - 40 * per_block - 30 * per_block - arrays) // per_block
    assert eng.runner.kv_caches[0].shape[1] == eng.num_kv_blocks  # K: [layers, blocks, ...]
    assert any("activation peak of a 128-token step: " in line for line in logs)
    # the profiling program is not counted: the served programs are a forward per bucket, the
    # one sample program and the one prompt-logprob program (the profiled step ran it too)
    cfg = eng.config
    assert eng.stats.num_compilations == len(cfg.decode_buckets) + len(cfg.token_buckets) + 2
    monkeypatch.undo()
    prompts = [[5, 6, 7, 8], list(range(3, 60))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = LLM("tiny", log=lambda *_: None, num_kv_blocks=eng.num_kv_blocks, **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [o.outputs[0].token_ids for o in ref]
