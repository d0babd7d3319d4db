"""npud installs one top-level import name, `npud`, and no name another installed distribution
also provides (issue 38: npud's own top-level `kernels` package hid Hugging Face's `kernels`, which
transformers imports, and three test modules stopped collecting on a fresh machine).

Two ways a name of ours can shadow another's: the packages the project installs
(pyproject.toml's packages.find), and the regular packages at the checkout's root, which are first
on sys.path whenever Python runs from the checkout (`python -m pytest`, `python -m npud`)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parent.parent


def installed_names(root: Path) -> set[str]:
    """The top-level import names a checkout at `root` puts in front of site-packages: those its
    pyproject installs, and every regular package or module at its root."""
    find = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    names = {p.split(".")[0] for p in find_packages(str(root), include=find["include"])}
    names |= {p.parent.name for p in root.glob("*/__init__.py")}
    names |= {p.stem for p in root.glob("*.py")}
    return names


def shadowed(names: set[str], providers: dict[str, list[str]]) -> dict[str, list[str]]:
    """name -> the other distributions that provide it, for each of `names` another provides."""
    return {n: sorted(set(providers[n]) - {"npud"}) for n in sorted(names)
            if set(providers.get(n, ())) - {"npud"}}


def test_npud_installs_the_one_import_name_npud():
    assert installed_names(REPO) == {"npud"}


def test_no_import_name_of_npud_is_another_installed_distributions():
    assert shadowed(installed_names(REPO), packages_distributions()) == {}


def test_the_check_sees_a_top_level_package_that_shadows_an_installed_distribution(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "npud").mkdir()
    (tmp_path / "npud" / "__init__.py").write_text("")
    assert shadowed(installed_names(tmp_path), packages_distributions()) == {}
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")  # what main had before issue 38
    assert installed_names(tmp_path) == {"npud", "kernels"}
    assert shadowed(installed_names(tmp_path), {"kernels": ["kernels"], "npud": ["npud"]}) == {"kernels": ["kernels"]}


def test_transformers_finds_its_kernels_from_the_checkout():
    # run from the checkout, where the checkout's root is first on sys.path, as pytest and the demo run
    code = ("import importlib.util, transformers.integrations.hub_kernels\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(spec.origin if spec else 'not installed')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(REPO / "kernels") not in out.stdout and str(REPO / "npud") not in out.stdout, out.stdout
