"""An artifact that is missing, tampered with, truncated or of another format version is refused clearly."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from runtime import ArtifactError, Engine


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path):
    return shutil.copytree(tiny_artifact, tmp_path / "copy")


@pytest.mark.parametrize("edit", [lambda data: data[:-100], lambda data: data + b"\0" * 100],
                         ids=["truncated", "grown"])
def test_a_file_of_another_size_is_refused_at_load(artifact_copy, edit):
    weights = artifact_copy / "weights.bin"
    weights.write_bytes(edit(weights.read_bytes()))
    with pytest.raises(ArtifactError, match=r"weights.bin: \d+ bytes, but the manifest records \d+ \(truncated or modified\)"):
        Engine.load(artifact_copy)


def test_a_file_is_hashed_whole_over_many_chunks(tmp_path):
    """Every artifact file in the tests is under one 4 MiB read: hashing only the first chunk passed them all (a
    mutation audit), and --verify would miss damage past 4 MiB of SmolLM2's 539 MB weights."""
    from runtime.manifest import sha256_file

    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 3 + b"tail")
    assert sha256_file(path, chunk_bytes=7) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_manifests_hashes_are_sha256_of_the_files(tiny_artifact):
    """Checked against hashlib here: the build and the load share one hashing function, so a tamper test alone
    would pass with any hash."""
    import hashlib

    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    for name, record in manifest["files"].items():
        assert record["sha256"] == hashlib.sha256((tiny_artifact / name).read_bytes()).hexdigest(), name
        assert record["bytes"] == (tiny_artifact / name).stat().st_size, name


def test_same_size_tampering_is_caught_by_verify(artifact_copy):
    weights = artifact_copy / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    Engine.load(artifact_copy)  # sizes match: the default load does not hash gigabytes
    with pytest.raises(ArtifactError, match="sha256 differs"):
        Engine.load(artifact_copy, verify=True)


def test_missing_file_is_refused(artifact_copy):
    (artifact_copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json: file listed in the manifest is missing"):
        Engine.load(artifact_copy)


@pytest.mark.parametrize("version", [99, 0, None])
def test_another_format_version_is_refused(artifact_copy, version):
    manifest_path = artifact_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = version
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"format version {version}, but this runtime reads versions 1 and 2; "
                                            rf"rebuild it with this aotlm \(`aotlm build RECIPE`\) or use the aotlm "
                                            rf"that built it \(built by aotlm \d"):
        Engine.load(artifact_copy)


def test_a_float_artifact_is_format_1_which_older_runtimes_read(artifact_copy):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and "requires" not in manifest


@pytest.mark.parametrize("edit, message", [
    (dict(format_version=2, requires=["int8_kv_cache", "paged_cache"]),
     r"this artifact needs 'paged_cache', which this runtime does not know: use the aotlm that built it \(built by "
     r"aotlm [^)]*\), or rebuild it with this one"),
    (dict(format_version=1, requires=["int8_kv_cache"]), r"requires is \["),  # format 1 has none
    (dict(format_version=2, requires="int8_kv_cache"), r'requires is "int8_kv_cache", where a build writes a list'),
])
def test_requirements_this_runtime_does_not_know_are_refused_by_name(artifact_copy, edit, message):
    """A runtime that passed over a feature it did not know ran an int8 cache into an onnxruntime error, and a
    DequantizeLinear artifact without its session settings: other text, silently."""
    path = artifact_copy / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ArtifactError, match=message):
        Engine.load(artifact_copy)


def test_the_features_an_artifact_needs_are_read_from_its_manifest():
    from runtime.manifest import REQUIREMENTS, required_features

    plain = {"kv_cache": {"dtype": "float32"}, "engines": {"prefill": {}, "decode": {"session_config": None}}}
    assert required_features(plain) == []
    needs = required_features({"kv_cache": {"dtype": "int8"},
                               "engines": {"prefill": {"session_config": {"session.disable_quant_qdq": "1"}}}})
    assert needs == ["int8_kv_cache", "session_config"] and set(needs) <= set(REQUIREMENTS)


def test_another_format_is_not_an_aotlm_manifest(artifact_copy):
    manifest_path = artifact_copy / "manifest.json"
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), "format": "other"}))
    with pytest.raises(ArtifactError, match="not an aotlm manifest"):
        Engine.load(artifact_copy)


