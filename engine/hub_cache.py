"""Hugging Face hub ids resolved from the local Hugging Face cache, never downloaded.

    "HuggingFaceTB/SmolLM2-135M-Instruct"  ->  <hub cache>/models--HuggingFaceTB--
                                                SmolLM2-135M-Instruct/snapshots/<commit>/

The hub cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`
(transformers' and huggingface_hub's own rule), read when a model is resolved. A model that
is not there is an error that says how to fetch it; kvtier itself never goes online.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: `owner/name`, optionally `@revision` (a branch, tag or commit of the local cache).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def hub_cache_dir() -> Path:
    """The directory huggingface_hub keeps downloaded repositories in."""
    explicit = os.environ.get("HF_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as `owner/name[@revision]` (and not as a local path)."""
    return not name.startswith((".", "/", "~")) and _HUB_ID.match(name) is not None


def resolve_hub_id(name: str) -> Path:
    """The local snapshot directory of hub id `name` (`owner/name[@revision]`).

    Raises FileNotFoundError saying how to fetch the model when the local cache does not
    hold it (kvtier never downloads).
    """
    match = _HUB_ID.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a Hugging Face hub id (owner/name[@revision])")
    repo, revision = match["repo"], match["revision"]
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo, revision=revision, cache_dir=cache,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        where = f"{repo} at revision {revision}" if revision else repo
        raise FileNotFoundError(
            f"model {where} is not in the local Hugging Face cache ({cache}) and kvtier never "
            f"downloads: fetch it first with `hf download {repo}` (or point HF_HUB_CACHE / "
            "HF_HOME at a cache that holds it), or pass a local directory or .gguf file"
        ) from None
    if not path.is_dir():
        raise FileNotFoundError(f"the local Hugging Face cache lists {repo} but its snapshot "
                                f"{path} is missing; fetch it again with `hf download {repo}`")
    return path
