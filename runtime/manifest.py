"""Read and check an artifact's manifest.json: format version, every file's size, sha256 on demand.

The manifest is the contract between the compiler and the runtime; this module owns its version number.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

from runtime.errors import ArtifactError

FORMAT = "aotlm-artifact"
FORMAT_VERSION = 2  # the newest this runtime reads; a build writes 1 where an artifact needs none of REQUIREMENTS
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
# What a runtime must act on, not pass over: an artifact that needs one lists it in `requires` and is format 2,
# which the runtimes that read only format 1 refuse in a line. They had passed over both: an int8 cache's first
# step failed inside onnxruntime ("expected: (tensor(int8))"), and without session_config's disable_quant_qdq a
# DequantizeLinear artifact's prefill ran onnxruntime's fused 4-bit kernel: other text (6 of 8 SmolLM2 prompts).
# A feature added later that older runtimes would pass over gets an entry here: generation_defaults came later than
# format 2 without one, and the runtimes before it sampled a model that ships a temperature greedily, saying nothing.
REQUIREMENTS = {"int8_kv_cache": "a KV cache stored as int8", "session_config": "onnxruntime session settings",
                "generation_defaults": "the model's own sampling defaults"}


def required_features(manifest: dict) -> list[str]:
    """The REQUIREMENTS a manifest's artifact needs (the build stamps them, and format 2 where there are any)."""
    needs = ["int8_kv_cache"] if manifest.get("kv_cache", {}).get("dtype") == "int8" else []
    if any(engine.get("session_config") for engine in manifest.get("engines", {}).values()):
        needs.append("session_config")
    defaults = manifest.get("generation_defaults")
    if isinstance(defaults, dict) and defaults.get("values"):  # none to apply: nothing an older runtime would miss
        needs.append("generation_defaults")
    return needs


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# What every reader of a manifest relies on; a manifest without one of them was edited or cut short.
REQUIRED_SECTIONS = {"name": str, "model": dict, "tokenizer": dict, "kv_cache": dict, "engines": dict,
                     "backend": dict, "files": dict}


def _artifacts_inside(folder: Path, shown: int = 6) -> list[Path]:
    """The artifact folders directly inside `folder` (`aotlm build`'s --output, artifacts/ by default), a few; not a
    build's hidden temporary folders (.NAME.partial-..., whose manifest is written just before the rename)."""
    try:
        return sorted(child for child in folder.iterdir()
                      if not child.name.startswith(".") and (child / MANIFEST_FILE).is_file())[:shown]
    except OSError:
        return []


def _build_in_progress(folder: Path) -> str | None:
    """What to say when `folder` is a build's temporary folder, or the artifact a running build will put in place
    (compiler/artifact.py: staged_folder writes .NAME.partial-PID-XXXX beside it, then renames it to NAME)."""
    if folder.is_symlink():  # a dangling link: the build's folders are beside the folder it leads to
        target = Path(os.path.realpath(folder))
        said = _build_in_progress(target) if target != folder and not target.is_symlink() else None
        return None if said is None else f"{folder} is a link to {target}; {said}"
    name = folder.name
    if name.startswith(".") and ".partial-" in name:
        final = folder.parent / name[1:name.rindex(".partial-")]
        if not _held_by_a_build(folder):  # its build was stopped: no build will put anything at `final` from here
            return (f"{folder}: a temporary folder a stopped build left, not an artifact (the next `aotlm build` of "
                    f"{final.name} removes it); load {final}, or build it again")
        return (f"{folder}: a build's temporary folder, not an artifact; the build puts the artifact at {final} when it "
                f"finishes: load that")
    try:
        partial = sorted(folder.parent.glob(f".{glob.escape(name)}.partial-*"))
        retired = sorted(path / name for path in folder.parent.glob(f".{glob.escape(name)}.old-*"))
    except OSError:
        return None
    previous = next((path for path in retired if not _held_by_a_build(path.parent) and path.is_dir()), None)
    if previous is not None:  # a build killed between its swap's two renames: the old artifact is whole there
        return (f"{folder}: no such directory: a build of it was stopped while it replaced it, and the previous "
                f"artifact is whole at {previous}: move it back (mv {previous} {folder}) or build again (the next "
                f"`aotlm build` puts it back first)")
    running = next((path for path in partial if _held_by_a_build(path)), None)
    if running is not None:
        return (f"{folder}: no such directory yet: a build of it is running (its temporary folder {running} "
                f"exists); load it once `aotlm build` finishes")
    if partial:  # no build holds it: one was killed (its lock went with its process)
        return (f"{folder}: no such directory: a build of it was stopped before it finished (it left "
                f"{partial[0]}, which the next `aotlm build` removes); build it again")
    return None


