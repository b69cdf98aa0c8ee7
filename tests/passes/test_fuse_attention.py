"""fuse_attention + lower_onnxruntime: node counts, the per-layer report, and onnxruntime parity.

Graphs: the canonical decoder's prefill/decode export, and a Hugging Face LlamaForCausalLM traced with
torch.onnx (eager attention, no cache) where attention is spelled differently (repeat_kv, its own mask code).
"""
from __future__ import annotations

import collections
import dataclasses
import io
import warnings

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest
import torch

from compiler.errors import BuildError
from compiler.export import export_graphs, io_names
from compiler.frontend.config import DecoderConfig
from compiler.frontend.model import build_decoder
from compiler.frontend.random_init import random_model
from compiler.pipeline import run_pipeline
from passes import cleanup, fuse_attention, lower_onnx_attention, lower_onnxruntime
from passes.errors import PassError
from passes.session_config import session_config

MAX_CONTEXT = 32
CONFIG = DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,))


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


@pytest.fixture(scope="module")
def decoder_graphs():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    return {phase: cleanup.run(model, cleanup.Options())[0] for phase, model in export_graphs(decoder, MAX_CONTEXT).items()}


LOWERINGS = {"GroupQueryAttention": lower_onnxruntime, "Attention": lower_onnx_attention}


def fuse_and_lower(model, lowering=lower_onnxruntime, **options):
    fused, report = fuse_attention.run(model, fuse_attention.Options(**options))
    lowered, lowering_report = lowering.run(fused, lowering.Options())
    return fused, report, lowered, lowering_report


