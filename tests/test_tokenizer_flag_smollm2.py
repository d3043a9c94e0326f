"""--tokenizer on the real model (its own file, so that it alone compiles at full
optimisation with XLA's default emitters: tests/conftest.py's REAL_MODEL_FILES): smollm2
served with the tokenizer saved from its own GGUF metadata gives what it gives without the
flag, and that tokenizer renders and encodes as transformers' AutoTokenizer of the folder."""

from __future__ import annotations

from llm import LLM, SamplingParams
from test_tokenizer_flag import QUIET, auto_tokenizer

# test_real_model.py's shapes: their programs are in the persistent compilation cache
SHAPES = dict(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128, num_kv_blocks=96, warmup=False)


def test_smollm2_with_the_tokenizer_of_its_own_gguf_metadata_gives_what_it_gives_without(tmp_path):
    import gguf_loader
    from tokenizer import gguf_tokenizer

    path = gguf_loader.resolve_builtin("smollm2", log=lambda _: None)
    saved = str(tmp_path / "smollm2-tokenizer")
    gguf_tokenizer(gguf_loader.read_tokenizer_metadata(path)).save_pretrained(saved)
    ref = auto_tokenizer(saved)
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def run(**kw) -> tuple:
        llm = LLM("smollm2", **QUIET, **SHAPES, **kw)
        chat = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0]
        text = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=4, temperature=0))[0]
        return (llm.engine.model_config.eos_token_ids, chat.prompt, chat.prompt_token_ids, chat.outputs[0].token_ids,
                chat.outputs[0].text, text.prompt_token_ids, text.outputs[0].token_ids, text.outputs[0].text)

    named = run(tokenizer=saved)
    assert named[1] == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert named[5] == ref.encode("Hello, my name is")
    assert named == run()
