"""quantize_kv_cache: int8 cache I/O and GroupQueryAttention attributes, calibrated scales shared by both phases,
the codes onnxruntime writes against the float graph's cache, logits against the float graphs, and bad input."""
from __future__ import annotations

import collections
import re

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from compiler.export import export_graphs, io_names
from compiler.frontend.config import DecoderConfig
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from passes import cleanup, fuse_attention, lower_onnx_attention, lower_onnxruntime, quantize_kv_cache
from passes.calibration import CalibrationSet, CalibrationSpec
from passes.errors import PassError

MAX_CONTEXT = 32
CONFIG = DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,))
CALIBRATION_TOKENS = np.random.default_rng(7).integers(3, CONFIG.vocab_size, (4, 20))


def calibration_set() -> CalibrationSet:
    return CalibrationSet(text="random tokens", samples=4, length=20, token_ids=CALIBRATION_TOKENS)


@pytest.fixture(scope="module")
def lowered_graphs():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    graphs = {}
    for phase, model in export_graphs(decoder, MAX_CONTEXT).items():
        model = cleanup.run(model, cleanup.Options())[0]
        model = fuse_attention.run(model, fuse_attention.Options(required=True))[0]
        graphs[phase] = lower_onnxruntime.run(model, lower_onnxruntime.Options())[0]
    return graphs


