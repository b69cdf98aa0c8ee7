"""Tests for passes/fuse_rms_norm.py: traced and hand-built graphs, op counts before/after, onnxruntime parity."""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes import cleanup, fuse_rms_norm
from tests.passes.test_fuse_attention import LogitsOnly

TOLERANCE = 1e-5  # fused kernels sum in another order; anything above this is a wrong rewrite
NORM_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal")
HIDDEN, EPSILON = 8, 1e-5


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Without onnxruntime's graph optimizations: they fuse RMSNorm look-alikes of the reference graph too (a
    ReduceMean with keepdims=0 among them, wrongly), and parity would compare their fusion with ours."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def max_difference(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict) -> float:
    outputs_before, outputs_after = run_ort(before, feeds), run_ort(after, feeds)
    assert [o.name for o in before.graph.output] == [o.name for o in after.graph.output]
    return max(float(np.abs(a - b).max()) for a, b in zip(outputs_before, outputs_after))


def fuse(model: onnx.ModelProto, **options) -> tuple[onnx.ModelProto, dict]:
    return fuse_rms_norm.run(model, fuse_rms_norm.Options(**options))


# ---- the canonical decoder, traced -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_decoder():
    from compiler.export import export_graphs, io_names
    from compiler.frontend.config import DecoderConfig
    from compiler.frontend.model import build_decoder
    from compiler.frontend.random_init import random_model

    config = DecoderConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    decoder = build_decoder(config, random_model(config, seed=0).state_dict)
    graphs = {phase: cleanup.run(model, cleanup.Options())[0]
              for phase, model in export_graphs(decoder, max_context=32).items()}
    batch, sequence = 2, 5
    input_names, _ = io_names(config)
    cache = np.zeros((batch, config.num_kv_heads, 32, config.head_dim), np.float32)
    feeds = {"input_ids": np.random.default_rng(0).integers(0, config.vocab_size, (batch, sequence)),
             "position_ids": np.tile(np.arange(sequence), (batch, 1)),
             "attention_mask": np.ones((batch, sequence), np.int64),
             **{name: cache for name in input_names[3:]}}
    return graphs, feeds


# 2 layers -> 5 RMSNorms: input_layernorm and post_attention_layernorm per layer, and the final norm.
# The first input_layernorm reads the embedding Gather (no residual: plain form); the other three layer norms
# read a residual Add (skip form). The final norm reads the last residual Add in decode (skip form; its sum is
# read by nothing else, so output 3 stays empty), but in prefill ("last" logits) it reads the Gather + Reshape
# picking each row's last token (plain form).
EXPECTED = {"prefill": {"SimplifiedLayerNormalization": 2, "SkipSimplifiedLayerNormalization": 3},
            "decode": {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 4}}


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_decoder_norms_fused_with_parity(tiny_decoder, phase):
    graphs, feeds = tiny_decoder
    model = graphs[phase]
    model_bytes = model.SerializeToString()
    fused, report = fuse(model)

    assert model.SerializeToString() == model_bytes  # pure
    counts = op_counts(fused)
    for op, expected in EXPECTED[phase].items():
        assert counts[op] == expected, (op, counts)
    assert not any(counts[op] for op in NORM_OPS)
    assert report["fused"] == EXPECTED[phase]["SimplifiedLayerNormalization"]
    assert report["fused_with_skip"] == EXPECTED[phase]["SkipSimplifiedLayerNormalization"]
    assert report["skipped"] == [] and report["skip_form_declined"] == []
    # Each plain norm drops 6 nodes (7 -> 1), each skip-form norm 7 (7 + the residual Add -> 1).
    assert report["nodes"] == {"before": len(model.graph.node), "after": len(fused.graph.node)}
    assert len(model.graph.node) - len(fused.graph.node) == 6 * report["fused"] + 7 * report["fused_with_skip"]

    skip_nodes = [node for node in fused.graph.node if node.op_type == "SkipSimplifiedLayerNormalization"]
    assert all(node.domain == "com.microsoft" and len(node.output) == 4 for node in skip_nodes)
    assert max_difference(model, fused, feeds) <= TOLERANCE


