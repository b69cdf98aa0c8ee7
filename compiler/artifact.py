"""The artifact folder: written into a temporary sibling and renamed, so a failed build leaves nothing.

Owns the manifest's assembly (tool versions, file sizes and sha256); `runtime/manifest.py` owns reading it
and the format version both sides agree on.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import fcntl
import os
import platform
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import warnings
from importlib import metadata
from pathlib import Path

from compiler.errors import BuildError, is_artifact_folder
from runtime.errors import AotlmWarning
from runtime.manifest import FORMAT, FORMAT_VERSION, MANIFEST_FILE, required_features, sha256_file
from runtime.results import json_text, process_umask

NO_LOCKS = -1  # _try_lock on a filesystem without locks (some network filesystems)
# numpy computes GPTQ/AWQ (its linalg) and folds constants; ml_dtypes, safetensors, pyyaml read what the build reads
TRACKED_TOOLS = ("aotlm", "torch", "onnx", "onnxscript", "onnx-graphsurgeon", "onnxruntime", "gguf", "tokenizers",
                 "numpy", "ml_dtypes", "safetensors", "pyyaml", "tensorrt", "triton")


def tool_versions(names=TRACKED_TOOLS) -> dict:
    """Python's version and each named distribution's (None when it is not installed)."""
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


SOURCE_FOLDERS = ("compiler", "passes", "runtime")  # what a build runs: the calibration split and kernels are runtime's


def source_revision(root: Path = Path(__file__).resolve().parents[1]) -> dict | None:
    """The git commit the compiler ran from, and whether its SOURCE_FOLDERS had changes not committed: an
    artifact built before a fix (a stop token added to a loader, say) carries the same "aotlm" version as one built
    after it, and this tells them apart. None outside a git checkout, or without git."""
    import subprocess

    try:
        # aotlm's own checkout: not another project's, whose ignored .venv holds aotlm installed
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             encoding="utf-8", errors="replace", timeout=10, check=True).stdout.strip()
        if Path(top).resolve() != root:
            return None
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                encoding="utf-8", errors="replace", timeout=10, check=True).stdout.strip()
        # Untracked files too: a module the build imports that was never added leaves a commit that cannot rebuild it
        changed = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain",
                                  "--untracked-files=normal", "--", *SOURCE_FOLDERS], capture_output=True,
                                 encoding="utf-8", errors="replace", timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "modified": bool(changed.strip())} if re.fullmatch(r"[0-9a-f]{40}", commit) else None


def sources_sha256(root: Path = Path(__file__).resolve().parents[1], folders=SOURCE_FOLDERS) -> str:
    """sha256 of the Python files under `folders` (their paths and bytes): which code built an artifact where there
    is no commit to name (a wheel or `pip install .` records version 0.1.0 and nothing else), or what an uncommitted
    change was."""
    import hashlib

    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_host() -> dict:
    """The machine a build ran on, as far as it decides bytes: numpy's BLAS picks its kernels by CPU, and GPTQ's
    Cholesky and solves differ in the last bit between an AVX-512 and an AVX2 host (rtn, awq and float builds do
    not)."""
    cpu = platform.processor() or None
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    blas = None
    with contextlib.suppress(Exception):  # numpy's build configuration: its layout changed between releases
        import numpy

        config = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{config.get('name')} {config.get('version')}".strip()
    return {"machine": platform.machine(), "cpu": cpu, "blas": blas}


@contextlib.contextmanager
def staged_folder(final_dir: Path, swap: dict | None = None):
    """Yield an empty temporary folder beside final_dir; on success it replaces final_dir atomically. swap: a dict
    that receives `replaced`, whether an artifact was there to replace when the swap ran (another build's, made
    meanwhile, counts).

    The build holds an exclusive lock (flock) on its temporary folders while it runs. The kernel releases it when
    the process ends, however it ends, so a later build removes what a killed one (SIGKILL, power loss) left
    behind and leaves a running one's alone, whatever the process ids say: builds in two containers that share
    the folder have separate pid spaces, and a container's build gets the same pid every time."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(final_dir)
    with contextlib.ExitStack() as held:
        staging = _locked_folder(final_dir, "partial", held)
        # mkdtemp makes it private; an artifact is shared as its files are. A setgid folder's (a team's) group
        # passes to what is made in it through that bit: kept, as mkdir keeps it
        staging.chmod((0o777 & ~process_umask()) | (staging.stat().st_mode & stat.S_ISGID))
        try:
            yield staging
            sync_to_disk(staging)
            # One build swaps at a time (another may have built the same name meanwhile), and a signal waits until
            # the swap is done: where it takes two renames, the path holds no artifact between them.
            with _swap_lock(final_dir), _signals_deferred():
                if final_dir.exists() and not _replaceable(final_dir):  # made while this build ran
                    raise BuildError(f"{final_dir} appeared during the build and is not an aotlm artifact: it is left "
                                     f"alone and this build's artifact is not written; move it and build again")
                if swap is not None:  # an artifact; an empty folder (which the swap also takes) is none
                    swap["replaced"] = is_artifact_folder(final_dir)
                # (not a link: the exchange would move the link itself, and rmtree leaves a link where it was)
                if final_dir.exists() and not final_dir.is_symlink() and exchange_folders(staging, final_dir):
                    # one atomic step (Linux): the path never lacks an artifact, and the old one, now at the staging
                    # folder's name, goes with it (a build killed before its removal left a .partial that the next
                    # build removes)
                    shutil.rmtree(staging, ignore_errors=True)
                elif final_dir.exists():  # two renames: the old artifact stays whole until the new one is in place
                    retired = _locked_folder(final_dir, "old", held)
                    try:
                        os.replace(final_dir, retired / final_dir.name)
                    except BaseException:
                        shutil.rmtree(retired, ignore_errors=True)
                        raise
                    try:
                        os.replace(staging, final_dir)
                    except BaseException:  # the old artifact goes back
                        os.replace(retired / final_dir.name, final_dir)
                        shutil.rmtree(retired, ignore_errors=True)
                        raise
                    shutil.rmtree(retired, ignore_errors=True)
                else:
                    os.replace(staging, final_dir)
            try:  # the rename itself; the artifact is in place already, so a failure here only warns
                _sync_folder(final_dir.parent)
            except OSError as error:
                warnings.warn(f"{final_dir.parent}: could not flush the folder to disk after the rename ({error}); "
                              f"the artifact is in place", AotlmWarning, stacklevel=3)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


