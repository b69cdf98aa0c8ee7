"""Trace the canonical decoder to two ONNX graphs: prefill (a prompt, or a chunk of one; the last token's logits, or
every position's with prefill_logits "all") and decode (a step: every position's logits). Both take the KV cache in
and give it out.

I/O of both graphs (names recorded in the manifest by `kv_cache_spec`):
  inputs   input_ids [batch, sequence] int64, position_ids [batch, sequence] int64,
           attention_mask [batch, total] int64 (1 = a real token; total = cached + new tokens: prefill of a whole
           prompt, total == sequence; a chunk after cached tokens, more),
           past_key_values.{i}.key / .value [batch, kv_heads, max_context, head_dim] float32 (int8 after
           the quantize_kv_cache pass)
  outputs  logits: prefill [batch, vocab] at each row's last valid token ("last") or [batch, sequence, vocab]
           ("all"); decode [batch, sequence, vocab]
           present.{i}.key / .value, same shape as the past buffer: the runtime binds one buffer to both.
Weights keep their Hugging Face parameter names, so the two graphs share them by name.
"""
from __future__ import annotations

import errno
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
import torch
from torch import nn

from compiler.errors import BuildError, exception_chain
from compiler.frontend.config import DecoderConfig
from compiler.frontend.model import Decoder
from compiler.recipe_checks import check_max_positions

PHASES = ("prefill", "decode")


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# The cache's element types: the export's float types, or int8 once quantize_kv_cache has run.
CACHE_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
                onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.INT8: "int8"}
CACHE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def cache_dtype(graphs: dict[str, onnx.ModelProto], exported: str) -> str:
    """The KV cache's element type after the passes: the decode graph's first past input's (else `exported`)."""
    decode = graphs.get("decode")
    for value in decode.graph.input if decode is not None else ():
        if value.name == past_name(0, "key"):
            return CACHE_DTYPES.get(value.type.tensor_type.elem_type, exported)
    return exported


def kv_cache_spec(config: DecoderConfig, max_context: int, dtype: str = "float32") -> dict:
    """The manifest's description of the cache buffers and which output aliases which input."""
    aliases = {present_name(i, kind): past_name(i, kind) for i in range(config.num_layers) for kind in ("key", "value")}
    return {
        "layout": ["batch", "kv_heads", "max_context", "head_dim"],
        "shape": ["batch", config.num_kv_heads, max_context, config.head_dim],
        "dtype": dtype,
        "num_layers": config.num_layers,
        "max_context": max_context,
        "bytes_per_token": config.kv_bytes_per_token * CACHE_ITEMSIZE[dtype] // 4,  # config counts float32
        "output_aliases_input": aliases,
    }


class PhaseGraph(nn.Module):
    """Flat tensor signature around `Decoder` for tracing: caches as key0, value0, key1, value1, ..."""

    def __init__(self, decoder: Decoder, phase: str, prefill_logits: str):
        super().__init__()
        self.decoder = decoder
        self.attend_to_cache = phase == "decode"
        self.logits = prefill_logits if phase == "prefill" else "all"

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.model.embed_tokens.weight.dtype

    def forward(self, input_ids, position_ids, attention_mask, *caches):
        logits, keys, values = self.decoder(
            input_ids, position_ids, attention_mask, caches[0::2], caches[1::2], self.attend_to_cache, self.logits
        )
        return (logits, *[t for pair in zip(keys, values) for t in pair])


def example_inputs(config: DecoderConfig, max_context: int, phase: str, batch: int = 2,
                   dtype: torch.dtype = torch.float32) -> tuple:
    # Sizes other than 1 where the cache allows (from max_context 3), so no exporter can mistake a dynamic axis
    # for a constant 1 (the axes are named dynamic too); and within the cache (a max_context of 2 to 6 wrote the
    # example past its rows).
    total = min(5 if phase == "prefill" else 7, max_context)
    sequence = total if phase == "prefill" else max(1, min(2, total - 1))
    start = total - sequence
    positions = torch.arange(start, total).expand(batch, sequence).contiguous()
    cache = torch.zeros(batch, config.num_kv_heads, max_context, config.head_dim, dtype=dtype)
    caches = [cache.clone() for _ in range(2 * config.num_layers)]
    return (torch.zeros(batch, sequence, dtype=torch.long), positions, torch.ones(batch, total, dtype=torch.long), *caches)


