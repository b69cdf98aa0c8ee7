"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout (a
command whose table is its output, `aotlm inspect`, prints it to stdout itself)."""
from rich.console import Console

console = Console(stderr=True)
