"""The peers: other ways to decode the same target on the same prompts, timed like ours.

Transformers engine: `model.generate()` (the reference), prompt-lookup decoding
(`prompt_lookup_num_tokens`) and assisted generation with an autoregressive draft model
(`assistant_model`). MLX engine: mlx-lm's `stream_generate`, plain and with its own draft-model
speculative decoding. A peer that cannot run here (no AR draft model) stays in the table with
the reason. Peers borrow the engine's loaded target (`engine.model`): same weights, same dtype,
same kernels (on a CPU in float32, oneDNN-packed linears: accel/torch_linear.py; on MLX's CPU
backend the target's attention through accel/mlx_attention.py); the AR draft model gets the
same packing (an MLX AR draft of another mlx-lm model family keeps mlx-lm's attention).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from dflash_local.bench.measure import RunFigures
from dflash_local.engines.table import MLX, TRANSFORMERS
from dflash_local.errors import IncompatiblePairError
from dflash_local.events import GenerationParams

PROMPT_LOOKUP_TOKENS = 10  # the value Transformers' docs suggest
MLX_DRAFT_TOKENS = 3
NO_AR_DRAFT = ("n/a: no AR draft model given (--ar-draft DIR; `dflash-local train --kind ar` "
               "makes one for this target)")


@dataclass
class Peer:
    name: str
    run: Callable[[list[int], GenerationParams], RunFigures] | None
    unavailable: str | None = None  # why it cannot run here
    close: Callable[[], None] | None = None  # ends its process (a Mac peer)
    settings: dict | None = None  # what a Mac peer chose for itself (cap, quantization, BLAS)


def peers_for(engine, ar_draft: str | None, peer_python: str | None = None,
              mac_peers: tuple[str, ...] = (), log: Callable[[str], None] = print,
              greedy: bool = True) -> list[Peer]:
    """The in-process peers of the engine, then the Mac peers named in `mac_peers`."""
    in_process = {TRANSFORMERS.name: transformers_peers, MLX.name: mlx_peers}.get(engine.name)
    peers = in_process(engine, ar_draft) if in_process is not None else []
    return peers + process_peers(engine, peer_python, mac_peers, log, greedy)


# --- dflash-mlx and mlx-dspark, each in its own process ---

def process_peers(engine, peer_python: str | None, names: tuple[str, ...],
                  log: Callable[[str], None], greedy: bool = True) -> list[Peer]:
    from dflash_local.bench import peer_process

    rows = [(name, dtype) for name in names for dtype in peer_process.DRAFTER_DTYPES]
    reason = (peer_process.NO_ENVIRONMENT if peer_python is None else
              "n/a: the Mac peers are measured greedy only (--temperature 0)" if not greedy else
              f"n/a: the {engine.name} engine has no local target directory to share"
              if engine.pair.target_path is None else None)
    if rows and reason:
        return [Peer(peer_process.row_name(name, None, dtype), None, reason) for name, dtype in rows]
    blas = peer_process.blas_binding(engine.compute_threads()) if rows else {}
    peers = []
    for name, dtype in rows:
        log(f"starting peer {name} ({peer_process.DRAFTER_DTYPES[dtype]})...")
        try:
            process, loaded = peer_process.start_peer(
                peer_python, name, dtype, str(engine.pair.target_path),
                str(engine.pair.drafter_path), blas, log)
        except peer_process.PeerProcessError as exc:
            log(f"peer {name} cannot run: {exc}")
            peers.append(Peer(peer_process.row_name(name, None, dtype), None, f"n/a: {exc}"))
            continue
        peers.append(Peer(peer_process.row_name(name, loaded["version"], dtype),
                          partial(peer_process.generate, process), close=process.close,
                          settings={**loaded["settings"], "blas": process.blas}))
    return peers


# --- Transformers ---

def transformers_peers(engine, ar_draft: str | None) -> list[Peer]:
    peers = [
        Peer("transformers generate", partial(_hf_generate, engine, {})),
        Peer(f"prompt lookup (n={PROMPT_LOOKUP_TOKENS})",
             partial(_hf_generate, engine, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS})),
    ]
    if ar_draft is None:
        return [*peers, Peer("assisted (AR draft)", None, NO_AR_DRAFT)]
    from transformers import AutoModelForCausalLM

    from dflash_local.accel.torch_linear import pack_causal_lm
    from dflash_local.pairs.hub import resolve_model

    draft = AutoModelForCausalLM.from_pretrained(resolve_model(ar_draft), dtype=engine.model.dtype)
    draft = draft.to(engine.model.device).eval()
    pack_causal_lm(draft)
    _check_same_vocab(draft.config.vocab_size, engine.model.config.vocab_size, ar_draft)
    return [*peers, Peer(f"assisted ({ar_draft})",
                         partial(_hf_generate, engine, {"assistant_model": draft}))]


class _TimingStreamer:
    """Transformers streamer: the prompt comes first, then each step's new tokens."""

    def __init__(self):
        self.seen_prompt = False
        self.first_token_at: float | None = None
        self.step_sizes: list[int] = []

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.step_sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def _hf_generate(engine, extra: dict, prompt_ids: list[int], params: GenerationParams) -> RunFigures:
    import torch
    from transformers import GenerationConfig

    sampling = ({"do_sample": False} if params.greedy else
                {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                 "top_k": params.top_k})
    config = GenerationConfig(
        max_new_tokens=params.max_tokens, eos_token_id=list(params.stop_token_ids),
        pad_token_id=params.stop_token_ids[0], **sampling,
        **{k: v for k, v in extra.items() if k != "assistant_model"},
    )
    if params.seed is not None:
        torch.manual_seed(params.seed)
    input_ids = torch.tensor([prompt_ids], device=engine.model.device)
    streamer = _TimingStreamer()
    start = time.perf_counter()
    with torch.inference_mode():
        output = engine.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
            streamer=streamer, assistant_model=extra.get("assistant_model"),
        )
    end = time.perf_counter()
    new_ids = output[0, len(prompt_ids):].tolist()
    first = streamer.first_token_at or end
    speculative = bool(extra)
    return RunFigures(
        prompt_tokens=len(prompt_ids), completion_tokens=len(new_ids), prefill_s=first - start,
        decode_s=end - first, committed_per_round=streamer.step_sizes[1:] if speculative else [],
        token_ids=new_ids,
    )