def io_names(config: DecoderConfig) -> tuple[list[str], list[str]]:
    kv = [(i, kind) for i in range(config.num_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "position_ids", "attention_mask"] + [past_name(i, k) for i, k in kv]
    outputs = ["logits"] + [present_name(i, k) for i, k in kv]
    return inputs, outputs


def _dynamic_axes(config: DecoderConfig, phase: str, prefill_logits: str) -> dict:
    inputs, outputs = io_names(config)
    # The mask's width is its own dimension in both graphs: the prefill graph also runs a chunk after cached tokens
    # (runtime: engines.prefill.takes_past), when the mask covers them too. Declared equal to the input's length, an
    # optimizer may take one's shape for the other's, and the chunk would be read as a first prompt.
    total = "total"
    last_only = phase == "prefill" and prefill_logits == "last"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "position_ids": {0: "batch", 1: "sequence"},
            "attention_mask": {0: "batch", 1: total},
            "logits": {0: "batch"} if last_only else {0: "batch", 1: "sequence"}}
    axes.update({name: {0: "batch"} for name in inputs[3:] + outputs[1:]})
    return axes


def trace_phase(decoder: Decoder, phase: str, max_context: int, opset: int, prefill_logits: str, folder: Path) -> Path:
    """Trace one phase with torch.onnx's TorchScript exporter into folder/<phase>.onnx; returns the path.

    Why not dynamo=True: on this 2-core machine it took ~150 s per graph for SmolLM2-135M against ~17 s here.
    The fusion passes match what this exporter emits (and a dynamo-style spelling where it differs).
    """
    config = decoder.config
    inputs, outputs = io_names(config)
    module = PhaseGraph(decoder, phase, prefill_logits).eval()
    axes = _dynamic_axes(config, phase, prefill_logits)
    path = Path(folder) / f"{phase}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                module, example_inputs(config, max_context, phase, dtype=module.dtype), str(path), dynamo=False, opset_version=opset,
                input_names=inputs, output_names=outputs, dynamic_axes=axes, do_constant_folding=True,
            )
        except Exception as error:  # the exporter's own errors are long; keep the first line and the phase
            full = next((e for e in exception_chain(error) if isinstance(e, OSError) and e.errno in DISK_FULL), None)
            if full is not None:  # the command's one line for a refused write, naming the folder that is full
                raise OSError(full.errno, full.strerror, f"{tempfile.gettempdir()}, the temporary folder where the "
                                                         f"{phase} graph is traced (TMPDIR)") from None
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if isinstance(error, MemoryError) or "can't allocate memory" in str(error):  # torch's allocator's words
                raise BuildError(f"export of the {phase} graph ran out of memory ({first_line[:200]}): {OUT_OF_MEMORY}") \
                    from error
            raise BuildError(f"export of the {phase} graph failed: {first_line}") from error
    return path


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: ulimit -f, or FAT32's 4 GiB file


# What a build that ran out of memory is told (also compiler/cli.py, for one that ran out elsewhere).
OUT_OF_MEMORY = ("a build holds about 3 to 5 times the model's float32 weights at its peak, a quantized one of a small "
                 "model up to 7 (README: \"Models of 2 GiB and more\"); free memory, or build on a machine with more")


def load_traced(path: Path, config: DecoderConfig) -> onnx.ModelProto:
    """A traced phase's graph read back, with Hugging Face weight names and a named, shared lm_head."""
    model = onnx.load(str(path), load_external_data=True)
    for initializer in model.graph.initializer:  # PhaseGraph's "decoder." prefix -> Hugging Face names
        initializer.name = initializer.name.removeprefix("decoder.")
    for node in model.graph.node:  # outputs too: the exporter shares equal weights through Identity nodes
        node.input[:] = [name.removeprefix("decoder.") for name in node.input]
        node.output[:] = [name.removeprefix("decoder.") for name in node.output]
    _drop_zero_lm_head_bias(model, config)
    _name_lm_head(model, config)
    model.graph.name = Path(path).stem  # lowering passes that differ by phase (lower_tensorrt's decode split) read it
    return model


