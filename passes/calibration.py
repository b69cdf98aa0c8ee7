"""Calibration for the quantize pass: run the float graph on sample text, keep each weight input's statistics.

The recipe names the text, the number of samples, their length and a seed (`CalibrationSpec`); the compiler
tokenizes it into a `CalibrationSet` (token ids [samples, length]) before the pass runs, because passes know
graphs, not tokenizers. `collect_statistics` runs the graph with onnxruntime, one sample at a time, with
the selected MatMuls' input tensors added as graph outputs, and folds each batch of activations into running
sums: E[x xᵀ] ([K, K], what GPTQ and the output-error measure need) and E|x| ([K], AWQ's channel salience).
Memory is bounded by those sums and one sample's activations, never by the number of samples.

Feeds follow the artifact's graph contract (compiler/export.py): input_ids, position_ids, attention_mask of
ones (one sample, batch 1, no padding) and zero KV-cache buffers; any other float input gets zeros with its
dynamic axes 1 (batch) or 0 (a past length), so a graph with an empty-past contract runs too.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator

import numpy as np
import onnx

from passes.errors import PassError

# One .onnx protobuf must stay under 2 GiB; above this the graph goes to onnxruntime through a file.
IN_MEMORY_LIMIT = 1 << 30
TOKEN_INPUTS = {"input_ids", "position_ids", "attention_mask"}
# Other inputs (the KV cache: float, or int8 after quantize_kv_cache) are fed zeros of their type.
ZERO_FEED_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int8)": np.int8}


@dataclass(frozen=True)
class CalibrationSpec:
    """What the recipe says: `text` is "pydoc" (Python's documentation, its first 90%: the last 10% is held out
    for the accuracy report) or a path to a UTF-8 text file; `samples` windows of `length` tokens, drawn
    without overlap, chosen with `seed`."""
    text: str = "pydoc"
    samples: int = field(default=64, metadata={"min": 1})
    length: int = field(default=256, metadata={"min": 2})
    seed: int = field(default=0, metadata={"min": 0})


@dataclass(frozen=True, eq=False)
class CalibrationSet(CalibrationSpec):
    """The spec resolved into tokens, plus a memo both phases' graphs share.

    The memo maps a layer (its node name, the same in both phases' graphs), its quantization settings and its
    weight's content to the quantized form: the prefill and decode graphs hold the same weights under different
    tensor names, and calibrated rounding must give both the same codes (else the artifact would store them twice
    and its phases would disagree). A set serves one model: quantize's entries are keyed by layer and weight, but
    quantize_kv_cache's scales only by its settings, so a set reused for another model would hand it the first
    one's cache scales (a build makes a set per build).
    """
    token_ids: np.ndarray | None = None  # int64 [samples, length]
    source: dict = field(default_factory=dict)  # what was read: file or "pydoc", characters, tokens available
    memo: dict = field(default_factory=dict, repr=False)
    progress: Callable[[str], None] | None = field(default=None, repr=False)  # the build's progress lines
    # Where a graph too large to hand onnxruntime in memory is written: a context manager giving a folder, removed
    # after. The compiler's is locked while the build runs, so that the next build removes one a killed build left (a
    # copy of the model's weights, written at the build's memory peak, where the OOM killer strikes); tempfile's
    # where none is given.
    scratch: Callable[[], ContextManager] | None = field(default=None, repr=False)

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    def describe(self) -> dict:
        return {"text": self.text, "samples": self.samples, "length": self.length, "seed": self.seed,
                "tokens": int(self.token_ids.size), **self.source}


@dataclass
class ActivationStats:
    """Running sums over every calibration row (token) of one activation tensor with K channels."""
    outer: np.ndarray   # float64 [K, K], Σ x xᵀ
    absolute: np.ndarray  # float64 [K], Σ |x|
    rows: int = 0

    @classmethod
    def empty(cls, channels: int) -> "ActivationStats":
        return cls(np.zeros((channels, channels)), np.zeros(channels))

    def add(self, activations: np.ndarray) -> None:
        rows = activations.reshape(-1, activations.shape[-1]).astype(np.float32)
        self.outer += rows.T @ rows  # float32 product, float64 sum: fast, and exact enough over many samples
        self.absolute += np.abs(rows).sum(axis=0)
        self.rows += rows.shape[0]

    @property
    def hessian(self) -> np.ndarray:
        return self.outer / max(self.rows, 1)

    @property
    def mean_abs(self) -> np.ndarray:
        return self.absolute / max(self.rows, 1)


def draw_samples(token_ids: np.ndarray, samples: int, length: int, seed: int) -> np.ndarray:
    """`samples` non-overlapping windows of `length` tokens, chosen with `seed`; [samples, length] int64."""
    available = len(token_ids) // length
    if available < samples:
        raise PassError(f"calibration text has {len(token_ids)} tokens: too short for {samples} samples of "
                        f"{length} tokens ({samples * length}); lower calibration.samples or calibration.length, "
                        f"or give a longer text")
    windows = np.asarray(token_ids[: available * length], np.int64).reshape(available, length)
    chosen = np.sort(np.random.default_rng(seed).choice(available, samples, replace=False))
    return windows[chosen]


def collect_statistics(model: onnx.ModelProto, activations: list[str], calibration: CalibrationSet,
                       progress: Callable[[int, int], None] | None = None) -> dict[str, ActivationStats]:
    """Statistics of each named tensor of `model` over the calibration samples (see the module docstring)."""
    stats: dict[str, ActivationStats] = {}
    for index, outputs in enumerate(sample_outputs(model, activations, calibration)):
        for name, value in zip(activations, outputs):
            if not np.isfinite(value).all():  # one overflow made E[x xᵀ] inf: GPTQ wrote NaN scales, every output NaN
                bad = np.argwhere(~np.isfinite(value.reshape(-1, value.shape[-1])))[0]
                raise PassError(f"calibration: the float graph's tensor {name} is not finite (inf or NaN) on sample "
                                f"{index + 1} of {len(calibration.token_ids)}, at its token {bad[0]}, channel {bad[1]}: "
                                f"quantizing from it would write NaN; a float16 export can overflow there (export in "
                                f"float32: export.dtype), or calibrate on other text or another seed")
            if name not in stats:
                stats[name] = ActivationStats.empty(value.shape[-1])
            stats[name].add(value)
        if progress:
            progress(index + 1, len(calibration.token_ids))
    return stats


def sample_outputs(model: onnx.ModelProto, names: list[str], calibration: CalibrationSet) -> Iterator[list[np.ndarray]]:
    """The named tensors of `model` (graph outputs or intermediates), one list per calibration sample, in order."""
    import onnxruntime as ort  # the pass runs the float graph to observe it; the kernels are onnxruntime's

    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    known_outputs = {o.name for o in probed.graph.output}
    for name in names:
        if name not in known_outputs:
            # Untyped: onnxruntime gives it the tensor's own type (a float16 graph's activations are float16).
            probed.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    options.intra_op_num_threads = cpu_threads()
    with (calibration.scratch or tempfile.TemporaryDirectory)() as folder:
        session = _session(probed, options, folder, ort)
    del probed
    for sample in calibration.token_ids:
        try:
            outputs = session.run(names, _feeds(session, sample))
        except Exception as error:  # onnxruntime's own exception types: name the step and the first line
            raise PassError(f"calibration: onnxruntime failed running the float graph on a {len(sample)}-token sample "
                            f"({str(error).splitlines()[0]})") from None
        yield outputs


def cpu_threads() -> int:
    """intra_op_num_threads for the passes' onnxruntime sessions: 0 (onnxruntime's default, one per physical core,
    pinned) where the process may use every CPU, else that many, given explicitly: the default pinned workers to CPUs
    outside a taskset or a container's cpuset ("pthread_setaffinity_np failed" on each session). The runtime also
    heeds a container's CPU quota (runtime/cpus.py); a build, not latency-bound, goes by its affinity."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 0
    return 0 if usable >= (os.cpu_count() or 1) else usable


