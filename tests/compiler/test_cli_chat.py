"""compiler/cli_chat.py: `aotlm chat`'s refusals, its exit commands, its system message, and which turns of a long
conversation it keeps (the conversation tests against the tiny chat artifact are tests/runtime/test_chat.py's)."""
from __future__ import annotations

import io
import re

import pytest

from compiler.cli import main
from compiler.cli_chat import _fitting_prompt


class Characters:
    """An engine whose chat prompt has a token per character of the messages' contents."""
    max_context = 100

    def chat_prompt_ids(self, messages):
        return [0] * sum(len(message["content"]) for message in messages)


def said(role: str, length: int) -> dict:
    return {"role": role, "content": "x" * length}


def test_a_reply_s_room_is_max_new_tokens_but_at_most_half_the_context(capsys):
    for max_new_tokens, fits in ((10, 90), (500, 50)):  # room 10; room 50, not 500
        assert len(_fitting_prompt(Characters(), [], [said("user", fits)], max_new_tokens)) == fits
        assert _fitting_prompt(Characters(), [], [said("user", fits + 1)], max_new_tokens) is None
    assert "dropped" not in capsys.readouterr().err


def test_the_oldest_exchange_is_dropped_whole_until_the_prompt_fits_exactly(capsys):
    system, turns = [said("system", 10)], [said("user", 20), said("assistant", 20), said("user", 50)]
    ids = _fitting_prompt(Characters(), system, turns, 40)  # 10 + 90 + 40 > 100; 10 + 50 + 40 = 100
    assert len(ids) == 60 and turns == [said("user", 50)]
    assert capsys.readouterr().err.count("dropped the oldest exchange") == 1
    turns = [said("user", 30), said("assistant", 5), said("user", 20)]
    assert len(_fitting_prompt(Characters(), [], turns, 50)) == 20 and turns == [said("user", 20)]  # not the reply


def test_a_last_message_too_long_alone_leaves_the_conversation_as_it_was(capsys):
    turns = [said("user", 10), said("assistant", 10), said("user", 61)]
    assert _fitting_prompt(Characters(), [said("system", 0)], turns, 40) is None
    assert len(turns) == 3 and "dropped" not in capsys.readouterr().err