@pytest.fixture(scope="module")
def quantized(lowered_graphs):
    options = quantize_kv_cache.Options(calibration=calibration_set())  # one set: the phases share its memo
    return {phase: quantize_kv_cache.run(model, options) for phase, model in lowered_graphs.items()}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def run_steps(graphs: dict, dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A 6-token prompt, then four decode steps; returns the logits of each step and the final caches."""
    inputs, _ = io_names(CONFIG)
    sessions = {phase: session(model) for phase, model in graphs.items()}
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), dtype)] * (2 * CONFIG.num_layers)
    prompt = [1, 5, 9, 14, 200, 7]
    feed = {"input_ids": np.array([prompt]), "position_ids": np.arange(6)[None], "attention_mask": np.ones((1, 6), np.int64)}
    logits, *caches = sessions["prefill"].run(None, {**feed, **dict(zip(inputs[3:], caches))})
    collected = [logits.reshape(-1)]
    for step in range(4):
        length = 6 + step
        feed = {"input_ids": np.array([[30 + step]]), "position_ids": np.array([[length]]),
                "attention_mask": np.ones((1, length + 1), np.int64)}
        logits, *caches = sessions["decode"].run(None, {**feed, **dict(zip(inputs[3:], caches))})
        collected.append(logits.reshape(-1))
    return collected, caches


def attributes_of(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_cache_io_becomes_int8_decode_reads_codes_and_prefill_writes_them(quantized):
    for phase, (model, report) in quantized.items():
        assert report["quantized_layers"] == CONFIG.num_layers and report["dtype"] == "int8"
        assert report["prefill_attention"] == ("float" if phase == "prefill" else None)  # decode reads codes either way
        cache_io = [v for v in [*model.graph.input, *model.graph.output] if v.name.startswith(("past_key", "present."))]
        assert len(cache_io) == 4 * CONFIG.num_layers
        assert {v.type.tensor_type.elem_type for v in cache_io} == {onnx.TensorProto.INT8}
        nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(nodes) == CONFIG.num_layers
        onnx.checker.check_model(model)
    for node in (n for n in quantized["decode"][0].graph.node if n.op_type == "GroupQueryAttention"):
        attributes = attributes_of(node)
        assert attributes["k_quant_type"] == attributes["v_quant_type"] == b"PER_CHANNEL"
        assert attributes["kv_cache_bit_width"] == 8
        assert len(node.input) == 14 and node.input[12] == f"{node.input[3]}.kv_scale"
        assert initializer(quantized["decode"][0], node.input[12]).shape == (CONFIG.num_kv_heads * CONFIG.head_dim,)
    # Prefill has no past: its attention runs in float over the prompt, then Round/Clip/Cast/Pad write the codes.
    prefill = quantized["prefill"][0]
    for node in (n for n in prefill.graph.node if n.op_type == "GroupQueryAttention"):
        assert "k_quant_type" not in attributes_of(node) and node.input[3] == node.input[4] == ""
    producers = {output: node.op_type for node in prefill.graph.node for output in node.output}
    assert {producers[v.name] for v in prefill.graph.output if v.name.startswith("present.")} == {"Pad"}
    assert collections.Counter(n.op_type for n in prefill.graph.node)["Round"] == 2 * CONFIG.num_layers


def prefill_inverse_scale(prefill: onnx.ModelProto, layer: int, kind: str) -> np.ndarray:
    return initializer(prefill, f"layers.{layer}.FlashAttention/int8_cache/{kind}_inverse_scale").reshape(-1)


def test_both_phases_get_the_same_scales_and_they_cover_the_calibration_peaks_with_headroom(quantized, lowered_graphs):
    (prefill, _), (decode, _) = quantized["prefill"], quantized["decode"]
    inputs, outputs = io_names(CONFIG)
    for name in inputs[3:]:  # past_key_values.{layer}.{kind}
        _, layer, kind = name.split(".")
        np.testing.assert_array_equal(prefill_inverse_scale(prefill, int(layer), kind),  # what decode multiplies by
                                      np.float32(1) / initializer(decode, f"{name}.kv_scale"))
    # What the float prefill graph writes into its cache over the calibration samples, channel by channel.
    float_prefill = session(lowered_graphs["prefill"])
    peaks, pairs = {}, {}
    for sample in CALIBRATION_TOKENS:
        zeros = np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)
        feed = {"input_ids": sample[None], "position_ids": np.arange(len(sample))[None],
                "attention_mask": np.ones((1, len(sample)), np.int64), **{name: zeros for name in inputs[3:]}}
        for name, value in zip(inputs[3:], float_prefill.run(outputs[1:], feed)):
            rows = value[0, :, :len(sample)]
            peaks[name] = np.maximum(peaks.get(name, 0), np.abs(rows).max(axis=1).reshape(-1))
            half = CONFIG.head_dim // 2  # Llama's rotary pairs channel c with c + head_dim / 2
            norm = np.hypot(rows[..., :half], rows[..., half:]).max(axis=1)
            pairs[name] = np.maximum(pairs.get(name, 0), np.concatenate([norm, norm], -1).reshape(-1))
    for name, peak in peaks.items():  # headroom over the peak; a rotated key's pair norm at least
        covered = np.maximum(1.5 * peak, pairs[name]) if name.endswith(".key") else 1.5 * peak
        np.testing.assert_allclose(initializer(decode, f"{name}.kv_scale") * 127, covered, rtol=1e-6)
    assert any((pairs[name] > 1.5 * peaks[name]).any() for name in peaks if name.endswith(".key"))  # it mattered


def test_codes_in_the_cache_are_the_float_cache_rounded_by_the_scales(quantized, lowered_graphs):
    _, float_caches = run_steps(lowered_graphs, np.float32)
    _, int8_caches = run_steps({phase: model for phase, (model, _) in quantized.items()}, np.int8)
    inputs, _ = io_names(CONFIG)
    decode = quantized["decode"][0]
    # Layer 0's keys and values depend only on the prompt: its codes are the float cache rounded (to one code,
    # where a value sits at a rounding boundary) and clipped. Later layers read layer 0's rounded cache.
    for position, (name, exact, codes) in enumerate(zip(inputs[3:], float_caches, int8_caches)):
        written = 10  # 6 prompt tokens + 4 decode steps
        assert codes[0, :, :written].any() and not codes[0, :, written:].any(), name  # only the sequence's rows
        if position < 2:
            scale = initializer(decode, f"{name}.kv_scale").reshape(CONFIG.num_kv_heads, 1, CONFIG.head_dim)
            expected = np.clip(np.round(exact[0, :, :written] * quantize_kv_cache.reciprocal(scale)), -128, 127)
            np.testing.assert_array_equal(codes[0, :, :written], expected, err_msg=name)


def test_logits_stay_within_the_round_off_of_the_float_graphs(quantized, lowered_graphs):
    float_logits, _ = run_steps(lowered_graphs, np.float32)
    int8_logits, _ = run_steps({phase: model for phase, (model, _) in quantized.items()}, np.int8)
    np.testing.assert_array_equal(float_logits[0], int8_logits[0])  # prefill attends over the prompt in float
    for exact, approximate in zip(float_logits[1:], int8_logits[1:]):  # decode reads the rounded cache
        spread = exact.max() - exact.min()
        assert np.abs(exact - approximate).max() < 0.02 * spread
        assert not np.array_equal(exact, approximate)


def test_decode_reads_the_codes_as_the_float_graph_reads_their_dequantized_values(quantized, lowered_graphs):
    """One decode step over an int8 cache of 10 written rows against the float graph's step over those codes times
    their scales: only this step's own key and value, rounded as they are written, differ. Measured 7.4e-4 of the
    logit range; the k and v scales swapped gave 7.2e-2, each head's channels reversed 8.6e-2."""
    _, codes = run_steps({phase: model for phase, (model, _) in quantized.items()}, np.int8)
    inputs, _ = io_names(CONFIG)
    decode = quantized["decode"][0]
    restored = [codes_ * initializer(decode, f"{name}.kv_scale").reshape(1, CONFIG.num_kv_heads, 1, CONFIG.head_dim)
                for name, codes_ in zip(inputs[3:], codes)]
    feed = {"input_ids": np.array([[77]]), "position_ids": np.array([[10]]), "attention_mask": np.ones((1, 11), np.int64)}
    int8_logits, *presents = session(decode).run(None, {**feed, **dict(zip(inputs[3:], codes))})
    float_logits, *_ = session(lowered_graphs["decode"]).run(None, {**feed, **dict(zip(inputs[3:], restored))})
    spread = float(float_logits.max() - float_logits.min())
    assert np.abs(int8_logits - float_logits).max() < 5e-3 * spread
    for before, after in zip(codes, presents):  # the step wrote row 10 only
        np.testing.assert_array_equal(after[0, :, :10], before[0, :, :10])
        assert after[0, :, 10].any() and not after[0, :, 11:].any()


def test_prefill_attention_int8_keeps_the_quantized_path_in_prefill_too(lowered_graphs):
    options = quantize_kv_cache.Options(prefill_attention="int8", calibration=calibration_set())
    graphs = {phase: quantize_kv_cache.run(model, options)[0] for phase, model in lowered_graphs.items()}
    for node in (n for n in graphs["prefill"].graph.node if n.op_type == "GroupQueryAttention"):
        assert attributes_of(node)["kv_cache_bit_width"] == 8 and node.input[3].startswith("past_key_values")
    float_logits, float_caches = run_steps(lowered_graphs, np.float32)
    int8_logits, int8_caches = run_steps(graphs, np.int8)
    assert not np.array_equal(float_logits[0], int8_logits[0])  # the prompt's attention reads the codes too
    for exact, approximate in zip(float_logits, int8_logits):
        assert np.abs(exact - approximate).max() < 0.02 * (exact.max() - exact.min())
    # Layer 0's codes do not depend on which path wrote them.
    _, default_caches = run_steps({p: quantize_kv_cache.run(m, quantize_kv_cache.Options(
        calibration=calibration_set()))[0] for p, m in lowered_graphs.items()}, np.int8)
    np.testing.assert_array_equal(default_caches[0], int8_caches[0])


def test_report_measures_the_round_off(quantized, lowered_graphs):
    """Each layer's reported error, E(x - x̂)² / E x² of its keys and values over the calibration samples, and its
    scale range, recomputed from the float prefill graph's cache and the scales the decode graph reads."""
    decode, report = quantized["decode"]
    assert report["calibration"]["samples"] == 4
    assert [layer["layer"] for layer in report["layers"]] == ["layers.0.FlashAttention", "layers.1.FlashAttention"]
    inputs, outputs = io_names(CONFIG)
    float_prefill = session(lowered_graphs["prefill"])
    squared_error, squared = collections.Counter(), collections.Counter()
    for sample in CALIBRATION_TOKENS:
        zeros = np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)
        feed = {"input_ids": sample[None], "position_ids": np.arange(len(sample))[None],
                "attention_mask": np.ones((1, len(sample)), np.int64), **{name: zeros for name in inputs[3:]}}
        for name, value in zip(inputs[3:], float_prefill.run(outputs[1:], feed)):
            rows = value[0, :, :len(sample)].astype(np.float64)
            scale = initializer(decode, f"{name}.kv_scale").reshape(CONFIG.num_kv_heads, 1, CONFIG.head_dim)
            restored = np.clip(np.round(rows / scale), -128, 127) * scale
            squared_error[name] += np.sum((rows - restored) ** 2)
            squared[name] += np.sum(rows ** 2)
    for index, layer in enumerate(report["layers"]):
        for kind in ("key", "value"):
            name = f"past_key_values.{index}.{kind}"
            np.testing.assert_allclose(layer[f"{kind}_error"], squared_error[name] / squared[name], rtol=1e-3)
            scale = initializer(decode, f"{name}.kv_scale")
            assert layer[f"{kind}_scale"] == [float(scale.min()), float(scale.max())]
    for kind in ("key", "value"):
        mean = np.mean([layer[f"{kind}_error"] for layer in report["layers"]])
        assert report["relative_error"][f"{kind}_mean"] == pytest.approx(mean, rel=1e-12) and 0 < mean < 1e-3


