"""A quantized build end to end on the tiny model: calibration from the recipe, the accuracy report in the
manifest (equal to what `aotlm eval` computes), and the recipe / calibration errors users can hit."""
from __future__ import annotations

import dataclasses
import json
import platform

import numpy as np
import pytest

from compiler.build import build
from compiler.errors import BuildError, RecipeError
from compiler.recipe import parse_recipe
from passes.calibration import CalibrationSpec
from runtime import Engine
from runtime.evaluate import builtin_text, decode_logits_for, encode_text, evaluate, tokens_fingerprint

QUANTIZE = {"quantize": {"bits": 4, "block_size": 32, "method": "awq", "embedding": "quantized",
                         "calibration": {"text": "pydoc", "samples": 4, "length": 64, "seed": 1},
                         "overrides": [{"pattern": "*down_proj*", "bits": 8}]}}
ACCURACY = {"max_tokens": 400, "window": 64, "stride": 32}


def quantized_recipe(tiny_recipe, quantize=QUANTIZE, name="tiny-awq"):
    data = tiny_recipe.to_dict()
    passes, last = data["passes"][:-1], data["passes"][-1]
    assert list(last) == ["skip_unused_rows"]  # it stays last: quantize must calibrate on every row
    data.update(name=name, passes=passes + [quantize, last], accuracy=ACCURACY)
    return parse_recipe(data, origin="test")


BUILD_MESSAGES: list[str] = []


@pytest.fixture(scope="module")
def quantized_artifact(tiny_recipe, tmp_path_factory):
    return build(quantized_recipe(tiny_recipe), tmp_path_factory.mktemp("quantized"), progress=BUILD_MESSAGES.append)


def test_long_steps_report_progress(quantized_artifact):
    for expected in ("calibration: sample 4/4", "awq: scale search", "quantize: 9/9 weights (awq)",
                     "accuracy: window"):
        assert any(message.startswith(expected) for message in BUILD_MESSAGES), (expected, BUILD_MESSAGES)
    # once: the second phase's graph takes the first's results from the memo, and had said every line again
    assert sum(message.startswith("quantize: 9/9 weights") for message in BUILD_MESSAGES) == 1, BUILD_MESSAGES


def test_pass_progress_counts_the_recipes_passes_across_the_quantize_split(quantized_artifact, tiny_recipe):
    """The build runs the passes before the first quantizing one and the rest in two calls: the second's lines
    counted from 1 again ("[6/6] pack_projections", then "[1/2] quantize")."""
    names = [spec.name for spec in quantized_recipe(tiny_recipe).passes]
    started = [message for message in BUILD_MESSAGES if message.startswith("[")]
    expected = {f"[{index + 1}/{len(names)}] {name} ({phase})" for index, name in enumerate(names)
                for phase in ("prefill", "decode")}
    assert set(started) == expected, sorted(set(started) ^ expected)


def test_manifest_reports_calibration_sizes_and_held_out_accuracy(quantized_artifact, tiny_artifact):
    manifest = json.loads((quantized_artifact / "manifest.json").read_text())
    report = next(p["report"] for p in manifest["passes"] if p["name"] == "quantize" and p["phase"] == "decode")
    assert report["calibration"]["samples"] == 4 and report["calibration"]["tokens"] == 256
    assert "pydoc" in report["calibration"]["source"]
    layer = lambda part: next(e for e in report["layers"] if "layers.1/" in e["node"] and part in e["node"])  # noqa: E731
    assert layer("down_proj")["bits"] == 8 and layer("q_proj+k_proj+v_proj")["bits"] == 4  # packed by the recipe
    assert all(0 < layer["relative_output_error"] < 0.5 for layer in report["layers"])
    assert report["embedding"]["quantized"] and report["embedding"]["kernel"] == "com.microsoft.GatherBlockQuantized"

    accuracy = manifest["accuracy"]
    held_out = accuracy["held_out"]
    assert held_out["tokens"] == 400 and held_out["window"] == 64 and "held out" in held_out["text"]
    assert held_out["python"] == platform.python_version()  # the built-in text is this Python's documentation
    assert held_out["repeats_calibration_from"] is None  # its first 400 tokens repeat no run of the calibration part
    assert 0 <= held_out["top1_agreement"] <= 1 and held_out["mean_kl"] > 0
    assert held_out["perplexity_increase"] == pytest.approx(held_out["perplexity"] / held_out["reference_perplexity"] - 1)
    assert accuracy["quantization"]["totals"]["graph_bytes_after"] < accuracy["quantization"]["totals"]["graph_bytes_before"] / 3
    weights = lambda folder: (folder / "weights.bin").stat().st_size  # noqa: E731
    assert weights(quantized_artifact) < weights(tiny_artifact) / 3

    # The manifest's numbers are `aotlm eval`'s: same runtime evaluation, same held-out text, window and stride.
    engine = Engine.load(quantized_artifact)
    tokens = np.array(encode_text(engine.tokenizer, builtin_text("pydoc-held-out"))[:400])
    assert held_out["tokens_sha256"] == tokens_fingerprint(tokens)
    again = evaluate(tokens, decode_logits_for(engine.backend), window=64, stride=32)
    assert again.perplexity == pytest.approx(held_out["perplexity"], rel=1e-6)
    # The float reference is the unquantized tiny model's decode graph: its perplexity is the tiny artifact's.
    reference = evaluate(tokens, decode_logits_for(Engine.load(tiny_artifact).backend), window=64, stride=32)
    assert reference.perplexity == pytest.approx(held_out["reference_perplexity"], rel=1e-4)
    assert len(engine.generate("Hello", max_new_tokens=5).token_ids) == 5