def session_for(model: onnx.ModelProto) -> ort.InferenceSession:
    """A session with the config entries passes recorded in the graph (as the runtime sets them)."""
    options = ort.SessionOptions()
    for key, value in session_config(model).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def generate_logits(graphs: dict, session=session_for) -> list[np.ndarray]:
    """A right-padded batch of two prompts, then three decode steps with per-row lengths."""
    inputs, _ = io_names(CONFIG)
    sessions = {p: session(m) for p, m in graphs.items()}
    rows, width = [[1, 5, 9, 14, 200, 7], [1, 77, 3]], 6
    mask_for = lambda lengths: np.array([[1] * n + [0] * (max(lengths) - n) for n in lengths])  # noqa: E731
    caches = [np.zeros((2, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    feed = {"input_ids": np.array([r + [0] * (width - len(r)) for r in rows]),
            "position_ids": np.tile(np.arange(width), (2, 1)), "attention_mask": mask_for([6, 3])}
    logits, *caches = sessions["prefill"].run(None, {**feed, **dict(zip(inputs[3:], caches))})
    collected, lengths = [logits], [6, 3]
    for step in range(3):
        feed = {"input_ids": np.array([[10 + step], [20 + step]]), "position_ids": np.array([[n] for n in lengths]),
                "attention_mask": mask_for([n + 1 for n in lengths])}
        lengths = [n + 1 for n in lengths]
        logits, *caches = sessions["decode"].run(None, {**feed, **dict(zip(inputs[3:], caches))})
        collected.append(logits[:, -1])
    return collected + [np.stack(caches)[:, :, :, :9]]  # the written cache rows too


def rotary_table_shape(model: onnx.ModelProto, name: str) -> list[int]:
    """The shape of a rotary table input: an initializer's, or through the Cast a float16 graph puts after it."""
    producers = {output: node for node in model.graph.node for output in node.output}
    while name in producers and producers[name].op_type == "Cast":
        name = producers[name].input[0]
    table = next(t for t in model.graph.initializer if t.name == name)
    return list(table.dims)


def test_every_layer_fuses_and_lowers_to_group_query_attention(decoder_graphs):
    for phase, model in decoder_graphs.items():
        fused, report, lowered, lowering = fuse_and_lower(model)
        assert report["fused"] == CONFIG.num_layers and report["unfused"] == 0, report
        assert [layer["layer"] for layer in report["layers"]] == ["layers.0", "layers.1"]
        counts = op_counts(fused)
        assert counts["FlashAttention"] == CONFIG.num_layers
        for gone in ("Softmax", "ScatterElements", "Cos", "Sin", "Neg"):
            assert counts[gone] == 0, (phase, gone)
        assert len(fused.graph.node) < len(model.graph.node) / 2
        assert lowering["lowered"] == CONFIG.num_layers and op_counts(lowered)["GroupQueryAttention"] == CONFIG.num_layers
        assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output]
        # The softmax scale went into the q projections' weights; the decode graph selects the GEMM kernel path.
        assert lowering["scale_folded_into"] == {"weight": CONFIG.num_layers}
        assert lowering["attention_kernel"] == ("gemm" if phase == "decode" else "flash")
        # A row of the rotary tables per cache position (the logits below stop at position 9 of 32: a shorter
        # table would pass them, and fail a decode past its end)
        for node in (n for n in fused.graph.node if n.op_type == "FlashAttention"):
            shape = rotary_table_shape(fused, node.input[7])
            assert shape == [MAX_CONTEXT, CONFIG.head_dim // 2], shape
        for node in (n for n in lowered.graph.node if n.op_type == "GroupQueryAttention"):
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes["scale"] == 1.0
            assert attributes.get("qk_output", 0) == (1 if phase == "decode" else 0)
            assert len(node.output) == (4 if phase == "decode" else 3)


@pytest.mark.parametrize("target", LOWERINGS)
def test_lowered_graphs_generate_like_the_unfused_ones(decoder_graphs, target):
    lowered = {phase: fuse_and_lower(model, LOWERINGS[target])[2] for phase, model in decoder_graphs.items()}
    assert all(op_counts(model)[target] == CONFIG.num_layers for model in lowered.values())
    for reference, fused in zip(generate_logits(decoder_graphs), generate_logits(lowered)):
        np.testing.assert_allclose(fused, reference, atol=1e-5)


def test_the_opset_23_lowering_computes_what_the_onnx_spec_says(decoder_graphs):
    """onnx's reference evaluator, the spec's own implementation, runs the lowered graphs: a reading of Attention-23
    (grouping, mask polarity, scale) or RotaryEmbedding-23 that onnxruntime shares but the spec does not would pass
    the test above and compute something else in TensorRT. The positions and the mask are built once per graph, not
    per layer (they were: one mask per layer and step)."""
    from onnx.reference import ReferenceEvaluator

    lowered = {phase: fuse_and_lower(model, lower_onnx_attention)[2] for phase, model in decoder_graphs.items()}
    assert all(op_counts(model)["And"] == 1 and op_counts(model)["Attention"] == CONFIG.num_layers
               for model in lowered.values())
    for reference, spec in zip(generate_logits(decoder_graphs), generate_logits(lowered, ReferenceEvaluator)):
        np.testing.assert_allclose(spec, reference, atol=1e-5)
    # queries of unknown shape may cover other tokens: each layer builds its own, with the same logits
    unknown = {}
    for phase, model in decoder_graphs.items():
        fused = fuse_attention.run(model, fuse_attention.Options())[0]
        del fused.graph.value_info[:]
        unknown[phase] = lower_onnx_attention.run(fused, lower_onnx_attention.Options())[0]
    assert all(op_counts(model)["And"] == CONFIG.num_layers for model in unknown.values())
    for reference, alone in zip(generate_logits(decoder_graphs), generate_logits(unknown)):
        np.testing.assert_allclose(alone, reference, atol=1e-5)


def test_a_cache_named_otherwise_is_found_by_what_writes_it(decoder_graphs):
    """The probes took only inputs named past_key_values.* for the cache: a decode graph whose buffers are named
    past.0.key (a StaticCache traced by hand) was probed as 512 tokens against a 64-row cache, and every layer stayed
    unfused "because the mask has shape [1, 1, 512, 64]"."""
    renamed = onnx.ModelProto()
    renamed.CopyFrom(decoder_graphs["decode"])
    for value in renamed.graph.input:
        if value.name.startswith("past_key_values."):
            new = value.name.replace("past_key_values.", "past.")
            for node in renamed.graph.node:
                node.input[:] = [new if name == value.name else name for name in node.input]
            value.name = new
    fused, report = fuse_attention.run(renamed, fuse_attention.Options())
    assert report["fused"] == CONFIG.num_layers, report["layers"]
    assert {i.name for i in fused.graph.input} >= {"past.0.key", "past.1.value"}


def test_max_rewrites_fuses_only_the_first(decoder_graphs):
    fused, report, _, _ = fuse_and_lower(decoder_graphs["decode"], max_rewrites=1)
    assert report["fused"] == 1 and op_counts(fused)["FlashAttention"] == 1
    assert report["layers"][1] == {"layer": "layers.1", "fused": False, "reason": "max_rewrites=1"}


def break_layer_one(model: onnx.ModelProto) -> onnx.ModelProto:
    """Put a Relu between layer 1's Softmax and its value MatMul."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    softmax = next(n for n in broken.graph.node if n.op_type == "Softmax" and "layers.1" in n.name)
    consumer = next(n for n in broken.graph.node if softmax.output[0] in n.input)
    consumer.input[list(consumer.input).index(softmax.output[0])] = "inserted_relu_out"
    broken.graph.node.append(onnx.helper.make_node("Relu", [softmax.output[0]], ["inserted_relu_out"], name="inserted"))
    return broken


def test_a_broken_layer_is_reported_and_can_fail_the_build(decoder_graphs):
    broken = break_layer_one(decoder_graphs["decode"])
    _, report = fuse_attention.run(broken, fuse_attention.Options())
    assert report["fused"] == 1 and report["unfused"] == 1
    assert report["layers"][1]["layer"] == "layers.1" and "Relu" in report["layers"][1]["reason"]
    with pytest.raises(PassError, match="layers.1: Softmax output feeds Relu"):
        fuse_attention.run(broken, fuse_attention.Options(required=True))

    class Spec:
        name, options = "fuse_attention", fuse_attention.Options(required=True)

    with pytest.raises(BuildError, match=r"passes\[0\] \(fuse_attention, decode graph\): fusion required .* layers.1"):
        run_pipeline({"decode": broken}, [Spec()])


def test_a_required_fusion_of_a_graph_fused_already_says_so(decoder_graphs):
    """fuse_attention listed twice with required: true said "1 attention block(s) not fused: no Softmax" of a graph
    whose every block was fused."""
    fused, _ = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())
    with pytest.raises(PassError, match=r"^the attention is fused already \(2 FlashAttention nodes, .*\); list "
                                        r"fuse_attention once"):
        fuse_attention.run(fused, fuse_attention.Options(required=True))
    _, report = fuse_attention.run(fused, fuse_attention.Options())  # not required: idle, as before
    assert report["fused"] == 0


def test_probabilities_read_by_a_second_node_keep_their_layer_unfused(decoder_graphs):
    """Layer 1's Softmax also feeds an extra graph output through a Relu: fused, its probabilities would no longer
    be computed for that reader. The layer stays unfused, said why, and the graph computes what it did."""
    model = onnx.ModelProto()
    model.CopyFrom(decoder_graphs["decode"])
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax" and "layers.1" in n.name)
    model.graph.node.append(onnx.helper.make_node("Relu", [softmax.output[0]], ["probabilities_read"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("probabilities_read", onnx.TensorProto.FLOAT, None))
    fused, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == 1 and report["unfused"] == 1
    assert "Softmax output has 2 consumers" in report["layers"][1]["reason"]
    assert "probabilities_read" in {o.name for o in fused.graph.output}
    assert sum(n.op_type == "Softmax" for n in fused.graph.node) == 1  # layer 1's, still computing what Relu reads


@pytest.fixture(scope="module")
def hf_traced():
    """transformers' LlamaForCausalLM (tiny, random, eager attention, no cache) traced with torch.onnx."""
    torch.manual_seed(0)
    model = tiny_llama()
    ids, mask = torch.randint(0, 300, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    return trace_hf(model, ids, mask), ids.numpy(), mask.numpy(), expected


def tiny_llama(attention: str = "eager"):
    """transformers' LlamaForCausalLM: 2 layers, 4 query heads over 2 kv heads, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         attn_implementation=attention, use_cache=False)
    return LlamaForCausalLM(config).eval()


class LogitsOnly(torch.nn.Module):
    """A transformers causal LM as (input_ids, attention_mask) -> logits, without its cache: what is exported. Export
    it in eval mode: torch.onnx restores the wrapper's mode afterwards, and a new module's is training, which would
    switch the model's dropout on for whatever runs it next."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def trace_hf(model, ids, mask) -> onnx.ModelProto:
    """A transformers causal LM's logits, traced with torch.onnx (TorchScript, opset 21) and cleaned up."""
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(LogitsOnly(model).eval(), (ids, mask), buffer, dynamo=False, opset_version=21,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    return cleanup.run(onnx.load_from_string(buffer.getvalue()), cleanup.Options())[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_mask_is_not_fused_as_causal_attention(dtype):
    """Mistral with a 3-token window: its traced mask hides keys a causal mask keeps. The probe runs the mask and
    keeps the layers unfused (before, both were reported fused and the logits changed by 0.4). In bfloat16 the probe
    runs the same math in float32: onnxruntime's CPU has no bfloat16 Where (before, both layers were fused, noted
    "unchecked", and `required` passed)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                           sliding_window=3, attn_implementation="eager", use_cache=False)
    model = trace_hf(MistralForCausalLM(config).eval().to(dtype), torch.randint(0, 300, (1, 9)),
                     torch.ones(1, 9, dtype=torch.long))
    _, report = fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=128))
    assert report["fused"] == 0 and {layer["reason"] for layer in report["layers"]} == {
        "the additive mask hides keys at or before the query that a causal mask keeps (e.g. a sliding window)"}
    with pytest.raises(PassError, match="sliding window"):
        fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=128, required=True))


def test_bfloat16_blocks_are_checked_by_the_probes_not_left_unchecked():
    """The project's own bfloat16 export (TensorRT's dtype): every block fused, and both probes ran (before, each
    layer's report said "mask: unchecked ..." and "block: unchecked ...": no bfloat16 Where or Mul on the CPU)."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    for phase, model in export_graphs(decoder, MAX_CONTEXT, dtype="bfloat16").items():
        _, report = fuse_attention.run(cleanup.run(model, cleanup.Options())[0], fuse_attention.Options(required=True))
        assert report["fused"] == CONFIG.num_layers, (phase, report)
        assert not [layer for layer in report["layers"] if "mask" in layer or "block" in layer], (phase, report)


def test_the_probe_tells_causal_masks_from_biases_and_windows():
    from passes.attention_mask_probe import _judge

    causal = np.triu(np.full((6, 6), -np.inf), 1)[None, None]
    assert _judge(causal, 6) is None
    assert "bias" in _judge(causal + np.tril(np.arange(6)[None, :] - np.arange(6)[:, None] * 0.5), 6)
    window = causal.copy()
    window[..., 5, 0] = -np.inf
    assert "sliding window" in _judge(window, 6)
    assert "not causal" in _judge(np.zeros((1, 1, 6, 6)), 6)


@pytest.mark.parametrize("target", LOWERINGS)
def test_hugging_face_traced_attention_fuses_too(hf_traced, target):
    model, ids, mask, expected = hf_traced
    fused, report, lowered, _ = fuse_and_lower(model, LOWERINGS[target], rotary_cache_length=128)
    assert report["fused"] == 2 and all(not layer["cache"] for layer in report["layers"]), report
    assert op_counts(fused)["Softmax"] == 0
    logits = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_allclose(logits, expected, atol=1e-5)


def test_a_graph_without_cache_needs_a_rotary_table_length(hf_traced):
    with pytest.raises(PassError, match="rotary_cache_length"):
        fuse_attention.run(hf_traced[0], fuse_attention.Options())


def test_the_pass_leaves_its_input_untouched(decoder_graphs):
    model = decoder_graphs["decode"]
    before = model.SerializeToString()
    fused, _, lowered, _ = fuse_and_lower(model)
    assert model.SerializeToString() == before
    assert [o.domain for o in fused.opset_import].count("aotlm") == 1
    assert "aotlm" not in [o.domain for o in lowered.opset_import]


def test_attention_probabilities_that_are_a_graph_output_are_not_fused_away(decoder_graphs):
    model = onnx.ModelProto()
    model.CopyFrom(decoder_graphs["prefill"])
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    model.graph.output.append(onnx.helper.make_tensor_value_info(softmax.output[0], onnx.TensorProto.FLOAT, None))
    _, report = fuse_attention.run(model, fuse_attention.Options())
    unfused = [layer for layer in report["layers"] if not layer["fused"]]
    assert len(unfused) == 1 and "are a graph output" in unfused[0]["reason"]
    assert report["fused"] == CONFIG.num_layers - 1


def test_a_repeat_that_gives_query_heads_other_kv_heads_is_not_fused(monkeypatch):
    """transformers' Llama with kv heads repeated as [rep, kv]: query head h reads kv head h % KV. The graph
    passes every structural check; the block probe runs it and keeps it unfused (before the probe both layers
    were fused and the logits changed by 0.45)."""
    import transformers.models.llama.modeling_llama as modeling_llama

    def repeat_kv_tiled(hidden, n_rep):
        batch, kv_heads, length, head_dim = hidden.shape
        return hidden[:, None].expand(batch, n_rep, kv_heads, length, head_dim).reshape(
            batch, n_rep * kv_heads, length, head_dim)

    monkeypatch.setattr(modeling_llama, "repeat_kv", repeat_kv_tiled)
    torch.manual_seed(0)
    model = tiny_llama()
    ids, mask = torch.randint(0, 300, (1, 7)), torch.ones(1, 7, dtype=torch.long)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    traced = trace_hf(model, ids, mask)
    fused, report = fuse_attention.run(traced, fuse_attention.Options(rotary_cache_length=128))
    assert report["fused"] == 0 and {layer["reason"] for layer in report["layers"]} == {
        "query head h reads kv head h % 2 (kv heads repeated as [rep, kv]); FlashAttention's reads h // 2"}
    logits = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    with pytest.raises(PassError, match=r"layers.0: query head h reads kv head h % 2"):
        fuse_attention.run(traced, fuse_attention.Options(rotary_cache_length=128, required=True))


def test_the_block_probe_compares_against_the_reference(decoder_graphs):
    """A block's probe output equal to FlashAttention's reference passes, one changed value does not; the
    project's own prefill block passes when run."""
    from passes import attention_block_probe as probe

    graph = gs.import_onnx(decoder_graphs["prefill"])
    found = fuse_attention.match(next(node for node in graph.nodes if node.op == "Softmax"))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, probe.PROBE_TOKENS, probe._width(found, t))).astype(np.float32)
               for t in (found.query, found.key, found.value))
    expected = probe._reference(found, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))[0]
    assert probe._judge(found, expected.astype(np.float32), q, k, v) is None
    wrong = expected.copy()
    wrong[0, 3, 5] += 0.05
    assert "computes something other than FlashAttention" in probe._judge(found, wrong, q, k, v)
    assert probe.check_blocks(graph, [found]) == [None]


def export_dynamo(model, ids, mask, opset: int) -> onnx.ModelProto:
    """torch.onnx's dynamo exporter (torch's default), logits only, batch and sequence dynamic, cleaned up."""
    batch, sequence = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("sequence", min=1, max=64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(LogitsOnly(model).eval(), (ids, mask), dynamo=True, opset_version=opset,
                                    input_names=["input_ids", "attention_mask"], output_names=["logits"],
                                    dynamic_shapes={"input_ids": {0: batch, 1: sequence},
                                                    "attention_mask": {0: batch, 1: sequence}})
    return cleanup.run(program.model_proto, cleanup.Options())[0]


@pytest.mark.parametrize("attention, opset", [("sdpa", 18), ("eager", 23)])
def test_dynamo_exported_attention_fuses_and_keeps_the_logits(attention, opset):
    """torch.onnx's dynamo exporter spells attention differently from the TorchScript one: at opset 18 SDPA scales
    q and k by sqrt(scale) each before their product and guards the probabilities with Where(IsNaN(p), 0, p); at
    opset 23 the rotary is ONNX's RotaryEmbedding op. Each fuses (before: 0 of 2 layers) and the logits hold."""
    torch.manual_seed(0)
    model = tiny_llama(attention)
    ids, mask = torch.randint(0, 300, (2, 7)), torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    fused, report, lowered, _ = fuse_and_lower(export_dynamo(model, ids, mask, opset), rotary_cache_length=128)
    assert report["fused"] == 2 and report["unfused"] == 0, report
    assert [layer["layer"] for layer in report["layers"]] == ["attention.0", "attention.1"]  # nodes: node_Softmax_N
    assert report["padding"].startswith("right")
    assert op_counts(fused)["Softmax"] == 0 and op_counts(fused)["RotaryEmbedding"] == 0
    logits = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(logits[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(logits[1, :4], expected[1, :4], atol=1e-5)  # the right-padded row's valid tokens


def test_an_onnx_attention_op_is_reported_not_silently_skipped():
    """torch's SDPA exported at opset 23 is one ONNX Attention op per layer: no Softmax to anchor on. The report
    lists the layer with the reason (before: an empty report; required: true said 'no Softmax found')."""
    q, k, v = (onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, 4, 5, 16]) for name in "qkv")
    output = onnx.helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [1, 4, 5, 16])
    node = onnx.helper.make_node("Attention", ["q", "k", "v"], ["o"], name="node_scaled_dot_product_attention",
                                 is_causal=1)
    graph = onnx.helper.make_graph([node], "main_graph", [q, k, v], [output])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    _, report = fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=128))
    assert report["fused"] == 0 and report["unfused"] == 1
    assert "'node_scaled_dot_product_attention' is an ONNX Attention op" in report["layers"][0]["reason"]
    with pytest.raises(PassError, match="is an ONNX Attention op"):
        fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=128, required=True))


