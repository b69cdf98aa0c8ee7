"""Weight-only quantization of every MatMul (and tied lm_head Gemm) with a constant float weight.

    A ---> MatMul ---> Y        =>   A ---> MatMulNBits ---> Y                      (lowering: matmulnbits)
    W [K, N] --^                     A ---> MatMul <--- DequantizeLinear(codes, scales)  (lowering: dequantize_linear)

Methods (settings per layer: the pass's options, then the first `overrides` entry whose pattern matches):
  rtn   round to nearest, no data;
  awq   per-input-channel scales searched on calibration statistics (passes/quantize_algorithms.py), the 1/s
        folded into the op before the MatMuls that share the input (passes/awq_fold.py), then each block's
        range clipped to the ratio that minimises its output error (AWQ's auto-clip);
  gptq  rounding with error compensation from the calibration Hessian E[x xᵀ];
  awq_gptq  AWQ's scales and folds, then GPTQ's rounding of the scaled weights (the best of the four on the
        default model: benchmarks/RESULTS.md, "Quantization").
Every weight goes through the one representation (`passes.quantized_weights.QuantizedWeight`) and is then
lowered per backend: `com.microsoft.MatMulNBits` for onnxruntime, `DequantizeLinear` feeding MatMul for
TensorRT and plain ONNX (passes/quantized_lowering_*.py). INT4 uses blocks of `block_size` along K; INT8 is
per output channel. When the block size does not divide K the last block is partial: padded with zeros (the
report says so per layer), which MatMulNBits, DequantizeLinear and GatherBlockQuantized all accept.

The embedding table (a Gather on a constant) stays float unless `embedding: quantized`; onnxruntime then
reads it through `com.microsoft.GatherBlockQuantized`, sharing the tied lm_head's codes when the model ties
them (so the table is stored once, in 4 or 8 bits); a calibrated method then quantizes that shared table for
both uses (no AWQ input scales; GPTQ / clipping on E[x xᵀ] / mean(diag) + I, see quantize_target). The
DequantizeLinear lowering keeps the table float.

With calibration (method awq or gptq, or any method when a CalibrationSet is given) the report carries each
layer's relative output error on the calibration data, E||x ΔW||² / E||x W||², computed from E[x xᵀ].
"""
from __future__ import annotations

import hashlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Literal

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs

from passes.awq_fold import fold_awq_scales, graph_outputs, search_awq_scales
from passes.calibration import CalibrationSet, CalibrationSpec, Statistics, digest
from passes.errors import PassError
from passes.graph_export import export_onnx
from passes.graph_patterns import constant_type, uncached_values, unique_name
from passes.quantize_algorithms import quantize_clipped, quantize_gptq, relative_output_error
from passes.quantize_patterns import Product, packed_parts, pattern_problem
from passes.quantize_patterns import matches as pattern_matches
from passes.quantized_lowering_dq import rewrite_dequantize_linear
from passes.quantized_lowering_ort import (MICROSOFT_DOMAIN, for_matmulnbits, matmulnbits_constants,
                                           rewrite_gather_block_quantized, rewrite_matmulnbits)
from passes.quantized_weights import QuantizedWeight, dequantize, quantize_rtn
from passes.session_config import record_session_config

FLOAT_TYPES = (np.float32, np.float16, ml_dtypes.bfloat16)  # bfloat16: TensorRT graphs
Method = Literal["rtn", "awq", "gptq", "awq_gptq"]


@dataclass(frozen=True)
class Override:
    """Settings for the MatMuls whose node or weight name matches `pattern` (fnmatch); unset keys inherit."""
    pattern: str
    bits: Literal[4, 8] | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    method: Method | None = None
    skip: bool = False  # keep these layers float


OVERRIDABLE = ("bits", "block_size", "symmetric", "method")  # the settings an Override can give its layers


