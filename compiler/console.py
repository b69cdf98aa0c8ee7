"""The command line's console: progress, tables and errors on stderr, so generated text alone goes to stdout (a
command whose table is its output, `aotlm inspect`, prints it to stdout itself).

A message (an error, a warning, a log or timing line) prints through `message`, `warning` or `error`, one line each:
piped or logged, stderr is 80 columns to rich, which would cut a long line, and a path inside it, with a newline
(soft_wrap keeps it whole; a terminal wraps it for the eye instead); and numbers are not recoloured. Text that comes
from a user, a file or an exception is not markup: `warning` and `error` escape theirs, and a `message` escapes what
it puts inside its own markup (a file named model[v2].gguf would otherwise print as model.gguf)."""
import errno
import io
import os
import sys

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


class _WholeWrites(io.RawIOBase):
    """stdout's file layer, writing all it is given or raising. Under PYTHONUNBUFFERED (python -u, set in many Docker
    images) Python's own stdout writes to the file directly and drops what a short write left (cpython#85393):
    `aotlm inspect --json > file` on a full disk wrote 4096 of 23978 bytes and exited 0."""

    def __init__(self, descriptor: int) -> None:
        super().__init__()
        self._descriptor = descriptor

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._descriptor

    def isatty(self) -> bool:
        return os.isatty(self._descriptor)

    def write(self, data) -> int:
        view = whole = memoryview(data).cast("B")
        try:
            while view:
                view = view[os.write(self._descriptor, view):]  # a full disk's next write raises ENOSPC
        except OSError as problem:
            if problem.errno in FULL:  # the error line says which write the disk refused
                problem.filename = problem.filename or "standard output"
            raise
        return whole.nbytes


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_replaced = []


def whole_writes_to_stdout() -> None:
    """Put stdout's writes through _WholeWrites: unbuffered (PYTHONUNBUFFERED), Python's stdout dropped what a short
    write left; buffered, it writes on until all is written, but its error names no file."""
    stdout = sys.stdout
    layer = getattr(stdout, "buffer", None)
    unbuffered = type(layer) is io.FileIO
    if not unbuffered and type(getattr(layer, "raw", None)) is not io.FileIO:  # no file (a test's capture)
        return
    stdout.flush()
    _replaced.append(stdout)  # kept: collected, it would close the descriptor
    raw = _WholeWrites(stdout.fileno())
    sys.stdout = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=stdout.encoding,
                                  errors=stdout.errors, line_buffering=stdout.line_buffering, write_through=unbuffered)


# ":x:" in a user's path is text, not an emoji code. Not interactive unless stderr is a terminal: FORCE_COLOR (set in
# many CI setups for coloured logs) made rich animate its spinners and bars into the log file, frame by frame
# (53 frames for a 2-second build); TTY_INTERACTIVE, where set, decides (rich reads it).
console = ReaderAwareConsole(stderr=True, emoji=False,
                             force_interactive=None if "TTY_INTERACTIVE" in os.environ or (
                                 sys.stderr is not None and sys.stderr.isatty()) else False)  # None: closed (2>&-)


def print_table(table, out: Console = console) -> None:
    """A table whole: rich cuts a cell that does not fit the console with "…" (an E2E of 24289.5 ms read "24289.…",
    a name its distinguishing end), in a pipe's 80 columns or a narrow terminal. It is drawn at the console's width
    where rich gives every column room for its longest word there, else at the least width where it does (a terminal
    wraps the lines for the eye; no digit is lost, and `grep NAME` finds a name whole), and a column rich still gives
    less room than a word needs folds it onto the next line instead of cutting it."""
    for column in table.columns:
        if column.overflow == "ellipsis":
            column.overflow = "fold"
    given = [column.width for column in table.columns]  # _least_whole_width may fix them: the caller's table back
    given_least = table.min_width
    least = _least_whole_width(table, out)
    width = out._width  # the console's own (None: the terminal's), widened for this table only: the same console,
    # so that a capture (inspect prints all or nothing) and the order of its output hold
    try:
        if least > out.width:
            out.width = least
        out.print(table)
    except OSError:  # a reader that left (as message); stdout's table is the command's output: its failure counts
        if not out.stderr:
            raise
    finally:
        out._width = width
        for column, fixed in zip(table.columns, given):
            column.width = fixed
        table.min_width = given_least


