"""The one table that maps recipe pass names to passes.

A pass is a module with a frozen dataclass `Options` and `run(model, options) -> (model, report)`:
`model` is an in-memory onnx.ModelProto (weights included), `report` a JSON-serializable dict.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from passes import cleanup


@dataclass(frozen=True)
class PassEntry:
    run: Callable
    options_type: type
    summary: str


PASSES: dict[str, PassEntry] = {
    "cleanup": PassEntry(cleanup.run, cleanup.Options, "constant folding, dead nodes, shape inference, shared initializers"),
}