def test_per_tensor_scales_are_one_number_per_layer_and_kind(lowered_graphs):
    options = quantize_kv_cache.Options(granularity="per_tensor", calibration=calibration_set())
    graphs = {phase: quantize_kv_cache.run(model, options) for phase, model in lowered_graphs.items()}
    model, report = graphs["decode"]
    scales = [initializer(model, t.name) for t in model.graph.initializer if t.name.endswith(".kv_scale")]
    assert [s.shape for s in scales] == [(1,)] * (2 * CONFIG.num_layers)
    assert report["granularity"] == "per_tensor"
    float_logits, _ = run_steps(lowered_graphs, np.float32)
    int8_logits, _ = run_steps({phase: model for phase, (model, _) in graphs.items()}, np.int8)
    for exact, approximate in zip(float_logits, int8_logits):
        assert np.abs(exact - approximate).max() < 0.05 * (exact.max() - exact.min())


def test_a_graph_without_group_query_attention_is_refused_naming_the_order(lowered_graphs):
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    fused = fuse_attention.run(cleanup.run(export_graphs(decoder, MAX_CONTEXT)["decode"], cleanup.Options())[0],
                               fuse_attention.Options())[0]
    with pytest.raises(PassError, match="after lower_onnxruntime"):
        quantize_kv_cache.run(fused, quantize_kv_cache.Options(calibration=calibration_set()))


