"""Load a GGUF file (llama.cpp's format) into the canonical decoder's `LoadedModel`.

This module owns the GGUF-specific knowledge: reading `{arch}.*` metadata into a DecoderConfig,
dequantizing every tensor to float32 in PyTorch's (out, in) layout, renaming llama.cpp's tensor names to
Hugging Face Llama names, and undoing llama.cpp's row permutation of the Q/K projections. The tokenizer.json
comes from the `tokenizer.ggml.*` metadata (compiler/frontend/gguf_tokenizer.py).
"""
from __future__ import annotations

import hashlib
import os
from importlib import metadata
import re
import struct
import sys

import numpy as np
import torch

from compiler.errors import BuildError
from compiler.frontend import hub_id_hint
from compiler.frontend.config import SUPPORTED_ARCHITECTURES, DecoderConfig, LoadedModel
from compiler.frontend.generation_defaults import from_gguf
from compiler.frontend.gguf_tokenizer import tokenizer_json_from_gguf
from compiler.frontend.hf_loader import is_lfs_pointer
from compiler.frontend.random_init import check_state_dict, expected_shapes
from runtime.versions import pip_install

# llama.cpp tensor name -> Hugging Face name (global tensors, then per-block ones under blk.N.).
GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# convert_hf_to_gguf.py permutes Q/K rows only in LlamaModel (which also converts Mistral checkpoints);
# Qwen2Model writes Hugging Face's order unchanged, so un-permuting a qwen2 file would break it.
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def unknown_type_advice() -> str:
    return (f"which the gguf package here ({metadata.version('gguf')}) does not know: a type llama.cpp has since "
            f"removed (such as Q4_0_4_4, the ARM-repacked Q4_0) or one newer than this package; convert or requantize "
            f"the model with a current llama.cpp, or upgrade the gguf package")


