"""docs/interfaces.md is what tools/gen_interfaces.py writes from npud/engine/api.py, so it cannot go
stale: change the boundary, run the tool, commit both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("gen_interfaces", REPO / "tools" / "gen_interfaces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_current():
    tool = _tool()
    assert (REPO / "docs" / "interfaces.md").read_text() == tool.render((REPO / "npud" / "engine" / "api.py").read_text()), (
        "docs/interfaces.md is stale: run python tools/gen_interfaces.py")


def test_a_changed_boundary_makes_the_page_stale(tmp_path, monkeypatch):
    tool = _tool()
    source = (REPO / "npud" / "engine" / "api.py").read_text()
    changed = source.replace("    use_prefix_cache: bool = True\n",
                             "    use_prefix_cache: bool = True\n    min_tokens: int = 0  # a new parameter\n", 1)
    assert changed != source
    page = tool.render(changed)
    assert "- `min_tokens: int = 0` — a new parameter" in page
    monkeypatch.setattr(tool, "TARGET", REPO / "docs" / "interfaces.md")
    monkeypatch.setattr(tool, "SOURCE", tmp_path / "api.py")
    (tmp_path / "api.py").write_text(changed)
    assert tool.main(["--check"]) == 1
    (tmp_path / "api.py").write_text(source)
    assert tool.main(["--check"]) == 0
