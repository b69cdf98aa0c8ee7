"""A user's text file, read one way everywhere: `aotlm eval`/`compare --text`, a recipe's calibration.text and
`aotlm bench --prompt-file`.

UTF-8, a leading byte-order mark dropped, line ends as written (CRLF is scored as CRLF). A FIFO or a device is
refused unread (a FIFO hung for ever, /dev/zero was read until memory ran out). `TextFile.prefix` reads only as far
as asked: scoring 4,096 tokens of a 2 GB corpus read all of it (10 GB resident for a file whose first line held an
emoji, which makes Python keep 4 bytes a character), and a bad byte far past the scored part refused the file.
A byte that is not UTF-8 is named by its offset in the file, line and column, and a UTF-16 file is said to be one;
`text_problem` tells a file that decodes but is not text (UTF-16 without a byte-order mark, zeros).
"""
from __future__ import annotations

import codecs
import os
import re

READ_CHARACTERS = 1 << 16  # the smallest read: prefixes grow by doubling, a few reads each
CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")  # Unicode's Cc, but tab, newlines, form feed
CONTROL_CHARACTERS_MAX_SHARE = 0.01  # more, and a text is taken for binary
UTF16_MARKS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class TextFileError(ValueError):
    """A text file that cannot be read as UTF-8 text; the message names the file (as its label says) and why."""


class TextFile:
    """A UTF-8 text file read from its start, as far as `prefix` is asked to (`read_all`: the whole of it).
    label: how messages name it (e.g. "--text notes.txt"). OSError (a missing file: FileNotFoundError) when it cannot
    be opened, TextFileError when it is not a regular file or not UTF-8."""

    def __init__(self, path, label: str | None = None):
        self.path = os.fspath(path)
        self.label = label or self.path
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            raise TextFileError(f"{self.label} is not a regular file (a folder, a FIFO or a device); give a text file")
        self._handle = open(self.path, encoding="utf-8-sig", newline="")
        self._read = ""  # the text so far
        self.complete = False  # the whole file is in self._read

    def prefix(self, characters: int) -> tuple[str, bool]:
        """(its first `characters` characters, or all of it if it has fewer; whether that is the whole file)."""
        while not self.complete and len(self._read) <= characters:  # one more than asked tells whether more follow
            try:
                part = self._handle.read(max(READ_CHARACTERS, characters + 1 - len(self._read)))
            except UnicodeDecodeError:
                self._close()
                raise TextFileError(f"{self.label}: {not_utf8(self.path)}") from None
            self._read += part
            if not part:
                self._close()
        return self._read[:characters], self.complete and characters >= len(self._read)

    def read_all(self) -> str:
        while not self.complete:
            self.prefix(2 * max(len(self._read), READ_CHARACTERS))
        return self._read

    @property
    def text_read(self) -> str:
        """What has been read so far (to check it is text: text_problem)."""
        return self._read

    def _close(self) -> None:
        self.complete = True
        self._handle.close()

    def close(self) -> None:
        """Let go of the file, read or not (a prefix read leaves it open: `with TextFile(...) as text:`)."""
        self._handle.close()

    def __enter__(self) -> "TextFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()


def text_prefix(text: "str | TextFile", characters: int) -> tuple[str, bool]:
    """(the first `characters` characters of a str or a TextFile, whether that is all of it)."""
    if isinstance(text, TextFile):
        return text.prefix(characters)
    return text[:characters], characters >= len(text)


def read_text_file(path, label: str | None = None) -> str:
    """The whole of a text file, read as TextFile reads it."""
    return TextFile(path, label).read_all()


def not_utf8(path) -> str:
    """Where a file stops being UTF-8, as "the byte at offset N (line L, byte C of the line) is 0xBB: not UTF-8;
    ...", found by reading it again in binary (a text reader's error gives a position inside its last chunk, after
    the byte-order mark)."""
    with open(path, "rb") as stream:
        if stream.read(2) in UTF16_MARKS:
            return ("it is UTF-16 (it begins with UTF-16's byte-order mark), not UTF-8; save it as UTF-8, e.g. "
                    f"iconv -f UTF-16 -t UTF-8 {os.fspath(path)} > converted.txt")
        stream.seek(0)
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, lines, line_start = 0, 0, 0  # bytes decoded, newlines among them, where the last line began
        while True:
            chunk = stream.read(1 << 20)
            held = decoder.getstate()[0]  # the last chunk's unfinished character, decoded again with this one
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                data, start = error.object, offset - len(held)  # data[0] is byte `start` of the file
                before = data[:error.start]
                if b"\n" in before:
                    lines, line_start = lines + before.count(b"\n"), start + before.rfind(b"\n") + 1
                bad = start + error.start
                what = f"0x{data[error.start]:02x}" if error.start < len(data) else "the end of the file"
                return (f"the byte at offset {bad} (line {lines + 1}, byte {bad - line_start + 1} of the line) is "
                        f"{what}: not UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 -t UTF-8)")
            if not chunk:
                return "it is UTF-8 now (it changed while being read?)"
            if b"\n" in chunk:
                lines, line_start = lines + chunk.count(b"\n"), offset + chunk.rfind(b"\n") + 1
            offset += len(chunk)


def text_problem(text: str) -> str | None:
    """Why a decoded text is not text, or None: mostly control characters (zeros; UTF-16 without a byte-order mark,
    whose ASCII reads as every other character NUL)."""
    control = CONTROL_CHARACTERS.subn("", text)[1]
    if control <= CONTROL_CHARACTERS_MAX_SHARE * len(text):
        return None
    nul_odd, nul_even = text[1::2].count("\0"), text[0::2].count("\0")
    if max(nul_odd, nul_even) > 0.4 * len(text) / 2 and min(nul_odd, nul_even) < 0.1 * len(text) / 2:
        order = "LE" if nul_odd > nul_even else "BE"  # ASCII's zero byte after it (little-endian) or before it
        return (f"looks like UTF-16{order} without a byte-order mark (every other character is NUL); convert it to "
                f"UTF-8, e.g. iconv -f UTF-16{order} -t UTF-8")
    return (f"looks binary ({control:,} of its {len(text):,} characters are control characters such as NUL); give a "
            f"UTF-8 text file")
