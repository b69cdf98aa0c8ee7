"""The onnxruntime backend's session settings: an engine's session_config entries (recorded by passes, copied into
the manifest) reach its session, and a malformed one is refused with the fix."""
from __future__ import annotations

import pytest

from runtime.errors import ArtifactError
from runtime.onnxruntime_backend import STOP_SPINNING_AFTER_RUN, session_options


def test_an_engines_session_config_entries_are_set_on_its_session_options():
    options = session_options({"graph_optimization_level": "all"}, 2, {"session.disable_quant_qdq": "1"})
    assert options.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert options.intra_op_num_threads == 2
    plain = session_options({}, None)
    with pytest.raises(RuntimeError, match="does not have configuration with key"):  # never set
        plain.get_session_config_entry("session.disable_quant_qdq")


@pytest.mark.parametrize("config", [["session.disable_quant_qdq"], {"session.disable_quant_qdq": 1}, {1: "1"}])
def test_a_malformed_session_config_is_refused_naming_the_engine(config):
    with pytest.raises(ArtifactError, match=r"manifest engines\.prefill: session_config must map onnxruntime config "
                                            r"keys to strings.*rebuild the artifact"):
        session_options({}, None, config, "manifest engines.prefill")


def test_sessions_stop_spinning_after_each_run_unless_asked_or_the_engine_says_otherwise():
    assert session_options({}, None).get_session_config_entry(STOP_SPINNING_AFTER_RUN) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration with key"):  # unset: spinning on after a run
        session_options({}, None, spin_after_run=True).get_session_config_entry(STOP_SPINNING_AFTER_RUN)
    recorded = session_options({}, None, {STOP_SPINNING_AFTER_RUN: "0"})  # an engine's own entry wins
    assert recorded.get_session_config_entry(STOP_SPINNING_AFTER_RUN) == "0"


def test_an_engine_opens_its_sessions_with_the_spinning_setting(tiny_artifact, opened_sessions_stop_spinning):
    from runtime import Engine

    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=False)
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=True)
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=["decode"])
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=("prefill",))
    # per engine: its prefill session, then its decode session
    assert opened_sessions_stop_spinning == [True, True, False, False, True, False, False, True]


def test_aotlm_run_keeps_only_the_decode_session_spinning(tiny_artifact, opened_sessions_stop_spinning, capsys):
    from compiler.cli import main

    assert main(["run", str(tiny_artifact), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert opened_sessions_stop_spinning == [True, False]  # one request: prefill stops, decode spins on


def test_a_recipes_thread_count_above_this_machines_cores_runs_with_the_cores(monkeypatch):
    """An artifact built with backend.intra_op_threads for a bigger machine: more threads than cores only contend
    (thousands hang), as Engine.load refuses for an explicit count; the manifest's is capped, with a warning."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.warns(RuntimeWarning, match="backend.intra_op_threads: 16, more than the 2 cores"):
        assert session_options({"intra_op_threads": 16}, None).intra_op_num_threads == 2
    assert session_options({"intra_op_threads": 2}, None).intra_op_num_threads == 2