def test_an_artifact_from_a_newer_onnxruntime_is_tried_with_a_warning_and_a_failure_names_the_release(
        artifact_copy, monkeypatch):
    """An Intel Mac's newest onnxruntime is 1.23.2: an artifact built with a newer one was refused, though a float one
    runs there with the same tokens. It is tried, with a warning; where the graphs do not load, the error says which
    release to install, first."""
    import onnxruntime

    manifest_path = artifact_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for built in ("1.0.0", onnxruntime.__version__):  # as new, or newer here: no word
        manifest["backend"]["version"] = built
        manifest_path.write_text(json.dumps(manifest))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Engine.load(artifact_copy).close()
    manifest["backend"]["version"] = "99.1.0"
    manifest_path.write_text(json.dumps(manifest))
    older = rf"built with onnxruntime 99.1.0, and {re.escape(onnxruntime.__version__)} is installed \(older\): " \
            rf"install onnxruntime>=99.1.0, or rebuild"
    with pytest.warns(RuntimeWarning, match=older + ".*it loaded, and runs"):
        Engine.load(artifact_copy).close()

    def cannot_load(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Node (GroupQueryAttention) input size 14 not in range")

    monkeypatch.setattr(onnxruntime, "InferenceSession", cannot_load)
    with pytest.raises(ArtifactError, match=r"onnxruntime cannot load this graph; this artifact was built with "
                                            r"onnxruntime 99.1.0.*\(.*input size 14"):
        Engine.load(artifact_copy)


def test_onnxruntime_versions_compare_by_release():
    from runtime.onnxruntime_backend import check_version
    from runtime.versions import release

    with pytest.raises(ArtifactError, match="backend.version 'abc' in the manifest is not an onnxruntime version"):
        check_version("abc", "1.32.0")  # it parsed as 0.0.0, older than anything installed

    assert release("1.33.0rc1") == (1, 33, 0) and release("1.32.0+cpu") == (1, 32, 0)
    assert release("1.9.0") < release("1.32.0") and release("10.14.1.48") == release("10.14.1")


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="no such directory"):
        Engine.load(tmp_path / "nope")
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    with pytest.raises(ArtifactError, match="a file, not an artifact folder; it looks like a recipe"):
        Engine.load(tmp_path / "recipe.yaml")
    with pytest.raises(ArtifactError, match="no manifest.json\\); build one with"):
        Engine.load(tmp_path)
    for name in ("model-b", "model-a"):  # the folder artifacts are built into, given instead of one of them
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    with pytest.raises(ArtifactError, match=f"no manifest.json\\); it holds artifacts: give one of "
                                            f"{tmp_path / 'model-a'}, {tmp_path / 'model-b'}$"):
        Engine.load(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable manifest"):
        Engine.load(tmp_path)
    for hostile in ("[" * 100_000 + "]" * 100_000, '{"format_version": ' + "9" * 5000 + "}"):  # a traceback each
        (tmp_path / "manifest.json").write_text(hostile)
        with pytest.raises(ArtifactError, match="unreadable manifest"):
            Engine.load(tmp_path)


def test_manifest_describes_the_artifact(tiny_artifact):
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["recipe"]["name"] == "tiny-random"
    assert manifest["tools"]["onnxruntime"] and manifest["tools"]["torch"]
    assert manifest["tools"]["numpy"] == np.__version__  # GPTQ and AWQ run in its linear algebra
    assert manifest["model"]["config"]["num_layers"] == 2
    aliases = manifest["kv_cache"]["output_aliases_input"]
    assert aliases["present.1.value"] == "past_key_values.1.value" and len(aliases) == 4
    decode_inputs = {i["name"]: i for i in manifest["engines"]["decode"]["inputs"]}
    assert decode_inputs["past_key_values.0.key"]["kv_cache"] and decode_inputs["past_key_values.0.key"]["shape"][2] == 128
    recipe_passes = [next(iter(entry)) for entry in manifest["recipe"]["passes"]]
    assert [(r["name"], r["phase"]) for r in manifest["passes"]] == [
        (name, phase) for name in recipe_passes for phase in ("prefill", "decode")]
    fusion = next(r for r in manifest["passes"] if r["name"] == "fuse_attention")
    assert fusion["report"]["fused"] == 2 and all(layer["fused"] for layer in fusion["report"]["layers"])
    assert set(manifest["files"]) == {"prefill.onnx", "decode.onnx", "weights.bin", "tokenizer.json"}


def _edit_manifest(folder, edit):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, named", [
    (lambda m: m["files"]["weights.bin"].pop("bytes"), "files.weights.bin"),
    (lambda m: m["files"].__setitem__("weights.bin", "565248"), "files.weights.bin"),
    (lambda m: m["files"]["weights.bin"].__setitem__("bytes", "565248"), "files.weights.bin"),
    (lambda m: m["files"]["weights.bin"].pop("sha256"), "files.weights.bin"),
    (lambda m: m["engines"]["decode"].pop("file"), "engines.decode.file"),
    (lambda m: m.__setitem__("engines", {}), "engines.prefill.file"),
    (lambda m: m["backend"].__setitem__("version", 1), "backend.version"),
    (lambda m: m["backend"].pop("name"), "backend.name"),
    (lambda m: m["tokenizer"].pop("eos_token_ids"), "tokenizer.eos_token_ids"),
    (lambda m: m["kv_cache"].pop("max_context"), "kv_cache.max_context"),
    (lambda m: m["model"]["config"].pop("vocab_size"), "model.config.vocab_size"),
    (lambda m: m["model"]["config"].pop("architecture"), "model.config.architecture"),  # inspect's KeyError
    (lambda m: m["model"]["config"].__setitem__("num_kv_heads", None), "model.config.num_kv_heads"),
    (lambda m: m.pop("created"), "created"),
    # these reached `aotlm inspect` (KeyError) or onnxruntime (invalid rank) before they were checked
    (lambda m: m["engines"]["decode"].pop("inputs"), "engines.decode.inputs"),
    (lambda m: m["passes"].append({"name": "x"}), r"passes\[\d+\]"),
    (lambda m: m["tokenizer"].__setitem__("eos_token_ids", ["x"]), "tokenizer.eos_token_ids as token ids"),
    (lambda m: m["kv_cache"].__setitem__("shape", [1]), r"kv_cache.shape as \[batch, kv_heads, max_context, head_dim\]"),
    # a KeyError / AttributeError in the backend; a cache longer than its buffers failed inside onnxruntime
    (lambda m: m["kv_cache"].pop("output_aliases_input"), "kv_cache.output_aliases_input"),
    (lambda m: m["kv_cache"].__setitem__("output_aliases_input", []), "kv_cache.output_aliases_input"),
    (lambda m: m["kv_cache"].__setitem__("max_context", 4096), r"kv_cache.max_context equal to kv_cache.shape\[2\] \(128\), not 4096"),
    (lambda m: m["engines"]["decode"]["inputs"].__setitem__(0, "input_ids"), "engines.decode.inputs as a list of mappings"),
    (lambda m: m["engines"]["prefill"]["outputs"].__setitem__(0, "logits"), "engines.prefill.outputs as a list of mappings"),
    (lambda m: m["tokenizer"].pop("file"), "tokenizer.file"),  # the file checks read it
    (lambda m: m["kv_cache"].pop("bytes_per_token"), "kv_cache.bytes_per_token"),  # bench and serve size slots by it
    (lambda m: m.__setitem__("files", []), "files"),
    (lambda m: m["tokenizer"].__setitem__("eos_token_ids", [-1]), "tokenizer.eos_token_ids as token ids"),
    (lambda m: m["kv_cache"]["shape"].__setitem__(1, 0), r"kv_cache.shape as \[batch, kv_heads, max_context, head_dim\]"),
])
def test_a_manifest_missing_a_field_its_readers_use_is_refused_by_name(artifact_copy, edit, named):
    """Only the top-level sections were checked: these were KeyError / TypeError / AttributeError tracebacks."""
    _edit_manifest(artifact_copy, edit)
    with pytest.raises(ArtifactError, match=rf"the manifest lacks (.*, )?{named}(, .*)? \(or has the wrong type\)"):
        Engine.load(artifact_copy)


