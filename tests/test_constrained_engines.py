"""The constrained loop on the MLX engine too (greedy equality with the naive oracle), and
sampling under a grammar on both engines: the first tokens follow the target's probabilities
masked by the grammar, then renormalised (a chi-square test against the exact joint, which a
rule that ignores the mask fails)."""

from __future__ import annotations

import numpy as np
import pytest
from constraint_oracle import (
    ANSWER,
    OracleMatcher,
    constrained_plain,
    follows_answer_schema,
    target_logits,
)
from fixtures_tiny import ScriptedDrafter, collect, params_of, tiny_engine, tiny_pair
from test_sampling import PASS_P_VALUE, chi_square_p_value, greedy_script

from dflash_local.events import GenerationParams, OutputConstraint
from dflash_local.method import speculative
from dflash_local.method.acceptance import target_probs

# a forced first token, then free choices the mask narrows at every position
BRANCHING = OutputConstraint("regex", "x[a-c](y|[a-c]{1,3})z")
MEASURED, SEEDS = 3, 300


@pytest.fixture(scope="module")
def mlx_engine(tmp_path_factory):
    pytest.importorskip("mlx.core")
    from mlx_tiny import write_target
    from tiny_models import make_drafter

    from dflash_local.engines.mlx_engine import MLXEngine

    root = tmp_path_factory.mktemp("mlx-constrained")
    target_dir = write_target(root / "target", "qwen3", seed=3)
    return MLXEngine(target_dir, make_drafter(root / "drafter", target_dir, layers=2, taps=[1, 3, 4]))


@pytest.fixture(scope="module", params=["transformers", "mlx"])
def engine(request, tmp_path_factory):
    if request.param == "mlx":
        return request.getfixturevalue("mlx_engine")
    return tiny_engine(tiny_pair(tmp_path_factory, "qwen3"))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_mlx_constrained_speculative_equals_constrained_plain(mlx_engine, block_size, tree):
    prompt_ids = mlx_engine.encode_chat([{"role": "user", "content": "Is it raining? JSON."}])
    expected = constrained_plain(mlx_engine, prompt_ids, ANSWER, 64)
    for speculative_on in (False, True):
        tokens, events = collect(mlx_engine.stream(prompt_ids, params_of(
            max_tokens=64, constraint=ANSWER, speculative=speculative_on, block_size=block_size,
            tree=tree)))
        assert tokens == expected
        assert events[-1].finish_reason == "stop"
        assert follows_answer_schema(mlx_engine.decode(tokens))


def exact_constrained_joint(engine, prompt_ids, params) -> tuple[dict, dict]:
    """P(first MEASURED tokens) under the masked, renormalised target, from the target's own
    logits and the oracle's matcher; and the tables {prefix: probs} the scripted drafter reads."""
    oracle = OracleMatcher(engine, BRANCHING)
    tables, joint = {}, {(): 1.0}
    for _ in range(MEASURED):
        extended = {}
        for prefix, mass in joint.items():
            oracle.matcher.reset()
            assert oracle.matcher.consume_tokens(list(prefix))
            logits = target_logits(engine, [*prompt_ids, *prefix])
            masked = np.where(oracle.allowed(len(logits)), logits, -np.inf)
            probs = tables[prefix] = target_probs(masked[None], params)[0]
            for token in np.flatnonzero(probs):
                extended[(*prefix, int(token))] = mass * probs[token]
        joint = extended
    return joint, tables


def sampled_firsts(engine, prompt_ids, params, tables, seeds=SEEDS, constrained=True) -> list[tuple]:
    firsts = []
    for seed in range(seeds):
        seeded = GenerationParams(**{**params.__dict__, "seed": seed, "max_tokens": MEASURED + 1,
                                     "stop_token_ids": tuple(engine.eos_token_ids)})
        drafter = ScriptedDrafter(prompt_ids, greedy_script(len(prompt_ids), tables), drafter_block=4)
        grammar = engine.constraints.grammar(BRANCHING) if constrained else None
        events = speculative.generate(engine.make_runner(collect_taps=True), drafter, prompt_ids,
                                      seeded, grammar=grammar)
        firsts.append(tuple(token for event in events for token in event.token_ids)[:MEASURED])
    return firsts


def test_constrained_sampling_follows_the_masked_target(engine):
    prompt_ids = engine.encode_chat([{"role": "user", "content": "hello world"}])
    params = params_of(temperature=1.0)
    joint, tables = exact_constrained_joint(engine, prompt_ids, params)
    assert len(joint) > 4, "the grammar leaves choices to sample"
    assert chi_square_p_value(sampled_firsts(engine, prompt_ids, params, tables), joint) > PASS_P_VALUE
    # the check has teeth: sampling that ignores the mask leaves the grammar's support
    unmasked = sampled_firsts(engine, prompt_ids, params, tables, seeds=20, constrained=False)
    assert any(sample not in joint for sample in unmasked)
