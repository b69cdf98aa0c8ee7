"""Errors the compiler raises for bad input: the command line prints their message, never a traceback."""


class BuildError(Exception):
    """A build cannot proceed; the message says what is wrong and how to fix it."""


class RecipeError(BuildError):
    """A recipe is missing, malformed or invalid; the message names the key path."""


class UsageError(BuildError):
    """A command-line argument cannot be used as given (e.g. an output path inside a file)."""


def check_output_file(path: str | None, flag: str) -> None:
    """Raise UsageError unless `path` can be written as a file: checked before the work, not after it."""
    import os
    from pathlib import Path

    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name, e.g. {out / 'results.json'}")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a folder; choose another path")
    if not os.access(ancestor, os.W_OK):
        raise UsageError(f"{flag} {path}: {ancestor} is not writable; choose another path")


def check_output_folder(path: str, flag: str) -> None:
    """Raise UsageError unless `path` is, or can be made, a writable folder."""
    import os
    from pathlib import Path

    folder = Path(path)
    ancestor = folder
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is a file, not a folder; choose another path")
    if not os.access(ancestor, os.W_OK):
        raise UsageError(f"{flag} {path}: {ancestor} is not writable; choose another path")
