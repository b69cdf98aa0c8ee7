"""Tests for passes/pack_projections.py: a tiny traced decoder and a hand-made graph, op counts, ort parity."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.export import export_graphs, io_names
from compiler.frontend.config import DecoderConfig
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, pack_projections

MAX_CONTEXT = 32
TOLERANCE = 1e-5


def tiny_config(attention_bias: bool) -> DecoderConfig:
    return DecoderConfig(vocab_size=260, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, attention_bias=attention_bias)


@pytest.fixture(scope="module", params=[False, True], ids=["no_bias", "qkv_bias"])
def decoder_graphs(request) -> tuple[DecoderConfig, dict[str, onnx.ModelProto]]:
    """Both phases of a 2-layer random decoder, cleaned up (a few seconds to trace)."""
    config = tiny_config(request.param)
    decoder = build_decoder(config, random_model(config, seed=0).state_dict)
    graphs = export_graphs(decoder, max_context=MAX_CONTEXT)
    return config, {phase: cleanup.run(model, cleanup.Options())[0] for phase, model in graphs.items()}


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def decoder_feeds(config: DecoderConfig, batch: int = 2, sequence: int = 5) -> dict[str, np.ndarray]:
    inputs, _ = io_names(config)
    rng = np.random.default_rng(0)
    cache = np.zeros((batch, config.num_kv_heads, MAX_CONTEXT, config.head_dim), dtype=np.float32)
    feeds = {"input_ids": rng.integers(0, config.vocab_size, (batch, sequence), dtype=np.int64),
             "position_ids": np.tile(np.arange(sequence, dtype=np.int64), (batch, 1)),
             "attention_mask": np.ones((batch, sequence), dtype=np.int64)}
    feeds.update({name: cache.copy() for name in inputs[3:]})
    return feeds


def assert_same_outputs(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        difference = np.abs(before[name] - after[name]).max()
        assert difference <= TOLERANCE, f"{name}: max difference {difference}"


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_packs_qkv_and_gate_up_of_every_layer(decoder_graphs, phase):
    config, graphs = decoder_graphs
    model = graphs[phase]
    model_bytes = model.SerializeToString()

    packed, report = pack_projections.run(model, pack_projections.Options())

    assert model.SerializeToString() == model_bytes  # pure
    assert [entry["widths"] for entry in report["packed"]] == [[32, 16, 16], [48, 48]] * 2
    assert [len(entry["nodes"]) for entry in report["packed"]] == [3, 2, 3, 2]
    assert report["skipped"] == []
    before, after = op_counts(model), op_counts(packed)
    assert after["MatMul"] == before["MatMul"] - 6  # 2 layers x ((3 - 1) + (2 - 1))
    assert after["Split"] == before["Split"] + 4
    assert after["Add"] == before["Add"] - (4 if config.attention_bias else 0)  # 3 bias Adds -> 1, per layer
    assert [entry["biases_packed"] for entry in report["packed"]] == [config.attention_bias, False] * 2
    assert report["weight_bytes"]["after"] == report["weight_bytes"]["before"]
    names = {tensor.name for tensor in packed.graph.initializer}
    assert "/decoder/layers.0/self_attn/q_proj+k_proj+v_proj.packed_weight" in names
    assert "/decoder/layers.1/mlp/gate_proj+up_proj.packed_weight" in names
    assert [value.name for value in packed.graph.input] == [value.name for value in model.graph.input]
    assert [value.name for value in packed.graph.output] == [value.name for value in model.graph.output]

    feeds = decoder_feeds(config)
    assert_same_outputs(run_ort(model, feeds), run_ort(packed, feeds))


def test_max_rewrites_packs_exactly_one_group(decoder_graphs):
    _, graphs = decoder_graphs
    model = graphs["prefill"]

    packed, report = pack_projections.run(model, pack_projections.Options(max_rewrites=1))

    assert len(report["packed"]) == 1
    assert report["packed"][0]["widths"] == [32, 16, 16]  # the first group in graph order: layer 0's q/k/v
    assert op_counts(packed)["MatMul"] == op_counts(model)["MatMul"] - 2
    assert [entry["reason"] for entry in report["skipped"]] == ["max_rewrites=1"] * (2 + 3 + 2)


def make_sibling_model() -> onnx.ModelProto:
    """
        x ─┬─► MatMul(w_a: initializer) ─► a
           └─► MatMul(w_b: graph input) ─► b       ->  not packed: w_b is not a constant
    """
    rng = np.random.default_rng(1)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w_a")
    nodes = [helper.make_node("MatMul", ["x", "w_a"], ["a"], name="matmul_a"),
             helper.make_node("MatMul", ["x", "w_b"], ["b"], name="matmul_b")]
    graph = helper.make_graph(
        nodes, "siblings",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
                helper.make_tensor_value_info("w_b", TensorProto.FLOAT, [4, 2])],
        outputs=[helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
                 helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 2])],
        initializer=[weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_sibling_with_non_constant_weight_is_skipped_with_a_reason():
    model = make_sibling_model()

    packed, report = pack_projections.run(model, pack_projections.Options())

    assert report["packed"] == []
    assert report["skipped"] == [{"node": "matmul_b", "reason": "weight_not_constant"},
                                 {"node": "matmul_a", "reason": "group_too_small"}]
    assert op_counts(packed) == op_counts(model) == Counter(MatMul=2)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "w_b": rng.standard_normal((4, 2)).astype(np.float32)}
    assert_same_outputs(run_ort(model, feeds), run_ort(packed, feeds))


def test_a_bias_on_some_siblings_only_stays_after_the_split_with_the_reason():
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rng.standard_normal((4, n)).astype(np.float32), f"w_{name}")
               for name, n in (("a", 3), ("b", 2))]
    bias = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "bias_a")
    nodes = [helper.make_node("MatMul", ["x", "w_a"], ["a0"], name="matmul_a"),
             helper.make_node("Add", ["a0", "bias_a"], ["a"], name="bias_add_a"),
             helper.make_node("MatMul", ["x", "w_b"], ["b"], name="matmul_b")]
    graph = helper.make_graph(nodes, "siblings", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", n]) for o, n in (("a", 3), ("b", 2))],
                              [*weights, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    packed, report = pack_projections.run(model, pack_projections.Options())
    (entry,) = report["packed"]
    assert not entry["biases_packed"] and entry["biases_left"].startswith("1 of 2 products have a constant bias Add")
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32)}
    assert_same_outputs(run_ort(model, feeds), run_ort(packed, feeds))


def test_attention_takes_the_packed_qkv_and_the_split_goes_away():
    """After lower_onnxruntime, packing q/k/v feeds GroupQueryAttention the packed tensor (key, value empty)."""
    from tests.passes import test_fuse_attention as fused  # its tiny config, lowering and logits harness
    from tests.passes.test_fuse_attention import CONFIG, fuse_and_lower, generate_logits

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    lowered = {phase: fuse_and_lower(cleanup.run(model, cleanup.Options())[0], required=True)[2]
               for phase, model in export_graphs(decoder, fused.MAX_CONTEXT).items()}
    packed = {}
    for phase, model in lowered.items():
        packed[phase], report = pack_projections.run(model, pack_projections.Options())
        attention = [n for n in packed[phase].graph.node if n.op_type == "GroupQueryAttention"]
        assert report["qkv_into_attention"] == CONFIG.num_layers == len(attention)
        assert all(list(n.input[1:3]) == ["", ""] for n in attention)
        producers = {o: n.op_type for n in packed[phase].graph.node for o in n.output}
        assert all(producers[n.input[0]] == "MatMul" for n in attention)  # the packed MatMul itself, no Split
    for got, want in zip(generate_logits(packed), generate_logits(lowered)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_packing_holds_the_packed_weights_and_the_new_model_not_the_parts_too():
    """Three 64 MB sibling weights, in a fresh process: the pass had read every part into its constant (kept there
    until the graph was collected), so its peak rose by three copies of the weights (parts, packed, new model); it
    now rises by about two, reading one part at a time into the packed weight."""
    from tests.peak_memory import peak_growth_mb

    grown = peak_growth_mb("from passes import pack_projections\nmodel = matmul_model(3, 1024, 16384)", """
        packed, report = pack_projections.run(model, pack_projections.Options())
        assert len(report["packed"]) == 1 and len(packed.graph.initializer) == 2, report  # the weight and split sizes
    """)
    weights_mb = 3 * 64
    assert grown < 2.5 * weights_mb, grown


def test_bfloat16_weights_pack():
    """export.dtype bfloat16 (TensorRT recipes): the packed weight had been allocated with graphsurgeon's dtype,
    which for bfloat16 is the ONNX type number, and the pass failed with a numpy TypeError."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((8, width)).astype(ml_dtypes.bfloat16) for width in (8, 4, 4)]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"/p{i}/MatMul") for i in range(3)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 8])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.BFLOAT16, [1, p.shape[1]]) for i, p in enumerate(parts)],
        initializer=[numpy_helper.from_array(p, f"w{i}") for i, p in enumerate(parts)]),
        opset_imports=[helper.make_opsetid("", 21)])
    packed, report = pack_projections.run(model, pack_projections.Options())
    assert len(report["packed"]) == 1
    weight = next(t for t in packed.graph.initializer if t.name.endswith("packed_weight"))
    assert weight.data_type == TensorProto.BFLOAT16
    np.testing.assert_array_equal(numpy_helper.to_array(weight).astype(np.float32),
                                  np.concatenate(parts, axis=1).astype(np.float32))


