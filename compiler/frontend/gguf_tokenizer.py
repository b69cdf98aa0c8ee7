"""tokenizer.json text (Hugging Face `tokenizers`) for the tokenizer a GGUF file describes in its `tokenizer.ggml.*`
metadata, built the way llama.cpp tokenizes with it (llama-vocab.cpp), so that an artifact's prompts become the tokens
llama.cpp would give the model:

- model "gpt2": byte-level BPE from the stored merges (SmolLM2, Llama 3, Qwen2), split first by the regex of its
  `tokenizer.ggml.pre` type;
- model "llama": SentencePiece BPE (Llama 2, TinyLlama, Mistral 7B, CodeLlama), ranked by the stored piece scores,
  with byte fallback for characters the vocabulary lacks.
"""
from __future__ import annotations

from collections import Counter

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from compiler.errors import BuildError
from runtime.tokenizer import bytes_to_unicode

# How llama.cpp splits text before byte-level BPE, by tokenizer.ggml.pre (llama-vocab.cpp): each type's regexes
# run one after another, each cutting every piece so far at its matches (what a Sequence of isolating Splits does).
# The types here are llama.cpp's for the architectures aotlm loads; another type is refused rather than split wrongly.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_LETTERS = (  # llama.cpp's list of cased-letter ranges, for DeepSeek LLM's \s?\p{L}+
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# llama.cpp's LLAMA3 pre-tokenizer type: its BPE takes a word that is in the vocabulary whole (ignore_merges, as
# Llama 3's tokenizer.json says), and it adds BOS unless the file's add_bos_token says not to.
LLAMA3_PRE_TYPES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                    "jina-v5-nano")
# SmolLM2's own tokenizer.json splits digits off the same way, with a Digits(individual_digits) pre-tokenizer.
_DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(LLAMA3_PRE_TYPES + ("smaug-bpe", "dbrx"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"), (_QWEN2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS_THEN_GPT2),
    **dict.fromkeys(("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "olmo", "jais", "trillion",
                     "granite-docling", "exaone4"), (GPT2_SPLIT,)),
    "deepseek-llm": ("[\r\n]", rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    # no type (files converted before llama.cpp recorded one) or "default": its DEFAULT regexes
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"),
}
# llama.cpp's llama_token_type, as convert_hf_to_gguf writes tokenizer.ggml.token_type
TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 2, 3, 4
SPACE_MARK = "\u2581"  # SentencePiece's "▁": a space, inside its pieces


def tokenizer_json_from_gguf(field, path: str) -> str:
    """tokenizer.json text for the tokenizer a GGUF describes; field(key) reads its metadata (None when absent)."""
    model = field("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_tokenizer(field, path).to_str()
    if model != "gpt2":
        raise BuildError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; 'gpt2' (byte-level BPE, as in SmolLM2, Llama 3, "
            f"Qwen2) and 'llama' (SentencePiece BPE, as in Llama 2, Mistral 7B) are. Use the model's Hugging Face "
            f"folder (with tokenizer.json) instead."
        )
    return _byte_level_tokenizer(field, path).to_str()


def _byte_level_tokenizer(field, path: str) -> Tokenizer:
    tokens, token_types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type") or []
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def respell(token: str) -> str:
        # A token stored as raw text instead of byte-level symbols is spelled out byte by byte, like transformers.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    # A merge is "left right"; split at the first space after position 0, as llama.cpp does.
    raw_merges = field("tokenizer.ggml.merges") or []
    vocab = _byte_level_vocab(tokens, token_types, respell, raw_merges)
    # Only merges make a byte-level BPE produce its multi-byte tokens: without them every word splits into bytes.
    # A vocabulary of mostly such tokens with no merges is an incomplete file (llama.cpp refuses it too); a
    # byte-only vocabulary with a few placeholders (a random test tokenizer) needs none.
    normal = [t for t, kind in zip(tokens, token_types or [TOKEN_TYPE_NORMAL] * len(tokens)) if kind == TOKEN_TYPE_NORMAL]
    if not raw_merges and sum(len(respell(t)) > 1 for t in normal) > len(normal) // 2:
        raise BuildError(f"{path}: the GGUF's gpt2 tokenizer has no tokenizer.ggml.merges for its "
                         f"{len(normal)}-token vocabulary; the file is incomplete: convert the model again, or use "
                         f"its Hugging Face folder (with tokenizer.json)")
    broken = next((m for m in raw_merges if m.find(" ", 1) < 0), None)
    if broken is not None:
        raise BuildError(f"tokenizer.ggml.merges holds {broken!r}, not 'left right'; the GGUF's tokenizer is damaged: "
                         f"use the model's Hugging Face folder (with tokenizer.json) instead")
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1 :]) for m in raw_merges]
    llama3 = field("tokenizer.ggml.pre") in LLAMA3_PRE_TYPES
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=llama3))
    except Exception as error:  # noqa: BLE001 -- tokenizers raises a bare Exception ("Token `x` out of vocabulary")
        raise BuildError(f"{path}: the GGUF's tokenizer.ggml.merges do not fit its tokenizer.ggml.tokens ({error}): "
                         f"a merge names a piece that is not in the token list, so the file's tokenizer is damaged or "
                         f"its token list was cut short; convert the model again, or use its Hugging Face folder "
                         f"(with tokenizer.json)") from None
    tokenizer.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre"), path)
    tokenizer.decoder = decoders.ByteLevel()
    # A control token is matched whole by the text it is stored as (the vocabulary holds that text: _byte_level_vocab);
    # one kept under its byte-level spelling (a raw "\n\n" marked control is a llama.cpp mislabel) is not.
    _add_marked_tokens(tokenizer, tokens, token_types, vocab, control_usable=lambda token: token in vocab)
    _add_bos(tokenizer, field, tokens, default=llama3)
    if tokenizer.post_processor is None:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _byte_level_vocab(tokens: list, token_types: list, respell, raw_merges: list) -> dict:
    """token -> id for the byte-level BPE. Normal tokens by their byte-level spelling. Control and user-defined tokens
    (added tokens: <｜User｜>, <｜begin▁of▁sentence｜>, " <tag>") are stored by convert_hf_to_gguf as the text they
    stand for, which llama.cpp matches whole in the input and gives back as that text: they keep that text as their key,
    so that they are matched whole under their own id (spelled byte by byte, <｜User｜> became "<ï½ľUserï½ľ>", which
    no input produces, and the text was cut into a dozen byte tokens). Kept spelled out: whitespace-only control tokens
    (a llama.cpp mislabel), a spelling that a merge makes or uses (the merges must find it), and a text another token
    already has."""
    merge_symbols = set()
    for merge in raw_merges:
        cut = merge.find(" ", 1)
        if cut > 0:
            merge_symbols.update((merge[:cut], merge[cut + 1:], merge[:cut] + merge[cut + 1:]))
    kinds = list(token_types) + [TOKEN_TYPE_NORMAL] * (len(tokens) - len(token_types))
    spelled = [respell(token) for token in tokens]
    vocab = {spelling: index for index, spelling in enumerate(spelled)}
    for index, (token, kind) in enumerate(zip(tokens, kinds)):
        if (spelled[index] != token and kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and token not in vocab
                and spelled[index] not in merge_symbols and not (kind == TOKEN_TYPE_CONTROL and token.isspace())
                and vocab.get(spelled[index]) == index):
            del vocab[spelled[index]]
            vocab[token] = index
    return vocab


