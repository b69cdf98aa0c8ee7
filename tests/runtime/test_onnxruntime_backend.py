"""The onnxruntime backend's session settings: an engine's session_config entries (recorded by passes, copied into
the manifest) reach its session, and a malformed one is refused with the fix."""
from __future__ import annotations

import pytest

from runtime.errors import ArtifactError
from runtime.onnxruntime_backend import session_options


def test_an_engines_session_config_entries_are_set_on_its_session_options():
    options = session_options({"graph_optimization_level": "all"}, 2, {"session.disable_quant_qdq": "1"})
    assert options.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert options.intra_op_num_threads == 2
    plain = session_options({}, None)
    with pytest.raises(Exception):  # onnxruntime raises when an entry was never set
        plain.get_session_config_entry("session.disable_quant_qdq")


@pytest.mark.parametrize("config", [["session.disable_quant_qdq"], {"session.disable_quant_qdq": 1}, {1: "1"}])
def test_a_malformed_session_config_is_refused_naming_the_engine(config):
    with pytest.raises(ArtifactError, match=r"manifest engines\.prefill: session_config must map onnxruntime config "
                                            r"keys to strings.*rebuild the artifact"):
        session_options({}, None, config, "manifest engines.prefill")