def test_max_rewrites_fuses_exactly_one(tiny_decoder):
    graphs, feeds = tiny_decoder
    fused, report = fuse(graphs["prefill"], max_rewrites=1)

    assert report["fused"] + report["fused_with_skip"] == 1
    assert op_counts(fused)["ReduceMean"] == 4
    assert len(report["skipped"]) == 4 and all(item["reason"] == "max_rewrites=1" for item in report["skipped"])
    assert max_difference(graphs["prefill"], fused, feeds) <= TOLERANCE


def test_skip_fusion_off_gives_plain_norms_only(tiny_decoder):
    graphs, feeds = tiny_decoder
    fused, report = fuse(graphs["decode"], skip_fusion=False)

    assert report["fused"] == 5 and report["fused_with_skip"] == 0
    assert op_counts(fused)["SkipSimplifiedLayerNormalization"] == 0
    assert max_difference(graphs["decode"], fused, feeds) <= TOLERANCE


# ---- Hugging Face LlamaForCausalLM, traced -----------------------------------------------------------------

def test_hugging_face_llama_norms_fused_with_parity(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at ones: make each one different so a misplaced weight shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))

    input_ids = torch.randint(0, config.vocab_size, (2, 5))
    attention_mask = torch.ones(2, 5, dtype=torch.long)
    path = tmp_path / "llama.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(LogitsOnly(model).eval(), (input_ids, attention_mask), str(path), dynamo=False, opset_version=21,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={name: {0: "batch", 1: "sequence"}
                                        for name in ("input_ids", "attention_mask", "logits")})
    traced, _ = cleanup.run(onnx.load(str(path)), cleanup.Options())
    fused, report = fuse(traced)

    # LlamaRMSNorm spells it Cast -> Pow -> ReduceMean -> Add -> Sqrt -> Div(1, .) -> Mul -> Cast -> Mul(weight):
    # the first norm reads the embedding (plain), the other four a residual Add (skip form).
    assert (report["fused"], report["fused_with_skip"], report["skipped"]) == (1, 4, [])
    assert not any(op_counts(fused)[op] for op in NORM_OPS)
    feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
    assert max_difference(traced, fused, feeds) <= TOLERANCE


# ---- hand-built graphs: spellings and broken patterns ------------------------------------------------------

def rms_norm_model(spelling: str = "div", axis: int = -1, residual: bool = False, extra_op: bool = False,
                   skip_shape: tuple[int, ...] | None = None, keepdims: int = 1,
                   shape: tuple[int, ...] = (2, 3, HIDDEN)) -> onnx.ModelProto:
    """
        residual:  a, b ─► Add ─► x        (x is also a graph output: the next residual reads it)
        x ─► Pow(2) ─► ReduceMean(axis) ─► Add(eps) ─[Abs]─► Sqrt ─► Div(1, .) | Reciprocal ─► Mul(x, .) ─► Mul(w, .)
                                                       (or:  Sqrt ─► Div(x, .) ───────────────────────► Mul(w, .)) ─► y
    """
    rng = np.random.default_rng(1)
    initializers = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                    numpy_helper.from_array(np.array([axis], np.int64), "axes"),
                    numpy_helper.from_array(np.array(EPSILON, np.float32), "eps"),
                    numpy_helper.from_array(np.array(1.0, np.float32), "one"),
                    numpy_helper.from_array((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "weight")]
    nodes = [helper.make_node("Add", ["a", "b"], ["x"])] if residual else []
    x = "x" if residual else "a"
    nodes += [helper.make_node("Pow", [x, "two"], ["square"]),
              helper.make_node("ReduceMean", ["square", "axes"], ["mean"], keepdims=keepdims),
              helper.make_node("Add", ["mean", "eps"], ["mean_eps"])]
    if extra_op:
        nodes.append(helper.make_node("Abs", ["mean_eps"], ["mean_eps_abs"]))
    nodes.append(helper.make_node("Sqrt", ["mean_eps_abs" if extra_op else "mean_eps"], ["rms"]))
    if spelling == "div_x":
        nodes.append(helper.make_node("Div", [x, "rms"], ["normalized"]))
    else:
        inverse = (helper.make_node("Div", ["one", "rms"], ["inv_rms"]) if spelling == "div"
                   else helper.make_node("Reciprocal", ["rms"], ["inv_rms"]))
        nodes += [inverse, helper.make_node("Mul", ["inv_rms", x], ["normalized"])]
    nodes.append(helper.make_node("Mul", ["normalized", "weight"], ["y"]))

    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(shape))]
    if residual:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, list(skip_shape or shape)))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))]
    if residual:
        outputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)))
    graph = helper.make_graph(nodes, "rms_norm_test", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return onnx.shape_inference.infer_shapes(model)


def feeds_for(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(2)
    return {value.name: rng.standard_normal([d.dim_value for d in value.type.tensor_type.shape.dim]).astype(np.float32)
            for value in model.graph.input}


def numpy_rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The reference: y = x / sqrt(mean(x^2, last axis) + eps) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPSILON) * weight


@pytest.mark.parametrize("spelling", ["div", "reciprocal", "div_x"])
def test_spellings_fuse_to_plain_norm(spelling):
    model = rms_norm_model(spelling)
    fused, report = fuse(model)

    assert report["fused"] == 1 and report["skipped"] == []
    assert [node.op_type for node in fused.graph.node] == ["SimplifiedLayerNormalization"]
    attrs = {a.name: helper.get_attribute_value(a) for a in fused.graph.node[0].attribute}
    assert attrs["axis"] == -1 and attrs["stash_type"] == 1 and attrs["epsilon"] == pytest.approx(EPSILON)
    feeds = feeds_for(model)
    weight = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "weight"))
    difference = np.abs(run_ort(fused, feeds)[0] - numpy_rms_norm(feeds["a"], weight)).max()
    assert difference <= TOLERANCE, f"max difference against numpy: {difference}"


