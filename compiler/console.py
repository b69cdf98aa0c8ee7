"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout."""
from rich.console import Console

console = Console(stderr=True)
