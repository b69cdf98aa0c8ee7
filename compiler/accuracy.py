"""The build's accuracy report for quantized recipes: the quantized engine against the float graph it came from.

The float reference is the decode graph as it was just before the first quantize pass (fusions applied, so
the two differ only by quantization). Both run through the runtime's onnxruntime backend and its evaluation
(`runtime.evaluate`), on the held-out part of the calibration text, so the perplexity in the manifest is the
one `aotlm eval` prints for the same text, window and stride. Per-layer output errors come from the quantize
pass's own report (measured on the calibration data).
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from tokenizers import Tokenizer

from compiler.artifact import scratch_folder
from compiler.backends import onnxruntime as onnxruntime_backend
from compiler.calibration import held_out_label, split_text
from compiler.errors import BuildError
from compiler.export import cache_dtype
from runtime.evaluate import EvaluationError, decode_logits_for, evaluate, prefix_encoding, tokens_fingerprint
from runtime.onnxruntime_backend import OnnxRuntimeBackend
from runtime.tokenizer import whole_text


REPEATED_CHARACTERS = 160  # a held-out run this long found word for word in the calibration part was seen there


@dataclass(frozen=True)
class HeldOut:
    """The tokens the accuracy report scores, where they come from, and the first of them whose text starts a run of
    about REPEATED_CHARACTERS characters also in the calibration part (None: none does). The built-in text's
    held-out `while` and `with` topics repeat its `compound` topic past about their 10,000th token."""
    tokens: np.ndarray
    source: str
    repeats_calibration_from: int | None


def held_out_tokens(calibration_text: str, tokenizer_json: str, max_tokens: int,
                    other_texts: tuple[str, ...] = ()) -> HeldOut:
    """The held-out part of `calibration_text`, and where it repeats the calibration part of that text or of
    `other_texts` (another pass's calibration.text: what any quantizer saw)."""
    calibration, held_out, source = split_text(calibration_text)
    # as little of a long file as the report scores (its held-out part, tokenized whole, took 0.6 GB for 4096 tokens)
    encoding = prefix_encoding(whole_text(Tokenizer.from_str(tokenizer_json)), held_out, max_tokens)
    ids, offsets = encoding.ids[:max_tokens], encoding.offsets[:max_tokens]
    scored_text = held_out[:offsets[-1][1]] if offsets else ""
    runs = [first_repeated_run(scored_text, seen)
            for seen in (calibration, *(split_text(text)[0] for text in other_texts if text != calibration_text))]
    repeated = min((run for run in runs if run is not None), default=None)
    first_token = None if repeated is None else next(k for k, (_, end) in enumerate(offsets) if end > repeated)
    return HeldOut(np.asarray(ids, np.int64), held_out_label(source["source"]), first_token)


def first_repeated_run(text: str, seen: str, length: int = REPEATED_CHARACTERS) -> int | None:
    """The first position in `text` that starts a run found word for word in `seen`: every run of `length`
    characters is found, and none shorter than `length - length // 4 + 1`. `seen` is indexed by the hashes of its
    pieces starting every length // 4 characters (bounded memory for a long calibration file); every run of
    `length` characters holds one of them whole."""
    step = max(1, length // 4)
    piece = length - step + 1
    indexed = {hash(seen[i:i + piece]) for i in range(0, len(seen) - piece + 1, step)}
    found = next((i for i in range(len(text) - piece + 1)
                  if hash(text[i:i + piece]) in indexed and text[i:i + piece] in seen), None)  # no hash collision
    if found is None:
        return None
    start = found  # the piece found starts up to `step` characters into its run: back to where the run starts
    while start > 0 and text[start - 1:found + piece] in seen:
        start -= 1
    return start


def repeated_text_warning(held_out: HeldOut) -> str | None:
    if held_out.repeats_calibration_from is None:
        return None
    if held_out.repeats_calibration_from < 2:  # accuracy.max_tokens is at least 2: no cut leaves unseen text
        return (f"accuracy report: the held-out text ({held_out.source}) repeats the calibration part word for word "
                f"from its first scored token, so the report scores no unseen text; give a calibration text whose last "
                f"10% does not repeat the rest, or set accuracy.enabled: false")
    return (f"accuracy report: from its token {held_out.repeats_calibration_from} on, the held-out text "
            f"({held_out.source}) repeats the calibration part word for word (a run of {REPEATED_CHARACTERS} "
            f"characters or so), so it is not unseen text there; set accuracy.max_tokens to "
            f"{held_out.repeats_calibration_from} or less")


def report_window_and_stride(window: int, stride: int | None, max_context: int) -> tuple[int, int]:
    """The recipe's window and stride, the window cut to the max context; no stride given: half the window, as
    `aotlm eval`'s default (a fixed 256 made a raised window's report three times eval's windows, and another
    number). A cut window keeps at least half of it as context, as that default does: a given stride could
    otherwise equal the cut window and leave the scored tokens of every window after the first one token of
    context."""
    if window > max_context:
        window, stride = max_context, None if stride is None else min(stride, max(1, max_context // 2))
    return window, max(1, window // 2) if stride is None else stride


def evaluate_against_float(float_decode: onnx.ModelProto, artifact: Path, manifest: dict, spec, held_out: HeldOut,
                           backend_spec, progress) -> dict:
    """Perplexity of the float graph and of the built artifact, top-1 agreement and KL(float || quantized).

    float_decode is spent: the writer moves its weights out into the scratch folder's file (a deep copy kept them
    twice, and the quantized artifact's prefill session, which the report never runs, held its weights as float:
    an INT4 build of a 1.5 GB model peaked at 5.6x its weights here, against 4.25x for its fp32 build)."""
    tokens = held_out.tokens
    window, stride = report_window_and_stride(spec.window, spec.stride, manifest["kv_cache"]["max_context"])
    # The float graph keeps a float cache even when the artifact's is int8 (quantize_kv_cache).
    float_cache = {**manifest["kv_cache"], "dtype": cache_dtype({"decode": float_decode}, "float32")}
    with scratch_folder("float") as folder:
        sections = onnxruntime_backend.write_engines({"decode": float_decode}, Path(folder), backend_spec,
                                                     manifest["kv_cache"]["output_aliases_input"])
        reference = OnnxRuntimeBackend(Path(folder), {**sections, "kv_cache": float_cache, "model": manifest["model"]})
        quantized = OnnxRuntimeBackend(artifact, {**manifest, "engines": {"decode": manifest["engines"]["decode"]}})
        try:
            result = evaluate(tokens, decode_logits_for(quantized), window=window, stride=stride,
                              reference_logits_for=decode_logits_for(reference),
                              on_window=lambda done, total: progress(f"accuracy: window {done}/{total}")
                              if done == total or done % 8 == 0 else None)
        except EvaluationError as error:
            raise BuildError(f"accuracy report: {error}") from None
        del reference, quantized
    return {"text": held_out.source, "tokens": int(len(tokens)), "tokens_sha256": tokens_fingerprint(tokens),
            "python": platform.python_version(), "repeats_calibration_from": held_out.repeats_calibration_from,
            "max_context": manifest["kv_cache"]["max_context"],
            **result.to_dict(),
            "perplexity_increase": result.perplexity / result.reference_perplexity - 1}


def quantization_summary(pass_reports: list[dict]) -> dict:
    """Sizes and per-layer output errors from the quantize pass's report on the decode graph, and the KV cache's
    round-off from quantize_kv_cache's; each only when the recipe has that pass."""
    def decode_report(name: str) -> dict | None:
        return next((r["report"] for r in reversed(pass_reports) if r["name"] == name and r["phase"] == "decode"), None)

    summary = {}
    report = decode_report("quantize")
    if report is not None:
        layers = sorted(report["layers"], key=lambda layer: -(layer["relative_output_error"] or 0))
        summary.update({"totals": report["totals"], "embedding": report["embedding"],
                        "worst_layers": [{k: layer[k] for k in ("node", "method", "bits", "block_size",
                                                                "relative_output_error")} for layer in layers[:5]],
                        "padded_layers": [{"node": layer["node"], "note": layer["note"]} for layer in report["layers"]
                                          if "padded to" in (layer.get("note") or "")]})
    report = decode_report("quantize_kv_cache")
    if report is not None:
        summary["kv_cache"] = {k: report[k] for k in ("dtype", "granularity", "quantized_layers", "relative_error")}
    return summary