def test_residual_add_read_elsewhere_becomes_skip_output():
    model = rms_norm_model(residual=True)
    fused, report = fuse(model)

    assert report["fused_with_skip"] == 1
    (node,) = fused.graph.node
    assert (node.op_type, node.domain) == ("SkipSimplifiedLayerNormalization", "com.microsoft")
    assert list(node.input) == ["a", "b", "weight"] and list(node.output) == ["y", "", "", "x"]
    assert max_difference(model, fused, feeds_for(model)) <= TOLERANCE


def test_broadcasting_residual_declines_skip_form_but_fuses_plain():
    model = rms_norm_model(residual=True, skip_shape=(HIDDEN,))  # a bias-like operand: the kernel cannot take it
    fused, report = fuse(model)

    assert (report["fused"], report["fused_with_skip"]) == (1, 0)
    assert report["skip_form_declined"][0]["reason"].startswith("shapes")
    assert op_counts(fused) == Counter({"Add": 1, "SimplifiedLayerNormalization": 1})
    assert max_difference(model, fused, feeds_for(model)) <= TOLERANCE


@pytest.mark.parametrize("broken, reason", [
    ({"axis": 0}, "reduce_axis_not_last"),
    ({"extra_op": True}, "no_sqrt"),
    # keepdims=0 drops the reduced axis: on [1, H, H] the 1/rms [1, H] broadcasts over x's rows, scaling column j by
    # row j's rms, where the fused kernel scales each row by its own (a mutation audit: nothing asserted this one)
    ({"keepdims": 0, "shape": (1, HIDDEN, HIDDEN)}, "keepdims_0"),
], ids=["axis_0", "extra_op", "keepdims_0"])
def test_broken_pattern_is_skipped_with_reason(broken, reason):
    model = rms_norm_model(**broken)
    fused, report = fuse(model)

    assert (report["fused"], report["fused_with_skip"]) == (0, 0)
    assert len(report["skipped"]) == 1 and report["skipped"][0]["reason"].startswith(reason)
    assert op_counts(fused) == op_counts(model)
    assert max_difference(model, fused, feeds_for(model)) == 0.0


def test_a_residual_typed_apart_from_the_weight_declines_the_skip_form():
    """SkipSimplifiedLayerNormalization takes input, skip and weight of one type. ONNX typing gives a residual Add's
    operands the weight's type, so only the graph's annotations can disagree: here a stale float16 value_info on one
    operand (onnxruntime refuses to load it as it is). The skip form is declined; the plain norm still fuses."""
    model = rms_norm_model(residual=True)
    add = next(node for node in model.graph.node if node.op_type == "Add" and list(node.input) == ["a", "b"])
    add.input[1] = "b_copy"
    model.graph.node.insert(0, helper.make_node("Identity", ["b"], ["b_copy"]))
    model.graph.value_info.append(helper.make_tensor_value_info("b_copy", TensorProto.FLOAT16, [2, 3, HIDDEN]))
    fused, report = fuse(model)

    assert (report["fused"], report["fused_with_skip"]) == (1, 0), report
    assert report["skip_form_declined"][0]["reason"] == "dtypes: float32 + float16 with weight float32"
    assert op_counts(fused) == Counter({"Identity": 1, "Add": 1, "SimplifiedLayerNormalization": 1})
    for graph in (model.graph, fused.graph):  # drop the stale annotation so onnxruntime loads both
        kept = [value for value in graph.value_info if value.name != "b_copy"]
        del graph.value_info[:]
        graph.value_info.extend(kept)
    assert max_difference(model, fused, feeds_for(model)) <= TOLERANCE


