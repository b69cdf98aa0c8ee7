"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout (a
command whose table is its output, `aotlm inspect`, prints it to stdout itself).

A message (an error, a warning, a log or timing line) prints through `message`, `warning` or `error`, one line each:
piped or logged, stderr is 80 columns to rich, which would cut a long line, and a path inside it, with a newline
(soft_wrap keeps it whole; a terminal wraps it for the eye instead); and numbers are not recoloured. Text that comes
from a user, a file or an exception is not markup: `warning` and `error` escape theirs, and a `message` escapes what
it puts inside its own markup (a file named model[v2].gguf would otherwise print as model.gguf)."""
from rich.console import Console
from rich.markup import escape

console = Console(stderr=True, emoji=False)  # ":x:" in a user's path is text, not an emoji code


def message(markup: str, out: Console = console) -> None:
    """One line of rich markup, kept whole however narrow the console (out: stdout's, for a command whose report
    is its output)."""
    out.print(markup, highlight=False, soft_wrap=True)


def warning(text: str, out: Console = console) -> None:
    message(f"[yellow]warning:[/yellow] {escape(text)}", out)


def error(text: str) -> None:
    message(f"[red]error:[/red] {escape(text)}")
