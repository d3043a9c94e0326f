"""The decoder-only transformer every supported family runs on, and the family table.

The families (FAMILIES: Llama 2/3, Mistral, Qwen2, Qwen3) are one network, `Decoder`, with
a few switches their config adapters set: GQA, q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), Llama 3.1's RoPE frequency scaling, tied embeddings. Each layer declares its
weights (`WEIGHTS`): their Hugging Face and GGUF names and their logical axes, which
parallel.py maps onto a device mesh. Each forward step takes a flat batch of T tokens
from any number of sequences; the layers write the step's K/V into the paged cache and
call the attention backend (see docs/ARCHITECTURE.md for the cache layout and
attention_backend.py for the backends).

Numerics: matmuls run in the parameter dtype (float32 or bfloat16); RMSNorm, RoPE,
softmax (inside the backend) and the logits are float32. Quantized linears (quant.py)
convert their codes to that dtype inside the step.

Loading (checkpoint directories, GGUF files, the built-in models) is model_loader.py's:
it fills these parameters from tensors named as WEIGHTS declares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_backend import AttentionBackend
from hf_config import check_hf_config, check_llama3_rope, token_ids
from kernels_pallas import Bits, QuantizedKV, as_bits, from_bits, quantize_kv
from quant import QuantLinear
from quant_methods import WeightQuant

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, hashable so jitted code can take it as a static argument."""

    architecture: str  # the family's model_type (a key of FAMILIES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3 parameters, as sorted items
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # The per-family options (set by the family's config adapter):
    attention_bias: bool = False  # biases on q/k/v_proj
    o_proj_bias: bool = False  # and on o_proj
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE
    sliding_window: int | None = None  # attention is exact only while a sequence fits in it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def max_model_len(self) -> int:
        """The longest sequence this engine runs exactly: a sliding window caps it, since
        the kernels attend to the whole context."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a Hugging Face config.json dict; raises ValueError on what we do not run."""
        # The family first: an unsupported one (Gemma3's text_config, Mllama) lacks the fields checked next
        model_type = d.get("model_type") if isinstance(d, dict) else None
        if isinstance(d, dict) and not (isinstance(model_type, str) and model_type in FAMILIES):
            raise ValueError(f"unsupported model_type {model_type!r} (architectures={d.get('architectures')}); "
                             f"supported: {', '.join(FAMILIES)}")
        check_hf_config(d, source)
        family = FAMILIES[d["model_type"]]
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        heads = d["num_attention_heads"]
        theta, scaling = _rope_from_hf(d)
        return cls(
            architecture=family.model_type, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            # null is the default, as an absent key (check_hf_config has refused 0)
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=d["max_position_embeddings"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=token_ids(d.get("eos_token_id"), f"{source}: eos_token_id"),
            **family.options(d),
        )


# ---- model families ------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """A supported model family, as its checkpoints describe it. Every family runs on the
    one `Decoder` below, whose layers declare the tensor names (HF and GGUF) and the
    sharding of each weight; a family's `options` maps its config.json onto the decoder's
    switches (the ModelConfig fields attention_bias, o_proj_bias, qk_norm, sliding_window)."""

    model_type: str  # config.json's model_type
    options: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> the decoder's switches
    gguf_arch: str | None = None  # its GGUF files' general.architecture; None: not read from GGUF
    gguf_qk_permuted: bool = False  # llama.cpp's converter permuted its q/k rows (gguf_loader.unpermute_qk)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family: config.json files with its model_type (and GGUF files with its
    gguf_arch) then load."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model family {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


def llama_options(d: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: `attention_bias` puts biases on q/k/v and o; a sliding window
    is on whenever the config gives one."""
    bias = bool(d.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, sliding_window=d.get("sliding_window"))


# transformers' default sliding_window (MistralConfig, and Qwen2/Qwen3Config's with
# use_sliding_window) where a config.json leaves the key out
DEFAULT_WINDOW = 4096


def mistral_options(d: dict[str, Any]) -> dict[str, Any]:
    """Mistral: as Llama, with transformers' default window where the config.json leaves
    the key out; null turns it off, as in Mistral v0.2 and later."""
    return {**llama_options(d), "sliding_window": d.get("sliding_window", DEFAULT_WINDOW)}


def _qwen_window(d: dict[str, Any]) -> int | None:
    # Qwen configs carry a window size that is off unless use_sliding_window
    return d.get("sliding_window", DEFAULT_WINDOW) if d.get("use_sliding_window", False) else None


def qwen2_options(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen2: q/k/v biases always, none on o_proj."""
    return dict(attention_bias=True, o_proj_bias=False, sliding_window=_qwen_window(d))


def qwen3_options(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: RMSNorm on each q and k head; biases as Llama's."""
    bias = bool(d.get("attention_bias", False))
    return dict(attention_bias=bias, o_proj_bias=bias, qk_norm=True, sliding_window=_qwen_window(d))


register_family(Family("llama", llama_options, gguf_arch="llama", gguf_qk_permuted=True))
register_family(Family("mistral", mistral_options))  # Mistral's GGUF files say "llama"
register_family(Family("qwen2", qwen2_options, gguf_arch="qwen2"))
register_family(Family("qwen3", qwen3_options, gguf_arch="qwen3"))


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, float], ...] | None]:
    # transformers 5.x writes `rope_parameters` (rope_type, rope_theta, ...); older configs
    # have a top-level rope_theta and `rope_scaling` (with "type" or "rope_type").
    p = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in p.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    if p.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    theta = float(p.get("rope_theta") or d.get("rope_theta") or 10000.0)  # null: absent (0 is refused)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported RoPE type {rope_type!r} (the rope_type of rope_parameters or rope_scaling; "
                         "supported: default, llama3)")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in p]
    if missing:
        raise ValueError(f"llama3 RoPE scaling lacks {missing}")
    check_llama3_rope(p)
    return theta, tuple(sorted((k, float(p[k])) for k in LLAMA3_ROPE_KEYS))


