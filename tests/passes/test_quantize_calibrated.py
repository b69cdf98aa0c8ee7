"""quantize with calibration: AWQ / GPTQ against RTN, statistics, AWQ's folds, overrides, the quantized embedding,
and the DequantizeLinear lowering, on synthetic layers and on the tiny decoder's fused graphs."""
from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.export import export_graphs
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, fuse_attention, fuse_rms_norm, fuse_silu, lower_onnxruntime, pack_projections, quantize
from passes.awq_fold import apply_input_scales, attention_value_tie
from passes.calibration import CalibrationSet, CalibrationSpec, collect_statistics, draw_samples
from passes.errors import PassError
from passes.quantize_algorithms import (awq_search, output_error, quantize_gptq, refit_scales, relative_output_error,
                                        scaled_dequantized)
from passes.quantized_weights import QuantizedWeight, dequantize, quantize_rtn
from tests.passes.test_fuse_attention import CONFIG, decoder_graphs, fuse_and_lower, generate_logits, op_counts  # noqa: F401

FORMATS = {"int4_b32_sym": (4, 32, True), "int4_b128_sym": (4, 128, True), "int4_b32_asym": (4, 32, False),
           "int8_channel": (8, 256, True)}


def correlated_layer(k=256, n=96, rows=4096, seed=0):
    """Activations with correlated channels of uneven magnitude (as LLM activations have), their E[x xᵀ] and E|x|."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((k, k)) / np.sqrt(k)
    gains = np.exp(1.5 * rng.standard_normal(k))  # a few channels ~20x the typical one
    x = (rng.standard_normal((rows, k)) @ mixing + 0.3 * rng.standard_normal((rows, k))) * gains
    weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return weight, x.T @ x / rows, np.abs(x).mean(axis=0)


@pytest.mark.parametrize("name", FORMATS)
def test_awq_and_gptq_lower_the_layer_output_error_below_rtn(name):
    bits, block_size, symmetric = FORMATS[name]
    weight, hessian, mean_abs = correlated_layer()
    rtn = relative_output_error(weight, dequantize(quantize_rtn(weight, bits, block_size, symmetric)), hessian)
    scales, record = awq_search([weight], hessian, mean_abs, bits, block_size, symmetric)
    awq = relative_output_error(weight, scaled_dequantized(weight, scales, bits, block_size, symmetric), hessian)
    gptq_weight = quantize_gptq(weight, hessian, bits, block_size, symmetric)
    gptq = relative_output_error(weight, dequantize(gptq_weight), hessian)
    print(f"{name}: relative output error rtn {rtn:.3e} awq {awq:.3e} (alpha {record['alpha']}) gptq {gptq:.3e}")
    # α = 0 is RTN, so AWQ can only tie or win on its own data; GPTQ minimises this very error column by column.
    assert awq <= rtn and gptq <= rtn
    assert awq < 0.9 * rtn and gptq < 0.9 * rtn  # with salient, correlated channels both win clearly
    assert gptq_weight.codes.max() < 2 ** bits and gptq_weight.scales.shape == (96, 256 // block_size)


def spiky_layer(k=64, n=32, rows=2048, seed=1):
    """Activations where 8 channels are 0 but for rare spikes 100x the typical value (E|x| small, E[x²] large), their
    E[x xᵀ] and E|x|: the salience E|x| understates them, so the best α is high."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k))
    spiking = rng.choice(k, 8, replace=False)
    x[:, spiking] *= 100 * (rng.random((rows, 8)) < 0.02)
    weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return weight, x.T @ x / rows, np.abs(x).mean(axis=0)


def reference_awq_search(weight, hessian, mean_abs, bits, block_size, symmetric):
    """AWQ's scale search written out: for α in {0, 1/20, ..., 19/20}, s = E|x|^α normalised to √(max s · min s) = 1,
    the output error of diag(1/s) Q(diag(s) W); returns (every α's error, the best α, its s)."""
    losses, candidates = [], []
    for alpha in np.arange(20) / 20:
        scales = np.maximum(mean_abs, 1e-8) ** alpha
        scales = (scales / np.sqrt(scales.max() * scales.min())).astype(np.float32)
        rounded = dequantize(quantize_rtn(weight * scales[:, None], bits, block_size, symmetric))
        losses.append(output_error(weight, rounded / scales[:, None], hessian))
        candidates.append((alpha, scales))
    alpha, scales = candidates[int(np.argmin(losses))]
    return np.array(losses), alpha, scales


@pytest.mark.parametrize("layer, best_alpha", [("correlated", 0.35), ("spiky", 0.85)])
def test_awq_search_tries_every_alpha_of_the_grid(layer, best_alpha):
    """The search's α, scales and losses equal a direct search over the whole grid. The layers are chosen so that a
    narrowed grid shows: correlated channels are best at α = 0.35 (not on a grid of tenths), rare spikes at 0.85
    (not in the grid's lower half), both far below α = 0 (RTN), the loss the record reports as loss_rtn."""
    weight, hessian, mean_abs = (correlated_layer(k=64, n=32, rows=2048, seed=1) if layer == "correlated"
                                 else spiky_layer())
    scales, record = awq_search([weight], hessian, mean_abs, 4, 32, True)
    losses, alpha, expected_scales = reference_awq_search(weight, hessian, mean_abs, 4, 32, True)
    assert alpha == pytest.approx(best_alpha)  # the layer is what this test needs (any other α: at least 2.5% worse)
    assert record["alpha"] == pytest.approx(alpha)
    np.testing.assert_allclose(scales, expected_scales, rtol=1e-6)
    # The search sums the error in float32: equal to the float64 reference within 1e-4.
    assert record["loss_rtn"] == pytest.approx(losses[0], rel=1e-4)
    assert record["loss_best"] == pytest.approx(losses.min(), rel=1e-4) and record["loss_best"] < 0.5 * losses[0]


def gather_matmul(table: np.ndarray, weight: np.ndarray) -> onnx.ModelProto:
    """Gather(table, input_ids) -> MatMul "proj": the MatMul's input rows are known table rows."""
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "input_ids"], ["x"]),
         onnx.helper.make_node("MatMul", ["x", "W"], ["y"], name="proj")], "g",
        [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, None])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(table, "table"), onnx.numpy_helper.from_array(weight, "W")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])


