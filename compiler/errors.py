"""Errors the compiler raises for bad input: the command line prints their message, never a traceback."""
import argparse
import codecs
import os
import sys
import tempfile
from pathlib import Path


class BuildError(Exception):
    """A build cannot proceed; the message says what is wrong and how to fix it."""


class RecipeError(BuildError):
    """A recipe is missing, malformed or invalid; the message names the key path."""


class UsageError(BuildError):
    """A command-line argument cannot be used as given (e.g. an output path inside a file)."""


def check_output_file(path: str | None, flag: str) -> None:
    """Raise UsageError unless `path` can be written as a file: checked before the work, not after it."""
    if not path:
        return
    from runtime.results import is_stream, own_descriptor

    if is_stream(path):  # "-", /dev/stdout, a pipe: written into (runtime/results.py: write_json)
        # not opened here (a pipe's reader would see its end); /dev/fd/3 without the shell's `3>` was found only
        # after the whole run, as a traceback
        descriptor = None if path == "-" else own_descriptor(path)
        if descriptor is not None:  # written through a copy of it: what counts is how it is open, not the file
            try:
                import fcntl

                mode = fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE
            except ImportError:  # no fcntl (Windows): the write will say
                return
            except OSError:
                mode = None
            if mode is None:
                raise UsageError(f"{flag} {path}: no such stream (descriptor {descriptor} is not open: a /dev/fd/N is "
                                 f"one the shell opened, e.g. `3> results.json`); open it, or give a file name")
            if mode == os.O_RDONLY:
                raise UsageError(f"{flag} {path}: descriptor {descriptor} is open for reading only (`<`); open it "
                                 f"for writing (`{descriptor}>`), or give a file name")
            return
        if path != "-" and not os.path.exists(path):  # another process's descriptor, closed since
            raise UsageError(f"{flag} {path}: no such file or stream; give a file name")
        if path != "-" and not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: not writable by this user; give another file")
        return
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name, e.g. {Path(path) / 'results.json'}")
    artifact = next((folder for folder in Path(path).resolve().parents if is_artifact_folder(folder)), None)
    if artifact is not None:  # its manifest lists every file: another one there makes the runtime refuse it
        raise UsageError(f"{flag} {path}: inside the artifact folder {artifact}, which must hold only what its "
                         f"manifest lists; write it elsewhere")
    _check_writable_ancestor(Path(path).parent, path, flag)


def is_artifact_folder(folder: Path) -> bool:
    """An aotlm artifact folder: its manifest.json begins with the artifact format (the build writes it first)."""
    try:
        with open(folder / "manifest.json", "rb") as manifest:
            return b'"aotlm-artifact"' in manifest.read(256)
    except OSError:
        return False


def check_output_folder(path: str, flag: str) -> None:
    """Raise UsageError unless `path` is, or can be made, a writable folder."""
    try:
        _check_writable_ancestor(Path(path), path, flag)
    except OSError as error:  # a name longer than the file system takes: even asking whether it exists fails
        raise UsageError(f"{flag} {path}: {error.strerror or error}; choose another path") from None


def _check_writable_ancestor(folder, path: str, flag: str) -> None:
    """The nearest existing folder at or above `folder` must be a writable folder (the rest gets created)."""
    ancestor = folder
    while not ancestor.exists():
        if ancestor.is_symlink():  # mkdir would fail on it after the whole export
            raise UsageError(f"{flag} {path}: {ancestor} is a link to {os.readlink(ancestor)}, which leads to no "
                             f"folder (it does not exist, or the links form a loop); mount or create its target, or "
                             f"choose another path")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a folder; choose another path")
    if not os.access(ancestor, os.W_OK):
        raise UsageError(f"{flag} {path}: {ancestor} is not writable; choose another path")
    try:  # what the permission bits do not tell (/proc takes no folders, even from root): one made and removed
        probe = tempfile.mkdtemp(prefix=".aotlm-probe-", dir=ancestor)
    except OSError as error:
        raise UsageError(f"{flag} {path}: a folder cannot be made in {ancestor} ({error.strerror or error}); choose "
                         f"another path") from None
    os.rmdir(probe)  # made empty a moment ago by this process


def text_argument(text: str) -> str:
    """An argparse type for text a model reads (a prompt, a stop string, a name), not a path: under an ASCII locale
    with Python's UTF-8 mode off (PYTHONUTF8=0 LC_ALL=C) Python read its bytes as ASCII, and a UTF-8 prompt ("灯塔")
    was refused as bytes that were not UTF-8. Paths keep Python's reading, which the file system functions expect.
    Bytes that are not UTF-8 stay lone surrogates, refused by name later."""
    if codecs.lookup(sys.getfilesystemencoding()).name != "ascii":
        return text
    try:
        return text.encode("ascii", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return text


def user_path(text: str) -> str:
    """An argparse type for a path: a leading ~ or ~user is the home folder, as the shell expands it in `--out ~/x`
    but not in `--out=~/x` (which would make a folder named ~ here)."""
    return os.path.expanduser(text)


def whole_number(text: str) -> int:
    """int(text), or argparse's error in words: a ValueError made argparse print the type function's own name
    ("invalid nonnegative_int value: 'abc'")."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def number(text: str) -> float:
    """float(text), or argparse's error in words (as whole_number)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = whole_number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def thread_count(text: str) -> int:
    """An argparse type: intra-op threads, 0 (the default) up to the CPUs this process may use (its affinity and
    container limit, runtime/cpus.py). More threads than those only contend (each spins on a CPU while a run lasts:
    twice as slow per token on one CPU); thousands hang the process."""
    from runtime.cpus import cpus, restriction, usable_cpus

    value = nonnegative_int(text)
    cores = usable_cpus()
    if value > cores:
        raise argparse.ArgumentTypeError(f"{value} is more than the {cpus(cores)} this process may use"
                                         f"{restriction()}; give at most {cores}, or 0 for the default")
    return value


# --no-spin (run, chat, serve, bench, eval, compare): Engine.load(spin_during_run=False)
NO_SPIN_HELP = ("onnxruntime's threads sleep while they wait, during runs too, instead of spinning: for a host whose "
                "cores other processes use (TPOT 0.68x beside one busy core of 2; served tokens/s 0.94-1.01x when "
                "idle)")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = number(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def exception_chain(exception: BaseException):
    """The exception and the ones it was raised from or while handling, once each."""
    seen = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        yield exception
        exception = exception.__cause__ or exception.__context__
