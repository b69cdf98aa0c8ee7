"""What a build refuses in a recipe before anything slow: first with the model unread (the passes' order and options,
what the backend cannot build, values that must agree with export.max_context), then against the model's config
(its context, its head size). `aotlm plan` asks the same, so that it never sizes a recipe the build would refuse."""
from __future__ import annotations

from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.backends import tensorrt as tensorrt_backend
from compiler.calibration import BUILTIN, check_text_file
from compiler.errors import BuildError
from compiler.pipeline import check_passes
from compiler.recipe import Recipe
from passes.lower_onnxruntime import HEAD_DIM_ADVICE, HEAD_DIM_MULTIPLE
from passes.lower_tensorrt import PLUGIN_HEAD_DIM_ADVICE, PLUGIN_HEAD_DIMS


def check_recipe(recipe: Recipe) -> None:
    """Raises BuildError naming the key and the fix."""
    check_passes(recipe.passes)
    if recipe.backend.name == "tensorrt":
        tensorrt_backend.check_recipe(recipe)
    if recipe.backend.name == "onnxruntime":
        onnxruntime_backend.check_recipe(recipe)
    if recipe.backend.name == "onnxruntime" and recipe.export.dtype != "float32":
        raise BuildError(f"export.dtype: {recipe.export.dtype!r} with backend onnxruntime: its CPU runtime keeps a "
                         f"float32 KV cache; use float32 (float16/bfloat16 are for backend tensorrt)")
    for index, spec in enumerate(recipe.passes):  # calibration runs the graphs, whose cache holds max_context tokens
        rotary_rows = getattr(spec.options, "rotary_cache_length", None)
        if rotary_rows is not None and rotary_rows < recipe.export.max_context:
            raise BuildError(f"passes[{index}] ({spec.name}): rotary_cache_length {rotary_rows} is below "
                             f"export.max_context ({recipe.export.max_context}): later positions would have no rotary "
                             f"angles; set it to at least {recipe.export.max_context}, or leave it out (the default)")
        if rotary_rows is not None and rotary_rows > recipe.export.max_context:  # 1e8 rows ran for minutes, then stored
            raise BuildError(f"passes[{index}] ({spec.name}): rotary_cache_length {rotary_rows} exceeds "
                             f"export.max_context ({recipe.export.max_context}): rows past it are never read, only "
                             f"computed and stored; leave it out (the default is export.max_context)")
        calibration = getattr(spec.options, "calibration", None)
        if calibration is not None and calibration.text != BUILTIN:
            try:
                check_text_file(calibration.text)
            except BuildError as error:
                raise BuildError(f"passes[{index}].{spec.name}.{error}") from None
        if calibration is not None and calibration.length > recipe.export.max_context:
            raise BuildError(f"passes[{index}] ({spec.name}): calibration.length {calibration.length} exceeds "
                             f"export.max_context ({recipe.export.max_context}); set calibration.length to at most "
                             f"{recipe.export.max_context}")


def check_config_fits(config, recipe: Recipe) -> None:
    """The model's config against the recipe: the context it attends over, and the head size a lowering needs."""
    window = config.sliding_window
    max_context = recipe.export.max_context
    if window is not None and max_context > window:
        raise BuildError(f"the model attends within a sliding window of {window} tokens (its config's "
                         f"sliding_window), which the decoder does not implement; set export.max_context to {window} "
                         f"or less (attention within the window is exact)")
    check_max_positions(config, max_context)
    names = [spec.name for spec in recipe.passes]
    lowers_fused = "fuse_attention" in names and "lower_onnxruntime" in names[names.index("fuse_attention"):]
    if config.head_dim % HEAD_DIM_MULTIPLE and lowers_fused:
        raise BuildError(HEAD_DIM_ADVICE.format(head_dim=config.head_dim))
    if recipe.backend.name == "tensorrt":  # what check_graphs and lower_tensorrt would refuse after the export
        lowering = next((spec for spec in recipe.passes if spec.name == "lower_tensorrt"), None)
        if lowering is not None and lowering.options.attention == "plugin" and config.head_dim not in PLUGIN_HEAD_DIMS:
            raise BuildError(f"passes: lower_tensorrt: {PLUGIN_HEAD_DIM_ADVICE.format(head_dim=config.head_dim)}")
        itemsize = 4 if recipe.export.dtype == "float32" else 2
        tensorrt_backend.check_cache_alignment(config.num_kv_heads, max_context, config.head_dim, itemsize)


def check_max_positions(config, max_context: int) -> None:
    """The cache's rows are positions: no more than the model was trained to attend over."""
    if max_context > config.max_position_embeddings:
        raise BuildError(f"export.max_context: {max_context} exceeds the model's max_position_embeddings "
                         f"({config.max_position_embeddings}); lower it in the recipe")
