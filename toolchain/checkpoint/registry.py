"""Model families by Hugging Face architecture name, imported lazily.

Adding a family = one module with the `Family` attributes + one line in `_FAMILIES`. A converted checkpoint's
config.json names the architecture it was converted from, so its description (`Family.spec`) is found the same way.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Protocol

from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

# HF `architectures[0]` -> module implementing it.
_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "toolchain.checkpoint.llama",
    "MistralForCausalLM": "toolchain.checkpoint.mistral",
    "Qwen2ForCausalLM": "toolchain.checkpoint.qwen2",
    "Qwen3ForCausalLM": "toolchain.checkpoint.qwen3",
    "Phi3ForCausalLM": "toolchain.checkpoint.phi3",
    "GPT2LMHeadModel": "toolchain.checkpoint.gpt2",
    "Gemma3ForCausalLM": "toolchain.checkpoint.gemma3",
    "MixtralForCausalLM": "toolchain.checkpoint.mixtral",
    "Qwen3MoeForCausalLM": "toolchain.checkpoint.qwen3_moe",
    "GptOssForCausalLM": "toolchain.checkpoint.gpt_oss",
}

Shape = tuple[int, ...]


class Family(Protocol):
    """What a family module provides (module-level names)."""

    DROPPED: tuple[re.Pattern[str], ...]

    def config_from_hf(self, hf: dict[str, Any], dtype: str, source: str) -> ModelConfig: ...

    def source_shapes(self, cfg: ModelConfig, available: set[str]) -> dict[str, Shape]: ...

    def weight_table(self, cfg: ModelConfig, available: set[str]) -> list[Rule]: ...

    def spec(self, cfg: ModelConfig) -> ModelSpec: ...


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


# Mixture-of-experts families that need more than the model description has: refused with what is missing, one line
# each (docs/conversion.md, "What comes next").
NOT_YET = {
    "DeepseekV3ForCausalLM": "needs multi-head latent attention (MLA: low-rank compressed KV, decoupled rotary), "
    "grouped sigmoid routing with a correction bias, shared experts, and its multi-token-prediction layer",
    "Llama4ForCausalLM": "needs MoE and dense layers interleaved, chunked attention with iRoPE (layers without "
    "rotary), a shared expert and sigmoid top-1 routing",
    "Llama4ForConditionalGeneration": "needs MoE and dense layers interleaved, chunked attention with iRoPE (layers "
    "without rotary), a shared expert and sigmoid top-1 routing (and its vision tower is out of scope)",
    "Qwen3NextForCausalLM": "needs hybrid linear attention (gated DeltaNet layers with a recurrent state among "
    "gated full-attention layers), a gated shared expert, and its multi-token-prediction layer",
}


def unsupported(arch: str) -> str:
    """Why `arch` is refused: what it needs where we know, and the supported set."""
    why = f"; it {NOT_YET[arch]} (docs/conversion.md, 'What comes next')" if arch in NOT_YET else ""
    return f"architecture {arch!r} is not supported{why}; supported: {', '.join(supported_architectures())}"


def family_for(hf_config: dict[str, Any], source: str) -> tuple[str, Family]:
    archs = hf_config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise UserError(f'{source}: no \'architectures\' entry; add one, e.g. "architectures": ["LlamaForCausalLM"]')
    arch = str(archs[0])
    if arch not in _FAMILIES:
        raise UserError(f"{source}: {unsupported(arch)}")
    module: Family = importlib.import_module(_FAMILIES[arch])
    return arch, module


def family_of_config(cfg: ModelConfig) -> Family:
    """The family of a checkpoint config (its `architecture`, the HF name it was converted from)."""
    if cfg.architecture not in _FAMILIES:
        raise UserError(unsupported(cfg.architecture))
    module: Family = importlib.import_module(_FAMILIES[cfg.architecture])
    return module
