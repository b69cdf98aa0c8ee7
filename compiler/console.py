"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout (a
command whose table is its output, `aotlm inspect`, prints it to stdout itself).

A message (an error, a warning, a log or timing line) prints with soft_wrap=True: piped or logged, stderr is 80 columns
to rich, which would cut a long line, and a path inside it, with a newline; a terminal wraps it for the eye instead."""
from rich.console import Console

console = Console(stderr=True)