@jax.tree_util.register_dataclass
@dataclass
class AttentionInputs:
    """Where this step's K/V go and what each query attends to (see docs/ARCHITECTURE.md, "KV cache")."""

    slot_mapping: jax.Array  # [T] i32: flat cache index of token t's K/V
    block_tables: jax.Array  # [S, W] i32
    kv_lens: jax.Array  # [S] i32, including this step's tokens
    cu_q_lens: jax.Array | None = None  # [S+1] i32; None => decode, one token per slot (T == S)


# ---- weights: declared by the layer that owns them -------------------------------

@dataclass(frozen=True)
class Weight:
    """One parameter as checkpoints name it and as tensor parallelism splits it."""

    hf: str  # its Hugging Face name; "{}" stands for the layer index
    gguf: str  # its name in llama.cpp's GGUF files
    axes: tuple[str, ...]  # the logical axis of each dim; parallel.RULES maps them onto the mesh
    transposed: bool = False  # checkpoints store it [out, in] (torch Linear); here it is [in, out]
    # A quantized kernel's scales (quant.py): computed from, or stored inside the blocks of,
    # the kernel's checkpoint tensor; never a tensor of their own.
    derived: bool = False

    @property
    def stacked(self) -> bool:
        """A decoder layer's parameter: one array for all layers, layer first."""
        return self.axes[:1] == ("layers",)


def _linear_weights(name: str, gguf: str, axes: tuple[str, str], bias: bool = True) -> dict[str, Weight]:
    """A linear's kernel [in, out] and, where a config may give it one, its bias [out];
    quantized (quant.QuantLinear), the kernel holds codes and beside it go a per-channel
    scale [out] or per-block scales (and minima) [in/32, out], split over the mesh with it,
    or one scale for the whole tensor, replicated (so every shard decodes as one device)."""
    kernel = {f"{name}.kernel": Weight(f"{name}.weight", f"{gguf}.weight", axes, transposed=True)}
    scales = {f"{name}.scale": Weight(f"{name}.weight_scale", "", axes[1:], derived=True),
              f"{name}.tensor_scale": Weight(f"{name}.weight_tensor_scale", "", (), derived=True),
              f"{name}.block_scale": Weight(f"{name}.weight_block_scale", "", axes, derived=True),
              f"{name}.block_min": Weight(f"{name}.weight_block_min", "", axes, derived=True)}
    return kernel | scales | ({f"{name}.bias": Weight(f"{name}.bias", f"{gguf}.bias", axes[1:])} if bias else {})


