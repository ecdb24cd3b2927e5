"""Where kvtier keeps per-user files: converted models and, by default, the disk KV tier.

The cache directory is `$KVTIER_CACHE_DIR` when set, else the platform's user cache
directory for kvtier (platformdirs: `$XDG_CACHE_HOME/kvtier`, else `~/.cache/kvtier` on
Linux; `~/Library/Caches/kvtier` on macOS). Directories created here are owner-only (0700):
cached KV blocks are derived from users' prompts and must not be readable by other accounts.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

_OWNER_ONLY = 0o700


def cache_dir(create: bool = True) -> Path:
    """The user cache directory (absolute).

    With `create`, it is made (with parents) owner-only when missing; an existing directory
    keeps its permissions. Raises OSError when the path exists but is not a directory or
    cannot be created.
    """
    override = os.environ.get("KVTIER_CACHE_DIR")
    if override:
        path = Path(override).expanduser()
    else:
        path = Path(platformdirs.user_cache_dir("kvtier", appauthor=False))
    path = path.absolute()
    if create:
        ensure_private_dir(path)
    return path


def models_dir(create: bool = True) -> Path:
    """`<cache_dir>/models`: converted model weights, one subdirectory per model."""
    path = cache_dir(create) / "models"
    if create:
        ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) with mode 0700 unless it already exists.

    Raises OSError naming the path when it exists as a non-directory or cannot be created.
    """
    if path.is_dir():
        return path
    if path.exists():
        raise OSError(f"{path} exists but is not a directory; remove it or point "
                      "KVTIER_CACHE_DIR elsewhere")
    try:
        path.mkdir(mode=_OWNER_ONLY, parents=True, exist_ok=True)
        # mkdir's mode is filtered by the umask; set it explicitly.
        os.chmod(path, _OWNER_ONLY)
    except OSError as exc:
        raise OSError(f"cannot create cache directory {path}: {exc.strerror or exc}; "
                      "set KVTIER_CACHE_DIR to a writable location") from exc
    return path