def test_calibration_statistics_equal_the_activations_second_moment():
    """Gather(table, ids) -> MatMul: the MatMul's input rows are table rows, so E[x xᵀ] is known exactly."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    model = gather_matmul(table, rng.standard_normal((16, 8)).astype(np.float32))
    tokens = draw_samples(rng.integers(0, 50, 1000), samples=6, length=20, seed=3)
    stats = collect_statistics(model, ["x"], CalibrationSet(samples=6, length=20, token_ids=tokens))["x"]
    rows = table[tokens.reshape(-1)].astype(np.float64)
    assert stats.rows == 120
    np.testing.assert_allclose(stats.hessian, rows.T @ rows / 120, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.mean_abs, np.abs(rows).mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_the_reported_layer_error_is_what_the_lowered_graph_computes_on_the_calibration_rows(method):
    """The report's relative_output_error, E‖xΔW‖²/E‖xW‖² from the calibration statistics, against the quantized
    graph itself run over the calibration samples (Gather -> MatMul: its input rows are known table rows)."""
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((50, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32)  # uneven channels
    weight = rng.standard_normal((64, 8)).astype(np.float32)
    model = gather_matmul(table, weight)
    tokens = draw_samples(rng.integers(0, 50, 1000), samples=6, length=20, seed=3)
    quantized, report = quantize.run(model, quantize.Options(
        bits=4, block_size=32, method=method, calibration=CalibrationSet(samples=6, length=20, token_ids=tokens)))
    session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    computed = np.concatenate([session.run(None, {"input_ids": sample[None]})[0][0] for sample in tokens])
    exact = table[tokens.reshape(-1)].astype(np.float64) @ weight
    measured = np.sum((computed - exact) ** 2) / np.sum(exact ** 2)
    (layer,) = report["layers"]
    assert layer["node"] == "proj" and layer["method"] == method
    np.testing.assert_allclose(layer["relative_output_error"], measured, rtol=1e-4)  # measured: within 1e-6


def test_calibration_text_too_short_for_the_samples_is_a_clear_error():
    with pytest.raises(PassError, match=r"calibration text has 100 tokens: too short for 8 samples of 16 tokens \(128\)"):
        draw_samples(np.arange(100), samples=8, length=16, seed=0)
    first, again = draw_samples(np.arange(1000), 5, 16, seed=1), draw_samples(np.arange(1000), 5, 16, seed=1)
    np.testing.assert_array_equal(first, again)  # the seed decides the samples
    assert len(np.unique(first[:, 0])) == 5  # windows do not overlap


@pytest.fixture(scope="module")
def fused_graphs(decoder_graphs):  # noqa: F811
    """The tiny decoder as the default recipe leaves it before quantize: GQA, (Skip)SimplifiedLayerNorm, QuickGelu."""
    graphs = {}
    for phase, model in decoder_graphs.items():
        model = fuse_and_lower(model, required=True)[2]
        model = fuse_rms_norm.run(model, fuse_rms_norm.Options())[0]
        graphs[phase] = fuse_silu.run(model, fuse_silu.Options())[0]
    return graphs


def calibration(samples=8, length=24, seed=0) -> CalibrationSet:
    tokens = np.random.default_rng(seed).integers(3, CONFIG.vocab_size, samples * length)
    return CalibrationSet(samples=samples, length=length, seed=seed, token_ids=tokens.reshape(samples, length))


def run_graph(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("packed, rotary", [(False, "inside"), (True, "inside"), (True, "separate")],
                         ids=["separate", "packed", "packed-rotary-separate"])
def test_awq_folds_are_exact_in_float(fused_graphs, decoder_graphs, packed, rotary):  # noqa: F811
    """Scale every group's input by 1/s and its weights by s, without quantizing: the model must not change.
    Packed: q/k/v and gate/up are one MatMul + Split each (pack_projections), so down_proj's 1/s goes into the
    up columns of the packed gate/up weight. With rotary "separate" the attention reads v from that Split (it
    took the packed input before): o_proj's tied scales still fold into v's columns."""
    model = fused_graphs["prefill"]
    if rotary == "separate":
        fused = fuse_attention.run(decoder_graphs["prefill"], fuse_attention.Options(required=True))[0]
        model = lower_onnxruntime.run(fused, lower_onnxruntime.Options(rotary="separate"))[0]
        model = fuse_silu.run(fuse_rms_norm.run(model, fuse_rms_norm.Options())[0], fuse_silu.Options())[0]
    if packed:
        model = pack_projections.run(model, pack_projections.Options())[0]
    graph = gs.import_onnx(model)
    rng = np.random.default_rng(0)
    groups: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        if node.op == "MatMul" and isinstance(node.inputs[1], gs.Constant):
            groups.setdefault(node.inputs[0].name, []).append(node)
    folds, attention_outputs = [], 0
    for group in groups.values():
        scales = np.exp(rng.uniform(-1, 1, group[0].inputs[1].values.shape[0])).astype(np.float32)
        values = attention_value_tie(group[0].inputs[0])
        attention_outputs += values is not None
        if values is not None and attention_outputs == 1:  # o_proj: scales tied per kv head fold into the values
            tied = scales.reshape(values.tie)
            scales = np.broadcast_to(tied[:, :1], tied.shape).reshape(-1).copy()
        for node in group:
            node.inputs[1] = gs.Constant(f"{node.name}_scaled", node.inputs[1].values * scales[:, None])
        folds.append(apply_input_scales(graph, group[0].inputs[0], group, scales))
    kinds = {how.split(" '")[0].split(" (")[0] for how in folds}
    # q/k/v, gate/up and lm_head: into a norm's gamma; down_proj: into up_proj; o_proj (after attention): into the
    # value projection when its scales are tied per kv head, else (the other layer here) a Mul.
    assert kinds == {"folded into SimplifiedLayerNormalization", "folded into SkipSimplifiedLayerNormalization",
                     "folded into MatMul", "folded into the attention's value projection",
                     "Mul inserted before the group"}, folds
    folded = gs.export_onnx(graph.cleanup().toposort())
    inputs = {"input_ids": np.array([[1, 5, 9, 14, 200, 7]]), "position_ids": np.arange(6)[None],
              "attention_mask": np.ones((1, 6), np.int64)}
    inputs.update({i.name: np.zeros([1] + [d.dim_value for d in i.type.tensor_type.shape.dim[1:]], np.float32)
                   for i in model.graph.input if i.name.startswith("past")})
    np.testing.assert_allclose(run_graph(folded, inputs)[0], run_graph(model, inputs)[0], rtol=1e-4, atol=1e-4)


def _fold_graph(returned: str | None = None, read_outside: str | None = None) -> onnx.ModelProto:
    """embedding x -> Mul(gamma) -> hidden -> Reshape [-1, K] -> lm_head, and a gated down_proj reading
    Mul(Sigmoid(gate), up) of x; `returned` is also a graph output (a caller reads the last hidden state, say);
    `read_outside` is also read by a Tanh, a node in no group, whose output "outside" is a graph output too."""
    rng = np.random.default_rng(0)
    k, n, vocab = 16, 8, 30
    weights = {"table": rng.standard_normal((vocab, k)), "gamma": 1 + 0.1 * rng.standard_normal(k),
               "head": rng.standard_normal((k, n)), "gate": rng.standard_normal((k, k)),
               "up": rng.standard_normal((k, k)), "down": rng.standard_normal((k, n)), "shape": np.array([-1, k])}
    node = helper.make_node
    nodes = [node("Gather", ["table", "input_ids"], ["x"]), node("Mul", ["x", "gamma"], ["hidden"]),
             node("Reshape", ["hidden", "shape"], ["rows"]), node("MatMul", ["rows", "head"], ["logits"]),
             node("MatMul", ["x", "gate"], ["gated"]), node("Sigmoid", ["gated"], ["gate_act"]),
             node("MatMul", ["x", "up"], ["up_out"]), node("Mul", ["gate_act", "up_out"], ["product"]),
             node("MatMul", ["product", "down"], ["mlp"])]
    if read_outside is not None:
        nodes.append(node("Tanh", [read_outside], ["outside"]))
    names = ["logits", "mlp"] + [name for name in (returned, read_outside and "outside") if name is not None]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    initializers = [numpy_helper.from_array(v.astype(np.int64 if name == "shape" else np.float32), name)
                    for name, v in weights.items()]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 4])],
                              outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _scale_both_groups(graph: gs.Graph) -> dict[str, str]:
    """_fold_graph's lm_head and down_proj read x / s and hold diag(s) W (random s, no rounding): how each 1/s went
    in, by the group's input (rows, product). The graph computes what it did unless a fold changed another reader."""
    rng = np.random.default_rng(1)
    folds = {}
    for reader, node_input in (("rows", "head"), ("product", "down")):  # lm_head's and down_proj's groups
        group = [node for node in graph.nodes if node.op == "MatMul" and node.inputs[1].name == node_input]
        scales = np.exp(rng.uniform(-1, 1, 16)).astype(np.float32)
        group[0].inputs[1] = gs.Constant(f"{node_input}_scaled", group[0].inputs[1].values * scales[:, None])
        folds[reader] = apply_input_scales(graph, group[0].inputs[0], group, scales)
    return folds


