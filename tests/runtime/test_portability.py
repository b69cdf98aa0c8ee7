"""The runtime where Linux's extras are missing (macOS, Windows, a container without /proc): huge pages, the
server's client check, chat templates without jinja2; and the CLI's word for a build on Windows."""
from __future__ import annotations

import select
import socket
import sys
import types

import pytest

from runtime import ArtifactError, Engine, huge_pages


def test_an_engine_loads_without_proc_maps(tiny_artifact, monkeypatch):
    """Engine.load(huge_pages=True), the default, read /proc/self/maps before its own "not Linux" check: a
    FileNotFoundError on macOS, Windows or without /proc, where the README promises an unsupported kernel is never
    fatal."""
    real_open = open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(huge_pages, "open", no_proc, raising=False)
    assert huge_pages.private_anonymous_mappings(0) == []
    with Engine.load(tiny_artifact) as engine:
        assert len(engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True).token_ids) == 2


def test_the_servers_client_check_works_without_poll(monkeypatch):
    """Windows has no select.poll: every request lasting over 0.25 s answered 500 and streams were cut."""
    from runtime.server import _Handler

    monkeypatch.delattr(select, "poll")
    ours, theirs = socket.socketpair()
    handler = types.SimpleNamespace(connection=ours)
    try:
        assert _Handler._client_gone(handler) is False  # nothing to read: still there
        theirs.sendall(b"x")
        assert _Handler._client_gone(handler) is False  # something sent: still there (not consumed)
        assert ours.recv(1) == b"x"
        theirs.close()
        assert _Handler._client_gone(handler) is True
    finally:
        ours.close()


def test_a_chat_template_without_jinja2_fails_chat_requests_not_the_load(chat_artifact, monkeypatch):
    """The runtime needs onnxruntime, tokenizers and numpy (ARCHITECTURE.md): without jinja2 an artifact with a chat
    template did not even load, for plain prompts."""
    from runtime import chat

    chat.compiled.cache_clear()  # a template compiled by an earlier test would hide the missing module
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 -> ImportError
    try:
        with Engine.load(chat_artifact[0]) as engine:
            assert len(engine.generate([1, 2, 3], max_new_tokens=2, ignore_eos=True).token_ids) == 2
            with pytest.raises(ArtifactError, match=r"chat template needs jinja2, which is not installed: .* -m pip install"):
                engine.chat_prompt_ids([{"role": "user", "content": "hi"}])
    finally:
        chat.compiled.cache_clear()


def test_a_build_on_windows_says_it_needs_a_posix_system(capsys, monkeypatch):
    """compiler/artifact.py imports fcntl: on Windows `aotlm build` was a ModuleNotFoundError traceback."""
    import argparse

    from compiler import cli

    def no_fcntl(args):
        raise ModuleNotFoundError("No module named 'fcntl'", name="fcntl")

    parsed = argparse.Namespace(handler=no_fcntl, command="build")
    monkeypatch.setattr(cli, "parser", lambda: types.SimpleNamespace(parse_args=lambda argv: parsed))
    assert cli.main(["build", "x.yaml"]) == 2
    assert "`aotlm build` needs a POSIX system (Linux or macOS; on Windows, WSL)" in capsys.readouterr().err
