"""Recipes: YAML files that pin down a build, validated into frozen pydantic models.

Unknown keys and wrong types are reported with the dotted key path and the YAML line; relative paths are
resolved against the recipe's own directory; `--set dotted.key=value` overrides are applied before validation.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from toolchain.engine.backends import CHOICES as BACKEND_CHOICES
from toolchain.engine.geometry import TOKENS_PER_BLOCK
from toolchain.errors import UserError
from toolchain.files import RECIPE_LIMIT, read_text_capped
from toolchain.quantize.methods import DEFAULT_GROUP_SIZE, GROUP_SIZE_CHOICES, KV_CACHE_NAMES, METHOD_NAMES

_FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2's float forms (an exponent needs no dot and no sign: 1e-9, 5e3, -1E-4; a sign before a bare fraction:
# -.5), plus what PyYAML's YAML 1.1 resolver already read as floats (underscores, 1:30.5), so that no recipe that
# loaded before changes meaning. Integers (no dot, no exponent) are left to the int resolver.
_FLOAT = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 floats: PyYAML implements YAML 1.1, which reads `1e-9` and `5e3` as
    strings. Quoted scalars are never resolved, so `"1e-9"` stays a string."""


RecipeLoader.yaml_implicit_resolvers = {  # SafeLoader's, less its YAML 1.1 float resolver
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))

# stage -> its directory in a `trtbuild run` output dir (pipeline.py writes them, diff.py and inspect read them)
STAGE_DIRS = {
    "convert": "checkpoint",
    "quantize": "quantized",
    "build": "engine",
    "draft": "draft",  # issue 30: the draft engine of draft-target speculation
    "eval": "report",
    "diff": "diff",
}
Dtype = Literal["auto", "float16", "bfloat16", "float32"]
BackendChoice = Literal[BACKEND_CHOICES]  # type: ignore[valid-type]  # engine/backends.py's registry, as a Literal
GroupSize = Literal[GROUP_SIZE_CHOICES]  # type: ignore[valid-type]  # the methods' own sizes (methods/__init__.py)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_S = TypeVar("_S", bound=_Section)


class ModelSection(_Section):
    """The Hugging Face checkpoint to start from."""

    path: Path = Field(description="Hugging Face model directory (config.json + safetensors); relative to the recipe")
    dtype: Dtype = Field("auto", description="Weight dtype of the converted checkpoint; auto keeps the source's")
    allow_pickle: StrictBool = Field(False, description="Allow pickle weights (*.bin), loaded with weights_only=True")


class ConvertSection(_Section):
    """How the checkpoint is split for multi-GPU engines (TensorRT-LLM's mapping)."""

    @model_validator(mode="before")
    @classmethod
    def _empty_means_defaults(cls, data: Any) -> Any:
        return {} if data is None else data  # a `convert:` with every key commented out

    tp: StrictInt = Field(1, ge=1, description="Tensor-parallel size")
    pp: StrictInt = Field(1, ge=1, description="Pipeline-parallel size")
    workers: StrictInt = Field(2, ge=1, le=64, description="Tensors prepared in parallel; never changes the output")


