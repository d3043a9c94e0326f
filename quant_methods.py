"""Weight quantization methods: the one registry of `--quantization` values (vLLM's
QUANTIZATION_METHODS), and what each method stores quantized.

A method is one `@QUANTIZATION_METHODS.register(name)` class: it picks, for each decoder-layer
linear (LAYER_LINEARS), the scheme that stores it (quant.SCHEMES: int8, fp8_e4m3, q8_0, q4_0,
q4_1) or leaves it in the model dtype, and declares what it needs from the checkpoint
(`reads_gguf_blocks`: a GGUF file's quantized tensors as stored). Callers ask the method;
nothing outside this file compares method names.

JAX-free: config.py, which the JAX-free scheduler imports, validates `quantization` against
this registry; quant.py (the layer and the schemes, in JAX) builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from policy import Registry

# The decoder layers' linears (nnx attribute paths), the ones a method may quantize.
LAYER_LINEARS = tuple(f"layers.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


@dataclass(frozen=True)
class WeightQuant:
    """Which linear layers are quantized, and how: (nnx attribute path, scheme) pairs,
    e.g. ("layers.self_attn.q_proj", "int8"). Hashable: it shapes the model's arrays."""

    schemes: tuple[tuple[str, str], ...]
    method: str  # the --quantization value it came from (for the start-up line)

    def scheme(self, path: str) -> str | None:
        return dict(self.schemes).get(path)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for _, s in self.schemes:
            counts[s] = counts.get(s, 0) + 1
        # every method stores weights only: the activations, and so the matmuls, stay in the model dtype
        return f"{self.method}, weight-only: " + ", ".join(f"{n} linear(s) {s}" for s, n in sorted(counts.items()))


GGUFTypes = dict[str, set[str]]  # a GGUF file's tensor types per linear (LAYER_LINEARS path -> its layers' types)


class QuantizationMethod:
    """One --quantization value: which linears it stores quantized, in which scheme."""

    name: ClassVar[str]  # set by QUANTIZATION_METHODS.register
    summary: ClassVar[str] = ""  # one line for --help
    # It serves a GGUF file's quantized tensors as stored: the file's linears come to
    # `schemes` as GGUF types, and to the loader as blocks (quant.GGUFBlocks), not floats.
    reads_gguf_blocks: ClassVar[bool] = False

    def schemes(self, gguf_types: GGUFTypes | None) -> tuple[tuple[str, str], ...]:
        """(LAYER_LINEARS path, scheme name) for each linear stored quantized; gguf_types:
        the file's tensor types per linear, None for a checkpoint that is not a GGUF file."""
        raise NotImplementedError

    def weight_quant(self, gguf_types: GGUFTypes | None) -> WeightQuant:
        if self.reads_gguf_blocks and gguf_types is None:
            raise ValueError(f"--quantization {self.name} serves a GGUF file's quantized tensors; this model is not a "
                             f".gguf file (use --quantization {float_methods()} for any checkpoint)")
        return WeightQuant(self.schemes(gguf_types), self.name)


QUANTIZATION_METHODS: Registry[QuantizationMethod] = Registry("quantization", also=(None,))  # None: the model dtype


def float_methods() -> str:
    """The registered methods that quantize float weights, so serve any checkpoint ("int8 or fp8")."""
    return " or ".join(name for name, m in QUANTIZATION_METHODS.items() if not m.reads_gguf_blocks)


@QUANTIZATION_METHODS.register("int8")
class Int8(QuantizationMethod):
    """Every linear in int8 per output channel, from any checkpoint's float weights (a GGUF
    file's dequantized first)."""

    summary = "per output channel, any checkpoint"

    def schemes(self, gguf_types: GGUFTypes | None) -> tuple[tuple[str, str], ...]:
        return tuple((path, "int8") for path in LAYER_LINEARS)


@QUANTIZATION_METHODS.register("fp8")
class FP8(QuantizationMethod):
    """vLLM's `--quantization fp8` on a float checkpoint (online: Fp8Config with
    is_checkpoint_fp8_serialized=False): every linear in float8_e4m3fn with one scale per
    weight tensor, quantized at load time from any checkpoint's float weights (a GGUF
    file's dequantized first). Weight-only: the activations stay in the model dtype, as
    vLLM's Marlin path on GPUs without FP8 compute; on FP8 GPUs vLLM also quantizes the
    activations (W8A8). A checkpoint stored in FP8 (config.json `quantization_config`) is
    refused by hf_config.py."""

    summary = ("E4M3, one scale per tensor, any checkpoint; the activations stay in the model dtype, where "
               "vLLM on an FP8 GPU quantizes them too")

    def schemes(self, gguf_types: GGUFTypes | None) -> tuple[tuple[str, str], ...]:
        return tuple((path, "fp8_e4m3") for path in LAYER_LINEARS)


# The GGUF tensor types served in their own blocks, and the scheme that holds each.
GGUF_NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


@QUANTIZATION_METHODS.register("gguf")
class GGUF(QuantizationMethod):
    """A GGUF file's Q8_0 / Q4_0 / Q4_1 linears kept in their blocks. A linear is kept when
    every layer stores it as one type (a stacked parameter has one layout); the others are
    dequantized to the model dtype."""

    summary = "a GGUF file's Q8_0/Q4_0/Q4_1 blocks as stored"
    reads_gguf_blocks = True

    def schemes(self, gguf_types: GGUFTypes | None) -> tuple[tuple[str, str], ...]:
        assert gguf_types is not None
        schemes = []
        for path in LAYER_LINEARS:
            types = gguf_types.get(path, set())
            scheme = GGUF_NATIVE.get(next(iter(types))) if len(types) == 1 else None
            if scheme is not None:
                schemes.append((path, scheme))
        if not schemes:
            found = sorted(set().union(*gguf_types.values())) if gguf_types else []
            raise ValueError(f"--quantization {self.name} serves {', '.join(GGUF_NATIVE)} linears natively; this "
                             f"file's linears are {', '.join(found) or 'none'}. Drop --quantization to dequantize "
                             f"them, or use --quantization {float_methods()}")
        return tuple(schemes)
