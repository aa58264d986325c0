"""The catalog of known target <-> drafter pairs (models/catalog.toml), as frozen dataclasses.

Boundary: parse and validate the TOML, answer "which pairs does engine X run", and locate a pair's
models on this machine (the embedded target, the shipped drafter, or the Hugging Face cache).
Downloading is hub_download.py's job; loading is the engines'.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_local import paths
from dflash_local.engines.table import LAUNCHED, LOCAL, engine_names, find_engine
from dflash_local.errors import CheckpointError, ModelNotFoundError
from dflash_local.pairs.memory_fit import QUANT_BYTES_PER_PARAM
from dflash_local.pairs.snapshot_manifest import INCOMPLETE, IncompleteSnapshotError

THINKING_MODES = ("off", "on", "none")
SOURCES = ("hub", "embedded", "shipped")
DRAFTER_VERSIONS = (1, 2)  # DFlash (DFlashDraftModel) and DFlash 2 (DFlash2DraftModel)
EMBEDDED_PAIR_ID = "embedded"
QUANTIZATIONS = tuple(QUANT_BYTES_PER_PARAM)  # the ones the fit estimate knows the size of
# config.json keys a pair's `arch` may give (what memory_fit.py reads), and the ones it must
ARCH_KEYS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_size", "max_position_embeddings", "layer_types", "full_attention_interval",
             "sliding_window", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")
ARCH_REQUIRED = ("num_hidden_layers", "num_key_value_heads", "head_dim")
AVAILABLE, MISSING = "available", "missing"  # with INCOMPLETE: where a model stands locally


@dataclass(frozen=True)
class ModelSpec:
    repo: str  # hub repo id, or the local name for the embedded target / shipped drafter
    source: str  # "hub" | "embedded" | "shipped"
    revision: str | None = None  # None = not pinned
    params_b: float | None = None
    size_gb: float | None = None  # an estimate; None = unknown
    quantization: str | None = None  # how the weights are stored (QUANTIZATIONS); None = unknown

    def to_json(self) -> dict[str, Any]:
        return {"repo": self.repo, "source": self.source, "revision": self.revision,
                "revision_pinned": self.revision is not None, "params_b": self.params_b,
                "size_gb": self.size_gb, "quantization": self.quantization}


@dataclass(frozen=True)
class PairSpec:
    id: str
    engines: tuple[str, ...]
    target: ModelSpec
    drafter: ModelSpec
    thinking: str  # the thinking mode the drafter was trained for
    hybrid: bool
    model_type: str  # the target's config.json model_type: which architecture the engines must run
    block_sizes: tuple[tuple[str, int | str], ...]  # (engine, recommended block size or "auto")
    notes: str = ""
    drafter_version: int = 1  # the drafter's DFlash version: servers run DFlash 2 only from a release
    arch: tuple[tuple[str, Any], ...] = ()  # the target's config.json numbers (cited), for the
    # fit estimate before its config is downloaded; empty = not given

    def architecture(self) -> dict[str, Any] | None:
        """The target's architecture numbers as a config.json-shaped dict; None: not given."""
        return dict(self.arch) or None
    draft_window: int | None = None  # default draft sliding window (long contexts); None: unbounded

    def block_size_for(self, engine: str) -> int | str | None:
        """The recommended block size on this engine, as the catalog writes it; None: none."""
        return dict(self.block_sizes).get(engine)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "engines": list(self.engines), "thinking": self.thinking,
                "hybrid": self.hybrid, "model_type": self.model_type, "block_size": dict(self.block_sizes), "notes": self.notes,
                "arch": self.architecture(),
                "draft_window": self.draft_window,
                "target": self.target.to_json(),
                "drafter": {**self.drafter.to_json(), "version": self.drafter_version}}


