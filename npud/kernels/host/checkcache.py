"""The host self-check's pass, remembered in the kernel cache for the exact build and CPU it was run on.

What the self-check (npud/kernels/select.py, check.py) proves: on this CPU, the compiled library's
kernels, on the ISA path and thread split they take here, give every row of an M-row call the
bits of the one-row call, and the bf16-dot instruction agrees with its emulation (or is turned
off). Every input of that is fixed: the check's own inputs are seeded, the code is the library
(the sha256 of its bytes as loaded, not its name: the same sources built by another compiler
are other code) and the Python kernel modules, the path is the ISA chosen and the thread
count, and the hardware is the CPU (model, flags, microcode). So a pass is stored under a key
over all of them, and a start whose key matches reuses it instead of spending its 0.1-0.3 s
again: a library of other bytes, an edited kernel or check, another ISA path, thread count,
CPU or microcode, or another version of this file's format runs the check again.
A failure is never stored (the machine checks again at every start, and logs it each time);
`NPUD_SELF_CHECK=always` runs it at every start regardless. What reuse gives up: a run-to-run
fault of the hardware or a thread-scheduling effect that only some runs would show. The check
could not promise to catch those either (it runs once, on one set of inputs).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import structlog

from npud.kernels.host.cache import cache_dir

log = structlog.get_logger(__name__)

FORMAT = 2  # 2: keyed by the library's bytes, not its name
_KERNELS = Path(__file__).resolve().parent.parent  # kernels/: the Python side of every kernel and check


def _cpu() -> str:
    """The CPU as the kernel reports it: model name, flags and microcode of the first CPU."""
    keep = ("vendor_id", "cpu family", "model", "model name", "stepping", "microcode", "flags")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    first = text.split("\n\n", 1)[0]
    return "\n".join(line for line in first.splitlines() if line.split(":", 1)[0].strip() in keep)


def check_key(library_sha256: str, isa: str, threads: int, numerics_version: int) -> str:
    """The sha256 the pass is stored under (see the module docstring for what it covers);
    `library_sha256` is the digest of the loaded library's bytes (native.library_sha256())."""
    h = hashlib.sha256(f"{FORMAT}\0{library_sha256}\0{isa}\0{threads}\0{numerics_version}\0".encode())
    for path in sorted(_KERNELS.rglob("*.py")):
        h.update(path.relative_to(_KERNELS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(_cpu().encode())
    return h.hexdigest()


def entry_path(key: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"self-check-{key[:32]}.json"


def read_pass(key: str, directory: Path | None = None) -> dict | None:
    """The stored pass for `key` ({"bf16_dot_hardware": bool}), or None: absent, unreadable,
    for another key, or NPUD_SELF_CHECK=always."""
    if os.environ.get("NPUD_SELF_CHECK", "") == "always":
        return None
    try:
        raw = json.loads(entry_path(key, directory).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("key") != key or raw.get("format") != FORMAT \
            or not isinstance(raw.get("bf16_dot_hardware"), bool):
        return None
    return {"bf16_dot_hardware": raw["bf16_dot_hardware"]}


def write_pass(key: str, bf16_dot_hardware: bool, directory: Path | None = None) -> None:
    """Store a pass (atomically); a cache that refuses is logged and otherwise ignored."""
    path = entry_path(key, directory)
    body = json.dumps({"format": FORMAT, "key": key, "bf16_dot_hardware": bool(bf16_dot_hardware)})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("self_check_cache_write_failed", path=str(path), error=exc.strerror or str(exc))
        tmp.unlink(missing_ok=True)
