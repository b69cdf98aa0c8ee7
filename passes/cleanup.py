"""Placeholder: being written (constant folding, dead-node removal, shape inference, deduplicated initializers)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    fold_constants: bool = True
    deduplicate_initializers: bool = True
    infer_shapes: bool = True


def run(model, options: Options):
    raise NotImplementedError("cleanup pass is being written")
