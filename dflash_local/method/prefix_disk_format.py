"""One prefix-cache entry on disk: its arrays in a safetensors file, its manifest in JSON.

An engine's kept state (prefix_cache.Kept.state: dataclasses, lists, tuples, dicts, framework
arrays, a framework's layer objects) is packed into a JSON skeleton plus named numpy arrays, and
back; the engine's `LeafCodec` converts its arrays and the few framework values (a dtype, a
device) that are not plain JSON. The payload is written first, the manifest (token ids, the pair
key, sizes, the payload's sha256) last and only once the payload is durable: a manifest is the
entry's commit record. Each file goes through a per-process temporary name, fsync and rename, so
a crash leaves at most a temporary file or a payload without a manifest, never a torn entry.
Numpy and safetensors only; what an entry means is the engine's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

PAYLOAD, MANIFEST, TEMPORARY = ".safetensors", ".json", ".tmp"


class LeafCodec(Protocol):
    """An engine's values that are not plain JSON, in and out of an entry file."""

    def to_numpy(self, value: Any) -> tuple[np.ndarray, str] | None:
        """A framework array as (numpy array, its dtype's name); None: not an array."""

    def from_numpy(self, array: np.ndarray, dtype: str) -> Any:
        """The framework array `to_numpy` gave `array` for."""

    def to_tag(self, value: Any) -> str | None:
        """A framework value (a dtype, a device) as text; None: not one."""

    def from_tag(self, tag: str) -> Any:
        """The value `to_tag` gave `tag` for."""

    def object_type(self, name: str) -> type | None:
        """The class of this name whose instances are packed by their attributes (None: no
        such class may be packed)."""


class Unpackable(ValueError):
    """A state holds a value an entry file cannot hold (the reason names its type)."""


class CorruptEntry(ValueError):
    """An entry's files disagree with its manifest (a torn write, a flipped bit)."""


def pack(value: Any, codec: LeafCodec) -> tuple[Any, dict[str, np.ndarray]]:
    """(JSON skeleton, named arrays) of a kept state."""
    arrays: dict[str, np.ndarray] = {}

    def walk(item: Any) -> Any:
        if item is None or isinstance(item, bool | int | float | str):
            return item
        as_array = codec.to_numpy(item)
        if as_array is not None:
            name = f"a{len(arrays)}"
            arrays[name] = np.ascontiguousarray(as_array[0])
            return {"array": name, "dtype": as_array[1]}
        tag = codec.to_tag(item)
        if tag is not None:
            return {"tag": tag}
        if isinstance(item, list):
            return [walk(x) for x in item]
        if isinstance(item, tuple):
            return {"tuple": [walk(x) for x in item]}
        if isinstance(item, dict):
            return {"dict": [[walk(k), walk(v)] for k, v in item.items()]}
        name = type(item).__name__
        if codec.object_type(name) is type(item):
            return {"object": name, "attrs": walk(dict(vars(item)))}
        raise Unpackable(f"a kept state holds a {type(item).__module__}.{name}")

    return walk(value), arrays


def unpack(skeleton: Any, arrays: dict[str, np.ndarray], codec: LeafCodec) -> Any:
    """The state `pack` gave (skeleton, arrays) for."""
    if skeleton is None or isinstance(skeleton, bool | int | float | str):
        return skeleton
    if isinstance(skeleton, list):
        return [unpack(x, arrays, codec) for x in skeleton]
    if "array" in skeleton:
        return codec.from_numpy(arrays[skeleton["array"]], skeleton["dtype"])
    if "tag" in skeleton:
        return codec.from_tag(skeleton["tag"])
    if "tuple" in skeleton:
        return tuple(unpack(x, arrays, codec) for x in skeleton["tuple"])
    if "dict" in skeleton:
        return {unpack(k, arrays, codec): unpack(v, arrays, codec) for k, v in skeleton["dict"]}
    cls = codec.object_type(skeleton["object"])
    if cls is None:
        raise CorruptEntry(f"an entry names the class {skeleton['object']!r}, not one this engine packs")
    item = cls.__new__(cls)
    item.__dict__.update(unpack(skeleton["attrs"], arrays, codec))
    return item


def write_entry(directory: Path, name: str, arrays: dict[str, np.ndarray], manifest: dict) -> int:
    """Write an entry's payload, then its manifest (which records the payload's size and
    sha256); returns the bytes written."""
    payload = save_arrays(arrays) if arrays else save_arrays({"empty": np.zeros(0, np.uint8)})
    _write_atomic(directory / (name + PAYLOAD), payload)
    manifest = {**manifest, "payload_bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest()}
    text = json.dumps(manifest, separators=(",", ":")).encode()
    _write_atomic(directory / (name + MANIFEST), text)
    _fsync_directory(directory)
    return len(payload) + len(text)


def read_manifest(path: Path) -> dict:
    """An entry's manifest; CorruptEntry when it is not one."""
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptEntry(f"{path.name}: not a manifest ({error})") from error
    if not isinstance(manifest, dict) or not {"pair", "token_ids", "sha256"} <= manifest.keys():
        raise CorruptEntry(f"{path.name}: not a manifest (fields missing)")
    return manifest


def read_payload(path: Path, manifest: dict) -> dict[str, np.ndarray]:
    """An entry's arrays, checked against its manifest's size and sha256 before any is parsed."""
    payload = path.read_bytes()
    if len(payload) != manifest.get("payload_bytes"):
        raise CorruptEntry(f"{path.name}: {len(payload)} bytes, its manifest says "
                           f"{manifest.get('payload_bytes')}")
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise CorruptEntry(f"{path.name}: its sha256 differs from its manifest's")
    try:
        return load_arrays(payload)
    except Exception as error:  # safetensors raises its own SafetensorError
        raise CorruptEntry(f"{path.name}: not a safetensors file ({error})") from error


def _write_atomic(path: Path, data: bytes) -> None:
    """temp file (named by this process) + fsync + rename: readers see all of `data` or none."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}{TEMPORARY}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """The renames themselves survive a power cut."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
