"""`aotlm eval` and `aotlm compare`: perplexity of an artifact on a text, or of two side by side (top-1 agreement,
KL), by the sliding-window evaluation in runtime/evaluate.py, with a progress bar over windows.

Only `runtime/` is used (imported when called), as a deployed artifact would be.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from compiler.console import ReaderAwareConsole, console, message, print_table, warning
from compiler.errors import NO_SPIN_HELP, check_output_file, thread_count, user_path


class _ArtifactInfo:
    """One artifact to evaluate: its folder and manifest, read (cheaply) before any graph is loaded."""

    def __init__(self, path: str):
        from runtime.manifest import check_files, read_manifest

        self.path = path
        self.manifest = read_manifest(path)  # a folder that is not an artifact fails here, in one line
        check_files(path, self.manifest)  # a missing or cut file, before any of them is read
        self.name = self.manifest["name"]
        self.max_context = self.manifest["kv_cache"]["max_context"]
        self.bytes = sum(record["bytes"] for record in self.manifest["files"].values())
        self.tokenizer_file = Path(path) / self.manifest["tokenizer"]["file"]


def _evaluation_tokens(args, artifacts: list[_ArtifactInfo]) -> list[int]:
    """The text (a file, or builtin:NAME) as token ids without BOS, its first --max-tokens; >= 2 or an error. Only
    as much of the text is tokenized as that needs, and as the artifacts' build reports scored of it (to tell
    whether this is their text: `_warn_if_not_the_report_text`)."""
    from runtime.evaluate import EvaluationError, builtin_text, encode_text
    from runtime.text_files import TextFile, TextFileError, text_problem
    from runtime.tokenizer import TextTokenizer

    source = args.text
    if args.max_tokens < 2:
        raise EvaluationError(f"--max-tokens must be >= 2 (one token of context, one scored), got {args.max_tokens}")
    if source.startswith("builtin:"):
        from runtime.evaluate import BUILTIN_TEXTS

        name = source.removeprefix("builtin:")
        if name not in BUILTIN_TEXTS:  # spelled as --text takes them (the function's own names lack the prefix)
            raise EvaluationError(f"--text {source}: unknown built-in text; give "
                                  f"{' or '.join('builtin:' + known for known in BUILTIN_TEXTS)}")
        text = builtin_text(name)
    else:
        try:
            text = TextFile(source, f"--text {source}")  # CRLF scored as written; no byte-order mark
        except FileNotFoundError:
            raise EvaluationError(f"--text {source}: no such file") from None
        except OSError as error:
            raise EvaluationError(f"--text {source}: cannot read it ({error})") from None
        except TextFileError as error:
            raise EvaluationError(str(error)) from None
    reported = [_report_tokens(args, artifact)[1] for artifact in artifacts]
    tokenizer = TextTokenizer(artifacts[0].tokenizer_file)
    try:  # only as much of a file is read as the tokens need
        ids = encode_text(tokenizer, text, max([args.max_tokens, *reported]))
    except TextFileError as error:
        raise EvaluationError(str(error)) from None
    except OSError as error:
        raise EvaluationError(f"--text {source}: cannot read it ({error})") from None
    finally:
        if isinstance(text, TextFile):
            text.close()  # what it read stays readable (text_read)
    problem = text_problem(text.text_read if isinstance(text, TextFile) else text)
    if problem:  # a perplexity of UTF-16 read as UTF-8, or of zeros, compares with nothing
        raise EvaluationError(f"--text {source}: it {problem}")
    for artifact in artifacts:
        _warn_if_not_the_report_text(args, artifact, ids)
    token_ids = ids[: args.max_tokens]
    if len(token_ids) < 2:
        raise EvaluationError(f"--text {source}: {len(token_ids)} token(s); scoring needs at least 2")
    return token_ids


def _report_tokens(args, artifact: _ArtifactInfo) -> tuple[str | None, int]:
    """The fingerprint and count of the tokens the build report scored, when --text is that report's text."""
    held_out = (artifact.manifest.get("accuracy") or {}).get("held_out") or {}
    recorded, count = held_out.get("tokens_sha256"), held_out.get("tokens")
    from runtime.evaluate import BUILTIN_SOURCE

    builtin = str(held_out.get("text")).startswith(BUILTIN_SOURCE)  # a file's path may hold "pydoc" too
    if args.text != "builtin:pydoc-held-out" or not recorded or not count or not builtin:
        return None, 0
    return recorded, int(count)


