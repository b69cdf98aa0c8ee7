"""Check, by running it, that each rotary `fuse_rotary` matched computes what its RotaryEmbedding node would.

The match reads the structure: the rotate-half Slices, Neg and Concat, and the cos operand's way up to Cos and
the inv_freq constant. Some differences do not show there:
- t's layout: a rotary applied before the heads' transpose (t [B, S, heads, D], cos unsqueezed at axis 2, as
  transformers' `apply_rotary_pos_emb(..., unsqueeze_dim=2)` does) has the same nodes, but RotaryEmbedding reads
  a 4-D input as [B, heads, S, D];
- the sin operand, which the match does not parse: Neg(sin) there is the inverse rotation;
- the positions' way to Cos: linear position scaling divides them (`position_ids / factor`) below the Mul by
  inv_freq, where the breadth-first search for inv_freq steps over it.

So each match is evaluated: the graph between t and the rotated output is cut out (t becomes a probe input; the
other inputs come from attention_mask_probe's feeds: batch 1, an empty past) and run with onnxruntime on random
t [1, heads, PROBE_TOKENS, D]. Its output must equal the rotation RotaryEmbedding applies with the matched inv_freq
and scaling at the positions the fused node would read (the matched positions tensor, an output of the probe too).
position_ids holds PROBE_TOKENS positions (its own length when fixed), the last of them PROBE_TOKENS - 1 at least:
at position 0 every rotation is the identity, so a one-token probe at 0 (a graph of fixed shapes, one token) showed
nothing. A rotary the probe cannot run is not fused (fusing unchecked math could change results).

`check_tables` (fuse_attention and fuse_rotary) runs the graph's own cos and sin over every row the fused tables
will hold, up to MAX_PROBE_TOKENS: the few positions above leave frequencies switched by sequence length
(longrope) or positions clamped past them unseen.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes import flash_attention_op as op
from passes.attention_mask_probe import probe_feed, run_cut, run_cut_many
from passes.probe_precision import REDUCED, as_float32, element_type

PROBE_TOKENS = 7
PROBE_HEADS = 3  # when t's heads dimension is not fixed: any count unlike PROBE_TOKENS, so a layout mix-up shows
TOLERANCE = 1e-4  # of the largest magnitude; float32 agrees to ~1e-7
REDUCED_PRECISION_TOLERANCE = 2e-2  # float16 / bfloat16 graphs: tables stored in bfloat16 are off by ~4e-3


def check_rotaries(graph: gs.Graph, matches: list) -> list[str | None]:
    """Per match, in order: None when it computes RotaryEmbedding's rotation, else why it stays unfused."""
    if not matches:
        return []
    rng = np.random.default_rng(0)
    probe = graph.copy()  # shares the weights; the cleanup keeps only what the rotaries need
    tensors = probe.tensors()
    tokens = _fixed(matches[0].source, 2) or PROBE_TOKENS  # a graph of fixed shapes takes only its own sizes
    fed, sources, outputs = {}, {}, []  # fed: probe input name -> values; sources: t's name -> the same values
    for index, found in enumerate(matches):
        source = tensors[found.source.name]
        if source.name not in sources:
            shape = (1, _fixed(source, 1) or PROBE_HEADS, tokens, 2 * found.inv_freq.size)
            value = gs.Variable(f"{source.name}.probe", dtype=np.float32, shape=list(shape))
            source.inputs.clear()
            probe.inputs = [t for t in probe.inputs if t is not source]  # t may be a graph input: now computed
            probe.nodes.append(gs.Node("Cast", inputs=[value], outputs=[source],
                                       attrs={"to": element_type(source.dtype)}))
            fed[value.name] = sources[source.name] = rng.standard_normal(shape).astype(np.float32)
            probe.inputs.append(value)
        output = gs.Variable(f"rotary_probe_output_{index}", np.float32)
        probe.nodes.append(gs.Node("Cast", inputs=[tensors[found.add.outputs[0].name]], outputs=[output],
                                   attrs={"to": onnx.TensorProto.FLOAT}))
        positions = gs.Variable(f"rotary_probe_positions_{index}", np.int64)  # what RotaryEmbedding would read
        probe.nodes.append(gs.Node("Identity", inputs=[tensors[found.positions.name]], outputs=[positions]))
        outputs += [output, positions]
    probe.outputs = outputs
    as_float32(probe)  # onnxruntime's CPU kernels lack bfloat16 Mul and Add: the same math in float32
    values = run_cut(probe, lambda value: fed[value.name] if value.name in fed else _feed(value, tokens))
    if isinstance(values, str):
        return [f"rotary: could not be checked by running it ({values}); left unfused"] * len(matches)
    return [_judge(found, np.asarray(value, np.float64), sources[found.source.name], np.asarray(positions),
                   TOLERANCE if element_type(found.source.dtype) not in REDUCED else REDUCED_PRECISION_TOLERANCE)
            for found, value, positions in zip(matches, values[0::2], values[1::2])]