def test_a_residual_of_unknown_equal_looking_dimensions_is_not_taken_for_equal_shapes():
    """Both operands [None, None, 8]: unknown sizes compared equal, and the skip form returned (1, 3, 8) where the
    graph's broadcasting Add gives (2, 3, 8)."""
    model = rms_norm_model(residual=True)
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim[:2]:
            dim.Clear()  # unknown: neither a size nor a name
    fused, report = fuse(model)
    assert (report["fused"], report["fused_with_skip"]) == (1, 0)
    assert "known to be equal" in report["skip_form_declined"][0]["reason"]
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((1, 3, HIDDEN)).astype(np.float32),
             "b": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    assert run_ort(fused, feeds)[0].shape == (2, 3, HIDDEN) and max_difference(model, fused, feeds) <= TOLERANCE


def test_an_epsilon_of_higher_rank_is_not_taken_for_a_scalar():
    """An epsilon shaped [1, 1, 1, 1] broadcasts the rank-3 norm to rank 4, which the fused node would not."""
    model = rms_norm_model()
    eps = next(t for t in model.graph.initializer if t.name == "eps")
    eps.CopyFrom(numpy_helper.from_array(np.full((1, 1, 1, 1), EPSILON, np.float32), "eps"))
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    fused, report = fuse(model)
    assert report["fused"] == 0 and report["skipped"][0]["reason"].startswith("no_epsilon")


def test_a_weight_that_is_also_a_graph_input_stays_overridable():
    """An initializer listed as a graph input (an overridable default): the pass baked it into the fused node and
    the export dropped the input, so feeding it failed ("Invalid input name: weight")."""
    model = rms_norm_model()
    model.graph.input.append(helper.make_tensor_value_info("weight", TensorProto.FLOAT, [HIDDEN]))
    fused, report = fuse(model)
    assert report["fused"] == 0 and report["skipped"][0]["reason"].startswith("weight_is_graph_input")
    assert [i.name for i in fused.graph.input] == ["a", "weight"]
    feeds = {**feeds_for(rms_norm_model()), "weight": np.full(HIDDEN, 2.0, np.float32)}
    assert max_difference(model, fused, feeds) == 0.0


def test_registered():
    from passes.registry import PASSES

    assert PASSES["fuse_rms_norm"].run is fuse_rms_norm.run
    assert PASSES["fuse_rms_norm"].options_type is fuse_rms_norm.Options


def test_an_epsilon_that_is_also_a_graph_input_stays_overridable():
    """The epsilon was baked into the fused node's attribute and its input left without a default."""
    model = rms_norm_model()
    model.graph.input.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
    fused, report = fuse(model)
    assert report["fused"] == 0 and report["skipped"][0]["reason"].startswith("constant_is_graph_input")
    assert [i.name for i in fused.graph.input] == ["a", "eps"]
    feeds = feeds_for(rms_norm_model())
    for fed in ({}, {"eps": np.array(1.0, np.float32)}):
        assert max_difference(model, fused, {**feeds, **fed}) == 0.0


def test_a_square_written_as_mul_of_a_graph_input_fuses():
    """Mul(x, x) on a graph input x (a graph that takes inputs_embeds) was skipped as constant_is_graph_input: its
    second input, x itself, was taken for a Pow's exponent."""
    model = rms_norm_model()
    square = next(node for node in model.graph.node if node.op_type == "Pow")
    square.op_type, square.input[1] = "Mul", square.input[0]
    assert square.input[0] in [i.name for i in model.graph.input]
    fused, report = fuse(model)
    assert report["fused"] == 1 and report["skipped"] == [], report
    assert max_difference(model, fused, feeds_for(model)) < 1e-5


