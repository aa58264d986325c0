"""A prompt's own log-probabilities on both local engines (engines/prompt_scores.py): equal to
the log_softmax of the real model's own forward over the prompt, chunk by chunk, and the
scored state kept so the generation after it restores every prompt row but the last and
generates the same tokens as without it."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures_tiny import collect, tiny_engine, tiny_pair
from test_logprobs import TOLERANCE, reference_logprobs

from dflash_local.engines import prompt_scores
from dflash_local.events import GenerationParams
from dflash_local.method.prefix_cache import make_prefix_cache

TOP = 4
PROMPT = [5, 77, 130, 42, 9, 200, 31, 64, 18, 111, 250, 7, 99]  # 13 rows: chunks of 5, 5 and 3


@pytest.fixture(scope="module", params=["transformers", "mlx"])
def engine(request, tmp_path_factory):
    if request.param == "transformers":
        return tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    from dflash_local.engines.mlx_engine import MLXEngine

    root = tmp_path_factory.mktemp("mlx-scores")
    target = write_target(root / "target", "qwen3", seed=3)
    return MLXEngine(target, make_drafter(root / "drafter", target, layers=2, taps=[1, 3, 4]))


@pytest.fixture
def fresh_cache(engine):
    """An empty RAM tier for the test, the engine's own put back after it."""
    kept = engine.prefix_cache
    engine.prefix_cache = make_prefix_cache(True, None, 1 << 20)
    yield engine.prefix_cache
    engine.prefix_cache = kept


def test_scores_equal_the_models_forward_in_chunks(engine, fresh_cache, monkeypatch):
    monkeypatch.setattr(prompt_scores, "SCORE_CHUNK_ROWS", 5)
    scores = engine.score_prompt(PROMPT, TOP, GenerationParams(max_tokens=4))
    assert len(scores) == len(PROMPT) - 1  # the first token has none: nothing predicts it
    reference = reference_logprobs(engine, PROMPT[:1], PROMPT[1:])  # row i: token i + 1
    for row, (score, token_id) in enumerate(zip(scores, PROMPT[1:], strict=True)):
        assert score.logprob == pytest.approx(reference[row, token_id], abs=TOLERANCE)
        best = np.argsort(-reference[row], kind="stable")[:TOP]
        assert list(score.top_ids) == best.tolist()
        assert score.top_logprobs == pytest.approx(reference[row, best].tolist(), abs=TOLERANCE)


@pytest.mark.parametrize("speculative", [False, True])
def test_the_generation_resumes_the_scored_state(engine, fresh_cache, speculative):
    params = GenerationParams(max_tokens=12, speculative=speculative, stop_token_ids=(-1,))
    expected, _ = collect(engine.stream(PROMPT, params))
    fresh_cache.clear()
    engine.score_prompt(PROMPT, 0, params)
    tokens, events = collect(engine.stream(PROMPT, params))
    assert tokens == expected
    assert events[0].cached_tokens == len(PROMPT) - 1  # one row prefilled after the scoring
