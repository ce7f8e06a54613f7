"""Test models: tiny random Hugging Face models of every family, the one table of family parity cases, and how tests
compare what we convert and build with transformers (the reference forward, the CPU engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import BASE, save_random_llama, wide_init
from transformers import AutoModelForCausalLM

from toolchain import seeded
from toolchain.engine.api import Engine as OrtEngine
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.reference.model import ReferenceModel


def hf_classes(arch: str) -> tuple[Any, Any]:
    """(config class, model class) of transformers for one of the test families."""
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]


def _is_norm_weight(name: str) -> bool:
    is_norm = "norm" in name or ".ln_" in name or name.startswith(("ln_f", "transformer.ln_f"))
    return is_norm and name.endswith("weight")


def save_random(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A random model of family `arch` (not llama: conftest.save_random_llama) saved by transformers."""
    config_cls, model_cls = hf_classes(arch)
    gpt2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 64}
    base: dict[str, Any] = gpt2 if arch == "gpt2" else BASE
    model = model_cls(config_cls(**{**base, **overrides}))
    seeded.fill_(list(model.named_parameters()), seed, wide_init(_is_norm_weight))
    model.save_pretrained(path, safe_serialization=True)
    return path


# -- the family parity cases --------------------------------------------------------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 500000.0,
}
# Phi3Config's token ids default to 32000, outside the tiny vocabulary (its embedding's padding_idx must fit).
PHI3_TOKENS: dict[str, Any] = {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
GEMMA3: dict[str, Any] = {
    "num_hidden_layers": 7,  # pattern 6: layers 0-4 and 6 slide, layer 5 is global
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "sliding_window": 6,
    "query_pre_attn_scalar": 20,
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
    },
}

# Mixture-of-experts cases (issue 26): Mixtral top-2 of 8 narrow experts; Qwen3-MoE with its q/k norms, a head_dim
# of its own, top-3 of 8, and dense layers among the sparse ones.
MIXTRAL: dict[str, Any] = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}
QWEN3_MOE: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 32,
    "head_dim": 24,
    "mlp_only_layers": [1],  # layers 0 and 2 sparse, layer 1 dense (intermediate_size 96)
}

# gpt-oss with every feature on: top-3 of 8 experts with biases and a router bias, a SwiGLU limit the random
# weights' gate/up values cross (test_gpt_oss checks they do), sinks, windows of 6 on layers 0 and 2 (layer 1 full),
# YaRN whose ramp spans the 16-dim heads (beta_fast 8 over 16 original positions), q/k/v/o biases.
GPT_OSS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 3,
    "sliding_window": 6,
    "swiglu_limit": 0.5,
    "max_position_embeddings": 64,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
        "rope_theta": 1000.0,
    },
}


@dataclass(frozen=True)
class Parity:
    """One family with its distinctive features switched on, whose reference forward must match transformers
    (float32: max abs < 1e-4, identical argmax)."""

    arch: str  # a family of hf_classes
    config: dict[str, Any] = field(default_factory=dict)  # the config's fields beyond the tiny base
    seq: int = 40  # compare()'s sequence length
    engine: bool = False  # checked with the CPU engine too, by test_spec_families


# Every registered family needs a case here (test_family_parity checks it against the registry).
PARITY: dict[str, Parity] = {
    "llama-gqa-4to1": Parity("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}, seq=48),
    "llama-mha": Parity("llama", {"num_attention_heads": 4, "num_key_value_heads": 4}, seq=48),
    "llama-llama3-rope": Parity("llama", {"rope_parameters": LLAMA3_ROPE}, seq=48),
    "llama-linear-rope": Parity(
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}, seq=48
    ),
    "llama-tied": Parity("llama", {"tie_word_embeddings": True}, seq=48),
    "llama-head-dim-24": Parity("llama", {"head_dim": 24, "num_attention_heads": 4, "num_key_value_heads": 2}, seq=48),
    "llama-biases": Parity("llama", {"attention_bias": True, "mlp_bias": True}, seq=48),
    "mistral-sliding-window": Parity("mistral", {"sliding_window": 8}),
    "qwen2-biases": Parity("qwen2"),
    "qwen2-tied": Parity("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": Parity("qwen3", {"head_dim": 24}),
    "gpt2-tied": Parity("gpt2"),
    "gpt2-untied": Parity("gpt2", {"tie_word_embeddings": False}),
    "phi3-gqa": Parity("phi3", PHI3_TOKENS),
    # shorter than the test sequences: the mask differs from causal
    "phi3-window": Parity("phi3", {**PHI3_TOKENS, "sliding_window": 8}),
    "phi3-tied-mha": Parity("phi3", {**PHI3_TOKENS, "tie_word_embeddings": True, "num_key_value_heads": 8}),
    "gemma3": Parity("gemma3", GEMMA3, engine=True),
    "gemma3-untied-no-softcap": Parity(
        "gemma3", {**GEMMA3, "tie_word_embeddings": False, "final_logit_softcapping": None}, engine=True
    ),
    "qwen2-windows": Parity(
        "qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}, engine=True
    ),
    "qwen3-windows": Parity(
        "qwen3", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}, engine=True
    ),
    "mixtral-top2-of-8": Parity("mixtral", MIXTRAL, seq=48, engine=True),
    "mixtral-window-top1-of-4": Parity(
        "mixtral", {**MIXTRAL, "num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 8}, seq=48
    ),
    "qwen3-moe-renormalised": Parity("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": True}, seq=48, engine=True),
    # decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen3-moe-unnormalised-step2": Parity(
        "qwen3_moe",
        {**QWEN3_MOE, "num_hidden_layers": 4, "norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2},
        seq=48,
        engine=True,
    ),
    "gpt-oss-every-feature": Parity("gpt_oss", GPT_OSS, seq=48, engine=True),
}


def save_case(path: Path, name: str) -> Path:
    """The random model of parity case `name`, saved by transformers at `path`."""
    case = PARITY[name]
    if case.arch == "llama":
        return save_random_llama(path, **case.config)
    return save_random(path, case.arch, **case.config)


def compare(hf_dir: Path, ckpt: Path, seq: int = 48, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(max abs logit difference, fraction of positions with the same argmax) on fresh random ids."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    ref = ReferenceModel.from_checkpoint(ckpt, dtype=dtype)
    ids = torch.randint(0, ref.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    got = ref.forward(ids)
    return (expected - got).abs().max().item(), (expected.argmax(-1) == got.argmax(-1)).float().mean().item()


# -- the CPU engine against transformers --------------------------------------------------------------------------

TPB = 4  # small blocks so that short test sequences span several, with partial last blocks


def build(ckpt: Path, out: Path, **kw: Any) -> OrtEngine:
    build_engine(ckpt, out, BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4, **kw))
    return open_engine(out)


def run_alone(engine: OrtEngine, ids: list[int], blocks: int = 32) -> np.ndarray:
    """Every position's logits of one sequence in one prefill call, blocks in shuffled order."""
    return run_with_pool(engine, ids, blocks)[0]


def run_with_pool(engine: OrtEngine, ids: list[int], blocks: int = 32) -> tuple[np.ndarray, torch.Tensor, list[int]]:
    """run_alone, also returning the pool it wrote and the sequence's block table."""
    pool = engine.new_kv_cache(blocks)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(len(ids))).tolist()
    table = order[: -(-len(ids) // TPB)]
    return engine.forward(Batch.from_sequences([ids], [0], [table], all_logits=True), pool), pool, table


def hf_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(got - expected).max() < 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()