def test_a_graph_without_node_names_fuses_into_distinct_nodes(decoder_graphs):
    """Every layer's fused node and output are named from the layer; with no node names to read them from, each
    was called "attention" (two nodes, one output name: an invalid graph). Now attention.0, attention.1, ..."""
    model = onnx.ModelProto()
    model.CopyFrom(decoder_graphs["decode"])
    for node in model.graph.node:
        node.name = ""
    fused, report, lowered, _ = fuse_and_lower(model)
    assert report["fused"] == CONFIG.num_layers
    assert [layer["layer"] for layer in report["layers"]] == [f"attention.{i}" for i in range(CONFIG.num_layers)]
    onnx.checker.check_model(lowered)
    unnamed, named = generate_logits({"prefill": fuse_and_lower(decoder_graphs["prefill"])[2], "decode": lowered}), \
        generate_logits({phase: fuse_and_lower(graph)[2] for phase, graph in decoder_graphs.items()})
    for a, b in zip(unnamed, named):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("operand", [0, 1])
def test_a_scaling_by_a_one_element_constant_of_shape_1_is_read(decoder_graphs, operand):
    """q or k scaled by a constant of shape [1] (not []) before their product: numpy 2 refuses float() on it, and
    the pass crashed with a TypeError. The factor (here 0.5) moves into the fused node's scale (which the block
    probe then checks: a wrong scale would leave the layers unfused)."""
    graph = gs.import_onnx(decoder_graphs["prefill"])
    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        product = fuse_attention._scores(softmax)[0]
        source = product.inputs[operand]
        scaled = gs.Variable(f"{source.name}_halved", dtype=source.dtype)
        graph.nodes.append(gs.Node("Mul", inputs=[source, gs.Constant(f"{source.name}_half", np.full((1,), 0.5,
                                                                                                     np.float32))],
                                   outputs=[scaled]))
        product.inputs[operand] = scaled
    graph.toposort()
    model = gs.export_onnx(graph)
    fused, report = fuse_attention.run(model, fuse_attention.Options(required=True))
    assert report["fused"] == CONFIG.num_layers
    scales = [a.f for n in fused.graph.node if n.op_type == "FlashAttention" for a in n.attribute if a.name == "scale"]
    assert scales == pytest.approx([0.5 * CONFIG.head_dim ** -0.5] * CONFIG.num_layers)