def _retarget(aliases: dict) -> None:
    aliases["present.0.key"] = "past_key_values.1.key"


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["engines"]["decode"].__setitem__("backend", "tensorrt"),
     "engines.decode.backend is 'tensorrt', but backend.name is 'onnxruntime'"),
    # the backend binds this map: a present output bound to another layer's past failed inside onnxruntime
    (lambda m: _retarget(m["kv_cache"]["output_aliases_input"]),
     "engines.prefill declares output 'present.0.key' aliasing 'past_key_values.0.key', but "
     "kv_cache.output_aliases_input maps it to 'past_key_values.1.key'"),
    (lambda m: m["kv_cache"]["output_aliases_input"].pop("present.1.value"),
     "engines.prefill declares output 'present.1.value' aliasing 'past_key_values.1.value', but "
     "kv_cache.output_aliases_input maps it to None"),
    (lambda m: m["engines"]["decode"]["outputs"][-1].__setitem__("aliases", None),
     "engines.decode declares output 'present.1.value' aliasing None, but kv_cache.output_aliases_input maps it to "
     "'past_key_values.1.value'"),
    (lambda m: m["engines"]["decode"]["inputs"][-1].__setitem__("kv_cache", False),
     "engines.decode's input 'past_key_values.1.value' is aliased by an output but not marked kv_cache"),
    (lambda m: m.__setitem__("format_version", "1"), 'format_version is "1", where a build writes the number 1'),
    # True == 1 == 1.0 in Python: they loaded, and inspect printed "format vTrue"
    (lambda m: m.__setitem__("format_version", True), "format_version is true, where a build writes the number 1"),
    (lambda m: m.__setitem__("format_version", 1.0), "format_version is 1.0, where a build writes the number 1"),
    # the backends size the cache from kv_cache: a longer max_context (shape too) loaded, then failed in onnxruntime
    (lambda m: m["kv_cache"].update(max_context=256, shape=["batch", 2, 256, 16]),
     "engines.prefill's cache input 'past_key_values.0.key' is float32 ['batch', 2, 128, 16], but kv_cache says "
     "float32 ['batch', 2, 256, 16]"),
    (lambda m: m["engines"]["decode"]["inputs"][3].update(shape=None),
     "engines.decode's cache input 'past_key_values.0.key' is float32 None, but kv_cache says float32"),
    (lambda m: m["kv_cache"].update(dtype="int8"),
     "engines.prefill's cache input 'past_key_values.0.key' is float32 ['batch', 2, 128, 16], but kv_cache says "
     "int8 ['batch', 2, 128, 16]"),
])
def test_engine_records_that_contradict_the_cache_map_are_refused(artifact_copy, edit, message):
    """The runtime binds kv_cache.output_aliases_input; the engines' own records were written and never read, so an
    edit that made them disagree loaded, and failed at the first step with onnxruntime's 'Missing Input'."""
    _edit_manifest(artifact_copy, edit)
    with pytest.raises(ArtifactError, match=re.escape(message)):
        Engine.load(artifact_copy)


