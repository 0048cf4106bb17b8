"""A disk cache of a GGUF model's converted weights, read back as memory maps.

Loading SmolLM2's GGUF dequantizes every tensor, converts it to specjax's layout and copies it into
fresh float32 arrays: 7-10 s per process on a 2-core VM, most of it first-touch page faults on
650 MB of new memory, paid again by every ``specjax generate``. The converted arrays (float32, in the
layout asked for: split or stacked layers) are written once under ``cache_root()/params/`` as one
``.npy`` per leaf plus a manifest, and later loads map those files read-only: the pages come from the
OS page cache, shared by every process that maps them, and nothing is converted again (load ~1 s).

The entry's key is the GGUF file's real path, inode, size, modification and change times, the layout
and ``FORMAT``: a changed file or a new conversion is a new entry (the change time and inode catch a
file rewritten with its old size and modification time restored, as ``cp -p``, ``rsync -a`` or
``touch -r`` leave it). A hit is checked against the file's config (every leaf's name and shape). Entries are
written into a temporary directory and renamed into place, so a reader never sees half an entry, and an
entry is never changed after it is written (a mapped file must not change under its readers). A damaged
entry (a missing or truncated file, shapes that disagree with the manifest) is reported, removed and
rebuilt. ``SPECJAX_PARAMS_CACHE=0`` turns the cache off (each load converts again, nothing is written).
Writing an entry removes those of its file before it changed and of files that are gone (``_prune_stale``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings

import numpy as np

from specjax.config import cache_root
from specjax.errors import CheckpointError, InputError
from specjax.io.gguf_file import file_identity

# Bump when the conversion's output changes (key maps, layouts, fused groups): old entries are ignored.
FORMAT = 1
ENV = "SPECJAX_PARAMS_CACHE"
_MANIFEST = "manifest.json"


def enabled() -> bool:
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true", "no", "yes", ""):
        raise InputError(f"{ENV}={os.environ[ENV]!r}: expected 1/on or 0/off")
    return value not in ("0", "off", "false", "no")


def identity(source: str, layout: str) -> list:
    """What an entry is of: the file (``file_identity``: its path first), the layout (sixth), ``FORMAT``."""
    return file_identity(source) + [layout, FORMAT]


def entry_dir(source: str, layout: str) -> str:
    """The cache entry of ``source`` (a file) converted to ``layout`` ("split" or "stacked")."""
    digest = hashlib.sha256(json.dumps(identity(source, layout)).encode()).hexdigest()[:20]
    return os.path.join(cache_root(), "params", f"{os.path.basename(source)}-{layout}-{digest}")


def _prune_stale(kept: str, ident: list) -> None:
    """Remove the entries no load can hit again: of the same file and layout before it changed, or of a
    file that is gone (each fresh virtual environment holds its own copy of a packaged GGUF: 622 MB an entry
    each time). Entries written before their identity was recorded are left. A process that has an entry
    mapped keeps its pages: removing mapped files is safe."""
    root = os.path.dirname(kept)
    for name in os.listdir(root):
        entry = os.path.join(root, name)
        if entry == kept or ".tmp-" in name:
            continue
        try:
            with open(os.path.join(entry, _MANIFEST)) as f:
                source = json.load(f).get("source")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(source, list) or len(source) != len(ident):
            continue
        changed = source[0] == ident[0] and source[5] == ident[5] and source != ident
        if changed or not os.path.exists(source[0]):
            shutil.rmtree(entry, ignore_errors=True)


def _structure(tree, leaves: list) -> dict:
    """The pytree's nesting (dicts and tuples) as JSON, each array replaced by its index in ``leaves``."""
    if isinstance(tree, dict):
        return {"dict": {str(k): _structure(v, leaves) for k, v in tree.items()}}
    if isinstance(tree, (tuple, list)):
        return {"tuple": [_structure(v, leaves) for v in tree]}
    leaves.append(np.asarray(tree))
    return {"leaf": len(leaves) - 1}


def _rebuild(node: dict, leaves: list):
    if "dict" in node:
        return {k: _rebuild(v, leaves) for k, v in node["dict"].items()}
    if "tuple" in node:
        return tuple(_rebuild(v, leaves) for v in node["tuple"])
    return leaves[node["leaf"]]


def read(path: str, check=None):
    """The params of the entry at ``path`` as read-only memory maps, or None when there is no entry.
    A damaged entry (``check(params)`` raising a ``CheckpointError`` counts too: leaves missing or of
    other shapes than the model's config asks) is removed with a warning (the caller converts again and
    rewrites it)."""
    manifest_path = os.path.join(path, _MANIFEST)
    if not os.path.exists(manifest_path):
        return None
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        leaves = []
        for i, (shape, dtype) in enumerate(manifest["leaves"]):
            a = np.load(os.path.join(path, f"{i}.npy"), mmap_mode="r", allow_pickle=False)
            if list(a.shape) != shape or a.dtype.name != dtype:
                raise ValueError(f"leaf {i}: {a.shape} {a.dtype}, the manifest says {tuple(shape)} {dtype}")
            leaves.append(a)
        params = _rebuild(manifest["structure"], leaves)
        if check is not None:
            check(params)
        return params
    except (OSError, ValueError, KeyError, TypeError, IndexError, CheckpointError) as e:
        warnings.warn(f"specjax: the weights cache entry {path} is damaged ({e}); converting again", stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
        return None


def write(path: str, params, ident: list | None = None) -> bool:
    """Store ``params`` (numpy leaves) as the entry at ``path``; False (with a warning) when the disk
    refuses. Another process writing the same entry meanwhile is fine: the first rename wins. ``ident``
    (``identity``): recorded, and the entries it makes stale are removed (``_prune_stale``)."""
    leaves: list = []
    structure = _structure(params, leaves)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(tmp)
        for i, a in enumerate(leaves):
            np.save(os.path.join(tmp, f"{i}.npy"), np.ascontiguousarray(a), allow_pickle=False)
        with open(os.path.join(tmp, _MANIFEST), "w") as f:  # last: an entry with a manifest is complete
            json.dump({"structure": structure, "leaves": [[list(a.shape), a.dtype.name] for a in leaves],
                       "source": ident}, f)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.exists(os.path.join(path, _MANIFEST)):
                raise
        if ident is not None:
            _prune_stale(path, ident)
        return True
    except OSError as e:
        warnings.warn(f"specjax: could not write the weights cache entry {path}: {e} (the next load converts "
                      f"again; {ENV}=0 turns the cache off)", stacklevel=3)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
