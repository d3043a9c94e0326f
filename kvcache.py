"""The paged KV cache: the block allocator (pure Python) and the device arrays.

K and V are each [num_layers, num_blocks, block_size, num_kv_heads, head_dim] (the layers
stacked for the model's scan). Block 0 of every layer is the null block: idle slots and padding tokens point at it, so it is never handed out.

JAX is imported inside the functions that size or create arrays, not at the top: the
scheduler owns a BlockAllocator and must stay importable (and testable) without JAX.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from config import EngineConfig, flag_name
from policy import KV_ADMISSION

if TYPE_CHECKING:
    import jax

    from model import ModelConfig

NULL_BLOCK = 0


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra_key: object = None) -> bytes:
    """The name of a full block: SHA-256 over its parent's name, its token ids and an
    extra key (anything besides the tokens that must part blocks: a request's cache_salt,
    on its first block). Chaining the parent makes the name stand for the whole prefix
    (and the first block's extra key), so equal names mean equal prefixes and a hit needs
    no token comparison.

    Why a cryptographic hash: two different prefixes with one name would silently serve
    one request the other's K/V. Python's 64-bit hash() can be collided on purpose by a
    client; finding a SHA-256 collision is not feasible (vLLM's --prefix-caching-hash-algo
    sha256 makes the same argument). Cost: about a microsecond per block."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(repr(extra_key).encode())
    return h.digest()


class OutOfBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free."""


class BlockAllocator:
    """The block pool: reference counts, an owner map (request id -> its blocks, in
    block-table order), and the prefix cache (vLLM V1's design, as in nano-vllm).

    Prefix cache: a full block can be given a name (`hash_block_tokens`, chained over the
    prefix) once its K/V is written or being written in the scheduled step. A named block
    is shared: every sequence whose prefix has the same names references it (ref count =
    number of owners). A block nobody references is *free* but keeps its contents and
    its name; it waits in the free queue and still serves hits until its memory is handed
    out again (lazy eviction). The free queue is the eviction order, front first:
    unnamed blocks (nothing worth keeping) at the front, then named blocks, least recently
    freed first; a sequence frees its blocks tail first, so its last blocks (least likely
    shared) go before its first. `enable_caching=False` never names a block: a plain free
    list.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # An ordered dict as a doubly linked list: O(1) pop at the front (eviction),
        # append at the back (free), and removal from the middle (a hit revives a block).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._owned: dict[str, list[int]] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks  # a block's name
        self._cached: dict[bytes, int] = {}  # name -> block (the inverse of _block_hash)
        self._num_named: dict[str, int] = {}  # owner -> leading blocks already offered a name
        self.num_evictions = 0  # cached blocks whose memory was handed out again

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks no sequence references, cached ones included: all can be handed out."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence; a shared block counts once."""
        return self.num_usable - len(self._free)

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or free (the prefix cache's size)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_usable

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def blocks_of(self, owner: str) -> list[int]:
        return list(self._owned.get(owner, ()))

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- prefix cache ----------------------------------------------------------------
    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The blocks named block_hashes[0], [1], ... up to the first name not cached:
        the longest cached prefix. Changes nothing (see share)."""
        if not self.enable_caching:
            return []
        out = []
        for h in block_hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_revived(self, blocks: Sequence[int]) -> int:
        """How many of these cached blocks are free: sharing them takes them out of the
        free queue, so admission must count them like fresh blocks."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def share(self, owner: str, blocks: Sequence[int]) -> None:
        """Append cached blocks (a cached_prefix result) to owner's list, one reference each."""
        for b in blocks:
            assert self._block_hash[b] is not None, f"block {b} is not cached"
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
        if blocks:
            lst = self._owned.setdefault(owner, [])
            assert self._num_named.get(owner, 0) == len(lst), "share only a prefix"
            lst.extend(blocks)
            self._num_named[owner] = len(lst)

    def num_named(self, owner: str) -> int:
        """owner's leading blocks already offered a name (cache_blocks names the rest)."""
        return self._num_named.get(owner, 0)

    @property
    def named_counts(self) -> Mapping[str, int]:
        """owner -> num_named(owner) (absent: 0), read only: for a loop over every running
        sequence, a dict lookup instead of a call each."""
        return self._num_named

    def cache_blocks(self, owner: str, block_hashes: Sequence[bytes]) -> None:
        """Name owner's first len(block_hashes) blocks (those not named yet), i.e. its full
        blocks whose K/V is computed or computed in the step being scheduled. A name
        already held by another block stays there: this block stays unnamed (it holds
        the same K/V, and a name has one block)."""
        if not self.enable_caching:
            return
        blocks = self._owned.get(owner, [])
        assert len(block_hashes) <= len(blocks), "naming blocks that are not allocated"
        for i in range(self._num_named.get(owner, 0), len(block_hashes)):
            b, h = blocks[i], block_hashes[i]
            if h not in self._cached and self._block_hash[b] is None:
                self._block_hash[b] = h
                self._cached[h] = b
        self._num_named[owner] = max(self._num_named.get(owner, 0), len(block_hashes))

    def uncache_from(self, owner: str, first: int) -> None:
        """Take the names off owner's blocks from its `first` on: the step that was to
        compute their K/V ran nowhere (its request failed alone), so no request may share
        them. Its blocks from `first` on are its own: a prefix-cache hit is a prefix."""
        for b in self._owned.get(owner, [])[first:]:
            self._unname(b)
        if self._num_named.get(owner, 0) > first:
            self._num_named[owner] = first

    def _unname(self, b: int) -> bool:
        """Block b loses its prefix-cache name, if it has one (True: it had)."""
        if (h := self._block_hash[b]) is None:
            return False
        del self._cached[h]
        self._block_hash[b] = None
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every name (after a weight update, or to benchmark a cold cache). As
        vLLM, it fails (False, nothing changed) while any block is in use."""
        if self.num_used:
            return False
        for b in self._cached.values():
            self._block_hash[b] = None
        self._cached.clear()
        return True

    # ---- allocate / free -------------------------------------------------------------
    def allocate(self, owner: str, n: int) -> list[int]:
        """Append n fresh blocks to owner's list and return them. A cached free block
        handed out loses its name here (the lazy eviction)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"{owner!r} needs {n} KV blocks, only {len(self._free)} of "
                                   f"{self.num_usable} are free")
        new = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            assert self._ref_counts[b] == 0, f"block {b} on the free list is referenced"
            if self._unname(b):  # evict
                self.num_evictions += 1
            self._ref_counts[b] = 1
            new.append(b)
        if new:
            self._owned.setdefault(owner, []).extend(new)
        return new

    def free(self, owner: str) -> int:
        """Drop owner's references; the count returned. Freeing twice frees nothing.
        Blocks left unreferenced join the free queue, tail first (see the class doc)."""
        blocks = self._owned.pop(owner, [])
        self._num_named.pop(owner, None)
        for b in reversed(blocks):
            assert self._ref_counts[b] > 0, f"block {b} freed by {owner!r} is not referenced"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:
                    self._free.move_to_end(b, last=False)
        return len(blocks)

    def free_tail(self, owner: str, keep: int) -> None:
        """Give back owner's blocks past its first `keep`: blocks taken for speculative
        tokens that were not kept. They are its own (never shared, never named)."""
        blocks = self._owned[owner]
        assert 0 < keep < len(blocks) and self._num_named.get(owner, 0) <= keep
        for b in reversed(blocks[keep:]):
            assert self._ref_counts[b] == 1 and self._block_hash[b] is None, f"block {b} is shared or named"
            self._ref_counts[b] = 0
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        del blocks[keep:]

    def check_invariants(self) -> None:
        """O(num_blocks): for tests and debugging, not for every step."""
        refs = [0] * self.num_blocks
        for owner, blocks in self._owned.items():
            assert blocks, f"owner {owner!r} with no blocks is still listed"
            assert len(blocks) == len(set(blocks)), f"{owner!r} holds a block twice"
            assert self._num_named.get(owner, 0) <= len(blocks)
            for b in blocks:
                refs[b] += 1
        free = set(self._free)
        assert NULL_BLOCK not in free and refs[NULL_BLOCK] == 0, "the null block was handed out"
        assert refs == self._ref_counts, "a reference count disagrees with the owners"
        assert free == {b for b in range(1, self.num_blocks) if refs[b] == 0}, \
            "a referenced block is free, or an unreferenced one leaked"
        named = {b: h for b, h in enumerate(self._block_hash) if h is not None}
        assert {h: b for b, h in named.items()} == self._cached, "a name and its block disagree"
        assert len(named) == len(self._cached), "two blocks hold one name"
        assert self.enable_caching or not named, "a block was named with caching off"
        # The free queue: unnamed blocks before named ones.
        kinds = [self._block_hash[b] is not None for b in self._free]
        assert kinds == sorted(kinds), "an unnamed free block sits behind a cached one"


# ---- sizing ----------------------------------------------------------------------------
CPU_DEFAULT_KV_BYTES = 4 * 2**30  # vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE=4)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: Any, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block, K and V, every layer: as the arrays hold them (a quantized
    cache's f32 scale per token and KV head included)."""
    import jax.numpy as jnp

    from kernels_pallas import kv_storage_dtype

    stored = kv_storage_dtype(kv_cache_dtype)
    per_head = cfg.head_dim * jnp.dtype(dtype if stored is None else stored).itemsize + (0 if stored is None else 4)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * per_head


def device_memory_bytes() -> int:
    """The first device's memory: its allocator's limit on an accelerator (0 if it reports
    none), the host's RAM on CPU."""
    import jax

    from config import host_memory_bytes

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return host_memory_bytes()
    return int((dev.memory_stats() or {}).get("bytes_limit", 0))


def num_kv_blocks_for(config: EngineConfig, cfg: ModelConfig, dtype: Any, weight_bytes: int,
                      activation_bytes: int = 0, extra_bytes_per_block: int = 0, logprobs_bytes: int = 0) -> int:
    """Total blocks (null block included) for a resolved config, from the first knob set:
    num_kv_blocks, kv_cache_memory, or (on an accelerator) gpu_memory_utilization.
    extra_bytes_per_block: a second cache indexed by the same blocks (a draft model's).
    logprobs_bytes: the logprob arrays a step returns (runner.logprobs_bytes), which the
    activations hold at least: the reserve where none was measured (an explicit budget's
    check, a device without counters), vocabulary-wide under --max-logprobs -1. Under async
    scheduling a second step's are reserved beside: the step before's outputs stay on the
    device, unread, while this one runs."""
    import jax

    activation_bytes = max(activation_bytes, logprobs_bytes)  # a measured peak includes one step's
    activation_bytes += logprobs_bytes if config.async_scheduling else 0

    # Per device: under tensor parallelism each device holds 1/tp of every block (its KV
    # heads; cfg counts heads after any replication, see parallel.py), and the budgets
    # below (--kv-cache-memory, --gpu-memory-utilization, weight_bytes) are per device too.
    per_block = kv_cache_bytes_per_block(cfg, config.block_size, dtype, config.kv_cache_dtype) // config.tensor_parallel_size
    per_block += extra_bytes_per_block
    have = device_memory_bytes()
    on_cpu = jax.devices()[0].platform == "cpu"
    # On CPU the device is the host: a swap pool (--preemption-mode swap) takes the same memory
    swap_bytes = int(config.swap_space * 2**30) if on_cpu and config.swaps_kv else 0
    if config.num_kv_blocks is not None:
        num, source = config.num_kv_blocks, f"{flag_name('num_kv_blocks')} {config.num_kv_blocks}"
    elif config.kv_cache_memory is not None:
        num = config.kv_cache_memory // per_block + 1
        source = f"{flag_name('kv_cache_memory')} {config.kv_cache_memory} bytes"
    elif not on_cpu:
        dev = jax.devices()[0]
        if not have:
            raise ValueError(f"{dev.platform} reports no memory limit: pass --kv-cache-memory or --num-kv-blocks")
        budget = int(config.gpu_memory_utilization * have) - weight_bytes - activation_bytes
        num = max(budget, 0) // per_block  # the null block comes out of the same memory
        source = (f"--gpu-memory-utilization {config.gpu_memory_utilization} of {have / 2**30:.1f} "
                  f"GiB minus {weight_bytes / 2**30:.2f} GiB of weights and {activation_bytes / 2**30:.2f} GiB "
                  "of activations")
    else:
        # CPU with no budget given: vLLM's CPU default of 4 GiB, or less when max_num_seqs
        # sequences of max_model_len need less (the engine could never use more). Not
        # max_num_seqs x max_model_len alone: a 131,072-position config would exhaust memory.
        # Nor more than the host leaves, as the accelerator's budget: gpu_memory_utilization of
        # its memory (a container's limit) less the weights, activations and any swap pool.
        leaves = int(config.gpu_memory_utilization * have) - weight_bytes - activation_bytes - swap_bytes
        budget = min(CPU_DEFAULT_KV_BYTES, max(leaves, 0)) // per_block
        num = min(budget, config.max_num_seqs * config.max_blocks_per_seq) + 1
        source = (f"the CPU default of {CPU_DEFAULT_KV_BYTES / 2**30:.0f} GiB (set --kv-cache-memory or "
                  "--num-kv-blocks)")
        if leaves < CPU_DEFAULT_KV_BYTES:
            source += (f", capped at what --gpu-memory-utilization {config.gpu_memory_utilization} of the host's "
                       f"{have / 2**30:.2f} GiB leaves beside {weight_bytes / 2**30:.2f} GiB of weights, "
                       f"{activation_bytes / 2**30:.2f} GiB of activations"
                       + (f" and a {swap_bytes / 2**30:g} GiB swap pool" if swap_bytes else ""))
    explicit = config.num_kv_blocks is not None or config.kv_cache_memory is not None
    if explicit and have and num * per_block + weight_bytes + activation_bytes + swap_bytes > have:
        # Refused before it is allocated: past this point it is an out-of-memory error from deep
        # inside the allocator, or a host killed for memory (a budget fits by construction).
        raise ValueError(f"{source}: a KV cache of {num} blocks takes {num * per_block / 2**30:.2f} GiB, which "
                         f"with {weight_bytes / 2**30:.2f} GiB of weights"
                         + (f", a {swap_bytes / 2**30:g} GiB swap pool" if swap_bytes else "")
                         + f" and {activation_bytes / 2**30:.2f} GiB of "
                         "activations (the logprob arrays at least) does not fit in the device's "
                         f"{have / 2**30:.2f} GiB; lower it (or shrink the logprob arrays: --max-logprobs, "
                         "--max-num-batched-tokens)")
    need = config.max_blocks_per_seq
    if num - 1 < need:
        raise ValueError(f"the KV cache budget ({source}) gives {max(num - 1, 0)} usable blocks of "
                         f"{config.block_size} tokens ({per_block} bytes each), but one sequence of max_model_len "
                         f"{config.max_model_len} needs {need}: raise the budget or lower --max-model-len"
                         + (f" (to at most {(num - 1) * config.block_size}, the longest sequence it holds, as "
                            "vLLM estimates)" if num > 1 else ""))
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


def create_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                     kv_cache_dtype: str = "auto") -> tuple[Any, Any]:
    """K and V, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: the
    layers stacked, as the model's scanned layer stack takes them (see model.Decoder); in
    the model dtype, or a kernels_pallas.QuantizedKV of that shape for an 8-bit cache. On CPU
    a float type narrower than 32 bits is held as its bits (kernels_pallas.as_bits)."""
    import jax.numpy as jnp

    from kernels_pallas import QuantizedKV, bits_zeros, kv_storage_dtype

    shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    stored = kv_storage_dtype(kv_cache_dtype)
    if stored is None:
        return bits_zeros(shape, dtype), bits_zeros(shape, dtype)
    make = lambda: QuantizedKV(bits_zeros(shape, stored), jnp.zeros(shape[:-1], jnp.float32))
    return make(), make()


def describe(config: EngineConfig, cfg: ModelConfig, num_blocks: int, dtype: Any) -> str:
    """One start-up line: what the cache holds and how many max_model_len sequences fit."""
    usable, bs, max_len, max_seqs = num_blocks - 1, config.block_size, config.max_model_len, config.max_num_seqs
    mib = num_blocks * kv_cache_bytes_per_block(cfg, bs, dtype, config.kv_cache_dtype) / 2**20
    admission = KV_ADMISSION[config.kv_admission]()
    fit = admission.max_concurrency(config, usable)
    fit_text = f"{fit}" if isinstance(fit, int) else f"{fit:.2f}"
    policy = f"{admission.name}: {admission.summary}"
    at_once = f"{fit_text} (KV-bound)" if fit < max_seqs else f"{max_seqs} (slot-bound)"
    import numpy as np

    stored = f"{config.kv_cache_dtype} + f32 scales" if config.kv_cache_quantized else np.dtype(dtype).name
    return (f"KV cache ({stored}): {usable} blocks x {bs} tokens = {usable * bs} tokens ({mib:.1f} MiB); "
            f"max concurrency at max_model_len {max_len}: {fit_text}x ({policy}); "
            f"with max_num_seqs {max_seqs}, sequences at once: {at_once}")
