"""Our random checkpoints as GGUF files for llama.cpp, converted by llama.cpp's own convert_hf_to_gguf.py.

The converter comes from the llama-cpp-python sdist (vendor/llama.cpp), unpacked into
bench/out/llama-src; it is run, never copied. Our test tokenizer is one it does not know, so
the run names its pre-tokenizer ("default": llama.cpp's plain byte-level BPE split) instead of
looking up its hash, and goes straight to the BPE vocabulary (there is no tokenizer.model to
try sentencepiece on); the benchmarks feed token ids, so the split never matters.

    .venv/bin/python bench/gguf_convert.py bench/out/qwen3-0.5b bf16      # -> bench/out/qwen3-0.5b/model-bf16.gguf
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from llamacpp import VERSION

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "bench" / "out" / "llama-src"
SDIST_VERSION = VERSION  # the converter of the llama.cpp the benchmarks time

# Runs in vendor/llama.cpp with our Python (it has torch, transformers, numpy).
_RUNNER = r"""
import sys
sys.path[:0] = [".", "gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def no_sentencepiece(self):  # our checkpoints have no tokenizer.model: take the BPE path
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


def sdist_path() -> Path:
    """The llama-cpp-python sdist: $NPUD_LLAMA_SDIST, else downloaded from the package index
    into bench/out/sdist once. Raises FileNotFoundError when neither gives one."""
    if os.environ.get("NPUD_LLAMA_SDIST"):
        sdist = Path(os.environ["NPUD_LLAMA_SDIST"])
        if not sdist.exists():
            raise FileNotFoundError(f"no llama-cpp-python sdist at {sdist} (NPUD_LLAMA_SDIST)")
        return sdist
    folder = ROOT / "bench" / "out" / "sdist"
    found = sorted(folder.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={SDIST_VERSION}", "-d", str(folder)], check=False)
        found = sorted(folder.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"))
    if not found:
        raise FileNotFoundError(f"no llama-cpp-python {SDIST_VERSION} sdist: pip download failed and "
                                "NPUD_LLAMA_SDIST is not set")
    return found[0]


def llama_cpp_tree() -> Path:
    """vendor/llama.cpp of the unpacked sdist (unpacked on first use); raises FileNotFoundError without the sdist."""
    found = sorted(SRC.glob("*/vendor/llama.cpp"))
    if found:
        return found[0]
    sdist = sdist_path()
    SRC.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(SRC, filter="data")
    return sorted(SRC.glob("*/vendor/llama.cpp"))[0]


def convert(checkpoint: Path, outtype: str) -> Path:
    """checkpoint/model-<outtype>.gguf (bf16, q8_0, f32, ...), converted once."""
    out = Path(checkpoint) / f"model-{outtype}.gguf"
    if out.exists():
        return out
    tmp = out.with_suffix(".gguf.tmp")
    subprocess.run([sys.executable, "-c", _RUNNER, str(Path(checkpoint).resolve()), "--outtype", outtype,
                    "--outfile", str(tmp.resolve())], cwd=llama_cpp_tree(), check=True, capture_output=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(convert(Path(sys.argv[1]), sys.argv[2]))
