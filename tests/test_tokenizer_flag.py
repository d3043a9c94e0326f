"""vLLM's --tokenizer (LLM(..., tokenizer=...)): a tokenizer folder used instead of the
model's own, for a Hugging Face checkpoint, a GGUF file, an orbax checkpoint and the
built-in random models.

Claims, each against transformers' AutoTokenizer on the named folder as the reference:
prompts are encoded with it, outputs decoded with it (offline and /detokenize), chats
rendered with its template (offline and /tokenize), structured outputs constrained over its
vocabulary; its eos_token_id stops a request beside the model's own stop ids (vLLM's eos from
the tokenizer and the generation config); smollm2 served with the tokenizer saved from its
own GGUF metadata gives what it gives without the flag (test_tokenizer_flag_smollm2.py); a
missing folder, one without a tokenizer, one whose files do not load and a vocabulary larger
than the model's embedding are start-up errors naming --tokenizer (the last with both sizes)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import pytest
from conftest import make_hf_checkpoint, make_sp_tokenizer

import cli_args
import server
from config import EngineConfig
from llm import LLM, SamplingParams
from sampling_params import StructuredOutputsParams

SHAPES = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=16, warmup=False)
QUIET = dict(log=lambda *_: None)
TEXT = "the capital of France is Paris"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
MESSAGES = [{"role": "user", "content": "the capital of France"}]


def auto_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[str, str]:
    """(a checkpoint with its own byte-level BPE and ChatML template, a folder holding a
    SentencePiece-style tokenizer of the same vocabulary size with a template of its own)."""
    root = tmp_path_factory.mktemp("tokflag")
    ckpt = make_hf_checkpoint(root / "ckpt", tokenizer=True)
    named = str(root / "sp")
    make_sp_tokenizer(named)
    tok = auto_tokenizer(named)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(named)
    return ckpt, named


def continuation(ref, prompt_ids: list[int], ids: list[int]) -> str:
    """What the output adds to the prompt's text under `ref` (vLLM's detokenizer's text:
    a SentencePiece word keeps its space after the prompt)."""
    whole = ref.decode(prompt_ids + ids, skip_special_tokens=True)
    head = ref.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(head)
    return whole[len(head):]


def test_a_checkpoint_served_with_another_tokenizer_encodes_decodes_chats_and_constrains_with_it(folders):
    ckpt, named = folders
    ref, own = auto_tokenizer(named), auto_tokenizer(ckpt)
    assert len(own) <= len(ref) == 300 and ref.encode(TEXT) != own.encode(TEXT)  # the two can be told apart
    llm = LLM(ckpt, tokenizer=named, **QUIET, **SHAPES)
    # the learnt pieces only: byte pieces of a random model's output need not form UTF-8,
    # whose U+FFFD a whole decode and an incremental one place differently
    pieces = sorted(i for t, i in ref.get_vocab().items() if not t.startswith("<"))
    out = llm.generate([TEXT], SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=pieces))[0]
    assert out.prompt_token_ids == ref.encode(TEXT)
    ids = list(out.outputs[0].token_ids)
    assert len(ids) == 6 and out.outputs[0].text == continuation(ref, out.prompt_token_ids, ids)

    chat = llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0))[0]
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert want.startswith("[user] the capital")  # the named folder's template, not the checkpoint's ChatML
    assert chat.prompt == want and chat.prompt_token_ids == ref.encode(want, add_special_tokens=False)

    # structured outputs: the grammar's token table is the named tokenizer's
    choice = StructuredOutputsParams(choice=["Paris", "London"])
    done = llm.generate([TEXT], SamplingParams(max_tokens=8, temperature=0, structured_outputs=choice))[0].outputs[0]
    assert done.text in ("Paris", "London") and ref.decode(list(done.token_ids), skip_special_tokens=True) == done.text
    assert own.decode(list(done.token_ids)) != done.text


def test_the_tokenizers_eos_stops_beside_the_models_own_stop_ids(folders, tmp_path):
    ckpt, named = folders
    unk_eos = str(tmp_path / "unk-eos")
    tok = auto_tokenizer(named)
    tok.eos_token = "<unk>"
    tok.save_pretrained(unk_eos)
    assert auto_tokenizer(unk_eos).eos_token_id == 0
    with open(os.path.join(ckpt, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2  # the model's generation config's, as its config.json's

    def first_tokens(llm: LLM, token: int) -> tuple[list[int], str]:
        out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=3, temperature=0, logit_bias={token: 100}))
        return list(out[0].outputs[0].token_ids), out[0].outputs[0].finish_reason

    llm = LLM(ckpt, tokenizer=unk_eos, **QUIET, **SHAPES)
    assert llm.engine.model_config.eos_token_ids == (0, 2)  # the tokenizer's first (vLLM's primary EOS)
    assert first_tokens(llm, 0) == ([0], "stop") and first_tokens(llm, 2) == ([2], "stop")
    del llm
    own = LLM(ckpt, **QUIET, **SHAPES)  # without the flag id 0 is no EOS
    assert own.engine.model_config.eos_token_ids == (2,) and first_tokens(own, 0) == ([0, 0, 0], "length")
    del own
    # The same holds without the flag for a checkpoint whose own tokenizer says so (vLLM's
    # primary EOS is the tokenizer's, whatever config.json says).
    ckpt_unk = shutil.copytree(ckpt, tmp_path / "ckpt-unk-eos")
    auto_tokenizer(unk_eos).save_pretrained(ckpt_unk)
    mine = LLM(str(ckpt_unk), **QUIET, **SHAPES)
    assert mine.engine.model_config.eos_token_ids == (0, 2)
    assert first_tokens(mine, 0) == ([0], "stop") and first_tokens(mine, 2) == ([2], "stop")


def test_a_builtin_random_model_takes_a_smaller_tokenizer_with_its_eos_alone(folders):
    _, named = folders
    ref = auto_tokenizer(named)
    llm = LLM("tiny", tokenizer=named, **QUIET, **SHAPES)  # 512 embedding rows, 300 token ids
    assert llm.engine.model_config.vocab_size == 512
    assert llm.engine.model_config.eos_token_ids == (2,)  # the named tokenizer's; not the byte tokenizer's 257
    out = llm.generate([TEXT], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.prompt_token_ids == ref.encode(TEXT)


def test_an_orbax_checkpoint_serves_the_named_tokenizer(folders, tmp_path):
    import checkpoint
    from model_loader import load_model

    _, named = folders
    checkpoint.save(load_model("tiny"), str(tmp_path / "orbax"))
    llm = LLM(str(tmp_path / "orbax"), tokenizer=named, **QUIET, **SHAPES)
    assert llm.engine.model_config.eos_token_ids == (2,)
    assert llm.generate([TEXT], SamplingParams(max_tokens=1))[0].prompt_token_ids == auto_tokenizer(named).encode(TEXT)


def test_tokenize_and_detokenize_use_the_named_tokenizer(folders):
    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine

    _, named = folders
    ref = auto_tokenizer(named)
    engine = AsyncEngine(EngineConfig(model="tiny", tokenizer=named, max_num_seqs=2, max_model_len=128, warmup=False),
                         log=lambda *_: None)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())

    async def calls() -> list[dict]:
        app = server.app_from_args(engine, cli_args.build_parser().parse_args([]))
        async with TestClient(TestServer(app)) as client:
            out = []
            for path, body in (("/tokenize", {"prompt": TEXT}), ("/tokenize", {"messages": MESSAGES}),
                               ("/detokenize", {"tokens": ref.encode(TEXT)})):
                resp = await client.post(path, json=body)
                assert resp.status == 200, await resp.text()
                out.append(json.loads(await resp.text()))
            return out

    try:
        text, chat, detok = loop.run_until_complete(asyncio.wait_for(calls(), 300))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    assert text["tokens"] == ref.encode(TEXT)
    rendered = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == ref.encode(rendered, add_special_tokens=False)
    assert detok["prompt"] == ref.decode(ref.encode(TEXT), skip_special_tokens=False)


def test_bad_values_are_start_up_errors_naming_the_flag(folders, tmp_path, capsys):
    import gguf_loader

    ckpt, named = folders
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for value, says in ((str(tmp_path / "none"), "no such folder or file"),
                        (str(tmp_path / "empty"), "the folder holds no Hugging Face tokenizer"),
                        (str(tmp_path / "file.txt"), "is a file, not a folder holding a Hugging Face tokenizer")):
        with pytest.raises(ValueError, match=re.escape(f"--tokenizer '{value}'") + f".*{says}"):
            EngineConfig(model="tiny", tokenizer=value)  # before any model loads
        with pytest.raises(SystemExit) as e:
            server.main(["--model", "tiny", "--port", "0", "--tokenizer", value])
        assert e.value.code == 2 and f"--tokenizer '{value}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tokenizer must be a string or None"):
        EngineConfig(tokenizer=3)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"--tokenizer '{broken}': ") + ".*its tokenizer files do not load"):
        LLM(ckpt, tokenizer=str(broken), **QUIET, **SHAPES)

    # a vocabulary past the embedding: smollm2's 49152 ids on a model of 300 rows (a .gguf file's tokenizer)
    smollm2 = gguf_loader.resolve_builtin("smollm2", log=lambda _: None)
    with pytest.raises(ValueError, match=r"--tokenizer .*: its vocabulary has 49152 token ids, more than the "
                                         r"model's 300 embedding rows \(vocab_size\): ids 300\.\.49151"):
        LLM(ckpt, tokenizer=smollm2, **QUIET, **SHAPES)


def test_a_models_own_tokenizer_past_its_embedding_is_refused_at_load_naming_the_model(folders, tmp_path):
    """As --tokenizer's: ids from the checkpoint's own tokenizer must have embedding rows.
    Fewer ids than vocab_size (padding rows) load, as every other test here does."""
    ckpt, _ = folders
    own = auto_tokenizer(ckpt)
    n = max(own.get_vocab().values()) + 1
    assert n < 300  # the fixture's: a smaller vocabulary than the model's 300 rows
    grown = str(tmp_path / "grown")
    shutil.copytree(ckpt, grown)
    own.add_tokens([f"<extra_{i}>" for i in range(300 - n + 2)])  # ids n..301
    own.save_pretrained(grown)
    assert max(auto_tokenizer(grown).get_vocab().values()) == 301
    with pytest.raises(ValueError, match=re.escape(f"the tokenizer of '{grown}': its vocabulary has 302 token ids, "
                                                   "more than the model's 300 embedding rows (vocab_size): "
                                                   "ids 300..301")):
        LLM(grown, **QUIET, **SHAPES)


def test_an_empty_tokenizer_is_unset_on_the_command_line_in_a_config_file_and_offline(folders, tmp_path):
    """vLLM's --tokenizer '' (its nullable_str; EngineArgs: `if not self.tokenizer: self.tokenizer
    = self.model`): the model's own tokenizer, not a path that does not exist."""
    import config_file

    ckpt, named = folders
    assert EngineConfig(model="tiny", tokenizer="").tokenizer is None
    parser = cli_args.build_parser()
    args = config_file.parse_args(parser, ["--model", "tiny", "--tokenizer", ""])
    assert cli_args.engine_config(args).tokenizer is None
    (tmp_path / "c.yaml").write_text("model: tiny\ntokenizer: ''\n")
    args = config_file.parse_args(cli_args.build_parser(), ["--config", str(tmp_path / "c.yaml")])
    assert args.tokenizer == "" and cli_args.engine_config(args).tokenizer is None

    own, ref = auto_tokenizer(ckpt), auto_tokenizer(named)
    assert own.encode(TEXT) != ref.encode(TEXT)
    llm = LLM(ckpt, tokenizer="", **QUIET, **SHAPES)
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, temperature=0))[0]
    assert out.prompt_token_ids == own.encode(TEXT)
    short = [{"role": "user", "content": "hi"}]  # the checkpoint's ChatML in its small byte-level BPE
    chat = llm.chat(short, SamplingParams(max_tokens=1, temperature=0))[0]
    want = own.apply_chat_template(short, tokenize=False, add_generation_prompt=True)
    assert want.startswith("<|im_start|>user")  # the checkpoint's ChatML, not the other folder's template
    assert chat.prompt == want and chat.prompt_token_ids == own.encode(want, add_special_tokens=False)
