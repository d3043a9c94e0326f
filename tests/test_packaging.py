"""The plain install serves from anywhere: `pip install -e .` maps exactly the modules that
pyproject.toml lists, so a top-level module missing from that list imports only when the
current directory is the checkout (the README's commands run there; a user's script need not)."""

from __future__ import annotations

import glob
import os
import tomllib

from conftest import ROOT


def test_every_top_level_module_is_installed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["py-modules"])
    on_disk = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert listed == on_disk
