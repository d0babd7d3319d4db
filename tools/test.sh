#!/usr/bin/env bash
# The README's test command: make a virtual environment, install npud with its test
# extras, run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest "$@"