# --- MLX ---

def mlx_peers(engine, ar_draft: str | None) -> list[Peer]:
    peers = [Peer("mlx-lm generate", partial(_mlx_generate, engine, None))]
    if ar_draft is None:
        return [*peers, Peer("mlx-lm draft model (AR draft)", None, NO_AR_DRAFT)]
    from mlx_lm import load as mlx_lm_load

    from dflash_local.pairs.hub import resolve_model

    draft, draft_tokenizer = mlx_lm_load(str(resolve_model(ar_draft)))
    _check_same_vocab(draft_tokenizer.vocab_size, engine.tokenizer.vocab_size, ar_draft)
    return [*peers, Peer(f"mlx-lm draft model ({ar_draft})",
                         partial(_mlx_generate, engine, draft))]


def _mlx_generate(engine, draft_model, prompt_ids: list[int], params: GenerationParams) -> RunFigures:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tokenizer = TokenizerWrapper(engine.tokenizer, eos_token_ids=list(params.stop_token_ids))
    sampler = make_sampler(temp=params.temperature, top_k=params.top_k,
                           top_p=params.top_p if params.top_p < 1.0 else 0.0)
    if params.seed is not None:
        mx.random.seed(params.seed)
    extra = {} if draft_model is None else {"draft_model": draft_model,
                                             "num_draft_tokens": MLX_DRAFT_TOKENS}
    token_ids: list[int] = []
    from_draft: list[bool] = []
    first = None
    start = time.perf_counter()
    for response in stream_generate(engine.model, tokenizer, prompt_ids,
                                    max_tokens=params.max_tokens, sampler=sampler, **extra):
        first = first or time.perf_counter()
        token_ids.append(int(response.token))
        from_draft.append(bool(response.from_draft))
    end = time.perf_counter()
    first = first or end
    return RunFigures(
        prompt_tokens=len(prompt_ids), completion_tokens=len(token_ids), prefill_s=first - start,
        decode_s=end - first,
        committed_per_round=_rounds_from_flags(from_draft[1:]) if draft_model is not None else [],
        token_ids=token_ids,
    )


def _rounds_from_flags(from_draft: list[bool]) -> list[int]:
    """mlx-lm yields a round's accepted drafts (from_draft) and then the target's own token."""
    rounds, current = [], 0
    for flag in from_draft:
        current += 1
        if not flag:
            rounds.append(current)
            current = 0
    return rounds + ([current] if current else [])


def _check_same_vocab(draft_vocab: int, target_vocab: int, name: str) -> None:
    if draft_vocab != target_vocab:
        raise IncompatiblePairError(
            [f"AR draft {name} has vocab size {draft_vocab}, the target {target_vocab}"]
        )
