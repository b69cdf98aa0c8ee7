"""The tokenizers aotlm rebuilds from GGUF metadata, against llama.cpp's own tokenizer test vectors.

    .venv/bin/python benchmarks/gguf_tokenizers.py [--models DIR | --sdist FILE] [--version V] [--out F]

llama.cpp tests its tokenizers on vocabulary-only GGUF files (models/ggml-vocab-<name>.gguf) with texts
(<name>.gguf.inp, separated by `__ggml_vocab_test__` lines) and the token ids they must give (<name>.gguf.out, one
line per text, written by the model's own Hugging Face tokenizer in llama.cpp's convert_hf_to_gguf_update.py, which
llama.cpp's test-tokenizer-0 checks itself against, encoding without BOS and without parsing special tokens). Those files ship in the
llama-cpp-python source distribution on PyPI: by default this script downloads it (`pip download`, no build, ~77 MB,
kept under benchmarks/results/cache/) and reads them from there; --sdist uses a downloaded one, --models a folder of
such files. Per vocabulary: its architecture and tokenizer type, and how many texts aotlm's tokenizer.json encodes to
the expected ids (or the error that refuses it). A table on the console, JSON in
benchmarks/results/gguf_tokenizers.json (--out).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from compiler.errors import BuildError  # noqa: E402
from compiler.frontend.config import SUPPORTED_ARCHITECTURES  # noqa: E402
from compiler.frontend.gguf_loader import _field, _open_reader  # noqa: E402
from runtime.results import write_json  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import output_file  # noqa: E402
from compiler.frontend.gguf_tokenizer import tokenizer_json_from_gguf  # noqa: E402
from compiler.console import print_table  # noqa: E402

SEPARATOR = "\n__ggml_vocab_test__\n"
VOCAB_PREFIX = "ggml-vocab-"
CACHE = REPO / "benchmarks" / "results" / "cache" / "llama-cpp-python"


def read_vectors(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of a vocabulary's .inp and .out files."""
    with open(f"{vocab}.inp", encoding="utf-8", newline="") as handle:  # a text's own "\r" stays one
        texts = handle.read().split(SEPARATOR)
    lines = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    if texts and texts[-1] == "":  # the .inp ends with a separator (its texts " " and "" are texts like any other)
        texts = texts[:-1]
    lines = lines[: len(texts)]
    if len(lines) != len(texts):
        raise ValueError(f"{vocab}: {len(texts)} texts in .inp but {len(lines)} lines in .out")
    return [(text, [int(token) for token in line.split()]) for text, line in zip(texts, lines)]


def check_vocabulary(vocab: Path) -> dict:
    from tokenizers import Tokenizer

    reader = _open_reader(str(vocab))
    field = lambda key: _field(reader, key)  # noqa: E731
    row = {"vocabulary": vocab.name.removeprefix(VOCAB_PREFIX).removesuffix(".gguf"),
           "architecture": field("general.architecture"), "model": field("tokenizer.ggml.model"),
           "pre": field("tokenizer.ggml.pre")}
    row["architecture_supported"] = row["architecture"] in SUPPORTED_ARCHITECTURES
    vectors = read_vectors(vocab)
    row["texts"] = len(vectors)
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json_from_gguf(field, str(vocab)))
    except BuildError as error:
        return {**row, "equal": None, "refused": str(error).split(": ", 1)[-1]}
    mismatches = [(text, ids, tokenizer.encode(text, add_special_tokens=False).ids) for text, ids in vectors]
    mismatches = [(text, ids, got) for text, ids, got in mismatches if got != ids]
    row["equal"] = len(vectors) - len(mismatches)
    row["first_mismatch"] = ({"text": mismatches[0][0], "llama_cpp": mismatches[0][1], "aotlm": mismatches[0][2]}
                             if mismatches else None)
    return row


def vocabularies(models: Path) -> list[Path]:
    """The vocabulary files that have test vectors beside them."""
    return [path for path in sorted(models.glob(f"{VOCAB_PREFIX}*.gguf"))
            if Path(f"{path}.inp").is_file() and Path(f"{path}.out").is_file()]


def models_from_sdist(sdist: Path, into: Path) -> Path:
    """Extract <sdist>/vendor/llama.cpp/models/ggml-vocab-* into `into`; returns that folder."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers()
                   if "/vendor/llama.cpp/models/" in m.name and Path(m.name).name.startswith(VOCAB_PREFIX) and m.isfile()]
        if not members:
            raise SystemExit(f"{sdist}: no vendor/llama.cpp/models/{VOCAB_PREFIX}* files; is it llama-cpp-python's sdist?")
        for member in members:
            member.name = Path(member.name).name  # flat, and nothing outside `into`
            if hasattr(tarfile, "data_filter"):  # Python 3.10.12 / 3.11.4 and later
                archive.extract(member, into, filter="data")
            else:  # a regular file under its base name: nothing it names can land outside `into`
                archive.extract(member, into)
    return into


def download_sdist(version: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    print(f"downloading llama-cpp-python {version}'s source distribution (~77 MB, not built) into {into}")
    command = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
               "--no-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(into)]
    if subprocess.run(command).returncode != 0:
        raise SystemExit("pip could not download llama-cpp-python's sdist (offline?): pass --sdist FILE or --models DIR")
    return next(into.glob(f"llama_cpp_python-{version}.tar.gz"))


def show(rows: list[dict]) -> None:
    table = Table(title="GGUF tokenizers: aotlm's tokenizer.json against llama.cpp's test vectors")
    for column in ("vocabulary", "architecture", "tokenizer", "texts equal", "first difference / refusal"):
        table.add_column(column)
    for row in rows:
        architecture = row["architecture"] + ("" if row["architecture_supported"] else " (not loaded by aotlm)")
        if row["equal"] is None:
            result, note = "refused", row["refused"][:90]
        else:
            result = f"{row['equal']}/{row['texts']}"
            mismatch = row["first_mismatch"]
            note = "" if mismatch is None else (f"{mismatch['text'][:30]!r}: llama.cpp {mismatch['llama_cpp'][:6]}, "
                                                f"aotlm {mismatch['aotlm'][:6]}")
        table.add_row(row["vocabulary"], architecture, f"{row['model']}/{row['pre']}", result, note)
    print_table(table, Console())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--models", type=Path, help="a folder of ggml-vocab-*.gguf files with .inp/.out beside them")
    source.add_argument("--sdist", type=Path, help="llama-cpp-python's .tar.gz source distribution")
    parser.add_argument("--version", default="0.3.36", help="the llama-cpp-python release to download")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gguf_tokenizers.json")
    args = parser.parse_args(argv)
    output_file(parser, args.out)  # before the download and the tokenizing, not a traceback after them
    if args.models is not None and not args.models.is_dir():
        parser.error(f"--models {args.models}: not a folder")
    if args.sdist is not None and not args.sdist.is_file():
        parser.error(f"--sdist {args.sdist}: no such file")
    models = args.models
    if models is None:
        sdist = args.sdist or download_sdist(args.version, CACHE)
        models = models_from_sdist(sdist, CACHE / f"models-{sdist.name.removesuffix('.tar.gz')}")
    found = vocabularies(models)
    if not found:
        parser.error(f"{models}: no {VOCAB_PREFIX}*.gguf files with .inp and .out beside them")
    rows = [check_vocabulary(vocab) for vocab in found]
    show(rows)
    write_json(args.out, {"source": str(args.sdist or models), "vocabularies": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
