"""The plan's disk cache: what the compiler said of a program, keyed by the program and target.

A candidate's compile takes minutes for a large model on a large slice; the
same program for the same target (the same devices in the same order, the
same jax and TPU compiler) compiles to the same figures. The key is a hash
of the lowered program's text (StableHLO, its shardings included), the
mesh's device order, the target's device kind and the compiler versions.
Each entry's first line is the SHA-256 of the rest, so an entry changed on
disk (damaged, edited, cut short) is compiled again rather than read as
figures the compiler never gave.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # spmd plan's parser reads DEFAULT_CACHE_DIR without importing jax
    from spmd._src.explain import CompilerOutput

__all__ = ["DEFAULT_CACHE_DIR", "cache_key", "load", "store"]

DEFAULT_CACHE_DIR = Path("~/.cache/spmd/plan")
_FORMAT = 2  # bumped when CompilerOutput's fields or the entries' layout change


def _versions() -> str:
    """jax, jaxlib and libtpu: a new compiler may compile the same program differently."""
    found = []
    for package in ("jax", "jaxlib", "libtpu"):
        try:
            found.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package}=-")
    return ",".join(found)


def cache_key(program_text: str, devices: list[Any]) -> str:
    """The key of one program on one target.

    Args:
      program_text: the lowered program's text (`lowered.as_text()`).
      devices: the mesh's devices, in the mesh's order.
    """
    first = devices[0]
    target = [
        _FORMAT,
        _versions(),
        first.platform,
        str(getattr(first, "device_kind", "")),
        str(getattr(first, "num_cores", "")),
        [(d.id, getattr(d, "slice_index", 0)) for d in devices],
    ]
    digest = hashlib.sha256(json.dumps(target).encode())
    digest.update(program_text.encode())
    return digest.hexdigest()


def load(directory: Path | None, key: str) -> CompilerOutput | None:
    """The stored compiler output for `key`; None where absent or unreadable."""
    if directory is None:
        return None
    from spmd._src.explain import CompilerOutput

    path = directory / f"{key}.json"
    try:
        digest, _, text = path.read_text().partition("\n")
        if digest != _digest(text):  # changed on disk since it was stored
            return None
        return CompilerOutput(**json.loads(text))
    except (OSError, ValueError, TypeError):  # absent, unreadable, or of another format
        return None


def store(directory: Path | None, key: str, output: CompilerOutput) -> None:
    """Stores `output` under `key` (written whole, then renamed: readers never see a part)."""
    if directory is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    part = path.with_suffix(f".{os.getpid()}.part")
    text = json.dumps(dataclasses.asdict(output))
    part.write_text(f"{_digest(text)}\n{text}")
    os.replace(part, path)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