def check_gguf_path(path: str) -> str:
    """The recipe's GGUF path, absolute, or BuildError saying what it names instead."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise BuildError(f"{path}: a folder, not a GGUF file; model.path names the .gguf file itself (a Hugging Face "
                         f"folder is model.source: hf)")
    if not os.path.isfile(path):
        raise BuildError(f"GGUF file not found: {path}. Check the model path in the recipe.{hub_id_hint(path, 'gguf')}")
    return path


def load_gguf(path: str, progress: bool | None = None, check_config=None) -> LoadedModel:
    """Read a GGUF file into float32 Hugging Face-named tensors, a DecoderConfig and a tokenizer.json.

    progress: show a progress bar while dequantizing; None shows one when stderr is a terminal.
    check_config: called with the DecoderConfig before any weight is dequantized (the build's context checks), so a
    file it refuses fails in a second rather than after minutes of dequantizing a large model.
    """
    path = check_gguf_path(path)
    reader = _open_reader(path)
    architecture = _field(reader, "general.architecture")
    if architecture is None:  # "architecture None is not supported" said less
        raise BuildError(f"{path}: GGUF metadata key general.architecture is missing; the file cannot describe a "
                         f"model (llama.cpp refuses it too); convert the model again with a current llama.cpp")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise BuildError(
            f"{path}: GGUF architecture {architecture!r} is not supported; the compiler supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-family decoders)."
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = _read_config(reader, architecture, tokens, path)
    # The tokenizer first: an unsupported one fails the build before seconds of dequantizing.
    tokenizer_json = tokenizer_json_from_gguf(lambda key: _field(reader, key), path) if tokens else None
    if check_config is not None:
        check_config(config)
    state_dict = _read_tensors(reader, config, path, progress)
    check_state_dict(config, state_dict, path)
    file_type = _field(reader, "general.file_type")
    defaults, warnings = from_gguf(lambda key: _field(reader, key), "the GGUF's general.sampling")
    return LoadedModel(
        config=config,
        state_dict=state_dict,
        tokenizer_json=tokenizer_json,
        chat_template=_field(reader, "tokenizer.chat_template"),
        generation_defaults=defaults,
        warnings=warnings,
        source={
            "kind": "gguf",
            "path": path,
            "size_bytes": os.path.getsize(path),
            "sha256": _sha256(path),
            "file_type": _file_type_name(file_type),
            "name": _field(reader, "general.name"),
        },
    )


def _open_reader(path: str):
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map (still no copy of the file).

        np.memmap's bookkeeping on every slice makes parsing a 49k-token vocabulary take ~5 s; on a plain
        view of the same mapping it takes ~2 s.
        """

        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, mapped):
            self._plain_data = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs, fields):
            known = {member.value for member in gguf.GGMLQuantizationType}
            for field in fields:  # the package's own error names the type but not the tensor
                kind = int(field.parts[4][0])
                if kind not in known:
                    name = bytes(field.parts[1]).decode("utf-8", "replace")
                    raise BuildError(f"{path}: tensor {name} is stored as GGML type {kind}, {unknown_type_advice()}")
            return super()._build_tensors(start_offs, fields)

    if is_lfs_pointer(path):  # the reader's own error says "GGUF magic invalid"
        raise BuildError(f"{path}: a Git LFS pointer, not the GGUF file; run `git lfs pull` where it was cloned")
    problem = header_problem(path)
    if problem:  # a header whose counts its bytes cannot hold: most often a download cut short
        raise BuildError(_cut_short(path, problem))
    try:
        reader = PlainArrayReader(path)
    except BuildError:  # an unknown tensor type, named
        raise
    except Exception as error:  # gguf raises ValueError/struct errors for anything that is not GGUF
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", str(error))
        if unknown:  # a whole file whose tensor type this package has no name for: not a download cut short
            raise BuildError(f"{path}: a tensor is stored as GGML type {unknown.group(1)}, "
                             f"{unknown_type_advice()}") from None
        version = _gguf_version(path)
        if version is not None and version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
            raise BuildError(f"{path}: GGUF version {version}, which the gguf package here does not read (it reads "
                             f"versions {', '.join(map(str, gguf.gguf_reader.READER_SUPPORTED_VERSIONS))}); convert "
                             f"the model again with a current llama.cpp, or upgrade the gguf package")
        if isinstance(error, KeyError):  # a key given twice: the file is malformed, whatever its length
            raise BuildError(f"{path} is not a readable GGUF file ({error.args[0] if error.args else error}); "
                             f"convert the model again, or re-download it") from None
        if version is not None and isinstance(error, (AttributeError, TypeError)):
            # An AttributeError or TypeError: the gguf package and numpy here do not work together (gguf 0.11 with
            # numpy 2), whatever the file holds
            raise BuildError(f"{path}: the gguf package {_installed('gguf')} could not read it with numpy "
                             f"{_installed('numpy')} ({type(error).__name__}: {str(error)[:200]}); "
                             + pip_install("-U gguf") + " (aotlm needs 0.16 or later)") from None
        if version is not None:
            # A GGUF of a version the reader takes, whose reading then ran past the data it found: the usual cause
            # is a download or copy cut short, whose own error ("cannot reshape ...") says nothing of it.
            raise BuildError(_cut_short(path, str(error))) from None
        raise BuildError(f"{path} is not a readable GGUF file ({error}). Check the path, or re-download it.")
    parts = _field(reader, "split.count")
    if isinstance(parts, int) and parts > 1:  # gguf-split's shards: each holds some tensors, the first the metadata
        part = _field(reader, "split.no")
        which = f"part {part + 1} of {parts}" if isinstance(part, int) else f"one of {parts} parts"
        raise BuildError(f"{path}: {which} of a split GGUF (gguf-split); merge the parts into one file with llama.cpp's "
                         f"`llama-gguf-split --merge FIRST-PART.gguf MERGED.gguf` and set model.path to it")
    if reader.byte_order == "S":
        # The reader takes the header either way, but dequantize reads tensor data in this machine's byte order:
        # float weights came out as garbage (refused as "NaN or infinite values ... damaged"), and the float16 scales
        # inside quantized blocks would be read wrongly without a NaN to show it. llama.cpp refuses such a file too.
        order = "little" if sys.byteorder == "big" else "big"
        raise BuildError(f"{path}: a {order}-endian GGUF file, and this machine is {sys.byteorder}-endian; convert it "
                         f"with gguf-py's `gguf-convert-endian {os.path.basename(path)} {sys.byteorder}` (on a copy: "
                         f"it converts in place), or use a {sys.byteorder}-endian download of the model")
    return reader


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


# GGUF's metadata value types (gguf.GGUFValueType): fixed sizes in bytes; 8 is a string, 9 an array
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGUF_TENSOR_INFO_MIN_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a name, dims count, a dim, type, offset