@pytest.mark.parametrize("returned", ["hidden", "up_out"])
def test_awq_folds_leave_a_graph_output_as_it_was(returned):
    """Folded through the Reshape into the norm's Mul (or into up_proj's columns), 1/s changed `hidden` (`up_out`),
    a graph output: its caller read values off by up to 113. A Mul goes before the group instead, and every output,
    the returned tensor included, is what it was."""
    model = _fold_graph(returned)
    graph = gs.import_onnx(model)
    folds = _scale_both_groups(graph)
    blocked = "rows" if returned == "hidden" else "product"
    assert folds[blocked] == "Mul inserted before the group", folds
    folded = gs.export_onnx(graph.cleanup().toposort())
    feeds = {"input_ids": np.array([[3, 1, 4, 1]])}
    for after, before in zip(run_graph(folded, feeds), run_graph(model, feeds)):
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("read", ["rows", "hidden", "up_out"])
def test_awq_folds_leave_what_a_reader_outside_the_group_reads_as_it_was(read):
    """A Tanh in no group reads lm_head's input itself (`rows`), the norm's output before the Reshape (`hidden`) or
    up_proj's output inside down_proj's gated input (`up_out`). A fold into what produces it would hand the Tanh
    values scaled by 1/s; that group gets a Mul instead, the other one still folds, and every output, the Tanh's
    included, is what it was."""
    model = _fold_graph(read_outside=read)
    graph = gs.import_onnx(model)
    folds = _scale_both_groups(graph)
    folded = gs.export_onnx(graph.cleanup().toposort())
    feeds = {"input_ids": np.array([[3, 1, 4, 1]])}
    for name, after, before in zip(("logits", "mlp", "outside"), run_graph(folded, feeds), run_graph(model, feeds)):
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5, err_msg=name)
    blocked = "product" if read == "up_out" else "rows"
    assert folds[blocked] == "Mul inserted before the group", folds
    assert all(how.startswith("folded into") for reader, how in folds.items() if reader != blocked), folds


def norm_with_an_outside_reader() -> tuple[onnx.ModelProto, CalibrationSet]:
    """input_ids -> Gather -> SimplifiedLayerNormalization(gamma) -> normed, read by q_proj and by `outside`, a MatMul
    the recipe keeps float (excluded): outside AWQ's group, so folding q_proj's 1/s into gamma would change it."""
    rng = np.random.default_rng(0)
    vocab, k = 100, 64
    table = rng.standard_normal((vocab, k)).astype(np.float32)
    gamma = np.exp(1.5 * rng.standard_normal(k)).astype(np.float32)  # uneven channels: AWQ's α is well above 0
    node = helper.make_node
    graph = helper.make_graph(
        [node("Gather", ["table", "input_ids"], ["x"], name="embed"),
         node("SimplifiedLayerNormalization", ["x", "gamma"], ["normed"], name="norm", axis=-1, epsilon=1e-5,
              stash_type=1),
         node("MatMul", ["normed", "W_q"], ["q"], name="q_proj"),
         node("MatMul", ["normed", "W_outside"], ["side"], name="outside")], "norm_with_an_outside_reader",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("q", "side")],
        [numpy_helper.from_array(values, name) for name, values in (
            ("table", table), ("gamma", gamma), ("W_q", (rng.standard_normal((k, 32)) / 8).astype(np.float32)),
            ("W_outside", (rng.standard_normal((k, 16)) / 8).astype(np.float32)))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    tokens = draw_samples(rng.integers(0, vocab, 2000), samples=8, length=20, seed=3)
    return model, CalibrationSet(samples=8, length=20, token_ids=tokens)


def test_awq_does_not_fold_into_a_norm_whose_output_a_layer_outside_the_group_reads():
    """q_proj's 1/s may go into the norm's gamma only if every reader of the norm's output divides by it; the
    excluded `outside` MatMul reads it too, so a Mul goes before q_proj and `side` is the float graph's own."""
    model, data = norm_with_an_outside_reader()
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="awq", exclude=("outside",),
                                                             calibration=data))
    (layer,) = report["layers"]
    alpha = float(layer["awq"].split(",")[0].removeprefix("alpha="))
    assert layer["node"] == "q_proj" and alpha > 0, layer  # s is not 1: a fold would show
    feeds = {"input_ids": data.token_ids[:2].reshape(1, -1)}
    (_, side), (_, float_side) = run_graph(quantized, feeds), run_graph(model, feeds)
    np.testing.assert_allclose(side, float_side, rtol=1e-6, atol=1e-6)  # the same float ops on the same values
    assert layer["awq"].endswith("Mul inserted before the group"), layer


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_decoder_matches_float_and_both_phases_share_codes(fused_graphs, method):
    data = calibration()
    quantized, reports = {}, {}
    for phase, model in fused_graphs.items():
        options = quantize.Options(bits=4, block_size=32, method=method, calibration=data)
        quantized[phase], reports[phase] = quantize.run(model, options)
    rtn = {phase: quantize.run(model, quantize.Options(bits=4, block_size=32, calibration=data))
           for phase, model in fused_graphs.items()}
    rtn_report = rtn["decode"][1]
    report = reports["decode"]
    assert op_counts(quantized["decode"])["MatMulNBits"] == 15  # 7 projections x 2 layers + lm_head
    assert report["calibration"]["samples"] == 8 and report["calibration"]["tokens"] == 8 * 24
    mean = report["totals"]["mean_relative_output_error"]
    rtn_mean = rtn_report["totals"]["mean_relative_output_error"]
    print(f"{method}: mean relative layer output error {mean:.3e} vs rtn {rtn_mean:.3e}")
    assert mean <= rtn_mean
    if method == "awq":
        folds = [layer["awq"] for layer in report["layers"]]
        # every group folds, o_proj's (tied) into the value projection: no Mul is left
        assert sum("folded into" in how for how in folds) == 15 and sum("value projection" in how for how in folds) == 2
        assert op_counts(quantized["decode"]).get("Mul", 0) == op_counts(fused_graphs["decode"]).get("Mul", 0)
    # The decode graph reuses the prefill graph's codes (the memo), so the artifact stores them once.
    blobs = {phase: {onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer if t.name.endswith("_q4")}
             for phase, m in quantized.items()}
    assert len(blobs["decode"]) == 15 and blobs["decode"] == blobs["prefill"]
    def worst_difference(graphs: dict) -> float:
        return max(float(np.abs(q - f).max() / np.abs(f).max())
                   for q, f in zip(generate_logits(graphs), generate_logits(fused_graphs)))

    worst, rtn_worst = worst_difference(quantized), worst_difference({p: m for p, (m, _) in rtn.items()})
    print(f"{method}: worst relative logit/cache difference vs float {worst:.3g} (rtn {rtn_worst:.3g})")
    # Measured: awq 0.183, gptq 0.168, rtn 0.162 (4-bit weights of a random 2-layer model). The calibrated methods
    # lower the layers' output error on calibration data (above), not this worst element of held-out logits, so
    # the bound is RTN's own difference with a margin; a wrong fold or code moves logits by O(1).
    assert worst < 1.25 * rtn_worst


