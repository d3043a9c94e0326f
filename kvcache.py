"""The paged KV cache: the block allocator (pure Python) and the device arrays.

K and V are each [num_layers, num_blocks, block_size, num_kv_heads, head_dim] (the layers
stacked for the model's scan). Block 0 of every layer is the null block: idle slots and padding tokens point at it, so it is never handed out.

JAX is imported inside the functions that size or create arrays, not at the top: the
scheduler owns a BlockAllocator and must stay importable (and testable) without JAX.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import jax

    from config import EngineConfig
    from model import ModelConfig

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free."""


class BlockAllocator:
    """Free list plus an owner map (request id -> its blocks, in block-table order).

    Every block carries a reference count. Today a block has at most one owner (count 0
    or 1); a prefix cache would share full blocks between requests by counting owners.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        # FIFO: a freed block goes to the back, so the blocks freed longest ago are reused
        # first (the eviction order a prefix cache wants for the contents they still hold).
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._owned: dict[str, list[int]] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_usable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def blocks_of(self, owner: str) -> list[int]:
        return list(self._owned.get(owner, ()))

    def allocate(self, owner: str, n: int) -> list[int]:
        """Append n fresh blocks to owner's list and return them."""
        if n > len(self._free):
            raise OutOfBlocksError(f"{owner!r} needs {n} KV blocks, only {len(self._free)} of "
                                   f"{self.num_usable} are free")
        new = [self._free.popleft() for _ in range(n)]
        for b in new:
            assert self._ref_counts[b] == 0, f"block {b} on the free list is referenced"
            self._ref_counts[b] = 1
        if new:
            self._owned.setdefault(owner, []).extend(new)
        return new

    def free(self, owner: str) -> int:
        """Return all of owner's blocks; the count returned. Freeing twice frees nothing."""
        blocks = self._owned.pop(owner, [])
        for b in blocks:
            assert self._ref_counts[b] > 0, f"block {b} freed by {owner!r} is not referenced"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
        return len(blocks)

    def check_invariants(self) -> None:
        """O(num_blocks): for tests and debugging, not for every step."""
        owned = [b for blocks in self._owned.values() for b in blocks]
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert NULL_BLOCK not in free and NULL_BLOCK not in owned, "the null block was handed out"
        assert free.isdisjoint(owned), "a block is both free and owned"
        assert len(free) + len(owned) == self.num_usable, "free + used != usable: a block leaked"
        for b in range(1, self.num_blocks):
            assert self._ref_counts[b] == (b not in free), f"block {b}: ref count {self._ref_counts[b]}"
        assert all(self._owned.values()), "an owner with no blocks is still listed"


# ---- sizing ----------------------------------------------------------------------------
def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: Any) -> int:
    import jax.numpy as jnp

    itemsize = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize


def num_kv_blocks_for(config: EngineConfig, cfg: ModelConfig, dtype: Any, weight_bytes: int,
                      activation_bytes: int = 0) -> int:
    """Total blocks (null block included) for a resolved config, from the first knob set:
    num_kv_blocks, kv_cache_memory, or (on an accelerator) gpu_memory_utilization."""
    import jax

    # Per device: under tensor parallelism each device holds 1/tp of every block (its KV
    # heads; cfg counts heads after any replication, see parallel.py), and the budgets
    # below (--kv-cache-memory, --gpu-memory-utilization, weight_bytes) are per device too.
    per_block = kv_cache_bytes_per_block(cfg, config.block_size, dtype) // config.tensor_parallel_size
    if config.num_kv_blocks is not None:
        num, source = config.num_kv_blocks, f"--num-kv-blocks {config.num_kv_blocks}"
    elif config.kv_cache_memory is not None:
        num = config.kv_cache_memory // per_block + 1
        source = f"--kv-cache-memory {config.kv_cache_memory} bytes"
    elif (dev := jax.devices()[0]).platform != "cpu":
        stats = dev.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"{dev.platform} reports no memory limit: pass --kv-cache-memory or --num-kv-blocks")
        budget = int(config.gpu_memory_utilization * stats["bytes_limit"]) - weight_bytes - activation_bytes
        num = max(budget, 0) // per_block  # the null block comes out of the same memory
        source = (f"--gpu-memory-utilization {config.gpu_memory_utilization} of {stats['bytes_limit'] / 2**30:.1f} "
                  f"GiB minus {weight_bytes / 2**30:.2f} GiB of weights and {activation_bytes / 2**30:.2f} GiB "
                  "of activations")
    else:
        # CPU with no budget given: room for max_num_seqs sequences of max_model_len.
        return config.max_num_seqs * config.max_blocks_per_seq + 1
    need = config.max_blocks_per_seq
    if num - 1 < need:
        raise ValueError(f"the KV cache budget ({source}) gives {max(num - 1, 0)} usable blocks of "
                         f"{config.block_size} tokens ({per_block} bytes each), but one sequence of max_model_len "
                         f"{config.max_model_len} needs {need}: raise the budget or lower --max-model-len")
    return num