def test_engine_records_from_before_the_aliases_were_recorded_load(artifact_copy):
    def older(manifest):
        for engine in manifest["engines"].values():
            for output in engine["outputs"]:
                del output["aliases"]
            for entry in engine["inputs"]:
                del entry["kv_cache"]

    _edit_manifest(artifact_copy, older)
    assert len(Engine.load(artifact_copy).generate([1, 5], max_new_tokens=2, ignore_eos=True).token_ids) == 2


@pytest.mark.parametrize("setting, message", [
    ({"graph_optimization_level": "ultra"}, r"graph_optimization_level: 'ultra' is not one of .*rebuild the artifact"),
    ({"intra_op_threads": -2}, r"intra_op_threads: -2 must be an integer >= 0"),
])
def test_edited_session_settings_are_named(artifact_copy, setting, message):
    """An unknown optimization level was a KeyError from inside the backend."""
    _edit_manifest(artifact_copy, lambda m: m["backend"].setdefault("session", {}).update(setting))
    with pytest.raises(ArtifactError, match=message):
        Engine.load(artifact_copy)


def test_a_file_the_manifest_does_not_list_is_refused(artifact_copy):
    """weights.bin dropped from `files` and then cut: nothing checked it, and onnxruntime failed inside its loader."""
    _edit_manifest(artifact_copy, lambda m: m["files"].pop("weights.bin"))
    (artifact_copy / "weights.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(ArtifactError, match="weights.bin: not in the manifest's files"):
        Engine.load(artifact_copy)
    (artifact_copy / "weights.bin").unlink()  # gone too: the graphs' external data is still named by the manifest
    with pytest.raises(ArtifactError, match="weights.bin: not in the manifest's files"):
        Engine.load(artifact_copy)


def test_a_chat_template_the_manifest_names_but_does_not_list_is_refused(artifact_copy):
    """A file the sections name is checked like one in the folder, whether or not it is there."""
    _edit_manifest(artifact_copy, lambda m: m["tokenizer"].__setitem__("chat_template", "chat_template.jinja"))
    with pytest.raises(ArtifactError, match="chat_template.jinja: not in the manifest's files.*the manifest was "
                                            "edited: rebuild the artifact"):
        Engine.load(artifact_copy)


def test_a_manifest_json_in_a_subfolder_is_a_stray_file(artifact_copy):
    """Files named manifest.json were left out wherever they were, so sub/manifest.json loaded unchecked."""
    (artifact_copy / "sub").mkdir()
    (artifact_copy / "sub" / "manifest.json").write_text("{}")
    with pytest.raises(ArtifactError, match="sub/manifest.json: not in the manifest's files"):
        Engine.load(artifact_copy)


def test_a_manifest_that_cannot_be_read_is_named(artifact_copy, monkeypatch):
    """Another user's artifact: the PermissionError came out of read_manifest as a traceback."""
    read_text = Path.read_text

    def refused(path, *args, **kwargs):
        if path.name == "manifest.json":
            raise PermissionError(13, "Permission denied", str(path))
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(ArtifactError, match=r"manifest.json: cannot be read \(Permission denied\); fix the folder"):
        Engine.load(artifact_copy)


def test_an_engine_file_that_is_another_graph_is_refused_by_its_io(artifact_copy):
    """decode pointed at prefill.onnx: same input names, another logits rank; it failed in onnxruntime's Gather."""
    _edit_manifest(artifact_copy, lambda m: m["engines"]["decode"].__setitem__("file", "prefill.onnx"))
    with pytest.raises(ArtifactError, match=r"prefill.onnx: the graph's outputs differ from the manifest's I/O spec "
                                            r"\(graph \('logits', 'float32', \[None, 512\]\), manifest"):
        Engine.load(artifact_copy)


def test_a_listed_file_that_cannot_be_read_is_named(artifact_copy, monkeypatch):
    """Another user's weights.bin: sizes matched, and onnxruntime then refused prefill.onnx ("SystemError : 13"),
    naming neither the file nor the cause (an unreadable tokenizer.json said "rebuild the artifact")."""
    import builtins

    real_open = builtins.open

    def refused(file, *args, **kwargs):
        if Path(str(file)).name == "weights.bin":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refused)
    with pytest.raises(ArtifactError, match=r"weights.bin: cannot be read \(Permission denied\); fix the folder"):
        Engine.load(artifact_copy)