def test_the_pipeline_calibrates_on_the_decode_graph_where_lm_head_reads_every_token(fused_graphs, monkeypatch):
    """The prefill graph (prefill_logits: last) gives lm_head and the final norm one row per sample; the phases
    share their results, computed on the first graph quantize gets: the pipeline gives it decode's first."""
    from compiler.pipeline import run_pipeline
    from passes import calibration as calibration_module

    collected = []
    collect = calibration_module.collect_statistics

    def recording(model, names, data, progress=None):
        stats = collect(model, names, data, progress)
        collected.append({name: stats[name].rows for name in names})
        return stats

    monkeypatch.setattr(calibration_module, "collect_statistics", recording)
    spec = type("Spec", (), {"name": "quantize", "options": quantize.Options(
        bits=4, block_size=32, method="gptq", calibration=calibration(), embedding="quantized")})()
    graphs, results = run_pipeline(fused_graphs, [spec])
    assert [result.phase for result in results] == list(fused_graphs)  # reported in the graphs' order
    # One pass over the data (prefill reuses every result), every activation on all 8 x 24 tokens: lm_head's
    # input had 8 rows on the prefill graph.
    assert len(collected) == 1 and set(collected[0].values()) == {8 * 24}
    heads = [[layer for layer in result.report["layers"] if "lm_head" in layer["node"]] for result in results]
    assert len(heads[0]) == 1 and heads[0] == heads[1]  # prefill reports decode's error, not its own 8 rows'


def test_int8_recipe_settings_calibrated_beat_rtn_and_both_phases_share_codes(fused_graphs):
    """recipes/smollm2-135m-int8.yaml's quantize settings (AWQ + act-order GPTQ, 8 bits per channel, the tied table
    quantized, int8 activations per block of 16) on the packed graphs, against the same settings by RTN."""
    data = calibration()
    packed = {phase: pack_projections.run(model, pack_projections.Options())[0]
              for phase, model in fused_graphs.items()}
    settings = dict(bits=8, embedding="quantized", accuracy_level=4, int8_kernel_block=16, calibration=data)
    quantized, reports = {}, {}
    for phase, model in packed.items():
        options = quantize.Options(method="awq_gptq", gptq_act_order=True, **settings)
        quantized[phase], reports[phase] = quantize.run(model, options)
    rtn = {phase: quantize.run(model, quantize.Options(method="rtn", **settings)) for phase, model in packed.items()}
    mean = reports["decode"]["totals"]["mean_relative_output_error"]
    rtn_mean = rtn["decode"][1]["totals"]["mean_relative_output_error"]
    print(f"int8 awq_gptq: mean relative layer output error {mean:.3e} vs rtn {rtn_mean:.3e}")
    assert mean < 0.8 * rtn_mean
    assert op_counts(quantized["decode"])["MatMulNBits"] == 9  # (q+k+v, o, gate+up, down) x 2 layers + lm_head
    assert op_counts(quantized["decode"]).get("Mul", 0) == op_counts(packed["decode"]).get("Mul", 0)  # all folded
    blobs = {phase: {onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer
                     if t.name.endswith("_q8") and "_gather_" not in t.name}  # MatMulNBits' codes
             for phase, m in quantized.items()}
    assert len(blobs["decode"]) == 9 and blobs["decode"] == blobs["prefill"]
    # Logits only: the last entry is the cache, whose value rows AWQ's o_proj fold scales by design.
    float_logits = generate_logits(packed)[:-1]
    worst = {name: max(float(np.abs(q - f).max() / np.abs(f).max())
                       for q, f in zip(generate_logits(graphs), float_logits))
             for name, graphs in (("awq_gptq", quantized), ("rtn", {p: m for p, (m, _) in rtn.items()}))}
    print(f"int8: worst relative logit difference vs float {worst}")
    # Measured 0.023 (RTN 0.014) on this random 2-layer model; a wrong fold or code moves logits by O(1).
    assert worst["awq_gptq"] < 0.05


def test_a_calibrated_shared_table_keeps_one_set_of_codes_for_both_uses():
    """awq_gptq on a tied lm_head whose table the quantized embedding gathers: no AWQ input scales (the gather
    could not undo them), GPTQ on E[x xᵀ] / mean(diag) + I, and the gather still reads exactly lm_head's codes."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    decoder = build_decoder(config, random_model(config, seed=0).state_dict)
    model = fuse_and_lower(cleanup.run(export_graphs(decoder, 64)["decode"], cleanup.Options())[0], required=True)[2]
    options = quantize.Options(bits=4, block_size=32, method="awq_gptq", embedding="quantized",
                               calibration=calibration())
    quantized, report = quantize.run(model, options)
    head = next(layer for layer in report["layers"] if layer["note"])
    assert head["note"].startswith("awq_gptq without input scales") and head["awq"] is None
    assert report["embedding"]["shares_codes_with"] == head["node"]
    graph = gs.import_onnx(quantized)
    gather = next(n for n in graph.nodes if n.op == "GatherBlockQuantized")
    lm_head = next(n for n in graph.nodes if n.op == "MatMulNBits" and n.name == f"{head['node']}_q4")
    assert gather.inputs[0].values.tobytes() == lm_head.inputs[1].values.tobytes()
    assert gather.inputs[2].values.tobytes() == lm_head.inputs[2].values.tobytes()  # the same scales too
    rtn_layers = quantize.run(model, dataclasses.replace(options, method="rtn"))[1]["layers"]
    rtn = next(layer for layer in rtn_layers if layer["node"] == head["node"])
    print(f"shared table: lm_head relative output error {head['relative_output_error']:.3e} (rtn "
          f"{rtn['relative_output_error']:.3e})")
    assert head["relative_output_error"] < rtn["relative_output_error"]
    # The dequantize_linear lowering keeps the table float: lm_head is then an ordinary layer (AWQ scales, plain
    # E[x xᵀ]); it had been quantized as the shared table that report said was not quantized.
    _, dq_report = quantize.run(model, dataclasses.replace(options, lowering="dequantize_linear"))
    dq_head = next(layer for layer in dq_report["layers"] if layer["node"] == head["node"])
    assert dq_report["embedding"]["quantized"] is False and dq_head["note"] is None and dq_head["awq"] is not None


def test_overrides_set_per_layer_settings_and_unmatched_patterns_fail(fused_graphs):
    options = quantize.Options(bits=4, overrides=(quantize.Override("*layers.0/*", skip=True),
                                                  quantize.Override("*down_proj*", bits=8)))
    _, report = quantize.run(fused_graphs["decode"], options)
    kept = [s["node"] for s in report["skipped"] if s["reason"].startswith("kept float by override")]
    assert len(kept) == 7 and all("layers.0/" in node for node in kept)
    by_bits = {layer["node"].split("/")[-2]: layer["bits"] for layer in report["layers"] if "layers.1/" in layer["node"]}
    assert by_bits == {"q_proj": 4, "k_proj": 4, "v_proj": 4, "o_proj": 4, "gate_proj": 4, "up_proj": 4, "down_proj": 8}
    with pytest.raises(PassError, match=r"pattern\(s\) overrides '\*lm_head_typo\*' match no MatMul"):
        quantize.run(fused_graphs["decode"], quantize.Options(overrides=(quantize.Override("*lm_head_typo*", bits=8),)))
    with pytest.raises(PassError, match=r"overrides\[0\] \('\*down\*'\): block_size=48"):
        quantize.run(fused_graphs["decode"], quantize.Options(overrides=(quantize.Override("*down*", block_size=48),)))


def tied_model(vocab=96, hidden=64, seed=0) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """ids -> Gather(E) -> MatMul(W) -> Gemm(., E, transB=1): an embedding table the lm_head reads too."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    weight = (rng.standard_normal((hidden, hidden)) / 8).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["E", "ids"], ["x"], name="embed"),
         onnx.helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"),
         onnx.helper.make_node("Gemm", ["h", "E"], ["logits"], name="lm_head", transB=1)], "tied",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [None])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, vocab])],
        initializer=[onnx.numpy_helper.from_array(table, "E"), onnx.numpy_helper.from_array(weight, "W")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)]), table, weight