@dataclass(frozen=True)
class Options:
    bits: Literal[4, 8] = 4
    block_size: int = 32        # INT4 only; INT8 is per channel
    symmetric: bool = True      # INT4 only; INT8 is always symmetric
    method: Method = "rtn"
    calibration: CalibrationSpec | None = None  # needed by awq and gptq; the build resolves it into tokens
    overrides: tuple[Override, ...] = ()
    exclude: tuple[str, ...] = ()  # fnmatch patterns on the MatMul's node name or its weight's name
    embedding: Literal["float", "quantized"] = "float"
    lowering: Literal["matmulnbits", "dequantize_linear"] = "matmulnbits"
    accuracy_level: int = 0     # MatMulNBits' minimum compute precision (0 = unset, 4 = int8 activations)
    # MatMulNBits' block for INT8 per-channel weights (each channel's scale repeated per block: the same weights).
    # With accuracy_level 4 onnxruntime quantizes the activations per block of this length, so a smaller block is
    # more accurate. None: the largest power of two <= 256 dividing K (128 when none from 16 does), no larger than the
    # power of two that holds K (quantized_weights.kernel_block).
    int8_kernel_block: int | None = None
    gptq_act_order: bool = False  # gptq / awq_gptq: round channels by decreasing E[x²], block scales fixed first
    # Symmetric INT4 over all 16 codes (scale = the block's largest-magnitude value / -8, as onnxruntime quantizes)
    # rather than [-7, 7] with a positive scale. None: on for the MatMulNBits lowering; TensorRT's DequantizeLinear
    # needs strictly positive scales, so the dequantize_linear lowering refuses it.
    full_range: bool | None = None
    max_rewrites: int | None = None


@dataclass(frozen=True)
class Settings:
    bits: int
    block_size: int
    symmetric: bool
    method: str
    full_range: bool = False  # symmetric INT4 only: all 16 codes, signed scales (block_parameters)


@dataclass
class Target:
    """One quantizable node: a MatMul, or a Gemm(A, B, transB=1) that is a (tied) lm_head."""
    node: gs.Node
    constant: gs.Constant
    settings: Settings
    input_name: str = ""  # the activation as calibrated, before any AWQ Mul is inserted in front of the node
    note: str = ""
    input_scales: np.ndarray | None = None  # AWQ's s: the node reads x / s and quantizes diag(s) W
    scaling: str = ""
    shared_table: bool = False  # a tied lm_head whose table the quantized embedding gathers too
    layer: str = ""  # the node's name (or output's): the same in both phases' graphs, unlike their weights' names

    @property
    def activation(self) -> gs.Variable:
        return self.node.inputs[0]

    @property
    def weight(self) -> np.ndarray:
        """[K, N], as MatMul's B."""
        values = uncached_values(self.constant)  # read each time, not kept in the constant to the pass's end
        return values.T if self.node.op == "Gemm" else values


# -- options and settings ---------------------------------------------------------------------------------
MAX_BLOCK = 256  # the largest block MatMulNBits' CPU kernels are built for


def check_settings(settings: Settings | Options, where: str = "quantize") -> None:
    if settings.bits not in (4, 8):
        raise PassError(f"{where}: bits={settings.bits} is not supported; choose 4 (blocked) or 8 (per channel)")
    size = settings.block_size
    if settings.bits == 4 and (size < 16 or size > MAX_BLOCK or size & (size - 1)):
        raise PassError(f"{where}: block_size={size}: MatMulNBits needs a power of two from 16 to {MAX_BLOCK} "
                        f"(e.g. 32, 64, 128)")


def check_int8_options(bits: int, block_size: int | None, symmetric: bool | None, where: str) -> None:
    """INT8 here is one symmetric scale per output channel: a block size or zero points would be dropped unsaid."""
    if bits != 8:
        return
    if block_size is not None:
        raise PassError(f"{where}: block_size={block_size} with bits=8: INT8 has one scale per output channel, no "
                        f"blocks; drop block_size (int8_kernel_block sets how finely MatMulNBits rounds activations)")
    if symmetric is False:
        raise PassError(f"{where}: symmetric=false with bits=8: INT8 is symmetric per output channel (no zero "
                        f"points); drop symmetric, or use bits=4 for zero points")


