"""Fill-in-the-middle out of the box (issue 27, item 3): the bundled pycode-base carries
Qwen2.5-Coder's FIM tokens and was trained on FIM examples (tools/train_pair.py --stage fim),
so llama.vim's `/infill` completes code against it through a real daemon, with no download.

The request is llama.vim's (its `llama#fim` body: input_prefix, the cursor line's start as
`prompt`, input_suffix, input_extra chunks, n_predict, n_indent, top_k/top_p, samplers, the
t_max_* limits, response_fields); it sends no temperature, so npud decodes greedily and the
answer is one string. The held-out file below was written for this test, so it is in no
training file. What is checked: the answer is not empty, it ends by itself (EOS before
n_predict: the model knows where the middle stops), and put back between prefix and suffix the
whole file parses. A syntactically valid middle, not an exact one: the 5.8M-parameter model
writes Python-shaped lines whose meaning is often wrong (npud/models/README.md has its
held-out exact-match rate). Mutants: the base before FIM (no FIM tokens: 400) fails all three;
the base after 4 FIM steps of a small smoke run fails two (its middles do not parse).
"""

from __future__ import annotations

import ast

import pytest

from npud_fixture import start_or_clean, stop_daemon
from test_npud_support import REPO, DaemonProc, short_tempdir

pytestmark = pytest.mark.slow  # a real daemon on a real (small) model
httpx = pytest.importorskip("httpx2")

MODELS = REPO / "npud" / "models"
MODEL = "pycode"

# llama.vim's request (autoload/llama.vim, llama#fim): the fields it always sends
LLAMA_VIM = {"n_indent": 8, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": False,
             "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
             "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                 "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                 "timings/predicted_per_token_ms", "timings/predicted_per_second",
                                 "truncated", "tokens_cached"]}
EXTRA = [{"filename": "config.py", "text": "DEFAULT_ENCODING = 'utf-8'\n"}]


@pytest.fixture(scope="module")
def http():
    models = [{"name": MODEL, "checkpoint_dir": str(MODELS / "pycode-base"), "draft_dir": str(MODELS / "pycode-draft")}]
    daemon = start_or_clean(DaemonProc(short_tempdir(), models, limits={"max_prompt_tokens": 1024, "max_tokens": 128}))
    transport = httpx.HTTPTransport(uds=str(daemon.dir / "http.sock"))
    with httpx.Client(transport=transport, base_url="http://npud", timeout=300) as c:
        yield c
    stop_daemon(daemon)


def infill(http, prefix: str, line: str, suffix: str, n_predict: int = 64) -> dict:
    body = {"input_prefix": prefix, "prompt": line, "input_suffix": suffix, "input_extra": EXTRA,
            "n_predict": n_predict, **LLAMA_VIM}
    r = http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# Written for this test (so in no training file): (lines above the cursor, the cursor line up to
# the cursor, the rest of the file). llama.vim sends the cursor line's start, here the
# indentation an editor puts on a new line, as `prompt`.
CASES = {
    "with_block": ('import os\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'
                   '    with open(path) as f:\n', "        ",
                   "\n\n\ndef main():\n    for line in read_lines(os.environ['HOME']):\n        print(line)\n"),
    "method": ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n", "        ",
               "\n\n    def pop(self):\n        return self.items.pop()\n"),
    "function": ("import os\n\n\ndef exists(path):\n", "", '\n\n\nif exists("/tmp"):\n    print("yes")\n'),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_llama_vim_infill_completes_the_middle(http, name):
    prefix, line, suffix = CASES[name]
    reply = infill(http, prefix, line, suffix)
    middle = reply["content"]
    assert reply["stop_type"] == "eos" and reply["tokens_predicted"] < 64, reply  # it ended by itself
    assert middle.strip(), reply
    ast.parse(prefix + line + middle + suffix)  # a SyntaxError fails the test
