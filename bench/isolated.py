"""Run a benchmark's function in a fresh interpreter, for the engines npud must not share a process with.

Beside npud's kernels another engine would run in a process that is not the one its users run:
for a hybrid model npud starts numba's libgomp threads with OMP_WAIT_POLICY=passive
(npud/kernels/host/recurrent.py) and torch uses the same libgomp, which reads the policy once per
process; npud's thread pools and its freed model memory are there too. In bench/decode.py transformers' bf16 decode ran at
6.7-8.7 tok/s in npud's process; alone, 9.4-11.0 in one A/B run (the machine's noise is of
that order too), so every transformers row now runs alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent

_CHILD = "import json, sys; from {module} import {function} as f; print(json.dumps(f(*json.loads(sys.argv[1]))))"


def run_isolated(module: str, function: str, *args):
    """`module.function(*args)` (JSON in, JSON out) in a new python; its last line of output is the result.

    Raises subprocess.CalledProcessError (with the child's stderr) when it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH), str(BENCH.parent), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _CHILD.format(module=module, function=function), json.dumps(args)],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, f"{module}.{function}", res.stdout, res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])