def test_a_folder_that_cannot_be_searched_is_named(artifact_copy, monkeypatch):
    """A folder without x permission: stat of its manifest raised a bare PermissionError, which the command line
    reported as a refused write ("or write elsewhere")."""
    is_file = Path.is_file

    def refused(path):
        if path.name == "manifest.json":
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", refused)
    with pytest.raises(ArtifactError, match=r"manifest.json: cannot be read \(Permission denied\); fix the folder"):
        Engine.load(artifact_copy)


@pytest.mark.parametrize("outside", [lambda folder: str(folder.parent / "other" / "decode.onnx"),
                                     lambda folder: "../other/decode.onnx"], ids=["absolute", "parent"])
def test_a_file_outside_the_artifact_folder_is_refused(artifact_copy, outside):
    """A manifest pointing decode at another artifact's graph beside the folder, listed with its true size and
    sha256, loaded it and passed --verify: the folder no longer held what the runtime ran."""
    shutil.copytree(artifact_copy, artifact_copy.parent / "other")
    name = outside(artifact_copy)

    def point_decode_outside(manifest):
        manifest["files"][name] = manifest["files"].pop("decode.onnx")
        manifest["engines"]["decode"]["file"] = name

    _edit_manifest(artifact_copy, point_decode_outside)
    (artifact_copy / "decode.onnx").unlink()
    with pytest.raises(ArtifactError, match=r"manifest.json: its files list names '.*other/decode.onnx', outside the artifact"):
        Engine.load(artifact_copy, verify=True)


def test_any_path_object_loads(tiny_artifact):
    from pathlib import PurePosixPath

    class Where:  # any os.PathLike
        def __fspath__(self):
            return str(tiny_artifact)

    for path in (PurePosixPath(tiny_artifact), Where()):  # "artifact_dir must be a path (str or pathlib.Path)"
        assert Engine.load(path, huge_pages=False).artifact_dir == Path(tiny_artifact)
    with pytest.raises(ArtifactError, match="artifact_dir must be a path .*got bytes; decode it to str first"):
        Engine.load(str(tiny_artifact).encode())


