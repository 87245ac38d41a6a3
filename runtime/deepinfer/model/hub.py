"""Model arguments: a local directory, or a Hugging Face hub id resolved through `huggingface_hub`.

A hub id (`deepseek-ai/DeepSeek-V2-Lite`, optionally with a revision: branch, tag or commit) is
looked up in the local Hugging Face cache first (HF_HOME / HF_HUB_CACHE, `models--org--name/
snapshots/<commit>`, refs for branches and tags), so a cached model runs offline and without a
network round trip. Only when the cache lacks a complete snapshot is it downloaded, by
`huggingface_hub.snapshot_download` (never by hand-written HTTP), and only the files an engine
reads: configs, safetensors weights, the tokenizer. Pickled weights (`*.bin`, `*.pt`) and remote
code are never fetched. Offline (HF_HUB_OFFLINE=1) or unreachable, a model not in the cache is a
CheckpointError that names the cache folder and the command that downloads it.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from ..errors import CheckpointError

# what an engine reads from a model repository; nothing executable, nothing pickled
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.jinja", "*.model"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(s: str) -> bool:
    """`org/name` that is not a path on this machine."""
    return bool(_HUB_ID.match(s)) and not Path(s).expanduser().exists() and ".." not in s


def resolve_model(model, revision: Optional[str] = None) -> Path:
    """The model directory for `model`: an existing directory as is, or a hub id's snapshot."""
    s = os.fspath(model)
    p = Path(s).expanduser()
    if p.is_dir():
        if revision:
            raise CheckpointError(f"revision {revision!r} was given, but {p} is a local directory, not a hub id")
        return p
    if p.exists():
        raise CheckpointError(f"model {s}: not a directory (give the folder that holds config.json)")
    if not looks_like_hub_id(s):
        raise CheckpointError(f"model directory {p} does not exist (and {s!r} is not a hub id of the form "
                              f"org/name)")
    return snapshot(s, revision)


def _complete(d: Path) -> bool:
    """config.json and every weight file the index lists (or model.safetensors) are present."""
    if not (d / "config.json").is_file():
        return False
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
            # os.path.isfile is False for a name the OS refuses (too long, a NUL) where Path.is_file raises
            return all(isinstance(f, str) and os.path.isfile(d / f) for f in files)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return False     # a damaged index is no complete snapshot
    return (d / "model.safetensors").is_file()


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def snapshot(repo_id: str, revision: Optional[str] = None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as e:   # a core dependency; only a broken install lacks it
        raise CheckpointError(f"hub id {repo_id!r} needs the huggingface_hub package ({e}); pip install "
                              f"huggingface_hub, or pass a local model directory") from None
    rev = f" at revision {revision!r}" if revision else ""
    get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        local = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                       local_files_only=True))
        if _complete(local):
            return local
    except (LocalEntryNotFoundError, FileNotFoundError):
        local = None
    except ValueError as e:   # a malformed id or revision
        raise CheckpointError(f"hub id {repo_id!r}{rev}: {e}") from None
    offline = bool(constants.HF_HUB_OFFLINE)
    what = "is only partly in" if local is not None else "is not in"
    if offline:
        raise CheckpointError(f"model {repo_id!r}{rev} {what} the Hugging Face cache ({_cache_dir()}) and the hub "
                              f"is offline (HF_HUB_OFFLINE=1). Download it on a connected machine with `{get}` "
                              f"(set HF_HUB_CACHE or HF_HOME to use another cache), or pass a local directory.")
    print(f"deepinfer: downloading {repo_id}{rev} into {_cache_dir()} (huggingface_hub "
          f"{huggingface_hub.__version__}; only configs, safetensors and the tokenizer)", file=sys.stderr)
    try:
        d = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise CheckpointError(f"hub id {repo_id!r}: the repository does not exist or needs access (log in with "
                              f"`hf auth login` for a gated or private model): {type(e).__name__}") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"hub id {repo_id!r}: revision {revision!r} does not exist") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(f"model {repo_id!r}{rev} {what} the Hugging Face cache ({_cache_dir()}) and the hub "
                              f"cannot be reached. Download it with `{get}` when online, or pass a local "
                              f"directory.") from None
    except OSError as e:
        raise CheckpointError(f"downloading {repo_id!r}{rev} into {_cache_dir()} failed: {e}") from None
    if not _complete(d):
        raise CheckpointError(f"hub id {repo_id!r}{rev}: the snapshot in {d} has no config.json and safetensors "
                              f"weights (deepinfer never loads pickled *.bin weights)")
    return d