def check_options(options: Options) -> None:
    check_settings(options)
    check_int8_options(options.bits, None if options.block_size == Options.block_size else options.block_size,
                       options.symmetric, "quantize")
    if options.accuracy_level not in (0, 1, 2, 3, 4):
        raise PassError(f"quantize: accuracy_level={options.accuracy_level}: MatMulNBits takes 0 (unset), 1 (fp32), "
                        f"2 (fp16), 3 (bf16) or 4 (int8 activations)")
    if options.max_rewrites is not None and options.max_rewrites < 0:
        raise PassError(f"quantize: max_rewrites={options.max_rewrites} must be >= 0")
    if options.full_range and options.lowering == "dequantize_linear":
        raise PassError("quantize: full_range: true needs negative scales, which TensorRT's DequantizeLinear refuses "
                        "(strictly positive scales only); drop full_range or use lowering: matmulnbits")
    block = options.int8_kernel_block
    if block is not None and (block < 16 or block > MAX_BLOCK or block & (block - 1)):
        raise PassError(f"quantize: int8_kernel_block={block}: MatMulNBits needs a power of two from 16 to "
                        f"{MAX_BLOCK} (e.g. 32)")
    layer_settings = [base_settings(options)]
    for index, override in enumerate(options.overrides):
        merged = settings_with(base_settings(options), override, full_range_wanted(options))
        where = f"quantize: overrides[{index}] ({override.pattern!r})"
        if not override.skip and all(getattr(override, key) is None for key in OVERRIDABLE):
            raise PassError(f"{where} sets nothing: give bits, block_size, symmetric or method, or skip: true")
        given = [key for key in OVERRIDABLE if getattr(override, key) is not None]
        if override.skip and given:  # they were dropped unsaid: the layers stay float
            raise PassError(f"{where}: skip: true keeps these layers float, so {', '.join(given)} would do nothing; "
                            f"drop {'it' if len(given) == 1 else 'them'}, or drop skip to quantize them so")
        check_settings(merged, where)
        check_int8_options(merged.bits, override.block_size, override.symmetric, where)
        if not override.skip:
            layer_settings.append(merged)
    check_options_used(options, layer_settings)
    needs_data = sorted(methods_used(options) - {"rtn"})
    if needs_data and options.calibration is None:  # before the export, not when the pass meets it
        raise PassError(f"quantize: method {', '.join(needs_data)} needs calibration data: set `calibration` (text, "
                        f"samples, length, seed) in the recipe; the build tokenizes it")


def methods_used(options: Options) -> set[str]:
    """The methods the pass's layers may use: its own, and its overrides' (those that quantize)."""
    return {options.method, *(o.method for o in options.overrides if o.method is not None and not o.skip)}


def check_options_used(options: Options, layer_settings: list[Settings]) -> None:
    """Options that no layer's settings use would be dropped unsaid, as a pattern that matches nothing would be."""
    if options.full_range and not any(settings.full_range for settings in layer_settings):
        raise PassError("quantize: full_range: true applies to symmetric INT4 only, and no layer is symmetric INT4 "
                        "(bits=8 or symmetric=false); drop full_range")
    if options.gptq_act_order and not any(s.method in ("gptq", "awq_gptq") for s in layer_settings):
        raise PassError("quantize: gptq_act_order: true applies to method gptq or awq_gptq, and no layer uses them; "
                        "drop gptq_act_order or set method")
    if options.int8_kernel_block is not None and options.lowering != "matmulnbits":
        raise PassError(f"quantize: int8_kernel_block sets MatMulNBits' blocks, and lowering {options.lowering} keeps "
                        f"INT8 per channel (DequantizeLinear); drop int8_kernel_block")
    if options.int8_kernel_block is not None and not any(settings.bits == 8 for settings in layer_settings):
        raise PassError(f"quantize: int8_kernel_block applies to INT8 layers, and every layer is INT4 (its "
                        f"block_size, {options.block_size}, sets its blocks); drop int8_kernel_block")


