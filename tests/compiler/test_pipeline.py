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
from compiler.pass_reports import format_reports
from compiler.pass_reports import PassResult
from compiler.pipeline import run_pipeline
from passes import cleanup, fuse_silu
from passes.errors import PassError
from passes.registry import PASSES, PassEntry
from passes.session_config import record_session_config, session_config


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


def with_constant(model: onnx.ModelProto, shape: tuple[int, ...]) -> onnx.ModelProto:
    """`model` with its Add's constant reshaped to `shape` (3 values either way): [3] adds to x's [3]; [3, 1]
    broadcasts; [1, 3] too; a size that cannot broadcast ([2]) does not check."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    values = np.ones(shape, np.float32)
    changed.graph.node[0].attribute[0].t.CopyFrom(numpy_helper.from_array(values))
    return changed


def test_a_graph_whose_shapes_cannot_check_names_the_pass_that_made_it(monkeypatch):
    """A pass that gave a weight sizes its product cannot take was accepted (the checker ran without shape
    inference) and failed as onnxruntime's error at the session load, naming no pass."""
    register(monkeypatch, "resize_constant", lambda model, options: (with_constant(model, (2,)), {}))
    with pytest.raises(BuildError, match=r"pass 'resize_constant' produced a prefill graph whose shapes do not "
                                         r"check: .*Add"):
        run_pipeline(phases(), [Spec("resize_constant")])
    # a graph that did not check before the pass is not the pass's doing: it runs on
    broken = {phase: with_constant(model, (2,)) for phase, model in phases().items()}
    register(monkeypatch, "identity", lambda model, options: (model, {}))
    run_pipeline(broken, [Spec("identity")])


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


def test_outputs_reordered_without_saying_so_fail_too():
    """The same names in another order: the check compared lists, and nothing asserted that (a mutation audit)."""
    from onnx import TensorProto, helper

    from compiler.pipeline import check_pass_result

    def model(order):
        value = helper.make_tensor_value_info
        nodes = [helper.make_node("Identity", ["x"], [name]) for name in ("logits", "present.0.key")]
        graph = helper.make_graph(nodes, "g", [value("x", TensorProto.FLOAT, [1])],
                                  [value(name, TensorProto.FLOAT, [1]) for name in order])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])

    with pytest.raises(BuildError, match=r"pass 'reorder' changed the decode graph's outputs"):
        check_pass_result("reorder", "decode", model(["logits", "present.0.key"]), model(["present.0.key", "logits"]),
                          {})


def test_custom_domains_pass_the_check(monkeypatch):
    def add_custom_ops(model, options):
        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(model)
        rewritten.graph.node.append(helper.make_node("FlashAttention", ["x"], ["fused"], domain="aotlm"))
        rewritten.graph.node.append(helper.make_node("MatMulNBits", ["x"], ["quantized"], domain="com.microsoft"))
        # onnxruntime's own op in the default domain, which the checker has no schema for
        rewritten.graph.node.append(helper.make_node("SimplifiedLayerNormalization", ["x", "one"], ["normalized"]))
        rewritten.opset_import.extend([helper.make_opsetid("aotlm", 1), helper.make_opsetid("com.microsoft", 1)])
        return rewritten, {"fused": np.int64(1), "scales": np.array([0.5])}

    register(monkeypatch, "add_custom_ops", add_custom_ops)
    graphs, results = run_pipeline(phases(), [Spec("add_custom_ops")])
    assert results[0].report == {"fused": 1, "scales": [0.5]}
    assert graphs["prefill"].graph.node[-1].domain == ""  # checked as com.microsoft, kept where onnxruntime wants it
    assert type(results[0].report["fused"]) is int


def test_report_keys_are_strings_as_the_manifests_json_holds_them(monkeypatch):
    register(monkeypatch, "keyed_report", lambda model, options: (model, {"layers": {0: "fused", np.int64(1): "kept"}}))
    _, results = run_pipeline(phases(), [Spec("keyed_report")])
    assert results[0].report == {"layers": {"0": "fused", "1": "kept"}}  # an np.int64 key fails json.dumps


def test_a_pass_that_returns_no_model_is_named(monkeypatch):
    register(monkeypatch, "forgets_the_model", lambda model, options: (None, {}))
    with pytest.raises(BuildError, match=r"^pass 'forgets_the_model' \(prefill\) returned a NoneType, not an "
                                         r"onnx.ModelProto$"):
        run_pipeline(phases(), [Spec("forgets_the_model")])


def test_a_renamed_input_fails_like_a_renamed_output(monkeypatch):
    def rename_input(model, options):
        renamed = onnx.ModelProto()
        renamed.CopyFrom(model)
        renamed.graph.input[0].name = "tokens"
        for node in renamed.graph.node:
            node.input[:] = ["tokens" if name == "x" else name for name in node.input]
        return renamed, {}

    register(monkeypatch, "rename_input", rename_input)
    with pytest.raises(BuildError, match=r"^pass 'rename_input' changed the prefill graph's inputs from \['x'\] to "
                                         r"\['tokens'\]; a pass that means to must say changes_io: True"):
        run_pipeline(phases(), [Spec("rename_input")])