def _held_by_a_build(folder: Path) -> bool:
    """Whether a running build holds its lock on folder (compiler/artifact.py locks its temporary folders with flock
    while it runs; the kernel drops the lock when the process ends, however it ends). Where locks cannot be tried
    (no fcntl, a filesystem without them), a build is assumed to hold it, as before."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False  # removed meanwhile (the build finished) or not ours: not a build of ours to wait for
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(descriptor)
    return False


def _builder(manifest: dict) -> str:
    """" (built by aotlm X at commit Y)", from what the manifest records, for a refusal's advice."""
    tools = manifest.get("tools") if isinstance(manifest.get("tools"), dict) else {}
    source = tools.get("aotlm_source") if isinstance(tools.get("aotlm_source"), dict) else {}
    version, commit, sources = tools.get("aotlm"), source.get("commit"), tools.get("aotlm_sources_sha256")
    if not isinstance(version, str):
        return ""
    at = (f" at commit {commit[:12]}" if isinstance(commit, str) else
          f", sources sha256 {sources[:12]}" if isinstance(sources, str) else "")
    return f" (built by aotlm {version}{at})"


def utf8_path(path) -> str:
    """The path as onnxruntime and tokenizers take one: str, which they encode as UTF-8. Under a C or POSIX locale
    without UTF-8 mode, Python reads a path's non-ASCII bytes as lone surrogates, which neither could encode: the
    same bytes read as UTF-8 name the same file. ArtifactError where the bytes are not UTF-8 (check_utf8_path)."""
    check_utf8_path(path)
    return os.fsencode(path).decode("utf-8")


def check_utf8_path(folder, what: str = "its path", fix: str = "rename or move the folder") -> None:
    """onnxruntime and tokenizers take paths as UTF-8 text: a folder whose name holds other bytes (made on a latin-1
    system, or by a script) loaded as onnxruntime's argument dump or as "cannot read the tokenizer; rebuild"."""
    try:
        os.fsencode(folder).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ArtifactError(f"{os.fspath(folder)!a}: {what} is not UTF-8 (byte 0x{error.object[error.start]:02x}), and "
                            f"onnxruntime and tokenizers take UTF-8 paths only; {fix}") from None