def _warn_if_not_the_report_text(args, artifact: _ArtifactInfo, token_ids: list[int]) -> None:
    """builtin:pydoc-held-out is Python's documentation, which changes between Python releases: say so when this
    Python's text is not the one the artifact's build report scored (their perplexities are then not comparable).
    `token_ids` holds at least as many of the text's tokens as the report scored, where the text has them."""
    import platform

    from runtime.evaluate import tokens_fingerprint

    recorded, count = _report_tokens(args, artifact)
    if not recorded or (len(token_ids) >= count and tokens_fingerprint(token_ids[:count]) == recorded):
        return
    held_out = artifact.manifest["accuracy"]["held_out"]
    warning(f"this Python's ({platform.python_version()}) built-in documentation text is not the one "
            f"{artifact.name}'s build report scored (Python {held_out.get('python')}): compare this perplexity with "
            f"the report's only when both come from the same text")


def _window_and_stride(args, artifacts: list[_ArtifactInfo]) -> tuple[int, int]:
    """--window (default 512, at most the smallest max context of `artifacts`) and --stride (default window / 2),
    checked."""
    from runtime.evaluate import EvaluationError, window_spans

    max_context = min(artifact.max_context for artifact in artifacts)
    window = min(512, max_context) if args.window is None else args.window
    if window > max_context:
        limiting = next(artifact for artifact in artifacts if artifact.max_context == max_context)
        raise EvaluationError(f"--window {window} exceeds the max context of {limiting.path} ({max_context})")
    stride = max(1, window // 2) if args.stride is None else args.stride
    try:
        window_spans(0, window, stride)  # checks window >= 2 and 1 <= stride <= window
    except EvaluationError as error:  # name only the flags the user gave: a default stride is not theirs
        given = f"--window {window}" + ("" if args.stride is None else f" --stride {stride}")
        raise EvaluationError(f"{given}: {error}") from None
    return window, stride


def _score(args, candidate: _ArtifactInfo, reference: _ArtifactInfo | None, token_ids: list[int], window: int, stride: int):
    """Run the sliding-window evaluation with a progress bar over windows."""
    from rich.progress import Progress

    from runtime import Engine
    from runtime.evaluate import decode_logits_for, evaluate, window_spans

    def load(scored: _ArtifactInfo):
        # Scoring runs multi-token windows, bound by arithmetic, not by reading the weights: no huge pages.
        return decode_logits_for(Engine.load(scored.path, intra_op_threads=args.threads, huge_pages=False,
                                             spin_during_run=not args.no_spin))

    model = load(candidate)
    reference_logits = load(reference) if reference is not None else None
    with Progress(console=console) as progress:
        label = candidate.name if reference is None else f"{reference.name} vs {candidate.name}"
        task = progress.add_task(f"scoring {label}", total=len(window_spans(len(token_ids), window, stride)))
        return evaluate(token_ids, model, window=window, stride=stride, reference_logits_for=reference_logits,
                        on_window=lambda done, total: progress.update(task, completed=done))


def _results_console(args):
    """Where the result table goes: stdout, as the command's output (`aotlm eval ... > result.txt`), unless the JSON
    goes there (--json -, /dev/stdout); progress and warnings stay on stderr."""
    return console if json_on_stdout(args.json) else ReaderAwareConsole(file=sys.stdout, emoji=False)


def json_on_stdout(path: str | None) -> bool:
    """Whether the JSON goes to this process's stdout: "-", or a stream that is stdout (/dev/stdout, /proc/self/fd/1)."""
    from runtime.results import is_stream

    if path == "-":
        return True
    if not path or not is_stream(path):
        return False
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # a stdout with no descriptor (a test's): not that one
        return False


def _write_json(path: str | None, payload: dict) -> None:
    from runtime.results import shown_path, write_json

    if path:
        message(f"wrote {escape(shown_path(write_json(path, payload)))}")


def perplexity_text(perplexity: float) -> str:
    """Four decimals, or four digits where that is long (a broken artifact's 1e200 printed as a 201-digit number)."""
    return f"{perplexity:.4f}" if perplexity < 1e6 else f"{perplexity:.4g}"


def _window_shown(window: int, tokens: int) -> str:
    """The window the evaluation used: fewer tokens than --window (a short text, or --max-tokens) are one window."""
    return str(window) if tokens >= window else f"{tokens} (all of them; --window {window})"


def _stride_shown(window: int, stride: int, tokens: int) -> str:
    """The stride, or "- (one window)" where the text is one window and no window follows it."""
    return str(stride) if tokens > window else "- (one window)"


def eval_command(args) -> None:
    check_output_file(args.json, "--json")
    artifact = _ArtifactInfo(args.artifact)
    window, stride = _window_and_stride(args, [artifact])
    token_ids = _evaluation_tokens(args, [artifact])
    result = _score(args, artifact, None, token_ids, window, stride)
    table = Table(title=f"perplexity on {escape(args.text)} ({len(token_ids)} tokens, no BOS)")
    for column in ("artifact", "MiB", "tokens scored", "window", "stride", "perplexity"):
        table.add_column(column, justify="left" if column == "artifact" else "right")
    table.add_row(escape(artifact.name), f"{artifact.bytes / 2**20:.2f}", str(result.tokens_scored),
                  _window_shown(window, len(token_ids)), _stride_shown(window, stride, len(token_ids)),
                  perplexity_text(result.perplexity))
    print_table(table, _results_console(args))
    from runtime.evaluate import tokens_fingerprint

    _write_json(args.json, {"artifact": str(args.artifact), "name": artifact.name, "bytes": artifact.bytes,
                            "text": args.text, "tokens": len(token_ids), "tokens_sha256": tokens_fingerprint(token_ids),
                            **result.to_dict()})


def compare_command(args) -> None:
    from runtime.evaluate import EvaluationError

    check_output_file(args.json, "--json")
    reference, candidate = _ArtifactInfo(args.reference), _ArtifactInfo(args.candidate)
    if reference.tokenizer_file.read_bytes() != candidate.tokenizer_file.read_bytes():
        raise EvaluationError(f"{args.reference} and {args.candidate} have different tokenizers "
                              f"({reference.tokenizer_file.name} differs); compare needs the same tokens and "
                              f"vocabulary")
    vocabularies = [artifact.manifest["model"]["config"]["vocab_size"] for artifact in (reference, candidate)]
    if vocabularies[0] != vocabularies[1]:  # from the manifests, before either model loads and scoring starts
        raise EvaluationError(f"{args.reference} scores {vocabularies[0]} vocabulary entries and {args.candidate} "
                              f"{vocabularies[1]}; top-1 agreement and KL need the same vocabulary")
    window, stride = _window_and_stride(args, [reference, candidate])
    token_ids = _evaluation_tokens(args, [reference, candidate])  # the same tokenizer (checked above)
    result = _score(args, candidate, reference, token_ids, window, stride)
    table = Table(title=f"{escape(args.text)}: {result.tokens_scored} tokens scored, window "
                        f"{_window_shown(window, len(token_ids))}, "
                        f"stride {_stride_shown(window, stride, len(token_ids))}; "
                        f"B against A (KL(A || B), nats per token)")
    for column in ("", "artifact", "MiB", "perplexity", "top-1 agreement", "mean KL"):
        table.add_column(column, justify="left" if column in ("", "artifact") else "right")
    table.add_row("A", escape(reference.name), f"{reference.bytes / 2**20:.2f}", perplexity_text(result.reference_perplexity), "", "")
    table.add_row("B", escape(candidate.name), f"{candidate.bytes / 2**20:.2f}", perplexity_text(result.perplexity),
                  f"{result.top1_agreement:.2%}", f"{result.mean_kl:.3g}")  # the build report's: 6.92e-07, not 0.000001
    print_table(table, _results_console(args))
    describe = lambda scored, path, perplexity, nll: {  # noqa: E731
        "artifact": str(path), "name": scored.name, "bytes": scored.bytes, "perplexity": perplexity, "mean_nll": nll}
    from runtime.evaluate import tokens_fingerprint

    _write_json(args.json, {
        "text": args.text, "tokens": len(token_ids), "tokens_sha256": tokens_fingerprint(token_ids),
        "tokens_scored": result.tokens_scored, "windows": result.windows,
        "window": window, "stride": stride,
        "reference": describe(reference, args.reference, result.reference_perplexity, result.reference_mean_nll),
        "candidate": describe(candidate, args.candidate, result.perplexity, result.mean_nll),
        # mean_kl (in nats) as eval's JSON, Evaluation.to_dict and the manifest's accuracy report name it
        "top1_agreement": result.top1_agreement, "mean_kl": result.mean_kl,
        "kl_direction": "KL(reference || candidate)",
    })


def add_evaluation_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--text", type=user_path, required=True,
                         help="UTF-8 text file, or builtin:pydoc-held-out (the last ~10%% of Python's docs)")
    command.add_argument("--max-tokens", type=int, default=4096, help="score the first N tokens (default: 4096)")
    command.add_argument("--window", type=int, default=None,
                         help="tokens per window (default: 512, or the max context if smaller)")
    command.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: window / 2)")
    command.add_argument("--json", type=user_path, default=None, metavar="OUT", help="also write the results to this JSON file (- for stdout)")
    command.add_argument("--threads", type=thread_count, default=None, help="onnxruntime intra-op threads (default: artifact's)")
    command.add_argument("--no-spin", action="store_true", help=NO_SPIN_HELP)