def _session(model: onnx.ModelProto, options, folder: str, ort):
    try:
        if model.ByteSize() < IN_MEMORY_LIMIT:
            return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        path = os.path.join(folder, "calibration.onnx")
        onnx.save_model(model, path, save_as_external_data=True, location="calibration.data")
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as error:  # onnxruntime's own exception types; the graph is the pipeline's, name the step
        raise PassError(f"calibration: onnxruntime cannot run the float graph ({str(error).splitlines()[0]})") from None


def _feeds(session, sample: np.ndarray) -> dict[str, np.ndarray]:
    length = len(sample)
    feeds = {"input_ids": sample[None].astype(np.int64),
             "position_ids": np.arange(length, dtype=np.int64)[None],
             "attention_mask": np.ones((1, length), np.int64)}
    for graph_input in session.get_inputs():
        if graph_input.name in TOKEN_INPUTS:
            continue
        if graph_input.type not in ZERO_FEED_TYPES:
            raise PassError(f"calibration: does not know how to feed graph input {graph_input.name!r} "
                            f"({graph_input.type}); the graph must follow the artifact's I/O contract")
        shape = [dim if isinstance(dim, int) else (1 if axis == 0 else 0) for axis, dim in enumerate(graph_input.shape)]
        feeds[graph_input.name] = np.zeros(shape, ZERO_FEED_TYPES[graph_input.type])
    return {name: value for name, value in feeds.items() if name in {i.name for i in session.get_inputs()}}


def digest(*arrays: np.ndarray) -> str:
    """A content key for memoised results (scale searches, quantized weights) shared by both phases' graphs."""
    hasher = hashlib.sha1()
    for array in arrays:
        hasher.update(np.ascontiguousarray(array).tobytes())
        hasher.update(str(array.shape).encode())
    return hasher.hexdigest()


class Statistics:
    """E[x xᵀ] and E|x| per activation, collected on first use for every target at once (one pass over the data).
    Targets are passes/quantize.py's: anything with an `input_name` (the activation its MatMul reads)."""

    def __init__(self, model: onnx.ModelProto, targets: list, calibration: CalibrationSet | None):
        self.model, self.targets, self.calibration = model, targets, calibration
        self.stats = None

    def __call__(self, target):
        if self.calibration is None:
            return None
        if self.stats is None:
            names = list(dict.fromkeys(t.input_name for t in self.targets))
            say = self.calibration.say
            say(f"calibration: running the float graph on {self.calibration.samples} samples of "
                f"{self.calibration.length} tokens, {len(names)} weight inputs")
            self.stats = collect_statistics(self.model, names, self.calibration, progress=lambda done, total: say(
                f"calibration: sample {done}/{total}") if done == total or done % max(1, total // 8) == 0 else None)
        return self.stats[target.input_name]