# ---- refusals: each guards a check that a mutation audit found untested ------------------------------------------

def projection_model(nodes: list, initializers: list, outputs: dict[str, int],
                     weight_inputs: tuple[str, ...] = ()) -> onnx.ModelProto:
    """x [batch, 4] read by the given nodes; `outputs` maps each graph output to its width; `weight_inputs` are
    initializers also listed as graph inputs (defaults the caller may override)."""
    shapes = {t.name: list(t.dims) for t in initializers}
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[name]) for name in weight_inputs]
    graph = helper.make_graph(nodes, "projections", inputs,
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", width])
                               for name, width in outputs.items()], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def random_initializer(name: str, *shape: int, dtype=np.float32) -> onnx.TensorProto:
    rng = np.random.default_rng(sum(map(ord, name)))  # each name its own values
    return numpy_helper.from_array(rng.standard_normal(shape).astype(dtype), name)


def shared_weight_model() -> onnx.ModelProto:
    """w_a is also read by a MatMul of another activation (y = relu(x)): packing would keep a copy of it."""
    nodes = [helper.make_node("MatMul", ["x", "w_a"], ["a"], name="matmul_a"),
             helper.make_node("MatMul", ["x", "w_b"], ["b"], name="matmul_b"),
             helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("MatMul", ["y", "w_a"], ["c"], name="matmul_c")]
    return projection_model(nodes, [random_initializer("w_a", 4, 3), random_initializer("w_b", 4, 2)],
                            {"a": 3, "b": 2, "c": 3})


