"""Small things a newcomer hit in their first hour (issue 27): an OS error at start names its
path; a GGUF model's weight format is the file's own (its block types), not the weight_format
setting it ignores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from npud.config import ModelEntry
from npud.registry import ModelRegistry, weight_format
from test_npud_support import REPO, short_tempdir

PLAIN_UID, NOGROUP = 64014, 65534


def _as_plain_user() -> tuple[list[str], str] | None:
    """(command prefix, python) that run as a user file modes apply to, or None when impossible."""
    if os.geteuid() != 0:
        return [], sys.executable
    if not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK):
        return None
    done = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True)
    if done.stdout.strip() != str(sys.version_info[:2]):
        return None
    return ["setpriv", f"--reuid={PLAIN_UID}", f"--regid={NOGROUP}", "--clear-groups", "--"], "/usr/bin/python3"


@pytest.mark.skipif(_as_plain_user() is None, reason="as root, needs setpriv and /usr/bin/python3 of this version")
@pytest.mark.parametrize("where", ["socket", "socket-parent"])
def test_a_socket_in_an_unwritable_directory_names_its_path(where):
    prefix, python = _as_plain_user()
    workdir = short_tempdir()
    try:
        closed, state = workdir / "closed", workdir / "state"
        closed.mkdir(mode=0o555)
        state.mkdir(mode=0o777)
        state.chmod(0o777)
        socket_path = closed / "npud.sock" if where == "socket" else closed / "sub" / "npud.sock"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "PYTHONNOUSERSITE": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])}
        done = subprocess.run([*prefix, python, "-m", "npud", "--model", str(REPO / "npud" / "models" / "pycode-base"),
                               "--socket", str(socket_path), "--state-dir", str(state / "npud"), "--log-format", "json"],
                              capture_output=True, text=True, timeout=120, env=env, cwd=workdir)
        assert done.returncode == 1, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        named = socket_path if where == "socket" else socket_path.parent
        assert last.startswith(f"npud: error: {named}: ") and "Permission denied" in last, last
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class Described:
    """A loaded model as the registry sees it: only describe() matters here."""

    nbytes, max_context, fim = 10, 64, False

    def __init__(self, mix):
        self.mix = mix

    def describe(self) -> dict:
        return {"checkpoint": {"quant_mix": self.mix}} if self.mix is not None else {"checkpoint": {}}


def test_a_gguf_model_reports_its_block_types_not_the_setting():
    gguf = ModelEntry(name="g", checkpoint_dir="/m/gemma-3-270m-q4_k_m.gguf")
    assert gguf.weight_format == "bf16"  # the setting's default, which a GGUF's blocks ignore
    assert weight_format(gguf, None) == "gguf"  # not loaded yet: the file's header is not read
    assert weight_format(gguf, Described({"Q4_K": 27, "Q6_K": 9}).describe()) == "gguf: Q4_K 27, Q6_K 9"
    directory = ModelEntry(name="d", checkpoint_dir="/m/qwen", weight_format="int8")
    assert weight_format(directory, Described(None).describe()) == "int8"
    registry = ModelRegistry([gguf, directory], max_resident_bytes=100, loader=lambda name, *a, **k: Described(
        {"Q8_0": 3} if name == "g" else None))
    assert [m["weight_format"] for m in registry.describe()] == ["gguf", "int8"]
    registry.get("g")
    assert [m["weight_format"] for m in registry.describe()] == ["gguf: Q8_0 3", "int8"]


# -- issue 42: the command line a newcomer from llama-server or Ollama tries ------------------------

def _entries(argv: list[str]):
    from npud import main as npud_main

    return npud_main.model_entries(npud_main._parser().parse_args(argv))


def test_weight_format_and_threads_are_set_per_model_on_the_command_line(tmp_path):
    """`--weight-format` and `--threads` set the --model before them; before any --model, every
    --model's (item 7). Speed needed a TOML file before."""
    a, b = tmp_path / "a.gguf", tmp_path / "b"
    a.write_bytes(b"GGUF")
    b.mkdir()
    first, second = _entries(["--threads", "1", "--model", str(a), "--weight-format", "gguf-q8",
                              "--model", str(b), "--threads", "2"])
    assert (first.name, first.weight_format, first.threads) == ("a", "gguf-q8", 1)
    assert (second.name, second.weight_format, second.threads) == ("b", "bf16", 2)
    (only,) = _entries(["--model", str(b), "--weight-format", "int8"])
    assert (only.weight_format, only.threads) == ("int8", 0)
    done = subprocess.run([sys.executable, "-m", "npud", "--model", str(b), "--weight-format", "gguf-q8",
                           "--check-config"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "gguf-q8" in done.stderr and "is for .gguf files" in done.stderr
    sample = (REPO / "systemd" / "npud.toml").read_text()
    assert "weight_format\n# does not apply" not in sample and "does not apply" not in sample.split("[[models]]")[1]
    assert 'weight_format = "gguf-q8"' in sample and "--weight-format gguf-q8" in sample


def test_an_unknown_model_name_says_which_short_names_npud_knows():
    """`npud --model llama3.2`, as an Ollama user types it (item 10): the packaged short names
    and that npud never downloads, not a bare "no such file"."""
    done = subprocess.run([sys.executable, "-m", "npud", "--model", "llama3.2", "--check-config"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2
    assert "gemma-3-270m" in done.stderr and "never downloads" in done.stderr, done.stderr