def _sublayer(attr: str, weights: dict[str, Weight], hf: str, gguf: str,
              stacked: bool = False) -> dict[str, Weight]:
    """A sublayer's declarations under its attribute path and name prefixes; `stacked`
    layers carry a leading "layers" axis."""
    lead = ("layers",) if stacked else ()
    return {f"{attr}.{path}": replace(w, hf=hf + w.hf, gguf=gguf + w.gguf, axes=lead + w.axes)
            for path, w in weights.items()}


def declared_weight(path: tuple[Any, ...]) -> Weight:
    """The declaration (Decoder.WEIGHTS) of the parameter at an nnx state path."""
    return Decoder.WEIGHTS[".".join(str(p) for p in path)]


def hf_tensor_names(path: tuple[Any, ...], num_layers: int) -> list[str]:
    """The HF tensor names the parameter at `path` holds: one per layer, in order, for
    a stacked layer parameter (none for a quantized kernel's scales: they come with it)."""
    w = declared_weight(path)
    if w.derived:
        return []
    return [w.hf.format(i) for i in range(num_layers)] if w.stacked else [w.hf]


# ---- layers ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[head_dim/2] float32 inverse frequencies, a trace-time constant (not a param)."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if cfg.rope_scaling is not None:
        # Llama 3.1: wavelengths longer than the original context are stretched by
        # `factor`, short ones are kept, and the band between is interpolated.
        s = dict(cfg.rope_scaling)
        old, factor = s["original_max_position_embeddings"], s["factor"]
        lo, hi = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > old / lo, inv / factor, np.where(wavelen < old / hi, inv, blended))
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [T, H, D] rotated by position, in HF's "rotate half" layout (pairs are (i, i+D/2))."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(x.dtype) * self.weight[...]  # as HF: normalise in f32, scale in dtype


def _linear(n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs,
            scheme: str | None = None) -> nnx.Linear | QuantLinear:
    if scheme is not None:  # filled by loading (model_from_hf_tensors)
        return QuantLinear(n_in, n_out, bias, dtype, scheme)
    # std 1/sqrt(fan_in) keeps every sublayer's output O(1), so a random model's context
    # visibly moves its logits (real weights are loaded over this anyway).
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
                      kernel_init=nnx.initializers.normal(n_in ** -0.5), rngs=rngs)


def _write_cache(cache: jax.Array | Bits | QuantizedKV, x: jax.Array,
                 slots: jax.Array) -> jax.Array | Bits | QuantizedKV:
    """Scatter x [T, Hkv, D] into cache rows `slots`; a pure update XLA does in place when
    the cache buffer is donated. A quantized cache gets x's 8-bit values and their scales."""
    if isinstance(cache, QuantizedKV):
        values, scales = quantize_kv(x, cache.dtype)
        return QuantizedKV(_write_cache(cache.values, values, slots), _write_cache(cache.scales, scales, slots))
    if isinstance(cache, Bits):  # held as its bits (as_bits): x's bits in the cache's type
        return Bits(_write_cache(cache.bits, jax.lax.bitcast_convert_type(x.astype(cache.dtype), cache.bits.dtype),
                                 slots), cache.dtype)
    nb, bs, *rest = cache.shape
    return cache.reshape(nb * bs, *rest).at[slots].set(x.astype(cache.dtype)).reshape(cache.shape)