def test_a_build_under_way_is_named_not_suggested(tmp_path):
    """A build writes .NAME.partial-PID-XXXX beside NAME, then renames it (compiler/artifact.py). Loading the output
    folder suggested the temporary folder as an artifact to load; loading NAME before the rename said to build it."""
    staging = tmp_path / ".tiny.partial-123-abcd"
    staging.mkdir()
    (staging / "manifest.json").write_text("{}")  # written just before the rename
    with pytest.raises(ArtifactError, match=r"not an artifact \(no manifest.json\); build one with") as refused:
        Engine.load(tmp_path)
    assert "partial" not in str(refused.value)
    fcntl = pytest.importorskip("fcntl")
    held = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running build holds it
    try:
        with pytest.raises(ArtifactError, match=r"tiny: no such directory yet: a build of it is running .*"
                                                r"load it once `aotlm build` finishes"):
            Engine.load(tmp_path / "tiny")
    finally:
        os.close(held)
    # A build killed (SIGKILL, the OOM killer) leaves its folder and no lock: said to be running, for ever
    with pytest.raises(ArtifactError, match=r"tiny: no such directory: a build of it was stopped before it finished "
                                            r"\(it left .*\.tiny\.partial-123-abcd, which the next `aotlm build` "
                                            r"removes\); build it again$"):
        Engine.load(tmp_path / "tiny")
    (staging / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"a temporary folder a stopped build left, not an artifact \(the next "
                                            r"`aotlm build` of tiny removes it\); load .*/tiny, or build it again$"):
        Engine.load(staging)  # no build holds it: none will put the artifact in place from here (a review)
    held = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ArtifactError, match=r"a build's temporary folder, not an artifact; the build puts the "
                                                r"artifact at .*/tiny when it finishes"):
            Engine.load(staging)
    finally:
        os.close(held)


def test_a_file_linked_from_outside_the_artifact_is_hashed_at_every_load(artifact_copy, tmp_path):
    """A hostile artifact's chat template linked to /proc/self/environ (size 0, as listed) served the server's
    environment to every client: the sizes were checked, the hashes only on demand. A link out of the folder (cp -rs,
    git-annex, DVC) is now hashed at load; a link to a device is refused; a link inside the folder is its own file."""
    link = artifact_copy / "chat_template.jinja"
    link.symlink_to("/proc/self/environ")
    listed = {"bytes": 0, "sha256": "0" * 64}
    _edit_manifest(artifact_copy, lambda m: (m["tokenizer"].__setitem__("chat_template", "chat_template.jinja"),
                                             m["files"].__setitem__("chat_template.jinja", listed)))
    with pytest.raises(ArtifactError, match=r"chat_template.jinja, a link to /proc/.*/environ,: sha256 differs"):
        Engine.load(artifact_copy)
    link.unlink()
    link.symlink_to("/dev/null")
    with pytest.raises(ArtifactError, match=r"chat_template.jinja: a link to /dev/null, which is not a regular file"):
        Engine.load(artifact_copy)
    link.unlink()
    _edit_manifest(artifact_copy, lambda m: (m["tokenizer"].pop("chat_template"),
                                             m["files"].pop("chat_template.jinja")))
    linked = tmp_path / "linked"  # cp -rs: every file a link to the original's
    linked.mkdir()
    for file in artifact_copy.iterdir():
        (linked / file.name).symlink_to(file)
    assert Engine.load(linked).generate([1, 5], max_new_tokens=2, ignore_eos=True).token_ids
    (artifact_copy / "tokenizer.json").rename(artifact_copy / "tokenizer-real.json")
    (artifact_copy / "tokenizer.json").symlink_to("tokenizer-real.json")  # inside: the folder's own
    _edit_manifest(artifact_copy, lambda m: m["files"].__setitem__("tokenizer-real.json", m["files"]["tokenizer.json"]))
    assert Engine.load(artifact_copy).generate([1, 5], max_new_tokens=2, ignore_eos=True).token_ids


