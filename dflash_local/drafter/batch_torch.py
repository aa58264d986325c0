"""Several generations' drafter passes as one ragged pass of the torch drafter (DFlash v1).

Every session's new context rows are concatenated into one sequence, and so are their blocks
([anchor, MASK x (width-1)] each), so the context projection (`fc`), each layer's projections and
MLP, and the draft head read their weights once for all sessions; each row keeps its own
position. Attention stays per session: a session's block attends to its own context cache (its
new rows appended there, as its own pass appends them) and to its own block, under its own layer
masks. DFlash 2's convolutions mix rows within a block, so they run per session's block (their
small kernel projection included) between the shared sublayers; its candidate selector picks
each session's draft from that session's rows. A pass that fails part-way leaves every
session's cache as it was before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash_local.drafter.dflash2_torch import GroupedCausalConv
from dflash_local.drafter.selector import greedy_chain, selector_tree
from dflash_local.method.draft_tree import DraftTree, tree_from_logits
from dflash_local.method.ragged import check_arguments, spans, split

# model_torch.py's DraftSession, which imports this module (no import back: no cycle)
DraftSession = Any


def propose_batch(sessions: Sequence[DraftSession], anchors: Sequence[int],
                  new_taps: Sequence[torch.Tensor], widths: Sequence[int]) -> list[list[int]]:
    """Each session's `propose(anchor, taps, width)` (see DraftSession.propose_batch)."""
    if not _checked(sessions, anchors, new_taps, widths):
        return [session.propose(anchor, taps, width)
                for session, anchor, taps, width in zip(sessions, anchors, new_taps, widths)]
    model = sessions[0].model
    with torch.inference_mode():
        hidden = _ragged_draft(sessions, anchors, new_taps, widths)
        if model.candidate_selector is not None:
            return [greedy_chain(inputs) for inputs in _selector_inputs(model, hidden, anchors, widths)]
        ids = model.draft_token_ids(hidden)[0].tolist()
    return _split(ids, widths)


def propose_tree_batch(sessions: Sequence[DraftSession], anchors: Sequence[int],
                       new_taps: Sequence[torch.Tensor], nodes: Sequence[int]) -> list[DraftTree]:
    """Each session's `propose_tree(anchor, taps, nodes)` (see DraftSession.propose_tree_batch)."""
    widths = [count + 1 for count in nodes]
    if not _checked(sessions, anchors, new_taps, widths):
        return [session.propose_tree(anchor, taps, count)
                for session, anchor, taps, count in zip(sessions, anchors, new_taps, nodes)]
    model = sessions[0].model
    with torch.inference_mode():
        hidden = _ragged_draft(sessions, anchors, new_taps, widths)
        if model.candidate_selector is not None:
            return [selector_tree(inputs, count) for inputs, count
                    in zip(_selector_inputs(model, hidden, anchors, widths), nodes)]
        logits, ids = model.draft_logits(hidden)
    rows = logits[0].float().cpu().numpy()
    vocab_ids = None if ids is None else ids.cpu().numpy()
    return [tree_from_logits(session_rows, vocab_ids, count)
            for session_rows, count in zip(_split(rows, widths), nodes)]


def _selector_inputs(model, hidden: torch.Tensor, anchors, widths) -> list:
    """DFlash 2's selector inputs per session, from one head pass over every draft row."""
    logits, ids = model.draft_logits(hidden)
    return [model.candidate_selector.inputs(session_hidden, session_logits, ids, anchor)
            for session_hidden, session_logits, anchor
            in zip(_split(hidden[0], widths), _split(logits[0], widths), anchors)]


def _checked(sessions, anchors, new_taps, widths) -> bool:
    """Refuse mismatched arguments; whether there is more than one session to batch."""
    check_arguments("propose_batch", sessions, "session",
                    {"anchors": anchors, "taps": new_taps, "widths": widths},
                    lambda session: session.model, "drafter")
    return len(sessions) > 1


def _split(rows, widths: Sequence[int]) -> list:
    """The joined draft rows cut back into sessions (width - 1 each: the anchor drafts none)."""
    return split(rows, [width - 1 for width in widths])


def _ragged_draft(sessions, anchors, new_taps, widths) -> torch.Tensor:
    """`_draft_rows`; a pass that fails part-way puts every session's context cache back as it
    was (an append builds new tensors, so the lists held before are that state), none left
    holding some layers' new rows."""
    saved = [(list(s.cache.keys), list(s.cache.values), s.cache.start, s.cache.end) for s in sessions]
    try:
        return _draft_rows(sessions, anchors, new_taps, widths)
    except BaseException:
        for session, (keys, values, start, end) in zip(sessions, saved):
            session.cache.keys, session.cache.values = keys, values
            session.cache.start, session.cache.end = start, end
        raise


