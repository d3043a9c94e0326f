"""Tokenizers: a byte-level one for the built-in random-weight models, and transformers'
fast tokenizers for real checkpoints (from a directory's tokenizer files, or built from a
GGUF file's metadata).

Both expose the same small surface the engine and server use: encode, decode,
apply_chat_template, bos_token_id, eos_token_id.

Nothing here needs torch: transformers' own GGUF reader does (it dequantizes tensors with
it), so a GGUF file's tokenizer is built from metadata the `gguf` library reads, through
transformers' torch-free GGUF-to-tokenizers converter.
"""

from __future__ import annotations

import os
from typing import Any


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; then bos, eos, pad. The model's vocabulary may be
    larger (a random model can emit any id): ids with no meaning decode to U+FFFD, or to
    nothing when special tokens are skipped."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    _SPECIAL_TEXT = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()  # bytes are decoded together: one char may span ids
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(self._SPECIAL_TEXT.get(i, "\ufffd"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: list[dict] | None = None,
                            continue_final_message: bool = False) -> str | list[int]:
        """ChatML-style text. The markers are plain text here (bytes), not special ids;
        with tokenize=True the ids get a leading bos, as encode() gives. tools are not
        rendered (as by a template without a tools section). continue_final_message: the
        last message stays open (no end marker), as transformers' apply_chat_template."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if continue_final_message:
            text = text[:-len("<|im_end|>\n")]
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any | None:
    """A transformers fast tokenizer when `path` holds tokenizer files or is a GGUF file
    with a tokenizer, else None (the engine then takes token-id prompts only)."""
    if path.endswith(".gguf"):
        import gguf_loader

        metadata = gguf_loader.read_tokenizer_metadata(path)
        return gguf_tokenizer(metadata) if metadata is not None else None
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    _quiet_transformers()
    from transformers import AutoTokenizer  # slow import: only when needed

    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(metadata: dict[str, Any]) -> Any:
    """The tokenizer a GGUF file describes, from its `tokenizer.*` keys and
    `general.architecture` (as gguf_loader.read_tokenizer_metadata returns them): the
    same vocabulary, merges, special tokens, BOS/EOS and chat template that
    `AutoTokenizer.from_pretrained(folder, gguf_file=name)` gives, without its torch import."""
    try:
        return _gguf_tokenizer(metadata)
    except Exception as e:  # missing keys, ids past the vocabulary, a model type the converter lacks
        raise ValueError(f"the GGUF file's tokenizer metadata does not describe a usable tokenizer "
                         f"({type(e).__name__}: {e})") from None


def _gguf_tokenizer(metadata: dict[str, Any]) -> Any:
    _quiet_transformers()
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING, _SPECIAL_TOKENS,
                                                                       convert_gguf_tokenizer)

    # What transformers' get_gguf_tokenizer does with the metadata its own reader returns.
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokens.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def _quiet_transformers() -> None:
    # Without torch, importing transformers advises that "models won't be available":
    # true, and irrelevant here (only its tokenizers are used).
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