@dataclass(frozen=True)
class PrefillOnly:
    phases: tuple[str, ...] = ("prefill",)


def test_a_pass_with_a_phases_option_runs_on_those_phases_only(monkeypatch):
    ran_on = []
    monkeypatch.setitem(PASSES, "prefill_only", PassEntry(
        lambda model, options: (ran_on.append(model.graph.output[0].name) or model, {"applied": True}),
        PrefillOnly, "test-only pass"))
    graphs = {"prefill": make_phase("p"), "decode": make_phase("d")}
    result, results = run_pipeline(graphs, [Spec("prefill_only", PrefillOnly())])
    assert ran_on == ["p"] and result["decode"] is graphs["decode"]
    assert [(r.phase, r.report) for r in results] == [
        ("prefill", {"applied": True}),
        ("decode", {"applied": False, "reason": "runs on prefill only (its phases option)"})]


def test_session_settings_an_earlier_pass_recorded_outlive_a_pass_that_drops_metadata(monkeypatch):
    """A pass that rebuilds its model (through onnx-graphsurgeon) returns it without metadata_props: the settings
    the onnxruntime backend copies into the manifest would be lost."""
    graphs = phases()
    for model in graphs.values():
        record_session_config(model, model, {"session.disable_quant_qdq": "1"})
    register(monkeypatch, "rebuild", lambda model, options: (make_phase(), {}))  # a fresh model, no metadata
    result, _ = run_pipeline(graphs, [Spec("rebuild")])
    assert {phase: session_config(model) for phase, model in result.items()} == {
        "prefill": {"session.disable_quant_qdq": "1"}, "decode": {"session.disable_quant_qdq": "1"}}


def test_the_report_table_left_aligns_text_and_right_aligns_numbers():
    table = format_reports([PassResult("cleanup", "prefill", 0.5, {}, 4, 2),
                            PassResult("fuse_attention", "decode", 12.25, {}, 120, 96)])
    assert table.splitlines() == ["pass            phase    seconds      nodes",
                                  "cleanup         prefill     0.50     4 -> 2",
                                  "fuse_attention  decode     12.25  120 -> 96"]


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


