"""dequantize_weights: MatMulNBits -> DequantizeLinear -> MatMul over the same codes gives the format's float weights
(checked against a numpy decoding of the initializers), which onnxruntime folds at load only with the session
config the pass records; in a decoder it rewrites the prefill graph's per-token products and keeps the lm_head."""
from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler.errors import BuildError
from compiler.pipeline import check_passes, run_pipeline
from compiler.recipe import PassSpec
from passes import dequantize_weights, fuse_silu, quantize, skip_unused_rows
from passes.errors import PassError
from passes.session_config import session_config
from tests.passes.test_fuse_attention import decoder_graphs, generate_logits  # noqa: F401
from tests.passes.test_quantize import matmul_model, random_weight
from tests.passes.test_skip_unused_rows import DEFAULT_RECIPE_PASSES, run_passes

# name: quantize options, on a [K, N] = [80, 48] weight: K = 80 is 2.5 blocks of 32 (a padded last block, and an
# odd block count, whose packed INT4 zero points end in a padding nibble)
FORMATS = {
    "int4-symmetric-full-range": dict(bits=4, block_size=32),
    "int4-zero-points": dict(bits=4, block_size=32, symmetric=False),
    "int4-zero-points-block-64": dict(bits=4, block_size=64, symmetric=False),  # 2 blocks: zero points fill a byte
    "int4-block-16": dict(bits=4, block_size=16),
    "int8-per-channel-kernel-block-16": dict(bits=8, int8_kernel_block=16),  # INT8 is symmetric per channel
}


def inputs_of(model: onnx.ModelProto, node: onnx.NodeProto) -> dict[str, np.ndarray]:
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return {name: initializers[name] for name in node.input[1:4] if name}


