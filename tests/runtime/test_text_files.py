"""runtime/text_files.py: a user's text file read one way (eval's --text, calibration.text, bench's --prompt-file)."""
from __future__ import annotations

import codecs

import pytest

from runtime.text_files import READ_CHARACTERS, TextFile, TextFileError, read_text_file, text_problem


def test_a_prefix_reads_only_as_far_as_asked_and_a_bad_byte_beyond_it_is_not_reached(tmp_path):
    """Scoring 4,096 tokens of a 200 MB file read all of it (430 MB resident; 1 GB with an emoji in its first line),
    and one bad byte anywhere refused the whole file."""
    path = tmp_path / "corpus.txt"
    path.write_bytes("é".encode() + b"x" * (8 * READ_CHARACTERS) + b"\n\xff")
    text = TextFile(path)
    assert text.prefix(100) == ("é" + "x" * 99, False)
    assert len(text.text_read) <= READ_CHARACTERS + 1  # one read, not the file
    assert text.prefix(3 * READ_CHARACTERS)[0] == "é" + "x" * (3 * READ_CHARACTERS - 1)
    with pytest.raises(TextFileError, match=rf"{path}: the byte at offset {8 * READ_CHARACTERS + 3} \(line 2, byte 1 of the line\) "
                                            r"is 0xff: not UTF-8"):
        text.read_all()


def test_a_short_file_is_whole_and_drops_its_byte_order_mark_and_keeps_crlf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(codecs.BOM_UTF8 + b"one\r\ntwo\r\n")
    assert TextFile(path).prefix(9) == ("one\r\ntwo\r", False)  # one character more follows
    assert TextFile(path).prefix(10) == ("one\r\ntwo\r\n", True)
    assert read_text_file(path) == "one\r\ntwo\r\n"


@pytest.mark.parametrize("content, place", [
    (codecs.BOM_UTF8 + b"hello\nwor\xe9ld\n", r"offset 12 \(line 2, byte 4 of the line\) is 0xe9"),
    (b"abc\xe2\x82", r"offset 3 \(line 1, byte 4 of the line\) is 0xe2"),  # cut inside a character at the end
    ("a" * (1 << 20) + "\né" + "b" * 10, None),  # read whole: no error
    (b"x\n" * 600_000 + b"ab\xff", r"offset 1200002 \(line 600001, byte 3 of the line\) is 0xff"),  # past 1 MiB
])
def test_where_a_file_stops_being_utf8(tmp_path, content, place):
    """By its byte in the file, line and byte of the line: the decoder's position counted from after the byte-order
    mark, inside its last chunk ("position 9" for the file's byte 12)."""
    path = tmp_path / "text.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if place is None:
        assert read_text_file(path).endswith("éb" + "b" * 9)
        return
    with pytest.raises(TextFileError, match=rf"{path}: the byte at {place}: not UTF-8; convert the file to UTF-8"):
        read_text_file(path)


def test_a_utf16_file_is_said_to_be_one(tmp_path):
    with_mark, without_mark = tmp_path / "marked.txt", tmp_path / "unmarked.txt"
    with_mark.write_bytes(codecs.BOM_UTF16_LE + "The lighthouse keeper.\n".encode("utf-16-le"))
    marked_big_endian = tmp_path / "marked-be.txt"
    marked_big_endian.write_bytes(codecs.BOM_UTF16_BE + "The lighthouse keeper.\n".encode("utf-16-be"))
    with pytest.raises(TextFileError, match=r"it is UTF-16 \(it begins with UTF-16's byte-order mark\)"):
        read_text_file(marked_big_endian)
    without_mark.write_bytes(("The lighthouse keeper lit the lamp.\n" * 20).encode("utf-16-le"))
    with pytest.raises(TextFileError, match=r"marked.txt: it is UTF-16 \(it begins with UTF-16's byte-order mark\), "
                                            r"not UTF-8; save it as UTF-8, e.g. iconv -f UTF-16 -t UTF-8"):
        read_text_file(with_mark)
    assert text_problem(read_text_file(without_mark)).startswith("looks like UTF-16LE without a byte-order mark")
    big_endian = tmp_path / "big-endian.txt"  # its zero bytes come first: iconv -f UTF-16LE made 栀攀氀氀漀 of it
    big_endian.write_bytes(("The lighthouse keeper lit the lamp.\n" * 20).encode("utf-16-be"))
    assert text_problem(read_text_file(big_endian)).endswith("iconv -f UTF-16BE -t UTF-8")


@pytest.mark.parametrize("text, problem", [
    ("\0" * 1000, "looks binary (1,000 of its 1,000 characters are control characters such as NUL)"),
    ("text " * 1000 + "\x07" * 100, "looks binary"),
    ("text " * 1000 + "\x07" * 10, None),  # a few control characters in real text
    ("Grüße, 世界\r\n\t\f", None),
])
def test_text_problem(text, problem):
    found = text_problem(text)
    assert (found is None) if problem is None else found.startswith(problem)


def test_a_folder_or_a_device_is_refused_unread(tmp_path):
    for path in (tmp_path, "/dev/zero"):
        with pytest.raises(TextFileError, match="is not a regular file"):
            TextFile(path, "--text x")
    with pytest.raises(FileNotFoundError):
        TextFile(tmp_path / "missing.txt")


def test_a_file_read_in_part_is_closed_by_close_or_a_with_block(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("word " * 100_000)
    with TextFile(path) as text:
        assert text.prefix(10) == ("word word ", False)
    assert text._handle.closed and text.text_read.startswith("word word ")