def read_manifest(artifact_dir: str | Path) -> dict:
    """Load manifest.json and check its format and version; raises ArtifactError."""
    if isinstance(artifact_dir, str) and not artifact_dir.strip():  # Path("") is ".": "./ has no manifest" misled
        raise ArtifactError("the artifact path is empty (an unset variable?); give the artifact's folder, e.g. "
                            "artifacts/<name>")
    folder = Path(artifact_dir)
    path = folder / MANIFEST_FILE
    if not folder.is_absolute():
        try:
            os.getcwd()  # a relative path read fine, then failed (resolve()) once the working folder was gone
        except FileNotFoundError:
            raise ArtifactError(f"{folder}: a path relative to the working folder, which was deleted; cd to a folder "
                                f"that exists, or give the artifact's absolute path") from None
    if folder.is_file():
        fix = (f"it looks like a recipe: build it with `aotlm build {folder}` (or size it with `aotlm plan {folder}`)"
               if folder.suffix in (".yaml", ".yml") else "an artifact is the folder `aotlm build RECIPE` writes")
        raise ArtifactError(f"{folder}: a file, not an artifact folder; {fix}")
    if not folder.is_dir():
        building = _build_in_progress(folder) if folder.name else None  # a glob: on the refusals' paths only
        built = Path("artifacts") / folder  # a recipe's name, as `aotlm build NAME` takes one: its artifact is there
        if building is None and not folder.is_absolute() and (built / MANIFEST_FILE).is_file():
            raise ArtifactError(f"{folder}: no such folder here; did you mean {built}? (`aotlm build` writes "
                                f"artifacts/<name>)")
        raise ArtifactError(building or f"{folder}: not an artifact folder (no such directory); build one with "
                                        f"`aotlm build RECIPE`")
    try:
        has_manifest = path.is_file()
    except OSError as error:  # a folder without search (x) permission: even stat of what it holds is refused
        raise _unreadable(path, error) from None
    if not has_manifest and folder.name.startswith(".") and (building := _build_in_progress(folder)) is not None:
        raise ArtifactError(building)
    if not has_manifest:
        inside = _artifacts_inside(folder)
        fix = (f"it holds artifacts: give one of {', '.join(map(str, inside))}" if inside
               else "build one with `aotlm build RECIPE`")
        raise ArtifactError(f"{folder}: not an artifact (no {MANIFEST_FILE}); {fix}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, a 5000-digit number, nesting 10^5 deep
        raise ArtifactError(f"{path}: unreadable manifest ({str(error)[:200]}); rebuild the artifact") from None
    except OSError as error:  # another user's artifact, say
        raise _unreadable(path, error) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not an aotlm manifest (format field missing); rebuild the artifact")
    version = manifest.get("format_version")
    # true and 1.0 equal 1 in Python, and the text "1" reads as it: a build writes the integer, so each was edited
    if (isinstance(version, str) and version.strip() in map(str, READABLE_VERSIONS)) or (
            isinstance(version, (bool, float)) and version in READABLE_VERSIONS):
        raise ArtifactError(f"{path}: format_version is {json.dumps(version)}, where a build writes the number "
                            f"{int(float(version))}; the manifest was edited: rebuild the artifact")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{path}: artifact format version {version!r}, but this runtime reads versions "
            f"{' and '.join(map(str, READABLE_VERSIONS))}; rebuild it with this aotlm (`aotlm build RECIPE`) or use "
            f"the aotlm that built it{_builder(manifest)}"
        )
    requires = manifest.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(need, str) for need in requires) or (
            version == 1 and requires):
        raise ArtifactError(f"{path}: requires is {json.dumps(requires)[:100]}, where a build writes a list of names "
                            f"(format 2); the manifest was edited: rebuild the artifact")
    unknown = [need for need in requires if need not in REQUIREMENTS]
    if unknown:
        raise ArtifactError(f"{path}: this artifact needs {', '.join(map(repr, unknown))}, which this runtime does not "
                            f"know: use the aotlm that built it{_builder(manifest)}, or rebuild it with this one")
    missing = [key for key, kind in REQUIRED_SECTIONS.items() if not isinstance(manifest.get(key), kind)]
    missing = missing or [key for key, kind in REQUIRED_FIELDS.items() if not isinstance(_field(manifest, key), kind)]
    missing = missing or [f"files.{name}" for name, record in manifest["files"].items() if not isinstance(record, dict)
                          or not isinstance(record.get("bytes"), int) or not isinstance(record.get("sha256"), str)]
    missing = missing or [f"passes[{index}]" for index, record in enumerate(manifest["passes"])
                          if not isinstance(record, dict) or any(not isinstance(record.get(key), kind) for key, kind in
                                                                 PASS_RECORD.items())]
    integers = lambda values, least: all(isinstance(n, int) and not isinstance(n, bool) and n >= least  # noqa: E731
                                         for n in values)
    if not missing and not integers(manifest["tokenizer"]["eos_token_ids"], 0):
        missing = ["tokenizer.eos_token_ids as token ids"]
    shape = [] if missing else manifest["kv_cache"]["shape"]
    if not missing and not (len(shape) == 4 and (isinstance(shape[0], str) or integers(shape[:1], 1))
                            and integers(shape[1:], 1)):  # [batch (may be named), kv_heads, max_context, head_dim]
        missing = ["kv_cache.shape as [batch, kv_heads, max_context, head_dim]"]
    if not missing and shape[2] != manifest["kv_cache"]["max_context"]:  # the graphs' buffers are shape[2] long
        missing = [f"kv_cache.max_context equal to kv_cache.shape[2] ({shape[2]}), not "
                   f"{manifest['kv_cache']['max_context']}"]
    missing = missing or [f"engines.{phase}.{side} as a list of mappings" for phase in ("prefill", "decode")
                          for side in ("inputs", "outputs")
                          if not all(isinstance(entry, dict) for entry in manifest["engines"][phase][side])]
    if missing:
        raise ArtifactError(f"{path}: the manifest lacks {', '.join(missing)} (or has the wrong type); the file was "
                            f"edited or cut short: rebuild the artifact")
    disagreement = _engines_disagree(manifest)
    if disagreement:
        raise ArtifactError(f"{path}: {disagreement}; the manifest was edited: rebuild the artifact")
    outside = [name for name in manifest["files"] if Path(name).is_absolute() or ".." in Path(name).parts]
    if outside:  # the engines and tokenizer must be listed here (check_files), so none of them is read from elsewhere
        raise ArtifactError(f"{path}: its files list names {outside[0]!r}, outside the artifact folder; an artifact holds every "
                            f"file it uses: rebuild the artifact")
    return manifest


