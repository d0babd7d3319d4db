"""Write docs/man/npuctl.1 from npuctl's argparse parser (npud/clients/manpage.py).

    python tools/gen_manpage.py          # rewrite docs/man/npuctl.1
    python tools/gen_manpage.py --check  # exit 1 when the committed page differs
    man -l docs/man/npuctl.1             # read it

tests/test_manpage.py fails when the committed page is not what this writes, so a new
option cannot be missing from the page.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from npud.clients.manpage import render  # noqa: E402
from npud.clients.npuctl import EXIT_CODES_HELP, build_parser  # noqa: E402
from npud import __version__  # noqa: E402

TARGET = REPO / "docs" / "man" / "npuctl.1"


def page() -> str:
    return render(build_parser(), __version__, EXIT_CODES_HELP)


def main(argv: list[str]) -> int:
    text = page()
    if argv == ["--check"]:
        current = TARGET.read_text() if TARGET.exists() else None
        if current != text:
            print(f"{TARGET.relative_to(REPO)} is stale: run python tools/gen_manpage.py", file=sys.stderr)
            return 1
        return 0
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