def test_a_prefill_that_writes_its_cache_at_other_rows_is_not_fused(decoder_graphs):
    """Layer 0's prefill cache writes moved one row on: the attention output is the same (prefill reads its new keys
    directly), so only the written cache shows it. Before, the block was fused and wrote rows 0.. anyway."""
    shifted = onnx.ModelProto()
    shifted.CopyFrom(decoder_graphs["prefill"])
    shifted.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, np.int64), "one_row_on"))
    for node in [n for n in shifted.graph.node if n.op_type == "ScatterElements" and "layers.0" in n.name]:
        later = f"{node.name}/later_rows"
        shifted.graph.node.insert(0, onnx.helper.make_node("Add", [node.input[1], "one_row_on"], [later]))
        node.input[1] = later
    shifted = gs.export_onnx(gs.import_onnx(shifted).toposort())
    _, report = fuse_attention.run(shifted, fuse_attention.Options())
    assert report["fused"] == CONFIG.num_layers - 1
    assert report["layers"][0]["reason"].startswith("the block writes the key cache elsewhere than FlashAttention does")


def test_a_decode_mask_aligned_top_left_is_not_fused(decoder_graphs, monkeypatch):
    """A decode graph whose mask lets query i see keys j <= i (is_causal's alignment) rather than j <= its position:
    the two agree when queries and keys are as many, as in the first probe. Before, it was fused and a decode step
    after 4 cached tokens changed the logits by 0.43."""
    import compiler.frontend.model as model_module

    def top_left(position_ids, attention_mask, dtype):
        keys, queries = torch.arange(attention_mask.shape[1]), torch.arange(position_ids.shape[1])
        visible = (keys.view(1, 1, -1) <= queries.view(1, -1, 1)) & (attention_mask.unsqueeze(1) > 0)
        return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None]

    monkeypatch.setattr(model_module, "visibility_bias", top_left)
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    graphs = {phase: cleanup.run(model, cleanup.Options())[0] for phase, model in
              export_graphs(decoder, MAX_CONTEXT).items()}
    _, report = fuse_attention.run(graphs["decode"], fuse_attention.Options())
    assert report["fused"] == 0 and "aligned top-left" in report["layers"][0]["reason"]
    assert fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())[1]["fused"] == CONFIG.num_layers
    # The prefill graph reads its new keys only, never cached ones: there the same mask is the causal rule, and
    # the second probe (queries after cached tokens) is not run on it
    assert fuse_attention.run(graphs["prefill"], fuse_attention.Options(required=True))[1]["fused"] == CONFIG.num_layers


def test_a_mask_the_probe_cannot_evaluate_stays_unfused(decoder_graphs):
    """A mask that also reads an input the probe cannot make: "unchecked" had counted as fused, and `required`
    passed a block that may compute anything (a window in a graph of fixed batch 2, say)."""
    graph = gs.import_onnx(decoder_graphs["decode"])
    softmax = next(node for node in graph.nodes if node.op == "Softmax")
    extra = gs.Variable("mask_offset", np.float32, [1])
    graph.inputs.append(extra)
    mask_add = softmax.inputs[0].inputs[0]
    moved = graph.layer(op="Add", inputs=[mask_add.inputs[1], extra], outputs=["offset_mask"])[0]
    mask_add.inputs[1] = moved
    _, report = fuse_attention.run(gs.export_onnx(graph.toposort()), fuse_attention.Options())
    assert report["fused"] == CONFIG.num_layers - 1
    assert report["layers"][0]["reason"].startswith("unchecked: the mask could not be evaluated")


def test_a_window_longer_than_512_tokens_is_probed_over_the_rotary_table_length():
    """Mistral, window 600, dynamic axes: the probe ran 512 tokens, saw a causal mask and fused; at 700 tokens the
    fused logits differed by 0.027. The probe now runs the rotary table's length, the context the graph is built
    for."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           sliding_window=600, attn_implementation="eager", use_cache=False)
    model = trace_hf(MistralForCausalLM(config).eval(), torch.randint(0, 300, (1, 9)), torch.ones(1, 9, dtype=torch.long))
    _, report = fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=1024))
    assert report["fused"] == 0 and "sliding window" in report["layers"][0]["reason"]


def test_graphs_of_a_fixed_batch_and_a_small_cache_are_probed_at_their_sizes():
    """The block probe fed batch 1 and wrote 8 tokens: a graph of fixed batch 2, or of a 4-token cache, could not be
    run and, now that an unchecked block stays unfused, fused nothing."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    for max_context, batch in ((4, None), (MAX_CONTEXT, 2)):
        for phase, model in export_graphs(decoder, max_context).items():
            if batch is not None:
                for value in model.graph.input:
                    dim = value.type.tensor_type.shape.dim[0]
                    dim.Clear()
                    dim.dim_value = batch
            model = cleanup.run(model, cleanup.Options())[0]
            _, report = fuse_attention.run(model, fuse_attention.Options(required=True))
            assert report["fused"] == CONFIG.num_layers, (max_context, batch, phase)


def test_llama3_scaled_rotary_frequencies_fuse_and_keep_the_logits():
    """Llama 3.1+'s rope scaling divides each rotary frequency by its own factor. The pass reads the frequencies
    from the graph, so the fused and lowered graphs' rotary tables carry the divided ones: their logits and cache
    rows match the unfused graphs', which differ from plain RoPE's."""
    scaled = dataclasses.replace(CONFIG, rope_freq_factors=(1.0, 1.7, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0))
    weights = random_model(CONFIG, seed=0).state_dict
    for name, weight in weights.items():  # sharper attention, so that the rotary angles show in the logits
        if ".q_proj." in name or ".k_proj." in name:
            weight.mul_(4.0)
    graphs = {}
    for config in (CONFIG, scaled):
        exported = export_graphs(build_decoder(config, weights), MAX_CONTEXT)
        graphs[config] = {phase: cleanup.run(model, cleanup.Options())[0] for phase, model in exported.items()}
    lowered = {phase: fuse_and_lower(model, required=True)[2] for phase, model in graphs[scaled].items()}
    fused_logits, unfused_logits = generate_logits(lowered), generate_logits(graphs[scaled])
    for fused, reference in zip(fused_logits, unfused_logits):
        np.testing.assert_allclose(fused, reference, atol=1e-5)
    plain_logits = generate_logits(graphs[CONFIG])
    assert max(np.abs(a - b).max() for a, b in zip(unfused_logits[:-1], plain_logits[:-1])) > 1e-2


def guard_probabilities(model: onnx.ModelProto, fill: float) -> onnx.ModelProto:
    """Every Softmax's output p read through Where(IsNaN(p), fill, p), as torch's SDPA export guards it."""
    graph = gs.import_onnx(model)
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"]):
        probabilities = softmax.outputs[0]
        readers = list(probabilities.outputs)
        isnan = graph.layer(op="IsNaN", inputs=[probabilities], outputs=[f"guard_{index}_isnan"])[0]
        guarded = graph.layer(op="Where", inputs=[isnan, gs.Constant(f"guard_{index}_fill", np.array(fill, np.float32)),
                                                  probabilities], outputs=[f"guard_{index}_probabilities"])[0]
        guarded.dtype = probabilities.dtype
        for reader in readers:
            reader.inputs[reader.inputs.index(probabilities)] = guarded
    return gs.export_onnx(graph.toposort())


@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_only_a_nan_guard_that_zeroes_the_probabilities_is_fused_through(decoder_graphs, fill):
    """torch's SDPA export guards the probabilities with Where(IsNaN(p), 0, p): a query whose keys are all masked
    attends to nothing and outputs 0. The pass steps over that guard. One with another fill computes something else
    for such a row, so its Where is a second reader of the probabilities and the layers stay unfused (no row of this
    graph is all masked: only the constant tells the two guards apart, and the probe cannot)."""
    model = guard_probabilities(decoder_graphs["prefill"], fill)
    fused, report = fuse_attention.run(model, fuse_attention.Options())
    if fill == 0.0:
        assert report["fused"] == CONFIG.num_layers and op_counts(fused)["IsNaN"] == 0, report
        return
    assert report["fused"] == 0 and op_counts(fused)["IsNaN"] == CONFIG.num_layers
    assert {layer["reason"] for layer in report["layers"]} == {
        "Softmax output has 2 consumers, expected the value MatMul only"}


