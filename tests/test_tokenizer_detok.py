"""IncrementalDetokenizer against the tokenizer's own whole decode: the streamed chunks
joined equal decode_output (vLLM's text of the whole response), with and without stop
strings, for the byte tokenizer and a transformers byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest

from config import SamplingParams
from conftest import make_hf_tokenizer
from engine import decode_output
from tokenizer import ByteTokenizer, IncrementalDetokenizer


@pytest.fixture(scope="module", params=["byte", "hf"])
def tok(request, tmp_path_factory) -> Any:
    if request.param == "byte":
        return ByteTokenizer()
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("bpe"))
    make_hf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def stream(tok: Any, prompt: list[int], ids: list[int], params: SamplingParams) -> str:
    """The server's and the engine's way: one token at a time, the last one final."""
    d = IncrementalDetokenizer(tok, prompt, list(params.stop), params, (tok.eos_token_id,))
    out = []
    for j in range(len(ids)):
        last = j == len(ids) - 1
        stopped = d.advance(ids[j:j + 1], final=last)
        out.append(d.take(last or stopped))
        if stopped:
            break
    return "".join(out)


def test_a_prompt_ending_in_part_of_a_character_does_not_join_the_outputs_first_bytes(tok) -> None:
    # "é" is two byte tokens here; the prompt ends with its first, the output starts with
    # its second: alone (a whole decode of the output) that is an invalid byte, U+FFFD.
    first, second = tok.encode("é", add_special_tokens=False)[-2:]
    assert tok.decode([second]) == "\ufffd"
    prompt = tok.encode("the h", add_special_tokens=False) + [first]
    ids = [second, *tok.encode("ab", add_special_tokens=False), tok.eos_token_id]
    params = SamplingParams()
    whole = decode_output(tok, ids, params, (tok.eos_token_id,))
    assert whole == tok.decode(ids[:-1]) == "\ufffdab"
    assert stream(tok, prompt, ids, params) == whole
    # and the stop-string matcher cuts that same text
    assert stream(tok, prompt, ids, SamplingParams(stop=["b"])) == "\ufffda"