def _draft_rows(sessions, anchors, new_taps, widths) -> torch.Tensor:
    """The draft rows' hidden states (block positions 1..width-1 of each session, one after
    another), [1, sum(width - 1), H]; every session's context cache gains its new rows."""
    model, first = sessions[0].model, sessions[0]
    device, dtype = first._device, first._dtype
    mask_id = model.config.mask_token_id
    block = [token for anchor, width in zip(anchors, widths) for token in [anchor] + [mask_id] * (width - 1)]
    x = model.embed(torch.tensor([block], device=device))  # [1, sum W, H]
    ctx = model.hidden_norm(model.fc(torch.cat([taps.to(dtype) for taps in new_taps], dim=1)))
    counts = [taps.shape[1] for taps in new_taps]
    ctx_pos = [torch.arange(s.cache.end, s.cache.end + n, device=device) for s, n in zip(sessions, counts)]
    block_pos = [torch.arange(s.cache.end + n, s.cache.end + n + w, device=device)
                 for s, n, w in zip(sessions, counts, widths)]
    ctx_rope = model.rotary(torch.cat(ctx_pos), x.dtype)
    block_rope = model.rotary(torch.cat(block_pos), x.dtype)
    ctx_spans, block_spans = spans(counts), spans(widths)
    for index, layer in enumerate(model.layers):
        new_keys, new_values = layer.self_attn.context_kv(ctx, ctx_rope)
        contexts = []
        for session, (start, stop), positions in zip(sessions, ctx_spans, block_pos):
            keys, values = session.cache.append(index, new_keys[:, :, start:stop],
                                                new_values[:, :, start:stop])
            end = session.cache.end + stop - start
            kept = torch.arange(end - keys.shape[2], end, device=device)
            contexts.append((keys, values, model._layer_mask(index, kept, positions)))
        x = _ragged_layer(layer, x, contexts, block_rope, block_spans)
    for session, count in zip(sessions, counts):
        session.cache.end += count
        session.cache.start = session.cache.end - session.cache.keys[0].shape[2]
    drafts = [row for start, stop in block_spans for row in range(start + 1, stop)]
    return model.norm(x)[:, drafts]


def _ragged_layer(layer: nn.Module, x, contexts, block_rope, block_spans) -> torch.Tensor:
    """One decoder layer over every block row (DFlash 2: its convolutions per session's block)."""
    h, kernels = _conv_prepare(layer.attention_conv, layer.input_layernorm(x), block_spans)
    out = _ragged_attention(layer.self_attn, h, contexts, block_rope, block_spans)
    x = x + _conv_finish(layer.attention_conv, out, kernels, block_spans)
    h, kernels = _conv_prepare(layer.mlp_conv, layer.post_attention_layernorm(x), block_spans)
    return x + _conv_finish(layer.mlp_conv, layer.mlp(h), kernels, block_spans)


def _conv_prepare(conv: GroupedCausalConv | None, hidden: torch.Tensor, spans):
    """`conv.prepare` on each session's block rows (v1: no convolution, rows as they are)."""
    if conv is None:
        return hidden, None
    halves = [conv.prepare(hidden[:, start:stop]) for start, stop in spans]
    return torch.cat([mixed for mixed, _ in halves], dim=1), [kernel for _, kernel in halves]


def _conv_finish(conv: GroupedCausalConv | None, out: torch.Tensor, kernels, spans):
    if conv is None:
        return out
    return torch.cat([conv.finish(out[:, start:stop], kernel)
                      for (start, stop), kernel in zip(spans, kernels)], dim=1)


def _ragged_attention(attention, x, contexts, block_rope, block_spans) -> torch.Tensor:
    """One projection of every block row; each session's rows attend to its own context and
    block. x: [1, sum W, H] -> [1, sum W, H]."""
    queries, keys, values = attention.block_qkv(x, block_rope)
    outputs = [
        attention.attend(queries[:, :, start:stop],
                         torch.cat([ctx_keys, keys[:, :, start:stop]], dim=2),
                         torch.cat([ctx_values, values[:, :, start:stop]], dim=2), mask)
        for (start, stop), (ctx_keys, ctx_values, mask) in zip(block_spans, contexts)
    ]
    out = torch.cat(outputs, dim=2)  # [1, heads, sum W, d]
    return attention.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], -1))
