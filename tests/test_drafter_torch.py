"""The torch drafter against two oracles, and its checkpoint loading.

Oracles: z-lab's own `dflash.model.DFlashDraftModel` (the installed package imports and runs
under transformers 5.24 as it is, so no shim), loaded from the same checkpoint directory; and
`naive_logits` below, DFLASH.md's math written out with explicit masks and softmax, which
is the equality oracle for sliding/causal layer types.
"""

from __future__ import annotations

import json
import shutil

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from fixtures_tiny import tiny_pair
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash_local.drafter.config import DrafterConfig
from dflash_local.drafter.model_torch import DraftSession, load_drafter
from dflash_local.errors import CheckpointError

zlab = pytest.importorskip("dflash.model")  # test-only oracle

MASK = tiny_models.MASK_ID
LAYER_KINDS = {
    "v1": {},
    "sliding": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "sliding_window": 3, "use_sliding_window": True},
    "bidirectional-sliding": {"layer_types": ["sliding_attention"] * 3, "sliding_window": 3,
                              "use_sliding_window": True, "is_causal": False},
    "causal": {"is_causal": True},
}


@pytest.fixture(scope="module", params=list(LAYER_KINDS))
def setup(request, tmp_path_factory):
    """(target, our bound drafter, z-lab's drafter) on one checkpoint of that layer kind."""
    kind = LAYER_KINDS[request.param]
    pair = tiny_pair(tmp_path_factory, "qwen3", block_size=4, layers=3, **kind)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    ours = bound_drafter(pair.drafter, target)
    reference = zlab.DFlashDraftModel.from_pretrained(pair.drafter, dtype=torch.float32).eval()
    return target, ours, reference


def bound_drafter(path, target):
    return load_drafter(path).bind(target.get_input_embeddings(), target.get_output_embeddings())


def target_taps(target, ids: list[int], layer_ids) -> torch.Tensor:
    with torch.inference_mode():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def reference_logits(target, reference, taps, block, positions, cache=None):
    with torch.inference_mode():
        noise = F.embedding(block, target.get_input_embeddings().weight)
        hidden = reference(position_ids=positions[None], noise_embedding=noise, target_hidden=taps,
                           past_key_values=cache, use_cache=cache is not None)
        return reference.compute_logits(hidden, target.lm_head)


def our_logits(model, taps, block, cache):
    with torch.inference_mode():
        return model.logits(model.draft(block, taps, cache))


PROMPT = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 2, 1, 97]


def test_matches_zlab_reference_over_rounds(setup):
    """Round 1: the prompt's taps; round 2: three accepted rows, as the loop hands them over."""
    target, ours, reference = setup
    taps = target_taps(target, PROMPT + [50, 60, 70], ours.config.target_layer_ids)
    prompt_len, width = len(PROMPT), 4
    cache, ref_cache = ours.new_cache(), zlab._make_cache(reference.config)
    rounds = [(0, prompt_len, PROMPT[-1]), (prompt_len, prompt_len + 3, 70)]
    for start, end, anchor in rounds:
        block = torch.tensor([[anchor] + [MASK] * (width - 1)])
        expected = reference_logits(target, reference, taps[:, start:end], block,
                                    torch.arange(start, end + width), ref_cache)
        zlab._crop_to(ref_cache, end)  # the reference keeps context rows only, as we do
        torch.testing.assert_close(our_logits(ours, taps[:, start:end], block, cache), expected,
                                   rtol=1e-5, atol=1e-5)
    assert cache.end == prompt_len + 3


def test_matches_naive_math(setup):
    target, ours, _ = setup
    taps = target_taps(target, PROMPT, ours.config.target_layer_ids)
    block = torch.tensor([[PROMPT[-1]] + [MASK] * 3])
    expected = naive_logits(ours, target, taps[0], block[0])
    torch.testing.assert_close(our_logits(ours, taps, block, ours.new_cache())[0], expected,
                               rtol=1e-4, atol=1e-4)


def test_layer_kind_changes_the_draft(setup):
    """The mask is not a no-op: the same weights without it draft something else."""
    target, ours, _ = setup
    if not ours.config.layer_types and ours.config.is_causal is None:
        pytest.skip("v1 layers have no mask")
    taps = target_taps(target, PROMPT, ours.config.target_layer_ids)
    block = torch.tensor([[PROMPT[-1]] + [MASK] * 3])
    fields = {name: getattr(ours.config, name) for name in DrafterConfig.__dataclass_fields__}
    unmasked = DrafterConfig(**{**fields, "layer_types": (), "is_causal": None})
    plain = naive_logits(ours, target, taps[0], block[0], config=unmasked)
    assert not torch.allclose(our_logits(ours, taps, block, ours.new_cache())[0], plain, atol=1e-3)


# --- the naive oracle: DFLASH.md's drafter, one explicit step at a time ---

