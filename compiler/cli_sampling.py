"""The sampling options `aotlm run` and `aotlm chat` share: one set of flags, one check, one mapping to
runtime.sampling.SamplingParams' keywords (whose own checks refuse bad values before anything runs)."""
from __future__ import annotations

from compiler.errors import UsageError, nonnegative_int, text_argument


def add_sampling_options(parser) -> None:
    # No defaults in the flags themselves: a flag not given leaves the option to the model's own default
    # (--generation-config auto), else to aotlm's (shown in the help)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 = greedy (aotlm's default; a model's generation config may set another)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=None, help="sample within this probability mass (1 = all)")
    parser.add_argument("--min-p", type=float, default=None,
                        help="sample among tokens at least this fraction as likely as the likeliest (0 = all)")
    parser.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                        help="auto: options not given take the model's own defaults where it ships them "
                             "(generation_config.json, a GGUF's general.sampling; `aotlm inspect` shows them), as "
                             "vLLM and transformers do; none: aotlm's (greedy)")
    parser.add_argument("--seed", type=nonnegative_int, default=None, help="sampling seed, for reproducible samples")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="P",
                        help="divide the positive logits of tokens in the prompt or output by P, multiply negative "
                             "ones (transformers' and vLLM's; 1 = none; greedy decoding too)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="A",
                        help="subtract A from the logits of tokens the output holds (OpenAI's; -2..2, 0 = none)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="A",
                        help="subtract A per occurrence in the output (OpenAI's; -2..2, 0 = none)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", type=text_argument,
                        help="end the text before this string (repeatable; the model's end-of-sequence tokens stop "
                             "too, unless --ignore-eos)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="go on past the model's end-of-sequence tokens, to --max-new-tokens or a --stop string "
                             "(vLLM's ignore_eos: a fixed output length to time)")
    parser.add_argument("--min-new-tokens", type=nonnegative_int, default=0, metavar="N",
                        help="no end-of-sequence token, and no --stop string ending, within the first N new tokens "
                             "(vLLM's min_tokens)")


def sampling_options(args, manifest: dict | None = None) -> dict:
    """SamplingParams' keywords from the flags given, after refusing flags that greedy decoding would silently ignore
    and values SamplingParams refuses (a RequestError: one line, exit status 2), before the caller loads the weights.
    manifest: the artifact's, whose model defaults (--generation-config auto) the engine applies to the options not
    given, which decide whether it samples."""
    from runtime.sampling import model_defaults

    model = model_defaults(manifest) if manifest is not None and args.generation_config == "auto" else {}
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    sampling_only = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                                              ("--min-p", args.min_p), ("--seed", args.seed)) if value is not None]
    temperature = args.temperature if args.temperature is not None else model.get("temperature", 0.0)
    if temperature == 0 and sampling_only:  # greedy ignores them: the user would believe they sampled
        default = ("the default" if args.temperature is None else "given")
        raise UsageError(f"{', '.join(sampling_only)}: {'they shape' if len(sampling_only) > 1 else 'it shapes'} "
                         f"sampling, but --temperature 0 ({default}) decodes greedily; add --temperature > 0")
    from runtime.errors import RequestError
    from runtime.sampling import SamplingParams

    options = dict(max_new_tokens=args.max_new_tokens, seed=args.seed,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   stop_strings=tuple(args.stop), ignore_eos=args.ignore_eos, min_new_tokens=args.min_new_tokens,
                   **{name: value for name, value in given.items() if value is not None})
    try:
        SamplingParams(**options)  # out-of-range values: refused now, not after seconds of loading weights
    except RequestError as error:  # its message names the keyword ("min_p: 2.0 ..."): name the flag given instead
        keyword, colon, rest = str(error).partition(":")
        if colon and keyword in options:
            raise UsageError(f"{FLAGS.get(keyword, '--' + keyword.replace('_', '-'))}:{rest}") from None
        raise
    return options


FLAGS = {"stop_strings": "--stop"}  # SamplingParams' keywords whose flag is not the keyword with dashes