def _cut_short(path: str, problem: str) -> str:
    return (f"{path} starts as a GGUF file but could not be read to its end ({problem}); it holds "
            f"{os.path.getsize(path):,} bytes, which is probably fewer than its header describes (a download or copy "
            f"cut short). Re-download it, and compare its size or sha256 with the source's.")


def header_problem(path: str) -> str | None:
    """What makes a little-endian GGUF v2/v3 header impossible for its file's size, or None. The gguf reader loops
    once per announced array item and keeps each, even past the end of the file: a 56-byte file announcing an array
    of 2^40 items took 24 GB before the kernel killed the build. Every count is checked against the bytes left."""
    size = os.path.getsize(path)
    with open(path, "rb") as stream:
        def take(count: int) -> bytes:
            if count > size - stream.tell():
                raise EOFError(f"it announces {count:,} bytes at offset {stream.tell():,}, past its end ({size:,} "
                               f"bytes)")
            return stream.read(count)

        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

        def skip_value(kind: int, depth: int = 0) -> None:
            if kind in GGUF_SCALAR_BYTES:
                take(GGUF_SCALAR_BYTES[kind])
            elif kind == GGUF_STRING:
                take(number("Q"))
            elif kind == GGUF_ARRAY and depth < 4:
                item, count = number("I"), number("Q")
                least = GGUF_SCALAR_BYTES.get(item, 8)  # a string or an array takes 8 bytes at least
                if count * least > size - stream.tell():
                    raise EOFError(f"an array of {count:,} items at offset {stream.tell():,} cannot fit in its "
                                   f"{size:,} bytes")
                if item in GGUF_SCALAR_BYTES:
                    take(count * least)
                else:
                    for _ in range(count):
                        skip_value(item, depth + 1)
            else:
                raise EOFError(f"a metadata value of unknown type {kind} at offset {stream.tell():,}")

        try:
            if take(4) != b"GGUF" or number("I") not in (2, 3):
                return None  # not this check's to judge: the reader says what it is
            tensors, entries = number("Q"), number("Q")
            if tensors * GGUF_TENSOR_INFO_MIN_BYTES + entries * 13 > size:
                return f"it announces {tensors:,} tensors and {entries:,} metadata entries in {size:,} bytes"
            for _ in range(entries):
                take(number("Q"))  # the key
                skip_value(number("I"))
        except EOFError as error:
            return str(error)
    return None


