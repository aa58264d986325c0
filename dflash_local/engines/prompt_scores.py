"""A prompt's own log-probabilities on a local engine: the target's logits over the prompt,
as legacy completions' `echo` with `logprobs` reports them (and lm-eval's loglikelihood
reads them). The generation that follows is the usual one (engines/local.py).

The prompt's rows but the last run from row 0 (the last row predicts the reply, not a prompt
token: the generation runs it) in chunks of SCORE_CHUNK_ROWS rows, each chunk's logits turned
into its tokens' log-probabilities before the next runs, so memory holds one chunk's logits
[rows, V], never the whole prompt's. A kept prefix cannot be reused (it holds no logits), but
the scored state is kept as a prefix-cache entry, as a warm-up's is (turn_warmup.py): the
prompt extends it by one row, so the generation restores it and prefills one row, on every
target (a state kept whole, a hybrid's or a sliding window's, serves only a longer prompt). With
the cache off it prefills the whole prompt again. Among other generations (engine.sharing), the
others' rounds run between two chunks.
"""

from __future__ import annotations

from dflash_local.engines.turn_warmup import store_state
from dflash_local.events import GenerationParams, TokenLogprob, widest_block
from dflash_local.method.logprobs import token_logprobs

# rows per forward: a chunk's float32 logits are rows x V x 4 bytes (~50 MB at V = 49k)
SCORE_CHUNK_ROWS = 256


def score_prompt(engine, prompt_ids: list[int], top: int,
                 params: GenerationParams) -> tuple[TokenLogprob, ...]:
    """Each token of `prompt_ids` after the first, scored by the row before it, with its `top`
    alternatives; `params`: the generation to come, whose drafter context the kept state
    holds (engine: a LocalEngine)."""
    scored_ids = prompt_ids[:-1]  # row i predicts prompt token i + 1
    if not scored_ids:
        return ()
    drafter = (engine.make_drafter(params.draft_window)
               if widest_block(params, engine.pair.drafter_block) > 1 else None)
    runner = engine.make_runner(collect_taps=drafter is not None)
    scores: list[TokenLogprob] = []
    unseen_taps = []
    for start in range(0, len(scored_ids), SCORE_CHUNK_ROWS):
        if start and engine.sharing is not None:
            engine.sharing.pause()
        end = min(start + SCORE_CHUNK_ROWS, len(scored_ids))
        logits, taps = runner.prefill_scored(scored_ids[:end], start)  # [end - start, V]
        scores += token_logprobs(logits, range(end - start), prompt_ids[start + 1 : end + 1], top)
        if taps is not None:
            unseen_taps.append(taps)
    if (engine.prefix_cache is not None and engine.prefix_states is not None
            and engine.prefix_states.accepts(drafter)):
        store_state(engine, scored_ids, runner, drafter, unseen_taps)
    return tuple(scores)