def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, theta):
    """x: [T, heads, d]; rotate-half RoPE at absolute positions."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def allowed(config: DrafterConfig, layer: int, query_pos: int, key_pos: int) -> bool:
    """Who a block row may attend to (context rows come first, then the block)."""
    sliding = bool(config.layer_types) and config.layer_types[layer] == "sliding_attention"
    causal = sliding if config.is_causal is None else config.is_causal
    if causal and key_pos > query_pos:
        return False
    window = config.sliding_window if sliding else None
    return window is None or abs(query_pos - key_pos) < window


def naive_logits(model, target, taps, block, config: DrafterConfig | None = None):
    """taps: [S, n*H] context rows at positions 0..S-1; block: [B] at positions S..S+B-1."""
    config = config or model.config
    weights = {name: tensor.float() for name, tensor in model.state_dict().items()}
    eps, d = config.rms_norm_eps, config.head_dim
    ctx = rms(taps @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
    x = target.get_input_embeddings().weight[block]
    key_pos = torch.arange(taps.shape[0] + len(block))
    query_pos = key_pos[taps.shape[0]:]
    for i in range(config.num_hidden_layers):
        prefix = f"layers.{i}."
        w = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}
        h = rms(x, w["input_layernorm.weight"], eps)
        rows = torch.cat([ctx, h])  # keys/values: [context ; block]
        q = (h @ w["self_attn.q_proj.weight"].T).view(len(block), -1, d)
        k = (rows @ w["self_attn.k_proj.weight"].T).view(len(rows), -1, d)
        q, k = rms(q, w["self_attn.q_norm.weight"], eps), rms(k, w["self_attn.k_norm.weight"], eps)
        v = (rows @ w["self_attn.v_proj.weight"].T).view(len(rows), -1, d)
        q, k = rope(q, query_pos, config.rope_theta), rope(k, key_pos, config.rope_theta)
        group = q.shape[1] // k.shape[1]
        heads = []
        for head in range(q.shape[1]):
            scores = q[:, head] @ k[:, head // group].T / d**0.5
            for qi, qp in enumerate(query_pos.tolist()):
                for ki, kp in enumerate(key_pos.tolist()):
                    if not allowed(config, i, qp, kp):
                        scores[qi, ki] = float("-inf")
            heads.append(torch.softmax(scores, dim=-1) @ v[:, head // group])
        x = x + torch.cat(heads, dim=-1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"], eps)
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms(x, weights["norm.weight"], eps) @ target.get_output_embeddings().weight.T


# --- the context cache window ---

def test_window_bounds_the_cache_and_keeps_positions(tmp_path_factory):
    pair = tiny_pair(tmp_path_factory, "qwen3", block_size=4)
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    model = bound_drafter(pair.drafter, target)
    ids = PROMPT + [40, 41, 42, 43, 44, 45, 46]
    taps = target_taps(target, ids, model.config.target_layer_ids)
    window, session = 6, DraftSession(model, window=6)
    start = 0
    for end in (len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 4, len(ids)):
        proposals = session.propose(ids[end - 1], taps[:, start:end], width=4)
        assert all(keys.shape[2] <= window for keys in session.cache.keys)
        assert (session.cache.start, session.cache.end) == (end - window, end)
        # the same draft from a fresh cache holding only the last `window` rows, at their positions
        fresh = model.new_cache()
        fresh.end = end - window
        block = torch.tensor([[ids[end - 1]] + [MASK] * 3])
        expected = our_logits(model, taps[:, end - window : end], block, fresh)[0, 1:].argmax(-1)
        assert proposals == expected.tolist()
        start = end


# --- checkpoint errors ---

@pytest.fixture
def drafter_copy(tmp_path_factory, tmp_path):
    pair = tiny_pair(tmp_path_factory, "qwen3")
    shutil.copytree(pair.drafter, tmp_path / "drafter")
    return tmp_path / "drafter"


def test_truncated_safetensors(drafter_copy):
    weights = drafter_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_drafter(drafter_copy)


def test_missing_weight_is_named(drafter_copy):
    weights = drafter_copy / "model.safetensors"
    state = load_file(weights)
    del state["layers.1.mlp.up_proj.weight"]
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=r"missing \['layers\.1\.mlp\.up_proj\.weight'\]"):
        load_drafter(drafter_copy)


def test_wrong_shape_is_named(drafter_copy):
    weights = drafter_copy / "model.safetensors"
    state = load_file(weights)
    state["fc.weight"] = torch.zeros(64, 64)
    save_file(state, weights)
    message = r"fc\.weight has shape \(64, 64\), config implies \(64, 128\)"
    with pytest.raises(CheckpointError, match=message):
        load_drafter(drafter_copy)


def test_no_weights_file(drafter_copy):
    (drafter_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors file"):
        load_drafter(drafter_copy)


def test_bf16_checkpoint_loads_as_saved(drafter_copy):
    """z-lab ships bf16; loading upcasts exactly."""
    weights = load_file(drafter_copy / "model.safetensors")
    state = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    save_file(state, drafter_copy / "model.safetensors")
    config = json.loads((drafter_copy / "config.json").read_text())
    model = load_drafter(drafter_copy, dtype=torch.float32)
    assert model.fc.weight.dtype == torch.float32
    assert torch.equal(model.fc.weight, state["fc.weight"].float())
    assert model.config.block_size == config["dflash_config"]["block_size"]
