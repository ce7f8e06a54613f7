"""`trtbuild run`: execute a recipe's stages into one output directory.

Layout of the output: `recipe.yaml` (the resolved recipe), one sub-directory per stage (`checkpoint/`,
`quantized/` when the recipe has a `quantize:` section; later `engine/`, `report/`), each with its own
manifest, and a top-level manifest over all of it. The whole directory is written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolchain.atomic import atomic_dir
from toolchain.checkpoint.convert import convert
from toolchain.errors import UserError
from toolchain.manifest import StageRecord
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.recipe import LoadedRecipe, Recipe

_RESERVED = ("build", "eval")


def _quantize(recipe: Recipe, tmp: Path, record: StageRecord) -> dict[str, Any]:
    q = recipe.quantize
    assert q is not None
    opts = QuantizeOptions(
        q.method,
        q.kv_cache,
        q.group_size,
        q.calib_data,
        q.calib_samples,
        q.calib_seq_len,
        recipe.seed,
        tuple(q.exclude),
        q.sq_alpha,
    )
    return quantize_checkpoint(tmp / "checkpoint", tmp / "quantized", opts, q.eval_data, q.eval_tokens, record=record)


def run_recipe(loaded: LoadedRecipe, out_dir: Path | None, force: bool = False) -> dict[str, Any]:
    recipe = loaded.recipe
    out = out_dir or recipe.output
    if out is None:
        raise UserError(f"{loaded.path}: no output directory; pass -o OUT_DIR or set 'output:' in the recipe")
    for section in _RESERVED:
        if section in recipe.model_fields_set:  # present at all, even as null: refused, never ignored
            raise UserError(
                f"{loaded.path}: section '{section}' is not supported by this version of trtbuild "
                "(stages available: convert, quantize); remove it"
            )
    resolved, sha = loaded.resolved(), loaded.sha256

    def record(stage: str) -> StageRecord:
        return StageRecord(stage, recipe=resolved, recipe_sha256=sha)

    run = record("run")
    with atomic_dir(out, force, inputs=(recipe.model.path,)) as tmp:
        (tmp / "recipe.yaml").write_text(loaded.to_yaml())
        convert_record = record("convert")
        converted = convert(
            recipe.model.path,
            tmp / "checkpoint",
            dtype=recipe.model.dtype,
            allow_pickle=recipe.model.allow_pickle,
            tp=recipe.convert.tp,
            pp=recipe.convert.pp,
            workers=recipe.convert.workers,
            record=convert_record,
        )
        stages = {"convert": converted}
        if recipe.quantize is not None:
            stages["quantize"] = _quantize(recipe, tmp, record("quantize"))
        run.add_inputs(loaded.path.parent, [loaded.path])
        run.inputs += convert_record.inputs  # already hashed by the stage
        run.details.update(stages=list(stages), recipe_file=str(loaded.path))
        run.warnings += converted["warnings"]
        manifest = run.write(tmp)
    return {
        "output_dir": str(out.resolve()),
        "recipe": str(loaded.path),
        "recipe_sha256": sha,
        "stages": {
            name: {k: v for k, v in result.items() if k not in ("outputs", "output_dir")}
            for name, result in stages.items()
        },
        "outputs": manifest["outputs"],
        "warnings": run.warnings,
        "wall_time_s": manifest["wall_time_s"],
    }