def test_quantized_embedding_shares_the_tied_lm_head_codes():
    model, table, weight = tied_model()
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, embedding="quantized"))
    assert op_counts(quantized) == {"GatherBlockQuantized": 1, "MatMulNBits": 2}
    assert report["embedding"]["shares_codes_with"] == "lm_head"
    table_q = dequantize(quantize_rtn(table.T.copy(), 4, 32, True, full_range=True)).T  # [V, H]
    weight_q = dequantize(quantize_rtn(weight, 4, 32, True, full_range=True))
    ids = np.array([0, 7, 95, 7])
    expected = (table_q[ids] @ weight_q) @ table_q.T
    np.testing.assert_allclose(run_graph(quantized, {"ids": ids})[0], expected, rtol=1e-4, atol=1e-4)
    # The gather's data and the lm_head's B are the same bytes: the writer (dedup by content) stores them once,
    # so the graph holds the table in ~4.5 bits per value instead of 32.
    totals = report["totals"]
    assert totals["graph_bytes_after"] < (table.nbytes + weight.nbytes) / 5
    assert totals["graph_bytes_after"] == quantize.unique_initializer_bytes(quantized)


def test_float_embedding_keeps_the_table_and_dequantize_linear_lowering_matches_matmulnbits(fused_graphs):
    model, table, weight = tied_model()
    _, report = quantize.run(model, quantize.Options(bits=4))
    assert report["embedding"]["quantized"] is False and report["totals"]["graph_bytes_after"] > table.nbytes
    decode = fused_graphs["decode"]
    nbits, _ = quantize.run(decode, quantize.Options(bits=4, block_size=32, full_range=False))  # TensorRT's grid
    dq, dq_report = quantize.run(decode, quantize.Options(bits=4, block_size=32, lowering="dequantize_linear"))
    assert op_counts(dq)["DequantizeLinear"] == 15 and "MatMulNBits" not in op_counts(dq)
    assert dq_report["totals"]["quantized"] == 15
    feeds = {"input_ids": np.array([[1, 5, 9]]), "position_ids": np.array([[0, 1, 2]]),
             "attention_mask": np.ones((1, 3), np.int64)}
    feeds.update({i.name: np.zeros([1] + [d.dim_value for d in i.type.tensor_type.shape.dim[1:]], np.float32)
                  for i in decode.graph.input if i.name.startswith("past")})
    np.testing.assert_allclose(run_graph(dq, feeds)[0], run_graph(nbits, feeds)[0], rtol=1e-4, atol=1e-4)


def test_a_spec_without_tokens_is_refused_with_how_to_fix():
    model, _, _ = tied_model()
    spec_only = quantize.Options(method="gptq", calibration=CalibrationSpec())
    with pytest.raises(PassError, match="got a CalibrationSpec, not tokens: run it through the build"):
        quantize.run(model, spec_only)


def test_awq_gptq_rounds_the_scaled_weight_on_the_second_moment_of_the_scaled_input():
    """awq_gptq: the MatMul reads x / s and holds the rounding of diag(s) W, whose input statistics are
    E[(x/s)(x/s)ᵀ] = H / (s sᵀ); GPTQ on plain H would weigh each channel's error by the wrong s². The graph must
    compute x diag(1/s) GPTQ(diag(s) W, H / (s sᵀ)), s being AWQ's search on (H, E|x|)."""
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((100, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32)  # uneven channels
    weight = rng.standard_normal((64, 16)).astype(np.float32)
    model = gather_matmul(table, weight)
    tokens = draw_samples(rng.integers(0, 100, 2000), samples=8, length=20, seed=3)
    data = CalibrationSet(samples=8, length=20, token_ids=tokens)
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="awq_gptq",
                                                             calibration=data))
    stats = collect_statistics(model, ["x"], data)["x"]
    scales, record = awq_search([weight], stats.hessian, stats.mean_abs, 4, 32, True, full_range=True)
    rounded = quantize_gptq(weight * scales[:, None], stats.hessian / np.outer(scales, scales), 4, 32, True,
                            full_range=True)
    effective = dequantize(rounded) / scales[:, None]
    session = ort.InferenceSession(quantized.SerializeToString(), providers=["CPUExecutionProvider"])
    computed = np.concatenate([session.run(None, {"input_ids": sample[None]})[0][0] for sample in tokens])
    expected = table[tokens.reshape(-1)].astype(np.float64) @ effective
    assert record["alpha"] > 0  # s is not 1, so H / (s sᵀ) is not H
    # float32 kernels: within 1e-5 of the largest output; GPTQ on plain H moves outputs by 5% of it
    np.testing.assert_allclose(computed, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    (layer,) = report["layers"]
    assert layer["relative_output_error"] == pytest.approx(relative_output_error(weight, effective, stats.hessian),
                                                           rel=1e-6)


def tied_model_fed_input_ids(vocab=96, hidden=64, seed=0) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """tied_model read from input_ids [1, L] (what calibration feeds), flattened to the ids its Gather reads."""
    model, table, weight = tied_model(vocab, hidden, seed)
    graph = model.graph
    graph.node.insert(0, onnx.helper.make_node("Reshape", ["input_ids", "flat"], ["ids"], name="flatten"))
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"))
    del graph.input[:]
    graph.input.append(onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, None]))
    return model, table, weight


def test_a_calibrated_shared_table_is_gptq_on_the_normalised_hessian_plus_identity():
    """The table both the quantized embedding and the tied lm_head read: its rows' own error ‖Δ‖² (the gather) counts
    as much as lm_head's output error, so GPTQ rounds Eᵀ on H / mean(diag H) + I (H: lm_head's input statistics),
    without AWQ scales. proj is kept float, so the logits are (Ê[ids] W) Êᵀ with that one rounded table Ê."""
    model, table, weight = tied_model_fed_input_ids()
    tokens = draw_samples(np.random.default_rng(0).integers(0, 96, 2000), samples=8, length=20, seed=3)
    data = CalibrationSet(samples=8, length=20, token_ids=tokens)
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="awq_gptq",
                                                             embedding="quantized", exclude=("proj",),
                                                             calibration=data))
    hessian = collect_statistics(model, ["h"], data)["h"].hessian
    shared = hessian / np.mean(np.diag(hessian)) + np.eye(len(hessian))
    table_q = dequantize(quantize_gptq(table.T.copy(), shared, 4, 32, True, full_range=True)).T  # [V, H]
    ids = np.array([[0, 7, 95, 7, 40]])
    expected = (table_q[ids[0]] @ weight) @ table_q.T
    # float32 kernels: within 1e-5 of the largest logit; a table rounded on H without I moves them by 20%
    np.testing.assert_allclose(run_graph(quantized, {"input_ids": ids})[0], expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())
    (head,) = report["layers"]
    assert head["node"] == "lm_head" and head["awq"] is None and report["embedding"]["shares_codes_with"] == "lm_head"
    assert head["relative_output_error"] == pytest.approx(
        relative_output_error(table.T, table_q.T, hessian), rel=1e-6)  # reported on lm_head's own H