@dataclass(frozen=True)
class Catalog:
    pairs: tuple[PairSpec, ...]

    def get(self, pair_id: str) -> PairSpec:
        for pair in self.pairs:
            if pair.id == pair_id:
                return pair
        raise ModelNotFoundError(
            f"no pair {pair_id!r} in the catalog (known: {', '.join(p.id for p in self.pairs)})"
        )

    def for_engine(self, engine: str) -> tuple[PairSpec, ...]:
        return tuple(pair for pair in self.pairs if engine in pair.engines)

    def local_model_types(self) -> dict[str, frozenset[str]]:
        """Each target architecture a local engine is said to run -> those engines."""
        found: dict[str, set[str]] = {}
        for pair in self.pairs:
            local = {engine for engine in pair.engines if engine in engine_names(LOCAL)}
            if local:
                found.setdefault(pair.model_type, set()).update(local)
        return {model_type: frozenset(engines) for model_type, engines in found.items()}

    def hub_repos(self) -> frozenset[str]:
        """Every hub repo id the catalog names (targets and drafters)."""
        return frozenset(
            model.repo for pair in self.pairs for model in (pair.target, pair.drafter)
            if model.source == "hub"
        )


def pair_engines() -> tuple[str, ...]:
    """The engines a pair may name: those that load it (a relay serves its server's own pair)."""
    return engine_names(LOCAL, LAUNCHED)


def catalog_path() -> Path:
    return paths.shipped_models_dir() / "catalog.toml"


def load_catalog(path: str | Path | None = None) -> Catalog:
    path = Path(path) if path is not None else catalog_path()
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CheckpointError(f"cannot read the catalog {path}: {exc}") from None
    pairs = tuple(_parse_pair(entry, f"{path.name} pair #{index}")
                  for index, entry in enumerate(raw.get("pair", [])))
    ids = [pair.id for pair in pairs]
    duplicates = sorted({pair_id for pair_id in ids if ids.count(pair_id) > 1})
    if duplicates:
        raise CheckpointError(f"{path.name}: duplicate pair ids {duplicates}")
    if not pairs or pairs[0].id != EMBEDDED_PAIR_ID:
        raise CheckpointError(f"{path.name}: the first pair must be {EMBEDDED_PAIR_ID!r}")
    return Catalog(pairs)


def _parse_pair(entry: dict[str, Any], where: str) -> PairSpec:
    pair_id = _field(entry, "id", str, where)
    where = f"{where} ({pair_id!r})"
    engines = tuple(_field(entry, "engines", list, where))
    known = pair_engines()
    if not engines or any(engine not in known for engine in engines):
        raise CheckpointError(f"{where}: engines {list(engines)} must be a non-empty subset of "
                              f"{known}")
    thinking = _field(entry, "thinking", str, where)
    if thinking not in THINKING_MODES:
        raise CheckpointError(f"{where}: thinking {thinking!r} is not one of {THINKING_MODES}")
    block_sizes = _field(entry, "block_size", dict, where)
    bad = {engine: size for engine, size in block_sizes.items()
           if engine not in engines or not (size == "auto" or isinstance(size, int) and size >= 1)}
    if bad:
        raise CheckpointError(f"{where}: block_size entries {bad} name an engine the pair lacks "
                              f"or are not integers >= 1 or \"auto\"")
    drafter = _field(entry, "drafter", dict, where)
    version = drafter.get("version", 1)
    if type(version) is not int or version not in DRAFTER_VERSIONS:  # bool is an int: refused
        raise CheckpointError(f"{where} drafter: version {version!r} is not one of "
                              f"{DRAFTER_VERSIONS} (1 = DFlash, 2 = DFlash 2)")
    window = entry.get("draft_window")
    if window is not None and (type(window) is not int or window < 1):
        raise CheckpointError(f"{where}: draft_window {window!r} must be an integer >= 1")
    refusing = [engine for engine in engines if not find_engine(engine).takes_draft_window]
    if window is not None and refusing:  # vLLM reads a window from the drafter's config only
        raise CheckpointError(f"{where}: draft_window {window} on a pair {refusing[0]} serves: "
                              f"{refusing[0]} takes no draft window at launch")
    return PairSpec(
        id=pair_id, engines=engines, thinking=thinking, drafter_version=version, draft_window=window,
        hybrid=bool(entry.get("hybrid", False)), model_type=_field(entry, "model_type", str, where),
        block_sizes=tuple(sorted(block_sizes.items())),
        notes=str(entry.get("notes", "")), arch=_parse_arch(entry.get("arch"), where),
        target=_parse_model(_field(entry, "target", dict, where), f"{where} target"),
        drafter=_parse_model(drafter, f"{where} drafter"),
    )


