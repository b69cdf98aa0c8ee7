"""onnxruntime session settings a graph needs, recorded in the graph by the pass that makes them needed.

A pass that emits a form onnxruntime runs well only with some session config entry (say
`session.disable_quant_qdq`) records the entry in the model's metadata under SESSION_CONFIG_KEY, as JSON. The
onnxruntime backend copies it into the manifest's entry for that engine, and the runtime sets it on that engine's
session. Passes never see the runtime, and the runtime reads only the manifest.
"""
from __future__ import annotations

import json

import onnx

SESSION_CONFIG_KEY = "aotlm.session_config"


def session_config(model: onnx.ModelProto) -> dict[str, str]:
    """The entries recorded in `model` (empty when none)."""
    for entry in model.metadata_props:
        if entry.key == SESSION_CONFIG_KEY:
            return json.loads(entry.value)
    return {}


def record_session_config(result: onnx.ModelProto, source: onnx.ModelProto, entries: dict[str, str]) -> dict[str, str]:
    """Gives `result` (a pass's new model) `source`'s metadata plus `entries`; returns the merged entries."""
    merged = {**session_config(source), **entries}
    del result.metadata_props[:]
    for entry in source.metadata_props:
        if entry.key != SESSION_CONFIG_KEY:
            result.metadata_props.add(key=entry.key, value=entry.value)
    result.metadata_props.add(key=SESSION_CONFIG_KEY, value=json.dumps(merged, sort_keys=True))
    return merged