def test_a_layer_lowered_to_another_attention_op_is_refused_by_its_cache(lowered_graphs):
    """Layer 0 on GroupQueryAttention, layer 1 on ONNX Attention: the pass turned layer 0's cache to int8 and left
    layer 1's float, an artifact whose runtime failed in onnxruntime at the first prompt."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    fused = fuse_attention.run(cleanup.run(export_graphs(decoder, MAX_CONTEXT)["decode"], cleanup.Options())[0],
                               fuse_attention.Options())[0]
    mixed = lower_onnxruntime.run(fused, lower_onnxruntime.Options(max_rewrites=1))[0]
    mixed = lower_onnx_attention.run(mixed, lower_onnx_attention.Options())[0]
    with pytest.raises(PassError, match=r"past_key_values.1.key, past_key_values.1.value: KV-cache inputs that no "
                                        r"GroupQueryAttention reads"):
        quantize_kv_cache.run(mixed, quantize_kv_cache.Options(calibration=calibration_set()))


def test_bad_options_and_a_second_run_are_clear_errors(quantized, lowered_graphs):
    with pytest.raises(PassError, match="bits: 4 is not supported"):
        quantize_kv_cache.run(lowered_graphs["decode"], quantize_kv_cache.Options(bits=4, calibration=calibration_set()))
    for headroom in (0.5, float("nan")):  # NaN is neither < 1 nor >= 1: the check is written `not >= 1` for it
        with pytest.raises(PassError, match=f"headroom: {headroom} must be >= 1"):
            quantize_kv_cache.run(lowered_graphs["decode"],
                                  quantize_kv_cache.Options(headroom=headroom, calibration=calibration_set()))
    # 1e39 was accepted: the scales overflowed to inf and every decode logit was NaN
    for headroom in (128.0, 1e39):
        with pytest.raises(PassError, match=re.escape(f"headroom: {headroom} puts the calibration peak below code 1")):
            quantize_kv_cache.run(lowered_graphs["decode"],
                                  quantize_kv_cache.Options(headroom=headroom, calibration=calibration_set()))
    with pytest.raises(PassError, match="calibration"):
        quantize_kv_cache.run(lowered_graphs["decode"], quantize_kv_cache.Options(calibration=CalibrationSpec()))
    for phase in ("prefill", "decode"):
        with pytest.raises(PassError, match="already INT8, not float; list quantize_kv_cache once"):
            quantize_kv_cache.run(quantized[phase][0], quantize_kv_cache.Options(calibration=calibration_set()))


def test_a_channel_that_is_always_zero_gets_code_zero_from_both_phases():
    """A value channel that calibration saw only as 0 (its v_proj row is 0): its scale was tiny / 127, a subnormal
    whose reciprocal is inf, and decode's GroupQueryAttention wrote code 127 (0 x inf) where prefill wrote 0."""
    state = random_model(CONFIG, seed=0).state_dict
    state["model.layers.0.self_attn.v_proj.weight"][3, :] = 0  # kv head 0, channel 3
    graphs = {}
    for phase, model in export_graphs(build_decoder(CONFIG, state), MAX_CONTEXT).items():
        model = fuse_attention.run(cleanup.run(model, cleanup.Options())[0], fuse_attention.Options(required=True))[0]
        graphs[phase] = lower_onnxruntime.run(model, lower_onnxruntime.Options())[0]
    options = quantize_kv_cache.Options(calibration=calibration_set())
    quantized_graphs = {phase: quantize_kv_cache.run(model, options)[0] for phase, model in graphs.items()}
    scale = initializer(quantized_graphs["decode"], "past_key_values.0.value.kv_scale").reshape(-1)[3]
    assert scale == np.finfo(np.float32).tiny  # the smallest normal float32, not a subnormal
    logits, caches = run_steps(quantized_graphs, np.int8)
    value = caches[1]  # layer 0's value cache: 6 prompt rows from prefill, then 4 written by decode steps
    assert np.all(value[0, 0, :10, 3] == 0) and all(np.isfinite(step).all() for step in logits)