def _sentencepiece_tokenizer(field, path: str) -> Tokenizer:
    """llama.cpp's SPM tokenizer: spaces become "▁" (and one is put before the text, add_space_prefix), then the
    adjacent pair whose joined piece scores highest merges first, as SentencePiece's BPE does; a character with no
    piece becomes its UTF-8 bytes' <0xXX> tokens. `tokenizers` ranks merges by their order, so the merges are every
    split of a piece into two pieces (control, user-defined and unknown tokens aside), by the joined piece's score
    (ties between different pieces of equal score go by id, where SentencePiece and llama.cpp take the leftmost pair:
    a few are harmless, a file of many is refused, _check_scores_rank_pieces)."""
    tokens, scores, token_types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.scores"), \
        field("tokenizer.ggml.token_type")
    if scores is None or len(scores) != len(tokens) or (token_types is not None and len(token_types) != len(tokens)):
        found = "no tokenizer.ggml.scores" if scores is None else (
            f"{len(scores)} scores and {len(token_types) if token_types is not None else 'no'} token types")
        raise BuildError(f"{path}: the GGUF's SentencePiece ('llama') tokenizer has {len(tokens)} tokens and {found}; "
                         f"it needs one score (and one type, if any) per token: the file is incomplete or damaged, "
                         f"convert the model again, or use its Hugging Face folder (with tokenizer.json)")
    token_types = token_types or [TOKEN_TYPE_NORMAL] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    # llama.cpp merges two adjacent symbols into whatever token their joined text spells (try_add_bigram looks the
    # text up whatever its type: an unused or a byte piece too) and keeps it (resegment); only the tokens it cut out
    # of the text before (control, user-defined, unknown) never occur inside a text it merges.
    mergeable = {token: score for token, score, kind in zip(tokens, scores, token_types)
                 if kind not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)}
    ranked = sorted(((-score, vocab[piece], piece[:cut], piece[cut:]) for piece, score in mergeable.items()
                     for cut in range(1, len(piece)) if piece[:cut] in mergeable and piece[cut:] in mergeable),
                    key=lambda merge: merge[:2])
    _check_scores_rank_pieces([(merge[0], merge[1]) for merge in ranked], path)
    unknown = field("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_UNKNOWN), None)
    if unknown is not None and not 0 <= int(unknown) < len(tokens):
        raise BuildError(f"tokenizer.ggml.unknown_token_id {unknown} is outside the GGUF's {len(tokens)} tokens; the "
                         f"file is damaged: use the model's Hugging Face folder (with tokenizer.json) instead")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for _, _, left, right in ranked],
                                     unk_token=None if unknown is None else tokens[int(unknown)], fuse_unk=True,
                                     byte_fallback=True))
    # llama.cpp puts the space before every run of text that follows a special or user-defined token, not only the
    # first: the normalizer, which runs on each such run, does the same.
    space_prefix = field("tokenizer.ggml.add_space_prefix")
    space_prefix = True if space_prefix is None else bool(space_prefix)
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE_MARK)] if space_prefix else []) + [normalizers.Replace(" ", SPACE_MARK)])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))  # the space the prefix put before the text
    _add_marked_tokens(tokenizer, tokens, token_types, vocab)
    _add_bos(tokenizer, field, tokens, default=True)  # llama.cpp adds BOS for SPM vocabularies unless told not to
    return tokenizer