def _engines_disagree(manifest: dict) -> str | None:
    """Each engine's own record against the sections the backends read: its backend, and which outputs alias which
    cache inputs (the backend binds kv_cache.output_aliases_input; a map the graphs do not have failed at the first
    step, inside onnxruntime). The backend's check_io then holds the graphs to these records."""
    backend, cache_map = manifest["backend"]["name"], manifest["kv_cache"]["output_aliases_input"]
    for phase in ("prefill", "decode"):
        engine = manifest["engines"][phase]
        if engine.get("backend", backend) != backend:
            return f"engines.{phase}.backend is {engine['backend']!r}, but backend.name is {backend!r}"
        # The backends size the cache buffers from kv_cache; a graph whose cache inputs differ failed at its first
        # step, inside onnxruntime (kv_cache.max_context raised by hand, say: the graphs hold their own length)
        cache = manifest["kv_cache"]
        for entry in engine["inputs"]:
            shape, dtype = entry.get("shape", cache["shape"]), entry.get("dtype", cache["dtype"])
            if entry.get("kv_cache") is True and (not isinstance(shape, list) or shape[1:] != cache["shape"][1:]
                                                  or dtype != cache["dtype"]):
                return (f"engines.{phase}'s cache input {entry.get('name')!r} is {entry.get('dtype')} "
                        f"{entry.get('shape')}, but kv_cache says {cache['dtype']} {cache['shape']} (a graph's "
                        f"cache length and heads are fixed when it is built)")
        if not any("aliases" in output for output in engine["outputs"]):
            continue  # written by an aotlm from before the engines recorded their aliases: nothing to compare
        declared = {o.get("name"): o.get("aliases") for o in engine["outputs"] if o.get("aliases") is not None}
        flagged = {i.get("name") for i in engine["inputs"] if i.get("kv_cache")}
        # decode reads and writes every layer's cache; prefill declares no alias the cache map contradicts
        names = sorted(set(declared) | set(cache_map), key=str) if phase == "decode" else sorted(declared, key=str)
        for name in names:
            if declared.get(name) != cache_map.get(name):
                return (f"engines.{phase} declares output {name!r} aliasing {declared.get(name)!r}, but "
                        f"kv_cache.output_aliases_input maps it to {cache_map.get(name)!r}")
        unmarked = sorted(set(declared.values()) - flagged, key=str)
        if unmarked and any("kv_cache" in entry for entry in engine["inputs"]):
            return f"engines.{phase}'s input {unmarked[0]!r} is aliased by an output but not marked kv_cache"
    return None