def weight_input_model() -> onnx.ModelProto:
    """w_a is an initializer and a graph input: a value fed for it must still reach matmul_a."""
    nodes = [helper.make_node("MatMul", ["x", "w_a"], ["a"], name="matmul_a"),
             helper.make_node("MatMul", ["x", "w_b"], ["b"], name="matmul_b")]
    return projection_model(nodes, [random_initializer("w_a", 4, 3), random_initializer("w_b", 4, 2)],
                            {"a": 3, "b": 2}, weight_inputs=("w_a",))


@pytest.mark.parametrize("make_model, reason", [(shared_weight_model, "weight_shared"),
                                                (weight_input_model, "weight_is_graph_input")],
                         ids=["shared_weight", "weight_is_graph_input"])
def test_a_weight_that_packing_would_copy_or_freeze_is_refused(make_model, reason):
    model = make_model()

    packed, report = pack_projections.run(model, pack_projections.Options())

    assert report["packed"] == []
    assert report["skipped"] == [{"node": "matmul_a", "reason": reason},
                                 {"node": "matmul_b", "reason": "group_too_small"}]
    assert report["weight_bytes"]["after"] == report["weight_bytes"]["before"]  # a shared weight packed would grow it
    assert op_counts(packed) == op_counts(model)
    feeds = {"x": np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)}
    if reason == "weight_is_graph_input":  # an overriding value: packed into a constant, it would be ignored
        feeds["w_a"] = np.full((4, 3), 2.0, np.float32)
    assert_same_outputs(run_ort(model, feeds), run_ort(packed, feeds))