def _feed(value: gs.Variable, tokens: int) -> np.ndarray:
    """attention_mask_probe's feed; position_ids: its own length when fixed (else PROBE_TOKENS), ending at
    position PROBE_TOKENS - 1 or later (a fixed one-token graph gets position 6, not 0)."""
    if value.name != "position_ids":
        return probe_feed(value, tokens)
    length = _fixed(value, 1) or PROBE_TOKENS
    return probe_feed(value, max(length, PROBE_TOKENS), queries=length)


def _fixed(tensor: gs.Tensor, axis: int) -> int | None:
    shape = tensor.shape
    return shape[axis] if shape is not None and len(shape) > axis and isinstance(shape[axis], int) else None


def expected_rotation(t: np.ndarray, inv_freq: np.ndarray, scaling: float,
                      positions: np.ndarray | None = None) -> np.ndarray:
    """RotaryEmbedding (rotate-half, interleaved=0) of t [1, heads, S, D] at `positions` [S] (default 0..S-1)."""
    positions = np.arange(t.shape[2]) if positions is None else np.asarray(positions, np.int64).reshape(-1)
    cos, sin = op.rotary_tables(inv_freq, int(positions.max(initial=0)) + 1, scaling)
    by_position = t.astype(np.float64).transpose(0, 2, 1, 3)  # [B, S, heads, D], the reference's layout
    return op.rotate(by_position, cos[positions], sin[positions]).transpose(0, 2, 1, 3)


def _judge(found, output: np.ndarray, t: np.ndarray, positions: np.ndarray, tolerance: float) -> str | None:
    if positions.shape != (t.shape[0], t.shape[2]):
        return (f"rotary: its positions {list(positions.shape)} do not match t {list(t.shape)}'s batch and axis 2 on "
                f"a probe: t is not laid out [B, heads, S, D] (RotaryEmbedding's layout)")
    if positions.min() < 0:
        return f"rotary: its positions on a probe are {positions.tolist()}: RotaryEmbedding's tables hold none below 0"
    if not positions.any():
        return (f"rotary: could not be checked by running it (its positions on a probe are {positions.tolist()}: "
                f"at position 0 every rotation is the identity); left unfused")
    expected = expected_rotation(t, found.inv_freq, found.scaling, positions)
    if output.shape != expected.shape:
        return (f"rotary: gives shape {list(output.shape)} for t {list(expected.shape)} on a probe: t is not laid out "
                f"[B, heads, S, D] (RotaryEmbedding's layout)")
    error = np.abs(output - expected).max() / max(1.0, np.abs(expected).max())
    if error > tolerance:
        return (f"rotary: computes something other than RotaryEmbedding with the matched inv_freq and scaling "
                f"{found.scaling:.4g} (largest difference {error:.2g} on a probe; e.g. a scaled position, a negated "
                f"sin, or t laid out [B, S, heads, D])")
    return None


