"""Choosing the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling with a seed, after the
repetition, presence and frequency penalties if a request asks for them (as vLLM applies them: penalties first);
and, if asked, each chosen token's log-probability and its likeliest alternatives'."""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401  numpy 2 loads it on first use (~20 ms): here, not in a request's TTFT

from runtime.errors import ArtifactError, ModelOutputError, RequestError
from runtime.tokenizer import check_unicode

FLOAT32 = np.finfo(np.float32)  # the logits' type, which the penalties are applied in
MAX_STOP_STRINGS, MAX_STOP_CHARACTERS = 64, 1000  # per request (OpenAI's API: 4; lm-evaluation-harness sends a few)
MAX_HINTED_NAME = 64  # characters of an unknown option's name worth a "did you mean" (difflib: length squared)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops; generate, stream, chat and submit take these as keyword
    arguments too. Each is checked here: a value out of range is a RequestError naming it and its range.

    max_new_tokens: at most this many output tokens (>= 1). min_new_tokens: no stop before this many (vLLM's
    min_tokens). temperature: 0 = greedy, else softmax(logits / temperature). top_k: keep the k likeliest (0 = all).
    top_p: keep the likeliest whose probabilities sum to top_p, in (0, 1]. min_p: keep tokens at least this fraction
    as likely as the likeliest (0 = all), after top-k and top-p: transformers' order (and vLLM V0's; vLLM V1 applies
    it first, keeping fewer tokens when top_p is set too). seed: an integer >= 0 makes a sampled request repeatable; None draws one.
    stop_token_ids: ids that stop besides the model's end-of-sequence tokens; ignore_eos: go on past those (to
    max_new_tokens). stop_strings: a string or a list of strings that end the text (left out of it).
    repetition_penalty (> 0, 1 = none; transformers' and vLLM's), presence_penalty and frequency_penalty (-2..2,
    0 = none; OpenAI's), logit_bias ({token id: -100..100}, OpenAI's). logprobs: None, or 0..20 alternatives per
    output token in result.logprobs; prompt_logprobs: the same per prompt token (vLLM's). The comments on each
    field below say more.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    # Token ids that stop the request besides the model's end-of-sequence tokens (vLLM's: ignore_eos leaves those out)
    stop_token_ids: Sequence[int] | None = ()  # stored as a tuple (None: none, vLLM's spelling)
    stop_strings: str | Sequence[str] = ()  # a string is one stop string; stored as a tuple
    # Penalties on tokens already seen, greedy decoding included. repetition_penalty is transformers' and vLLM's
    # (the CTRL paper's): every token of the prompt and the output has a positive logit divided by it, a negative
    # one multiplied. presence_penalty and frequency_penalty are OpenAI's: subtracted from the logit of each token
    # the output holds, once and per occurrence. The defaults leave logits as they are.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities in the result (GenerationResult.logprobs), as vLLM's and OpenAI's `logprobs`: None = none;
    # N >= 0 = each output token's own and its N likeliest alternatives', from the model's distribution (the raw
    # logits: before penalties, temperature, top-k and top-p, as vLLM returns them by default).
    logprobs: int | None = None
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the likeliest (after top-k, top-p), 0 = all
    # vLLM's ignore_eos: go on past the model's end-of-sequence tokens, to max_new_tokens or a stop string (output
    # lengths fixed for a benchmark). Stop ids given in stop_token_ids still stop.
    ignore_eos: bool = False
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to those logits before the penalties (vLLM's order);
    # -100 all but bans a token, 100 all but forces it. Token ids may be ints or, as in OpenAI's JSON, digit strings.
    # Stored as ((id, bias), ...) sorted by id. Log-probabilities stay the model's own, as for the penalties.
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    # vLLM's prompt_logprobs: N >= 0 puts in result.prompt_logprobs, per prompt token, its log-probability given the
    # tokens before it and its N likeliest alternatives' (None for the first token). The prompt then runs through
    # the decode graph, which computes every position's logits (the batch-1 path and the scheduler both; there, no
    # cached prefix is reused for it).
    prompt_logprobs: int | None = None
    # vLLM's min_tokens: no stop token id nor end-of-sequence token is sampled (their logits are -inf), and no stop
    # string ends the text, before this many output tokens. 0 = no minimum.
    min_new_tokens: int = 0

    def __post_init__(self):
        if not is_integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: {self.max_new_tokens!r} must be an integer >= 1")
        if not _is_real(self.temperature) or not 0 <= self.temperature < float("inf"):  # `not` also refuses NaN
            raise RequestError(f"temperature: {self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k: {self.top_k!r} must be an integer >= 0 (0 = no limit)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p: {self.top_p!r} must be a number in (0, 1]")
        if not _is_real(self.repetition_penalty) or not (
                float(FLOAT32.smallest_subnormal) <= self.repetition_penalty <= float(FLOAT32.max)):
            # the logits are float32: a penalty that is 0 or inf there divided them by 0 (numpy warned) or by inf
            raise RequestError(f"repetition_penalty: {self.repetition_penalty!r} must be a finite number > 0 within "
                               f"float32's range ({FLOAT32.smallest_subnormal:.1e} to {FLOAT32.max:.1e}; 1 = none, "
                               f"above 1 discourages repeating)")
        for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's and vLLM's range
            if not _is_real(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name}: {getattr(self, name)!r} must be a number in [-2, 2] (0 = none)")
        if not is_integer(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise RequestError(f"min_new_tokens: {self.min_new_tokens!r} must be an integer from 0 to the most new "
                               f"tokens asked for ({self.max_new_tokens})")
        if self.prompt_logprobs is not None and (not is_integer(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise RequestError(f"prompt_logprobs: {self.prompt_logprobs!r} must be an integer in 0..{MAX_LOGPROBS}, "
                               f"or None")
        if self.logprobs is not None and (not is_integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs: {self.logprobs!r} must be an integer in 0..{MAX_LOGPROBS} (the alternatives "
                               f"per token beside the chosen one), or None")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p: {self.min_p!r} must be a number in [0, 1] (0 = no limit)")
        if self.seed is not None and (not is_integer(self.seed) or self.seed < 0):  # numpy's generators take >= 0
            raise RequestError(f"seed: {self.seed!r} must be an integer >= 0 or None")
        # numpy integers pass is_integer; keep Python ints, whose arithmetic cannot wrap around (the scheduler's
        # prompt + max_new_tokens - 1 read np.int32(2**31 - 1) as a negative need and admitted the request)
        for name in ("max_new_tokens", "top_k", "min_new_tokens", "logprobs", "prompt_logprobs", "seed"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        # A bare string is one stop string, as in vLLM's and OpenAI's `stop` (not a tuple of its characters).
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else self.stop_strings
        if not isinstance(stops, (list, tuple)) or not all(isinstance(stop, str) for stop in stops):
            raise RequestError(f"stop_strings: {self.stop_strings!r} must be a string or a list of strings")
        if any(not stop for stop in stops):
            raise RequestError("stop_strings: an empty string would stop before any text; remove it")
        if len(stops) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARACTERS for stop in stops):
            # each is looked for after every token, on the thread that steps every request: 900,000 of them made
            # each step of the whole batch take 0.9 s (OpenAI's API takes 4)
            count, longest = len(stops), max(map(len, stops))
            raise RequestError(f"stop_strings: {count:,} string{'s' * (count != 1)}, the longest {longest:,} "
                               f"character{'s' * (longest != 1)}; give at most {MAX_STOP_STRINGS}, each at most "
                               f"{MAX_STOP_CHARACTERS:,} characters")
        for stop in stops:  # bytes that were not UTF-8 (argv, a pipe): decoded text never holds them, so never stops
            check_unicode(stop, f"stop_strings: {stop!r}")  # its field first: the API names it (stop)
        object.__setattr__(self, "stop_strings", tuple(stops))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):  # a string such as "false" would read as True
            raise RequestError(f"ignore_eos: {self.ignore_eos!r} must be True or False")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        ids = () if self.stop_token_ids is None else self.stop_token_ids  # None: vLLM's spelling of none
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_integer(i) for i in ids):
            raise RequestError(f"stop_token_ids: {ids!r} must be a list of token ids (they stop besides the model's "
                               f"end-of-sequence tokens; ignore_eos=True leaves those out)")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    def stop_ids(self, eos_token_ids: Sequence[int]) -> frozenset[int]:
        """The token ids that end the request: stop_token_ids and, unless ignore_eos, the model's end-of-sequence
        tokens (vLLM's rule)."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


MAX_LOGIT_BIAS = 100.0  # OpenAI's range


def _checked_logit_bias(bias) -> tuple[tuple[int, float], ...] | None:
    if bias is None or isinstance(bias, tuple) and not bias:
        return None
    if isinstance(bias, tuple):  # the stored form, from dataclasses.replace: checked again below
        bias = dict(bias)
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias: {bias!r} must be a dict of token id -> bias (e.g. {{50256: -100}})")
    checked = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.strip().isascii() and token.strip().isdigit() and len(token) <= 20:
            # OpenAI's JSON keys (ASCII: "²" is a digit to str.isdigit, not to int(); 20 characters: past 4300 digits
            # int() raises, and no vocabulary is that large)
            token = int(token)
        if not is_integer(token) or token < 0:
            raise RequestError(f"logit_bias: key {token!r} must be a token id (an integer >= 0)")
        if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias: {value!r} for token {token} must be a number in "
                               f"[-{MAX_LOGIT_BIAS:.0f}, {MAX_LOGIT_BIAS:.0f}]")
        checked[int(token)] = float(value)
    return tuple(sorted(checked.items())) or None


def sampling_params(params: SamplingParams | None, keywords: dict, defaults: dict | None = None) -> SamplingParams:
    """A request's sampling options, given as `params` or as keywords (not both: one would be silently ignored).
    defaults: the model's (Engine.sampling_defaults), for the keywords not given; a SamplingParams is taken whole,
    as vLLM takes one."""
    if params is not None and keywords:
        raise RequestError(f"pass sampling options either as params or as keywords, not both "
                           f"(got params and {', '.join(sorted(keywords))})")
    if params is not None and not isinstance(params, SamplingParams):
        raise RequestError(f"params: expected a SamplingParams, got {type(params).__name__}")
    _check_option_names(keywords)
    return params or SamplingParams(**{**(defaults or {}), **keywords})


GENERATION_DEFAULT_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def model_defaults(manifest: dict) -> dict:
    """The manifest's generation_defaults values (compiler/frontend/generation_defaults.py), each checked as a
    request's would be; {} where there are none."""
    section = manifest.get("generation_defaults")
    if section is None:
        return {}
    values = section.get("values") if isinstance(section, dict) else None
    if not isinstance(values, dict) or not set(values) <= set(GENERATION_DEFAULT_NAMES):
        raise ArtifactError(f"manifest generation_defaults: {section!r} is not the model's sampling defaults as a "
                            f"build writes them; the manifest was edited: rebuild the artifact")
    try:
        SamplingParams(**values)
    except RequestError as error:
        raise ArtifactError(f"manifest generation_defaults: {error}; the manifest was edited: rebuild the "
                            f"artifact") from None
    return dict(values)


def _check_option_names(options: dict) -> None:
    unknown = [name for name in options if name not in SamplingParams.__dataclass_fields__]
    if unknown:
        hints = "; ".join(f"{name!r}: {_unknown_option_hint(name)}" for name in unknown)
        raise RequestError(f"unknown sampling option {hints}; the options are "
                           f"{', '.join(SamplingParams.__dataclass_fields__)}")


def _with_option_hints(init):
    """SamplingParams(max_tokens=...) raises the RequestError that generate(..., max_tokens=...) raises (which names
    max_new_tokens), not the dataclass' bare TypeError "unexpected keyword argument"."""
    @functools.wraps(init)
    def checked(self, *args, **options):
        _check_option_names(options)
        init(self, *args, **options)

    return checked


SamplingParams.__init__ = _with_option_hints(SamplingParams.__init__)


# Other APIs' names for options this one spells otherwise (OpenAI's and vLLM's), or does not have.
OPTION_ALIASES = {
    "max_tokens": "did you mean max_new_tokens?", "max_completion_tokens": "did you mean max_new_tokens?",
    "stop": "did you mean stop_strings (text) or stop_token_ids (ids)?",
    "top_logprobs": "did you mean logprobs (the alternatives per token)?",
    "n": "there is no n: submit the prompt n times with their own seeds (with prefix caching it is prefilled once)",
    "best_of": "there is no best_of: submit the prompt n times with their own seeds and keep the best",
    "sampling_params": "did you mean params (a SamplingParams, vLLM's sampling_params)?",
    "do_sample": "there is no do_sample: temperature 0 (the default) is greedy, above 0 samples",
}


def _unknown_option_hint(name: str) -> str:
    import difflib

    if name in OPTION_ALIASES:
        return OPTION_ALIASES[name]
    if len(name) > MAX_HINTED_NAME:  # no option's name is near a longer one
        return "not an option"
    close = difflib.get_close_matches(name, SamplingParams.__dataclass_fields__, n=1)
    return f"did you mean {close[0]}?" if close else "not an option"


def is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


class Sampler:
    """One per request, so a seed makes that request's samples reproducible whatever else runs (given the same
    logits: an int8 KV cache whose prefill attends in float gives others to a chunked or prefix-cached prompt, see
    runtime/scheduler.py). It remembers the tokens it returned (and the prompt's) for the penalties."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), eos_token_ids: Sequence[int] = ()):
        """eos_token_ids: the model's; for params.min_new_tokens samples, they and the request's stop ids are held
        back (vLLM's min_tokens holds the end-of-sequence tokens back under ignore_eos too)."""
        self.params = params
        self.sampled = 0
        held = params.stop_ids(eos_token_ids) | set(eos_token_ids) if params.min_new_tokens else ()
        self._held_ids = np.array(sorted(held), dtype=np.int64)
        self.rng = np.random.default_rng(params.seed)
        # Only a penalized request keeps its history: the ids seen (prompt and output) and the output's counts.
        self._seen: set[int] = set(prompt_ids) if params.penalized else set()
        self._output_counts: dict[int, int] = {}
        # With params.logprobs: per token returned, {token id: log-probability} for it and its alternatives.
        self.logprobs: list[dict[int, float]] = []
        bias = params.logit_bias or ()
        self._bias_ids = np.array([token for token, _ in bias], dtype=np.int64)
        self._bias_values = np.array([value for _, value in bias], dtype=np.float32)

    def __call__(self, logits: np.ndarray) -> int:
        """logits: [vocab] float32 -> token id, remembered as the output's next token. NaN or +inf logits, or all
        -inf, raise a ModelOutputError: greedy would pick an arbitrary token (argmax returns the first NaN) and
        sampling would fail inside numpy."""
        _check_samplable(logits)
        biased = logits
        if self._bias_ids.size:  # in a copy: the row belongs to the step's output, and logprobs are the model's
            biased = logits.copy()
            biased[self._bias_ids] += self._bias_values
        if self._held_ids.size and self.sampled < self.params.min_new_tokens:
            biased = biased.copy() if biased is logits else biased
            biased[self._held_ids] = -np.inf
            if biased.max() == -np.inf:  # argmax would pick a held-back token, sampling would fail in numpy
                raise RequestError(f"min_new_tokens: every token this request may sample is a stop or "
                                   f"end-of-sequence token; lower min_new_tokens to {self.sampled}")
        self.sampled += 1
        if not self.params.penalized:
            token = self._choose(biased)
        else:
            token = self._choose(self._penalize(biased))
            self._seen.add(token)
            self._output_counts[token] = self._output_counts.get(token, 0) + 1
        if self.params.logprobs is not None:
            self.logprobs.append(_logprobs(logits, token, self.params.logprobs))
        return token

    def _penalize(self, logits: np.ndarray) -> np.ndarray:
        """The logits after the penalties, in a copy (the row belongs to the step's output). Costs what the seen
        tokens number, not the vocabulary."""
        params, logits = self.params, logits.copy()
        if params.repetition_penalty != 1.0 and self._seen:
            seen = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            values = logits[seen]
            with np.errstate(over="ignore"):  # an overflow is refused below, with the reason
                logits[seen] = np.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
        if self._output_counts and (params.presence_penalty or params.frequency_penalty):
            ids = np.fromiter(self._output_counts, dtype=np.int64, count=len(self._output_counts))
            counts = np.fromiter(self._output_counts.values(), dtype=np.float32, count=len(ids))
            logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
        if logits.max() == np.inf:  # a finite logit divided by a tiny penalty
            raise RequestError(f"repetition_penalty: {params.repetition_penalty!r} overflows the logits of tokens "
                               f"already seen to infinity; use a penalty nearer 1")
        if logits.max() == -np.inf:  # every token seen, each multiplied past float32: nothing left to sample
            raise RequestError(f"repetition_penalty: {params.repetition_penalty!r} drives every token's logit to "
                               f"-infinity (all of them already seen); use a penalty nearer 1")
        return logits

    def _choose(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        scratch = _scratch(logits.size)
        return _draw(self.rng, self._probabilities(logits, scratch.probs), scratch.cdf)

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The probabilities sampling draws from (float64), for logits the request's logit_bias, min_new_tokens and
        penalties have already changed (__call__ applies them first): softmax at the temperature, then top-k, top-p
        and min-p, each renormalized, in transformers' order; greedy decoding's is all on the likeliest token."""
        _check_samplable(logits)  # as sampling does: NaN, +inf or no finite logit is the model's error, said so
        if self.params.greedy:
            return np.eye(1, logits.size, int(np.argmax(logits)), dtype=np.float64)[0]
        return self._probabilities(logits, np.empty(logits.size, dtype=np.float64))

    def _probabilities(self, raw: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """distribution() for a sampled request, computed in `probs` (a float64 buffer of the vocabulary's size) and
        returned: every step in place, the same operations in the same order as on fresh arrays, so the same values
        bit for bit. (Fresh 400 KB arrays per token can come from the system each time, page faults and all: on a
        process's main thread a sampled token took 1.17 ms on SmolLM2's vocabulary, 0.34 ms with these buffers.)"""
        # Shift before dividing: the largest logit becomes 0, so a tiny temperature gives -inf elsewhere, not inf - inf.
        probs[:] = raw
        largest = probs.max()
        with np.errstate(over="ignore"):
            np.subtract(probs, largest, out=probs)
            np.divide(probs, self.params.temperature, out=probs)
        if 0 < self.params.top_k < probs.size:
            # scaling is monotone, so the k-th largest scaled value is the k-th largest logit, scaled
            with np.errstate(over="ignore"):
                kth_largest = (np.float64(_kth_largest(raw, self.params.top_k)) - largest) / self.params.temperature
            probs[probs < kth_largest] = -np.inf
        np.exp(probs, out=probs)
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            keep = _top_p_kept(probs, self.params.top_p)
            kept = probs[keep]
            probs[:] = 0.0
            probs[keep] = kept
            probs /= probs.sum()
        if self.params.min_p > 0.0:  # after top-k and top-p, as transformers' MinPLogitsWarper runs
            probs[probs < self.params.min_p * probs.max()] = 0.0
            probs /= probs.sum()
        return probs


class _Scratch(threading.local):
    """A thread's float64 buffers of one vocabulary's size for sampling (a worker's, or a caller's batch-1 run)."""

    size = 0
    probs = cdf = None


_SCRATCH = _Scratch()


def _scratch(size: int) -> _Scratch:
    if _SCRATCH.size != size:
        _SCRATCH.size, _SCRATCH.probs, _SCRATCH.cdf = size, np.empty(size, np.float64), np.empty(size, np.float64)
    return _SCRATCH


def _draw(rng: np.random.Generator, probs: np.ndarray, cdf: np.ndarray | None = None) -> int:
    """rng.choice(probs.size, p=probs): the same uniform draw, the same cumulative sums, the same token. numpy's
    choice also checks p over the whole vocabulary (a Kahan sum, a sign test: ~0.2 ms at 49k entries, per token);
    distribution's probabilities are normalized already, and the entries top-k, top-p and min-p zeroed add exactly
    nothing to the cumulative sums, so they are left out. `cdf`: a buffer of the vocabulary's size to sum into."""
    nonzero = np.flatnonzero(probs) if np.count_nonzero(probs) * 4 < probs.size else None
    kept = probs if nonzero is None else probs[nonzero]
    cdf = np.cumsum(kept, out=None if cdf is None else cdf[:kept.size])
    cdf /= cdf[-1]
    index = int(np.searchsorted(cdf, rng.random(), side="right"))
    return index if nonzero is None else int(nonzero[index])


def _kth_largest(values: np.ndarray, k: int):
    """np.partition(values, -k)[-k], partitioning only the values near the largest (a partition of 49k entries took
    0.25-0.4 ms a token): the k-th largest of the values at least t is the k-th largest of all once k of them are."""
    largest = values.max()
    for spread in (4.0, 16.0, 64.0):
        near = values[values >= largest - spread]
        if near.size >= k:
            return np.partition(near, -k)[-k]
    return np.partition(values, -k)[-k]


# The tokens top_p's cut looks among: those within FIRST_RATIO of the likeliest (a model's usual distribution: a few
# hundred at most, one pass). Where they are many (a flat distribution), the narrower sets first, and where they hold
# too little of the mass, the wider ones: the first set whose mass reaches top_p is sorted (steps of 10**0.5: a flat
# distribution's few thousand tokens, not its whole vocabulary); the last, 0, is every token.
FIRST_RATIO = 1e-3
NARROWER_RATIOS = tuple(10.0 ** -np.arange(0.5, 3.0, 0.5))  # 0.32 .. 0.0032
WIDER_RATIOS = (*(10.0 ** -np.arange(3.5, 6.5, 0.5)), 0.0)  # 3.2e-4 .. 1e-6, then every token


def _top_p_kept(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids top_p keeps: the smallest run of the likeliest tokens whose mass reaches top_p (at least one token),
    i.e. order[:searchsorted(cumsum(probs[order]), top_p) + 1] for order = argsort(-probs, kind="stable"), tied tokens
    at the cut taken lower id first (float16 logits tie often). Only the values are sorted, not their ids: the
    descending values, and so their cumulative sums, are the same whatever order ties are in, and the cut's value
    then picks the ids. Only the tokens within a factor of the likeliest are sorted, where they hold top_p's mass:
    they are the likeliest, so their cumulative sums are the full ones' first. (SmolLM2 at temperature 1.5-2, top_p
    0.9-0.95: a stable argsort of all 49k entries had taken 4.5 ms a token, a fifth of a decode step; now 0.3-2.3.)"""
    likeliest = probs.max()
    first = probs >= likeliest * FIRST_RATIO
    if probs.sum(where=first) < top_p * 0.999:  # short of top_p's mass (a rounding margin)
        ladder = WIDER_RATIOS
    elif np.count_nonzero(first) * 16 > probs.size:
        ladder = (*NARROWER_RATIOS, FIRST_RATIO, *WIDER_RATIOS)
    else:
        ladder = (FIRST_RATIO, *WIDER_RATIOS)
    for ratio in ladder:
        chosen = first if ratio == FIRST_RATIO else probs >= likeliest * ratio
        if ratio and probs.sum(where=chosen) < top_p * 0.999:
            continue
        ids = np.flatnonzero(chosen)
        values = probs[ids]
        descending = np.sort(values)[::-1]
        cumulative = np.cumsum(descending)
        if ratio and cumulative[-1] < top_p:
            continue
        count = min(int(np.searchsorted(cumulative, top_p)) + 1, descending.size)
        cut = descending[count - 1]
        above = ids[values > cut]
        return np.concatenate([above, ids[values == cut][: count - above.size]])  # ids ascend: ties lower id first
    raise AssertionError("unreachable: the last ratio, 0, takes every token")


def _logprobs(logits: np.ndarray, token: int, alternatives: int) -> dict[int, float]:
    """{token: its log-probability} and the `alternatives` likeliest tokens' (log-softmax), likeliest first, the
    chosen token first of all; -inf logits (masked tokens) have -inf. The exponentials in float32 (a third of
    float64's time, ~0.1 ms over 49k entries: a scored prompt takes one per position), summed in float64: the
    log-probabilities agree with a float64 log-softmax within ~1e-7."""
    values = logits if logits.dtype in (np.float32, np.float64) else logits.astype(np.float32)
    largest = values.max()
    with np.errstate(over="ignore"):  # logits spanning more than float32's range: those far below are -inf, as exp'd
        log_sum = float(np.log(np.exp(values - largest).sum(dtype=np.float64)))

    def log_probability(index) -> float:  # (value - largest) - log_sum: largest + log_sum first lost the difference
        return (float(values[index]) - float(largest)) - log_sum  # to rounding at huge logits (ties all read 0)

    chosen = {token: log_probability(token)}
    if alternatives == 0:
        return chosen
    if alternatives == 1:  # argmax takes the lowest id among ties, as the general rule below does
        best = int(values.argmax())
        return chosen | {best: log_probability(best)}
    if alternatives < values.size:  # every token as likely as the k-th, so that ties go to the lower id
        cut = _kth_largest(values, alternatives)
        candidates = np.flatnonzero(values >= cut)
    else:
        candidates = np.arange(values.size)
    top = candidates[np.lexsort((candidates, -values[candidates]))][:alternatives]
    return chosen | {int(i): log_probability(i) for i in top}


def _check_samplable(logits: np.ndarray) -> None:
    # One reduction over the vocabulary (5.7 us measured for 49k entries, against a step of milliseconds): NaN
    # propagates through max, and a max of -inf means no token has any probability.
    largest = logits.max()
    if np.isnan(largest):
        raise ModelOutputError(f"the model's logits contain NaN at {int(np.isnan(logits).sum())} of {logits.size} "
                               f"vocabulary entries; the artifact's graphs produce non-finite values (rebuild it, "
                               f"or check with `aotlm eval`)")
    if largest == -np.inf:
        raise ModelOutputError("every logit is -inf: no token can be sampled; the artifact's graphs mask the whole "
                               "vocabulary")
    if largest == np.inf:  # an overflow: greedy would return it, sampling would compute inf - inf
        raise ModelOutputError(f"the model's logits are +inf at {int(np.isposinf(logits).sum())} of {logits.size} "
                               f"vocabulary entries: the artifact's graphs overflow (rebuild it, or check with "
                               f"`aotlm eval`)")


def last_token_logits(logits: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """[batch, vocab]: each row's logits at its last prompt token. A prefill graph returns just those ("last", the
    default) or every position's, [batch, sequence, vocab] (a recipe's export.prefill_logits: all)."""
    if logits.ndim == 2:
        return logits
    return logits[np.arange(len(lengths)), np.asarray(lengths) - 1]
