"""benchmarks/gguf_tokenizers.py counts what it should: a folder in llama.cpp's test-vector layout, made here from a
SentencePiece model (so no download), with one .out line altered and one vocabulary of a pre-tokenizer type aotlm
refuses."""
from __future__ import annotations

import io
import json

import gguf

from benchmarks.gguf_tokenizers import main, read_vectors
from tests.compiler.test_gguf_tokenizer import USER_SYMBOL, documentation_lines, gguf_metadata
from tests.compiler.test_frontend import write_sentencepiece_metadata

SEPARATOR = "\n__ggml_vocab_test__\n"


def write_vocabulary(path, architecture: str, write_tokenizer) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    write_tokenizer(writer)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def test_it_counts_equal_texts_names_the_first_difference_and_reports_refusals(tmp_path):
    import sentencepiece

    model = io.BytesIO()
    lines = documentation_lines()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines[:2000]), model_writer=model, vocab_size=600, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, user_defined_symbols=[USER_SYMBOL],
        minloglevel=2, num_threads=1)
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    write_vocabulary(tmp_path / "ggml-vocab-spm.gguf", "llama",
                     lambda writer: write_sentencepiece_metadata(writer, gguf_metadata(processor, True)))
    texts = ["Return the value.", " ", "", "tabs\tand ☃", lines[3000]]
    ids = [processor.encode(text) for text in texts]
    ids[3] = ids[3] + [5]  # llama.cpp "said" otherwise for the fourth text
    (tmp_path / "ggml-vocab-spm.gguf.inp").write_text(SEPARATOR.join(texts) + SEPARATOR, encoding="utf-8")
    (tmp_path / "ggml-vocab-spm.gguf.out").write_text("".join(" ".join(map(str, i)) + "\n" for i in ids))

    def byte_level(writer):
        writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("tekken")
        writer.add_token_list(["a", "b"]), writer.add_token_types([1, 1]), writer.add_token_merges([])

    write_vocabulary(tmp_path / "ggml-vocab-other.gguf", "llama", byte_level)
    (tmp_path / "ggml-vocab-other.gguf.inp").write_text("a" + SEPARATOR, encoding="utf-8")
    (tmp_path / "ggml-vocab-other.gguf.out").write_text("0\n")
    write_vocabulary(tmp_path / "ggml-vocab-untested.gguf", "llama", byte_level)  # no .inp/.out: not listed

    assert [text for text, _ in read_vectors(tmp_path / "ggml-vocab-spm.gguf")] == texts
    assert main(["--models", str(tmp_path), "--out", str(tmp_path / "out.json")]) == 0
    rows = {row["vocabulary"]: row for row in json.loads((tmp_path / "out.json").read_text())["vocabularies"]}
    assert set(rows) == {"spm", "other"}
    assert (rows["spm"]["equal"], rows["spm"]["texts"], rows["spm"]["first_mismatch"]["text"]) == (4, 5, texts[3])
    assert rows["spm"]["architecture_supported"] and rows["spm"]["pre"] is None
    assert rows["other"]["equal"] is None and "pre-tokenizer type 'tekken'" in rows["other"]["refused"]
