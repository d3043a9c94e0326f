"""docs/ARCHITECTURE.md's recipes, followed literally: the code a recipe shows is taken
from the doc's text and run as written, then a workload runs with what it added. A
recipe that needs an edit anywhere else fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llm import LLM
from policy import POLICIES
from sampling_params import SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"
# test_policy.py's engine shapes: the persistent compilation cache serves most programs
KW = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=256, num_kv_blocks=65, warmup=False)


def recipe_code(title: str) -> str:
    """The first python block under the doc's heading `### {title}`."""
    section = DOC.read_text().split(f"### {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def sjf_registered():
    code = recipe_code("Adding a scheduling policy")
    exec(compile(code, f"{DOC}: Adding a scheduling policy", "exec"), {"__name__": "recipe"})
    try:
        yield
    finally:
        POLICIES.pop("sjf")


def test_adding_a_scheduling_policy_is_one_class_and_one_registration(sjf_registered):
    """Two seats, four requests queued at once: shortest job first admits the two shortest
    and finishes them first; the greedy tokens are FCFS's (a policy changes who runs
    when, not what a request generates)."""
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 3, 9, 5)]
    sjf = LLM("tiny", log=lambda *_: None, scheduling_policy="sjf", record_trace=True, **KW)
    assert type(sjf.engine.scheduler.policy).__name__ == "ShortestJobFirst"
    outs = sjf.generate(prompts, params)
    first = sjf.engine.trace[0]
    assert sorted(rid for rid, _ in first.scheduled) == sorted([outs[1].request_id, outs[3].request_id])
    by_finish = sorted(range(4), key=lambda i: (outs[i].finished_time, i))
    assert by_finish == [1, 3, 2, 0]
    fcfs = LLM("tiny", log=lambda *_: None, **KW).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        sjf.generate(prompts[:1], params[:1], priority=[1])  # SJF does not read priorities


def test_an_unregistered_policy_name_is_refused_naming_the_registered_ones():
    from config import EngineConfig

    with pytest.raises(ValueError, match="scheduling_policy must be fcfs, priority, fair or slo, got 'sjf'"):
        EngineConfig(scheduling_policy="sjf")
