"""Tokenizers: a byte-level one for the built-in random-weight models, and transformers'
AutoTokenizer for real checkpoints.

Both expose the same small surface the engine and server use: encode, decode,
apply_chat_template, bos_token_id, eos_token_id.
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
                            tokenize: bool = False) -> str | list[int]:
        """ChatML-style text. The markers are plain text here (bytes), not special ids;
        with tokenize=True the ids get a leading bos, as encode() gives."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any | None:
    """transformers' AutoTokenizer when `path` holds tokenizer files or is a GGUF file
    (transformers reads the tokenizer and chat template from its metadata), else None
    (the engine then takes token-id prompts only)."""
    if path.endswith(".gguf"):
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # slow import: only when needed

    return AutoTokenizer.from_pretrained(path)
