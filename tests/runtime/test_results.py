"""runtime/results.py: a request's timings as reported (milliseconds, rates), when a request counts as received, and
result files written whole or not at all. Synthetic traces with binary-exact times (tests/runtime/test_metrics.py)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from runtime.errors import RequestError
from runtime.results import Timings, received_at, write_json
from tests.runtime.test_metrics import FIVE, trace


def test_a_requests_summary_is_in_milliseconds_and_tokens_per_second():
    timings = Timings(trace(**FIVE, cached_prompt_tokens=6))
    assert timings.token_times_s == [1.0, 1.5, 1.75, 2.25, 3.0]  # since arrival (10.0)
    assert timings.summary() == {
        "prompt_tokens": 8, "output_tokens": 5, "ttft_ms": 1000.0, "prefill_ms": 500.0, "tpot_ms": 500.0,
        "e2e_ms": 3000.0, "queue_ms": 250.0, "decode_tokens_per_s": 2.0,  # 1 / tpot
        "prefill_tokens_per_s": 4.0,  # the 2 tokens computed in 0.5 s
        "cached_prompt_tokens": 6,
    }


def test_a_prefill_that_took_no_time_reports_no_rate_rather_than_none():
    instant = Timings(trace(0.0, 0.0, [0.0], finish=0.0, prefill_end=0.0))
    assert instant.prefill_tokens_per_s == 0.0 and instant.tokens_per_s == 0.0 and instant.tpot_s == 0.0


@pytest.mark.parametrize("arrival, now, received", [
    (None, 7.5, 7.5), (5.0, 7.5, 5.0), (5, 7.5, 5.0),
    (8.25, 7.5, 7.5),  # a reading another thread took just after the call: not a negative queueing time
])
def test_a_request_is_received_at_its_arrival_if_that_is_not_later_than_now(arrival, now, received):
    got = received_at(arrival, now)
    assert got == received and isinstance(got, float)


@pytest.mark.parametrize("arrival", [math.nan, math.inf, -math.inf, "7.5", True, [7.5]])
def test_an_arrival_that_is_not_a_finite_reading_is_refused(arrival):
    with pytest.raises(RequestError, match=r"arrival: .* must be a finite time\.perf_counter\(\) reading"):
        received_at(arrival, 7.5)


@pytest.mark.parametrize("arrival", [0.0, -5.0, 0])
def test_an_arrival_at_or_before_the_clocks_start_is_refused(arrival):
    """0.0 (an "unset" placeholder) gave a TTFT of the machine's uptime, 59238 s."""
    with pytest.raises(RequestError, match=r"is no time.perf_counter\(\) reading .* or None for now"):
        received_at(arrival, 7.5)


def test_an_arrival_from_another_clock_is_refused():
    """time.time() (seconds since 1970) was taken as "now": TTFT lost the queueing time without a word."""
    with pytest.raises(RequestError, match=r"arrival: 1765000000.0 is 1,764,999,993 s after time.perf_counter\(\) "
                                           r"now; give a time.perf_counter\(\) reading \(time.time\(\) is another"):
        received_at(1765000000.0, 7.0)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_results_are_written_whole_into_a_new_folder_as_the_umask_says(tmp_path, umask, mode):
    """Readable by others as any file the user writes, and private under umask 077 (it was 644 whatever the umask)."""
    before = os.umask(umask)
    try:
        path = write_json(tmp_path / "new" / "results.json", {"rows": [1, 2], "name": "x"})
    finally:
        os.umask(before)
    assert path == tmp_path / "new" / "results.json"
    assert path.read_text() == '{\n  "rows": [\n    1,\n    2\n  ],\n  "name": "x"\n}\n'
    assert path.stat().st_mode & 0o777 == mode
    assert [p.name for p in path.parent.iterdir()] == ["results.json"]  # the temporary file renamed, not copied


