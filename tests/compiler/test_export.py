"""The exported prefill/decode graphs, run in onnxruntime, against the torch canonical decoder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from compiler.errors import BuildError
from compiler.export import export_graphs, io_names
from compiler.frontend.config import DecoderConfig
from compiler.frontend.random_init import random_model
from compiler.frontend.model import build_decoder

MAX_CONTEXT = 32
CONFIG = DecoderConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_ids=(2,))


@pytest.fixture(scope="module")
def exported():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    graphs = export_graphs(decoder, MAX_CONTEXT)
    sessions = {phase: ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                for phase, model in graphs.items()}
    return decoder, graphs, sessions


def recompute(decoder, rows: list[list[int]]) -> np.ndarray:
    """Last-token logits of each row, from scratch, one row at a time."""
    out = []
    for tokens in rows:
        n = len(tokens)
        empty = [torch.zeros(1, CONFIG.num_kv_heads, n, CONFIG.head_dim)] * CONFIG.num_layers
        with torch.no_grad():
            logits, _, _ = decoder(torch.tensor([tokens]), torch.arange(n)[None], torch.ones(1, n, dtype=torch.long),
                                   empty, empty, False, "all")
        out.append(logits[0, -1].numpy())
    return np.stack(out)


def run(session, caches, input_ids, position_ids, attention_mask):
    inputs, _ = io_names(CONFIG)
    feed = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
            **dict(zip(inputs[3:], caches))}
    logits, *presents = session.run(None, feed)
    return logits, presents


def test_tied_embedding_is_stored_once(exported, tmp_path):
    """The lm_head reads the embedding table as stored, Gemm(x, table, transB=1), in the traced files too: the
    exporter had folded a transposed copy into them (1.05 GB for Llama-3.2-1B), which the build then read back,
    compared with the table (two more copies) and removed; a 1.54 GB tied model peaked at 5.4 GB doing that."""
    from compiler.export import trace_graphs

    decoder, graphs, _ = exported
    for model in graphs.values():
        tables = [t.name for t in model.graph.initializer if CONFIG.vocab_size in t.dims]
        assert tables == ["model.embed_tokens.weight"]
        lm_head = [node for node in model.graph.node if "model.embed_tokens.weight" in node.input[1:]]
        assert [(n.op_type, len(n.input), [(a.name, a.i) for a in n.attribute]) for n in lm_head] == \
            [("Gemm", 2, [("transB", 1)])]
        assert lm_head[0].name == "/decoder/lm_head/Gemm_tied"  # recipes select it by name ("*lm_head*")
    for path in trace_graphs(decoder, MAX_CONTEXT, tmp_path).values():
        traced = onnx.load(str(path))
        assert [t.name for t in traced.graph.initializer if CONFIG.vocab_size in t.dims] == \
            ["decoder.model.embed_tokens.weight"]


def test_batch_with_different_lengths_then_chunked_decode(exported):
    """Right-padded prefill of two prompts, then a 2-token decode chunk and a 1-token step per row."""
    decoder, _, sessions = exported
    rows = [[1, 5, 9, 14, 200, 7], [1, 77, 3]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    caches = [np.zeros((2, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    logits, caches = run(sessions["prefill"], caches, ids, np.tile(np.arange(width), (2, 1)), mask)
    np.testing.assert_allclose(logits, recompute(decoder, rows), atol=1e-5)

    for chunk in ([[11, 12], [21, 22]], [[13], [23]]):
        positions = np.array([[len(r) + i for i in range(len(c))] for r, c in zip(rows, chunk)])
        rows = [r + c for r, c in zip(rows, chunk)]
        total = max(map(len, rows))
        mask = np.array([[1] * len(r) + [0] * (total - len(r)) for r in rows])  # each row's own valid prefix
        logits, caches = run(sessions["decode"], caches, np.array(chunk), positions, mask)
        np.testing.assert_allclose(logits[:, -1], recompute(decoder, rows), atol=1e-5)


def test_prefill_can_return_logits_for_every_position():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    prefill = export_graphs(decoder, MAX_CONTEXT, prefill_logits="all")["prefill"]
    session = ort.InferenceSession(prefill.SerializeToString(), providers=["CPUExecutionProvider"])
    tokens = [1, 5, 9, 14, 200]
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    logits, _ = run(session, caches, np.array([tokens]), np.arange(5)[None], np.ones((1, 5), np.int64))
    assert logits.shape == (1, 5, CONFIG.vocab_size)
    expected = np.concatenate([recompute(decoder, [tokens[: i + 1]]) for i in range(5)])
    np.testing.assert_allclose(logits[0], expected, atol=1e-5)


def test_a_key_the_attention_mask_hides_changes_no_other_token():
    """attention_mask 0 at key 2, inside the prompt (right padding only ever hides keys after every query, where the
    causal rule hides them anyway): no other token may read it. Its token can be anything without changing any other
    position's logits, the tokens before it keep the unmasked prompt's logits, and the ones after it do not."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    prefill = export_graphs(decoder, MAX_CONTEXT, prefill_logits="all")["prefill"]
    session = ort.InferenceSession(prefill.SerializeToString(), providers=["CPUExecutionProvider"])
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    positions, hole = np.arange(6)[None], 2

    def logits_for(tokens, mask):
        return run(session, caches, np.array([tokens]), positions, np.array([mask]))[0][0]

    hidden = logits_for([1, 5, 9, 14, 200, 7], [1, 1, 0, 1, 1, 1])
    hidden_other_token = logits_for([1, 5, 123, 14, 200, 7], [1, 1, 0, 1, 1, 1])
    visible = logits_for([1, 5, 9, 14, 200, 7], [1] * 6)
    others = [i for i in range(6) if i != hole]
    np.testing.assert_allclose(hidden_other_token[others], hidden[others], atol=1e-5)
    np.testing.assert_allclose(hidden[:hole], visible[:hole], atol=1e-5)
    assert np.abs(hidden[hole + 1:] - visible[hole + 1:]).max(axis=-1).min() > 1e-2  # each later token read it


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_export_fuses_and_keeps_float32_rotary(dtype):
    """TensorRT's graphs are float16/bfloat16 (strong typing). The fusion still fires, the rotary tables reach
    the fused node in the graph's type, and the float16 graph's logits stay near the float32 decoder's."""
    import onnx_graphsurgeon as gs

    from passes import cleanup, fuse_attention, lower_onnx_attention

    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    tokens = [[1, 5, 9, 14, 200, 7]]
    expected = recompute(decoder, tokens)
    graphs = export_graphs(build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict), MAX_CONTEXT, dtype=dtype)
    prefill, _ = cleanup.run(graphs["prefill"], cleanup.Options())
    fused, report = fuse_attention.run(prefill, fuse_attention.Options(required=True))
    assert report["fused"] == CONFIG.num_layers
    # The block probe ran the blocks against the op's reference: bfloat16 ones as the same math in float32
    # (onnxruntime's CPU kernels have no bfloat16 Mul; passes/probe_precision.py).
    assert [layer.get("block") for layer in report["layers"]] == [None] * CONFIG.num_layers
    node = next(n for n in gs.import_onnx(fused).nodes if n.op == "FlashAttention")
    assert len({str(t.dtype) for t in (*node.inputs[:5], *node.inputs[7:])}) == 1  # q, k, v, caches, cos, sin
    if dtype == "bfloat16":  # onnxruntime's CPU kernels have no bfloat16 MatMul: the graph's types are the check
        return
    lowered, _ = lower_onnx_attention.run(fused, lower_onnx_attention.Options())
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    n = len(tokens[0])
    caches = [np.zeros((1, CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim), np.float16)] * (2 * CONFIG.num_layers)
    logits, _ = run(session, caches, np.array(tokens), np.arange(n)[None], np.ones((1, n), np.int64))
    difference = np.abs(logits.astype(np.float32) - expected).max()
    assert difference < 1e-2, f"float16 graph vs float32 decoder: max |diff| {difference:.2e}"


