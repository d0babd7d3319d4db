"""npuctl's shell completion (npud/clients/shell_completion.py), run in real shells: bash through
its programmable-completion variables (COMP_WORDS, COMP_CWORD, COMPREPLY), zsh through a
pseudo-terminal (zsh/zpty) that presses Tab after a command line and records what the
completion system offers."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from npud.clients.npuctl import build_parser
from npud.clients.shell_completion import bash_script, zsh_script
from npud_fixture import REPO, python_env

COMMANDS = ["submit", "complete", "chat", "jobs", "status", "result", "cancel", "tickets", "device", "cache", "models", "load", "unload",
            "stats", "completion"]


def bash_complete(line: str, cwd, script: str | None = None) -> list[str]:
    """What bash offers for `line` (the cursor at its end), with the script npuctl prints
    (or `script`)."""
    words = line.split(" ")  # a trailing space is an empty word being completed
    source = "source <(python -m npud.clients.npuctl completion bash)" if script is None else "source ./npuctl.bash"
    if script is not None:
        (cwd / "npuctl.bash").write_text(script)
    array = " ".join("'" + w + "'" for w in words)
    program = (f'cd {str(cwd)!r} && {source} && COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; '
               'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}; _npuctl; printf "%s\\n" "${COMPREPLY[@]}"')
    env = python_env(None)
    env["PATH"] = f"{sys.executable.rsplit('/', 1)[0]}:{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run(["bash", "-c", program.replace("python -m", f"{sys.executable} -m")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    return sorted(x for x in run.stdout.split("\n") if x)


@pytest.fixture
def files(tmp_path):
    for name in ("prompts.jsonl", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "out").mkdir()
    return tmp_path


@pytest.mark.parametrize("line, expected", [
    ("npuctl ", sorted(COMMANDS)),
    ("npuctl c", ["cache", "cancel", "chat", "complete", "completion"]),
    ("npuctl ca", ["cache", "cancel"]),
    ("npuctl cache ", ["drop", "ls", "pin"]),
    ("npuctl cache ls --", ["--help", "--json", "--model", "--socket"]),
    ("npuctl --js", ["--json"]),
    ("npuctl submit --spec ", ["assistant", "auto", "dflash", "draft", "ngram", "none"]),
    ("npuctl submit --spec d", ["dflash", "draft"]),
    ("npuctl submit --format ", ["npud", "openai"]),
    ("npuctl jobs --state r", ["running"]),
    ("npuctl device ", ["clear", "status"]),
    ("npuctl completion ", ["bash", "zsh"]),
    # an option's value is skipped when finding the command: --socket PATH, --model NAME
    ("npuctl --socket device cache ", ["drop", "ls", "pin"]),
    ("npuctl submit --model cache --no", ["--no-prefix-cache"]),
    # paths: the input file, -o and --socket take file names
    ("npuctl submit ", ["notes.txt", "out", "prompts.jsonl"]),
    ("npuctl submit p", ["prompts.jsonl"]),
    ("npuctl submit prompts.jsonl --wait -o n", ["notes.txt"]),
    ("npuctl --socket o", ["out"]),
    # nothing to offer: a job id, a value without choices
    ("npuctl status ", []),
    ("npuctl submit --max-tokens ", []),
])
def test_bash_completes_from_the_parser(files, line, expected):
    assert bash_complete(line, files) == expected


def test_a_new_option_completes_without_editing_a_script(tmp_path):
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command")
    subs.choices["stats"].add_argument("--since-boot", choices=("yes", "no"), help="a new option")
    script = bash_script(parser)
    assert bash_complete("npuctl stats --si", tmp_path, script) == ["--since-boot"]
    assert bash_complete("npuctl stats --since-boot ", tmp_path, script) == ["no", "yes"]
    assert "--since-boot[a new option]:since_boot:(yes no)" in zsh_script(parser)


ZSH_CAPTURE = r"""
zmodload zsh/zpty
zpty z zsh -f -i
wait_for() {  # read the terminal until a line holds $1 as output, not as the echoed command
  local line
  while zpty -r z line; do
    [[ $line == *$1* && $line != *print* ]] && return 0
    [[ $line == *OFFERED:* && $line != *print* ]] && print -r -- "${line##*OFFERED:}"
  done
  return 1
}
zpty -w z "PROMPT='READY>'; bindkey -e; fpath=($1 \$fpath); autoload -U compinit; compinit -u -D; print SETUP-DONE"
wait_for SETUP-DONE
# every match the completion system adds is also printed
zpty -w z 'compadd () { local -a m; builtin compadd -A m "$@"; (( $#m )) && print -l -- "OFFERED:"${^m}; builtin compadd "$@" }; print FN-DONE'
wait_for FN-DONE
# type only once the line editor has the terminal: typed earlier, the line discipline
# would take ^U (kill line) itself
zpty -r z prompt '*READY>'
zpty -w -n z "$2"$'\t'$'\x15'
zpty -w z 'print CAPTURE-DONE'
wait_for CAPTURE-DONE
zpty -d z
"""


@pytest.fixture(scope="module")
def zsh_dir(tmp_path_factory):
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed (apt-get install -y zsh)")
    base = tmp_path_factory.mktemp("zsh")
    run = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "completion", "zsh"], cwd=REPO,
                         env=python_env(None), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (base / "functions").mkdir()
    (base / "functions" / "_npuctl").write_text(run.stdout)
    (base / "capture.zsh").write_text(ZSH_CAPTURE)
    (base / "prompts.jsonl").write_text("")
    assert subprocess.run(["zsh", "-n", str(base / "functions" / "_npuctl")]).returncode == 0
    return base


def zsh_complete(zsh_dir, line: str) -> list[str]:
    run = subprocess.run(["zsh", "-f", str(zsh_dir / "capture.zsh"), str(zsh_dir / "functions"), line],
                         cwd=zsh_dir, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return sorted({x.strip() for x in run.stdout.split("\n") if x.strip()})


@pytest.mark.parametrize("line, expected", [
    ("npuctl ca", ["cache", "cancel"]),
    ("npuctl cache ", ["drop", "ls", "pin"]),
    ("npuctl cache ls --", ["--help", "--json", "--model", "--socket"]),
    ("npuctl submit --spec ", ["assistant", "auto", "dflash", "draft", "ngram", "none"]),
    ("npuctl device ", ["clear", "status"]),
    ("npuctl completion ", ["bash", "zsh"]),
    ("npuctl submit --wait prom", ["prompts.jsonl"]),
])
def test_zsh_completes_from_the_parser(zsh_dir, line, expected):
    assert zsh_complete(zsh_dir, line) == expected