def write_keys_twice(model: onnx.ModelProto, offset: int) -> onnx.ModelProto:
    """Layer 0's key cache write gets its keys twice, [k; k] along the rows, at their positions and `offset` rows on;
    the attention reads the first copy (Slice), so the scores still read k."""
    graph = gs.import_onnx(model)
    writer = next(n for n in graph.nodes if n.op == "ScatterElements" and n.outputs[0].name == "present.0.key")
    keys, rows = writer.inputs[2], writer.inputs[1]
    readers = [n for n in keys.outputs if n is not writer]
    constants = {name: gs.Constant(f"twice_{name}", np.array(value, np.int64)) for name, value in
                 (("axis", [2]), ("repeat", [1, 1, 2, 1, 1]), ("shape", [0, 0, -1, CONFIG.head_dim]), ("zero", [0]),
                  ("offset", offset))}
    stacked = graph.layer(op="Unsqueeze", inputs=[keys, constants["axis"]], outputs=["twice_unsqueezed"])[0]
    stacked = graph.layer(op="Expand", inputs=[stacked, constants["repeat"]], outputs=["twice_expanded"])[0]
    both = graph.layer(op="Reshape", inputs=[stacked, constants["shape"]], outputs=["twice_keys"])[0]  # [B, KV, 2S, D]
    length = graph.layer(op="Shape", inputs=[keys], outputs=["twice_length"], attrs={"start": 2, "end": 3})[0]
    first = graph.layer(op="Slice", inputs=[both, constants["zero"], length, constants["axis"]],
                        outputs=["first_copy"])[0]
    later = graph.layer(op="Add", inputs=[rows, constants["offset"]], outputs=["twice_later_rows"])[0]
    both_rows = graph.layer(op="Concat", inputs=[rows, later], outputs=["twice_rows"], attrs={"axis": 2})[0]
    for tensor in (stacked, both, first):
        tensor.dtype = keys.dtype
    both_rows.dtype = later.dtype = rows.dtype
    writer.inputs[1], writer.inputs[2] = both_rows, both
    for reader in readers:
        reader.inputs[reader.inputs.index(keys)] = first
    return gs.export_onnx(graph.toposort())


def test_a_block_that_also_writes_rows_beyond_the_prompt_is_not_fused(decoder_graphs):
    """Layer 0's prefill writes every key at its position and again 16 rows on. Rows 0.. hold what FlashAttention
    writes and the attention output is the same: only the rows beyond the prompt, which the fused node would leave
    as they were, show the difference. The block probe checks them too and keeps the layer unfused."""
    model = write_keys_twice(decoder_graphs["prefill"], offset=16)
    inputs, _ = io_names(CONFIG)
    length = 6
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    feed = {"input_ids": np.array([[1, 5, 9, 14, 200, 7]]), "position_ids": np.arange(length)[None],
            "attention_mask": np.ones((1, length), np.int64), **dict(zip(inputs[3:], caches))}
    present_key = session_for(model).run(["present.0.key"], feed)[0]
    assert np.abs(present_key[:, :, :length]).max() > 0
    np.testing.assert_array_equal(present_key[:, :, 16:16 + length], present_key[:, :, :length])  # the second copy
    _, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == CONFIG.num_layers - 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["reason"].startswith("the block writes the key cache elsewhere than FlashAttention does")


def layer_zero_edited(model: onnx.ModelProto, edit) -> onnx.ModelProto:
    """The graph with `edit(graph, softmax)` applied to layer 0's attention (its Softmax passed)."""
    graph = gs.import_onnx(model)
    edit(graph, next(n for n in graph.nodes if n.op == "Softmax" and "layers.0" in n.name))
    return gs.export_onnx(graph.cleanup().toposort())


def cache_writer(graph: gs.Graph, present: str) -> gs.Node:
    return next(n for n in graph.nodes if n.op == "ScatterElements" and n.outputs and n.outputs[0].name == present)


def scale_values(graph, softmax):
    weighted_sum = softmax.outputs[0].outputs[0]
    doubled = graph.layer(op="Mul", inputs=[weighted_sum.inputs[1], gs.Constant("two", np.array(2.0, np.float32))],
                          outputs=["doubled_values"])[0]
    doubled.dtype = np.float32
    weighted_sum.inputs[1] = doubled


def scale_scores_by_an_input(graph, softmax):
    gain = gs.Variable("score_gain", np.float32, [1])
    graph.inputs.append(gain)
    gained = graph.layer(op="Mul", inputs=[softmax.inputs[0], gain], outputs=["gained_scores"])[0]
    gained.dtype = np.float32
    softmax.inputs[0] = gained


def grow_keys_by_concat(graph, softmax):
    writer = cache_writer(graph, "present.0.key")
    keys = writer.inputs[2]
    past = gs.Variable("past_new_keys", np.float32, ["batch", CONFIG.num_kv_heads, "past", CONFIG.head_dim])
    graph.inputs.append(past)
    grown = graph.layer(op="Concat", inputs=[past, keys], outputs=["grown_keys"], attrs={"axis": 2})[0]
    grown.dtype = np.float32
    for reader in [n for n in keys.outputs if n is not writer and n.op != "Concat"]:
        reader.inputs[reader.inputs.index(keys)] = grown


def write_values_nowhere(graph, softmax):
    writer = cache_writer(graph, "present.0.value")
    present = writer.outputs[0]
    writer.outputs.clear()
    graph.nodes.append(gs.Node("Identity", inputs=[writer.inputs[0]], outputs=[present]))


def write_keys_into_a_computed_buffer(graph, softmax):
    writer = cache_writer(graph, "present.0.key")
    copied = graph.layer(op="Identity", inputs=[writer.inputs[0]], outputs=["copied_past_key"])[0]
    copied.dtype = np.float32
    writer.inputs[0] = copied


@pytest.mark.parametrize("edit, reason", [
    (scale_values, "the values are scaled by 2 before the weighted sum"),
    (scale_scores_by_an_input, "Mul before Softmax is not a scaling by a constant"),
    (grow_keys_by_concat, "the cache grows by Concat(past, new) at "),
    (write_values_nowhere, "only one of the key and value caches is written"),
    (write_keys_into_a_computed_buffer, "cache write '/decoder/layers.0/self_attn/ScatterElements' does not update a "
                                        "graph input buffer"),
])
def test_each_structural_refusal_names_its_layer_and_check(decoder_graphs, edit, reason):
    """Layer 0 edited so that one structural check fails; layer 1 still fuses, and the report and `required` name
    layer 0 with that check (a value cache left unwritten had fused with an empty present value; the others fell
    through to a later, vaguer reason)."""
    model = layer_zero_edited(decoder_graphs["prefill"], edit)
    _, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["layer"] == "layers.0" and report["layers"][0]["reason"].startswith(reason), report
    with pytest.raises(PassError, match=r"1 attention block\(s\) not fused; first: layers.0: "):
        fuse_attention.run(model, fuse_attention.Options(required=True))


