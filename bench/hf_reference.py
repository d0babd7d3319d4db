"""transformers' decode and prefill timings for bench/decode.py, in a process of their own (isolated.py)."""

from __future__ import annotations

import statistics
import time


def hf_run(ckpt: str, dtype: str, prompt: list[int], long_prompt: list[int], steps: int, threads: int) -> dict:
    """Median decode step seconds after `prompt`, seconds to prefill `long_prompt`, torch's version."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    times = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        pkv, logits = res.past_key_values, res.logits[0, -1]
        for _ in range(steps):
            t = int(torch.argmax(logits))
            t0 = time.perf_counter()
            res = model(torch.tensor([[t]]), past_key_values=pkv, use_cache=True)
            times.append(time.perf_counter() - t0)
            pkv, logits = res.past_key_values, res.logits[0, -1]
        t0 = time.perf_counter()
        model(torch.tensor([long_prompt]), use_cache=True)
        prefill = time.perf_counter() - t0
    return dict(step=statistics.median(times), prefill=prefill, torch=torch.__version__)