def test_gptq_pads_a_partial_last_block_like_rtn():
    weight, hessian, _ = correlated_layer(k=80, n=24, rows=2048)
    qw = quantize_gptq(weight, hessian, 4, 32, symmetric=True)
    assert qw.codes.shape == (24, 96) and qw.scales.shape == (24, 3) and dequantize(qw).shape == (80, 24)
    assert np.all(qw.codes[:, 80:] == 8)  # padding encodes 0
    rtn = quantize_rtn(weight, 4, 32, symmetric=True)
    assert relative_output_error(weight, dequantize(qw), hessian) <= relative_output_error(weight, dequantize(rtn), hessian)


def test_calibration_runs_a_float16_graph():
    """Probed activations were declared float32, which onnxruntime refused for a float16 graph's tensors
    ("calibration: onnxruntime cannot run the float graph")."""
    from tests.passes.test_fuse_attention import CONFIG as config

    model = export_graphs(build_decoder(config, random_model(config, seed=0).state_dict), 32, dtype="float16")["prefill"]
    model = cleanup.run(model, cleanup.Options())[0]
    data = calibration(samples=2, length=8)
    _, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="gptq", calibration=data))
    errors = [layer["relative_output_error"] for layer in report["layers"]]
    assert errors and all(np.isfinite(errors))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_an_input_that_was_always_zero_is_round_to_nearest_not_nan(act_order):
    weight, _, _ = correlated_layer(k=64, n=16, rows=256)
    qw = quantize_gptq(weight, np.zeros((64, 64)), 4, 32, symmetric=True, act_order=act_order)  # scales were NaN
    rtn = quantize_rtn(weight, 4, 32, symmetric=True)
    assert np.isfinite(qw.scales).all() and np.array_equal(dequantize(qw), dequantize(rtn))


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_act_orders_block_scales_ignore_the_weights_of_dead_inputs(symmetric):
    """Act-order fixes its block scales before the loop: they came from the weight before its dead inputs' rows were
    zeroed (as the loop rounds them), so a dead input's large weight widened its block (a review: 3.4x plain GPTQ's
    output error). The same scales and codes now as with those rows zeroed beforehand."""
    weight, hessian, _ = correlated_layer(k=128, n=32, rows=2048)
    dead = [0, 5, 40, 41, 100]
    hessian = hessian.copy()
    hessian[dead, :] = 0.0
    hessian[:, dead] = 0.0
    loud, zeroed = weight.copy(), weight.copy()
    loud[dead] *= 8
    zeroed[dead] = 0.0
    a, b = (quantize_gptq(w, hessian, 4, 32, symmetric, act_order=True) for w in (loud, zeroed))
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
    plain = output_error(loud, dequantize(quantize_gptq(loud, hessian, 4, 32, symmetric)), hessian)
    assert output_error(loud, dequantize(a), hessian) <= 1.1 * plain


def test_calibration_on_a_graph_that_overflows_is_refused_naming_the_tensor():
    """A float16 graph whose activation overflowed on one calibration token: E[x xᵀ] was inf, GPTQ wrote NaN scales
    without a word, and the layer gave NaN for every input (a review)."""
    rng = np.random.default_rng(0)
    vocab, k, n = 50, 64, 32
    table = rng.standard_normal((vocab, k)).astype(np.float16)
    table[7, 3] = 40000
    gain = np.ones(k, np.float16)
    gain[3] = 2  # 80000: past float16's 65504
    weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float16)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["x"], name="embed"),
         helper.make_node("Mul", ["x", "gain"], ["y"], name="scale"),
         helper.make_node("MatMul", ["y", "W"], ["logits"], name="proj")], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, [1, "s", n])],
        [numpy_helper.from_array(a, name) for a, name in ((table, "table"), (gain, "gain"), (weight, "W"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    tokens = rng.integers(0, vocab, (4, 16))
    tokens[tokens == 7] = 8
    tokens[1, 5] = 7  # the one token whose row overflows
    options = quantize.Options(bits=4, block_size=32, method="gptq",
                               calibration=CalibrationSet(samples=4, length=16, token_ids=tokens))
    with pytest.raises(PassError, match=r"calibration: the float graph's tensor y is not finite \(inf or NaN\) on "
                                        r"sample 2 of 4, at its token 5, channel 3: .*export in float32"):
        quantize.run(model, options)


def test_gptq_on_fewer_calibration_tokens_than_it_needs_is_warned_of():
    """GPTQ fitted 16 tokens for a 256-input layer (0.02x round to nearest's error on them, 1.36x on others), and the
    report's per-layer error, measured on those tokens, looked excellent."""
    from passes.quantize import GPTQ_TOKENS_PER_INPUT, too_few_tokens_for_gptq

    from types import SimpleNamespace

    targets = [SimpleNamespace(weight=np.zeros((k, 8)), settings=SimpleNamespace(method=method))
               for k, method in ((256, "awq_gptq"), (64, "gptq"), (512, "rtn"))]  # the widest GPTQ input: 256
    few = CalibrationSet(samples=2, length=8, token_ids=np.zeros((2, 8), np.int64))
    enough = CalibrationSet(samples=4, length=256, token_ids=np.zeros((4, 256), np.int64))
    assert too_few_tokens_for_gptq(targets, few) == (
        f"quantize: GPTQ calibrates on 16 tokens for inputs of up to 256 channels: it can fit those tokens rather "
        f"than the model, and do worse than round to nearest on other text (the per-layer errors are measured on the "
        f"calibration tokens); give at least {GPTQ_TOKENS_PER_INPUT * 256:,} (calibration.samples x "
        f"calibration.length)")
    assert too_few_tokens_for_gptq(targets, enough) is None
    assert too_few_tokens_for_gptq([t for t in targets if t.settings.method == "rtn"], few) is None
    model, _, _ = tied_model_fed_input_ids(hidden=64)  # through the pass: a warning, in its report too (the manifest)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 8))
    for progress in (None, said := []):
        calibration = CalibrationSet(samples=2, length=8, token_ids=tokens,
                                     progress=None if progress is None else progress.append)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method="gptq",
                                                             calibration=calibration))
        assert len(report["warnings"]) == 1 and report["warnings"][0].startswith("quantize: GPTQ calibrates on 16")
        shown = [str(w.message) for w in caught] if progress is None else said
        assert [line for line in shown if "GPTQ calibrates" in line] == [
            report["warnings"][0] if progress is None else f"warning: {report['warnings'][0]}"]


@pytest.mark.parametrize("name", FORMATS)
def test_awq_range_clipping_never_loses_to_round_to_nearest(name):
    from passes.quantize_algorithms import quantize_clipped

    bits, block_size, symmetric = FORMATS[name]
    weight, hessian, _ = correlated_layer(n=48)
    rtn = relative_output_error(weight, dequantize(quantize_rtn(weight, bits, block_size, symmetric)), hessian)
    clipped = relative_output_error(weight, dequantize(quantize_clipped(weight, hessian, bits, block_size, symmetric)),
                                    hessian)
    print(f"{name}: rtn {rtn:.3e} clipped {clipped:.3e}")
    assert clipped <= rtn * (1 + 1e-6)  # ratio 1 is RTN; each block keeps its best ratio by its own error


def test_a_padded_quantized_embedding_still_shares_the_lm_head_codes():
    """hidden 80, blocks of 32: the last block is partial; the gather reads the padded rows and slices them."""
    model, table, weight = tied_model(hidden=80)
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, embedding="quantized"))
    assert op_counts(quantized) == {"GatherBlockQuantized": 1, "Slice": 1, "MatMulNBits": 2}
    table_q = dequantize(quantize_rtn(table.T.copy(), 4, 32, True, full_range=True)).T
    weight_q = dequantize(quantize_rtn(weight, 4, 32, True, full_range=True))
    ids = np.array([3, 0, 95])
    np.testing.assert_allclose(run_graph(quantized, {"ids": ids})[0], (table_q[ids] @ weight_q) @ table_q.T,
                               rtol=1e-4, atol=1e-4)
    packed_table = 96 * 3 * 16  # V rows x 3 blocks x 16 bytes: stored once for both ops
    assert report["totals"]["graph_bytes_after"] < packed_table + 96 * 3 * 4 + weight.nbytes / 4