@pytest.mark.parametrize("max_context", [2, 4, 6])
def test_a_small_max_context_exports_and_decodes(max_context):
    """The example inputs traced 5 prompt and 7 decode tokens into the cache whatever its size: a max_context of 2
    to 6, which the recipe allows, failed the export ("index 4 is out of bounds")."""
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    sessions = {phase: ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                for phase, model in export_graphs(decoder, max_context).items()}
    tokens = [1, 5, 9, 14, 200, 7][:max_context]
    caches = [np.zeros((1, CONFIG.num_kv_heads, max_context, CONFIG.head_dim), np.float32)] * (2 * CONFIG.num_layers)
    prompt = len(tokens) - 1
    logits, caches = run(sessions["prefill"], caches, np.array([tokens[:prompt]]), np.arange(prompt)[None],
                         np.ones((1, prompt), np.int64))
    np.testing.assert_allclose(logits.reshape(1, -1), recompute(decoder, [tokens[:prompt]]), atol=1e-5)  # the last's
    logits, _ = run(sessions["decode"], caches, np.array([tokens[prompt:]]), np.array([[prompt]]),
                    np.ones((1, len(tokens)), np.int64))
    np.testing.assert_allclose(logits[:, -1], recompute(decoder, [tokens]), atol=1e-5)


def test_the_two_phases_are_traced_into_folders_of_their_own(tmp_path, monkeypatch):
    """The exporter may keep weights in side files named after the tensors (it did for a 1.5 GB model), and the
    two graphs' files share names but not contents: traced into one folder, the decode trace overwrote the prefill's
    "onnx__MatMul_607" with a tensor a quarter its size, which the pass check then caught. The stand-in exporter
    here writes one such side file per trace, holding its phase's name."""
    from compiler.export import load_traced, trace_graphs

    export = torch.onnx.export

    def export_with_a_side_file(module, args, path, **options):
        export(module, args, path, **options)
        (Path(path).parent / "onnx__MatMul_607").write_text(Path(path).stem)

    monkeypatch.setattr(torch.onnx, "export", export_with_a_side_file)
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    paths = trace_graphs(decoder, 16, tmp_path)
    assert {phase: (path.parent / "onnx__MatMul_607").read_text() for phase, path in paths.items()} == {
        "prefill": "prefill", "decode": "decode"}
    graphs = {phase: load_traced(path, CONFIG) for phase, path in paths.items()}
    assert [model.graph.name for model in graphs.values()] == ["prefill", "decode"]