@dataclass(frozen=True)
class ActivationProfile:
    """What one profiling step cost on the device, from the allocator's own counters.

    JAX cannot reset peak_bytes_in_use, so the peak is the process's high-water mark: if
    something before the step (loading the weights, say) already went higher, the step
    sets no new peak and `activation_bytes` is an upper bound. Likewise, the step's first
    call compiles it, and whatever the compiler allocates on the device (autotuning
    scratch) counts too. Both err on the safe side: fewer KV blocks, never an
    out-of-memory error in the first long prefill.
    """

    bytes_in_use_before: int  # weights + the small profiling cache + whatever else is live
    peak_before: int
    peak_after: int

    @property
    def activation_bytes(self) -> int:
        """The step's transient memory: its peak above what was already in use."""
        return max(self.peak_after - self.bytes_in_use_before, 0)

    @property
    def is_upper_bound(self) -> bool:
        return self.peak_after <= self.peak_before

    def describe(self, num_tokens: int) -> str:
        mib = 2**20
        bound = (" (an upper bound: the step set no new peak, an earlier allocation went higher)"
                 if self.is_upper_bound else "")
        return (f"activation peak of a {num_tokens}-token step: {self.activation_bytes / mib:.1f} MiB = peak "
                f"{self.peak_after / mib:.1f} MiB - {self.bytes_in_use_before / mib:.1f} MiB in use before{bound}")


def measure_activation_bytes(run_step: Callable[[], None],
                             memory_stats: Callable[[], Mapping[str, int] | None]) -> ActivationProfile | None:
    """Run `run_step` once (the largest step the engine will ever run, finished before it
    returns) and read the device allocator before and after. `memory_stats` is the
    source, e.g. `jax.devices()[0].memory_stats`; injected so the arithmetic is testable
    without a GPU. None when the device keeps no such counters (CPU)."""
    before = memory_stats()
    if not before or "bytes_in_use" not in before or "peak_bytes_in_use" not in before:
        return None
    run_step()
    after = memory_stats() or {}
    return ActivationProfile(int(before["bytes_in_use"]), int(before["peak_bytes_in_use"]),
                             int(after["peak_bytes_in_use"]))


def create_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """K and V, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: the
    layers stacked, as the model's scanned layer stack takes them (see model.Llama)."""
    import jax.numpy as jnp

    shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def describe(config: EngineConfig, cfg: ModelConfig, num_blocks: int, dtype: Any) -> str:
    """One start-up line: what the cache holds and how many max_model_len sequences fit."""
    usable, bs, max_len, max_seqs = num_blocks - 1, config.block_size, config.max_model_len, config.max_num_seqs
    mib = num_blocks * kv_cache_bytes_per_block(cfg, bs, dtype) / 2**20
    if config.kv_admission == "reserve-max-len":
        # Every request holds max_model_len worth of blocks: a whole number of slots.
        fit: float = usable // config.max_blocks_per_seq
        fit_text, policy = f"{fit}", f"reserve-max-len: every request reserves {config.max_blocks_per_seq} blocks"
    else:
        fit = usable * bs / max_len
        how = "blocks grow as tokens arrive" if config.kv_admission == "on-demand" else "prompt + max_tokens reserved"
        fit_text, policy = f"{fit:.2f}", f"{config.kv_admission}: {how}, shorter sequences fit more"
    at_once = f"{fit_text} (KV-bound)" if fit < max_seqs else f"{max_seqs} (slot-bound)"
    return (f"KV cache: {usable} blocks x {bs} tokens = {usable * bs} tokens ({mib:.1f} MiB); "
            f"max concurrency at max_model_len {max_len}: {fit_text}x ({policy}); "
            f"with max_num_seqs {max_seqs}, sequences at once: {at_once}")