def full_range_wanted(options: Options) -> bool:
    return options.lowering == "matmulnbits" if options.full_range is None else options.full_range


def base_settings(options: Options) -> Settings:
    return with_full_range(Settings(options.bits, options.block_size, options.symmetric or options.bits == 8,
                                    options.method), full_range_wanted(options))


def settings_with(settings: Settings, override: Override, full_range: bool) -> Settings:
    changes = {name: getattr(override, name) for name in OVERRIDABLE if getattr(override, name) is not None}
    merged = replace(settings, **changes)
    return with_full_range(replace(merged, symmetric=merged.symmetric or merged.bits == 8), full_range)  # INT8: symmetric


def with_full_range(settings: Settings, wanted: bool) -> Settings:
    """full_range applies to symmetric INT4 (INT8 per channel has 255 of 256 levels already)."""
    return replace(settings, full_range=wanted and settings.bits == 4 and settings.symmetric)


def block_size_for(settings: Settings, k: int) -> int:
    """INT8: per channel (one block of K). INT4: the recipe's block, but no larger than the power of two that holds
    K (a block of 128 over K = 64 would pad every column to twice its codes, for the same grid)."""
    return k if settings.bits == 8 else min(settings.block_size, max(16, 1 << (k - 1).bit_length()))


def product_of(node: gs.Node) -> Product:
    """The node as the patterns see it (passes/quantize_patterns.py): its name, its weight's where the model named
    it, and a packed node's parts."""
    weight = node.inputs[1].name if len(node.inputs) > 1 else ""
    names = (node.name, weight) if weight and not weight.startswith("onnx::") else (node.name,)
    return Product(names, packed_parts(node.name))


def matches(pattern: str, node: gs.Node) -> bool:
    return pattern_matches(pattern, product_of(node))


def check_patterns(candidates: list[gs.Node], options: Options) -> None:
    """A pattern that matches nothing is a typo or a stale recipe; silently applying the defaults would hide it. One
    that names some of a packed MatMul's parts would set the others too (or, missing its name, nothing at all)."""
    problem = pattern_problem([product_of(node) for node in candidates], tuple(options.exclude),
                              tuple(o.pattern for o in options.overrides))
    if problem:
        raise PassError(f"quantize: {problem}")


# -- finding targets ---------------------------------------------------------------------------------------
def weight_of(node: gs.Node) -> gs.Constant | str:
    """The node's constant float weight, or why it has none usable."""
    if node.op == "Gemm":
        attrs = node.attrs
        if len(node.inputs) != 2 or attrs.get("transB", 0) != 1 or attrs.get("transA", 0) != 0 \
                or attrs.get("alpha", 1.0) != 1.0:
            return "Gemm is not A @ Bᵀ without bias"
    weight = node.inputs[1]
    if not isinstance(weight, gs.Constant):
        return "B is not a constant weight"
    ndim, dtype = len(weight.shape), constant_type(weight)
    if ndim != 2 or dtype.type not in FLOAT_TYPES:
        return f"B is {ndim}-D {dtype}, not a 2-D float weight"
    activation = node.inputs[0]
    if activation.shape is not None and len(activation.shape) < 2:
        return "A is 1-D; MatMulNBits needs A of rank >= 2"
    return weight


def settings_for(node: gs.Node, options: Options) -> Settings | str:
    pattern = next((p for p in options.exclude if matches(p, node)), None)
    if pattern:
        return f"excluded by pattern {pattern!r}"
    settings = base_settings(options)
    override = next((o for o in options.overrides if matches(o.pattern, node)), None)
    if override is not None:
        if override.skip:
            return f"kept float by override {override.pattern!r}"
        settings = settings_with(settings, override, full_range_wanted(options))
    return settings