def _gguf_version(path: str) -> int | None:
    """The version field after GGUF's magic (either byte order), or None for a file that does not start as GGUF."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(8)
    except OSError:
        return None
    if len(head) < 8 or head[:4] != b"GGUF":
        return None
    version = int.from_bytes(head[4:], "little")
    return version if version & 0xFFFF else int.from_bytes(head[4:], "big")  # as the reader tells a big-endian file


# Tokens llama.cpp ends generation at by their text, besides the eos / eot / eom ids (llama-vocab.cpp's
# special_eog_ids, ggerganov/llama.cpp#9606): a Llama-3-Instruct GGUF whose eos is <|end_of_text|> and that has no
# eot key stops at <|eot_id|> there, and SmolLM2's (eos <|im_end|>) at <|endoftext|> too.
END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                           "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def _end_of_generation_ids(tokens) -> list[int]:
    return [index for index, text in enumerate(tokens or ()) if text in END_OF_GENERATION_TEXTS]


def _field(reader, key: str, default=None):
    """A metadata value as a Python object (str, int, float, list), or default when the key is absent."""
    field = reader.fields.get(key)
    try:
        return default if field is None else field.contents()
    except UnicodeDecodeError as error:  # llama.cpp loads such a file; gguf-py decodes strictly
        raise BuildError(f"GGUF metadata {key}: a string that is not UTF-8 ({error}); fix it with gguf-py's "
                         f"`gguf-set-metadata`, or convert the model again") from None


def _as_float(value) -> float:
    # GGUF stores floats as float32; its shortest repr (1e-05, not 9.999999747e-06) is what the model meant.
    return float(str(np.float32(value)))


def _read_config(reader, arch: str, tokens: list | None, path: str) -> DecoderConfig:
    def required(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise BuildError(f"{path}: GGUF metadata key {arch}.{key} is missing; the file cannot describe a model.")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    # llama.cpp reads a factor without a type as linear scaling (and the pre-2024 key rope.scale_linear too); with
    # type "none" it ignores the factor (llama_context: "never scale if scaling type is none"): plain RoPE. Linear
    # by 1 (the converter writes it for a config's {"type": "linear", "factor": 1.0}) is plain RoPE too.
    factor = _field(reader, f"{arch}.rope.scaling.factor", _field(reader, f"{arch}.rope.scale_linear"))
    if scaling not in (None, "none") and not (scaling == "linear" and factor in (None, 0, 1, 0.0, 1.0)):
        raise BuildError(f"{path}: rope scaling {scaling!r} is not supported by the canonical decoder (plain RoPE).")
    if scaling is None and factor not in (None, 0, 1, 0.0, 1.0):
        raise BuildError(f"{path}: rope scaling factor {factor} (linear, as llama.cpp reads it) is not supported by the "
                         f"canonical decoder (plain RoPE).")
    def per_model(key: str, value):
        """A count llama.cpp also reads as one per layer (get_key_or_arr): the same for every layer, or refused."""
        if not isinstance(value, list):
            return value
        if len(set(value)) != 1:
            raise BuildError(f"{path}: per-layer {key} {sorted(set(value))} are not supported (every layer must "
                             f"have the same).")
        return value[0]

    hidden = _count(required("embedding_length"), f"{arch}.embedding_length", path)
    heads = _count(per_model(f"{arch}.attention.head_count", required("attention.head_count")),
                   f"{arch}.attention.head_count", path)
    kv_heads = per_model(f"{arch}.attention.head_count_kv", _field(reader, f"{arch}.attention.head_count_kv", heads))
    key_length = _field(reader, f"{arch}.attention.key_length")
    head_dim = _count(key_length or hidden // heads, f"{arch}.attention.key_length", path)  # llama.cpp's n_embd_head_k
    rotated = _field(reader, f"{arch}.rope.dimension_count")
    if rotated and _count(rotated, f"{arch}.rope.dimension_count", path) != head_dim:  # partial: had loaded as full
        derived = "" if key_length else (f" (embedding_length {hidden} / attention.head_count {heads}: if the head "
                                         f"count is wrong, fix it with gguf-py's `gguf-set-metadata`)")
        raise BuildError(f"{path}: rope.dimension_count {rotated} of head size {head_dim}{derived}: a rotary on part "
                         f"of each head is not supported by the canonical decoder (it rotates every channel).")
    tensor_names = {tensor.name for tensor in reader.tensors}
    rope_freqs = _rope_freq_factors(reader, head_dim, path)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # llama.cpp requires the token list and the embedding rows to agree; files without a tokenizer still load.
    vocab_size = len(tokens) if tokens else int(embed.shape[-1]) if embed is not None else 0
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    # llama.cpp stops generation at any end-of-generation token: eos, and end-of-turn / end-of-message if set.
    eos_ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    for kind, token_id in zip(("bos", "eos", "eot", "eom"), [bos, *eos_ids]):  # as hf_loader refuses one
        # a value that is not an integer is refused by int() below, inside its BuildError
        if isinstance(token_id, (int, np.integer)) and vocab_size and not 0 <= token_id < vocab_size:
            why = "" if kind == "bos" else " (an end token: generation would never stop)"
            raise BuildError(f"{path}: tokenizer.ggml.{kind}_token_id {token_id} is outside the vocabulary "
                             f"({vocab_size} tokens){why}; "
                             f"set the right id with gguf-py's `gguf-set-metadata FILE "
                             f"tokenizer.ggml.{kind}_token_id ID`, or convert the model again")
    try:
        return DecoderConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(per_model(f"{arch}.feed_forward_length", required("feed_forward_length"))),
            num_layers=int(required("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rope_theta=_as_float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            # llama.cpp refuses a file without these two; a default here (transformers' is eps 1e-6) would be a guess
            rms_norm_eps=_as_float(required("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=int(required("context_length")),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys([*(int(i) for i in eos_ids if i is not None),
                                               *_end_of_generation_ids(tokens)])),
            architecture=arch,
            rope_freq_factors=rope_freqs,
        )
    except (TypeError, ValueError) as error:  # a value int() cannot read; DecoderConfig's own consistency checks
        raise BuildError(f"{path}: inconsistent GGUF metadata: {error}")


def _count(value, key: str, path: str) -> int:
    """A size the loader divides by or shapes with (heads, widths): an integer >= 1, else a BuildError naming it."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise BuildError(f"{path}: GGUF metadata {key} is {value!r}; it must be an integer >= 1.")