def one_attention_graph(cache_dtype) -> tuple[gs.Graph, gs.Node]:
    """One GroupQueryAttention node (2 heads, 1 kv head of 16 channels, an 8-row cache) on graph inputs."""
    heads, channels, rows = 2, 16, 8
    f = np.float32
    q, k, v = (gs.Variable(n, f, [1, 1, c]) for n, c in (("q", heads * channels), ("k", channels), ("v", channels)))
    pasts = [gs.Variable(f"past_key_values.0.{kind}", cache_dtype, [1, 1, rows, channels]) for kind in ("key", "value")]
    presents = [gs.Variable(f"present.0.{kind}", cache_dtype, [1, 1, rows, channels]) for kind in ("key", "value")]
    lengths, total = gs.Variable("seqlens_k", np.int32, [1]), gs.Variable("total_sequence_length", np.int32, [])
    node = gs.Node("GroupQueryAttention", "layers.0.FlashAttention", domain="com.microsoft",
                   attrs={"num_heads": heads, "kv_num_heads": 1}, inputs=[q, k, v, *pasts, lengths, total],
                   outputs=[gs.Variable("output", f), *presents])
    graph = gs.Graph(nodes=[node], inputs=[q, k, v, *pasts, lengths, total], outputs=[node.outputs[0], *presents],
                     opset=21, import_domains=[onnx.helper.make_opsetid("", 21),
                                               onnx.helper.make_opsetid("com.microsoft", 1)])
    return graph, node


def single_attention_graph(phase: str, scales: list[np.ndarray]) -> ort.InferenceSession:
    """one_attention_graph's node with the pass's prefill writer after it, or its decode rewrite, as the runtime
    would run it."""
    graph, node = one_attention_graph(np.int8)
    if phase == "prefill":
        quantize_kv_cache.write_codes_after(graph, node, scales)
    else:
        quantize_kv_cache.read_codes(node, scales, quantize_kv_cache.Options(calibration=None))
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    return session(gs.export_onnx(graph))