def test_chat_refuses_no_reply_room_and_a_model_without_a_chat_template(capsys, monkeypatch, tiny_artifact):
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(tiny_artifact), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err

    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the manifest said there is no chat template")
    monkeypatch.setattr("runtime.Engine.load", load)
    assert main(["chat", str(tiny_artifact)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "its model has no chat template; use `aotlm run --prompt`" in " ".join(err.split())
    assert main(["run", str(tiny_artifact), "--chat", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "its model has no chat template; use --prompt for plain text" in " ".join(err.split())


@pytest.mark.parametrize("command", ["/quit", "  /exit  "])
def test_chat_s_system_message_leads_every_turn_and_an_exit_command_ends_it(chat_artifact, monkeypatch, capsys,
                                                                             command):
    from runtime import Engine

    artifact, _ = chat_artifact
    monkeypatch.setattr("sys.stdin", io.StringIO(f"2+2?\n{command}\nnever read\n"))
    assert main(["chat", str(artifact), "--system", "Hi", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    messages = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "2+2?"}]
    engine = Engine.load(artifact)
    reply = engine.chat(messages, max_new_tokens=4)
    assert out == reply.text + "\n"  # one reply: the line after the command is never read
    prompt_tokens = len(engine.chat_prompt_ids(messages))
    assert f"0 of {prompt_tokens} prompt tokens from the cache" in " ".join(err.split()), err


def test_a_message_the_engine_refuses_leaves_the_conversation_without_it(chat_artifact, monkeypatch, capsys):
    from runtime import Engine, RequestError

    artifact, _ = chat_artifact
    real = Engine.chat_prompt_ids

    def refusing(self, messages, *args, **kwargs):  # as a template's raise_exception refuses a message
        if messages[-1]["content"] == "refuse me":
            raise RequestError("the chat template refused these messages: no")
        return real(self, messages, *args, **kwargs)
    monkeypatch.setattr(Engine, "chat_prompt_ids", refusing)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nrefuse me\nok\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    err = " ".join(err.split())
    engine = Engine.load(artifact)
    first = engine.chat([{"role": "user", "content": "hi"}], max_new_tokens=3).text
    kept = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
            {"role": "user", "content": "ok"}]
    assert out.startswith(first + "\n") and "the chat template refused these messages: no" in err, (out, err)
    assert err.count("TTFT") == 2 and f"of {len(engine.chat_prompt_ids(kept))} prompt tokens from the cache" in \
        err.split("refused")[1], err


@pytest.mark.parametrize("terminal", [True, False])
def test_the_prompt_marker_is_shown_on_a_terminal_only(monkeypatch, capsys, terminal):
    from compiler.cli_chat import _read_line

    class Input(io.StringIO):
        def isatty(self):
            return terminal
    monkeypatch.setattr("sys.stdin", Input("hi\n"))
    assert _read_line() == "hi\n" and _read_line() is None
    assert capsys.readouterr().err == ("> > \n" if terminal else "")  # the end of input: a line of its own


def interrupt_the_reply_to_long(monkeypatch, interruption=KeyboardInterrupt):
    """Engine.stream, patched: the reply to the message "long" gets Ctrl-C (or `interruption`) while its first piece
    is written (the stream is left suspended); other replies run. Returns the real Engine.stream."""
    from runtime import Engine

    real = Engine.stream

    class Interrupted:
        def __init__(self, generation):
            self.generation = generation

        def __iter__(self):
            yield next(self.generation)
            raise interruption

        def close(self):
            self.generation.close()

    def stream(self, prompt, *args, **kwargs):
        generation = real(self, prompt, *args, **kwargs)
        return Interrupted(generation) if self.chat_prompt_ids([{"role": "user", "content": "long"}]) == prompt \
            else generation
    monkeypatch.setattr(Engine, "stream", stream)
    return real


def test_ctrl_c_during_a_reply_stops_it_and_the_conversation_goes_on_without_it(chat_artifact, monkeypatch, capsys):
    from runtime import Engine

    artifact, _ = chat_artifact
    real = interrupt_the_reply_to_long(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("long\n2+2?\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "4"]) == 0  # not 130: the chat went on
    out, err = capsys.readouterr()
    engine = Engine.load(artifact)
    first = next(iter(real(engine, engine.chat_prompt_ids([{"role": "user", "content": "long"}]), max_new_tokens=4)))
    reply = engine.chat([{"role": "user", "content": "2+2?"}], max_new_tokens=4)  # "long" is not in its prompt
    assert out == first + "\n" + reply.text + "\n", out
    err = " ".join(err.split())
    assert "reply stopped; that message is left out of the conversation" in err and err.count("TTFT") == 1, err


@pytest.mark.parametrize("key, status, err", [(KeyboardInterrupt, 130, "> \ninterrupted\n"), ("", 0, "> \n")])
def test_ctrl_c_or_ctrl_d_at_the_prompt_ends_the_chat_on_a_line_of_its_own(chat_artifact, monkeypatch, capsys, key,
                                                                            status, err):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

        def readline(self, *args):
            if key == "":
                return ""
            raise key
    monkeypatch.setattr("sys.stdin", Terminal())
    assert main(["chat", str(chat_artifact[0])]) == status
    assert capsys.readouterr().err == err


def test_ctrl_c_as_a_message_too_long_is_refused_keeps_the_exchange_before_it(chat_artifact, monkeypatch, capsys):
    """The "does not fit" branch had taken the message out already; a Ctrl-C while it said so took out the one
    before it too (the last reply), leaving two user messages in a row, which alternating templates refuse."""
    import compiler.cli_chat as cli_chat

    seen, fitting, say = {}, cli_chat._fitting_prompt, cli_chat.console.print

    def fit(engine, system, turns, room):
        seen["turns"] = turns
        return None if turns[-1]["content"] == "huge" else fitting(engine, system, turns, room)

    def interrupted(*args, **kwargs):
        if args and "does not fit" in str(args[0]):
            raise KeyboardInterrupt  # as if Ctrl-C landed while the refusal was printed
        return say(*args, **kwargs)

    monkeypatch.setattr(cli_chat, "_fitting_prompt", fit)
    monkeypatch.setattr(cli_chat.console, "print", interrupted)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nhuge\n"))
    main(["chat", str(chat_artifact[0]), "--max-new-tokens", "3"])
    assert [turn["role"] for turn in seen["turns"]] == ["user", "assistant"], seen["turns"]


def test_each_turn_s_timings_are_one_line_on_stderr_however_narrow_the_console(chat_artifact, monkeypatch, capsys):
    """The README: "a line on stderr gives its TTFT, the prompt tokens it found in the cache and its TPOT". Piped,
    rich's console is 80 columns wide and had cut that line (and the notice of a stopped reply) into two, so a
    script reading stderr line by line got half of it."""
    import compiler.cli_chat as cli_chat

    artifact, _ = chat_artifact
    monkeypatch.setattr(cli_chat.console, "_width", 30)  # narrower than the line: as an 80-column pipe for longer ones
    interrupt_the_reply_to_long(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("long\n2+2?\nand 3+3?\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().err.splitlines()
    timings = [line for line in lines if "TTFT" in line]
    assert len(timings) == 2 and all(re.fullmatch(r"TTFT [\d.]+ ms, \d+ of \d+ prompt tokens from the cache, TPOT "
                                                  r"(?:[\d.]+ ms|-), \d+ tokens \(\w+\)", line) for line in timings), lines
    assert any(line.startswith("reply stopped;") and line.endswith("ends the chat)") for line in lines), lines


def test_a_one_token_reply_has_no_tpot(chat_artifact, monkeypatch, capsys):
    """TPOT = (E2E - TTFT) / (output tokens - 1) has no value for one token: `aotlm run` shows "-", chat said 0.00."""
    monkeypatch.setattr("sys.stdin", io.StringIO("2+2?\n"))
    assert main(["chat", str(chat_artifact[0]), "--max-new-tokens", "1"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "TPOT -, 1 tokens" in err, err


def test_sigterm_during_a_reply_ends_the_chat_as_at_the_prompt(chat_artifact, monkeypatch, capsys):
    """SIGTERM (a supervisor's stop, `docker stop`) is a KeyboardInterrupt subclass in cli.main: the reply's Ctrl-C
    handler had caught it too, and the chat went on answering."""
    from compiler.cli import _Terminated

    interrupt_the_reply_to_long(monkeypatch, _Terminated)
    monkeypatch.setattr("sys.stdin", io.StringIO("long\n2+2?\n"))
    assert main(["chat", str(chat_artifact[0]), "--max-new-tokens", "4"]) == 143
    err = " ".join(capsys.readouterr().err.split())
    assert "terminated" in err and "TTFT" not in err and "reply stopped" not in err, err


def test_an_unknown_command_is_said_not_sent_to_the_model(chat_artifact, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("/help\n/usr/bin holds what?\n"))
    assert main(["chat", str(chat_artifact[0]), "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown command /help; /exit or /quit ends the chat" in err and err.count("TTFT") == 1, err


def test_a_message_that_is_not_utf8_is_refused_under_a_strict_utf8_locale(chat_artifact, monkeypatch, capsys):
    """Under en_US.UTF-8 stdin's errors are strict: a Latin-1 byte was a UnicodeDecodeError out of readline (a
    traceback, the chat over) instead of check_unicode's refusal naming the character."""
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 ok?\n2+2?\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", str(chat_artifact[0]), "--max-new-tokens", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "not valid Unicode at character 3" in err and err.count("TTFT") == 1, err


def test_a_byte_order_mark_at_the_start_of_piped_input_is_not_part_of_the_first_message(chat_artifact, monkeypatch,
                                                                                         capsys):
    """A file saved with a BOM and piped in: U+FEFF was tokenized into the first message (3 more prompt tokens of
    SmolLM2's); `aotlm eval` drops one from its --text file. Only the input's first line loses it."""
    counts = []
    for text in ("Hi\n", "\ufeffHi\n", "\ufeffHi\n\ufeffHi\n"):
        monkeypatch.setattr("sys.stdin", io.StringIO(text))
        assert main(["chat", str(chat_artifact[0]), "--max-new-tokens", "1"]) == 0
        counts.append([int(n) for n in re.findall(r"of (\d+) prompt tokens", capsys.readouterr().err)])
    assert counts[0] == counts[1] and counts[2][0] == counts[0][0] and len(counts[2]) == 2, counts


@pytest.mark.parametrize("command", [["chat"], ["run", "--chat", "hi"]])
def test_a_system_message_that_is_not_utf8_is_refused_before_the_load(chat_artifact, monkeypatch, capsys, command):
    """Every turn was refused naming messages[0]['content'], a message the user never wrote, and chat exited 0."""
    from runtime import Engine

    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded"))
    assert main([command[0], str(chat_artifact[0]), *command[1:], "--system", "sys\udcff"]) == 2
    assert "error: --system is not valid Unicode at character 3" in capsys.readouterr().err


def test_an_ascii_locale_without_utf8_mode_reads_and_writes_what_it_can(tiny_artifact, tmp_path):
    """PYTHONUTF8=0 LC_ALL=C: a UTF-8 prompt was refused as bytes that were not UTF-8, and a generated character
    outside ASCII ended the run with a UnicodeEncodeError traceback."""
    import os
    import subprocess
    import sys

    environment = {**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C", "LANG": "C"}
    environment.pop("PYTHONIOENCODING", None)
    done = subprocess.run([sys.executable, "-m", "compiler.cli", "run", str(tiny_artifact), "--prompt", "灯塔 café",
                           "--max-new-tokens", "24", "--temperature", "1", "--seed", "3", "--stop", "灯塔"],
                          capture_output=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert done.stdout.startswith(b"?? caf?") and b"Traceback" not in done.stderr
    import shutil

    named = shutil.copytree(tiny_artifact, tmp_path / "模型")  # a path keeps Python's reading of its bytes
    done = subprocess.run([sys.executable, "-m", "compiler.cli", "inspect", str(named)], capture_output=True,
                          env=environment, timeout=120)
    assert done.returncode == 0 and b"tiny-random" in done.stdout, done.stderr.decode(errors="replace")[-2000:]
    # loaded too: onnxruntime and tokenizers were handed the surrogates Python read the UTF-8 name as
    done = subprocess.run([sys.executable, "-m", "compiler.cli", "run", str(named), "--prompt", "hi",
                           "--max-new-tokens", "2"], capture_output=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]


def test_a_system_message_that_leaves_no_room_for_any_message_is_refused(chat_artifact, monkeypatch, capsys):
    """Every message was refused as too long ("send a shorter one"), which no message could be."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nyo\n"))
    assert main(["chat", str(chat_artifact[0]), "--system", "word " * 200]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(r"error: --system: with it, the prompt takes \d+ tokens before any message, which leaves no room "
                     r"for a message and a reply \(64 tokens\) in the 128-token context; shorten it", err), err


@pytest.mark.parametrize("command", [["chat"], ["run", "--chat", "hi"]])
def test_an_empty_system_message_is_a_system_message(chat_artifact, monkeypatch, capsys, command):
    """--system "" was dropped as no --system: SmolLM2's and Qwen's templates then insert their default system
    prompt, which an explicit empty one is how a user keeps out (the server's messages were right)."""
    counts = []
    for system in ([], ["--system", ""]):
        monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
        assert main([command[0], str(chat_artifact[0]), *command[1:], *system, "--max-new-tokens", "1"]) == 0
        counts.append(re.findall(r"(\d+) prompt tokens", capsys.readouterr().err))
    assert counts[0] and counts[1] and int(counts[1][0]) > int(counts[0][0]), counts
