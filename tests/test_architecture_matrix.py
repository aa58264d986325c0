"""The architecture matrix: every model_type the catalog names, on both local engines.

For each (model_type, engine) a tiny random-weight target built from the engine's own model
class (Transformers or mlx-lm) and a random z-lab-format drafter: speculative decoding equals
plain decoding token for token (greedy, float32), with a drafter that is right for part of some
blocks, so rollbacks of 0 < k < B-1 rows happen (GatedDeltaNet states, sliding windows past
their size); and the taps the drafter receives are the outputs of exactly the layers it names,
row for row, against the model's own forward. A combination an engine cannot run is refused
from config.json before any weight loads, naming the architecture and the engine that can.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from arch_tiny import MODEL_TYPES, TAPS, drafter_for, hf_target
from tiny_models import VOCAB

from dflash_local.engines.architectures import MLX_MODEL_TYPES
from dflash_local.events import GenerationParams, GenerationStats, parse_block_size
from dflash_local.pairs.catalog import load_catalog

ENGINES = ("mlx", "transformers")
# every combination runs losslessly: none is refused (a refused one would be listed with its reason)
RUNS = frozenset((model_type, engine) for model_type in MODEL_TYPES for engine in ENGINES)
PROMPT = [1, 40, 71, 88, 101, 33, 72, 99, 12, 250, 5, 64]  # longer than the sliding window
MAX_TOKENS = 20
BLOCK = 5
RIGHT = (BLOCK - 1, 0, 1, 2, 3)  # drafts right per round, cyclically: full, none, partial
SEEDS = {"mlx": 5, "transformers": 3}  # every tiny target then has a varied greedy output


def write_target(out, model_type: str, engine: str):
    if engine == "mlx":
        from mlx_tiny import write_target as write_mlx_target

        return write_mlx_target(out, model_type, seed=SEEDS[engine])
    return hf_target(out, model_type, seed=SEEDS[engine])


def load_engine(engine: str, target, drafter):
    if engine == "mlx":
        from dflash_local.engines.mlx_engine import MLXEngine

        return MLXEngine(target, drafter)
    from dflash_local.engines.torch_engine import TorchEngine

    return TorchEngine(target, drafter)


def as_numpy(array) -> np.ndarray:
    return array.float().numpy() if isinstance(array, torch.Tensor) else np.array(array)


class PartlyRightDrafter:
    """Runs the real drafter (its cache stays in step), proposes the plain output for the first
    RIGHT[round] drafts of a block and a wrong token after, and keeps every tap row it is handed."""

    tree_drafts = False

    def __init__(self, inner, plain: list[int]):
        self.inner, self.plain = inner, plain
        self.drafter_block = inner.drafter_block
        self.taps: list[np.ndarray] = []
        self.rows = 0

    def propose(self, anchor_id, new_taps, width):
        self.inner.propose(anchor_id, new_taps, width)
        self.taps.append(as_numpy(new_taps)[0])
        self.rows += new_taps.shape[1]
        index = self.rows - len(PROMPT)  # the anchor's index in the output
        assert self.plain[index] == anchor_id, "the taps do not cover the committed rows"
        truth = (self.plain + [0] * width)[index + 1 : index + width]
        right = RIGHT[(len(self.taps) - 1) % len(RIGHT)]
        return truth[:right] + [(token + 1) % VOCAB for token in truth[right:]]


def generate(engine, speculative: bool, drafter_factory=None):
    """Greedy tokens and the drafts accepted per round; `drafter_factory` replaces the engine's."""
    params = GenerationParams(max_tokens=MAX_TOKENS, speculative=speculative,
                              block_size=parse_block_size(BLOCK), stop_token_ids=(-1,))
    if drafter_factory is not None:
        engine.make_drafter = drafter_factory
    stats, tokens, accepted = GenerationStats(), [], []
    try:
        for event in engine.stream(PROMPT, params):
            stats.add(event)
            tokens.extend(event.token_ids)
            accepted.append(event.accepted)
    finally:
        engine.__dict__.pop("make_drafter", None)
    return tokens, accepted[1:]  # the prefill's event drafts nothing


def reference_taps(engine, engine_name: str, token_ids: list[int]) -> np.ndarray:
    """[rows, taps*H]: the tapped layers' outputs in the model's own forward over token_ids."""
    if engine_name == "transformers":
        with torch.inference_mode():
            out = engine.model(torch.tensor([token_ids]), output_hidden_states=True)
        return np.concatenate([as_numpy(out.hidden_states[i + 1][0]) for i in TAPS], axis=-1)
    from mlx_tiny import reference_outputs

    layers = engine.adapter.text_model(engine.model).layers
    (_, outputs), = reference_outputs(engine.model, layers, [token_ids])
    return np.concatenate([outputs[i] for i in TAPS], axis=-1)


@pytest.fixture(scope="module", params=sorted(RUNS), ids="-".join)
def case(request, tmp_path_factory):
    """(engine, its name, plain greedy tokens) for one combination of the matrix."""
    model_type, engine_name = request.param
    if engine_name == "mlx":
        pytest.importorskip("mlx.core")
    root = tmp_path_factory.mktemp(f"{model_type}-{engine_name}")
    target = write_target(root / "target", model_type, engine_name)
    engine = load_engine(engine_name, target, drafter_for(root / "drafter", target, block_size=BLOCK))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread on a busy core only waits
    plain, _ = generate(engine, speculative=False)
    assert len(plain) == MAX_TOKENS and len(set(plain)) >= 4, "a degenerate target hides bugs"
    yield engine, engine_name, plain
    torch.set_num_threads(threads)
    engine.close()


def test_lossless_with_partial_acceptance_and_taps_of_the_named_layers(case):
    engine, engine_name, plain = case
    drafters = []

    def partly_right(window=None):
        drafters.append(PartlyRightDrafter(type(engine).make_drafter(engine, window), plain))
        return drafters[-1]

    tokens, accepted = generate(engine, True, partly_right)
    assert tokens == plain
    assert BLOCK - 1 in accepted and 0 in accepted  # a whole block kept, a whole block rolled back
    assert any(0 < drafts < BLOCK - 1 for drafts in accepted)  # part of a block rolled back
    taps = np.concatenate(drafters[0].taps, axis=0)
    assert taps.shape[0] > len(PROMPT) + MAX_TOKENS // 2  # the prompt's rows and most outputs'
    expected = reference_taps(engine, engine_name, (PROMPT + plain)[: taps.shape[0]])
    assert taps.shape == expected.shape
    np.testing.assert_allclose(taps, expected, atol=2e-4, rtol=1e-4)


def test_lossless_with_the_real_drafter(case):
    engine, _, plain = case
    assert generate(engine, True)[0] == plain


def test_every_local_pair_of_the_catalog_is_in_the_matrix():
    listed = load_catalog().local_model_types()
    assert listed, "the catalog names no local pair"
    missing = sorted((model_type, engine) for model_type, engines in listed.items()
                     for engine in engines if (model_type, engine) not in RUNS)
    assert not missing, f"catalog pairs no matrix row covers: {missing}"


def test_the_mlx_table_is_what_the_adapters_run():
    pytest.importorskip("mlx.core")
    from dflash_local.engines.mlx_adapters import ADAPTERS

    assert set(ADAPTERS) == MLX_MODEL_TYPES
    assert set(MODEL_TYPES) <= MLX_MODEL_TYPES
