"""The passes' reports as a person reads them after a build (`aotlm build`, `aotlm inspect`): a table of each pass's
time and node counts, a line for each listed pass that changed nothing, and the accuracy report's lines. Imports
nothing heavy (no onnx): `aotlm inspect` runs where only the runtime is installed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PHASES_OPTION = "(its phases option)"  # the reason given for a phase a pass skips by its `phases` option


@dataclass
class PassResult:
    name: str
    phase: str
    seconds: float
    report: dict
    nodes_before: int = 0
    nodes_after: int = 0
    index: int | None = None  # its place in the recipe's passes (None: a manifest from before it was recorded)


# What each pass counts as its work, read from its report; cleanup always has some. A pass that did none in every phase
# it ran on is named (idle_passes): its node counts alone cannot tell "nothing to do" from "done".
WORK = {
    "fuse_attention": lambda r: r.get("fused", 0),
    "fuse_rotary": lambda r: r.get("rewrites", 0),
    "fuse_rms_norm": lambda r: r.get("fused", 0) + r.get("fused_with_skip", 0),
    "fuse_silu": lambda r: r.get("fused", 0),
    "lower_onnxruntime": lambda r: r.get("lowered", 0),
    "lower_onnx_attention": lambda r: r.get("lowered", 0),
    "lower_tensorrt": lambda r: r.get("lowered", 0),
    "pack_projections": lambda r: len(r.get("packed", ())),
    "quantize": lambda r: r.get("totals", {}).get("quantized", 0) + bool(r.get("embedding", {}).get("quantized")),
    "quantize_kv_cache": lambda r: r.get("quantized_layers", 0),
    "skip_unused_rows": lambda r: bool(r.get("applied")),
    "slice_packed_weights": lambda r: bool(r.get("applied")),
    "dequantize_weights": lambda r: bool(r.get("applied")),
}
NOTHING_TO_LOWER = "no aotlm.FlashAttention node left to lower (none fused before it, or an earlier lowering took them)"
IDLE_HINTS = {  # why a pass with no reason of its own found nothing
    "fuse_attention": "no attention block left to match (an earlier fuse_attention fused them)",
    "lower_onnxruntime": NOTHING_TO_LOWER,
    "lower_onnx_attention": NOTHING_TO_LOWER,
    "lower_tensorrt": NOTHING_TO_LOWER,
    "pack_projections": "no projections sharing an input with float weights",
    "quantize_kv_cache": "no GroupQueryAttention layer",
    "fuse_rms_norm": "no RMSNorm left to fuse (an earlier fuse_rms_norm took them, or the graph has none)",
    "fuse_silu": "no x * Sigmoid(x) left to fuse (an earlier fuse_silu took them, or the graph has none)",
    "fuse_rotary": "no rotary embedding left to fuse (fuse_attention folded it into the fused nodes, or an earlier "
                   "fuse_rotary took them)",
}


def idle_passes(results: Sequence[PassResult]) -> list[str]:
    """A line for each listed pass that changed nothing in any phase it ran on, with the first reason its reports
    give (their layers' or skipped entries'), so that a build does not pass one by in silence."""
    runs: dict[tuple, list[PassResult]] = {}
    for result in results:
        runs.setdefault((result.index, result.name), []).append(result)
    lines = []
    for (index, name), ran in runs.items():
        ran = [r for r in ran if not str(r.report.get("reason") or "").endswith(PHASES_OPTION)]
        if name not in WORK or not ran or any(WORK[name](r.report) for r in ran):
            continue
        reasons = [_first_reason(r.report) for r in ran]
        reason = next((text for text in reasons if text), IDLE_HINTS.get(name))
        where = f"passes[{index}] ({name})" if index is not None else name
        phases = ", ".join(r.phase for r in ran)
        lines.append(f"{where} changed nothing in {phases}" + (f": {reason}" if reason else ""))
    return lines


def partly_fused(results: Sequence[PassResult]) -> list[str]:
    """A line for each phase where fuse_attention fused some attention blocks and left others (a build without
    `required: true` goes on; those layers run unfused, slower), naming the first left and why."""
    lines = []
    for result in results:
        report = result.report
        if result.name != "fuse_attention" or not report.get("fused") or not report.get("unfused"):
            continue
        first = next((layer for layer in report.get("layers", ()) if not layer.get("fused")), {})
        where = f"passes[{result.index}] (fuse_attention)" if result.index is not None else "fuse_attention"
        total = report["fused"] + report["unfused"]
        lines.append(f"{where} left {report['unfused']} of {total} attention blocks unfused in {result.phase}; first: "
                     f"{first.get('layer', '?')}: {first.get('reason', 'no reason given')} (`required: true` makes "
                     f"this an error)")
    return lines


def _first_reason(report: dict) -> str | None:
    if report.get("reason"):
        return str(report["reason"])
    for key in ("layers", "skipped", "kept"):
        entries = report.get(key)
        if isinstance(entries, list):
            found = next((e for e in entries if isinstance(e, dict) and e.get("reason")), None)
            if found is not None:
                return f"{found.get('layer') or found.get('node') or ''}: {found['reason']}".lstrip(": ")
    return None


def format_reports(results: Sequence[PassResult]) -> str:
    """A short table: one line per (pass, phase) with its time and node counts before -> after."""
    rows = [("pass", "phase", "seconds", "nodes")]
    rows += [(result.name, result.phase, f"{result.seconds:.2f}", f"{result.nodes_before} -> {result.nodes_after}")
             for result in results]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    lines = []
    for row in rows:
        # Text columns left-aligned, numbers right-aligned.
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]), row[3].rjust(widths[3])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _figure(value: float | None, spec: str) -> str:
    """A report's number; null in a manifest is one past a float's range (JSON has no infinity: a broken build's
    perplexity, past 1e308), read "inf"."""
    return "inf" if value is None else format(value, spec)


FEW_HELD_OUT_TOKENS = 256  # below this the held-out figures are warned of as noise


def format_accuracy(accuracy: dict) -> str:
    """The console lines a person reads before deploying."""
    lines = []
    totals = accuracy.get("quantization", {}).get("totals")
    if totals:
        lines.append(f"quantized {totals['quantized']} MatMuls ({totals['skipped']} skipped): weights "
                     f"{totals['weight_bytes_before'] / 2**20:.1f} MiB -> {totals['weight_bytes_after'] / 2**20:.1f} MiB; "
                     f"graph {totals['graph_bytes_before'] / 2**20:.1f} MiB -> {totals['graph_bytes_after'] / 2**20:.1f} MiB")
        if totals.get("mean_relative_output_error") is not None:
            # the weights' rounding alone: MatMulNBits' int8 activations (accuracy_level 4) round each layer's input
            # too (for INT8 layers 1.6-4x this figure, a review), which the held-out figures below include
            lines.append(f"layer output error of the weights on calibration data (E||xΔW||²/E||xW||², the weights' "
                         f"rounding alone): mean {totals['mean_relative_output_error']:.2e}, max "
                         f"{totals['max_relative_output_error']:.2e}")
        elif totals["quantized"]:
            lines.append("layer output error: not measured (round to nearest without calibration data; add "
                         "quantize.calibration to the recipe to measure it)")
        worst = [layer for layer in accuracy["quantization"].get("worst_layers", ())
                 if layer.get("relative_output_error") is not None][:3]
        if worst:  # every layer's error is in the manifest (its quantize pass reports)
            lines.append("worst layers: " + ", ".join(
                f"{layer['node']} {layer['relative_output_error']:.2e} ({layer['method']} int{layer['bits']}"
                + (f" block {layer['block_size']}" if layer['bits'] == 4 else "") + ")" for layer in worst))
        padded = accuracy["quantization"].get("padded_layers")
        if padded:  # a block size that does not divide K: padded with the code of 0, never refused
            layers = "1 quantized layer" if len(padded) == 1 else f"{len(padded)} quantized layers"
            lines.append(f"note: in {layers} the block size does not divide the input size: the last block is padded "
                         f"with zeros (e.g. {padded[0]['node']}: {padded[0]['note']}; all in the manifest)")
    kv_cache = accuracy.get("quantization", {}).get("kv_cache")
    if kv_cache:
        lines.append(f"KV cache stored as {kv_cache['dtype']} ({kv_cache['granularity']} scales, "
                     f"{kv_cache['quantized_layers']} layers): relative round-off on calibration data, keys "
                     f"{kv_cache['relative_error']['key_mean']:.2e}, values {kv_cache['relative_error']['value_mean']:.2e}")
    held_out = accuracy.get("held_out")
    if held_out:
        lines.append(f"held-out text: {held_out['text']}, {held_out['tokens_scored']} tokens scored "
                     f"(window {held_out['window']}, stride {held_out['stride']})")
        if held_out["tokens_scored"] < FEW_HELD_OUT_TOKENS:
            lines.append(f"warning: only {held_out['tokens_scored']} held-out tokens scored: the perplexity, top-1 and "
                         f"KL below are noise at that size; raise accuracy.max_tokens or give a longer calibration "
                         f"text")
        lines.append(f"perplexity: float {_figure(held_out['reference_perplexity'], '.3f')} -> quantized "
                     f"{_figure(held_out['perplexity'], '.3f')} ({_figure(held_out['perplexity_increase'], '+.2%')}); "
                     f"top-1 agreement {100 * held_out['top1_agreement']:.2f}%; mean KL(float || quantized) "
                     f"{_figure(held_out['mean_kl'], '.3g')} nats")
        if held_out.get("max_context", 0) > held_out["window"]:  # an int8 cache's keys clipped past position 1024
            lines.append(f"note: positions {held_out['window']} to {held_out['max_context'] - 1} of the context are "
                         f"not scored here: set accuracy.window: {held_out['max_context']} in the recipe to score them "
                         f"(a longer window lowers both perplexities: compare the two, not with this report's)")
        if held_out.get("repeats_calibration_from") is not None:
            lines.append(f"warning: the held-out text repeats the calibration text from its token "
                         f"{held_out['repeats_calibration_from']} on")
    return "\n".join(lines)