def respell_scores(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each layer's softmax(scores * s + mask) written softmax(Identity(mask + scores / (1 / s))): a division, the
    mask as Add's first operand, one more step between the product and Softmax."""
    graph = gs.import_onnx(model)
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"]):
        add = softmax.inputs[0].inputs[0]
        scaled, mask = add.inputs
        multiply = scaled.inputs[0]
        product, factor = multiply.inputs[0], float(multiply.inputs[1].values)
        divided = graph.layer(op="Div", inputs=[product, gs.Constant(f"respelled_{index}_divisor",
                                                                    np.array(1 / factor, np.float32))],
                              outputs=[f"respelled_{index}_divided"])[0]
        add.inputs = [mask, divided]
        passed = graph.layer(op="Identity", inputs=[add.outputs[0]], outputs=[f"respelled_{index}_scores"])[0]
        divided.dtype = passed.dtype = np.float32
        softmax.inputs[0] = passed
    return gs.export_onnx(graph.cleanup().toposort())


def test_scores_divided_by_the_scale_with_the_mask_added_first_fuse(decoder_graphs):
    """A Div by 1/s is a scaling by s (read as 1/s, the graph would stay unfused), the mask may be Add's first
    operand, and an Identity more fits the walk from Softmax to the product; the logits and cache stay the same."""
    respelled = {phase: respell_scores(model) for phase, model in decoder_graphs.items()}
    assert op_counts(respelled["decode"])["Div"] > op_counts(decoder_graphs["decode"])["Div"]
    fused = {phase: fuse_and_lower(model, required=True) for phase, model in respelled.items()}
    for phase, (graph, report, _, _) in fused.items():
        assert report["fused"] == CONFIG.num_layers, (phase, report)
        scales = [a.f for n in graph.graph.node if n.op_type == "FlashAttention" for a in n.attribute
                  if a.name == "scale"]
        assert scales == pytest.approx([CONFIG.head_dim ** -0.5] * CONFIG.num_layers), phase
    lowered = {phase: outcome[2] for phase, outcome in fused.items()}
    for reference, result in zip(generate_logits(decoder_graphs), generate_logits(lowered)):
        np.testing.assert_allclose(result, reference, atol=1e-5)


def add_window(model: onnx.ModelProto, window: int) -> onnx.ModelProto:
    """Each layer's scores get a second additive mask after the causal one: -1e9 on keys more than `window` - 1
    positions before the query (a sliding window added on its own)."""
    graph = gs.import_onnx(model)
    inputs = {t.name: t for t in graph.inputs}
    const = lambda name, value: gs.Constant(f"window_{name}", np.array(value))  # noqa: E731
    shape = graph.layer(op="Shape", inputs=[inputs["attention_mask"]], outputs=["window_shape"])[0]
    length = graph.layer(op="Gather", inputs=[shape, const("one", np.int64(1))], outputs=["window_length"],
                         attrs={"axis": 0})[0]
    keys = graph.layer(op="Range", inputs=[const("zero", np.int64(0)), length, const("step", np.int64(1))],
                       outputs=["window_keys"])[0]
    positions = graph.layer(op="Unsqueeze", inputs=[inputs["position_ids"], const("axis", np.array([2], np.int64))],
                            outputs=["window_positions"])[0]
    first = graph.layer(op="Sub", inputs=[positions, const("width", np.int64(window - 1))], outputs=["window_first"])[0]
    outside = graph.layer(op="Less", inputs=[keys, first], outputs=["window_outside"])[0]
    bias = graph.layer(op="Where", inputs=[outside, const("hidden", np.float32(-1e9)), const("kept", np.float32(0))],
                       outputs=["window_bias_3d"])[0]
    bias = graph.layer(op="Unsqueeze", inputs=[bias, const("axes", np.array([1, 2], np.int64))],
                       outputs=["window_bias"])[0]  # [B, 1, 1, T, L] like the causal mask
    bias.dtype = np.float32
    for index, softmax in enumerate([n for n in graph.nodes if n.op == "Softmax"]):
        windowed = graph.layer(op="Add", inputs=[softmax.inputs[0], bias], outputs=[f"window_scores_{index}"])[0]
        windowed.dtype = np.float32
        softmax.inputs[0] = windowed
    return gs.export_onnx(graph.toposort())


def test_a_second_additive_mask_is_not_dropped_by_fusion(decoder_graphs):
    """A 10-token window added to the scores after the causal mask: the mask probe ran only the mask nearest the
    product (causal), the block probe's 8 tokens cannot see a 10-token window, and both layers fused; the fused
    graph then attended to every earlier key, and a 14-token prompt's logits changed by 0.09. Now the layers stay
    unfused and the graph computes what it did."""
    model = add_window(decoder_graphs["prefill"], window=10)
    inputs, _ = io_names(CONFIG)
    length = 14
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    feed = {"input_ids": np.arange(1, length + 1)[None] * 7, "position_ids": np.arange(length)[None],
            "attention_mask": np.ones((1, length), np.int64), **dict(zip(inputs[3:], caches))}
    windowed, causal = (session_for(m).run(["logits"], feed)[0] for m in (model, decoder_graphs["prefill"]))
    assert np.abs(windowed - causal).max() > 1e-2  # the window shows at 14 tokens
    fused, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == 0, report
    assert all(layer["reason"].startswith("the scores get two additive masks or biases before Softmax")
               for layer in report["layers"]), report
    np.testing.assert_allclose(session_for(fused).run(["logits"], feed)[0], windowed, atol=1e-6)
    with pytest.raises(PassError, match="layers.0: the scores get two additive masks"):
        fuse_attention.run(model, fuse_attention.Options(required=True))


def test_a_decode_window_wider_than_the_second_probe_is_not_fused(decoder_graphs, monkeypatch):
    """A decode graph whose mask hides keys 10 or more positions back: the first probe (32 tokens) sees the window;
    the second one (3 queries after 5 cached tokens) cannot, and its verdict must not replace the first one's."""
    import compiler.frontend.model as model_module

    def windowed(position_ids, attention_mask, dtype):
        keys = torch.arange(attention_mask.shape[1]).view(1, 1, -1)
        visible = (keys <= position_ids.unsqueeze(-1)) & (keys > position_ids.unsqueeze(-1) - 10) \
            & (attention_mask.unsqueeze(1) > 0)
        return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None]

    monkeypatch.setattr(model_module, "visibility_bias", windowed)
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    decode = cleanup.run(export_graphs(decoder, MAX_CONTEXT)["decode"], cleanup.Options())[0]
    _, report = fuse_attention.run(decode, fuse_attention.Options())
    assert report["fused"] == 0 and {layer["reason"] for layer in report["layers"]} == {
        "the additive mask hides keys at or before the query that a causal mask keeps (e.g. a sliding window)"}


def test_the_mask_probe_judges_every_head_and_the_masked_threshold():
    from passes.attention_mask_probe import _judge

    causal = np.triu(np.full((6, 6), -np.inf), 1)
    leaky = np.triu(np.full((6, 6), -1.0), 1)  # later keys only pushed down by 1: they still get weight
    assert _judge(leaky[None, None], 6) == "the additive mask is not causal: some query sees a later key"
    assert _judge(np.triu(np.full((6, 6), -1e4), 1)[None, None], 6) is None  # -1e4 counts as masked
    window = causal.copy()
    window[5, 0] = -np.inf
    per_head = np.stack([causal, window])[None]  # [1, 2 heads, 6, 6]: head 1 has a window
    assert "sliding window" in _judge(per_head, 6)
    assert "not [..., 6, 6]" in _judge(np.zeros((1, 1, 1, 6)), 6)  # one row for every query: no causal rule
    # Queries after cached tokens (3 new of 6): a kept key masked by exactly -1e4 is read as the top-left mistake
    later = np.triu(np.full((6, 6), -np.inf), 1)[3:]
    later[0, 4] = 0.0  # and a later key visible: query at position 3 sees key 4
    assert "not causal for queries after cached tokens" in _judge(later[None, None], 6, 3)
    top_left = np.triu(np.full((3, 6), -1e4), 1)
    assert "aligned top-left" in _judge(top_left[None, None], 6, 3)


def test_a_block_that_caches_keys_other_than_it_reads_is_not_fused(decoder_graphs):
    """Layer 0's prefill caches its keys halved and reads them halved (the half folds into the scale): the attention
    output is FlashAttention's with scale/2, but FlashAttention caches the unhalved keys, which a later decode step
    of the unfused graph would not read. The probe compares the written rows' values and keeps the layer unfused."""
    def cache_halved_keys(graph, softmax):
        writer = cache_writer(graph, "present.0.key")
        keys = writer.inputs[2]
        halved = graph.layer(op="Mul", inputs=[keys, gs.Constant("half", np.array(0.5, np.float32))],
                             outputs=["halved_keys"])[0]
        halved.dtype = np.float32
        for reader in [n for n in keys.outputs if n.op != "Mul" or n.outputs[0] is not halved]:
            reader.inputs[reader.inputs.index(keys)] = halved

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["prefill"], cache_halved_keys),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["reason"].startswith(
        "the block writes the key cache elsewhere than FlashAttention does (rows 0..7 for a 8-token first prompt; "
        "largest difference 0.5")


def cache_rows_moved(graph, cache: str, addend: gs.Tensor) -> None:
    """The rows the writer of output `cache` writes, moved by `addend` (an Add before its row indices)."""
    writer = cache_writer(graph, cache)
    writer.inputs[1] = graph.layer(op="Add", inputs=[writer.inputs[1], addend], outputs=[f"{cache}_rows_moved"])[0]
    writer.inputs[1].dtype = np.int64


def test_a_value_cache_written_at_other_rows_is_not_fused(decoder_graphs):
    """Only layer 0's value write moved one row on (its key write as FlashAttention's): the value cache is checked
    as well as the key cache."""
    def later_value_rows(graph, softmax):
        cache_rows_moved(graph, "present.0.value", gs.Constant("one_row", np.array(1, np.int64)))

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["prefill"], later_value_rows),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["reason"].startswith("the block writes the value cache elsewhere than FlashAttention")


