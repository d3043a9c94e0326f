"""bench/gpu_check.sh runs every stage with one Python: PYTHON= when set, else the README's
virtual environment (.venv/bin/python) when the checkout has one, else python3 from PATH.
Checked here with stand-in interpreters that only record their calls, so the script's whole
plumbing runs in a second, without a GPU or JAX."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
from conftest import ROOT

STAND_IN = "#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/calls.log\"\n"


def stand_in(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("venv, python_env, used", [(True, False, "venv"), (False, False, "path"),
                                                     (True, True, "env")])
def test_the_check_runs_the_venvs_python_unless_python_is_set(tmp_path, venv, python_env, used):
    checkout = tmp_path / "checkout"
    (checkout / "bench").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "bench", "gpu_check.sh"), checkout / "bench")
    pythons = {"venv": checkout / ".venv" / "bin" / "python", "path": tmp_path / "path" / "python3",
               "env": tmp_path / "env" / "python"}
    stand_in(pythons["path"])
    if venv:
        stand_in(pythons["venv"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {
        "PATH": f"{pythons['path'].parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    if python_env:
        env["PYTHON"] = stand_in(pythons["env"])
    subprocess.run(["bash", str(checkout / "bench" / "gpu_check.sh"), "--cpu-smoke"], env=env, cwd=tmp_path,
                   capture_output=True, text=True, timeout=300)
    calls = {name: (p.parent / "calls.log").read_text() if (p.parent / "calls.log").exists() else ""
             for name, p in pythons.items()}
    assert "bench/gpu_mix.py --tiny" in calls[used] and "bench/gpu_check_report.py" in calls[used], calls
    assert not any(text for name, text in calls.items() if name != used), calls