def declared_shapes(values) -> dict:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


@pytest.mark.parametrize("prefill_logits", ["last", "all"])
def test_declared_shapes_name_every_dynamic_axis(exported, prefill_logits):
    """The runtime, TensorRT's profiles and the manifest read these shapes: a length fixed at the example's (5 prompt
    tokens) would refuse other prompts, and a mask declared as long as the input would read a chunk after cached
    tokens as a first prompt."""
    decoder, graphs, _ = exported
    if prefill_logits == "all":
        graphs = export_graphs(decoder, MAX_CONTEXT, prefill_logits="all")
    cache = ["batch", CONFIG.num_kv_heads, MAX_CONTEXT, CONFIG.head_dim]
    logits = {"last": ["batch", CONFIG.vocab_size], "all": ["batch", "sequence", CONFIG.vocab_size]}
    for phase, model in graphs.items():
        inputs, outputs = declared_shapes(model.graph.input), declared_shapes(model.graph.output)
        assert inputs == {"input_ids": ["batch", "sequence"], "position_ids": ["batch", "sequence"],
                          "attention_mask": ["batch", "total"],
                          **{f"past_key_values.{i}.{kind}": cache for i in range(2) for kind in ("key", "value")}}
        assert outputs == {"logits": logits[prefill_logits] if phase == "prefill" else logits["all"],
                           **{f"present.{i}.{kind}": cache for i in range(2) for kind in ("key", "value")}}


def test_kv_cache_spec_sizes_the_buffers_in_their_dtype(exported):
    """The runtime allocates the cache from this shape and bench sizes slots by bytes_per_token: kv_heads (2, not
    the 4 query heads) x head_dim per layer, keys and values, at the cache's element size."""
    from compiler.export import cache_dtype, kv_cache_spec

    spec = kv_cache_spec(CONFIG, MAX_CONTEXT)
    assert spec["shape"] == ["batch", 2, MAX_CONTEXT, 8] and spec["dtype"] == "float32"
    assert spec["output_aliases_input"] == {f"present.{i}.{kind}": f"past_key_values.{i}.{kind}"
                                            for i in range(2) for kind in ("key", "value")}
    per_element = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
    assert {dtype: kv_cache_spec(CONFIG, MAX_CONTEXT, dtype)["bytes_per_token"] for dtype in per_element} == {
        dtype: 2 * 2 * 2 * 8 * size for dtype, size in per_element.items()}
    _, graphs, _ = exported
    assert cache_dtype(graphs, "float32") == "float32"
    quantized = onnx.ModelProto()  # the decode graph after quantize_kv_cache: its cache inputs are int8
    quantized.CopyFrom(graphs["decode"])
    for value in quantized.graph.input:
        if value.name.startswith("past_key_values."):
            value.type.tensor_type.elem_type = onnx.TensorProto.INT8
    assert cache_dtype({**graphs, "decode": quantized}, "float32") == "int8"


def test_an_unknown_dtype_or_a_context_past_the_models_positions_is_refused():
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=3).state_dict)
    with pytest.raises(BuildError, match=r"export.dtype: 'int8' is not one of float32, float16, bfloat16"):
        export_graphs(decoder, MAX_CONTEXT, dtype="int8")
    with pytest.raises(BuildError, match=r"export.max_context: 65 exceeds the model's max_position_embeddings \(64\)"):
        export_graphs(decoder, CONFIG.max_position_embeddings + 1)


def test_an_export_that_runs_out_of_memory_says_so(monkeypatch, tmp_path):
    """torch's allocator's "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate
    memory" named neither the memory a build needs nor what to do."""
    from compiler.export import trace_phase

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 16777216 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(torch.onnx, "export", out_of_memory)
    decoder = build_decoder(CONFIG, random_model(CONFIG, seed=0).state_dict)
    with pytest.raises(BuildError, match=r"^export of the decode graph ran out of memory \(\[enforce fail .*\): a build "
                                         r"holds about 3 to 5 times the model's float32 weights at its peak"):
        trace_phase(decoder, "decode", 64, 21, "last", tmp_path)


def test_a_command_that_runs_out_of_memory_says_so_in_a_line(monkeypatch, capsys):
    from compiler import cli

    def out_of_memory(args):
        raise MemoryError()

    monkeypatch.setattr(cli, "_inspect", out_of_memory)  # the parser names it when main builds it
    assert cli.main(["inspect", "x"]) == 2
    assert "error: out of memory during `aotlm inspect`; free memory, or use a machine with more" in \
        capsys.readouterr().err
