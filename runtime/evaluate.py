"""Accuracy of an artifact on a text: perplexity, and top-1 agreement and KL divergence against a reference.

    engine = Engine.load("artifacts/smollm2-135m-int4")
    reference = Engine.load("artifacts/smollm2-135m")
    tokens = np.array(encode_text(engine.tokenizer, builtin_text("pydoc-held-out"))[:4096])
    result = evaluate(tokens, decode_logits_for(engine), window=512, stride=256,
                      reference_logits_for=decode_logits_for(reference))
    result.perplexity, result.top1_agreement, result.mean_kl

Texts longer than the model's context are scored with sliding windows, as in Hugging Face's perplexity guide
(https://huggingface.co/docs/transformers/perplexity): windows of `window` tokens start every `stride` tokens,
and each token is scored once, by the first window that holds it after its first position, which is the window
that gives it the most left context. All statistics are computed in float64 from a stable log-softmax.

This module also owns the split of the built-in text (Python's documentation, `pydoc_data.topics`) into a
calibration part (for the compiler's quantization) and a held-out part (for evaluation): `split_pydoc_text`.
"""
from __future__ import annotations

import contextlib
import math
import operator
import re
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from runtime.errors import ModelOutputError, RequestError
from runtime.sampling import _logprobs
from runtime.text_files import TextFile, text_prefix

_NONE = object()  # no bad item found (None itself may be one)

LogitsFor = Callable[[np.ndarray], np.ndarray]  # token ids [n] -> logits [n, vocab], row i predicts token i + 1
CALIBRATION_FRACTION = 0.9  # of pydoc's characters; the held-out part starts at the next paragraph boundary
HELD_OUT_BOUNDARY_LIMIT = 0.95  # ...if one starts by here; else at 90% exactly (half the held-out part, at least)
PARAGRAPH_BREAK = re.compile(r"\r?\n\r?\n")
BUILTIN_SOURCE = "pydoc_data.topics (Python's documentation)"  # how reports name the built-in text
BUILTIN_TEXTS = ("pydoc-held-out", "pydoc-calibration")


class EvaluationError(RequestError, ValueError):
    """An evaluation cannot run as asked (bad window or stride, too few tokens, unknown built-in text)."""


# -- texts ---------------------------------------------------------------------------------------------------
def split_held_out(text: str) -> tuple[str, str]:
    """(calibration_part, held_out_part) of a text: the held-out part starts at the first paragraph boundary
    ("\\n\\n") at or after 90% of the characters, where one starts by 95% and text follows it (else at 90%
    exactly); the calibration part is everything before it.

    Quantization calibrates on the first part and its build-time report scores the second, so they never overlap.
    """
    found = PARAGRAPH_BREAK.search(text, int(CALIBRATION_FRACTION * len(text)))  # a CRLF file's are \r\n\r\n
    boundary = found.start() if found else -1
    if boundary > 0 and text[boundary - 1:boundary + 1] == "\r\n":  # the search began inside a CRLF: its whole break
        boundary -= 1
    # No paragraph boundary between 90% and 95% (a text whose only later one is its trailing blank line would hold out
    # just that line, one scored token): split at 90% exactly.
    if boundary < 0 or boundary > HELD_OUT_BOUNDARY_LIMIT * len(text) or not text[boundary:].strip():
        boundary = int(CALIBRATION_FRACTION * len(text))
    return text[:boundary], text[boundary:]


def split_pydoc_text() -> tuple[str, str]:
    """`split_held_out` of Python's documentation topics, sorted by name and joined by blank lines."""
    from pydoc_data.topics import topics

    return split_held_out("\n\n".join(topics[name] for name in sorted(topics)))


def builtin_text(name: str) -> str:
    """A text that ships with Python: "pydoc-held-out" (for evaluation) or "pydoc-calibration"."""
    if name not in BUILTIN_TEXTS:
        raise EvaluationError(f"unknown built-in text {name!r}; known: {', '.join(BUILTIN_TEXTS)}")
    calibration, held_out = split_pydoc_text()
    return held_out if name == "pydoc-held-out" else calibration


def tokens_fingerprint(token_ids) -> str:
    """A short hash of token ids: two evaluations scored the same tokens iff these match. Python's documentation
    (the built-in texts) differs from one Python release to the next, so the build's report records it."""
    import hashlib

    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:16]


def encode_text(tokenizer, text: str | TextFile, max_tokens: int | None = None) -> list[int]:
    """Token ids of `text` with no special tokens added (no BOS): evaluation scores the text itself.

    `tokenizer` is a runtime.tokenizer.TextTokenizer (its encode() lets the post-processor add BOS). With
    `max_tokens`, the first max_tokens ids of the whole text's, from as little of the text as gives them
    (prefix_encoding). `text`: a str, or a TextFile, read only as far as that needs.
    """
    if max_tokens is None:
        whole = text.read_all() if isinstance(text, TextFile) else text
        return tokenizer.tokenizer.encode(whole, add_special_tokens=False).ids
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:  # -1 sliced off the last id
        raise EvaluationError(f"max_tokens must be a whole number of 0 or more (or None: the whole text); got "
                              f"{max_tokens!r}")
    return prefix_encoding(tokenizer.tokenizer, text, max_tokens).ids[:max_tokens]


