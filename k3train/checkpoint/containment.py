"""Files inside the folder a user hands in, and nowhere else.

A Hugging Face folder or a checkpoint is read by name (`config.json`, `model.safetensors`, an
index's shard names, `.metadata`): any of them may be a symbolic link, and a link (or `..`)
leading out of the folder would import an outside weights file, open `/etc/passwd` as an index
or record an outside tokenizer path. So each path is resolved and must stay inside the folder.
One exception keeps the hub's cache usable: a folder `<repo>/snapshots/<revision>` may link into
`<repo>/blobs`, which is how `huggingface_hub` stores every file it downloads. Stdlib only.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["contained", "escapes"]


def _allowed_roots(root: Path) -> list[Path]:
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots":  # huggingface_hub's cache: snapshots/<rev>/name -> ../../blobs/<hash>
        roots.append(real.parent.parent / "blobs")
    return roots


def escapes(root: Path, path: Path) -> Path | None:
    """Where `path` really leads when that is outside `root` (links followed), else None."""
    resolved = path.resolve()
    if any(resolved == allowed or allowed in resolved.parents for allowed in _allowed_roots(root)):
        return None
    return resolved


def contained(root: Path, name: str | Path, error: type[Exception]) -> Path:
    """`root / name`, or `error` (one line) when it leads outside `root`."""
    path = root / name
    outside = escapes(root, path)
    if outside is not None:
        raise error(
            f"{path} leads outside {root} (to {outside}); only files inside the folder given are read: "
            "copy the file into the folder instead of linking it"
        )
    return path
