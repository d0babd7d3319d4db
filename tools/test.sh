#!/usr/bin/env bash
# The README's test command: make a virtual environment, install npud with its test
# extras, run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# the DFlash reference for tests/test_dflash.py, without its benchmark-only pins (pyproject.toml)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps dflash==0.1.0
# the host GEMMs: compiled once with gcc into the kernel cache (~/.cache/npud), reused by every start
.venv/bin/python -m npud.kernels.host
exec .venv/bin/python -m pytest "$@"