def decoded_weight(model: onnx.ModelProto) -> np.ndarray:
    """The MatMulNBits format decoded in numpy from the node's initializers: [K, N] = (code - zero point) * scale."""
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    bits, block, k, n = attrs["bits"], attrs["block_size"], attrs["K"], attrs["N"]
    blob, scales, *zero_points = inputs_of(model, node).values()
    blocks = -(-k // block)

    def unpack(packed):  # low-first: with 4 bits, element 2i is byte i's low nibble
        return packed if bits == 8 else np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    codes = unpack(blob).reshape(n, blocks, block).astype(np.float32)
    zero = unpack(zero_points[0].reshape(n, -1))[:, :blocks, None] if zero_points else 1 << (bits - 1)
    weight = (codes - zero) * scales.reshape(n, blocks, 1)
    return weight.reshape(n, blocks * block)[:, :k].T


def session(model: onnx.ModelProto, config: dict | None = None, optimized_path=None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


@pytest.mark.parametrize("name", FORMATS)
def test_the_float_product_is_the_formats_own_weight(name, tmp_path):
    weight = random_weight(k=80, n=48)
    quantized, _ = quantize.run(matmul_model(weight), quantize.Options(**FORMATS[name]))
    rewritten, report = dequantize_weights.run(quantized, dequantize_weights.Options())
    assert report["applied"] and report["rewritten"] == ["proj_q" + str(FORMATS[name]["bits"])]
    assert report["float_weight_bytes_at_load"] == 80 * 48 * 4  # float32
    assert op_counts(rewritten)["MatMulNBits"] == 0 and op_counts(rewritten)["DequantizeLinear"] == 1
    # The codes stay in the very initializers MatMulNBits read (a decode graph shares them by name); the new
    # constants are shapes, masks and shifts.
    before = {t.name: t for t in quantized.graph.initializer}
    after = {t.name: t for t in rewritten.graph.initializer}
    assert set(before) <= set(after) and all(after[name] == before[name] for name in before)
    assert all(onnx.numpy_helper.to_array(after[name]).nbytes <= 64 for name in set(after) - set(before))
    assert session_config(rewritten) == {"session.disable_quant_qdq": "1"} == report["session_config"]

    x = np.random.default_rng(1).standard_normal((2, 3, 80)).astype(np.float32)
    reference = x @ decoded_weight(quantized)
    folded = session(rewritten, session_config(rewritten), tmp_path / "optimized.onnx").run(None, {"X": x})[0]
    difference = np.abs(folded - reference).max()
    print(f"{name}: folded float product vs numpy decoding, max abs diff {difference:.2e}")
    assert difference <= 1e-5
    # With the recorded config onnxruntime folds the unpacking into a float initializer: one MatMul is left.
    assert dict(op_counts(onnx.load(tmp_path / "optimized.onnx"))) == {"MatMul": 1}


@pytest.mark.parametrize("k, left", [(64, {"MatMulNBits": 1}), (80, {"DequantizeLinear": 1, "Slice": 1, "MatMul": 1})])
def test_without_the_session_config_onnxruntime_does_not_fold_it(k, left, tmp_path):
    quantized, _ = quantize.run(matmul_model(random_weight(k=k, n=48)), quantize.Options(bits=4, block_size=32))
    rewritten, _ = dequantize_weights.run(quantized, dequantize_weights.Options())
    x = np.random.default_rng(2).standard_normal((2, 3, k)).astype(np.float32)
    plain = session(rewritten, None, tmp_path / "optimized.onnx").run(None, {"X": x})[0]
    reference = x @ decoded_weight(quantized)
    # Still the same product, but fused back into MatMulNBits (onnxruntime's fusion sets accuracy level 4: int8
    # activations, hence the looser bound), or, past a padded block's Slice, dequantized again at every run.
    assert np.abs(plain - reference).max() <= 0.05 * np.abs(reference).max()
    assert dict(op_counts(onnx.load(tmp_path / "optimized.onnx"))) == left


def test_a_two_d_activation_keeps_its_integer_kernel_where_logits_are_one_row_per_sequence():
    model = matmul_model(random_weight(k=64, n=48))
    for value in (*model.graph.input, *model.graph.output):
        del value.type.tensor_type.shape.dim[0]  # [3, K]: a product on selected rows, like the prefill lm_head
    model.graph.output[0].name = model.graph.node[0].output[0] = "logits"  # [3, N]: one row per sequence
    quantized, _ = quantize.run(model, quantize.Options(bits=4, block_size=32))
    result, report = dequantize_weights.run(quantized, dequantize_weights.Options())
    assert result is quantized and not report["applied"]
    assert "2-D activation [3, 64] in a graph whose logits are one row per sequence" in report["kept"][0]["reason"]
    assert report["reason"] == "every MatMulNBits left is kept (1: see kept)"  # not "no MatMulNBits to rewrite"
    # With 3-D logits (prefill_logits: all) a 2-D lm_head input is every token's row: rewritten
    every_row = onnx.ModelProto()
    every_row.CopyFrom(quantized)
    every_row.graph.output[0].type.tensor_type.shape.dim.insert(0, onnx.TensorShapeProto.Dimension(dim_value=1))
    assert dequantize_weights.run(every_row, dequantize_weights.Options())[1]["applied"]


def with_bias(model: onnx.ModelProto, bias: np.ndarray) -> onnx.ModelProto:
    """The model's MatMulNBits with a bias input [N] (position 5: zero points, if absent, and g_idx omitted)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    (node,) = [n for n in result.graph.node if n.op_type == "MatMulNBits"]
    result.graph.initializer.append(onnx.numpy_helper.from_array(bias, "bias"))
    node.input.extend([""] * (5 - len(node.input)) + ["bias"])
    return result


def test_a_bias_is_added_to_the_float_product():
    quantized, _ = quantize.run(matmul_model(random_weight(k=80, n=48)), quantize.Options(bits=4, block_size=32))
    bias = np.linspace(-1, 1, 48, dtype=np.float32)
    biased = with_bias(quantized, bias)
    rewritten, report = dequantize_weights.run(biased, dequantize_weights.Options())
    assert report["applied"] and op_counts(rewritten)["Add"] == 1
    x = np.random.default_rng(1).standard_normal((2, 3, 80)).astype(np.float32)
    folded = session(rewritten, session_config(rewritten)).run(None, {"X": x})[0]
    np.testing.assert_allclose(folded, x @ decoded_weight(quantized) + bias, rtol=0, atol=1e-5)


def set_attribute(name: str, value: int):
    def edit(model: onnx.ModelProto) -> None:
        (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        next(a for a in node.attribute if a.name == name).i = value
    return edit


def add_g_idx(model: onnx.ModelProto) -> None:
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.arange(80, dtype=np.int32) // 32, "g_idx"))
    node.input.extend(["", "g_idx"])  # no zero points


def scales_as_graph_input(model: onnx.ModelProto) -> None:
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    scales = next(t for t in model.graph.initializer if t.name == node.input[2])
    model.graph.initializer.remove(scales)
    model.graph.input.append(onnx.helper.make_tensor_value_info(scales.name, scales.data_type, list(scales.dims)))


def opset_20(model: onnx.ModelProto) -> None:
    next(o for o in model.opset_import if o.domain == "").version = 20


@pytest.mark.parametrize("edit, reason", [
    (add_g_idx, "has a g_idx input"),
    (scales_as_graph_input, "its scales input is computed from a graph input"),
    (set_attribute("bits", 2), "bits 2: only 4 and 8 are unpacked"),
    (opset_20, "opset 20: DequantizeLinear takes blocks from opset 21"),
    (set_attribute("block_size", 16), "B is [48, 3, 16], not [48, 5, 8] as K, N, bits and block_size say"),
])
def test_what_is_kept_is_reported_with_the_reason(edit, reason):
    quantized, _ = quantize.run(matmul_model(random_weight(k=80, n=48)), quantize.Options(bits=4, block_size=32))
    edit(quantized)
    result, report = dequantize_weights.run(quantized, dequantize_weights.Options())
    assert result is quantized and not report["applied"]
    (kept,) = report["kept"]
    assert kept["node"] == "proj_q4" and reason in kept["reason"]


def test_session_settings_survive_the_passes_after_it():
    model = matmul_model(random_weight(k=64, n=48))
    quantize_spec = PassSpec("quantize", quantize.Options(bits=4, block_size=32))
    graphs, _ = run_pipeline({"prefill": model}, [quantize_spec, PassSpec("dequantize_weights", dequantize_weights.Options()),
                                                  PassSpec("fuse_silu", fuse_silu.Options())])  # rebuilds the graph
    assert session_config(graphs["prefill"]) == {"session.disable_quant_qdq": "1"}


def prefill_only(passes):
    return [PassSpec(module.__name__.split(".")[-1], options) for module, options in passes]


def test_in_a_decoder_prefill_runs_float_products_and_decode_keeps_matmulnbits(decoder_graphs):  # noqa: F811
    fused = {phase: run_passes(model, DEFAULT_RECIPE_PASSES) for phase, model in decoder_graphs.items()}
    # accuracy_level 0: MatMulNBits with float activations, so both forms compute the same float products
    specs = prefill_only([(quantize, quantize.Options(bits=4, block_size=32, embedding="quantized")),
                          (skip_unused_rows, skip_unused_rows.Options())])
    quantized, _ = run_pipeline(fused, specs)
    graphs, results = run_pipeline(quantized, prefill_only([(dequantize_weights, dequantize_weights.Options())]))
    reports = {result.phase: result.report for result in results}
    assert reports["decode"] == {"applied": False, "reason": "runs on prefill only (its phases option)"}
    assert graphs["decode"] is quantized["decode"]
    prefill = reports["prefill"]
    # 2 layers x (packed q/k/v, o_proj, packed gate/up, down_proj); the last layer's after skip_unused_rows too
    assert len(prefill["rewritten"]) == 8 and op_counts(graphs["prefill"])["DequantizeLinear"] == 8
    (kept,) = prefill["kept"]
    assert "lm_head" in kept["node"] and "2-D activation" in kept["reason"]
    assert op_counts(graphs["prefill"])["MatMulNBits"] == 1 and op_counts(graphs["prefill"])["GatherBlockQuantized"] == 1
    for reference, result in zip(generate_logits(quantized), generate_logits(graphs)):  # prefill, then decode steps
        np.testing.assert_allclose(result, reference, rtol=0, atol=1e-4)


def test_pass_orders_and_options_that_would_do_nothing_are_refused():
    dequantize = PassSpec("dequantize_weights", dequantize_weights.Options())
    with pytest.raises(BuildError, match="list it after quantize"):
        check_passes([dequantize, PassSpec("quantize", quantize.Options())])
    with pytest.raises(BuildError, match="after skip_unused_rows"):
        check_passes([PassSpec("quantize", quantize.Options()), dequantize,
                      PassSpec("skip_unused_rows", skip_unused_rows.Options())])
    for phases in ((), ("prefill", "prefill")):
        with pytest.raises(PassError, match="at most once, and one at least"):
            dequantize_weights.check_options(dequantize_weights.Options(phases=phases))
    with pytest.raises(PassError, match="decode reads every weight at every step"):
        dequantize_weights.check_options(dequantize_weights.Options(phases=("prefill", "decode")))