@pytest.mark.parametrize("name", ["int4_b32_sym", "int4_b128_sym", "int4_b32_asym", "int8_channel"])
def test_gptq_act_order_keeps_the_format_and_does_not_lose_to_plain_gptq(name):
    """Act-order (channels by decreasing E[x²], block scales fixed first) on uneven, correlated activations."""
    bits, block_size, symmetric = FORMATS[name]
    weight, hessian, _ = correlated_layer(k=256, n=48)
    plain = quantize_gptq(weight, hessian, bits, block_size, symmetric)
    ordered = quantize_gptq(weight, hessian, bits, block_size, symmetric, act_order=True)
    errors = [relative_output_error(weight, dequantize(qw), hessian) for qw in (plain, ordered)]
    print(f"{name}: gptq {errors[0]:.3e}, act-order {errors[1]:.3e}")
    assert ordered.codes.shape == plain.codes.shape and ordered.scales.shape == plain.scales.shape
    assert ordered.codes.max() < 2**bits
    # Here a few channels carry most of E[x²]: rounded first, their error is spread over all the others
    # (measured: 4-bit ratios below 0.5; 8 bits per channel 0.59, where plain GPTQ's error is already small).
    assert errors[1] < (0.5 if bits == 4 else 0.7) * errors[0]


def test_scale_refit_recovers_the_scales_of_weights_that_are_exactly_on_a_grid():
    """W = (codes - zero) * true scales, handed over with wrong scales: the least-squares refit finds the true ones."""
    rng = np.random.default_rng(3)
    _, hessian, _ = correlated_layer(k=96, n=12, rows=2048)
    for zero_points in (None, rng.integers(3, 13, (12, 3)).astype(np.uint8)):
        codes = rng.integers(0, 16, (12, 96)).astype(np.uint8)
        true_scales = rng.uniform(0.01, 0.1, (12, 3)).astype(np.float32)
        exact = QuantizedWeight(codes, true_scales, zero_points, 4, 32, 96, 12)
        off = dataclasses.replace(exact, scales=true_scales * rng.uniform(0.7, 1.3, (12, 3)).astype(np.float32))
        refit = refit_scales(dequantize(exact), off, hessian)
        np.testing.assert_allclose(refit.scales, true_scales, rtol=1e-4)
        assert refit.codes is off.codes and refit.zero_points is off.zero_points


def test_a_refit_that_would_flip_a_scales_sign_keeps_the_old_scales():
    """Codes of -W with positive scales: the least-squares fit of W is a negative scale, which TensorRT refuses and
    the sign guard keeps out (GPTQ's own layers never flip one: a mutation audit found nothing asserted it)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 8)).astype(np.float32)
    activations = rng.standard_normal((256, 64))
    flipped = quantize_rtn(-weight, 4, 32, True)
    refit = refit_scales(weight, flipped, activations.T @ activations / 256)
    assert (refit.scales > 0).all()
    np.testing.assert_array_equal(refit.scales, flipped.scales)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_scale_refit_lowers_the_output_error_keeps_codes_and_signs(name, act_order):
    bits, block_size, symmetric = FORMATS[name]
    weight, hessian, _ = correlated_layer(k=256, n=48)
    for full_range in ([False, True] if symmetric and bits == 4 else [False]):
        qw = quantize_gptq(weight, hessian, bits, block_size, symmetric, act_order=act_order, full_range=full_range)
        unfitted = quantize_gptq(weight, hessian, bits, block_size, symmetric, act_order=act_order,
                                 full_range=full_range, refit=False)
        errors = [relative_output_error(weight, dequantize(q), hessian) for q in (unfitted, qw)]
        print(f"{name} act_order={act_order} full_range={full_range}: before refit {errors[0]:.3e}, after {errors[1]:.3e}")
        np.testing.assert_array_equal(qw.codes, unfitted.codes)
        assert np.all(np.sign(qw.scales) == np.sign(unfitted.scales))  # TensorRT's grid keeps positive scales
        assert errors[1] < (0.98 if act_order else 0.9) * errors[0]



def test_awq_gives_siblings_of_different_formats_one_scale_search_and_one_fold(fused_graphs):
    """An override that gives q_proj 8 bits while k/v keep 4: the three read one normalized input, whose 1/s folds
    once into the norm, so they must share one scale vector, searched over their own formats together."""
    options = quantize.Options(bits=4, method="awq", calibration=calibration(),
                               overrides=(quantize.Override("*q_proj*", bits=8),))
    model, report = quantize.run(fused_graphs["prefill"], options)
    for layer in ("layers.0/", "layers.1/"):
        rows = {row["node"].split("/")[-2]: row for row in report["layers"]
                if layer in row["node"] and row["node"].split("/")[-2] in ("q_proj", "k_proj", "v_proj")}
        assert {name: row["bits"] for name, row in rows.items()} == {"q_proj": 8, "k_proj": 4, "v_proj": 4}
        scalings = {row["awq"] for row in rows.values()}
        assert len(scalings) == 1 and "folded into" in scalings.pop(), rows
    graph = gs.import_onnx(model)
    assert not [node for node in graph.nodes if node.op == "Mul" and "awq" in node.name and "layers" in node.name
                and "q_proj" in node.name]


def repeated_layer_model(weight: np.ndarray, seed: int = 0) -> tuple[onnx.ModelProto, CalibrationSet]:
    """Two layers with equal weights (as a depth-upscaled model has) reading differently distributed inputs:
    layer0 reads the embedding x, layer1 reads x @ MIX (channels mixed and rescaled)."""
    rng = np.random.default_rng(seed)
    hidden = weight.shape[0]
    table = (rng.standard_normal((50, hidden)) * np.exp(1.5 * rng.standard_normal(hidden))).astype(np.float32)
    mix = (np.linalg.qr(rng.standard_normal((hidden, hidden)))[0] * np.exp(rng.standard_normal(hidden))).astype(np.float32)
    helper, tensor = onnx.helper, onnx.numpy_helper.from_array
    graph = helper.make_graph(
        [helper.make_node("Gather", ["T", "input_ids"], ["x"], name="embed"),
         helper.make_node("MatMul", ["x", "W_layer0"], ["a"], name="layer0"),
         helper.make_node("MatMul", ["x", "MIX"], ["x2"], name="mix"),
         helper.make_node("MatMul", ["x2", "W_layer1"], ["b"], name="layer1"),
         helper.make_node("Add", ["a", "b"], ["y"], name="add")], "repeated",
        [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [tensor(table, "T"), tensor(weight, "W_layer0"), tensor(weight.copy(), "W_layer1"), tensor(mix, "MIX")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    tokens = draw_samples(rng.integers(0, 50, 2000), samples=20, length=20, seed=3)
    return model, CalibrationSet(samples=20, length=20, token_ids=tokens)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layers_with_equal_weights_are_each_calibrated_on_their_own_inputs(method):
    """The results memo was keyed by the weight's content alone: layer1 got layer0's GPTQ codes (E[x xᵀ] of the
    other input: output error 0.0112 against 9.2e-05 on its own, and RTN's 0.0060) or layer0's AWQ scales, and
    the report gave it layer0's error."""
    weight = (np.random.default_rng(1).standard_normal((64, 64)) / 8).astype(np.float32)
    model, calibration = repeated_layer_model(weight)
    quantized, report = quantize.run(model, quantize.Options(bits=4, block_size=32, method=method, exclude=("mix",),
                                                             calibration=calibration))
    statistics = collect_statistics(model, ["x", "x2"], calibration)
    errors = {layer["node"]: layer["relative_output_error"] for layer in report["layers"]}
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in quantized.graph.initializer}
    if method == "gptq":
        own = quantize_gptq(weight, statistics["x2"].hessian, 4, 32, True, full_range=True)
        assert errors["layer1"] == pytest.approx(relative_output_error(weight, dequantize(own), statistics["x2"].hessian))
        assert errors["layer1"] < errors["layer0"] / 5  # layer0's own inputs: a different error
        inputs = {n.name: n.input[1] for n in quantized.graph.node if n.op_type == "MatMulNBits"}
        assert inputs["layer0_q4"] != inputs["layer1_q4"]
    else:
        own, _ = awq_search([weight], statistics["x2"].hessian, statistics["x2"].mean_abs, 4, 32, True, full_range=True)
        np.testing.assert_allclose(initializers["x2_awq_inverse_scales"], 1 / own, rtol=1e-6)
        assert not np.allclose(initializers["x_awq_inverse_scales"], initializers["x2_awq_inverse_scales"])


