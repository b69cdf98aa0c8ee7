"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout (a
command whose table is its output, `aotlm inspect`, prints it to stdout itself).

A message (an error, a warning, a log or timing line) prints through `message`, `warning` or `error`, one line each:
piped or logged, stderr is 80 columns to rich, which would cut a long line, and a path inside it, with a newline
(soft_wrap keeps it whole; a terminal wraps it for the eye instead); and numbers are not recoloured. Text that comes
from a user, a file or an exception is not markup: `warning` and `error` escape theirs, and a `message` escapes what
it puts inside its own markup (a file named model[v2].gguf would otherwise print as model.gguf)."""
import errno

from rich.console import Console
from rich.markup import escape

class ReaderAwareConsole(Console):
    """rich's console, but a reader that left is not "exit with status 1 and point stdout at /dev/null" (rich's
    answer, whichever stream it was): stderr's notices go nowhere from then on (a `2>&1 | tee` that Ctrl-C ended
    first), and stdout's output ends as any writer's into a closed pipe does (cli.main: status 141)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        if not self.stderr:
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout left")


console = ReaderAwareConsole(stderr=True, emoji=False)  # ":x:" in a user's path is text, not an emoji code


def message(markup: str, out: Console = console) -> None:
    """One line of rich markup, kept whole however narrow the console (out: stdout's, for a command whose report
    is its output). A console whose reader is gone (`2>&1 | tee` ended by the same Ctrl-C, a terminal hung up) drops
    it: a notice must not turn a clean stop into a traceback, nor `aotlm serve`'s drain into cut requests."""
    try:
        out.print(markup, highlight=False, soft_wrap=True)
    except OSError:
        pass


def warning(text: str, out: Console = console) -> None:
    message(f"[yellow]warning:[/yellow] {escape(text)}", out)


def error(text: str) -> None:
    message(f"[red]error:[/red] {escape(text)}")