RENAME_EXCHANGE, AT_FDCWD = 2, -100  # linux/fs.h, fcntl.h
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)  # a filesystem or kernel without it


def exchange_folders(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux's renameat2 with RENAME_EXCHANGE, glibc 2.28 and later): True when
    done, False where the system or the filesystem cannot (then staged_folder renames twice, and between the two
    renames the artifact's path is missing: loads during it were refused, 4,029 of 463,873 reads in a review's loop)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without the wrapper (glibc before 2.28, some musl releases)
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    number = ctypes.get_errno()
    if number in _UNSUPPORTED:
        return False
    raise OSError(number, os.strerror(number), str(second))


def _replaceable(folder: Path) -> bool:
    """Whether the swap may replace folder: an artifact, or empty."""
    return is_artifact_folder(folder) or (folder.is_dir() and not any(folder.iterdir()))


@contextlib.contextmanager
def _swap_lock(final_dir: Path):
    """An exclusive lock on final_dir's parent folder for the swap: another build's swap there (of any name: a swap
    takes milliseconds) waits. The folder itself, not a lock file beside the artifacts: nothing is left behind."""
    descriptor = os.open(final_dir.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # a filesystem without locks: as before, unlocked
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _signals_deferred(signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends, then act on the first one as its handler would. Blocking
    them (pthread_sigmask) would not do: Python runs its handlers in the main thread whichever thread the kernel
    picks, and a build has others (progress display, onnxruntime)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    caught: list[int] = []
    previous = {number: signal.signal(number, lambda number, frame: caught.append(number)) for number in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # Python's (KeyboardInterrupt) or the program's own (aotlm's SIGTERM)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


def sync_to_disk(folder: Path) -> None:
    """Flush every file under folder, and the folders, to disk. The rename that publishes an artifact can reach the
    disk before the data the files were written with: after a power loss the artifact would be in place with empty
    or partial files (the manifest's hashes catch that only when a load verifies)."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as handle:
                _fsync(handle.fileno())
        elif path.is_dir() and not path.is_symlink():
            _sync_folder(path)
    _sync_folder(Path(folder))


# fsync errors that mean "this filesystem does not sync that" (some FUSE and network mounts refuse folders), as
# coreutils' sync treats them: nothing more can be done, and the build goes on.
UNSYNCABLE = {errno.EINVAL, errno.EBADF, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EISDIR}


def _fsync(descriptor: int) -> None:
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in UNSYNCABLE:
            raise


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _fsync(descriptor)
    finally:
        os.close(descriptor)


def _locked_folder(final_dir: Path, kind: str, held: contextlib.ExitStack) -> Path:
    """A new `.NAME.KIND-PID-XXXX` folder beside final_dir, locked until `held` closes."""
    return _new_locked_folder(final_dir.parent, f".{final_dir.name}.{kind}-{os.getpid()}-", held)


def _new_locked_folder(parent: Path, prefix: str, held: contextlib.ExitStack) -> Path:
    """A new folder PREFIX-XXXX in parent, locked until `held` closes."""
    for _ in range(100):
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        lock = _try_lock(folder)
        if lock is None:  # another build's cleanup locked it after mkdtemp, and removes it: make another
            continue
        if lock != NO_LOCKS:
            held.callback(os.close, lock)
        return folder
    raise OSError(f"{parent}: 100 new temporary folders could not be locked or were removed at once")


def _try_lock(folder: Path) -> int | None:
    """An open descriptor holding an exclusive lock on folder; None while another process holds one, or when the
    folder is gone (another build removed it meanwhile) or not ours to open; NO_LOCKS on a filesystem without."""
    try:
        descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    except OSError:  # ENOLCK / EOPNOTSUPP
        os.close(descriptor)
        return NO_LOCKS
    if os.fstat(descriptor).st_nlink == 0:  # locked after its remover released it: removed
        os.close(descriptor)
        return None
    return descriptor


def remove_abandoned(final_dir: Path) -> list[Path]:
    """Remove the temporary folders of earlier builds of final_dir that no running build holds; returns them.

    A build stopped between its two renames left the old artifact in `.NAME.old-*/NAME` and nothing at final_dir:
    that artifact is put back first, not removed."""
    removed = []
    for kind in ("partial", "old"):
        # Anchored to the whole name mkdtemp makes: `.a.old-*` also globs the staging folder of a build named
        # `a.old-999-b`.
        pattern = re.compile(rf"\.{re.escape(final_dir.name)}\.{kind}-(\d+)-[a-z0-9_]+")
        for folder in final_dir.parent.glob(f".{final_dir.name}.{kind}-*"):
            match = pattern.fullmatch(folder.name)
            try:  # a staging folder made a moment ago may not be locked yet: another build starting with this one's
                young = kind == "partial" and time.time() - folder.lstat().st_mtime < SCRATCH_GRACE_S  # (mkdtemp,
            except FileNotFoundError:  # then lock) took it for a killed build's; or its build finished meanwhile
                continue
            if not (folder.is_dir() and match) or young:
                continue
            lock = _try_lock(folder)
            # A running build's; without locks, the process id in the name decides (unreliable across containers).
            if lock is None or (lock == NO_LOCKS and _alive(int(match.group(1)))):
                continue
            try:
                if kind == "old" and (folder / final_dir.name).is_dir() and not final_dir.exists():
                    os.replace(folder / final_dir.name, final_dir)
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            finally:
                if lock != NO_LOCKS:
                    os.close(lock)
    return removed


SCRATCH_KINDS = ("trace", "spill", "float", "tensorrt", "calibration")  # a build's folders in TMPDIR
# An unlocked scratch folder younger than this is left alone: a running build makes its folder, then locks it, and a
# cleanup in between took it for a killed build's ("removed ..., left by a build that was killed", of a live one).
SCRATCH_GRACE_S = 10.0


def temporary_folder() -> tuple[Path, str | None]:
    """The folder a build traces its graphs into (TMPDIR, else /tmp, /var/tmp, ...: Python's choice), and a warning
    when it is not the one TMPDIR names (Python passes over an unusable TMPDIR without a word, down to the current
    folder). Raises BuildError, before the model loads, when no folder is writable."""
    try:
        folder = Path(tempfile.gettempdir())
    except FileNotFoundError:  # Python's "No usable temporary directory found in [...]"
        raise BuildError("no writable temporary folder for the traced graphs (TMPDIR, /tmp, /var/tmp, /usr/tmp and the "
                         "current folder were tried): set TMPDIR to a writable folder with room for the model's "
                         "weights") from None
    try:  # torch's exporter and onnxruntime take paths as UTF-8 text: the export failed with torch's argument dump
        str(folder).encode("utf-8")
    except UnicodeEncodeError:
        raise BuildError(f"the temporary folder {str(folder)!a} (TMPDIR) has a path that is not UTF-8 as Python reads "
                         f"it (bytes of another encoding; or any non-ASCII under PYTHONUTF8=0 with a C locale), which "
                         f"the exporter cannot take: rename it, or set TMPDIR to a folder whose path is ASCII"
                         ) from None
    requested = os.environ.get("TMPDIR")
    try:
        same = not requested or Path(requested).resolve() == folder.resolve()
    except (OSError, RuntimeError):  # a link loop (RuntimeError on Python 3.11): not the folder Python took
        same = False
    if not same:
        return folder, (f"TMPDIR={requested} is not a writable folder: the traced graphs (the model's weights once or "
                        f"twice over) go to {folder}")
    if not requested and folder.resolve() == Path.cwd().resolve():
        return folder, (f"no writable /tmp: the traced graphs (the model's weights once or twice over) go to the "
                        f"current folder {folder}; set TMPDIR to choose")
    return folder, None


def check_disk_room(folder: Path, need: int, what: str) -> None:
    """Refuse, before the export, a build whose `what` (need bytes) cannot fit in folder's filesystem: it failed after
    the whole export and passes (minutes for a large model) with an error naming two folders and no sizes."""
    from runtime.onnxruntime_backend import binary_size

    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # not there yet (--output made later), or unreadable: the write says so when it comes
        return
    if free < need:
        raise BuildError(f"{what} need about {binary_size(need)} in {folder}, and {binary_size(free)} are free there: "
                         f"free space, or build on a larger disk (TMPDIR for the traced graphs, --output for the "
                         f"artifact)")


@contextlib.contextmanager
def scratch_folder(kind: str):
    """A new `aotlm-KIND-*` folder in the temporary folder, locked (flock) while the build uses it and removed after.
    A build killed outright (SIGKILL, the OOM killer: no cleanup runs) leaves its traces there, a model's weights
    once or twice over: the next build removes the ones no running build holds (remove_abandoned_scratch)."""
    assert kind in SCRATCH_KINDS, kind
    with contextlib.ExitStack() as held:
        folder = _new_locked_folder(Path(tempfile.gettempdir()), f"aotlm-{kind}-", held)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # before the lock goes: no other build reads it as abandoned


def remove_abandoned_scratch() -> list[Path]:
    """Remove the temporary folder's `aotlm-KIND-*` folders that no running build holds; returns them. Another
    user's are left alone (not ours to remove), and so, on a filesystem without locks, are all."""
    removed = []
    root = Path(tempfile.gettempdir())
    for kind in SCRATCH_KINDS:
        for folder in root.glob(f"aotlm-{kind}-*"):
            try:  # one lstat: a running build may remove its folder between two checks (FileNotFoundError escaped)
                status = folder.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
                continue
            if time.time() - status.st_mtime < SCRATCH_GRACE_S:  # perhaps between a build's mkdtemp and its lock
                continue
            lock = _try_lock(folder)
            if lock is None or lock == NO_LOCKS:  # a running build's, or no way to tell
                continue
            try:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            finally:
                os.close(lock)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def creation_time() -> datetime.datetime:
    """Now, or SOURCE_DATE_EPOCH's time where it is set (reproducible-builds.org's convention: two builds of one
    recipe then write the same `created`; `build_seconds` and each pass's `seconds` still differ). BuildError for a
    value that is not a whole number of seconds, as the convention asks."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        return datetime.datetime.now(datetime.timezone.utc)
    if not re.fullmatch(r"[0-9]{1,12}", epoch.strip()):
        raise BuildError(f"SOURCE_DATE_EPOCH={epoch!r}: give the seconds since 1970 as a whole number (e.g. git log "
                         f"-1 --format=%ct), or unset it")
    try:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
    except (ValueError, OverflowError, OSError):  # past year 9999 (999999999999 is in year 33658)
        raise BuildError(f"SOURCE_DATE_EPOCH={epoch!r}: a time past what a date can hold; give the seconds since 1970 "
                         f"of a real date (e.g. git log -1 --format=%ct), or unset it") from None


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Add format fields, creation time and every file's size + sha256, then write manifest.json."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST_FILE):
        files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    requires = required_features(manifest)
    full = {
        "format": FORMAT,
        # 1 where a runtime that reads only format 1 runs the artifact as it should: those runtimes stay usable
        "format_version": FORMAT_VERSION if requires else 1,
        **({"requires": requires} if requires else {}),
        "created": creation_time().isoformat(timespec="seconds"),
        **manifest,
        "files": files,
    }
    # JSON, strictly: a perplexity past 1e308 is null
    (folder / MANIFEST_FILE).write_text(json_text(full), encoding="utf-8")
    return full
