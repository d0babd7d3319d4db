"""The layers import only downwards: clients -> npud (its protocol) -> engine.api and the
factory engine.loader -> engine -> kernels; engine.api imports nothing of the engine back.
The layers are npud's subpackages npud.clients, npud.engine and npud.kernels and the daemon (the
rest of npud); below, a module or path names its layer without the `npud.` in front. An AST walk over every module's imports (function-level ones included), checked on
the real tree and shown to fail on a fixture tree with each kind of violation planted."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STDLIB = frozenset(sys.stdlib_module_names)
IO_MODULES = ("trio", "sqlite3", "socket")  # the daemon's world; the engine never sees it


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at_top_level) of every import in a file; `from x import y` gives x.y as
    well as x, so that importing a submodule by name is seen."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level are top level too
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    package = path.parent.name
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                base = ".".join([package] + ([base] if base else []))
            out.append((base, node.lineno, id(node) in top))
            out += [(f"{base}.{a.name}", node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__"):
                arg = node.args[0] if node.args else None
                target = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "<dynamic>"
                out.append((f"<importlib>{target}", node.lineno, False))
    return out


SUBLAYERS = ("clients", "engine", "kernels")


def _short(module: str) -> str:
    """npud.engine.api -> engine.api: the name of a module in the layer rules below."""
    head, _, rest = module.partition("npud.")
    if head == "" and rest.split(".")[0] in SUBLAYERS:
        return rest
    return module


def _layer_path(rel: Path) -> Path:
    """npud/engine/api.py -> engine/api.py; a daemon module keeps its npud/."""
    if len(rel.parts) > 2 and rel.parts[0] == "npud" and rel.parts[1] in SUBLAYERS:
        return Path(*rel.parts[1:])
    return rel


def _under(module: str, *roots: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def violations(root: Path) -> list[str]:
    """Every import in root's npud/ (npud/clients/, npud/engine/, npud/kernels/, the daemon) that breaks the layering,
    as "path:line: rule"; empty when the tree is clean."""
    found = []
    layers = ("clients", "npud", "engine", "kernels")
    for path in sorted((root / "npud").rglob("*.py")):
        rel = _layer_path(path.relative_to(root))
        layer = rel.parts[0]
        assert layer in layers, rel
        for module, line, top in _imports(path):
            module = _short(module)
            where = f"{path.relative_to(root)}:{line}: "
            if module.startswith("<importlib>"):
                target = _short(module.removeprefix("<importlib>"))
                if layer in ("npud", "clients") and (target == "<dynamic>" or _under(target, "engine", "kernels")):
                    found.append(where + f"{layer} reaches {target} through importlib (import engine.api directly)")
                continue
            if layer == "clients" and (_under(module, "engine", "kernels") or (
                    _under(module, "npud") and module not in ("npud", "npud.__version__")
                    and not _under(module, "npud.protocol"))):
                found.append(where + f"clients import only npud.protocol of the daemon, not {module}")
            if layer == "npud":
                if _under(module, "engine") and not _under(module, "engine.api", "engine.loader"):
                    found.append(where + f"npud sees the engine only through engine.api and engine.loader, not {module}")
                # the driver's ioctls (power mode, contexts): a module of the standard library only,
                # checked by the rule below, that touches no tensor
                if _under(module, "kernels", "numpy") and not _under(module, "kernels.amdxdna"):
                    found.append(where + f"npud never touches a tensor ({module})")
            if layer in ("engine", "kernels"):
                if _under(module, "npud", "clients", *IO_MODULES):
                    found.append(where + f"{layer} never imports {module}")
            if layer == "kernels" and _under(module, "engine"):
                found.append(where + f"kernels sit below the engine ({module})")
            if rel in (Path("engine/api.py"), Path("engine/loader.py"), Path("kernels/errors.py"),
                       Path("kernels/host/cache.py"), Path("kernels/cachedir.py"), Path("kernels/amdxdna.py")):
                stdlib = module.split(".")[0] in STDLIB or module.startswith("__future__")
                # the backends' errors (DeviceFault) are re-exported: a module that is itself
                # standard library only, checked by this same rule
                if rel == Path("engine/api.py") and module in ("kernels", "kernels.errors"):
                    continue
                # the cache directory's module: standard library at import (numba only when its
                # own cache is asked for), as engine.loader reaches it from the daemon
                if rel == Path("kernels/host/cache.py") and not top:
                    continue
                # the cache directory and its trust rule, from a module that is itself standard
                # library only (checked by this same rule), which logs through structlog when called
                if rel == Path("kernels/host/cache.py") and _under(module, "kernels.cachedir"):
                    continue
                if rel == Path("kernels/cachedir.py") and not top:
                    continue
                # the factory: engine.api's types at the top, the engine proper when called (and
                # only there); engine.api itself imports nothing of the engine
                if rel == Path("engine/loader.py") and (_under(module, "engine.api") or (
                        not top and _under(module, "engine.session"))):
                    continue
                # the cache directory's one rule and its trust check (npud/packaged.py, the daemon
                # and npud/userdirs.py read them here), from a module that is itself standard
                # library only, checked by this same rule
                if rel == Path("engine/loader.py") and not top and module == "kernels.cachedir":
                    continue
                if not stdlib:
                    found.append(where + f"{rel.with_suffix('').as_posix().replace('/', '.')} is standard library only ({module})")
    return found


def test_the_tree_keeps_its_layers():
    assert violations(REPO) == []


def test_npud_reaches_the_engine_only_through_engine_api_and_its_loader():
    daemon = [p for p in (REPO / "npud").rglob("*.py") if _layer_path(p.relative_to(REPO)).parts[0] == "npud"]
    npud = [_short(m) for p in daemon for m, _, _ in _imports(p) if _under(_short(m), "engine")]
    assert npud and all(_under(m, "engine.api", "engine.loader") for m in npud)


CLEAN = {
    "npud/clients/c.py": "import socket\nfrom npud.protocol import encode\nfrom npud import __version__\n",
    "npud/n.py": "import trio\nimport importlib\nfrom npud.engine.api import GenerateRequest\n"
                 "importlib.import_module('pyxrt')\n",
    "npud/engine/__init__.py": "",
    "npud/engine/e.py": "import numpy as np\nfrom npud.engine.api import ConfigError\nfrom npud.kernels import base\n",
    "npud/engine/api.py": "import enum\nfrom dataclasses import dataclass\nfrom npud.kernels import errors\n",
    "npud/engine/loader.py": "from pathlib import Path\nfrom npud.engine.api import ServedModel\n\n"
                        "def load_model():\n    from npud.engine.session import LoadedModel\n",
    "npud/kernels/errors.py": "class DeviceFault(RuntimeError):\n    pass\n",
    "npud/kernels/k.py": "import numpy as np\nimport structlog\n",
}

PLANTED = [
    ("npud/clients/c.py", "from npud.engine.api import GenerateRequest\n", "clients import only npud.protocol"),
    ("npud/clients/c.py", "from npud.jobs import JobManager\n", "clients import only npud.protocol"),
    ("npud/n.py", "from npud.engine.session import LoadedModel\n", "only through engine.api"),
    ("npud/n.py", "import npud.engine.generate\n", "only through engine.api"),
    ("npud/n.py", "def f():\n    from npud.engine import session\n", "only through engine.api"),
    ("npud/n.py", "importlib.import_module('npud.engine.session')\n", "through importlib"),
    ("npud/n.py", "importlib.import_module(name)\n", "through importlib"),
    ("npud/n.py", "import numpy\n", "never touches a tensor"),
    ("npud/engine/e.py", "import trio\n", "engine never imports trio"),
    ("npud/engine/e.py", "def f():\n    import sqlite3\n", "engine never imports sqlite3"),
    ("npud/engine/e.py", "from socket import socketpair\n", "engine never imports socket"),
    ("npud/engine/e.py", "from npud.protocol import ApiError\n", "engine never imports npud"),
    ("npud/kernels/k.py", "import trio\n", "kernels never imports trio"),
    ("npud/kernels/k.py", "from npud.engine.config import ModelConfig\n", "below the engine"),
    ("npud/engine/api.py", "import numpy as np\n", "standard library only"),
    ("npud/engine/api.py", "from npud.engine.session import LoadedModel\n", "standard library only"),
    ("npud/engine/api.py", "def load_model():\n    from npud.engine.session import LoadedModel\n", "standard library only"),
    ("npud/engine/loader.py", "from npud.engine.session import LoadedModel\n", "standard library only"),
    ("npud/engine/loader.py", "def f():\n    import numpy\n", "standard library only"),
    ("npud/n.py", "from npud.engine.loader import load_model\nfrom npud.engine.forward import Forward\n", "only through engine.api"),
    ("npud/engine/api.py", "def g():\n    import numpy\n", "standard library only"),
    ("npud/engine/api.py", "from npud.kernels import base\n", "standard library only"),
    ("npud/kernels/errors.py", "import numpy as np\n", "kernels.errors is standard library only"),
]


def _tree(root: Path, extra: tuple[str, str] | None = None) -> Path:
    for rel, text in CLEAN.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + (textwrap.dedent(extra[1]) if extra is not None and extra[0] == rel else ""))
    return root


def test_the_clean_fixture_tree_passes(tmp_path):
    assert violations(_tree(tmp_path)) == []


@pytest.mark.parametrize("rel, planted, rule", PLANTED)
def test_a_planted_violation_fails_the_check(tmp_path, rel, planted, rule):
    found = violations(_tree(tmp_path, (rel, planted)))
    assert len(found) >= 1 and all(f.startswith(rel + ":") for f in found), found
    assert any(rule in f for f in found), found


def test_importing_the_daemon_loads_no_engine_beyond_its_api_and_no_numpy():
    # at run time, transitively: what the AST walk checks one import at a time (kernels.errors
    # is engine.api's re-exported DeviceFault, kernels.amdxdna the driver's ioctls, both
    # standard library only)
    code = ("import sys, npud.main, npud.daemon, npud.config\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'numba')\n"
            "             or m.split('.')[:2] in (['npud', 'engine'], ['npud', 'kernels'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    assert out.stdout.split() == ["['npud.engine',", "'npud.engine.api',", "'npud.engine.loader',", "'npud.kernels',",
                                  "'npud.kernels.amdxdna',", "'npud.kernels.errors']"]


def test_engine_api_is_in_no_import_circle():
    """engine.api imports nothing of the engine (not even lazily): the factory that imports the
    engine proper lives in engine.loader, which nothing in the engine imports."""
    api = [m for m, _, _ in _imports(REPO / "npud" / "engine" / "api.py") if _under(_short(m), "engine")]
    assert api == []
    inside = [p for p in (REPO / "npud" / "engine").rglob("*.py")
              if any(_under(_short(m), "engine.loader") for m, _, _ in _imports(p))]
    assert inside == []
