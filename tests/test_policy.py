"""Scheduling policies: the refactor changed nothing, and priority does what vLLM's does."""

from __future__ import annotations

import json

import pytest
from scheduler_traces import CASES, FIXTURE, trace_of

with open(FIXTURE) as f:
    RECORDED = json.load(f)


@pytest.mark.parametrize("config,seed", CASES, ids=[f"{c}/{s}" for c, s in CASES])
def test_continuous_and_static_reproduce_the_recorded_step_traces(config, seed):
    """Recorded from the scheduler before the policy seam: same admissions, chunks,
    preemptions, releases, slots, blocks and wait reasons, step for step."""
    assert trace_of(config, seed) == RECORDED[f"{config}/{seed}"]