ROPE_FREQS = "rope_freqs.weight"  # per-frequency divisors of the rotary angles (Llama 3.1+'s rope scaling)


def _rope_freq_factors(reader, head_dim: int, path: str) -> tuple[float, ...] | None:
    """The rope_freqs tensor's values, which llama.cpp divides each rotary frequency by; None when absent."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    from gguf.quants import dequantize

    try:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    except NotImplementedError as error:
        raise BuildError(f"{path}: cannot read {ROPE_FREQS} ({tensor.tensor_type.name}): {error}")
    if values.size != head_dim // 2 or not np.all(np.isfinite(values) & (values > 0)):
        raise BuildError(f"{path}: {ROPE_FREQS} holds {values.size} values; it needs head_dim / 2 = {head_dim // 2} "
                         f"finite numbers > 0 (one divisor per rotary frequency)")
    return tuple(float(value) for value in values)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name for a llama.cpp tensor name, or None when the decoder has no such tensor."""
    base, _, kind = gguf_name.rpartition(".")
    if base in GLOBAL_TENSOR_NAMES and kind == "weight":
        return f"{GLOBAL_TENSOR_NAMES[base]}.weight"
    match = _BLOCK_TENSOR.match(gguf_name)
    if match and match.group(2) in BLOCK_TENSOR_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{BLOCK_TENSOR_NAMES[part]}.{kind}"
    return None


def unpermute_rotary_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute on a Q or K weight (or bias).

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3) ... of each head, Hugging Face rotates the two halves
    (rotate_half), so the converter reorders every head's rows from [first half | second half] to interleaved:
    reshape(n_head, 2, d/2, ...).swapaxes(1, 2). This is its exact inverse: reshape(n_head, d/2, 2, ...).swapaxes.
    Pass n_head = attention.head_count for Q and attention.head_count_kv for K, as the converter did.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _read_tensors(reader, config: DecoderConfig, path: str, progress: bool | None) -> dict:
    from gguf.quants import dequantize
    from rich.progress import track

    show = sys.stderr.isatty() if progress is None else progress
    expected = expected_shapes(config)
    tensors = [tensor for tensor in reader.tensors if tensor.name != ROPE_FREQS]  # read into the config
    unknown = [tensor.name for tensor in tensors if hf_tensor_name(tensor.name) is None]
    if unknown:  # checked before dequantizing anything, so a foreign file fails fast
        raise BuildError(
            f"{path}: tensors the Llama-family decoder cannot use: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''}."
        )
    state_dict = {}
    from compiler.console import console  # stderr's, inside the build's status: rich's own is stdout's, and the
    # two live displays overwrote each other on one line (the bar's frames went to stdout)
    for tensor in track(tensors, description="Dequantizing GGUF tensors", disable=not show, transient=True,
                        console=console):
        name = hf_tensor_name(tensor.name)
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # said below, in the file's names, not as a warning
                values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise BuildError(f"{path}: cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}")
        flat = values.reshape(-1)  # checked in pieces: a whole-tensor mask of an 8B model's table is 0.5 GB
        if not all(np.isfinite(flat[start:start + (1 << 24)]).all() for start in range(0, flat.size, 1 << 24)):
            raise BuildError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) dequantizes to NaN or infinite "
                             f"values: the file is damaged (a block's scale is not finite); download or convert it "
                             f"again")
        # GGUF lists dims innermost first (ne0 = columns); PyTorch's (out, in) is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if name in expected and shape != expected[name]:  # checked before the un-permute reshapes it by heads
            raise BuildError(f"{path}: tensor {tensor.name} has shape {shape}, the metadata implies {expected[name]}.")
        weight = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if config.architecture in PERMUTED_ARCHITECTURES and ".attn_q." in tensor.name:
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif config.architecture in PERMUTED_ARCHITECTURES and ".attn_k." in tensor.name:
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        state_dict[name] = weight
    return state_dict


def _file_type_name(file_type) -> str | None:
    if file_type is None:
        return None
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(file_type)).name
    except ValueError:
        return str(file_type)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
