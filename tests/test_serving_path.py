"""The serving path needs no torch: the README's server and the offline LLM run where
`import torch` fails, and the GGUF tokenizer they use (built from the file's metadata)
is transformers' own, id for id.

torch is installed for the tests (it is the reference here), so the subprocesses hide it
with a path finder that finds no `torch`, as if it were not installed. Both subprocesses
use test_real_model's engine shapes, so they share its compiled programs (conftest's
compilation cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gguf_loader
from conftest import hf_greedy
from test_server import request, running_server

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]  # the README's
SHAPES = ["--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "128", "--num-kv-blocks", "96"]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "  Leading spaces,\n\ntrailing newlines\n\n"},
     {"role": "user", "content": "Emoji 🙂👍🏽🇫🇷 and CJK: 日本語のテキスト、中文，한국어"}],
    [{"role": "user", "content": " x"}, {"role": "assistant", "content": "\n  y \t"}, {"role": "user", "content": "\n"}],
]

NO_TORCH = '''
import importlib.machinery
import sys


class PathFinderWithoutTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] == "torch" else super().find_spec(name, path, target)


sys.meta_path[:] = [PathFinderWithoutTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


@pytest.fixture(scope="module")
def smollm2() -> str:
    return gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2), gguf_file=os.path.basename(smollm2))


@pytest.fixture(scope="module")
def env_without_torch(tmp_path_factory) -> dict[str, str]:
    """Environment for a subprocess in which torch cannot be imported (sitecustomize runs
    before anything else imports)."""
    folder = tmp_path_factory.mktemp("no-torch")
    (folder / "sitecustomize.py").write_text(NO_TORCH)
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]), "PYTHONUNBUFFERED": "1"}


def test_the_blocker_hides_torch(env_without_torch) -> None:
    code = "import importlib.util, sys\nassert importlib.util.find_spec('torch') is None\ntry:\n import torch\nexcept ModuleNotFoundError:\n sys.exit(7)"
    assert subprocess.run([sys.executable, "-c", code], env=env_without_torch).returncode == 7


def test_the_gguf_tokenizer_is_transformers_id_for_id_on_smollm2(smollm2, reference_tokenizer) -> None:
    from tokenizer import load_tokenizer

    ours, ref = load_tokenizer(smollm2), reference_tokenizer
    for conversation in CONVERSATIONS:
        text = ours.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert text == ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    plain = " Grüße,\n\n  naïve café 😀 你好 "
    assert ours.encode(plain) == ref.encode(plain) and ours.decode(ours.encode(plain)) == plain
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                         ref.pad_token_id)
    assert ours.all_special_ids == ref.all_special_ids and len(ours) == len(ref)
    assert ours.convert_tokens_to_ids("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")


def test_without_torch_the_server_answers_the_readme_question(env_without_torch) -> None:
    with running_server("--model", "smollm2", *SHAPES, "--no-warmup", env=env_without_torch) as srv:
        status, out = request(srv, "POST", "/v1/chat/completions", {"messages": QUESTION, "temperature": 0}, key=None)
    assert status == 200, out
    assert "Paris" in out["choices"][0]["message"]["content"] and out["choices"][0]["finish_reason"] == "stop", out


OFFLINE = textwrap.dedent('''
    import json, sys
    import jax
    from llm import LLM, SamplingParams

    gguf_path, hf_dir, question, conversations, template = sys.argv[1:]
    question, conversations = json.loads(question), json.loads(conversations)
    llm = LLM(gguf_path, log=lambda *_: None, max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128,
              num_kv_blocks=96, warmup=False)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    [answer] = llm.chat(question, SamplingParams(temperature=0.0, max_tokens=48))
    continued = llm.chat(conversations, one, add_generation_prompt=False, continue_final_message=True)
    [templated] = llm.chat(question, one, chat_template=template)
    [generated] = llm.generate(["The capital of France is"], one)
    # The full optimisation this subprocess got is for smollm2: the random tiny checkpoint's 8
    # tokens run as fast unoptimised, and its part of this script then takes 5 CPU-s, not 8.5.
    jax.config.update("jax_disable_most_optimizations", True)
    hf = LLM(hf_dir, log=lambda *_: None, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=128,
             num_kv_blocks=64, warmup=False)
    [fox] = hf.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    print(json.dumps(dict(
        answer=[answer.outputs[0].text, answer.outputs[0].finish_reason],
        continued=[o.prompt_token_ids for o in continued], templated=templated.prompt_token_ids,
        generated=[generated.prompt_token_ids, generated.outputs[0].token_ids],
        fox=[fox.prompt_token_ids, fox.outputs[0].token_ids, fox.outputs[0].text],
        torch_loaded="torch" in sys.modules)))
''')


def test_without_torch_llm_chats_and_generates_from_a_gguf_file_and_an_hf_directory(
        smollm2, reference_tokenizer, hf_checkpoint, env_without_torch) -> None:
    hf_dir = hf_checkpoint("llama2", tokenizer=True)  # saved by torch here, loaded without it there
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    proc = subprocess.run([sys.executable, "-c", OFFLINE, smollm2, hf_dir, json.dumps(QUESTION),
                           json.dumps(CONVERSATIONS[1:]), template],
                          cwd=ROOT, env=env_without_torch, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not got["torch_loaded"]

    text, reason = got["answer"]
    assert "Paris" in text and reason == "stop"
    ref = reference_tokenizer
    for ids, conversation in zip(got["continued"], CONVERSATIONS[1:]):
        want = ref.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True,
                                       tokenize=False)
        assert ids == ref.encode(want, add_special_tokens=False)
    assert got["templated"] == ref.encode("[user] What is the capital of France?\n", add_special_tokens=False)
    prompt, tokens = got["generated"]
    assert prompt == ref.encode("The capital of France is") and len(tokens) == 1

    prompt, tokens, fox_text = got["fox"]
    assert tokens == hf_greedy(hf_dir, prompt, 8) and isinstance(fox_text, str)
