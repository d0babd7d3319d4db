"""docs/man/npuctl.1 is what tools/gen_manpage.py writes from npuctl's parser
(npud/clients/manpage.py), so it cannot go stale: change an option, run the tool, commit both."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest

from npud.clients.npuctl import EXIT_CODES_HELP, build_parser
from npud import __version__
from npud_fixture import REPO


def _tool():
    spec = importlib.util.spec_from_file_location("gen_manpage", REPO / "tools" / "gen_manpage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_current():
    assert _tool().main(["--check"]) == 0, "docs/man/npuctl.1 is stale: run python tools/gen_manpage.py"


def test_a_new_option_makes_the_page_stale(tmp_path, monkeypatch):
    tool = _tool()
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command")
    subs.choices["jobs"].add_argument("--owner", metavar="USER", help="only the jobs of USER")
    from npud.clients.manpage import render

    page = render(parser, __version__, EXIT_CODES_HELP)
    assert ".TP\n\\fB\\-\\-owner\\fR \\fIUSER\\fR\nonly the jobs of USER\n" in page
    monkeypatch.setattr(tool, "page", lambda: page)
    assert tool.main(["--check"]) == 1
    monkeypatch.setattr(tool, "TARGET", tmp_path / "npuctl.1")
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0


def test_every_command_and_option_is_on_the_page():
    page = (REPO / "docs" / "man" / "npuctl.1").read_text()
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subs.choices.items():
        assert f'.SS "{name}"' in page, name
        for action in sub._actions:
            for option in action.option_strings:
                assert "\\fB" + option.replace("-", "\\-") + "\\fR" in page, (name, option)
    assert '.SS "cache ls"' in page and ".SH EXIT STATUS AND ENVIRONMENT" in page
    assert page.count("130  interrupted (Ctrl\\-C)") == 1  # the shared epilog once, not per command


def test_man_renders_it_without_warnings():
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed (apt-get install -y groff)")
    run = subprocess.run(["groff", "-man", "-ww", "-Tutf8", str(REPO / "docs" / "man" / "npuctl.1")],
                         capture_output=True, timeout=60)
    assert run.returncode == 0 and run.stderr == b"", run.stderr
    text = run.stdout.decode()
    assert "npuctl - Talk to npud, the local LLM daemon" in text.replace("\u2010", "-").replace("\u2212", "-")