def _set_initializer(model: onnx.ModelProto, name: str, value: float) -> None:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(np.array(value, np.float32), name))


def _read_square_elsewhere(model: onnx.ModelProto) -> None:
    model.graph.output.append(helper.make_tensor_value_info("square", TensorProto.FLOAT, [2, 3, HIDDEN]))


@pytest.mark.parametrize("edit", [
    lambda model: _set_initializer(model, "two", 3.0),  # Pow(x, 3): not a square
    lambda model: _set_initializer(model, "one", 2.0),  # Div(2, rms): twice the norm
    _read_square_elsewhere,  # the square is also a graph output: fusing would drop it
], ids=["cube", "two_over_rms", "square_read_elsewhere"])
def test_look_alikes_of_rms_norm_are_left_as_they_are(edit):
    """Each of these passed for an RMSNorm when its check was removed (a mutation audit): nothing asserted them."""
    model = rms_norm_model()
    edit(model)
    fused, report = fuse(model)
    assert (report["fused"], report["fused_with_skip"]) == (0, 0), report
    assert op_counts(fused) == op_counts(model)
    for got, expected in zip(run_ort(fused, feeds_for(model)), run_ort(model, feeds_for(model))):
        np.testing.assert_array_equal(got, expected)  # NaN where the cube's mean is negative: equal too


def _square_of_two_tensors(model: onnx.ModelProto) -> None:
    square = next(node for node in model.graph.node if node.op_type == "Pow")
    square.op_type, square.input[:] = "Mul", ["x", "a"]


def _divide_another_tensor(model: onnx.ModelProto) -> None:
    divide = next(node for node in model.graph.node if node.op_type == "Div")
    divide.input[0] = "a"  # a / rms(a + b), not x / rms(x)


@pytest.mark.parametrize("spelling, edit", [("div", _square_of_two_tensors), ("div_x", _divide_another_tensor)],
                         ids=["mul_of_two_tensors", "div_of_another_tensor"])
def test_a_norm_of_one_tensor_scaling_another_is_left_as_it_is(spelling, edit):
    """Mul(x, a) is no square, and a / rms(x) no norm of x: each fused when its check was removed (a mutation audit:
    1.08 and 7.35 off), and nothing asserted them."""
    model = rms_norm_model(spelling, residual=True)
    edit(model)
    fused, report = fuse(model)
    assert (report["fused"], report["fused_with_skip"]) == (0, 0), report
    assert max_difference(model, fused, feeds_for(model)) == 0.0


def onnx_rms_normalization_model(axis: int = -1) -> onnx.ModelProto:
    """a, b ─► Add ─► x ─► RMSNormalization(x, weight) ─► y (opset 23; the dynamo exporter's spelling there)."""
    weight = numpy_helper.from_array((1 + 0.1 * np.random.default_rng(1).standard_normal(HIDDEN)).astype(np.float32),
                                     "weight")
    nodes = [helper.make_node("Add", ["a", "b"], ["x"]),
             helper.make_node("RMSNormalization", ["x", "weight"], ["y"], axis=axis, epsilon=EPSILON)]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "onnx_rms_norm", [value(n, TensorProto.FLOAT, [2, 3, HIDDEN]) for n in "ab"],
                              [value("y", TensorProto.FLOAT, [2, 3, HIDDEN])], [weight])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def test_onnxs_own_rms_normalization_takes_its_residual_add_too():
    """Opset 23's RMSNormalization was left alone and unreported: its residual Add was not fused as the spelled-out
    norms' are."""
    model = onnx_rms_normalization_model()
    fused, report = fuse(model)
    assert report["fused_with_skip"] == 1 and op_counts(fused) == Counter({"SkipSimplifiedLayerNormalization": 1})
    feeds = feeds_for(model)
    (y,) = run_ort(fused, feeds)
    np.testing.assert_allclose(y, numpy_rms_norm(feeds["a"] + feeds["b"], numpy_helper.to_array(
        model.graph.initializer[0])), atol=1e-5)
    assert max_difference(model, fused, feeds) < 1e-5
    _, over_two_axes = fuse(onnx_rms_normalization_model(axis=1))  # normalizes axes 1 and 2: not the kernel's
    assert over_two_axes["skipped"][0]["reason"].startswith("reduce_axis_not_last")