def test_inspect_says_in_which_formats_the_weights_are(quantized_artifact, capsys, monkeypatch):
    from compiler import cli

    monkeypatch.setattr(cli.console, "width", 300)
    assert cli.main(["inspect", str(quantized_artifact)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("weights:"))
    manifest = json.loads((quantized_artifact / "manifest.json").read_text())
    report = next(p["report"] for p in manifest["passes"] if p["name"] == "quantize" and p["phase"] == "decode")
    eight = sum(layer["bits"] == 8 for layer in report["layers"])
    assert f"{len(report['layers']) - eight} x awq int4 block" in line and f"{eight} x awq int8 per channel" in line
    assert "embedding int" in line and "MiB" in line, line


def test_bits_other_than_4_or_8_are_named_in_the_recipe(tiny_recipe):
    bad = {"quantize": {**QUANTIZE["quantize"], "bits": 3}}
    with pytest.raises(RecipeError, match=r"passes\[\d+\]\.quantize\.bits: 3 is not one of 4, 8"):
        quantized_recipe(tiny_recipe, bad)


def test_calibration_text_too_short_fails_before_any_artifact(tiny_recipe, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("A short text.\n\n" * 20)
    recipe = quantized_recipe(tiny_recipe, {"quantize": {**QUANTIZE["quantize"],
                                                         "calibration": {"text": str(text), "samples": 64,
                                                                         "length": 32}}})
    with pytest.raises(BuildError, match=r"calibration: calibration text has \d+ tokens: too short for 64 samples"):
        build(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    missing = dataclasses.replace(CalibrationSpec(), text=str(tmp_path / "nope.txt"), length=32)
    recipe = quantized_recipe(tiny_recipe, {"quantize": {**QUANTIZE["quantize"],
                                                         "calibration": dataclasses.asdict(missing)}})
    with pytest.raises(BuildError, match=r"passes\[\d+\].quantize.calibration.text: .*nope.txt: no such file; give a "
                                         r"UTF-8 text file, or 'pydoc'"):
        build(recipe, tmp_path / "out")


@pytest.fixture(scope="module")
def float_prefill_artifact(tiny_recipe, tmp_path_factory):
    """INT4 (RTN, float activations) with dequantize_weights on the prefill graph, as the quantized recipes run it."""
    data = quantized_recipe(tiny_recipe, {"quantize": {"bits": 4, "block_size": 32, "embedding": "quantized"}},
                            name="tiny-int4-float-prefill").to_dict()
    data["passes"].append({"dequantize_weights": {"phases": ["prefill"]}})
    return build(parse_recipe(data, origin="test"), tmp_path_factory.mktemp("float-prefill"))


def external_tensors(model_path) -> set[tuple[str, str]]:
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    return {(entry["offset"], entry["length"]) for entry in
            ({e.key: e.value for e in t.external_data} for t in model.graph.initializer) if entry}


def test_prefill_computes_in_float_from_the_decode_graphs_codes(float_prefill_artifact):
    manifest = json.loads((float_prefill_artifact / "manifest.json").read_text())
    assert manifest["engines"]["prefill"]["session_config"] == {"session.disable_quant_qdq": "1"}
    assert "session_config" not in manifest["engines"]["decode"]
    reports = {p["phase"]: p["report"] for p in manifest["passes"] if p["name"] == "dequantize_weights"}
    assert reports["prefill"]["applied"] and len(reports["prefill"]["rewritten"]) == 8  # 2 layers x 4 products
    assert not reports["decode"]["applied"]
    # The prefill graph adds no weight bytes: every tensor it reads from weights.bin, the decode graph reads too.
    prefill, decode = (external_tensors(float_prefill_artifact / f"{phase}.onnx") for phase in ("prefill", "decode"))
    assert prefill and prefill <= decode

    # Prefill (float products over the dequantized codes) and the decode graph (MatMulNBits, float activations at
    # accuracy level 0) compute the same logits for the same prompt from an empty cache.
    engine = Engine.load(float_prefill_artifact)
    ids = np.array([[1, 5, 9, 14, 200, 7]], np.int64)
    positions, mask = np.arange(6)[None], np.ones((1, 6), np.int64)
    engine.backend.allocate_cache(1)
    from_prefill = engine.backend.run("prefill", ids, positions, mask)[0].copy()
    from_decode = engine.backend.run("decode", ids, positions, mask)[0, -1]
    np.testing.assert_allclose(from_prefill, from_decode, rtol=0, atol=1e-4)
    assert len(engine.generate("Hello", max_new_tokens=5).token_ids) == 5


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
def test_quantize_before_fuse_attention_fuses_every_layer_and_gives_the_same_logits(tiny_recipe, tmp_path, lowering):
    """fuse_attention matched projections by constant float weights only: after quantize (DequantizeLinear ->
    MatMul, or MatMulNBits) it fused no layer, so a calibrated quantize for TensorRT, which must run before the
    plugins' lowering, had no order that built. INT8 per channel rounds each column alone, so quantizing before
    fusion and packing gives the codes quantizing after gives."""
    quantize = {"quantize": {"bits": 8, "method": "rtn", "lowering": lowering}}
    after = quantized_recipe(tiny_recipe, quantize, name="after")
    data = after.to_dict()
    names = [next(iter(entry)) for entry in data["passes"]]
    moved = data["passes"].pop(names.index("quantize"))
    data["passes"].insert(names.index("cleanup") + 1, moved)
    data.update(name="before", accuracy={"enabled": False})
    before = parse_recipe(data, origin="test")
    assert [spec.name for spec in before.passes][:3] == ["cleanup", "quantize", "fuse_attention"]
    ids = np.random.default_rng(0).integers(3, 512, 40).tolist()
    logits = []
    for recipe in (after, before):
        folder = build(dataclasses.replace(recipe, accuracy=dataclasses.replace(recipe.accuracy, enabled=False)),
                       tmp_path / recipe.name)
        manifest = json.loads((folder / "manifest.json").read_text())
        fused = [p["report"]["fused"] for p in manifest["passes"] if p["name"] == "fuse_attention"]
        assert fused == [2, 2], fused
        logits.append(decode_logits_for(Engine.load(folder))(ids))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-4)
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).all()


@pytest.mark.parametrize("lowering", ["matmulnbits", "dequantize_linear"])
def test_awq_before_fuse_attention_fuses_every_layer(tiny_recipe, tmp_path, lowering):
    """Before fusion AWQ's o_proj input scales fold into no producer: a Mul stays before o_proj, and fuse_attention,
    which looked for o_proj right after the heads' merge, fused no layer (a required fusion failed the build). The
    fused node now feeds that Mul: its logits are the unfused graph's, the same quantized weights."""
    awq = {"quantize": {"bits": 4, "block_size": 32, "method": "awq", "lowering": lowering,
                        "calibration": {"text": "pydoc", "samples": 2, "length": 32}}}
    data = quantized_recipe(tiny_recipe, awq, name="awq-first").to_dict()
    names = [next(iter(entry)) for entry in data["passes"]]
    moved = data["passes"].pop(names.index("quantize"))
    data["passes"].insert(names.index("cleanup") + 1, moved)
    data["accuracy"] = {"enabled": False}
    fused_recipe = parse_recipe(data, origin="test")
    unfused = dict(data, name="awq-unfused", passes=[entry for entry in data["passes"] if next(iter(entry)) not in (
        "fuse_attention", "lower_onnxruntime")])
    ids = np.random.default_rng(0).integers(3, 512, 40).tolist()
    logits = []
    for recipe in (fused_recipe, parse_recipe(unfused, origin="test")):
        folder = build(recipe, tmp_path / recipe.name)
        manifest = json.loads((folder / "manifest.json").read_text())
        reports = [p["report"] for p in manifest["passes"] if p["name"] in ("quantize", "fuse_attention")]
        logits.append(decode_logits_for(Engine.load(folder))(ids))
        if recipe is fused_recipe:
            assert [r["fused"] for r in reports if "fused" in r] == [2, 2]
            kept = [layer for r in reports if "layers" in r for layer in r["layers"] if "Mul inserted" in
                    str(layer.get("awq") or "")]
            assert kept, "no o_proj kept a Mul of input scales: the case this test is for did not arise"
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4)


def test_the_accuracy_report_opens_only_decode_engines(tiny_recipe, tmp_path, monkeypatch):
    """It opened the artifact's prefill too, which it never runs, whose session holds the quantized weights as float
    (a dequantize_weights build): SmolLM2's INT4 build peaked 1 GB higher."""
    import compiler.accuracy

    opened = []
    backend = compiler.accuracy.OnnxRuntimeBackend

    def recording(folder, manifest, *args, **kwargs):
        opened.append(sorted(manifest["engines"]))
        return backend(folder, manifest, *args, **kwargs)

    monkeypatch.setattr(compiler.accuracy, "OnnxRuntimeBackend", recording)
    build(quantized_recipe(tiny_recipe, name="tiny-report"), tmp_path)
    assert opened == [["decode"], ["decode"]]  # the float reference's and the artifact's