def test_siblings_of_mixed_weight_dtypes_are_not_packed_together():
    """A float16 weight beside float32 ones (a graph ill-typed or mid-conversion): one packed weight has one dtype,
    so the odd one is refused and the other two are packed."""
    nodes = [helper.make_node("MatMul", ["x", f"w_{name}"], [name], name=f"matmul_{name}") for name in "abc"]
    model = projection_model(nodes, [random_initializer("w_a", 4, 3), random_initializer("w_b", 4, 2, dtype=np.float16),
                                     random_initializer("w_c", 4, 2)], {"a": 3, "b": 2, "c": 2})

    packed, report = pack_projections.run(model, pack_projections.Options())

    assert report["skipped"] == [{"node": "matmul_b", "reason": "weight_dtype_mismatch"}]
    assert [entry["nodes"] for entry in report["packed"]] == [["matmul_a", "matmul_c"]]
    weight = next(t for t in packed.graph.initializer if t.name.endswith("packed_weight"))
    assert weight.data_type == TensorProto.FLOAT and list(weight.dims) == [4, 5]


def biased_siblings_model(case: str) -> onnx.ModelProto:
    """
        x ─┬─► MatMul(w_a) ─► a0 ─► Add(bias_a) ─► a      with one thing that keeps the biases from packing:
           └─► MatMul(w_b) ─► b0 ─► Add(bias_b) ─► b      a0 a graph output, a0 read by a Relu too, or a bias [1]
    """
    nodes = [helper.make_node("MatMul", ["x", "w_a"], ["a0"], name="matmul_a"),
             helper.make_node("Add", ["a0", "bias_a"], ["a"], name="bias_add_a"),
             helper.make_node("MatMul", ["x", "w_b"], ["b0"], name="matmul_b"),
             helper.make_node("Add", ["b0", "bias_b"], ["b"], name="bias_add_b")]
    outputs = {"a": 3, "b": 2}
    bias_a_shape = (1,) if case == "bias_broadcast" else (3,)
    if case == "product_is_graph_output":
        outputs["a0"] = 3
    if case == "product_read_elsewhere":
        nodes.append(helper.make_node("Relu", ["a0"], ["a0_relu"]))
        outputs["a0_relu"] = 3
    initializers = [random_initializer("w_a", 4, 3), random_initializer("w_b", 4, 2),
                    random_initializer("bias_a", *bias_a_shape), random_initializer("bias_b", 2)]
    return projection_model(nodes, initializers, outputs)


@pytest.mark.parametrize("case", ["product_is_graph_output", "product_read_elsewhere", "bias_broadcast"])
def test_biases_stay_after_the_split_when_packing_them_would_break_the_graph(case):
    """Packing the biases disconnects each MatMul's own output (another reader would lose it) and concatenates the
    biases (a [1] bias broadcast over its width would leave the packed bias short): the Adds stay instead."""
    model = biased_siblings_model(case)

    packed, report = pack_projections.run(model, pack_projections.Options())

    (entry,) = report["packed"]
    assert entry["nodes"] == ["matmul_a", "matmul_b"] and not entry["biases_packed"]
    assert entry["biases_left"].startswith("1 of 2 products have a constant bias Add"), entry
    assert op_counts(packed)["Add"] == 2
    feeds = {"x": np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)}
    assert_same_outputs(run_ort(model, feeds), run_ort(packed, feeds))


def test_projections_listed_k_before_q_are_packed_in_the_order_attention_reads():
    """With each k_proj before its q_proj in the node list, packing them into attention's q/k/v input would feed it
    [k|q|v] for [q|k|v]: the order check keeps that from happening (no test asserted it: a mutation audit). The
    logits and the cache stay the unpacked graph's."""
    from tests.passes import test_fuse_attention as fused_tests

    decoder = build_decoder(fused_tests.CONFIG, random_model(fused_tests.CONFIG, seed=0).state_dict)
    lowered = {phase: fused_tests.fuse_and_lower(cleanup.run(model, cleanup.Options())[0], required=True)[2]
               for phase, model in export_graphs(decoder, fused_tests.MAX_CONTEXT).items()}

    def k_first(model: onnx.ModelProto) -> onnx.ModelProto:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        nodes = list(model.graph.node)
        for k in [node for node in nodes if node.op_type == "MatMul" and "k_proj" in node.name]:
            q = next(node for node in nodes if node.op_type == "MatMul" and node.name == k.name.replace("k_proj",
                                                                                                      "q_proj"))
            nodes.remove(k)
            nodes.insert(nodes.index(q), k)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        return model

    packed = {phase: pack_projections.run(k_first(model), pack_projections.Options())[0]
              for phase, model in lowered.items()}
    for reference, result in zip(fused_tests.generate_logits(lowered), fused_tests.generate_logits(packed)):
        np.testing.assert_allclose(result, reference, atol=1e-5)
