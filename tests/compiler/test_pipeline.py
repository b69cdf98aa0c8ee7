"""Tests for compiler/pipeline.py: the pass manager around passes (lookup, timing, checks, dumps, reports)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler import pipeline
from compiler.errors import BuildError
from compiler.pipeline import PassResult, format_reports, run_pipeline
from passes import cleanup
from passes.registry import PASSES, PassEntry


@dataclass
class Spec:
    """Stands in for compiler.recipe's PassSpec: the pipeline only reads .name and .options."""
    name: str
    options: object = None


@dataclass(frozen=True)
class NoOptions:
    pass


def make_phase(output_name: str = "y") -> onnx.ModelProto:
    """x ─► Add(Constant 1) ─► Relu ─► y, plus a dead Neg branch for cleanup to remove."""
    nodes = [helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.ones(3, np.float32))),
             helper.make_node("Add", ["x", "one"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], [output_name]),
             helper.make_node("Neg", ["x"], ["dead"])]
    graph = helper.make_graph(nodes, "phase", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def phases() -> dict[str, onnx.ModelProto]:
    return {"prefill": make_phase(), "decode": make_phase()}


def register(monkeypatch, name: str, run) -> None:
    monkeypatch.setitem(PASSES, name, PassEntry(run, NoOptions, "test-only pass"))


def test_runs_every_pass_on_every_phase_in_order():
    lines: list[str] = []
    graphs, results = run_pipeline(phases(), [Spec("cleanup", cleanup.Options()), Spec("cleanup")],
                                   progress=lines.append)

    assert set(graphs) == {"prefill", "decode"}
    assert [(result.name, result.phase) for result in results] == [
        ("cleanup", "prefill"), ("cleanup", "decode"), ("cleanup", "prefill"), ("cleanup", "decode")]
    assert all(isinstance(result, PassResult) and result.seconds >= 0 for result in results)
    assert (results[0].nodes_before, results[0].nodes_after) == (4, 2)  # Constant folded, Neg removed
    assert len(graphs["decode"].graph.node) == 2
    assert any("cleanup (decode)" in line for line in lines)
    json.dumps([result.report for result in results])
    table = format_reports(results)
    assert "cleanup" in table and "4 -> 2" in table


def test_a_pass_that_runs_first_on_decode_gets_it_first_and_is_reported_in_the_graphs_order(monkeypatch):
    seen = []
    monkeypatch.setitem(PASSES, "decode_first", PassEntry(lambda model, options: (seen.append(model) or model, {}),
                                                          NoOptions, "test-only pass", runs_first_on=("decode",)))
    graphs = {"prefill": make_phase("p"), "decode": make_phase("d")}
    _, results = run_pipeline(graphs, [Spec("decode_first", NoOptions()), Spec("cleanup")])
    assert [model.graph.output[0].name for model in seen] == ["d", "p"]
    assert [(result.name, result.phase) for result in results] == [
        ("decode_first", "prefill"), ("decode_first", "decode"), ("cleanup", "prefill"), ("cleanup", "decode")]


def test_unknown_pass_lists_the_known_ones():
    with pytest.raises(BuildError, match="unknown pass 'fuse_everything'.*cleanup"):
        run_pipeline(phases(), [Spec("cleanup"), Spec("fuse_everything")])


def test_wrong_options_type_is_a_build_error():
    with pytest.raises(BuildError, match="pass 'cleanup' takes Options options, got NoOptions"):
        run_pipeline(phases(), [Spec("cleanup", NoOptions())])


def test_invalid_model_names_pass_and_phase(monkeypatch):
    def break_graph(model, options):
        broken = onnx.ModelProto()
        broken.CopyFrom(model)
        broken.graph.node[1].input[0] = "no_such_tensor"  # read before anything writes it
        return broken, {}

    register(monkeypatch, "break_graph", break_graph)
    with pytest.raises(BuildError, match=r"pass 'break_graph' produced an invalid prefill graph: .*no_such_tensor"):
        run_pipeline(phases(), [Spec("break_graph")])


def test_changed_io_names_fail_unless_declared(monkeypatch):
    def rename_output(model, options):
        return make_phase(output_name="renamed"), {}

    def rename_output_declared(model, options):
        return make_phase(output_name="renamed"), {"changes_io": True}

    register(monkeypatch, "rename_output", rename_output)
    register(monkeypatch, "rename_output_declared", rename_output_declared)
    with pytest.raises(BuildError, match=r"pass 'rename_output' changed the prefill graph's outputs"):
        run_pipeline(phases(), [Spec("rename_output")])

    graphs, _ = run_pipeline(phases(), [Spec("rename_output_declared")])
    assert graphs["decode"].graph.output[0].name == "renamed"


def test_custom_domains_pass_the_check(monkeypatch):
    def add_custom_ops(model, options):
        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(model)
        rewritten.graph.node.append(helper.make_node("FlashAttention", ["x"], ["fused"], domain="aotlm"))
        rewritten.graph.node.append(helper.make_node("MatMulNBits", ["x"], ["quantized"], domain="com.microsoft"))
        rewritten.opset_import.extend([helper.make_opsetid("aotlm", 1), helper.make_opsetid("com.microsoft", 1)])
        return rewritten, {"fused": np.int64(1), "scales": np.array([0.5])}

    register(monkeypatch, "add_custom_ops", add_custom_ops)
    _, results = run_pipeline(phases(), [Spec("add_custom_ops")])
    assert results[0].report == {"fused": 1, "scales": [0.5]}
    assert type(results[0].report["fused"]) is int


def test_unserializable_report_is_a_build_error(monkeypatch):
    register(monkeypatch, "bad_report", lambda model, options: (model, {"when": object()}))
    with pytest.raises(BuildError, match=r"pass 'bad_report' \(prefill\) report\['when'\]"):
        run_pipeline(phases(), [Spec("bad_report")])


def test_check_false_skips_the_checks(monkeypatch):
    register(monkeypatch, "rename_output", lambda model, options: (make_phase(output_name="renamed"), {}))
    graphs, _ = run_pipeline(phases(), [Spec("rename_output")], check=False)
    assert graphs["prefill"].graph.output[0].name == "renamed"


def test_big_dumps_keep_weights_in_a_side_file_and_leave_the_graph_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "DUMP_EXTERNAL_DATA_BYTES", 0)
    graphs = phases()
    graphs["prefill"].graph.initializer.append(numpy_helper.from_array(np.ones(4096, np.float32), "big"))
    graphs["prefill"].graph.node[1].input[1] = "big"  # Add(x, big) broadcasts to [4096]
    graphs["prefill"].graph.output[0].type.tensor_type.shape.dim[0].dim_value = 4096

    result, _ = run_pipeline(graphs, [Spec("cleanup")], dump_dir=str(tmp_path))

    assert (tmp_path / "00-cleanup-prefill.onnx.data").stat().st_size == 4096 * 4
    assert numpy_helper.to_array(result["prefill"].graph.initializer[0]).shape == (4096,)  # still in memory
    reloaded = onnx.load(str(tmp_path / "00-cleanup-prefill.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(reloaded.graph.initializer[0]), np.ones(4096))


def test_dumps_each_intermediate_graph(tmp_path):
    run_pipeline(phases(), [Spec("cleanup"), Spec("cleanup")], dump_dir=str(tmp_path))

    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == ["00-cleanup-decode.onnx", "00-cleanup-prefill.onnx",
                     "01-cleanup-decode.onnx", "01-cleanup-prefill.onnx"]
    onnx.checker.check_model(onnx.load(str(tmp_path / "01-cleanup-decode.onnx")))


def over_protobuf_limit() -> onnx.ModelProto:
    """y = Gather(a, ids) + Gather(b, ids) over two uint8 tables of 1 GiB + 64 bytes each: a model protobuf cannot
    serialize whole (each table alone can be; the tables go in by assignment, as protobuf copies a message it is
    given by serializing it)."""
    graph = helper.make_graph([helper.make_node("Gather", ["a", "ids"], ["ya"]),
                               helper.make_node("Gather", ["b", "ids"], ["yb"]),
                               helper.make_node("Add", ["ya", "yb"], ["y"])], "phase",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for name in ("a", "b"):
        table = model.graph.initializer.add(name=name, data_type=TensorProto.UINT8, dims=[(1 << 24) + 1, 64])
        table.raw_data = bytes(((1 << 24) + 1) * 64)
    return model


def test_a_model_over_protobufs_2_gib_limit_is_checked_without_its_weights(monkeypatch):
    """onnx.checker serializes what it checks: on a model of 2 GiB or more that raised protobuf's EncodeError from
    deep inside the checker (a random-init Llama of 2.26 GB failed its first pass so). The check reads the graph
    with its large weights as typed inputs, and still finds what is wrong in it."""
    model = over_protobuf_limit()
    pipeline.check_pass_result("identity", "decode", model, model, {})

    model.graph.node.append(helper.make_node("Relu", ["no_such_tensor"], ["z"]))
    with pytest.raises(BuildError, match=r"pass 'identity' produced an invalid decode graph: .*no_such_tensor"):
        pipeline.check_pass_result("identity", "decode", model, model, {})
    assert [len(table.raw_data) for table in model.graph.initializer] == [(1 << 30) + 64] * 2


def test_a_replaced_graph_is_freed_before_the_next_pass(monkeypatch):
    """graphsurgeon's graphs are reference cycles that hold the model they were imported from. Left to the cycle
    collector, each pass's leftovers (a copy of every weight) stayed alive: a 1.8 GB model's build held 18 GB at its
    end. With automatic collection off, what a pass leaves behind is freed before the next pass starts."""
    import gc
    import weakref

    import onnx_graphsurgeon as gs

    left_behind, alive_at_next_pass = [], []

    def import_and_export(model, options):
        alive_at_next_pass.extend(reference() is not None for reference in left_behind)
        graph = gs.import_onnx(model)
        left_behind.append(weakref.ref(graph.nodes[0]))  # nodes and tensors point at each other: a cycle
        return gs.export_onnx(graph), {}

    register(monkeypatch, "import_and_export", import_and_export)
    graphs = phases()
    collecting = gc.isenabled()
    gc.disable()
    try:
        result, _ = run_pipeline(graphs, [Spec("import_and_export")] * 3, consume=True)
    finally:
        if collecting:
            gc.enable()
    assert len(left_behind) == 6 and alive_at_next_pass == [False] * 15
    assert result is graphs and len(graphs["decode"].graph.node) == 4  # consume: the caller's dict holds the results


def with_large_weight(corrupt) -> onnx.ModelProto:
    """y = x + W, W a 320 KB initializer (above what the check keeps whole), then corrupted by `corrupt(model)`."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "phase",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 20000])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 20000])],
                              [numpy_helper.from_array(np.ones((4, 20000), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    corrupt(model)
    return model


def _half_raw_data(model):
    weight = model.graph.initializer[0]
    weight.raw_data = weight.raw_data[:len(weight.raw_data) // 2]


def _short_float_data(model):
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.float_data.extend([1.0] * 10)


@pytest.mark.parametrize("corrupt, message", [
    (_half_raw_data, r"initializer 'W' holds 160000 bytes of raw_data, and its dims \[4, 20000\] and type need 320000"),
    (_short_float_data, r"initializer 'W' holds 10 float_data values, and its dims \[4, 20000\] need 80000"),
    (lambda model: model.graph.initializer[0].float_data.extend([1.0]), r"'W' has 2 data fields \(raw_data, float_data\)"),
    (lambda model: model.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.float32), "W")),
     r"W initializer name is not unique"),
    (lambda model: model.metadata_props.extend([onnx.StringStringEntryProto(key="k", value=v) for v in "12"]),
     r"duplicate keys in metadata_props"),
    (lambda model: setattr(model.graph.initializer[0], "data_type", TensorProto.UNDEFINED),
     r"setting data_type field \(tensor name: W\) to UNDEFINED is not allowed"),
    (lambda model: setattr(model, "ir_version", 3), r"W in initializer but not in graph input"),
], ids=["raw-data-short", "float-data-short", "two-data-fields", "duplicate-name", "duplicate-metadata", "undefined-type",
        "ir3-initializer-not-an-input"])
def test_what_the_checker_found_in_large_weights_is_still_found(corrupt, message):
    """The check leaves the data of large weights out of what it hands onnx.checker; what the checker read of them
    (one data field, of the length the dims need; unique names; a defined type) is still refused, by pass and phase."""
    model = with_large_weight(corrupt)
    with pytest.raises(BuildError, match=r"pass 'rewrite' produced an invalid decode graph: .*" + message):
        pipeline.check_pass_result("rewrite", "decode", model, model, {})
    pipeline.check_pass_result("rewrite", "decode", *[with_large_weight(lambda model: None)] * 2, {})  # the intact one


def phases_with_weights() -> dict[str, onnx.ModelProto]:
    graphs = {}
    for phase in ("prefill", "decode"):
        model = make_phase()
        model.graph.name = phase
        weight = numpy_helper.from_array(np.arange(3 * 512, dtype=np.float32).reshape(3, 512), "w")  # 6 KB
        model.graph.initializer.append(weight)
        model.graph.node.append(helper.make_node("MatMul", ["y", "w"], ["z"]))
        model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [512]))
        graphs[phase] = model
    return graphs


def test_a_spilling_pipeline_runs_phase_by_phase_with_the_other_graph_on_disk(tmp_path, monkeypatch):
    """spill_dir: one phase's graph in memory at a time. Each phase runs every pass in turn (decode first, as
    quantize's runs_first_on asks), the other waiting in spill_dir; the graphs and reports are those of the pass by
    pass run."""
    seen = []

    def probe(model, options):
        others = [path.parent.name for path in tmp_path.glob("*/graph.data")]
        seen.append((model.graph.name, sorted(others)))
        return model, {}

    register(monkeypatch, "probe", probe)
    monkeypatch.setitem(PASSES, "probe_decode_first", PassEntry(probe, NoOptions, "test-only", runs_first_on=("decode",)))
    specs = [Spec("cleanup", cleanup.Options()), Spec("probe"), Spec("probe_decode_first")]
    reference, reference_results = run_pipeline(phases_with_weights(), specs)
    assert seen == [("prefill", []), ("decode", []), ("decode", []), ("prefill", [])]
    seen.clear()
    graphs = phases_with_weights()
    graphs["prefill"] = pipeline.spill_graph(graphs["prefill"], tmp_path / "prefill")  # spilled already: taken as is
    spilled, results = run_pipeline(graphs, specs, consume=True, spill_dir=tmp_path)
    assert seen == [("decode", ["prefill"])] * 2 + [("prefill", ["decode"])] * 2  # a graph read back leaves no files
    assert spilled is graphs and list(spilled) == ["prefill", "decode"] and not list(tmp_path.glob("*/graph.*"))
    assert {phase: model.SerializeToString() for phase, model in spilled.items()} == \
        {phase: model.SerializeToString() for phase, model in reference.items()}
    assert [(r.name, r.phase, r.report, r.nodes_before, r.nodes_after) for r in results] == \
        [(r.name, r.phase, r.report, r.nodes_before, r.nodes_after) for r in reference_results]
    with pytest.raises(TypeError, match="consume=True"):
        run_pipeline(phases_with_weights(), specs, spill_dir=tmp_path)


@pytest.mark.parametrize("name", pipeline.RUN_ONCE)
def test_a_pass_that_runs_once_listed_twice_is_refused(name):
    from compiler.recipe import PassSpec
    from passes.registry import PASSES

    spec = PassSpec(name, PASSES[name].options_type())
    with pytest.raises(BuildError, match=rf"passes\[1\]: {name} is listed twice"):
        pipeline.check_passes([spec, spec])
    assert set(pipeline.RUN_ONCE) == {"quantize", "quantize_kv_cache"}  # each refuses a graph it has rewritten