def test_a_block_the_probe_cannot_run_leaves_the_other_blocks_checked(decoder_graphs):
    """Layer 0's key write reads an input the probe cannot make: that block stays unfused as unchecked, and layer 1
    is probed alone and fused (not every block unchecked because one could not run)."""
    def offset_rows_by_an_input(graph, softmax):
        offset = gs.Variable("row_offset", np.int64, [1])
        graph.inputs.append(offset)
        cache_rows_moved(graph, "present.0.key", offset)

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["prefill"], offset_rows_by_an_input),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["reason"].startswith("unchecked: the block could not be evaluated")


def test_a_float32_block_two_percent_off_the_matched_scale_is_caught(decoder_graphs):
    """The block probe's float32 tolerance is 1e-3 of the output's magnitude: a scale 2% off the matched one gives a
    difference of 0.005 there, and is reported (a float16 block's 5e-2 would pass it)."""
    from passes import attention_block_probe as probe

    graph = gs.import_onnx(decoder_graphs["prefill"])
    softmax = next(node for node in graph.nodes if node.op == "Softmax")
    found = fuse_attention.match(softmax)
    scaling = softmax.inputs[0].inputs[0].inputs[0].inputs[0]  # Softmax <- Add(mask) <- Mul(scale)
    assert scaling.op == "Mul" and found.scale == pytest.approx(CONFIG.head_dim ** -0.5)
    scaling.inputs[1].values = np.asarray(scaling.inputs[1].values * 1.02, np.float32)
    [verdict] = probe.check_blocks(graph, [found])
    assert verdict is not None and verdict.startswith("the attention block computes something other than")


def test_fusion_required_on_a_graph_without_attention_fails():
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    model = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    _, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == 0 and report["layers"] == []
    with pytest.raises(PassError, match="fusion required but 1 attention block.* first: graph: no Softmax"):
        fuse_attention.run(model, fuse_attention.Options(required=True))


def test_rotary_cache_length_sets_the_table_rows_of_a_graph_with_a_cache(decoder_graphs):
    """The recipe's rotary_cache_length overrides the cache's max context as the rotary tables' length."""
    fused, report = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options(rotary_cache_length=48))
    nodes = [n for n in fused.graph.node if n.op_type == "FlashAttention"]
    assert report["fused"] == len(nodes) == CONFIG.num_layers  # else the loop below could check nothing
    for node in nodes:
        assert rotary_table_shape(fused, node.input[7]) == [48, CONFIG.head_dim // 2]


def test_a_rotary_attention_factor_is_kept_in_the_fused_tables():
    """transformers' YaRN rope multiplies cos and sin by an attention factor (here 1 + 0.1 ln 4 = 1.139). The pass
    reads it from the graph; the block probe's reference and the fused node's tables both apply it (without it in
    the tables the fused logits moved by 0.0025; without it in the reference both layers stayed unfused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                         attn_implementation="eager", use_cache=False)
    model = LlamaForCausalLM(config).eval()
    assert model.model.rotary_emb.attention_scaling == pytest.approx(1.1386, abs=1e-4)
    ids, mask = torch.randint(0, 300, (1, 9)), torch.ones(1, 9, dtype=torch.long)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
    _, report, lowered, _ = fuse_and_lower(trace_hf(model, ids, mask), rotary_cache_length=128, required=True)
    assert report["fused"] == 2
    logits = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(logits, expected, atol=1e-5)


def test_rotary_frequencies_chosen_by_sequence_length_are_not_fused():
    """transformers' longrope (Phi-3's rope, here on Llama) exported by dynamo picks its frequencies at run time:
    Where(max(position) + 1 > 32, long, short). The search for inv_freq under Cos found one branch, and the block
    probe's 8 positions ran the short one: spelled Where(<= 32, short, long) (the same graph), both layers were fused
    with the short frequencies and prompts longer than 32 tokens changed their logits (5.5e-3 at 33 tokens, 7.3e-3 at
    100). Frequencies under a Where are now refused, and the cos/sin tables are checked over the probe length (here
    the 128 rotary rows); the layers stay unfused. Longrope is never fused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "factor": 4.0,
                                       "long_factor": [float(i + 1) for i in range(8)],
                                       "original_max_position_embeddings": 32},
                         attn_implementation="eager", use_cache=False)
    model = export_dynamo(LlamaForCausalLM(config).eval(), torch.randint(0, 300, (1, 7)),
                          torch.ones(1, 7, dtype=torch.long), 18)
    graph = gs.import_onnx(model)
    for where in [n for n in graph.nodes if n.op == "Where" and n.inputs[0].inputs[0].op == "Greater"]:
        at_most = graph.layer(op="LessOrEqual", inputs=list(where.inputs[0].inputs[0].inputs),
                              outputs=[f"{where.name}_at_most"])[0]
        at_most.dtype = np.bool_
        where.inputs = [at_most, where.inputs[2], where.inputs[1]]
    swapped = gs.export_onnx(graph.cleanup().toposort())
    feed = {"input_ids": np.arange(1, 41)[None] * 7, "attention_mask": np.ones((1, 40), np.int64)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    expected = run(model)
    np.testing.assert_allclose(run(swapped), expected, atol=1e-6)  # the same graph, spelled the other way
    for graph_ in (model, swapped):
        fused, report = fuse_attention.run(graph_, fuse_attention.Options(rotary_cache_length=128))
        assert report["fused"] == 0, report
        np.testing.assert_allclose(run(fused), expected, atol=1e-6)
    assert all(layer["reason"].startswith("rotary: the frequencies under Cos are chosen at run time by Where")
               for layer in report["layers"]), report


def test_positions_clamped_past_the_block_probe_are_not_fused(hf_traced):
    """inv_freq is found under Cos and the block probe runs 8 positions: positions clamped at 10 (Min) passed both
    and fused, the fused node rotating by the true positions (logits off by 0.07 at 33 tokens with q and k
    weights scaled by 4). The graph's cos and
    sin tables are now run over the probe length and compared with the fused node's."""
    graph = gs.import_onnx(hf_traced[0])
    cast = next(n for n in graph.nodes if n.op == "Cast" and "rotary_emb" in n.name)  # positions, as float
    clamped = graph.layer(op="Min", inputs=[cast.outputs[0], np.array(10.0, np.float32)], outputs=["clamped"])[0]
    for node in [n for n in graph.nodes if cast.outputs[0] in n.inputs and n.op != "Min"]:
        node.inputs = [clamped if t is cast.outputs[0] else t for t in node.inputs]
    model = gs.export_onnx(graph.cleanup().toposort())
    feed = {"input_ids": np.arange(1, 34)[None] * 7, "attention_mask": np.ones((1, 33), np.int64)}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]  # noqa: E731
    expected = run(model)
    assert np.abs(expected - run(hf_traced[0])).max() > 1e-3  # the clamp changes the model past position 10
    fused, report = fuse_attention.run(model, fuse_attention.Options(rotary_cache_length=128))
    assert report["fused"] == 0 and all(layer["reason"].startswith("rotary: its cos table differs from cos(position")
                                        for layer in report["layers"]), report
    np.testing.assert_allclose(run(fused), expected, atol=1e-6)


# -- decode graphs whose attention differs only once the cache holds earlier tokens, and blocks sharing a cache --
def _int64(name, value):
    return gs.Constant(name, np.array(value, np.int64))


def test_a_decode_block_that_reads_only_the_new_tokens_keys_is_not_fused(decoder_graphs):
    """Layer 0's decode reads rows [total - S, total) of its key cache, not [0, total): with the first probe's empty
    past the new tokens are the whole context and the two agree; after cached tokens they do not (15% off logits)."""
    def keys_of_new_rows_only(graph, softmax):
        read = next(n for n in graph.nodes if n.op == "Slice" and n.inputs[0].name == "present.0.key")
        positions = next(t for t in graph.inputs if t.name == "position_ids")
        shape = graph.layer(op="Shape", inputs=[positions], outputs=["positions_shape"])[0]
        new = graph.layer(op="Slice", inputs=[shape, _int64("s1", [1]), _int64("s2", [2]), _int64("s0", [0])],
                          outputs=["new_tokens"])[0]
        start = graph.layer(op="Sub", inputs=[read.inputs[2], new], outputs=["new_rows_start"])[0]
        for tensor in (shape, new, start):
            tensor.dtype = np.int64
        read.inputs[1] = start

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["decode"], keys_of_new_rows_only),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert "after 7 cached tokens" in report["layers"][0]["reason"], report