class QuantizeSection(_Section):
    """The quantize stage, as `trtbuild quantize` (the recipe's `seed` chooses the calibration windows)."""

    method: StrictStr = Field(description="Quantization method", json_schema_extra={"enum": list(METHOD_NAMES)})
    kv_cache: StrictStr = Field(
        "none", description="KV cache quantization", json_schema_extra={"enum": list(KV_CACHE_NAMES)}
    )
    group_size: GroupSize = Field(DEFAULT_GROUP_SIZE, description="Group size of w4a16 / w4a16_awq")
    calib_data: Path | None = Field(None, description="Calibration text (.txt / .jsonl); relative to the recipe")
    calib_samples: StrictInt = Field(64, ge=1, description="Calibration windows")
    calib_seq_len: StrictInt = Field(256, ge=2, description="Tokens per calibration window")
    exclude: list[StrictStr] = Field(["lm_head"], description="Module globs left unquantized")
    sq_alpha: StrictFloat | Literal["auto"] = Field(
        0.5, description="SmoothQuant migration strength in [0, 1] (w8a8_sq), or 'auto': searched per layer"
    )
    eval_data: Path | None = Field(None, description="Text to measure the quality cost on; relative to the recipe")
    eval_tokens: StrictInt = Field(50_000, ge=2, description="Tokens of eval_data to score")

    @field_validator("method", "kv_cache")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        names = METHOD_NAMES if info.field_name == "method" else KV_CACHE_NAMES
        if value not in names:  # a custom error: pydantic's "Value error, " prefix is noise to a recipe's author
            raise PydanticCustomError("registered", "must be one of {names}", {"names": ", ".join(names)})
        return value

    @field_validator("sq_alpha", mode="before")
    @classmethod
    def _sq_alpha(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1):
            return value
        raise ValueError("must be a number in [0, 1] or 'auto'")


class BuildSection(_Section):
    """The build stage, as `trtbuild build`."""

    @model_validator(mode="before")
    @classmethod
    def _empty_means_defaults(cls, data: Any) -> Any:
        return {} if data is None else data

    backend: BackendChoice = Field("auto", description="Engine backend")
    max_batch_size: StrictInt = Field(16, ge=1, description="Sequences per engine call")
    max_num_tokens: StrictInt = Field(2048, ge=1, description="Tokens per engine call")
    max_seq_len: StrictInt = Field(0, ge=0, description="Longest sequence; 0: the model's max positions")
    tokens_per_block: StrictInt = Field(
        16, description="KV cache block size in tokens", json_schema_extra={"enum": list(TOKENS_PER_BLOCK)}
    )

    @field_validator("tokens_per_block")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if (
            value not in TOKENS_PER_BLOCK
        ):  # the engine's own set (engine/geometry.py), so a recipe fails before any stage
            raise PydanticCustomError(
                "block_size", "must be one of {sizes}", {"sizes": ", ".join(map(str, TOKENS_PER_BLOCK))}
            )
        return value


class GatesSection(_Section):
    """Quality gates: a value past its limit makes the run exit 3 (a regression, not an error)."""

    kld_mean_max: StrictFloat | None = Field(None, ge=0, description="Largest acceptable mean KLD")
    top1_min: StrictFloat | None = Field(None, ge=0, le=1, description="Smallest acceptable same-top-1 fraction")
    ppl_ratio_max: StrictFloat | None = Field(None, ge=0, description="Largest acceptable PPL(engine)/PPL(reference)")
    golden_exact_min: StrictFloat | None = Field(None, ge=0, le=1, description="Smallest golden exact-match rate")
    # issue 30: the golden prompts replayed speculating (the recipe's `speculative:` section)
    spec_equal_min: StrictFloat | None = Field(
        None, ge=0, le=1, description="Smallest share of golden prompts token-identical when speculating"
    )
    acceptance_rate_min: StrictFloat | None = Field(
        None, ge=0, le=1, description="Smallest share of drafted tokens accepted on the golden prompts"
    )
    # against eval.baseline (`trtbuild diff BASELINE ENGINE`): NEW is this run's engine, OLD the baseline
    kld_vs_old_max: StrictFloat | None = Field(None, ge=0, description="Largest mean KLD of the engine vs the baseline")
    top1_vs_old_min: StrictFloat | None = Field(None, ge=0, le=1, description="Smallest same-top-1 vs the baseline")
    ppl_ratio_vs_old_max: StrictFloat | None = Field(None, ge=0, description="Largest PPL(engine)/PPL(baseline)")
    golden_same_min: StrictFloat | None = Field(None, ge=0, le=1, description="Smallest share of golden outputs kept")


