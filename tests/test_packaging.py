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


def test_no_module_of_ours_shadows_an_installed_package():
    """`python bench/x.py` puts bench/ first on sys.path, and pytest puts the checkout there:
    a module of ours named like an installed package (transformers imports `kernels`, Hugging
    Face's kernel hub, when that distribution is installed) would be imported in its place."""
    import importlib.metadata

    installed = {name for name, dists in importlib.metadata.packages_distributions().items()
                 if any(d.lower() != "taxirank" for d in dists)}
    ours = {os.path.basename(p)[:-3] for d in ("", "bench") for p in glob.glob(os.path.join(ROOT, d, "*.py"))}
    assert not ours & installed, sorted(ours & installed)
