"""A checkpoint named by its Hugging Face repo id, found in the local Hugging Face cache.

`npud --model Qwen/Qwen3-0.6B` (or `checkpoint_dir = "Qwen/Qwen3-0.6B"`) serves the snapshot
that `hf download` or transformers left in the cache. npud never downloads: the cache is
read with huggingface_hub's own scanner (`scan_cache_dir`, which touches no network), so the
layout (models--org--name/snapshots/<commit>, refs/main) is the library's business, not ours.
huggingface_hub is an optional import (the `hf` extra; pyproject.toml says why).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name as the Hub spells repo ids: one slash, no leading '.', nothing a path would start with
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class NotCached(LookupError):
    """The repo is not in the local cache (or the cache cannot be read); the message says which and where."""


def looks_like_repo_id(value: str) -> bool:
    return bool(REPO_ID_RE.match(value)) and ".." not in value


def cache_dir() -> Path:
    """The hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. Read from the environment at
    each call (huggingface_hub.constants reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg_cache).expanduser() / "huggingface" / "hub"


def resolve_repo(repo_id: str) -> Path:
    """The snapshot directory of `repo_id` in the local cache: the revision refs/main names,
    else the most recently modified one. Offline. Raises NotCached naming the repo and the cache."""
    where = cache_dir()
    try:
        from huggingface_hub import CacheNotFound, scan_cache_dir
    except ImportError:
        raise NotCached(f"{repo_id!r} looks like a Hugging Face repo id, and reading the Hugging Face cache "
                        "needs huggingface_hub (pip install 'npud[hf]'); or give the snapshot directory") from None
    try:
        info = scan_cache_dir(where)
    except CacheNotFound:
        raise NotCached(f"no Hugging Face cache at {where}, so no snapshot of {repo_id} "
                        f"(npud never downloads: `hf download {repo_id}` first)") from None
    except OSError as exc:
        raise NotCached(f"cannot read the Hugging Face cache {where}: {exc.strerror}") from None
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == repo_id), None)
    if repo is None or not repo.revisions:
        raise NotCached(f"no snapshot of {repo_id} in the Hugging Face cache {where} "
                        f"(npud never downloads: `hf download {repo_id}` first)")
    main = [r for r in repo.revisions if "main" in r.refs]
    revision = main[0] if main else max(repo.revisions, key=lambda r: r.last_modified)
    return Path(revision.snapshot_path)