def _least_whole_width(table, out: Console) -> int:
    """The width to draw `table` at: the console's, or the least that holds every column's longest word. Where rich
    would take room from a column past its longest word (it takes from the widest columns, words or not: a name
    folded mid-word, "tiny-random-int8-rtn-pa" / "cked", where the table fit the console), each column gets a fixed
    width: its widest line, less what the room lacks, taken a cell at a time from the column with the most to spare
    above its longest word."""
    def shown(column):  # the header and footer only where drawn
        return [*([column.header] if table.show_header else []), *([column.footer] if table.show_footer else []),
                *column.cells]

    widest = [max([_widest_line(out, cell) for cell in shown(column)], default=0) for column in table.columns]
    words = [line if column.no_wrap else max([_longest_word(out, cell) for cell in shown(column)], default=0)
             for column, line in zip(table.columns, widest)]  # a no_wrap column's lines are its words
    widest = [min(line, column.max_width) if column.max_width else line for column, line in zip(table.columns, widest)]
    words = [min(word, column.max_width) if column.max_width else word for column, word in zip(table.columns, words)]
    try:  # rich's own count of the cells around the columns' text (private): padding, borders
        edges = sum(map(table._get_padding_width, range(len(table.columns)))) + table._extra_width
    except AttributeError:  # a rich without them: a boxed table's
        edges = (table.padding[1] + table.padding[3] + 1) * len(table.columns) + 1
    # rich wraps a title to the table's width: a path in one folded mid-word, so the table is as wide as its words
    titles = max(_longest_word(out, table.title or ""), _longest_word(out, table.caption or ""))
    if titles > (table.min_width or 0):
        table.min_width = titles
    room = max(out.width, sum(words) + edges, titles)
    if sum(widest) + edges <= room:  # it fits as it is: rich wraps nothing
        return room
    widths = [max(line, word) for line, word in zip(widest, words)]
    for _ in range(sum(widths) + edges - room):
        spare = [width - word for width, word in zip(widths, words)]
        widths[spare.index(max(spare))] -= 1
    for column, width in zip(table.columns, widths):
        column.width = width
    return room


def _widest_line(out: Console, cell) -> int:
    """The widest line of a table cell as rich draws it unwrapped, in terminal cells."""
    from rich.cells import cell_len
    from rich.text import Text

    if isinstance(cell, (str, Text)):
        text = cell.plain if isinstance(cell, Text) else out.render_str(cell).plain
        return max((cell_len(line) for line in text.splitlines()), default=0)
    return out.measure(cell, options=out.options.update_width(10_000)).maximum


def _longest_word(out: Console, cell) -> int:
    """The widest whitespace-separated word of a table cell's text, in terminal cells (0 for other renderables)."""
    from rich.cells import cell_len
    from rich.text import Text

    text = cell.plain if isinstance(cell, Text) else out.render_str(cell).plain if isinstance(cell, str) else ""
    return max((cell_len(word) for word in text.split()), default=0)


def message(markup: str, out: Console = console) -> None:
    """One line of rich markup, kept whole however narrow the console (out: stdout's, for a command whose report
    is its output). A console whose reader is gone (`2>&1 | tee` ended by the same Ctrl-C, a terminal hung up) drops
    it: a notice must not turn a clean stop into a traceback, nor `aotlm serve`'s drain into cut requests. stdout's
    line is output: a full disk or a closed pipe there is the command's failure (status 2, 141), not a 0."""
    try:
        out.print(markup, highlight=False, soft_wrap=True)
    except OSError:
        if not out.stderr:
            raise


def warning(text: str, out: Console = console) -> None:
    message(f"[yellow]warning:[/yellow] {escape(text)}", out)


def error(text: str) -> None:
    message(f"[red]error:[/red] {escape(text)}")