def find_targets(graph: gs.Graph, options: Options) -> tuple[list[Target], list[dict]]:
    candidates = [n for n in graph.nodes if n.op in ("MatMul", "Gemm")]
    check_patterns(candidates, options)
    targets, skipped = [], []
    for node in candidates:
        weight = weight_of(node)
        settings = settings_for(node, options) if isinstance(weight, gs.Constant) else weight
        if isinstance(settings, Settings):
            k = weight.shape[1 if node.op == "Gemm" else 0]
            block_size = block_size_for(settings, k)
        if isinstance(settings, str):
            skipped.append({"node": node.name, "reason": settings})
            continue
        if options.max_rewrites is not None and len(targets) >= options.max_rewrites:
            skipped.append({"node": node.name, "reason": f"max_rewrites={options.max_rewrites}"})
            continue
        target = Target(node, weight, replace(settings, block_size=block_size), input_name=node.inputs[0].name,
                        layer=node.name or node.outputs[0].name)
        if block_size < settings.block_size and settings.bits == 4:
            target.note = f"block_size {settings.block_size} > K={k}: one block of {block_size}"
        if k % block_size:
            blocks = -(-k // block_size)
            padded = f"K={k} padded to {blocks} blocks of {block_size} (the last holds {k % block_size} values)"
            target.note = "; ".join(filter(None, [target.note, padded]))
        # (Only where the table is quantized: the dequantize_linear lowering keeps it float, quantize_embedding.)
        if options.embedding == "quantized" and options.lowering == "matmulnbits" \
                and any(c.op == "Gather" for c in weight.outputs) and settings.method != "rtn":
            # The table is also gathered as the embedding: no input scales (the gather could not undo them), and
            # the codes must fit a row lookup as well as the lm_head's inputs (quantize_target, shared_table).
            target.shared_table = True
            shared = (f"{settings.method} without input scales, on E[x xᵀ] / mean(diag) + I: the weight is the "
                      f"quantized embedding table too, whose rows' own error counts as much as lm_head's output's")
            target.note = "; ".join(filter(None, [target.note, shared]))  # a padded K's note too
        targets.append(target)
    return targets, skipped


# -- calibration -------------------------------------------------------------------------------------------
def quantize_target(target: Target, statistics: Statistics, memo: dict,
                    act_order: bool = False) -> tuple[QuantizedWeight, float | None]:
    """The target's quantized weight and its relative output error (None without calibration data).
    act_order: Options.gptq_act_order, for gptq / awq_gptq."""
    settings = target.settings
    weight = target.weight.astype(np.float32)
    scales = target.input_scales
    # The layer is in the key: two layers with equal weights (a depth-upscaled model) see different inputs, so
    # GPTQ's Hessian and the reported error are their own. The phases share results through the layer's name.
    key = ("weight", target.layer, settings, act_order, target.shared_table, digest(weight),
           None if scales is None else digest(scales))
    if key not in memo:
        stats = statistics(target)
        scaled = weight if scales is None else weight * scales[:, None]
        # A scaled weight sees inputs x / s: E[(x/s)(x/s)ᵀ] = H / (s sᵀ).
        hessian = None if stats is None else stats.hessian if scales is None else stats.hessian / np.outer(scales, scales)
        if target.shared_table and hessian is not None:
            # Rows are also looked up as embeddings, whose error is the row's own ‖Δ‖²: weigh that (I) as much as
            # the lm_head's output error, H normalised to a unit mean diagonal.
            hessian = hessian / np.mean(np.diag(hessian)) + np.eye(len(hessian))
        if settings.method in ("gptq", "awq_gptq"):
            qw = quantize_gptq(scaled, hessian, settings.bits, settings.block_size, settings.symmetric,
                               act_order=act_order, full_range=settings.full_range)
        elif settings.method == "awq":
            qw = quantize_clipped(scaled, hessian, settings.bits, settings.block_size, settings.symmetric,
                                  settings.full_range)
        else:
            qw = quantize_rtn(scaled, settings.bits, settings.block_size, settings.symmetric, settings.full_range)
        error = None
        if stats is not None:
            effective = dequantize(qw) if scales is None else dequantize(qw) / scales[:, None]
            error = relative_output_error(weight, effective, stats.hessian)
        memo[key] = qw, error
    return memo[key]


# -- the pass ------------------------------------------------------------------------------------------------
GPTQ_TOKENS_PER_INPUT = 4  # calibration tokens per input channel below which GPTQ is warned of (see below)


def too_few_tokens_for_gptq(targets, calibration) -> str | None:
    """GPTQ on too few calibration tokens fits them, not the model: with fewer tokens than input channels E[x xᵀ]
    is singular, and a review's layer of 256 inputs had 0.02x round to nearest's output error on 16 calibration
    tokens but 1.36x on held-out ones (1.02x at 256 tokens, 0.59x at 4,096; GPTQ's paper calibrates on 128 x 2048).
    The per-layer error the report gives is measured on the calibration tokens and cannot show it."""
    inputs = [t.weight.shape[0] for t in targets if "gptq" in t.settings.method]
    if not inputs or calibration is None or calibration.token_ids is None:
        return None
    tokens, widest = int(calibration.token_ids.size), max(inputs)
    if tokens >= GPTQ_TOKENS_PER_INPUT * widest:
        return None
    return (f"quantize: GPTQ calibrates on {tokens:,} tokens for inputs of up to {widest:,} channels: it can fit those "
            f"tokens rather than the model, and do worse than round to nearest on other text (the per-layer errors "
            f"are measured on the calibration tokens); give at least {GPTQ_TOKENS_PER_INPUT * widest:,} "
            f"(calibration.samples x calibration.length)")


def run(model: onnx.ModelProto, options: Options) -> tuple[onnx.ModelProto, dict]:
    check_options(options)
    graph = gs.import_onnx(model)
    graph.import_domains = [onnx.helper.make_opsetid(o.domain, o.version) for o in model.opset_import]  # keep input intact
    quantized = [n for n in graph.nodes if n.op in ("MatMulNBits", "DequantizeLinear", "GatherBlockQuantized")]
    if quantized:  # a second run would find no float weight and quietly quantize nothing
        kinds = ", ".join(f"{count} {kind}" for kind, count in Counter(n.op for n in quantized).items())
        raise PassError(f"quantize: the graph's weights are already quantized ({kinds} nodes, e.g. "
                        f"{quantized[0].name}); list quantize once in the recipe and give layers other "
                        f"bits with `overrides`")
    targets, skipped = find_targets(graph, options)
    calibration = options.calibration if isinstance(options.calibration, CalibrationSet) else None
    needs_data = sorted({t.settings.method for t in targets} - {"rtn"})
    if needs_data and calibration is None:
        raise PassError(f"quantize: method {', '.join(needs_data)} needs calibration data: set `calibration` "
                        f"(text, samples, length, seed) in the recipe; the build tokenizes it"
                        if options.calibration is None else
                        f"quantize: method {', '.join(needs_data)} got a CalibrationSpec, not tokens: run it "
                        f"through the build, or pass a passes.calibration.CalibrationSet")
    memo = calibration.memo if calibration is not None else {}
    warning = too_few_tokens_for_gptq(targets, calibration)
    if warning and calibration.progress is not None:  # the build's progress lines
        calibration.say(f"warning: {warning}")
    elif warning:  # the Python API without a progress callback
        warnings.warn(warning, stacklevel=2)
    statistics = Statistics(model, targets, calibration)
    search_awq_scales(targets, statistics, memo, graph_outputs(graph))
    fold_awq_scales(graph, targets)

    layers, lowered_ort, lowered_dq, names_dq, names = [], {}, {}, {}, set()
    say = calibration.say if calibration is not None else (lambda message: None)
    computed = len(memo)
    for index, target in enumerate(targets, 1):
        qw, error = quantize_target(target, statistics, memo, options.gptq_act_order)
        # progress where weights were quantized here, not where the other phase's results came from the memo
        if (index == len(targets) or index % max(1, len(targets) // 8) == 0) and len(memo) > computed:
            say(f"quantize: {index}/{len(targets)} weights ({target.settings.method})")
            computed = len(memo)
        dtype = constant_type(target.constant)
        activation = target.activation
        # Nodes whose quantized weights are equal share one set of constants (stored once, counted at the first);
        # a float weight quantized two ways (an override, each layer's own GPTQ Hessian or AWQ scales) gets two,
        # named apart: under one name graphsurgeon would keep one of them.
        content = digest_quantized(qw)
        if options.lowering == "matmulnbits":
            bytes_after = 0
            if content not in lowered_ort:
                layout = for_matmulnbits(qw, options.int8_kernel_block)
                name = unique_name(target.constant.name, names)
                lowered_ort[content] = layout, matmulnbits_constants(name, layout, dtype)
                bytes_after = sum(int(c.values.nbytes) for c in lowered_ort[content][1])
            layout, constants = lowered_ort[content]
            rewrite_matmulnbits(graph, target.node, activation, layout, constants, options.accuracy_level)
            kernel_block = layout.block_size
        else:
            matmul = as_matmul(graph, target)
            if content not in names_dq:
                settings = target.settings
                names_dq[content] = unique_name(f"{target.constant.name}_{settings.method}_b{qw.block_size}"
                                                f"{'s' if settings.symmetric else 'a'}", names)
            bytes_after = rewrite_dequantize_linear(graph, matmul, qw, names_dq[content], dtype, lowered_dq)
            kernel_block = None
        layers.append({"node": target.node.name, "method": target.settings.method, "bits": qw.bits,
                       "bytes_before": math.prod(target.constant.shape) * dtype.itemsize, "bytes_after": bytes_after,
                       # block_size: the quantization's grid (INT8 per channel: K); kernel_block: MatMulNBits' blocks,
                       # which repeat a channel's scale (None: DequantizeLinear's per-axis form)
                       "block_size": qw.block_size, "kernel_block": kernel_block, "symmetric": qw.zero_points is None,
                       "full_range": target.settings.full_range,
                       "relative_output_error": error, "awq": target.scaling or None, "note": target.note or None,
                       "max_abs_weight_error": float(np.abs(scaled_back(target, qw) - target.weight).max())})
    embedding = quantize_embedding(graph, targets, options, memo)
    if (layers or embedding.get("quantized")) and options.lowering == "matmulnbits" \
            and not any(o.domain == MICROSOFT_DOMAIN for o in graph.import_domains):
        graph.import_domains.append(onnx.helper.make_opsetid(MICROSOFT_DOMAIN, 1))
    graph.cleanup().toposort()
    result = export_onnx(graph)
    errors = [layer["relative_output_error"] for layer in layers if layer["relative_output_error"] is not None]
    totals = {"weight_bytes_before": sum(layer["bytes_before"] for layer in layers),
              "weight_bytes_after": sum(layer["bytes_after"] for layer in layers),
              "graph_bytes_before": unique_initializer_bytes(model),  # everything stored, float tables included
              "graph_bytes_after": unique_initializer_bytes(result),
              "quantized": len(layers), "skipped": len(skipped),
              "mean_relative_output_error": float(np.mean(errors)) if errors else None,
              "max_relative_output_error": float(np.max(errors)) if errors else None}
    report = {"layers": layers, "skipped": skipped, "embedding": embedding, "totals": totals,
              "warnings": [warning] if warning else []}  # in the manifest's pass reports, for `aotlm inspect`
    if layers and options.lowering == "dequantize_linear":
        # onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits, by default at accuracy level 4 (int8
        # activations, ~0.6% off the float product the graph says): the recipe's level instead, 0 (float) unless set
        report["session_config"] = record_session_config(
            result, model, {"session.qdq_matmulnbits_accuracy_level": str(options.accuracy_level)})
    if calibration is not None:
        report["calibration"] = calibration.describe()
    return result, report


def scaled_back(target: Target, qw: QuantizedWeight) -> np.ndarray:
    weight = dequantize(qw)
    return weight if target.input_scales is None else weight / target.input_scales[:, None]


def as_matmul(graph: gs.Graph, target: Target) -> gs.Node:
    """A Gemm(A, B, transB=1) target as MatMul(A, Bᵀ), the form DequantizeLinear feeds."""
    if target.node.op == "MatMul":
        return target.node
    gemm = target.node
    output = gemm.outputs[0]
    gemm.outputs.clear()
    transposed = gs.Constant(f"{target.constant.name}_transposed", np.ascontiguousarray(target.weight))
    matmul = gs.Node("MatMul", name=f"{gemm.name}_matmul", inputs=[target.activation, transposed], outputs=[output])
    gemm.inputs.clear()
    graph.nodes.append(matmul)
    return matmul


def quantize_embedding(graph: gs.Graph, targets: list[Target], options: Options, memo: dict) -> dict:
    # Rows of a constant float table (axis 0: GatherBlockQuantized's gather_axis), the one reading input_ids first: an
    # imported graph may gather from other tables too (positions, a cos/sin cache), or along another axis
    gathers = [n for n in graph.nodes if n.op == "Gather" and isinstance(n.inputs[0], gs.Constant)
               and len(n.inputs[0].shape) == 2 and constant_type(n.inputs[0]).type in FLOAT_TYPES
               and n.attrs.get("axis", 0) == 0]
    if not gathers:
        return {"quantized": False, "reason": "no Gather of rows from a constant float table"}
    gather = next((n for n in gathers if n.inputs[1].name == "input_ids"), gathers[0])
    table = gather.inputs[0]
    if options.embedding == "float":
        return {"quantized": False, "node": gather.name, "reason": "embedding: float (the recipe's choice)"}
    if options.lowering != "matmulnbits":
        return {"quantized": False, "node": gather.name,
                "reason": "the dequantize_linear lowering keeps the table float (no quantized-gather kernel)"}
    tied = next((t for t in targets if t.constant is table and t.node.op == "Gemm"), None)
    settings = tied.settings if tied else replace(base_settings(options), method="rtn")
    hidden = table.shape[1]
    if hidden * settings.bits % 8:
        return {"quantized": False, "node": gather.name,
                "reason": f"hidden size {hidden} x {settings.bits} bits is not whole bytes per row"}
    if tied:
        qw, _ = quantize_target(tied, lambda _: None, memo, options.gptq_act_order)  # a memo hit: lm_head's codes
    else:
        qw = quantize_rtn(uncached_values(table).T.astype(np.float32), settings.bits, block_size_for(settings, hidden),
                          settings.symmetric, settings.full_range)
    qw = for_matmulnbits(qw, options.int8_kernel_block)  # the same blocks as the tied lm_head: its bytes, shared
    rewrite_gather_block_quantized(graph, gather, qw, constant_type(table))
    return {"quantized": True, "node": gather.name, "kernel": "com.microsoft.GatherBlockQuantized",
            "bits": qw.bits, "block_size": qw.block_size,  # the kernel's blocks (INT8: per row, its scale repeated)
            "per_channel": settings.bits == 8, "shares_codes_with": tied.node.name if tied else None}


def digest_quantized(qw: QuantizedWeight) -> str:
    zero_points = () if qw.zero_points is None else (qw.zero_points,)
    return digest(qw.codes, qw.scales, *zero_points, np.array([qw.bits, qw.block_size, qw.k, qw.n]))


def unique_initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the graph's initializers, each distinct content once (as the artifact writer stores them)."""
    seen = set()
    total = 0
    for tensor in model.graph.initializer:
        data = tensor.raw_data or onnx.numpy_helper.to_array(tensor).tobytes()
        key = hashlib.sha1(data).hexdigest()
        if key not in seen:
            seen.add(key)
            total += len(data)
    return total