def check_tables(graph: gs.Graph, tables: list[tuple[gs.Tensor, gs.Tensor, np.ndarray, float]],
                 length: int | None = None) -> list[str | None]:
    """Per (cos, sin, inv_freq, scaling): None when the graph's cos and sin tensors hold cos/sin(p * inv_freq) *
    scaling at every position p of the probe, a reason when not.

    The block and rotary probes run a few positions, and inv_freq is found by a search under Cos: frequencies the
    graph picks by sequence length (longrope's Where(max(position) + 1 > original, long, short), spelled so that the
    short ones are found), or positions clamped past the probes' last, passed both and were fused, changing outputs
    from there on. So the tables are evaluated over the mask probe's length (the cache length, else the rotary table
    length, else 512; at most MAX_PROBE_TOKENS): the positions the fused tables serve. A graph whose position_ids
    has a fixed width is fed that width at a time; one of fixed width whose positions cannot be moved that way is
    left unfused, with the reason."""
    from passes.attention_mask_probe import probe_length

    if not tables:
        return []
    length = probe_length(graph, length)
    probe = graph.copy()
    names = list(dict.fromkeys(t.name for cos, sin, _, _ in tables for t in (cos, sin)))
    tensors = probe.tensors()
    outputs = []
    for index, name in enumerate(names):
        outputs.append(gs.Variable(f"rotary_table_probe_{index}", np.float32))
        probe.nodes.append(gs.Node("Cast", inputs=[tensors[name]], outputs=[outputs[-1]],
                                   attrs={"to": onnx.TensorProto.FLOAT}))
    probe.outputs = outputs
    as_float32(probe)
    values = _table_values(probe, length)
    if isinstance(values, str):
        return [f"rotary: its cos/sin tables could not be checked by running them ({values}); left unfused"] * len(tables)
    by_name = dict(zip(names, values))
    return [_judge_tables(((kind, by_name[tensor.name]) for kind, tensor in (("cos", cos), ("sin", sin))), inv_freq,
                          scaling, length) for cos, sin, inv_freq, scaling in tables]


def _table_values(probe: gs.Graph, length: int) -> list[np.ndarray] | str:
    """The probe's outputs over positions 0..length-1, joined along the position axis (-2): one run, or, when the
    graph's position_ids input has a fixed width, runs of that width; a reason when they cannot be had."""
    probe.cleanup(remove_unused_graph_inputs=True)
    width = next((_fixed(value, 1) for value in probe.inputs if value.name == "position_ids"), None)
    if width is None:
        return run_cut(probe, lambda value: probe_feed(value, length))
    if width > length:
        return f"its fixed sequence width {width} exceeds the {length} rows the fused tables hold"

    def feed(value: gs.Variable, end: int) -> np.ndarray:
        if value.name == "attention_mask" and _fixed(value, 1):  # a fixed mask: its own width of real tokens
            return np.ones((value.shape[0] if isinstance(value.shape[0], int) else 1, _fixed(value, 1)), np.int64)
        return probe_feed(value, end, queries=width)

    ends = sorted({*range(width, length + 1, width), length})
    runs = run_cut_many(probe, [lambda value, end=end: feed(value, end) for end in ends])
    if isinstance(runs, str):
        return runs
    joined = []
    for index in range(len(probe.outputs)):
        parts, covered = [], 0
        for end, run in zip(ends, runs):  # the last run may overlap the one before: keep its new positions only
            value = np.asarray(run[index])
            if value.ndim < 2:
                return f"its tables have shape {list(value.shape)}, no position axis"
            parts.append(value[..., value.shape[-2] - (end - covered):, :])
            covered = end
        joined.append(np.concatenate(parts, axis=-2))
    return joined


def _judge_tables(values, inv_freq: np.ndarray, scaling: float, length: int) -> str | None:
    expected = dict(zip(("cos", "sin"), op.rotary_tables(inv_freq, length, scaling)))
    tolerance = (1e-3 + length * 2.4e-7) * max(1.0, abs(scaling))  # float32 angles: p * inv_freq rounds by ~p ulp
    for kind, value in values:
        value, table = np.asarray(value, np.float64), expected[kind]
        half = table.shape[1]
        if value.ndim < 2 or value.shape[-2] != length or value.shape[-1] not in (half, 2 * half):
            return (f"rotary: its {kind} table could not be run over the {length} positions the fused tables serve "
                    f"(shape {list(value.shape)} on the probe, not [..., {length}, {2 * half}]: e.g. a fixed sequence "
                    f"width with no position_ids input to move); left unfused")
        reference = table if value.shape[-1] == half else np.concatenate([table, table], axis=-1)
        difference = np.abs(value.reshape(-1, length, value.shape[-1]) - reference)
        by_position = difference.max(axis=(0, 2))
        if by_position.max() > tolerance:
            return (f"rotary: its {kind} table differs from {kind}(position * inv_freq) * {scaling:.4g} over {length} "
                    f"positions, from position {int(np.argmax(by_position > tolerance))} on (largest difference "
                    f"{by_position.max():.2g}: e.g. frequencies chosen by sequence length, or positions clamped or "
                    f"scaled)")
    return None
