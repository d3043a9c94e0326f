"""The block allocator's invariants and the KV cache's sizing arithmetic."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config import EngineConfig
from kvcache import (BlockAllocator, OutOfBlocksError, blocks_needed, create_kv_caches, describe,
                     kv_cache_bytes_per_block, num_kv_blocks_for)

# Only the attributes kvcache reads from model.ModelConfig.
CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
PER_BLOCK_F32 = 2 * 2 * 16 * 4 * 8 * 4  # K and V, layers, block_size, kv heads, head_dim, bytes


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


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    assert kv_cache_bytes_per_block(CFG, 16, jnp.float32) == PER_BLOCK_F32
    assert kv_cache_bytes_per_block(CFG, 16, "bfloat16") == PER_BLOCK_F32 // 2


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
    with pytest.raises(ValueError, match="gives 10 usable blocks .* max_model_len 256 needs 16"):
        num_kv_blocks_for(config(num_kv_blocks=11), CFG, jnp.float32, weight_bytes=0)
    device = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 10 * PER_BLOCK_F32})
    monkeypatch.setattr(jax, "devices", lambda: [device])
    with pytest.raises(ValueError, match="weights"):  # the weights alone exceed the budget
        num_kv_blocks_for(config(), CFG, jnp.float32, weight_bytes=20 * PER_BLOCK_F32)


def test_create_kv_caches_lays_out_blocks_tokens_heads_dims_per_layer():
    caches = create_kv_caches(CFG, num_blocks=3, block_size=16, dtype=jnp.bfloat16)
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == v.shape == (3, 16, 4, 8) and k.dtype == jnp.bfloat16
        assert not k.any()


@pytest.mark.parametrize("admission, concurrency, at_once", [
    ("on-demand", "2.50x (on-demand", "2.50"),  # 40 usable blocks x 16 = 640 tokens / 256
    ("reserve", "2.50x (reserve", "2.50"),
    ("reserve-max-len", "2x (reserve-max-len", "2"),  # whole max_model_len reservations only
])
def test_describe_states_blocks_tokens_memory_and_concurrency(admission, concurrency, at_once):
    line = describe(config(kv_admission=admission), CFG, 41, jnp.float32)
    assert line.startswith(f"KV cache: 40 blocks x 16 tokens = 640 tokens ({41 * PER_BLOCK_F32 / 2**20:.1f} MiB); "
                           "max concurrency at max_model_len 256: ")
    assert concurrency in line and line.endswith(f"with max_num_seqs 4, sequences at once: {at_once} (KV-bound)")
