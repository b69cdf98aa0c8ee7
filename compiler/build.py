"""One build: recipe -> model -> two ONNX graphs -> passes -> backend engines -> artifact folder."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from compiler.accuracy import evaluate_against_float, held_out_tokens, quantization_summary, repeated_text_warning
from compiler.artifact import (build_host, check_disk_room, creation_time, remove_abandoned, remove_abandoned_scratch,
                               scratch_folder, source_revision, sources_sha256, staged_folder, temporary_folder,
                               tool_versions, write_manifest)
from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.backends import tensorrt as tensorrt_backend
from compiler.calibration import BUILTIN, resolve_passes
from compiler.errors import BuildError, check_output_folder, is_artifact_folder
from compiler.export import cache_dtype, kv_cache_spec, load_traced, trace_graphs
from compiler.frontend import load_model
from compiler.frontend.hf_loader import config_before_weights, missing_tokenizer_message
from compiler.frontend.model import build_decoder
from compiler.pipeline import run_pipeline, spill_graph
from compiler.recipe import Recipe
from compiler.recipe_checks import check_config_fits, check_recipe

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # Jinja, as transformers saves it
# Above this (the model's weights, as loaded) the passes before quantization keep one phase's graph in memory at a
# time: a 1.25 GB model's passes peaked at 5.1 GB with both held, 3.4 GB one at a time (scratch, session 36); the
# default model (539 MB) gains nothing from it.
SPILL_ABOVE_WEIGHT_BYTES = 1 << 30
EXPORT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # per weight, by the recipe's export.dtype
QUANTIZING_PASSES = ("quantize", "quantize_kv_cache")  # the accuracy report compares against the graph before them


def _check_disk_room(recipe: Recipe, built_at: Path, parameters: int, quantized: bool) -> None:
    """The disk space the build certainly needs, checked before the export. The traced graphs: both phases, each with
    its copy of the weights, in the temporary folder (measured: 2.0x the weights at the peak). The artifact: a float
    build's weights file is the weights (a quantized one's is smaller, not estimated here), beside the artifact it
    replaces until the swap. A folder shared by both needs the larger only: the traces are gone before staging."""
    weights = parameters * EXPORT_BYTES[recipe.export.dtype]
    check_disk_room(temporary_folder()[0], 2 * weights, "the traced graphs (two copies of the weights)")
    if not quantized:
        folder = next((folder for folder in (built_at.parent, *built_at.parent.parents) if folder.exists()), None)
        if folder is not None:
            check_disk_room(folder, weights, "the artifact's weights")


def memory_short_warning(float32_bytes: int) -> str | None:
    """A warning, before the export, where the memory left (MemAvailable, a container's limit, ulimit -v) is below
    what the build's peak will add to the weights loaded now: at least 2 more copies of them (OUT_OF_MEMORY's 3 to 5
    times, less the one held). A build past it was killed by the OOM killer minutes in, without a word before."""
    from runtime.onnxruntime_backend import available_memory_bytes, binary_size

    available = available_memory_bytes()
    if available is None or available >= 2 * float32_bytes:
        return None
    return (f"this build's peak holds about 3 to 5 times the model's float32 weights ({binary_size(3 * float32_bytes)} "
            f"to {binary_size(5 * float32_bytes)}), and {binary_size(available)} more is available now (beside the "
            f"{binary_size(float32_bytes)} loaded): it may be killed partway (the OOM killer); free memory, or build on "
            f"a machine with more")


def check_tokenizer_fits(tokenizer_json: str, vocab_size: int) -> None:
    """A tokenizer whose ids reach past the embedding table builds, then fails at the first prompt that uses them:
    refuse it here. (A tokenizer smaller than the table is common: tables are padded to a round size.)"""
    from tokenizers import Tokenizer

    try:
        # the highest id, not the count: a vocabulary with holes (ids removed, an added token far out) counts fewer
        tokens = max(Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True).values(), default=-1) + 1
    except Exception as error:  # noqa: BLE001 -- the library raises a bare Exception on a bad file
        raise BuildError(f"cannot read the model's tokenizer ({str(error)[:200]}); use the model's own "
                         f"tokenizer.json") from None
    if tokens > vocab_size:
        raise BuildError(f"the tokenizer's ids reach {tokens - 1}, but the model's vocab_size is {vocab_size}: ids from "
                         f"{vocab_size} on would index past the embedding table; use the model's own tokenizer.json")


def check_chat_template(template: str) -> None:
    """A chat template that does not parse would build, and every chat request to the artifact would then fail:
    refuse it here, compiled as the runtime compiles it."""
    from runtime.chat import compiled
    from runtime.errors import ArtifactError

    try:
        compiled(template)
    except ArtifactError as error:
        detail = str(error).partition("(")[2].rstrip(")")
        raise BuildError(f"the model's chat template does not parse ({detail}); fix it where the model keeps it "
                         f"(chat_template.jinja, tokenizer_config.json's chat_template, or the GGUF's "
                         f"tokenizer.chat_template), or remove it to build without one") from None


def _sticky_owner_only(folder: Path) -> bool:
    """Whether folder sits in a sticky folder (mode 1777, as /tmp) that lets only its owner (or the folder's) rename it,
    and neither is this user (root may; so may a process with CAP_FOWNER, which this does not see)."""
    parent = folder.parent.resolve().stat()
    me = os.geteuid()
    return bool(parent.st_mode & stat.S_ISVTX) and me not in (0, parent.st_uid, folder.stat().st_uid)


def build(recipe: Recipe, output_root: str | Path = "artifacts", progress=None, dump_dir: str | Path | None = None,
          written: dict | None = None, swap: dict | None = None) -> Path:
    """Build recipe into output_root/<recipe.name>/ and return that path. Raises BuildError on bad input.
    dump_dir: each pass's output graph, per phase, is also written there (NN-pass-phase.onnx: to bisect a parity
    failure pass by pass; a large model's graphs take their weights' size each).
    written: a dict that receives the manifest this build wrote (the path may hold another build's by the time the
    caller reads it: `aotlm build` prints this one's reports from it).
    swap: a dict that receives `replaced`: whether the new artifact replaced one (staged_folder)."""
    say = progress or (lambda message: None)
    final_dir = Path(output_root) / recipe.name
    check_output_folder(output_root, "output folder")  # before anything slow: the export takes minutes
    from runtime.errors import ArtifactError
    from runtime.manifest import check_utf8_path

    try:  # an artifact whose path is not UTF-8 built fine and then loaded nowhere
        check_utf8_path(final_dir, "the artifact's path", "give --output a folder whose path is UTF-8")
    except ArtifactError as error:
        raise BuildError(str(error)) from None
    creation_time()  # a malformed SOURCE_DATE_EPOCH is refused now, not after the build's work
    _, temporary_warning = temporary_folder()
    if temporary_warning:
        say(f"warning: {temporary_warning}")
    if dump_dir is not None:
        check_output_folder(dump_dir, "--dump-passes folder")
        dumps, artifact = Path(dump_dir).resolve(), final_dir.resolve()
        if dumps == artifact or artifact in dumps.parents:  # the build replaces that folder: the dumps would go
            raise BuildError(f"--dump-passes {dump_dir}: inside the artifact folder {final_dir}, which the build "
                             f"replaces; choose a folder outside it")
        other = next((folder for folder in (dumps, *dumps.parents) if is_artifact_folder(folder)), None)
        if other is not None:  # its graphs would break that artifact: it holds only the files its manifest lists
            raise BuildError(f"--dump-passes {dump_dir}: {'is' if other == dumps else 'is inside'} the artifact "
                             f"folder {other}, which holds only what its manifest lists (the dumps would make it "
                             f"unloadable); choose a folder outside it")
    led_to = Path(os.path.realpath(final_dir))
    if final_dir.is_symlink() and not final_dir.exists() and led_to.parent.is_dir():
        # a build killed between its swap's two renames, where the link leads: the whole old artifact goes back first
        for folder in remove_abandoned(led_to):
            say(f"removed {folder}, left by a build of {final_dir} that was killed")
    if final_dir.is_symlink() and not final_dir.exists():  # exists() follows links: the rename would fail at the end
        raise BuildError(f"{final_dir} is a link to {os.readlink(final_dir)}, which does not exist; remove the link or "
                         f"change the recipe's name")
    built_at = final_dir
    if final_dir.is_symlink():  # a link to (say) a bigger disk: the new artifact goes there, and the link stays
        built_at = final_dir.resolve()
        if built_at.parent != final_dir.parent.resolve():
            say(f"{final_dir} is a link: the artifact is built at {built_at}")
    if final_dir.exists() and not final_dir.is_dir():
        raise BuildError(f"{final_dir} is a file; the artifact is a folder of that name: move the file or change the "
                         f"recipe's name")
    inside = next((folder for folder in (Path(output_root).resolve(), *Path(output_root).resolve().parents)
                   if is_artifact_folder(folder)), None)
    if inside is not None:  # --output artifacts/smollm2-135m, meant as the artifact itself: it would break that one
        raise BuildError(f"--output {output_root}: {'is' if inside == Path(output_root).resolve() else 'is inside'} the "
                         f"artifact folder {inside}; --output is the folder that receives <name>/ (e.g. artifacts), "
                         f"and an artifact holds only what its manifest lists")
    inside = next((folder for folder in built_at.parents if is_artifact_folder(folder)), None)
    if inside is not None:  # a link into another artifact: the new one would be written inside it, breaking it
        raise BuildError(f"{final_dir} is a link to {built_at}, inside the artifact folder {inside}; an artifact holds "
                         f"only what its manifest lists: point the link elsewhere, or remove it")
    if built_at.is_dir() and os.path.ismount(built_at):  # the swap renames it: a mount point cannot be (EBUSY)
        raise BuildError(f"{final_dir} is a mount point, and the build replaces that folder by renaming a new one over "
                         f"it, which a mount point refuses: give --output a folder on that volume (e.g. {final_dir}) "
                         f"so that the artifact is {final_dir / recipe.name}")
    if final_dir.is_dir() and not os.access(final_dir, os.R_OK | os.W_OK | os.X_OK):  # the swap moves it: checked first
        raise BuildError(f"{final_dir}: an artifact this build would replace, and it is not readable and writable by "
                         f"you; fix its permissions, remove it, or build into another --output folder")
    if built_at.is_dir() and _sticky_owner_only(built_at):  # /tmp-like: only its owner may rename it away
        raise BuildError(f"{final_dir}: an artifact this build would replace, in a folder where only a file's owner "
                         f"may move it (the sticky bit, as /tmp), and another user owns it; build into another "
                         f"--output folder or change the recipe's name")
    if final_dir.is_dir() and any(final_dir.iterdir()) and not is_artifact_folder(final_dir):
        # The build replaces final_dir whole: never a folder it did not make (a model's own files, say).
        raise BuildError(f"{final_dir} exists and is not an aotlm artifact (no aotlm manifest.json), and this build "
                         f"would replace it with the artifact: move it, build into another --output folder, or change "
                         f"the recipe's name")
    check_recipe(recipe)  # before anything slow: the export takes minutes
    if recipe.backend.name == "tensorrt":
        tensorrt_backend.require_tensorrt()
    started = time.perf_counter()
    if recipe.model.source == "hf" and recipe.model.path is not None:
        early = config_before_weights(recipe.model.path)  # a tokenizer.json, and the context: before the weights
        if early is not None:
            check_config_fits(early, recipe)
    say(f"loading the model ({recipe.model.source}" + (f": {recipe.model.path})" if recipe.model.path else ")"))
    loaded = load_model(recipe.model.source, recipe.model.path, recipe.model.config, recipe.model.seed,
                        check_config=lambda config: check_config_fits(config, recipe))
    if loaded.tokenizer_json is None:  # (random-init models make their own)
        raise BuildError(f"{loaded.source['path']}: no tokenizer.ggml.tokens in its metadata, so no tokenizer; aotlm "
                         f"reads a GGUF's tokenizer from the file itself: convert the model with its tokenizer "
                         f"(llama.cpp's convert_hf_to_gguf.py writes one)" if recipe.model.source == "gguf" else
                         missing_tokenizer_message(loaded.source["path"]))
    check_tokenizer_fits(loaded.tokenizer_json, loaded.config.vocab_size)
    for text in loaded.warnings:
        say(f"warning: {text}")
    if loaded.chat_template is not None:
        check_chat_template(loaded.chat_template)
    check_config_fits(loaded.config, recipe)
    passes = resolve_passes(recipe.passes, loaded.tokenizer_json, say)  # before the slow export: bad text fails fast
    # The float graph just before quantization (of weights or of the KV cache) is the accuracy report's reference:
    # the passes run in two parts. The report runs the artifact through onnxruntime's evaluator; a TensorRT
    # artifact is measured with `aotlm eval` on its GPU instead.
    first_quantize = next((i for i, spec in enumerate(passes) if spec.name in QUANTIZING_PASSES), len(passes))
    report_accuracy = first_quantize < len(passes) and recipe.accuracy.enabled and recipe.backend.name == "onnxruntime"
    if report_accuracy:  # its held-out text, checked before the export rather than after the whole build
        # The first calibrating pass's text (an RTN quantize before a calibrated quantize_kv_cache has none), and
        # every calibrating pass's text checked for what the held-out part repeats
        texts = tuple(dict.fromkeys(spec.options.calibration.text for spec in passes
                                    if getattr(spec.options, "calibration", None) is not None))
        held_out = held_out_tokens(texts[0] if texts else BUILTIN, loaded.tokenizer_json, recipe.accuracy.max_tokens,
                                   other_texts=texts[1:])
        if len(held_out.tokens) < 2:
            raise BuildError(f"accuracy report: its held-out text ({held_out.source}) has {len(held_out.tokens)} "
                             f"token(s), and scoring needs at least 2; give a longer calibration.text or set "
                             f"accuracy.enabled: false")
        if warning := repeated_text_warning(held_out):
            say(f"warning: {warning}")
    weight_bytes = sum(tensor.nbytes for tensor in loaded.state_dict.values())
    parameters = sum(tensor.numel() for tensor in loaded.state_dict.values())
    for folder in remove_abandoned_scratch():  # a killed build's traces: gigabytes for a large model
        say(f"removed {folder}, left by a build that was killed")
    if built_at.parent.is_dir():  # now, not after minutes of export: a killed swap's artifact is put back at once
        for folder in remove_abandoned(built_at):
            say(f"removed {folder}, left by a build of {built_at.name} that was killed")
    # after those removals: a build the OOM killer ended left twice the weights in TMPDIR, which the check counted
    _check_disk_room(recipe, built_at, parameters, quantized=any(spec.name == "quantize" for spec in passes))
    if short := memory_short_warning(4 * parameters):
        say(f"warning: {short}")
    decoder = build_decoder(loaded.config, loaded.state_dict)
    del loaded.state_dict  # the decoder holds the weights now
    with scratch_folder("spill") as spill:
        # A large model's passes before quantization hold one phase's graph at a time, the other on disk (run_pipeline's
        # spill_dir). Not the quantizing ones: quantize_kv_cache calibrates on the phase that runs first, and one
        # phase at a time would change which.
        spill_dir = Path(spill) if weight_bytes > SPILL_ABOVE_WEIGHT_BYTES else None
        with scratch_folder("trace") as traced:
            paths = trace_graphs(decoder, recipe.export.max_context, Path(traced), recipe.export.opset,
                                 recipe.export.prefill_logits, progress=say, dtype=recipe.export.dtype)
            del decoder  # its weights are in the traced files now: not held beside the graphs read back from them
            if spill_dir is not None:
                say(f"the weights take {weight_bytes / 1e9:.2f} GB: the passes before quantization run one phase at a "
                    f"time, the other phase's graph waiting on disk")
            graphs = {phase: load_traced(path, loaded.config) if spill_dir is None else
                      spill_graph(load_traced(path, loaded.config), spill_dir / phase) for phase, path in paths.items()}
        graphs, pass_results = run_pipeline(graphs, passes[:first_quantize], progress=say, consume=True,
                                            spill_dir=spill_dir, numbered=(0, len(passes)),
                                            dump_dir=None if dump_dir is None else str(dump_dir))
    float_decode = graphs["decode"] if report_accuracy else None
    graphs, more_results = run_pipeline(graphs, passes[first_quantize:], progress=say, consume=True,
                                        numbered=(first_quantize, len(passes)),
                                        dump_dir=None if dump_dir is None else str(dump_dir))
    pass_results += more_results
    kv_cache = kv_cache_spec(loaded.config, recipe.export.max_context, cache_dtype(graphs, recipe.export.dtype))

    with staged_folder(built_at, swap) as folder:
        say("writing engines")
        aliases = kv_cache["output_aliases_input"]
        if recipe.backend.name == "tensorrt":
            sections = tensorrt_backend.write_engines(graphs, folder, recipe, aliases, Path(output_root), say)
        else:
            sections = onnxruntime_backend.write_engines(graphs, folder, recipe.backend, aliases)
        (folder / TOKENIZER_FILE).write_text(loaded.tokenizer_json, encoding="utf-8")  # not the locale's: Ġ, Ā...
        if loaded.chat_template is not None:
            (folder / CHAT_TEMPLATE_FILE).write_text(loaded.chat_template, encoding="utf-8")
        manifest = {"kv_cache": kv_cache, "model": {"config": loaded.config.to_dict()}, **sections}
        accuracy = {}
        if report_accuracy:
            say("accuracy report: quantized vs float on held-out text")
            accuracy = {"quantization": quantization_summary([vars(result) for result in pass_results]),
                        "held_out": evaluate_against_float(float_decode, folder, manifest, recipe.accuracy,
                                                           held_out, recipe.backend, say)}
        say("hashing files and writing the manifest")
        full = write_manifest(folder, {
            "name": recipe.name,
            "recipe": recipe.to_dict(),
            "tools": {**tool_versions(), "aotlm_source": source_revision(), "aotlm_sources_sha256": sources_sha256(),
                      "host": build_host()},
            "model": {"config": loaded.config.to_dict(), "source": loaded.source},
            "tokenizer": {"file": TOKENIZER_FILE, "bos_token_id": loaded.config.bos_token_id,
                          "eos_token_ids": list(loaded.config.eos_token_ids),
                          "chat_template": CHAT_TEMPLATE_FILE if loaded.chat_template is not None else None,
                          "template_tokens": loaded.template_tokens},
            "kv_cache": kv_cache,
            # written where the model has none too: a manifest without it comes from an aotlm that did not look
            "generation_defaults": loaded.generation_defaults or {"source": None, "values": {}},
            **sections,
            "passes": [vars(result) for result in pass_results],
            **({"accuracy": accuracy} if accuracy else {}),
            "build_seconds": round(time.perf_counter() - started, 2),
        })
    if written is not None:
        written.update(full)
    return final_dir
