"""Text <-> token ids with the artifact's tokenizer.json (Hugging Face `tokenizers`), and streaming detokenization."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from runtime.errors import ArtifactError


class TextTokenizer:
    def __init__(self, path: str | Path, bos_token_id: int | None = None):
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on a bad file
            raise ArtifactError(f"{path}: cannot read the tokenizer ({error}); rebuild the artifact") from None
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        # The tokenizer.json's post-processor adds BOS when the model wants one; add nothing by hand.
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens arriving one by one into text pieces, holding back incomplete UTF-8 sequences.

    Decodes the window since the last emitted boundary, so each step costs O(window), not O(text).
    """

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the window re-decoded for context (spaces depend on it)
        self.read_offset = 0  # tokens before this were already emitted

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""