def test_prefill_writes_the_code_decode_writes_for_a_value_at_a_rounding_boundary():
    """Prefill rounded x / scale, decode's GroupQueryAttention rounds x * (1 / scale): for values half a code from
    two codes these differed by one in 415 of 3200 channels (a review's probe); now both multiply."""
    rng = np.random.default_rng(0)
    differ = 0
    for _ in range(20):
        scales = [rng.uniform(0.001, 0.3, 16).astype(np.float32) for _ in range(2)]
        key = ((rng.integers(-127, 127, 16) + 0.5) * scales[0]).astype(np.float32)  # half a code from two codes
        feed = {"q": np.zeros((1, 1, 32), np.float32), "k": key[None, None], "v": key[None, None],
                "seqlens_k": np.array([0], np.int32), "total_sequence_length": np.array(1, np.int32),
                **{f"past_key_values.0.{kind}": np.zeros((1, 1, 8, 16), np.int8) for kind in ("key", "value")}}
        codes = [single_attention_graph(phase, scales).run(["present.0.key"], feed)[0][0, 0, 0]
                 for phase in ("prefill", "decode")]
        differ += int(np.sum(codes[0] != codes[1]))
    assert differ == 0


def test_prefill_clips_values_past_the_calibrated_range_to_the_codes_decode_writes():
    """A value beyond the calibrated range (a prompt unlike the calibration text) is clipped, by prefill's graph as
    by decode's kernel: to -128 below, 127 above. A clip at -127 below wrote another code in prefill than in decode."""
    scales = [np.full(16, 0.01, np.float32) for _ in range(2)]
    key = np.array([-5.0, -1.285, -1.275, 5.0] * 4, np.float32)  # -500, -128.5, -127.5 and 500 codes
    feed = {"q": np.zeros((1, 1, 32), np.float32), "k": key[None, None], "v": key[None, None],
            "seqlens_k": np.array([0], np.int32), "total_sequence_length": np.array(1, np.int32),
            **{f"past_key_values.0.{kind}": np.zeros((1, 1, 8, 16), np.int8) for kind in ("key", "value")}}
    codes = [single_attention_graph(phase, scales).run(["present.0.key"], feed)[0][0, 0, 0]
             for phase in ("prefill", "decode")]
    np.testing.assert_array_equal(codes[0], codes[1])
    assert codes[0][0] == -128 and codes[0][3] == 127


def test_one_calibration_set_gives_each_granularity_and_headroom_its_own_scales(lowered_graphs):
    """The set's memo hands the scales from one phase to the other; runs that shape them otherwise must not share
    them. Per-tensor scales are the per-channel ones' maximum; headroom 127, the largest allowed, puts the peak at
    code 1."""
    calibration = calibration_set()

    def scales(**options) -> dict[str, np.ndarray]:
        model, _ = quantize_kv_cache.run(lowered_graphs["decode"],
                                         quantize_kv_cache.Options(calibration=calibration, **options))
        return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith(".kv_scale")}
    per_channel, per_tensor, widest = scales(), scales(granularity="per_tensor"), scales(headroom=127.0)
    assert len(per_channel) == 2 * CONFIG.num_layers
    for name, channels in per_channel.items():
        np.testing.assert_array_equal(per_tensor[name], [channels.max()])
        if name.endswith(".value"):  # a key's scale may be its pair's norm instead (test above)
            np.testing.assert_allclose(widest[name], channels * (127 / 1.5), rtol=1e-6)
        assert (widest[name] >= channels).all()


def test_a_phase_that_names_its_caches_otherwise_is_refused(lowered_graphs):
    """The decode graph takes the scales prefill calibrated, by past input name: one it does not find is named."""
    options = quantize_kv_cache.Options(calibration=calibration_set())
    quantize_kv_cache.run(lowered_graphs["prefill"], options)
    renamed = gs.import_onnx(lowered_graphs["decode"])
    next(t for t in renamed.inputs if t.name == "past_key_values.1.value").name = "cache.1.value"
    with pytest.raises(PassError,
                       match=re.escape("layers.1.FlashAttention: no calibrated scales for ['cache.1.value']")):
        quantize_kv_cache.run(gs.export_onnx(renamed), options)