class Attention(nnx.Module):
    # Q heads and KV heads are split over devices, whole; o_proj by its input (the heads),
    # so its bias is added once, after the sum.
    WEIGHTS = {**_linear_weights("q_proj", "attn_q", ("embed", "heads")),
               **_linear_weights("k_proj", "attn_k", ("embed", "kv_heads")),
               **_linear_weights("v_proj", "attn_v", ("embed", "kv_heads")),
               **_linear_weights("o_proj", "attn_output", ("heads", "embed")),
               "q_norm.weight": Weight("q_norm.weight", "attn_q_norm.weight", ("head_dim",)),
               "k_norm.weight": Weight("k_norm.weight", "attn_k_norm.weight", ("head_dim",))}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        self.cfg = cfg
        h, d, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        s = (lambda name: quant.scheme(f"layers.self_attn.{name}")) if quant else (lambda name: None)
        self.q_proj = _linear(h, nq * d, cfg.attention_bias, dtype, rngs, s("q_proj"))
        self.k_proj = _linear(h, nkv * d, cfg.attention_bias, dtype, rngs, s("k_proj"))
        self.v_proj = _linear(h, nkv * d, cfg.attention_bias, dtype, rngs, s("v_proj"))
        self.o_proj = _linear(nq * d, h, cfg.o_proj_bias, dtype, rngs, s("o_proj"))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array],
                 attn: AttentionInputs, backend: AttentionBackend,
                 block_offset: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """kv_cache: every layer's blocks in one [L * num_blocks, block_size, Hkv, D]
        array per K and V; this layer's block b is block_offset + b (see Decoder.__call__)."""
        cfg, t = self.cfg, x.shape[0]
        q = self.q_proj(x).reshape(t, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(t, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        # The step's K/V go into the cache first; attention then reads everything from it.
        slots = attn.slot_mapping + block_offset * kv_cache[0].shape[1]
        block_tables = attn.block_tables + block_offset
        k_cache = _write_cache(kv_cache[0], k, slots)
        v_cache = _write_cache(kv_cache[1], v, slots)
        scale = cfg.head_dim ** -0.5
        if attn.cu_q_lens is None:
            o = backend.decode(q, k_cache, v_cache, block_tables, attn.kv_lens, scale=scale)
        else:
            o = backend.ragged(q, k_cache, v_cache, block_tables, attn.cu_q_lens, attn.kv_lens, scale=scale)
        return self.o_proj(o.reshape(t, -1)), (k_cache, v_cache)


class MLP(nnx.Module):
    WEIGHTS = {**_linear_weights("gate_proj", "ffn_gate", ("embed", "mlp"), bias=False),
               **_linear_weights("up_proj", "ffn_up", ("embed", "mlp"), bias=False),
               **_linear_weights("down_proj", "ffn_down", ("mlp", "embed"), bias=False)}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        h, i = cfg.hidden_size, cfg.intermediate_size
        s = (lambda name: quant.scheme(f"layers.mlp.{name}")) if quant else (lambda name: None)
        self.gate_proj = _linear(h, i, False, dtype, rngs, s("gate_proj"))
        self.up_proj = _linear(h, i, False, dtype, rngs, s("up_proj"))
        self.down_proj = _linear(i, h, False, dtype, rngs, s("down_proj"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    WEIGHTS = {"input_layernorm.weight": Weight("input_layernorm.weight", "attn_norm.weight", ("embed",)),
               "post_attention_layernorm.weight": Weight("post_attention_layernorm.weight", "ffn_norm.weight",
                                                         ("embed",)),
               **_sublayer("self_attn", Attention.WEIGHTS, "self_attn.", ""),
               **_sublayer("mlp", MLP.WEIGHTS, "mlp.", "")}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, quant: WeightQuant | None = None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs, quant)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array],
                 attn: AttentionInputs, backend: AttentionBackend,
                 block_offset: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        h, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, attn, backend, block_offset)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


# K and V, each [num_layers, num_blocks, block_size, Hkv, head_dim] (or a QuantizedKV of that shape)
KVCache = tuple[jax.Array | QuantizedKV, jax.Array | QuantizedKV]


class Decoder(nnx.Module):
    """The decoder-only transformer of every family in FAMILIES. Attribute names mirror
    HF's parameter names; WEIGHTS declares every parameter (by its attribute path) with
    its checkpoint names and logical axes.

    Parameter layout (nnx.state(model, nnx.Param), every leaf one array):
      embed_tokens.embedding  [V, H]
      layers.<HF sublayer path>  the decoder layers STACKED: every leaf has a leading
          [num_layers] axis, e.g. layers.self_attn.q_proj.kernel [L, H, Hq*D],
          layers.mlp.down_proj.kernel [L, I, H], layers.input_layernorm.weight [L, H].
          Kernels are [in, out] (x @ W, HF's torch weight transposed).
      norm.weight [H];  lm_head.kernel [H, V] (absent with tied embeddings)
    The forward is one lax.scan over the stacked layers, so a step program's compile
    time does not grow with depth."""

    WEIGHTS = {"embed_tokens.embedding": Weight("model.embed_tokens.weight", "token_embd.weight", ("vocab", "embed")),
               **_sublayer("layers", DecoderLayer.WEIGHTS, "model.layers.{}.", "blk.{}.", stacked=True),
               "norm.weight": Weight("model.norm.weight", "output_norm.weight", ("embed",)),
               "lm_head.kernel": Weight("lm_head.weight", "output.weight", ("embed", "vocab"), transposed=True)}

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype | str = jnp.float32, quant: WeightQuant | None = None, *,
                 rngs: nnx.Rngs):
        """quant: the linears stored quantized (quant.py); their arrays are placeholders
        until model_from_hf_tensors fills them."""
        dtype = jnp.dtype(dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(cfg, dtype, rngs, quant)

        self.layers = stacked_layers(rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_caches: KVCache,
                 attn: AttentionInputs, backend: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """tokens, positions [T] -> (final-normed hidden [T, H], updated kv_caches)."""
        x = self.embed_tokens(tokens)
        k_all, v_all = kv_caches
        L, NB = k_all.shape[:2]
        assert L == self.config.num_hidden_layers, (k_all.shape, L)
        # The scan carries the whole cache, its layer axis folded into the block axis (a
        # free reshape): layer l's block b is row l * NB + b. Each layer scatters into the
        # carry in place and hands the attention backend block tables offset by l * NB,
        # so the kernels see an ordinary paged cache and no per-layer slice is copied.
        flat = lambda cache: jax.tree.map(lambda c: c.reshape(L * NB, *c.shape[2:]), cache)
        # On CPU a bf16/f16/fp8 cache is written and read as its bits (see as_bits); the
        # engine's is held so, one handed over in its float type goes back in it.
        given = jax.tree.structure((k_all, v_all))
        k_all, v_all = as_bits(k_all), as_bits(v_all)
        back = from_bits if jax.tree.structure((k_all, v_all)) != given else (lambda cache: cache)
        layer_def, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, k, v = carry
            state, l = xs
            x, (k, v) = nnx.merge(layer_def, state)(x, positions, (k, v), attn, backend, l * NB)
            return (x, k, v), None

        (x, k, v), _ = jax.lax.scan(body, (x, flat(k_all), flat(v_all)), (layer_state, jnp.arange(L)))
        unflat = lambda cache, like: jax.tree.map(lambda c, a: c.reshape(a.shape), cache, like)
        return self.norm(x), (back(unflat(k, k_all)), back(unflat(v, v_all)))

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] (rows of __call__'s output) -> [N, vocab] float32."""
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...]  # [V, H]
            return jnp.einsum("nh,vh->nv", hidden, w, preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


def init_model(cfg: ModelConfig, dtype: jnp.dtype | str = jnp.float32, seed: int = 0) -> Decoder:
    """Random weights (the built-in models, tests)."""
    return Decoder(cfg, dtype, rngs=nnx.Rngs(seed))


def param_bytes(model: Decoder) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def device_bytes(tree: Any) -> int:
    """Bytes the live arrays of `tree` occupy on this process's devices, read from their
    addressable shards (so replicated arrays count once per device holding them)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)