def test_files_a_desktop_adds_are_ignored_and_a_stray_file_is_named_for_removal(artifact_copy):
    """macOS's .DS_Store (and ._NAME on exFAT/SMB copies) made a copied artifact unloadable, with "rebuild" advice."""
    (artifact_copy / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (artifact_copy / "._weights.bin").write_bytes(b"\0\5\26\7")
    Engine.load(artifact_copy).close()
    (artifact_copy / "notes.txt").write_text("tried on Tuesday")
    with pytest.raises(ArtifactError, match="notes.txt: not in the manifest's files, .*lists: remove it"):
        Engine.load(artifact_copy)


def test_a_relative_path_from_a_deleted_working_folder_is_named(tiny_artifact, tmp_path, monkeypatch):
    """`cd gone; rmdir ../gone; aotlm run ../artifact`: the manifest read, then resolve() raised FileNotFoundError."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(ArtifactError, match="relative to the working folder, which was deleted"):
        Engine.load(os.path.relpath(tiny_artifact, gone))


def rebuilds_during_open(monkeypatch, folder, times: int) -> list:
    """Engine._open, with a build's swap (another artifact renamed over `folder`) during its first `times` calls."""
    opened, open_engine = [], Engine._open.__func__

    def swapped(cls, *args, **kwargs):
        if len(opened) < times:
            rebuilt = shutil.copytree(folder, folder.with_name(f"rebuilt-{len(opened)}"))
            manifest = json.loads((rebuilt / "manifest.json").read_text())
            (rebuilt / "manifest.json").write_text(json.dumps({**manifest, "created": f"build {len(opened) + 1}"}))
            folder.rename(folder.with_name(f"retired-{len(opened)}"))
            rebuilt.rename(folder)
        opened.append(True)
        return open_engine(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "_open", classmethod(swapped))
    return opened


def test_a_load_that_a_build_swapped_under_starts_over_on_the_new_artifact(artifact_copy, monkeypatch):
    """The manifest came from one build and the graphs from another (verify=True passed): a mix, without a word."""
    opened = rebuilds_during_open(monkeypatch, artifact_copy, times=1)
    engine = Engine.load(artifact_copy, verify=True)
    try:
        assert len(opened) == 2 and engine.manifest["created"] == "build 1"  # the artifact now at the path, whole
    finally:
        engine.close()


def test_a_load_swapped_under_every_time_says_so(artifact_copy, monkeypatch):
    rebuilds_during_open(monkeypatch, artifact_copy, times=3)
    with pytest.raises(ArtifactError, match=r"copy: a build replaced it while it loaded, 3 times; load it again once "
                                            r"the builds finish$"):
        Engine.load(artifact_copy)


def test_a_swap_that_makes_the_checks_refuse_the_mix_starts_over_too(artifact_copy, monkeypatch):
    """A rebuild landing between the manifest's read and the files' checks: the old manifest against the new files
    was refused as a damaged artifact ("sha256 differs ... rebuild the artifact", or another graph's inputs) while
    both builds were whole (a review: 4 of 10 rebuilds failed a load running beside them)."""
    import runtime.engine as engine_module

    real_check, calls = engine_module.check_files, []

    def swapped_then_checked(folder, manifest, **kwargs):
        if not calls:  # a build of other weights, whole, renamed over the folder after its manifest was read
            rebuilt = shutil.copytree(folder, folder.with_name("rebuilt"))
            weights = bytearray((rebuilt / "weights.bin").read_bytes())
            weights[:64] = bytes(64)
            (rebuilt / "weights.bin").write_bytes(bytes(weights))
            fresh = json.loads((rebuilt / "manifest.json").read_text())
            fresh["files"]["weights.bin"]["sha256"] = hashlib.sha256(weights).hexdigest()
            (rebuilt / "manifest.json").write_text(json.dumps({**fresh, "created": "the rebuild"}))
            folder.rename(folder.with_name("retired"))
            rebuilt.rename(folder)
        calls.append(manifest.get("created"))
        return real_check(folder, manifest, **kwargs)

    monkeypatch.setattr(engine_module, "check_files", swapped_then_checked)
    with Engine.load(artifact_copy, verify=True) as engine:
        assert engine.manifest["created"] == "the rebuild" and calls[1] == "the rebuild" and len(calls) == 2
    (artifact_copy / "weights.bin").write_bytes(bytes(64) + (artifact_copy / "weights.bin").read_bytes()[64:-1] + b"x")
    calls.clear()
    calls.append("no more swaps")
    with pytest.raises(ArtifactError, match="sha256 differs"):  # no swap: a damaged artifact is refused at once,
        Engine.load(artifact_copy, verify=True)
    assert len(calls) == 2  # after one check, not three


def test_a_load_whose_every_attempt_a_swap_spoiled_says_so_not_rebuild(artifact_copy, monkeypatch):
    """Every attempt's checks refused a mix of two builds: the last one's "sha256 differs ... rebuild the artifact"
    had been raised, about an artifact that was whole each time."""
    import runtime.engine as engine_module

    real_check, swaps = engine_module.check_files, []

    def swapped_every_time(folder, manifest, **kwargs):
        rebuilt = shutil.copytree(folder, folder.with_name(f"rebuilt-{len(swaps)}"))
        weights = bytearray((rebuilt / "weights.bin").read_bytes())
        weights[:8] = (len(swaps) + 1).to_bytes(8, "little")
        (rebuilt / "weights.bin").write_bytes(bytes(weights))
        fresh = json.loads((rebuilt / "manifest.json").read_text())
        fresh["files"]["weights.bin"]["sha256"] = hashlib.sha256(weights).hexdigest()
        (rebuilt / "manifest.json").write_text(json.dumps(fresh))
        folder.rename(folder.with_name(f"retired-{len(swaps)}"))
        rebuilt.rename(folder)
        swaps.append(True)
        return real_check(folder, manifest, **kwargs)

    monkeypatch.setattr(engine_module, "check_files", swapped_every_time)
    with pytest.raises(ArtifactError, match=r"copy: a build replaced it while it loaded, 3 times; load it again once "
                                            r"the builds finish$") as refused:
        Engine.load(artifact_copy, verify=True)
    assert len(swaps) == 3 and "sha256 differs" in str(refused.value.__cause__)


def test_a_build_killed_between_its_renames_names_the_whole_previous_artifact(artifact_copy, tmp_path):
    """The path held nothing and the old artifact sat whole in .NAME.old-*/NAME, while loads said a build was
    running; the next build put it back only at its very end (and not at all if it failed first)."""
    retired = tmp_path / ".copy.old-99-abcd"
    retired.mkdir()
    artifact_copy.rename(retired / "copy")
    (tmp_path / ".copy.partial-99-efgh").mkdir()  # the new one, never renamed in
    with pytest.raises(ArtifactError, match=r"copy: no such directory: a build of it was stopped while it replaced "
                                            r"it, and the previous artifact is whole at .*\.copy\.old-99-abcd/copy: "
                                            r"move it back \(mv "):
        Engine.load(artifact_copy)


def test_an_artifacts_name_given_for_its_folder_is_pointed_to_it(tiny_artifact, tmp_path, monkeypatch):
    """`aotlm build NAME` takes a recipe's name; `aotlm run NAME` said to build it, though artifacts/NAME was built."""
    (tmp_path / "artifacts").mkdir()
    shutil.copytree(tiny_artifact, tmp_path / "artifacts" / "tiny-random")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError, match=r"^tiny-random: no such folder here; did you mean artifacts/tiny-random\?"):
        Engine.load("tiny-random")
    with pytest.raises(ArtifactError, match=r"^the artifact path is empty \(an unset variable\?\)"):
        Engine.load("")  # it read "." and said ./ had no manifest


def test_an_artifact_whose_path_is_not_utf8_is_refused_by_what_it_is(tiny_artifact, tmp_path, capsys):
    """A folder named with bytes that are not UTF-8 (o\\xe9, made on a latin-1 system): the build succeeded, then
    onnxruntime refused the path with a dump of its constructor's signatures and tokenizers with "rebuild the
    artifact", which could not help. The load and the build now say what is wrong."""
    from compiler.cli import main

    folder = tmp_path / "o\udce9"  # os.fsdecode(b"o\xe9")
    shutil.copytree(tiny_artifact, folder)
    with pytest.raises(ArtifactError, match=r"/o\\udce9': its path is not UTF-8 \(byte 0xe9\), and onnxruntime and "
                                            r"tokenizers take UTF-8 paths only; rename or move the folder"):
        Engine.load(folder)
    assert main(["inspect", str(folder)]) == 0  # reading the manifest needs neither onnxruntime nor tokenizers
    capsys.readouterr()
    recipe = Path(__file__).parents[2] / "recipes" / "tiny-random.yaml"
    assert main(["build", str(recipe), "--output", str(folder)]) == 2
    assert "the artifact's path is not UTF-8 (byte 0xe9)" in " ".join(capsys.readouterr().err.split())