def test_the_unedited_decode_graph_still_fuses_every_layer(decoder_graphs):
    _, report = fuse_attention.run(decoder_graphs["decode"], fuse_attention.Options())
    assert report["fused"] == 2 and report["unfused"] == 0, report


def test_a_block_reading_another_layers_key_cache_is_refused_not_a_crash(decoder_graphs):
    """Layer 1 reads layer 0's written key cache: both blocks match layer 0's ScatterElements. Fusing both crashed
    (IndexError in rewrite: the writer's output already taken); each is reported unfused instead."""
    graph = gs.import_onnx(decoder_graphs["decode"])
    read = next(n for n in graph.nodes if n.op == "Slice" and n.inputs[0].name == "present.1.key")
    read.inputs[0] = next(t for t in graph.outputs if t.name == "present.0.key")
    model = gs.export_onnx(graph.cleanup().toposort())
    _, report = fuse_attention.run(model, fuse_attention.Options())
    assert report["fused"] == 0, report
    assert all("is matched by layers.0, layers.1" in layer["reason"] for layer in report["layers"]), report


def test_a_cache_write_that_adds_to_the_buffer_is_not_fused(decoder_graphs):
    """Layer 0 writes its caches with ScatterElements(reduction='add') (index_add_ / scatter_add): each written row is
    the row the buffer held plus the new key or value. The probes write over zeros, where that is an overwrite: both
    layers were fused and a decode over a reused buffer changed the logits by 0.12. The reduction is now read."""
    def accumulating_writes(graph, softmax):
        for cache in ("present.0.key", "present.0.value"):
            cache_writer(graph, cache).attrs["reduction"] = "add"

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["decode"], accumulating_writes),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert "has reduction='add'" in report["layers"][0]["reason"], report


def test_a_block_reading_another_sequences_keys_is_not_fused(decoder_graphs):
    """Layer 0's decode reads sequence 0's key cache for every sequence (a Slice on the batch axis; the MatMul
    broadcasts it). The block probe gave every sequence the same q, k, v and past, where that changes nothing: both
    layers were fused and the second sequence's logits changed by 0.07. Each probe sequence gets its own values now."""
    def first_sequences_keys(graph, softmax):
        read = next(n for n in graph.nodes if n.op == "Slice" and n.inputs[0].name == "present.0.key")
        first = graph.layer(op="Slice", inputs=[read.inputs[0], _int64("b0", [0]), _int64("b1", [1]),
                                                _int64("ax0", [0])], outputs=["first_sequence_keys"])[0]
        first.dtype = np.float32
        read.inputs[0] = first

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["decode"], first_sequences_keys),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert report["layers"][0]["reason"].startswith("the attention block computes something other than FlashAttention")


def test_an_attention_output_read_beside_the_head_merge_names_its_readers(decoder_graphs):
    """TorchScript's export of SDPA attention also reads the weighted sum's shape (a Shape node) to build the head
    merge's Reshape: the reason said the output "does not reach an output projection", where it does; it now names
    the readers and the exports that fuse."""
    def shape_read_beside(graph, softmax):
        weighted_sum = softmax.outputs[0].outputs[0].outputs[0]
        shape = graph.layer(op="Shape", inputs=[weighted_sum], outputs=["weighted_sum_shape"])[0]
        shape.dtype = np.int64
        graph.outputs.append(shape)

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["decode"], shape_read_beside),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    reason = report["layers"][0]["reason"]
    assert "has 2 readers (" in reason and "Shape '" in reason and "attn_implementation='eager'" in reason, reason


def test_a_cache_written_by_scatter_nd_is_named(decoder_graphs):
    """torch.export writes a StaticCache's index_copy_ as ScatterND: the walk up from the keys stopped there and the
    reason blamed the rotary ("no rotary embedding at 'val_132'"); it now names the ScatterND write."""
    def scatter_nd_write(graph, softmax):
        cache_writer(graph, "present.0.key").op = "ScatterND"  # refused by name before anything runs it

    _, report = fuse_attention.run(layer_zero_edited(decoder_graphs["decode"], scatter_nd_write),
                                   fuse_attention.Options())
    assert report["fused"] == 1 and report["layers"][1]["fused"], report
    assert "the cache is written by ScatterND '" in report["layers"][0]["reason"], report


def test_a_block_the_probe_cannot_run_leaves_the_others_their_two_sequence_probe(decoder_graphs):
    """Layer 0 takes its batch from an input the probe cannot make; layer 1 reads sequence 0's keys for every
    sequence. The failed run of both was retried with one sequence before being split by block, so layer 1 was judged
    on one sequence, where its read cannot show, and fused."""
    graph = gs.import_onnx(decoder_graphs["prefill"])
    scores = next(n for n in graph.nodes if n.op == "MatMul" and n.name == "/decoder/layers.1/self_attn/MatMul")
    first = graph.layer(op="Slice", inputs=[scores.inputs[1], _int64("b0", [0]), _int64("b1", [1]), _int64("ax0", [0])],
                        outputs=["first_sequence_keys"])[0]
    first.dtype = np.float32
    scores.inputs[1] = first
    concat = next(n for n in graph.nodes if n.name == "/decoder/layers.0/self_attn/Concat_6")
    extra = gs.Variable("extra_input", np.float32, ["batch", "sequence"])
    graph.inputs.append(extra)
    shape = graph.layer(op="Shape", inputs=[extra], outputs=["extra_shape"])[0]
    shape.dtype = np.int64
    batch = graph.layer(op="Slice", inputs=[shape, _int64("e0", [0]), _int64("e1", [1]), _int64("ex", [0])],
                        outputs=["extra_batch"])[0]
    batch.dtype = np.int64
    concat.inputs[0] = batch
    _, report = fuse_attention.run(gs.export_onnx(graph.cleanup().toposort()), fuse_attention.Options())
    assert report["fused"] == 0, report
    assert report["layers"][0]["reason"].startswith("unchecked"), report
    assert "in probe sequence 1 of 2" in report["layers"][1]["reason"], report


def test_the_cache_length_comes_from_the_cache_not_another_concatenated_input():
    """Found by what writes it, any rank-4 float input a Concat reads could pass for a cache: prefix embeddings
    concatenated first gave their 7 rows as the probe's length, where the cache holds 128."""
    from passes.attention_mask_probe import cache_length

    prefix = gs.Variable("prefix_embeddings", np.float32, [1, 1, 7, 64])
    past = gs.Variable("past.0.key", np.float32, [1, 2, 128, 16])
    hidden = gs.Variable("hidden", np.float32, None)
    present = gs.Variable("present.0.key", np.float32, None)
    new_key = gs.Variable("k", np.float32, [1, 2, 1, 16])
    nodes = [gs.Node("Concat", inputs=[prefix, prefix], outputs=[hidden], attrs={"axis": 2}),
             gs.Node("Concat", inputs=[past, new_key], outputs=[present], attrs={"axis": 2})]
    graph = gs.Graph(nodes=nodes, inputs=[prefix, past, new_key], outputs=[hidden, present])
    assert cache_length(graph) == 128


def test_a_probe_onnxruntime_refuses_keeps_the_reason_not_the_signature(monkeypatch):
    """onnxruntime's reason comes after a long C++ signature: the first 160 characters said only where it failed."""
    import onnxruntime

    from passes.attention_mask_probe import run_cut

    def refuse(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model from memory failed:" + " x" * 80 +
                           " Model::Model(onnx::ModelProto&&, const onnxruntime::PathString&) Unsupported model IR "
                           "version: 12, max supported IR version: 11")
    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)
    graph = gs.Graph(inputs=[gs.Variable("x", np.float32, [1])], outputs=[gs.Variable("y", np.float32, [1])])
    graph.nodes.append(gs.Node("Identity", inputs=[graph.inputs[0]], outputs=[graph.outputs[0]]))
    said = run_cut(graph, lambda value: np.zeros(1, np.float32))
    assert said.endswith("Unsupported model IR version: 12, max supported IR version: 11") and len(said) == 160