def test_a_large_weight_kept_in_a_side_file_is_checked_without_its_data(tmp_path, monkeypatch):
    """A graph loaded without its external data holds a location, not bytes: that is not a missing data field (the
    checker itself looks for the file, relative to the working folder for a model in memory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(bytes(4 * 20000 * 4))

    def move_out(model):
        weight = model.graph.initializer[0]
        weight.ClearField("raw_data")
        weight.data_location = TensorProto.EXTERNAL
        weight.external_data.add(key="location", value="weights.bin")

    model = with_large_weight(move_out)
    pipeline.check_pass_result("rewrite", "decode", model, model, {})


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


def test_passes_that_want_different_phases_first_cannot_run_one_phase_at_a_time(tmp_path, monkeypatch):
    for name, first in (("prefill_first", ("prefill",)), ("decode_first", ("decode",))):
        monkeypatch.setitem(PASSES, name, PassEntry(lambda model, options: (model, {}), NoOptions, "test-only pass",
                                                    runs_first_on=first))
    with pytest.raises(BuildError, match=r"^passes want different phases first \(decode, prefill\); they cannot run "
                                         r"one phase at a time$"):
        run_pipeline(phases(), [Spec("prefill_first"), Spec("decode_first")], consume=True, spill_dir=tmp_path)


def specs(*names):
    from compiler.recipe import PassSpec

    return [PassSpec(name, PASSES[name].options_type()) for name in names]


@pytest.mark.parametrize("names, refused", [
    # the lowering must lie between fuse_attention and quantize: one before them lowers nothing fuse_attention makes
    (("lower_onnxruntime", "fuse_attention", "quantize"), "passes[2] (quantize) comes after passes[1] (fuse_attention): "
                                                          "its calibration and the accuracy report run the graph"),
    # a rule without the lowering exception holds whatever lies between
    (("fuse_rotary", "lower_onnxruntime", "fuse_attention"), "passes[2] (fuse_attention) comes after passes[0] "
                                                             "(fuse_rotary): fuse_attention reads the rotary math"),
    # a cleanup after the passes that leave work to the session load would fold it at build, storing weights twice
    (("cleanup", "quantize", "dequantize_weights", "cleanup"), "passes[3] (cleanup) comes after passes[2] "
                                                               "(dequantize_weights): cleanup would fold at build"),
    (("cleanup", "slice_packed_weights", "cleanup"), "passes[2] (cleanup) comes after passes[1] "
                                                     "(slice_packed_weights): cleanup would fold prefill's slices"),
])
def test_an_order_rule_is_excused_only_by_a_lowering_between_and_only_where_it_says(names, refused):
    with pytest.raises(BuildError) as error:
        pipeline.check_passes(specs(*names))
    assert str(error.value).startswith(refused)
    pipeline.check_passes(specs("fuse_attention", "lower_onnxruntime", "quantize"))  # lowered between: allowed


def test_with_tensorrt_quantize_follows_lower_tensorrt_when_nothing_calibrates():
    """Round to nearest runs no graph, so it may follow TensorRT's plugins (the accuracy report is onnxruntime's
    only); AWQ and GPTQ calibrate in onnxruntime, which cannot run them. Every order had been refused."""
    from compiler.recipe import PassSpec
    from passes.quantize import Options, Override

    lowered = specs("cleanup", "fuse_attention", "lower_tensorrt")
    pipeline.check_passes([*lowered, PassSpec("quantize", Options(bits=8, lowering="dequantize_linear"))])
    skipped = Override(pattern="*lm_head*", skip=True)
    pipeline.check_passes([*lowered, PassSpec("quantize", Options(bits=8, lowering="dequantize_linear",
                                                                  overrides=(skipped,)))])
    for options in (Options(bits=4, block_size=64, method="awq"),
                    Options(bits=8, overrides=(Override(pattern="*mlp*", method="gptq"),))):
        with pytest.raises(BuildError, match=r"passes\[3\] \(quantize\) comes after passes\[2\] \(lower_tensorrt\) "
                                             r"with method (awq|gptq), whose calibration runs the graph in onnxruntime"):
            pipeline.check_passes([*lowered, PassSpec("quantize", options)])
    # round to nearest with a calibration set runs the graph too, for its per-layer error report
    from passes.calibration import CalibrationSpec

    rtn_calibrated = Options(bits=8, lowering="dequantize_linear", calibration=CalibrationSpec())
    with pytest.raises(BuildError, match=r"with calibration set, whose per-layer error report runs the graph in "
                                         r"onnxruntime.*; list quantize before fuse_attention"):
        pipeline.check_passes([*lowered, PassSpec("quantize", rtn_calibrated)])
    # calibrated, before the fusion: on the float graph, which onnxruntime runs
    awq = Options(bits=4, block_size=64, method="awq", lowering="dequantize_linear", calibration=CalibrationSpec())
    pipeline.check_passes([lowered[0], PassSpec("quantize", awq), *lowered[1:]])


def test_max_rewrites_zero_is_allowed_and_below_it_is_named():
    from compiler.recipe import PassSpec

    # 0: the first step of bisecting a parity failure (no rewrite at all)
    pipeline.check_passes([PassSpec("fuse_silu", fuse_silu.Options(max_rewrites=0))])
    with pytest.raises(BuildError, match=r"^passes\[1\]\.fuse_silu\.max_rewrites: -1 must be >= 0 \(or null: every "
                                         r"match\)$"):
        pipeline.check_passes([*specs("cleanup"), PassSpec("fuse_silu", fuse_silu.Options(max_rewrites=-1))])


def test_a_refused_option_names_the_pass_and_its_index(monkeypatch):
    def refuse(options):
        raise PassError("bits: 3 is not one of 4, 8")

    monkeypatch.setitem(PASSES, "picky", PassEntry(lambda model, options: (model, {}), NoOptions, "test-only pass",
                                                   check=refuse))
    with pytest.raises(BuildError, match=r"^passes\[1\] \(picky\): bits: 3 is not one of 4, 8$"):
        pipeline.check_passes([*specs("cleanup"), Spec("picky", NoOptions())])


@pytest.mark.parametrize("caller_froze", [False, True])
def test_objects_from_before_are_frozen_while_the_passes_run_and_thawed_after(monkeypatch, caller_froze):
    """run_pipeline keeps what existed before it out of the collector's way while the passes run (gc.freeze), and
    gives it back after, a failing pass too; a caller's own freeze is left as it was."""
    import gc

    seen = []

    def observe(model, options):
        seen.append(gc.get_freeze_count())
        return model, {}

    def fail(model, options):
        raise PassError("no")

    register(monkeypatch, "observe", observe)
    register(monkeypatch, "fail", fail)
    if caller_froze:
        gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run_pipeline(phases(), [Spec("observe")])
        with pytest.raises(BuildError):
            run_pipeline(phases(), [Spec("fail")])
        after = gc.get_freeze_count()
        # a caller's freeze stays (a frozen object may still die meanwhile: 720338 became 720336 once, under load)
        assert 0.99 * frozen < after <= frozen if caller_froze else after == 0
    finally:
        gc.unfreeze()
    assert seen and all(count > 0 for count in seen)


def test_a_pass_that_refuses_its_graph_is_named_by_its_place_in_the_recipe(monkeypatch):
    """It read "pass 'quantize' (decode): quantize: ...": the pass named twice, and not where the recipe lists it."""
    def refuses(model, options):
        raise PassError("refuses: no MatMul of that shape")

    register(monkeypatch, "refuses", refuses)
    with pytest.raises(BuildError, match=r"^passes\[1\] \(refuses, prefill graph\): no MatMul of that shape$"):
        run_pipeline(phases(), [Spec("cleanup"), Spec("refuses")])
    with pytest.raises(BuildError, match=r"^passes\[4\] \(refuses, prefill graph\)"):  # a later pipeline's place
        run_pipeline(phases(), [Spec("refuses")], numbered=(4, 6))
