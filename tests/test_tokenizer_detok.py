"""IncrementalDetokenizer against the tokenizer's own whole decode: the streamed chunks
joined equal decode_output (vLLM's text of the whole response), with and without stop
strings, for the byte tokenizer, a transformers byte-level BPE and a SentencePiece-style
tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_hf_tokenizer
from engine import decode_output
from sampling_params import SamplingParams
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


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory) -> Any:
    from transformers import AutoTokenizer

    from conftest import make_sp_tokenizer
    path = str(tmp_path_factory.mktemp("sp"))
    make_sp_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@settings(max_examples=60, deadline=None)
@given(prompt=st.text("abcé中 ", max_size=12).map("x".__add__), text=st.text("Parisé中x ", max_size=16).map("P".__add__),
       stop=st.sampled_from([None, "zz"]))
def test_a_sentencepiece_output_keeps_its_first_words_space_streamed_and_whole(sp_tok, prompt, text, stop) -> None:
    """SentencePiece marks a word's space on its piece ("▁Pa") and a decode drops the first
    piece's: tok.decode of an output alone loses the space that separates it from the prompt.
    vLLM's text (streamed and whole) keeps it: the output of `text`, encoded as a word, is
    " " + text after a prompt that has text (after BOS alone the space goes, as in vLLM,
    whose detokenizer also decodes after the prompt). An unmatched stop string changes nothing."""
    tok = sp_tok
    ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    prompt_ids = tok.encode(prompt)
    params = SamplingParams(stop=[stop] if stop else [])
    assert tok.decode(ids, skip_special_tokens=True) == text  # the trap: the space is gone
    whole = decode_output(tok, ids, params, (tok.eos_token_id,), prompt_ids)
    assert whole == stream(tok, prompt_ids, ids, params) == " " + text
    assert decode_output(tok, ids, params, (tok.eos_token_id,), [tok.bos_token_id]) == text


def test_llm_generate_keeps_a_sentencepiece_outputs_first_space_with_or_without_stop_strings(tmp_path) -> None:
    """LLM.generate's text is vLLM's (and the server's): " Pa" after a prompt, where the
    output decoded alone is "Pa"; the same whether or not a stop string was asked for (the
    engine's stop matcher has always decoded after the prompt)."""
    from conftest import make_hf_checkpoint
    from llm import LLM

    llm = LLM(model=make_hf_checkpoint(tmp_path / "m", tokenizer="sp"), max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=32, warmup=False)
    pa = llm.tokenizer.convert_tokens_to_ids("▁Pa")
    for stop in ([], ["zz"]):
        out = llm.generate(["the capital of France is"], SamplingParams(max_tokens=1, temperature=0.0, stop=stop,
                                                                       logit_bias={pa: 100.0}))[0].outputs[0]
        assert out.token_ids == [pa] and out.text == " Pa", stop


def test_a_run_of_byte_tokens_that_is_not_utf8_is_the_same_text_whole_and_streamed(sp_tok) -> None:
    """SentencePiece's byte fallback decodes a run of byte pieces together and, when the run is
    not UTF-8, gives a U+FFFD for every byte; a stream has already sent the bytes that stood
    alone. The whole text is the streamed one, which is also Python's decode of the bytes."""
    tok = sp_tok
    data = b"\x17M6\xbb"
    ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]
    prompt_ids = tok.encode("the capital")
    assert tok.decode(ids) == "\ufffd" * 4
    whole = decode_output(tok, ids, SamplingParams(), (tok.eos_token_id,), prompt_ids)
    assert whole == stream(tok, prompt_ids, ids, SamplingParams()) == data.decode("utf-8", "replace")


def test_byte_tokenizer_decoders_built_at_once_on_many_threads_need_no_transformers() -> None:
    """Requests build detokenizers on the event loop and the engine thread at once; the
    first import of transformers' lazy attributes is not thread-safe (a tiny model's first
    requests got "cannot import name 'PreTrainedTokenizerFast'", a 500). A ByteTokenizer's
    decoder imports nothing; checked in a fresh interpreter, where nothing imported it yet."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys, threading
from sampling_params import SamplingParams
from tokenizer import ByteTokenizer, decoder
errors, barrier = [], threading.Barrier(8)
def build():
    barrier.wait()
    try:
        assert decoder(ByteTokenizer(), SamplingParams())([104, 105]) == "hi"
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=build) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors, "transformers" in sys.modules)
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] False", out.stdout[-2000:]


def test_logprobs_tokens_keep_the_spaces_of_their_sentencepiece_pieces_as_vllm(sp_tok, tok) -> None:
    """vLLM's logprob tokens (convert_ids_list_to_tokens) put back the leading spaces a
    SentencePiece decode of one token strips: each token is its vocabulary piece with "▁"
    a space, so the tokens join into the text with its words' spaces and text_offset points
    at each token's place in it. A byte-level BPE's tokens are its decode, unchanged."""
    from outputs import TokenLogprob
    from protocol import chat_logprobs, completion_logprobs, prompt_logprobs_json

    ids = sp_tok.encode("the capital of France is Paris", add_special_tokens=False)
    want = [p.replace("▁", " ") for p in sp_tok.convert_ids_to_tokens(ids)]
    assert "".join(want) == " the capital of France is Paris" and sp_tok.decode(ids[:1]) == want[0][1:]
    lps = [TokenLogprob(t, -1.0, [(t, -1.0)], 1) for t in ids]
    completion = completion_logprobs(sp_tok, lps, 0, 1)
    assert completion["tokens"] == want and [list(top) for top in completion["top_logprobs"]] == [[w] for w in want]
    assert all(" the capital of France is Paris"[o:].startswith(w) for o, w in zip(completion["text_offset"], want))
    chat = chat_logprobs(sp_tok, lps, 1)["content"]
    assert [(c["token"], bytes(c["bytes"])) for c in chat] == [(w, w.encode()) for w in want]
    assert [c["top_logprobs"][0]["token"] for c in chat] == want
    assert [next(iter(p.values()))["decoded_token"] for p in prompt_logprobs_json(sp_tok, [None, *lps[1:]])[1:]] \
        == want[1:]
    if not isinstance(tok, ByteTokenizer):  # the byte-level BPE
        ids = tok.encode("the quick brown fox")
        assert completion_logprobs(tok, ids, 0)["tokens"] == [tok.decode([t]) for t in ids]


def test_a_token_ending_part_of_a_character_is_given_its_characters_text_as_vllm(tok) -> None:
    """vLLM's logprob tokens (LogprobsProcessor._verify_tokens): a token that alone decodes
    to part of a character is "" until the token that completes the character, whose text
    is the whole character, so the tokens join into the text; a stream's chunk gets the
    same from the tokens sampled before it, and prompt_logprobs from the prompt's."""
    from outputs import TokenLogprob
    from protocol import chat_logprobs, completion_logprobs, prompt_logprobs_json

    text = "go 中é!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # "中" and "é" span tokens
    lps = [TokenLogprob(t, -1.0, [(t, -1.0), (ids[-1], -2.0)], 1) for t in ids]
    tokens = completion_logprobs(tok, lps, 0, 1)["tokens"]
    assert "".join(tokens) == text and "\ufffd" not in "".join(tokens)
    # each token's text is what it adds to the ones before: the decode of the ids through it,
    # less that of the ids before, where those end on a whole character ("" where it does not)
    for j, t in enumerate(tokens):
        through = tok.decode(ids[:j + 1])
        assert t == ("" if through.endswith("\ufffd") else through[len(tok.decode(ids[:j]).rstrip("\ufffd")):]), j
    for k in range(len(ids)):  # streamed in two chunks: the second's context is the first's tokens
        assert completion_logprobs(tok, lps[:k], 0, 1)["tokens"] + \
            completion_logprobs(tok, lps[k:], 0, 1, before=ids[:k])["tokens"] == tokens
    chat = chat_logprobs(tok, lps, 2)["content"]
    assert [c["token"] for c in chat] == tokens and [bytes(c["bytes"]) for c in chat] == [t.encode() for t in tokens]
    assert [[t["token"] for t in c["top_logprobs"]] for c in chat[:-1]] == [[t, "!"] for t in tokens[:-1]]
    prompt = prompt_logprobs_json(tok, [None, *lps[1:]])
    assert [p[str(t)]["decoded_token"] for p, t in zip(prompt[1:], ids[1:])] == tokens[1:]