def test_keys_that_are_not_finite_on_the_calibration_text_are_refused(lowered_graphs):
    """An inf in layer 0's k projection: no int8 scale covers its keys, and decode would read NaN for all of them."""
    broken = onnx.ModelProto()
    broken.CopyFrom(lowered_graphs["prefill"])
    attention = next(n for n in broken.graph.node if n.op_type == "GroupQueryAttention")
    projection = next(n for n in broken.graph.node if attention.input[1] in n.output)
    weight = next(t for t in broken.graph.initializer if t.name == projection.input[1])
    values = onnx.numpy_helper.to_array(weight).copy()
    values[0, 0] = np.inf
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    with pytest.raises(PassError,
                       match="past_key_values.0.key: the float graph wrote keys or values that are not finite"):
        quantize_kv_cache.run(broken, quantize_kv_cache.Options(calibration=calibration_set()))


def test_a_node_whose_cache_the_pass_cannot_store_is_refused_before_calibration():
    def refusal(edit) -> str:
        graph, node = one_attention_graph(np.float32)
        edit(graph, node)
        with pytest.raises(PassError) as error:
            quantize_kv_cache.run(gs.export_onnx(graph), quantize_kv_cache.Options(calibration=calibration_set()))
        return str(error.value)

    def scale_inputs(graph, node):
        node.inputs.extend([gs.Variable.empty()] * 5 + [gs.Constant(f"{kind}_scale", np.ones(16, np.float32))
                                                        for kind in ("k", "v")])

    def half_precision(graph, node):
        for cache in (*node.inputs[3:5], *node.outputs[1:]):
            cache.dtype = np.float16

    assert refusal(scale_inputs).endswith("already has k_scale/v_scale inputs")
    assert refusal(lambda graph, node: graph.outputs.remove(node.outputs[1])).endswith(
        "its present output 'present.0.key' is not a graph output")
    # It said "already FLOAT16 ...; list quantize_kv_cache once": an int8 cache is refused before this check, so
    # the advice never fitted.
    assert refusal(half_precision).startswith("past_key_values.0.key: the KV cache is FLOAT16, not float32")


@pytest.mark.parametrize("pairs", ["halves", "interleaved"])
def test_a_key_channels_scale_covers_every_turn_of_its_rotary_pair(pairs):
    """Calibration sees early positions, where a slow pair has barely turned: a pair near one axis gave its other
    channel a scale that SmolLM2's keys past position 1024 overran 7-fold (clipped: +5.6% perplexity there). No
    rotation takes a channel past its pair's norm."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 32, 8)).astype(np.float32)
    first = np.r_[0:8:2] if pairs == "interleaved" else np.r_[0:4]
    second = first + 1 if pairs == "interleaved" else first + 4
    keys[..., first] += 10.0  # a large constant part on one axis of each pair
    norms = quantize_kv_cache.pair_norms(keys, pairs)
    assert (norms >= np.abs(keys).max(axis=1).reshape(-1)).all()
    for angle in np.linspace(0, 2 * np.pi, 17):  # the pairs turned as a later position turns them
        turned = keys.copy()
        turned[..., first] = np.cos(angle) * keys[..., first] - np.sin(angle) * keys[..., second]
        turned[..., second] = np.sin(angle) * keys[..., first] + np.cos(angle) * keys[..., second]
        assert (np.abs(turned).max(axis=1).reshape(-1) <= norms * (1 + 1e-6)).all(), angle


def test_rotated_keys_are_found_inside_the_node_and_before_it():
    """do_rotary on the node (rotary "inside"), or a com.microsoft.RotaryEmbedding feeding its key ("separate"):
    either way the keys' pairs are known; a key nothing rotates has none."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    model = fuse_attention.run(cleanup.run(export_graphs(decoder, MAX_CONTEXT)["decode"], cleanup.Options())[0],
                               fuse_attention.Options(required=True))[0]
    for rotary in ("inside", "separate"):
        graph = gs.import_onnx(lower_onnxruntime.run(model, lower_onnxruntime.Options(rotary=rotary))[0])
        nodes = [n for n in graph.nodes if (n.domain, n.op) == quantize_kv_cache.GQA]
        assert nodes and [quantize_kv_cache.rotary_pairs(n) for n in nodes] == ["halves"] * len(nodes), rotary
    nodes[0].inputs[1] = gs.Variable("unrotated_key", dtype=np.float32)  # separate: no RotaryEmbedding before it
    assert quantize_kv_cache.rotary_pairs(nodes[0]) is None
