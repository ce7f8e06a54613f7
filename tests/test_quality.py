"""The quality comparison: exact on identical models, agrees with torch's KL divergence, sees a perturbation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from toolchain.checkpoint.convert import convert
from toolchain.quality import compare, token_stats
from toolchain.reference.model import ReferenceModel
from toolchain.text import read_text, tokenize


def test_token_stats_match_direct_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    ref, var = torch.randn(3, 7, 50, generator=g), torch.randn(3, 7, 50, generator=g)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    stats = token_stats(ref, var, targets)
    log_p, log_q = F.log_softmax(ref.double(), -1), F.log_softmax(var.double(), -1)
    expected_kld = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(stats["kld"], expected_kld)
    torch.testing.assert_close(
        stats["nll_ref"], F.cross_entropy(ref.double().transpose(1, 2), targets, reduction="none")
    )
    p_obs = log_p.exp().gather(-1, targets[..., None])[..., 0]
    q_obs = log_q.exp().gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(stats["dp"], q_obs - p_obs)


def test_identical_models_lose_nothing_and_a_perturbation_shows(make_llama: Any, tmp_path: Path) -> None:
    convert(make_llama(), tmp_path / "ck")
    ref = ReferenceModel.from_checkpoint(tmp_path / "ck")
    tokens = torch.randint(0, 97, (4 * 32 + 5,), generator=torch.Generator().manual_seed(2))
    same = compare(ref.forward, ref.forward, tokens, window=32)
    assert same.tokens == 4 * 31 and same.windows == 4
    assert same.kld_max == 0 and same.ppl_ratio == 1 and same.same_top1 == 1 and same.dp_rms == 0
    noisy = ReferenceModel.from_checkpoint(tmp_path / "ck")
    g = torch.Generator().manual_seed(5)
    for name, w in noisy.w.items():
        if name.endswith("mlp.fc.weight"):
            w.add_(0.05 * torch.randn(w.shape, generator=g))
    worse = compare(ref.forward, noisy.forward, tokens, window=32)
    assert worse.kld_mean > 0 and worse.same_top1 < 1 and worse.ppl_ratio != 1
    assert worse.kld_p50 <= worse.kld_p90 <= worse.kld_p99 <= worse.kld_max
    assert math.isclose(worse.ppl_ratio, worse.ppl_variant / worse.ppl_reference)


def test_text_files(tmp_path: Path, stories: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "Once upon a time"}\n\n{"text": "there was a cat"}\n')
    assert read_text(tmp_path / "a.jsonl") == "Once upon a time\nthere was a cat"
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    from toolchain.errors import UserError

    with pytest.raises(UserError, match=r"bad\.jsonl:1"):
        read_text(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="holds no text"):
        read_text(tmp_path / "empty.txt")
    ids = tokenize(tmp_path / "a.jsonl", stories, max_tokens=5)
    assert ids.dtype == torch.int64 and ids.numel() == 5