class EvalSection(_Section):
    """The eval stage, as `trtbuild eval`, against the recipe's model (transformers, float32)."""

    data: Path = Field(description="Evaluation text (.txt / .jsonl); relative to the recipe")
    max_tokens: StrictInt = Field(50_000, ge=2, description="Tokens of data to score")
    golden: Path | None = Field(None, description='JSONL of {"prompt", "max_new_tokens"}; relative to the recipe')
    baseline: Path | None = Field(
        None, description="Released engine or run dir to diff this engine against (the *_vs_old gates); relative"
    )
    gates: GatesSection = Field(default_factory=GatesSection)


class DraftSection(_Section):
    """The draft engine of draft-target speculation (issue 30), made by the `draft` stage: convert (with `layers`: a
    stand-in of some of the model's layers), quantize when asked, build with the target's limits unless set."""

    @model_validator(mode="before")
    @classmethod
    def _empty_means_defaults(cls, data: Any) -> Any:
        return {} if data is None else data

    model: Path | None = Field(None, description="Hugging Face model dir of the draft; default the recipe's model")
    layers: list[StrictInt] | None = Field(
        None, description="Decoder layers to keep, renumbered (convert --layers); default all"
    )
    quantize: QuantizeSection | None = Field(None, description="Quantize the draft, as the quantize section")
    build: BuildSection | None = Field(
        None, description="The draft's build; each key not set here is the target's, tokens_per_block always is"
    )


class SpeculativeSection(_Section):
    """Speculative decoding measured by the eval stage (issue 30): n-gram prompt lookup or a draft engine."""

    method: Literal["draft", "ngram"] = Field(description="Proposer: a draft engine, or n-gram prompt lookup")
    num_speculative_tokens: StrictInt = Field(4, ge=1, description="Tokens drafted per step (k)")
    prompt_lookup_min: StrictInt = Field(2, ge=1, description="n-gram: shortest suffix matched")
    prompt_lookup_max: StrictInt = Field(4, ge=1, description="n-gram: longest suffix matched")
    draft: DraftSection | None = Field(None, description="method draft: the draft engine (default: the model)")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSection:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise PydanticCustomError(
                "lookup", "prompt_lookup_min {low} > prompt_lookup_max {high}: need min <= max",
                {"low": self.prompt_lookup_min, "high": self.prompt_lookup_max},
            )  # fmt: skip
        if self.method == "ngram" and self.draft is not None:
            raise PydanticCustomError("draft", "a draft: section belongs to method draft, not ngram", {})
        return self

    def draft_section(self) -> DraftSection | None:
        """The draft stage's settings (method draft: the section, defaults when absent), or None for n-gram."""
        return (self.draft or DraftSection()) if self.method == "draft" else None


class Recipe(_Section):
    """A reproducible trtbuild recipe: model x precision x target."""

    version: Literal[1] = Field(1, description="Recipe format version")
    name: StrictStr | None = Field(None, description="A name for the artifact")
    description: StrictStr | None = None
    seed: StrictInt = Field(0, description="Seed for every random choice (calibration sampling, ...)")
    output: Path | None = Field(None, description="Default output directory (relative to the recipe); -o overrides")
    model: ModelSection
    convert: ConvertSection = Field(default_factory=ConvertSection)
    quantize: QuantizeSection | None = None
    build: BuildSection | None = None
    eval: EvalSection | None = None
    speculative: SpeculativeSection | None = None


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe  # paths absolute
    path: Path
    written: Recipe  # paths as written: relative ones relative to the recipe file

    def resolved(self) -> dict[str, Any]:
        """The recipe with defaults filled and paths absolute: what actually ran."""
        return self.recipe.model_dump(mode="json")

    @property
    def sha256(self) -> str:
        """Of the recipe with defaults filled and paths as written (relative ones relative to the recipe file):
        the same recipe and inputs hash the same wherever the checkout lives."""
        canonical = json.dumps(self.written.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.resolved(), sort_keys=False)


SCHEMA_ID = "urn:trtbuild:recipe:v1"