def test_draw_samples_takes_whole_windows_without_overlap_chosen_by_the_seed():
    tokens = np.arange(70)  # 4 windows of 16, and 6 tokens left over
    np.testing.assert_array_equal(draw_samples(tokens, 4, 16, seed=0), np.arange(64).reshape(4, 16))  # just enough
    draws = [draw_samples(tokens, 3, 16, seed=seed) for seed in range(8)]
    for drawn in draws:
        starts = drawn[:, 0]
        assert drawn.dtype == np.int64 and drawn.shape == (3, 16) and list(starts) == sorted(set(starts))
        assert all(start % 16 == 0 and np.array_equal(row, np.arange(start, start + 16))
                   for start, row in zip(starts, drawn))
    assert len({drawn.tobytes() for drawn in draws}) > 1  # the seed chooses which windows
    np.testing.assert_array_equal(draw_samples(tokens, 3, 16, seed=5), draws[5])  # and the same seed, the same ones


def test_calibration_feeds_an_empty_past_to_a_graph_whose_past_length_is_dynamic():
    """Gather(table, ids) after a past of dynamic length (its batch axis dynamic too): the zero feed has batch 1 and
    past length 0, so the activation holds this sample's rows only."""
    table = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "input_ids"], ["new"]),
         onnx.helper.make_node("Concat", ["past", "new"], ["x"], axis=1)], "g",
        [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "length"]),
         onnx.helper.make_tensor_value_info("past", onnx.TensorProto.FLOAT, ["batch", "past_length", 16])],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(table, "table")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    tokens = np.arange(12).reshape(2, 6)
    stats = collect_statistics(model, ["x"], CalibrationSet(samples=2, length=6, token_ids=tokens))["x"]
    assert stats.rows == 12
    np.testing.assert_allclose(stats.mean_abs, np.abs(table[:12]).mean(axis=0), rtol=1e-6)


# -- the report's totals are the mean and max of its layers' output errors ------------
def test_the_reports_mean_and_max_output_errors_are_over_its_layers(fused_graphs):
    _, report = quantize.run(fused_graphs["decode"], quantize.Options(bits=4, block_size=32, calibration=calibration()))
    errors = np.array([layer["relative_output_error"] for layer in report["layers"]])
    assert len(errors) == 15 and (errors > 0).all()
    assert report["totals"]["mean_relative_output_error"] == pytest.approx(errors.mean(), rel=1e-12)
    assert report["totals"]["max_relative_output_error"] == errors.max()
    assert report["totals"]["mean_relative_output_error"] != pytest.approx(np.median(errors), rel=1e-9)


def test_a_pattern_naming_some_parts_of_a_packed_matmul_is_refused(fused_graphs):
    """pack_projections joins q/k/v into one MatMul named '.../q_proj+k_proj+v_proj.packed_MatMul': '*v_proj*' matched
    it, and the override set q and k too without a word. A pattern naming the packed node, or every part, is taken."""
    packed = pack_projections.run(fused_graphs["decode"], pack_projections.Options())[0]
    with pytest.raises(PassError, match=r"overrides '\*v_proj\*' names v_proj of the packed MatMul "
                                        r"'/decoder/layers.0/self_attn/q_proj\+k_proj\+v_proj.packed_MatMul', which also "
                                        r"computes q_proj, k_proj .*'\*q_proj\+k_proj\+v_proj\*'.*drop pack_projections"):
        quantize.run(packed, quantize.Options(bits=4, overrides=(quantize.Override("*v_proj*", bits=8),)))
    with pytest.raises(PassError, match=r"exclude '\*/up_proj/\*' names up_proj of the packed MatMul"):
        quantize.run(packed, quantize.Options(bits=4, exclude=("*/up_proj/*",)))
    _, report = quantize.run(packed, quantize.Options(bits=4, exclude=("*/self_attn/*_proj/MatMul",)))
    kept = {s["node"].split("/")[-1] for s in report["skipped"] if "layers.0/" in s["node"]}
    assert kept == {"q_proj+k_proj+v_proj.packed_MatMul", "MatMul"}, kept  # every part named: the packed node too
    for whole in ("*q_proj+k_proj+v_proj*", "*self_attn*", "*packed_MatMul"):
        _, report = quantize.run(packed, quantize.Options(bits=4, overrides=(quantize.Override(whole, bits=8),)))
        assert {layer["bits"] for layer in report["layers"] if "v_proj" in layer["node"]} == {8}, whole
    # a pattern cut from the packed name, the refusal's own example trimmed to the wanted parts, set q_proj too
    for some, named in (("*k_proj+v_proj*", "k_proj, v_proj"), ("*q_proj+k_proj*", "q_proj, k_proj"),
                        ("*k_proj+v_proj.packed_weight", "k_proj, v_proj")):  # the packed weight's name too
        with pytest.raises(PassError, match=rf"overrides '{re.escape(some)}' names {named} of the packed MatMul"):
            quantize.run(packed, quantize.Options(bits=4, overrides=(quantize.Override(some, bits=8),)))


def test_awq_reads_a_bfloat16_activations_type():
    """graphsurgeon names bfloat16 by its ONNX number (16): AWQ's folded Mul took np.dtype(16), a TypeError from
    inside the pass."""
    import ml_dtypes

    from passes.awq_fold import _dtype

    assert _dtype(gs.Variable("x", dtype=onnx.TensorProto.BFLOAT16)) == np.dtype(ml_dtypes.bfloat16)
    assert _dtype(gs.Variable("x", dtype=np.float16)) == np.float16 and _dtype(gs.Variable("x")) == np.float32


def test_torchs_generated_weight_names_are_not_patterns_and_the_refusal_shows_real_names(fused_graphs):
    """Weights without a name of the model's own are onnx::MatMul_594 in decode and onnx::MatMul_579 in prefill: a
    pattern over them set the two phases' layers apart (one int8, the other int4) without a word."""
    generated = next(node.input[1] for node in fused_graphs["decode"].graph.node
                     if node.op_type == "MatMul" and node.input[1].startswith("onnx::"))
    with pytest.raises(PassError, match=rf"overrides '{re.escape(generated)}' match no MatMul node or weight name; "
                                        r"patterns are fnmatch globs \(case-sensitive\) over ONNX node names such as "
                                        r"'/decoder/layers.N/"):
        quantize.run(fused_graphs["decode"], quantize.Options(bits=4, overrides=(quantize.Override(generated, bits=8),)))