# Fields below the sections that the runtime and `aotlm inspect` read, as dotted paths.
REQUIRED_FIELDS = {"created": str, "passes": list, "model.config": dict, "model.config.vocab_size": int,
                   "model.config.architecture": str, "model.config.num_layers": int, "model.config.hidden_size": int,
                   "model.config.num_heads": int, "model.config.num_kv_heads": int,
                   "model.source": dict, "tokenizer.file": str, "tokenizer.eos_token_ids": list,
                   "kv_cache.shape": list, "kv_cache.max_context": int, "kv_cache.bytes_per_token": int,
                   "kv_cache.layout": list, "kv_cache.output_aliases_input": dict, "engines.prefill.file": str,
                   "engines.decode.file": str,
                   "engines.prefill.inputs": list, "engines.prefill.outputs": list, "engines.decode.inputs": list,
                   "engines.decode.outputs": list, "backend.name": str, "backend.version": str}
PASS_RECORD = {"name": str, "phase": str, "seconds": (int, float), "report": dict}  # each entry of "passes"


def _field(manifest: dict, dotted: str):
    value = manifest
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def referenced_files(manifest: dict) -> list[str]:
    """The files the manifest's sections point at: engines, tokenizer, chat template, shared weights."""
    named = [engine["file"] for engine in manifest["engines"].values() if isinstance(engine, dict) and "file" in engine]
    named += [manifest["tokenizer"]["file"], manifest["tokenizer"].get("chat_template"),
              (manifest["backend"].get("weights") or {}).get("file")]
    return [name for name in named if name]


def _desktop_metadata(name: str) -> bool:
    """Files a desktop adds to any folder it shows or copies (macOS's .DS_Store and ._NAME resource forks on
    exFAT/SMB drives, Windows' Thumbs.db and desktop.ini): never read, so no reason to refuse the artifact."""
    return name in (".DS_Store", "Thumbs.db", "desktop.ini") or name.startswith("._")


def check_files(artifact_dir: str | Path, manifest: dict, verify_hashes: bool = False) -> None:
    """Every listed file must exist with its recorded size (and sha256 when verify_hashes); every file in the
    folder, and every file the manifest's sections name, must be listed (the build lists every file it writes)."""
    folder = Path(artifact_dir)
    listed = manifest.get("files", {})
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")  # sub/manifest.json is a stray file
                     if p.is_file() and p != folder / MANIFEST_FILE and not _desktop_metadata(p.name))
    unlisted = [name for name in present + referenced_files(manifest) if name not in listed]
    if unlisted:
        named = unlisted[0] in referenced_files(manifest)  # the manifest points at it: the manifest was edited
        raise ArtifactError(f"{folder / unlisted[0]}: not in the manifest's files, so its size and sha256 cannot be "
                            f"checked; " + ("the manifest was edited: rebuild the artifact" if named else
                                            "an artifact holds only the files its manifest lists: remove it (or "
                                            "rebuild the artifact)"))
    inside = folder.resolve()
    for name, record in listed.items():
        path = folder / name
        target = path.resolve()
        if path.is_symlink() and target.exists() and not target.is_file():  # a device, a FIFO (opening one blocks)
            raise ArtifactError(f"{path}: a link to {target}, which is not a regular file; rebuild the artifact")
        if not path.is_file():
            raise ArtifactError(f"{path}: file listed in the manifest is missing; rebuild the artifact")
        linked_out = not target.is_relative_to(inside)  # cp -rs, git-annex, DVC's cache: links to elsewhere
        size = path.stat().st_size
        if size != record["bytes"]:
            raise ArtifactError(
                f"{path}: {size} bytes, but the manifest records {record['bytes']} (truncated or modified); "
                f"rebuild the artifact"
            )
        try:  # opened, not read: onnxruntime blamed the graph whose external data it is, by errno number
            open(path, "rb").close()
        except OSError as error:
            raise _unreadable(path, error) from None
        # A file linked from outside the folder is hashed at every load: a link to /proc/self/environ (size 0, as
        # listed) served the server's environment as a chat template, and no hash was asked for
        if (verify_hashes or linked_out) and _sha256_or_refuse(path) != record["sha256"]:
            where = f", a link to {target}," if linked_out else ""
            raise ArtifactError(f"{path}{where}: sha256 differs from the manifest (file modified); rebuild the "
                                f"artifact")


def _sha256_or_refuse(path: Path) -> str:
    try:
        return sha256_file(path)
    except OSError as error:
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: OSError) -> ArtifactError:
    return ArtifactError(f"{path}: cannot be read ({error.strerror}); fix the folder's permissions")