# Among pieces of equal score llama.cpp merges the leftmost pair; merges ranked by a list cannot do that. Llama 2's
# vocabulary has 15 such pieces of 29612 that merges make (and tokenizes llama.cpp's test texts the same); a file
# whose scores do not rank its pieces (gguf-py writes -1000 for every piece of a vocabulary converted from a
# tokenizer.json) would tokenize otherwise.
MAX_TIED_PIECES = 0.01


def _check_scores_rank_pieces(ranked: list[tuple[float, int]], path: str) -> None:
    pieces = dict((piece, score) for score, piece in ranked)  # piece id -> -score, each merged piece once
    tied = sum(count for count in Counter(pieces.values()).values() if count > 1)
    if tied > MAX_TIED_PIECES * len(pieces):
        raise BuildError(f"{path}: {tied} of the {len(pieces)} pieces its SentencePiece merges make share a score with "
                         f"another (the file's scores do not rank them, as when a vocabulary is converted from a "
                         f"tokenizer.json): llama.cpp merges the leftmost pair among equal scores, which this "
                         f"tokenizer cannot reproduce. Use the model's Hugging Face folder (with tokenizer.json).")


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list, token_types: list, vocab: dict,
                       control_usable=lambda token: True) -> None:
    """Control tokens (<|im_start|>, </s> ...) and the unknown token (<unk>) are matched whole and are special, as
    llama.cpp matches them in a prompt (parse_special) and leaves them out of decoded text; user-defined ones are
    matched whole but decode like text."""
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token, kind in typed
                                  if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) and control_usable(token)])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token, kind in typed
                          if kind == TOKEN_TYPE_USER_DEFINED and token in vocab])


def _add_bos(tokenizer: Tokenizer, field, tokens: list, default: bool) -> None:
    """BOS before the text when the file's add_bos_token says so (default when it is absent), and EOS after it when
    its add_eos_token does (llama.cpp's tokenization with special tokens: embedding models set it)."""
    added = []
    for kind, given, fallback, where in (("bos", "add_bos_token", default, "before"),
                                         ("eos", "add_eos_token", False, "after")):
        token_id, add = field(f"tokenizer.ggml.{kind}_token_id"), field(f"tokenizer.ggml.{given}")
        if not (fallback if add is None else add) or token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise BuildError(f"tokenizer.ggml.{kind}_token_id {token_id} is outside the GGUF's {len(tokens)} tokens; "
                             f"the file is damaged: use the model's Hugging Face folder (with tokenizer.json) instead")
        added.append((where, tokenizer.id_to_token(int(token_id)), int(token_id)))
    if not added:
        return
    before = " ".join(f"{text} " for where, text, _ in added if where == "before")
    after = "".join(f" {text}" for where, text, _ in added if where == "after")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{before}$A{after}", pair=f"{before}$A{after} {before}$B{after}",
        special_tokens=list(dict.fromkeys((text, token_id) for _, text, token_id in added)))


def _pre_tokenizer(pre_type: str | None, path: str):
    splits = PRE_TOKENIZER_SPLITS.get("default" if pre_type is None else pre_type)
    if splits is None:
        raise BuildError(f"{path}: GGUF pre-tokenizer type {pre_type!r} (tokenizer.ggml.pre) is not supported: it "
                         f"decides where text is cut before BPE, and a wrong cut gives the model token sequences it "
                         f"was not trained on. Supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}. Use the model's "
                         f"Hugging Face folder (with tokenizer.json) instead.")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