def _parse_model(entry: dict[str, Any], where: str) -> ModelSpec:
    source = _field(entry, "source", str, where)
    if source not in SOURCES:
        raise CheckpointError(f"{where}: source {source!r} is not one of {SOURCES}")
    numbers = {key: entry.get(key) for key in ("params_b", "size_gb")}
    for key, value in numbers.items():
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise CheckpointError(f"{where}: {key} {value!r} must be a positive number")
    quantization = entry.get("quantization")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise CheckpointError(f"{where}: quantization {quantization!r} is not one of {QUANTIZATIONS}")
    return ModelSpec(repo=_field(entry, "repo", str, where), source=source,
                     revision=entry.get("revision"), quantization=quantization, **numbers)


def _parse_arch(arch: Any, where: str) -> tuple[tuple[str, Any], ...]:
    if arch is None:
        return ()
    if not isinstance(arch, dict):
        raise CheckpointError(f"{where}: 'arch' must be a table of config.json numbers, got {arch!r}")
    unknown = sorted(set(arch) - set(ARCH_KEYS))
    missing = [key for key in ARCH_REQUIRED if key not in arch]
    if unknown or missing:
        raise CheckpointError(f"{where} arch: unknown keys {unknown} or missing {missing} "
                              f"(known: {ARCH_KEYS})")
    bad = {key: value for key, value in arch.items()
           if key != "layer_types" and not (type(value) is int and value > 0)}
    if bad:
        raise CheckpointError(f"{where} arch: {bad} must be positive integers")
    layer_types = arch.get("layer_types")
    if layer_types is not None and not (
            isinstance(layer_types, list) and len(layer_types) == arch["num_hidden_layers"]
            and all(isinstance(kind, str) and kind for kind in layer_types)):
        raise CheckpointError(f"{where} arch: layer_types must list one layer kind (a string) per "
                              f"layer, {arch['num_hidden_layers']} in all; got {layer_types!r}")
    return tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                        for key, value in arch.items()))


def _field(entry: dict[str, Any], key: str, kind: type, where: str):
    value = entry.get(key)
    if not isinstance(value, kind):
        raise CheckpointError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


# --- where a pair's models are on this machine ---

def locate(model: ModelSpec, local_only: bool = True, prepare: bool = False,
           cache_dir: str | Path | None = None) -> Path:
    """The local directory of a catalog model. `prepare` imports the embedded target if needed."""
    if model.source == "embedded":
        from dflash_local.pairs import embedded  # lazy: it pulls in the GGUF reader

        target_dir = embedded.embedded_target_dir()
        if embedded.is_complete_import(target_dir):
            return target_dir
        if prepare:
            return embedded.import_embedded(target_dir)
        raise ModelNotFoundError(f"the embedded target is not imported yet into {target_dir}")
    if model.source == "shipped":
        shipped = paths.shipped_models_dir() / model.repo.removeprefix("models/")
        if not (shipped / "config.json").is_file():
            raise ModelNotFoundError(f"the shipped drafter {model.repo} is missing ({shipped})")
        return shipped
    from dflash_local.pairs.hub import resolve_model

    return resolve_model(model.repo, revision=model.revision, local_only=local_only,
                         cache_dir=cache_dir)


def find_local(model: ModelSpec, cache_dir: str | Path | None = None) -> tuple[str, Path | None]:
    """The model's availability, AVAILABLE (loads without a download), INCOMPLETE (a partial
    download: "incomplete: resume or delete") or MISSING, and, where its files are here, their
    directory (an embedded target that is not imported yet is AVAILABLE with none)."""
    try:
        return AVAILABLE, locate(model, cache_dir=cache_dir)
    except IncompleteSnapshotError:
        return INCOMPLETE, None
    except ModelNotFoundError:
        if model.source != "embedded":
            return MISSING, None
    from dflash_local.pairs import embedded

    try:
        embedded.find_embedded_gguf()
        return AVAILABLE, None
    except CheckpointError:
        return MISSING, None
