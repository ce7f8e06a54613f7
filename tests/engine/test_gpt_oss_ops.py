"""gpt-oss's attention in the reference ops (issue 26): KVCacheWrite's YaRN rotary against transformers' YaRN
frequencies and attention factor, PagedAttention's sinks against a float64 softmax with the sink logit as one more
column (transformers' GptOss eager_attention_forward), over a batch of prefill chunks and decode steps read from a
pool whose unowned slots hold NaN. The whole model: models.PARITY "gpt-oss-every-feature" (engine=True)."""

from __future__ import annotations

import math

import pytest
import torch

from toolchain.engine.ops import AttentionAttrs, kv_cache_write, paged_attention

H, KVH, D, TPB = 4, 2, 16, 4
YARN = {"factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
# float32 angles (transformers computes inv_freq in float32, the op in float64 then float32) at positions < 64
# differ by ~64 * 2^-24 radians, so float32 results agree to ~1e-5 of their O(1) scale
TOL = 1e-5


def attrs(**kw: object) -> AttentionAttrs:
    return AttentionAttrs(layer=0, num_heads=H, num_kv_heads=KVH, head_size=D, tokens_per_block=TPB, **kw)  # type: ignore[arg-type]


def yarn_attrs() -> AttentionAttrs:
    from toolchain.reference.rope import attention_factor

    return attrs(
        rotary_base=1000.0,
        rotary_scaling_type="yarn",
        rotary_scaling_factor=YARN["factor"],
        rotary_original_max_positions=16,
        rotary_beta_fast=8.0,
        rotary_beta_slow=1.0,
        rotary_truncate=0,
        rotary_attention_factor=attention_factor({"rope_type": "yarn", **YARN}),
    )


def test_kv_cache_write_applies_transformers_yarn() -> None:
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(head_dim=D, rope_parameters={"rope_type": "yarn", **YARN, "rope_theta": 1000.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    a = yarn_attrs()
    assert factor > 1 and a.rotary_attention_factor == pytest.approx(factor, rel=1e-12)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 30, 61], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(8, (H + 2 * KVH) * D, generator=g)
    pool = torch.full((1, 16, 2, KVH, TPB, D), float("nan"))
    tables = torch.tensor([list(range(16))], dtype=torch.int32)
    new_lens = torch.tensor([8], dtype=torch.int32)
    # one sequence of 8 new tokens whose positions jump: the op takes positions from position_ids
    q = kv_cache_write(a, qkv, positions, torch.tensor([62], dtype=torch.int32), new_lens, tables, pool)
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None] * factor for f in (torch.cos, torch.sin))
    x = qkv.double()[:, : (H + KVH) * D].view(8, H + KVH, D)
    want = x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1) * sin
    assert (q.double().view(8, H, D) - want[:, :H]).abs().max() < TOL
    k = pool[0, positions.long() // TPB, 0, :, positions.long() % TPB]  # [tokens, kv_heads, d]
    assert (k.double() - want[:, H:]).abs().max() < TOL
    plain = kv_cache_write(attrs(rotary_base=1000.0), qkv, positions, torch.tensor([62]), new_lens, tables, pool)
    assert (plain - q).abs().max() > 100 * TOL, "YaRN changes nothing"


def naive_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, window: int
) -> torch.Tensor:
    """One sequence's queries [n, H, D] at `positions` over its keys / values [total, KVH, D], float64: scores
    with the sink logit as one more column, softmax, the column dropped (transformers' eager_attention_forward)."""
    group = H // KVH
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) / math.sqrt(D)
    keys = torch.arange(k.shape[0])
    allowed = keys[None, :] <= positions[:, None]
    if window:
        allowed &= positions[:, None] - keys[None, :] < window
    scores = scores.masked_fill(~allowed, -math.inf)
    sink = sinks.double().view(H, 1, 1).expand(H, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hnt,thd->nhd", probs, v)


@pytest.mark.parametrize("window", [0, 6])
def test_paged_attention_with_sinks_is_the_softmax_with_a_sink_column(window: int) -> None:
    """A batch of a prefill chunk (5 new after 7 cached), two decode steps and a 2-token chunk; the sinks large
    enough to take much of the probability, so leaving them out, or letting them add to the output, shows."""
    g = torch.Generator().manual_seed(1)
    a = attrs(sinks=1, sliding_window=window)
    lens, contexts = [5, 1, 1, 2], [7, 9, 3, 0]
    pool = torch.full((1, 32, 2, KVH, TPB, D), float("nan"))
    tables = torch.tensor([[4 * s + b for b in range(4)] for s in range(4)], dtype=torch.int32).flip(1)
    keys, values = [], []
    for s, total in enumerate(c + n for c, n in zip(contexts, lens, strict=True)):
        k, v = torch.randn(total, KVH, D, generator=g), torch.randn(total, KVH, D, generator=g)
        for p in range(total):
            pool[0, tables[s, p // TPB], 0, :, p % TPB] = k[p]
            pool[0, tables[s, p // TPB], 1, :, p % TPB] = v[p]
        keys.append(k)
        values.append(v)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, lens, strict=True)]).int()
    q = torch.randn(sum(lens), H * D, generator=g)
    sinks = torch.randn(H, generator=g) + 2
    got = paged_attention(
        a, q, positions, torch.tensor(contexts).int(), torch.tensor(lens).int(), tables, pool, sinks
    ).view(-1, H, D)
    start = 0
    for s, n in enumerate(lens):
        rows = slice(start, start + n)
        want = naive_sinks(q[rows].view(n, H, D), keys[s], values[s], positions[rows].long(), sinks, window)
        assert (got[rows].double() - want).abs().max() < TOL, s
        start += n
    plain = paged_attention(attrs(sliding_window=window), q, positions, torch.tensor(contexts).int(),
                            torch.tensor(lens).int(), tables, pool).view(-1, H, D)  # fmt: skip
    assert (plain - got).abs().max() > 0.1, "the sinks change nothing"


def test_sinks_input_must_agree_with_the_attribute() -> None:
    q, ids = torch.zeros(1, H * D), torch.zeros(1, dtype=torch.int32)
    pool, tables = torch.zeros(1, 1, 2, KVH, TPB, D), torch.zeros(1, 1, dtype=torch.int32)
    ones = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks=1 with a sinks input of shape None: expected \(4,\)"):
        paged_attention(attrs(sinks=1), q, ids, ids, ones, tables, pool)
    with pytest.raises(ValueError, match=r"sinks=0 with a sinks input of shape \(4,\): expected no sinks input"):
        paged_attention(attrs(), q, ids, ids, ones, tables, pool, torch.zeros(H))
    with pytest.raises(ValueError, match=r"attention sinks 2: expected 0 or 1"):
        attrs(sinks=2)