def schema() -> dict[str, Any]:
    """The recipe's JSON Schema (draft 2020-12, which pydantic writes), with `$schema` and `$id` for validators."""
    body = Recipe.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **body}


def load_recipe(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRecipe:
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; pass the path of a .yaml recipe (see recipes/)")
    text = read_text_capped(path, RECIPE_LIMIT, "recipe")
    try:
        root = yaml.compose(text, Loader=RecipeLoader)
        data = yaml.load(text, Loader=RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{where}: YAML syntax error: {problem}; fix the YAML") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: a recipe is a mapping of sections (model:, quantize:, ...), got {type(data).__name__}"
        )
    overridden = [_apply_override(data, o) for o in overrides]
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise UserError(_explain(e, path, root, overridden)) from e
    _check_spec_gates(recipe, path, root)
    return LoadedRecipe(_resolve_paths(recipe, path.parent.resolve()), path.resolve(), recipe)


def _check_spec_gates(recipe: Recipe, path: Path, root: yaml.Node | None) -> None:
    """The speculative gates (issue 30) measure the golden prompts replayed with the recipe's proposer."""
    gates = recipe.eval.gates if recipe.eval is not None else None
    for name in ("spec_equal_min", "acceptance_rate_min"):
        if gates is None or getattr(gates, name) is None:
            continue
        where = f"{path}{_line(root, ['eval', 'gates', name])}: eval.gates.{name}"
        if recipe.eval is not None and recipe.eval.golden is None:
            raise UserError(f"{where} measures the golden prompts replayed speculating: add eval.golden")
        if getattr(recipe, "speculative", None) is None:
            raise UserError(f"{where} needs a proposer to measure: add a speculative: section")


def _apply_override(data: dict[str, Any], override: str) -> str:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise UserError(f"--set {override!r}: expected dotted.key=value, e.g. --set model.dtype=float16")
    try:
        value = yaml.load(raw, Loader=RecipeLoader) if raw else ""
    except yaml.YAMLError as e:
        raise UserError(f"--set {override!r}: value is not valid YAML ({e})") from e
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return key


def _resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else (base / p).resolve()

    return _map_paths(recipe, resolve)


def _map_paths(section: _S, fn: Callable[[Path], Path]) -> _S:
    """`section` with `fn` applied to every Path field, in every sub-section (so a new path key needs no code)."""
    update: dict[str, Any] = {}
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, Path):
            update[name] = fn(value)
        elif isinstance(value, _Section):
            update[name] = _map_paths(value, fn)
    return section.model_copy(update=update)


def _explain(error: ValidationError, path: Path, root: yaml.Node | None, overridden: list[str]) -> str:
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"]]
    key = ".".join(loc)
    # An error at or under an overridden key, or at a key an override created on its way down, is the --set's.
    culprit = next((o for o in overridden if _within(key, o) or _within(o, key)), None)
    where = f"--set {culprit}" if culprit else f"{path}{_line(root, loc)}"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(_allowed_keys(loc[:-1]))
        return f"{where}: unknown key '{key}'; allowed here: {allowed}"
    if first["type"] == "missing":
        return f"{where}: required key '{key}' is missing; add it (see `trtbuild recipe schema`)"
    return f"{where}: {key}: {first['msg']} (got {first.get('input')!r})"


def _within(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _line(root: yaml.Node | None, loc: list[str]) -> str:
    """':LINE' of the deepest YAML node along `loc` that exists."""
    node, line = root, None
    for part in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if k.value == part), None)
        if match is None:
            break
        line = match[0].start_mark.line + 1
        node = match[1]
    if line is None and root is not None:
        line = root.start_mark.line + 1
    return f":{line}" if line else ""


def _allowed_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = Recipe
    for part in loc:
        annotation = model.model_fields[part].annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next(a for a in candidates if issubclass(a, BaseModel))
    return list(model.model_fields) or ["(none: this section is reserved for a later version)"]