def prefix_encoding(tokenizer, text: str | TextFile, max_tokens: int):
    """The tokenizers Encoding (no special tokens) of as little of `text` as gives the whole text's first max_tokens
    ids: a prefix cut mid-word tokenizes that word differently, so a prefix's ids count only once a prefix twice as
    long begins with the same ones (a GB corpus scored for 4096 tokens is neither read nor tokenized whole).
    `tokenizer`: a tokenizers.Tokenizer; the caller keeps the first max_tokens of its ids (and offsets)."""
    encode = lambda part: tokenizer.encode(part, add_special_tokens=False)  # noqa: E731
    length, shorter = max(4096, 8 * max_tokens), None  # ~4 characters a token in English: one doubling, usually
    while True:
        part, whole = text_prefix(text, length)
        encoding = encode(part)
        if whole:
            return encoding
        if len(encoding.ids) > max_tokens:
            if shorter is not None and shorter[:max_tokens] == encoding.ids[:max_tokens]:
                return encoding
            shorter = encoding.ids
        length *= 2


# -- the window plan -----------------------------------------------------------------------------------------
def window_spans(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: feed tokens[start:end], score tokens[first_scored:end].

    Every token but the first is scored exactly once. The first window scores all its tokens after its first;
    each later window starts `stride` tokens after the previous one and scores only the tokens the previous
    window did not reach, each with at least window - stride tokens of left context. A window of W tokens can
    score at most W - 1 of them (its first has no context inside it), so with stride == window (no overlap
    asked) each window re-reads the previous window's last token: the windows step by window - 1.
    """
    if window < 2:
        raise EvaluationError(f"window must be >= 2 tokens (one of context, one scored), got {window}")
    if not 1 <= stride <= window:
        raise EvaluationError(f"stride must be between 1 and the window ({window}), got {stride}")
    spans: list[tuple[int, int, int]] = []
    start, scored_until = 0, 1  # token 0 has no left context: it is never scored
    while scored_until < num_tokens:
        end = min(start + window, num_tokens)
        spans.append((start, end, scored_until))
        scored_until = end
        start = min(start + stride, end - 1)  # the next window must hold one token before the first it scores
    return spans


# -- statistics ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Evaluation:
    """What `evaluate` measured. KL is KL(reference || model) in nats, averaged over scored tokens."""

    tokens_scored: int
    windows: int
    window: int
    stride: int
    mean_nll: float
    perplexity: float
    reference_mean_nll: float | None = None
    reference_perplexity: float | None = None
    top1_agreement: float | None = None  # fraction of scored positions where both argmaxes agree
    mean_kl: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Stable log-softmax over the last axis, in float64."""
    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class _Totals:
    """Running sums over scored tokens (float64), one per statistic."""

    def __init__(self):
        self.count = 0
        self.nll = 0.0
        self.reference_nll = 0.0
        self.agree = 0
        self.kl = 0.0

    def add(self, logits: np.ndarray, targets: np.ndarray, reference: np.ndarray | None) -> None:
        if reference is not None and reference.shape != logits.shape:
            raise EvaluationError(f"the reference's logits have shape {reference.shape}, the model's {logits.shape}: "
                                  f"top-1 agreement and KL need the same vocabulary")
        for start in range(0, len(targets), EVAL_PIECE_TOKENS):  # float64 copies of a few rows at a time
            rows = slice(start, start + EVAL_PIECE_TOKENS)
            self._add(logits[rows], targets[rows], None if reference is None else reference[rows])

    def _add(self, logits: np.ndarray, targets: np.ndarray, reference: np.ndarray | None) -> None:
        rows = np.arange(len(targets))
        log_probs = log_softmax(logits)
        self.count += len(targets)
        self.nll -= float(log_probs[rows, targets].sum())
        if reference is None:
            return
        reference_log_probs = log_softmax(reference)
        self.reference_nll -= float(reference_log_probs[rows, targets].sum())
        self.agree += int((logits.argmax(axis=-1) == reference.argmax(axis=-1)).sum())
        # KL(P_ref || P_model) = sum_v p_ref(v) * (log p_ref(v) - log p_model(v)), per position
        self.kl += float((np.exp(reference_log_probs) * (reference_log_probs - log_probs)).sum())


def _token_array(token_ids) -> np.ndarray:
    """token_ids as int64, refused unless one flat list of integers: an int64 cast had scored 10.7 as 10, and a
    [1, n] array as one token."""
    if not isinstance(token_ids, np.ndarray):  # a list: each item checked (numpy would read True as 1, 2**63 as float)
        items = list(token_ids)
        bad = next((item for item in items if isinstance(item, (bool, np.bool_)) or not hasattr(type(item), "__index__")),
                   _NONE)
        if isinstance(bad, (list, tuple, np.ndarray)):
            raise EvaluationError("token_ids must be one flat list of token ids; got a list of lists (pass ids[0])")
        if bad is not _NONE:
            raise EvaluationError(f"token ids must be integers; got {bad!r} ({type(bad).__name__})")
        ids = [operator.index(item) for item in items]
        huge = next((i for i in ids if not -2**63 <= i < 2**63), None)
        if huge is not None:
            raise EvaluationError(f"token id {huge} is outside any vocabulary")
        return np.array(ids, dtype=np.int64)
    tokens = token_ids
    if tokens.ndim != 1:
        hint = "; pass ids[0]" if tokens.ndim == 2 and len(tokens) == 1 else ""
        raise EvaluationError(f"token_ids must be one flat list of token ids; got a {tokens.ndim}-D array{hint}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise EvaluationError(f"token ids must be integers; got {tokens.dtype} values (e.g. {tokens[0]!r})")
    return tokens.astype(np.int64)


def evaluate(token_ids, logits_for: LogitsFor, *, window: int, stride: int,
             reference_logits_for: LogitsFor | None = None,
             on_window: Callable[[int, int], None] | None = None) -> Evaluation:
    """Perplexity of `logits_for` over `token_ids`; with a reference, also top-1 agreement and KL(ref || model).

    on_window(windows_done, windows_total) is called after each window (a progress bar).
    """
    tokens = _token_array(token_ids)
    spans = window_spans(len(tokens), window, stride)
    if not spans:
        raise EvaluationError(f"the text has {len(tokens)} token(s); scoring needs at least 2")
    totals = _Totals()
    for done, (start, end, first_scored) in enumerate(spans, 1):
        chunk = tokens[start:end]
        scored = slice(first_scored - 1 - start, end - 1 - start)  # row i predicts token start + i + 1
        targets = tokens[first_scored:end]
        logits = _finite(_checked(logits_for(chunk), len(chunk))[scored], "the model", start, first_scored)
        reference = None
        if reference_logits_for is not None:
            reference = _finite(_checked(reference_logits_for(chunk), len(chunk))[scored], "the reference", start,
                                first_scored)
        totals.add(logits, targets, reference)
        if on_window is not None:
            on_window(done, len(spans))
    mean_nll = totals.nll / totals.count
    compared = reference_logits_for is not None
    reference_nll = totals.reference_nll / totals.count if compared else None
    return Evaluation(
        tokens_scored=totals.count, windows=len(spans), window=window, stride=stride,
        mean_nll=mean_nll, perplexity=perplexity_of(mean_nll),
        reference_mean_nll=reference_nll, reference_perplexity=perplexity_of(reference_nll) if compared else None,
        top1_agreement=totals.agree / totals.count if compared else None,
        mean_kl=totals.kl / totals.count if compared else None,
    )


def perplexity_of(mean_nll: float) -> float:
    """exp(mean NLL); inf past a float's range (a broken artifact's NLL over 709), without numpy's overflow warning.
    JSON writes it as null (runtime/results.py json_text); the mean NLL stays finite beside it."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def _finite(logits: np.ndarray, whose: str, start: int, first_scored: int) -> np.ndarray:
    """A NaN or infinite logit would turn the perplexity and KL into NaN without a word (and count in top-1)."""
    bad = ~np.isfinite(logits).all(axis=-1)
    if bad.any():
        row = int(np.argmax(bad))
        raise EvaluationError(f"{whose}'s logits are NaN or infinite at position {first_scored + row - 1} (predicting "
                              f"token {first_scored + row}; the window from token {start}; {int(bad.sum())} such "
                              f"row(s) there): the engine overflowed or failed; "
                              f"a float16 engine may need float32 or bfloat16 (export.dtype)")
    return logits


def _checked(logits: np.ndarray, length: int) -> np.ndarray:
    if logits.ndim != 2 or logits.shape[0] != length:
        raise EvaluationError(f"logits_for returned shape {logits.shape}; expected [{length}, vocab]")
    return logits


# -- an artifact as a logits function -----------------------------------------------------------------------
def decode_logits_for(source) -> LogitsFor:
    """Logits for every position of a chunk, run through the decode graph as a fresh sequence.

    Batch 1, positions 0..n-1, attention mask of ones [1, n]: the graph attends only to the n new tokens, so
    whatever the cache held before is ignored (and overwritten). A chunk goes in pieces of EVAL_PIECE_TOKENS (fewer
    where the engine takes fewer tokens per decode call: TensorRT's decode_max_tokens), each attending to the cached
    pieces before it: the same logits up to rounding (in quantized graphs, int8 activations amplify the different
    rounding of one row and of many: +0.08% perplexity one token at a time on INT4, README "Accuracy"). `source` is an Engine, whose batch-1 cache each chunk then holds as a
    request would (other threads' generate/stream wait), or a bare OnnxRuntimeBackend that nothing else runs on.
    """
    def logits_for(token_ids: np.ndarray) -> np.ndarray:
        pieces = list(decode_logit_pieces(source, token_ids, EVAL_PIECE_TOKENS))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    return logits_for


def decode_logit_pieces(source, token_ids, piece_tokens: int | None = None):
    """decode_logits_for's logits a piece of positions at a time ([piece, vocab] float32 arrays, in order), for a
    caller that reduces each piece before the next (a long chunk's logits at once take length x vocab floats).
    piece_tokens: at most this many positions a piece (default: the engine's decode_max_tokens, else all). It holds
    an Engine's batch-1 cache until iterated to the end or closed."""
    hold = getattr(source, "batch_one", None)
    backend = source.backend if hold is not None else source
    max_context = backend.kv_spec["max_context"]
    piece = min(filter(None, (getattr(backend, "max_decode_tokens", None), piece_tokens, max_context)))
    length = len(token_ids)
    if not 1 <= length <= max_context:
        raise EvaluationError(f"a chunk of {length} tokens does not fit this artifact's max context "
                              f"({max_context}); use a window of at most {max_context}")
    input_ids = _token_array(token_ids)[None]  # [1, n]
    vocab = backend.manifest["model"]["config"]["vocab_size"]
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if outside.size:  # a negative id wrapped to a row from the end in onnxruntime's Gather, scored without a word
        raise EvaluationError(f"token id {outside[0]} is outside this model's vocabulary (0..{vocab - 1})")
    with hold() if hold is not None else contextlib.nullcontext():
        backend.allocate_cache(batch=1)  # a no-op when batch 1 is bound already; run() rebinds the logits
        for start in range(0, length, piece):
            end = min(start + piece, length)
            positions = np.arange(start, end, dtype=np.int64)[None]  # [1, end - start]
            mask = np.ones((1, end), dtype=np.int64)  # [1, total]: this piece and the ones before it
            logits = backend.run("decode", input_ids[:, start:end], positions, mask)  # [1, end - start, vocab]
            yield np.array(logits[0], dtype=np.float32)  # a copy: the backend reuses its logits array


# Positions a scoring run puts through the decode graph at once, and whose log-softmax it holds in float64. One run over
# a whole 2048-token window grew onnxruntime's arena by ~5.8 GiB on SmolLM2-135M (peak 8.1 GiB, against 2.9 GiB in
# pieces of 256, the same logits); its float64 log-softmax took 2.3 GiB more.
EVAL_PIECE_TOKENS = 256
PROMPT_PIECE_TOKENS = 128  # positions whose logits a prompt_logprobs request holds at once (128 x vocab floats)


def scored_prompt(pieces, token_ids: list[int], alternatives: int) -> tuple[list[dict[int, float] | None], np.ndarray]:
    """(prompt_logprobs' entries, the last position's logits [vocab]) from the prompt's logit pieces in order: per
    prompt token, its log-probability given the tokens before it and the `alternatives` likeliest tokens' there, in
    a result's logprobs form ({token: log-probability}, the token first); None for the first token, which nothing
    predicts (OpenAI's and vLLM's prompt logprobs: what lm-evaluation-harness scores choices with). Engine's
    batch-1 path calls it for a request's SamplingParams.prompt_logprobs."""
    entries: list[dict[int, float] | None] = [None]
    start, last = 0, None
    for logits in pieces:
        entries += prompt_entries(logits, token_ids, start, alternatives)
        start, last = start + len(logits), logits[-1]
    return entries, last


def prompt_entries(logits: np.ndarray, token_ids: list[int], start: int, alternatives: int) -> list[dict[int, float]]:
    """scored_prompt's entries for one piece: logits [n, vocab] of positions start..start + n - 1, row i predicting
    token start + i + 1 (a row at the prompt's last position predicts what follows it: no entry). The scheduler
    scores a prompt piece by piece with it."""
    if np.isnan(logits.max()):  # NaN propagates through max: one reduction, as the sampler checks its row
        row = int(np.isnan(logits).any(axis=-1).argmax())
        raise ModelOutputError(f"the model's logits contain NaN at prompt position {start + row}; the artifact's "
                               f"graphs produce non-finite values (rebuild it, or check with `aotlm eval`)")
    return [_logprobs(row, token_ids[start + i + 1], alternatives)
            for i, row in enumerate(logits) if start + i + 1 < len(token_ids)]