def test_a_payload_that_cannot_be_written_leaves_the_old_file_and_no_partial_one(tmp_path):
    path = write_json(tmp_path / "results.json", {"run": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"run": 2, "tokens": {1, 2}})  # a set: json.dumps refuses it
    assert json.loads(path.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_json_to_a_stream_is_written_into_it_not_renamed_over_it(tmp_path, capsys):
    """write_json renamed a temporary file over the path: --json /dev/stdout (as root) made /dev/stdout a file of JSON
    for every process of the container, a link to /proc/self/fd/1 became a file, and `--json >(jq .)` failed."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "stdout-like"
    link.symlink_to(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    assert write_json(link, {"a": 1}) == link
    reader.join(timeout=10)
    assert json.loads(received[0]) == {"a": 1} and link.is_symlink() and fifo.is_fifo()
    assert write_json("-", {"b": 2}).name == "-" and json.loads(capsys.readouterr().out) == {"b": 2}


@pytest.mark.parametrize("path", ["-", "/dev/stdout", "/dev/null"])
def test_a_stream_is_a_valid_output_path(path, tmp_path):
    """A stream is written into (check_output_file lets it through: /dev/fd had been "a folder that cannot be made"
    for a shell's >(jq .)); a regular file, or a link to one outside /dev and /proc, is replaced."""
    from compiler.errors import check_output_file
    from runtime.results import is_stream

    check_output_file(path, "--json")
    assert is_stream(path)
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "file.json")
    assert not is_stream(tmp_path / "file.json") and not is_stream(tmp_path / "link.json")


def test_a_file_under_dev_is_a_file_and_a_socket_descriptor_is_written_through_a_copy():
    """Any path under /dev counted as a stream: a new /dev/shm file was refused ("no such file or stream"), an old one
    appended to (two runs: invalid JSON). And a socket as stdout (systemd's journal) could not be opened by its
    /dev/stdout path: ENXIO after the whole run."""
    import socket
    import uuid

    from compiler.errors import check_output_file
    from runtime.results import is_stream

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = shm / f"aotlm-test-{uuid.uuid4().hex}.json"
    try:
        assert not is_stream(path)
        check_output_file(str(path), "--json")
        write_json(path, {"a": 1})
        write_json(path, {"a": 2})
        assert json.loads(path.read_text()) == {"a": 2}
    finally:
        path.unlink(missing_ok=True)

    ours, theirs = socket.socketpair()
    descriptor = os.dup(ours.fileno())
    try:
        assert is_stream(f"/dev/fd/{descriptor}") and is_stream(f"/proc/self/fd/{descriptor}")
        write_json(f"/dev/fd/{descriptor}", {"b": 3})
        theirs.settimeout(10)
        assert json.loads(theirs.recv(1 << 16)) == {"b": 3}
    finally:
        os.close(descriptor)
        ours.close()
        theirs.close()


def test_a_stream_that_is_not_open_is_refused_before_the_work(capsys, tiny_artifact):
    """--json /dev/fd/3 without the shell's `3>`: the whole evaluation ran, then a FileNotFoundError traceback."""
    from compiler import cli
    from compiler.errors import UsageError, check_output_file

    closed = 97
    with pytest.raises(OSError):
        os.fstat(closed)
    with pytest.raises(UsageError, match="/dev/fd/97: no such stream .*e.g. `3> results.json`"):
        check_output_file(f"/dev/fd/{closed}", "--json")
    assert cli.main(["eval", str(tiny_artifact), "--json", f"/dev/fd/{closed}", "--text", "builtin:pydoc-held-out"]) == 2
    assert "no such stream" in capsys.readouterr().err
    # written through a copy of the descriptor: how it is open counts (read-only: EBADF after the whole run), not
    # whether the file behind it is writable by this user
    reader, writer = os.pipe()
    try:
        with pytest.raises(UsageError, match=f"descriptor {reader} is open for reading only"):
            check_output_file(f"/dev/fd/{reader}", "--json")
        check_output_file(f"/proc/self/fd/{writer}", "--json")
    finally:
        os.close(reader)
        os.close(writer)


def test_json_to_stdout_redirected_to_a_file_is_appended_through_the_link(tmp_path):
    """/dev/stdout -> /proc/self/fd/1 -> a file the shell redirected to: the link's end is a regular file, so the
    JSON had been renamed over the link (as root, /dev/stdout itself became a file)."""
    import subprocess
    import sys

    link = tmp_path / "fd1"
    link.symlink_to("/proc/self/fd/1")
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        subprocess.run([sys.executable, "-c", "import sys; from runtime.results import write_json; "
                        "print('before', flush=True); write_json(sys.argv[1], {'a': 1})", str(link)],
                       stdout=stdout, check=True, cwd=Path(__file__).resolve().parents[2])
    assert link.is_symlink() and out.read_text().startswith("before\n{") and json.loads(out.read_text()[7:]) == {"a": 1}


def test_json_to_a_link_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path):
    target = tmp_path / "results" / "eval.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_json(link, {"b": 2})
    assert link.is_symlink() and json.loads(target.read_text()) == {"b": 2}


def test_a_full_disk_names_the_file_it_refused(tmp_path, monkeypatch):
    """A full disk's write error names no file; the command's error line ("No space left on device: free space
    there") then said nothing of where."""
    import errno

    (tmp_path / "r.json").write_text("{}")

    def refused(source, target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError) as raised:
        write_json(tmp_path / "r.json", {"ok": 1})
    assert raised.value.filename == str(tmp_path / "r.json") and raised.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"] and (tmp_path / "r.json").read_text() == "{}"


def test_json_has_no_infinity_a_non_finite_number_is_null(tmp_path):
    """A broken build's perplexity (past 1e308) was written as Infinity, which JSON has not: strict parsers
    (JavaScript's, Go's, Rust's, Python's with parse_constant) refused the whole file."""
    import warnings

    from runtime.evaluate import perplexity_of

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in exp" printed a stray line
        assert perplexity_of(800.0) == math.inf and perplexity_of(math.log(7.5)) == pytest.approx(7.5)
    path = write_json(tmp_path / "r.json", {"perplexity": perplexity_of(800.0), "mean_nll": 800.0,
                                            "rows": [float("nan"), (1.5, -math.inf)]})

    def refuse(constant):
        raise ValueError(f"{constant} is no JSON")
    assert json.loads(path.read_text(), parse_constant=refuse) == {"perplexity": None, "mean_nll": 800.0,
                                                                   "rows": [None, [1.5, None]]}