def _name_lm_head(model: onnx.ModelProto, config: DecoderConfig) -> None:
    """Name the output projection /decoder/lm_head/...: the trace names it after the call site (/decoder/MatMul),
    and recipes select it by name (quantize's overrides and exclude, e.g. "*lm_head*")."""
    shapes = {(config.hidden_size, config.vocab_size), (config.vocab_size, config.hidden_size)}
    initializers = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for node in reversed(model.graph.node):  # the last product of the graph
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and initializers.get(node.input[1]) in shapes:
            node.name = f"/decoder/lm_head/{'Gemm_tied' if node.op_type == 'Gemm' else 'MatMul'}"
            return


def _drop_zero_lm_head_bias(model: onnx.ModelProto, config: DecoderConfig) -> None:
    """A tied lm_head is traced as Gemm(x, table, zeros, transB=1) (the decoder's forward says why): drop the zeros,
    and the Constant node that made them when nothing else reads it."""
    if not config.tie_word_embeddings:
        return
    constants = {node.output[0]: node for node in model.graph.node if node.op_type == "Constant" and node.output}
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) != 3 or node.input[1] != "model.embed_tokens.weight":
            continue
        bias = node.input[2]
        made_by = constants.get(bias)
        if made_by is not None:
            value = next((numpy_helper.to_array(a.t) for a in made_by.attribute if a.name == "value"), None)
        else:
            value = numpy_helper.to_array(initializers[bias]) if bias in initializers else None
        if value is None or value.shape != (config.vocab_size,) or np.any(value):
            continue
        del node.input[2]
        kept = [a for a in node.attribute if a.name not in ("alpha", "beta") or onnx.helper.get_attribute_value(a) != 1.0]
        del node.attribute[:]
        node.attribute.extend(kept)  # alpha 1 and beta (without a bias) say nothing: the traced lm_head's plain Gemm
        if not any(bias in other.input for other in model.graph.node):
            if made_by is not None:
                model.graph.node.remove(made_by)
            elif bias in initializers:
                model.graph.initializer.remove(initializers[bias])
        return


def export_graphs(decoder: Decoder, max_context: int, opset: int = 21, prefill_logits: str = "last",
                  progress=None, dtype: str = "float32") -> dict[str, onnx.ModelProto]:
    """Both phases' graphs; dtype float16/bfloat16 casts the decoder first, in place (weights, activations, KV cache;
    RMSNorm and the rotary angles are computed in float32 inside). TensorRT >= 11 takes precision from the
    graph's types (strong typing), so a float16 engine starts from a float16 graph."""
    with tempfile.TemporaryDirectory() as folder:
        paths = trace_graphs(decoder, max_context, Path(folder), opset, prefill_logits, progress, dtype)
        return {phase: load_traced(path, decoder.config) for phase, path in paths.items()}


def trace_graphs(decoder: Decoder, max_context: int, folder: Path, opset: int = 21, prefill_logits: str = "last",
                 progress=None, dtype: str = "float32") -> dict[str, Path]:
    """Both phases traced into files under folder, each phase in its own subfolder: export_graphs without reading
    them back, so that a caller can free the decoder first and never hold its weights beside the graphs' (the
    build's peak memory)."""
    if dtype not in DTYPES:
        raise BuildError(f"export.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    decoder = decoder.to(DTYPES[dtype])
    check_max_positions(decoder.config, max_context)
    paths = {}
    for phase in PHASES:
        if progress:
            progress(f"tracing the {phase} graph")
        # A folder each: the exporter may keep weights in side files named after the tensors (it did for a 1.5 GB
        # model), and the two graphs' files share names ("onnx__MatMul_607") but not contents.
        (Path(folder) / phase).mkdir()
        paths[phase] = trace_phase(decoder, phase, max_context, opset, prefill_logits, Path(folder) / phase)
    return paths
