"""The Triton FlashAttention kernels equal the float64 reference, and write this step's k/v into the cache in place.

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before triton
is imported); with one, the same tests run natively. Shapes and tiles stay tiny because the interpreter is slow,
with 16-wide tiles so that every path crosses several tiles, row blocks and splits.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernels' launchers take torch tensors")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import: @triton.jit reads it
pytest.importorskip("triton", reason="the FlashAttention kernels need triton (the TensorRT backend's dependency)")

from passes import flash_attention_op as op  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from runtime.kernels import flash_attention as fa  # noqa: E402
from runtime.kernels.reference import attention_reference, new_token_positions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, MAX_CONTEXT = 2, 64
# Absolute tolerances: outputs are softmax-weighted means of N(0, 1) values, so |out| stays below ~3.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCE), ids=lambda dtype: str(dtype).split(".")[-1])
HEADS = pytest.mark.parametrize("heads", [(4, 2, 16), (4, 4, 32)], ids=["gqa-group2-d16", "mha-group1-d32"])
SMALL_PREFILL = fa.PrefillBlocks(block_m=16, block_n=16)
SMALL_DECODE = fa.DecodeBlocks(block_n=16, block_r=16)


def launch_general(*args, **options):
    return fa.flash_attention(*args, blocks=options.pop("blocks", SMALL_PREFILL), **options)


def launch_decode(*args, **options):
    return fa.flash_decode(*args, blocks=options.pop("blocks", SMALL_DECODE), split_size=16, **options)


KERNELS = pytest.mark.parametrize("launch", [launch_general, launch_decode], ids=["general", "decode-split"])


def make_inputs(seq_len, seqlens, total, dtype, heads, seed=0):
    num_heads, kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)  # noqa: E731
    return dict(
        q=randn(BATCH, seq_len, num_heads * head_dim), k=randn(BATCH, seq_len, kv_heads * head_dim),
        v=randn(BATCH, seq_len, kv_heads * head_dim),
        k_cache=randn(BATCH, kv_heads, MAX_CONTEXT, head_dim), v_cache=randn(BATCH, kv_heads, MAX_CONTEXT, head_dim),
        seqlens_k=torch.tensor(seqlens, dtype=torch.int32, device=DEVICE),
        total=torch.tensor([total], dtype=torch.int32, device=DEVICE), num_heads=num_heads, kv_heads=kv_heads)


def run_and_check(launch, inputs, **options):
    """Run a launcher; assert the output (real rows) against the reference and the in-place cache update."""
    caches_before = {name: inputs[name].clone() for name in ("k_cache", "v_cache")}
    addresses = {name: inputs[name].data_ptr() for name in caches_before}
    expected, expected_keys, expected_values = attention_reference(**inputs)
    out = launch(*inputs.values(), **options)
    dtype, seq_len, total = inputs["q"].dtype, inputs["q"].shape[1], int(inputs["total"][0])
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    for b, seqlen_k in enumerate(inputs["seqlens_k"].tolist()):
        positions, valid = new_token_positions(seqlen_k, total, seq_len)
        difference = (out[b, valid.to(out.device)].double().cpu() - expected[b, valid]).abs().max().item()
        assert difference <= TOLERANCE[dtype], f"sequence {b}: max |kernel - reference| = {difference:.3g}"
        assert torch.isfinite(out[b]).all(), f"sequence {b}: a padding row is not finite"
        for name, new_rows, expected_cache in (("k_cache", inputs["k"], expected_keys),
                                                ("v_cache", inputs["v"], expected_values)):
            cache = inputs[name][b].cpu()
            written = torch.zeros(MAX_CONTEXT, dtype=torch.bool)
            written[positions[valid]] = True
            new = new_rows[b].cpu().reshape(seq_len, inputs["kv_heads"], -1)[valid].transpose(0, 1)
            assert torch.equal(cache[:, written], new), f"{name}[{b}]: new rows differ from this step's k/v"
            assert torch.equal(cache[:, ~written], caches_before[name][b].cpu()[:, ~written]), \
                f"{name}[{b}]: rows of other positions changed"
            assert torch.equal(cache.double(), expected_cache[b]), f"{name}[{b}] differs from the reference"
    assert {name: inputs[name].data_ptr() for name in caches_before} == addresses, "caches were not updated in place"
    return out


@KERNELS
@HEADS
@DTYPES
def test_first_prompt_with_right_padding(launch, heads, dtype):
    # S == total: sequence 0 fills 19 of 20 rows, sequence 1 only 10 (rows 10..19 are padding, never cached)
    run_and_check(launch, make_inputs(20, [18, 9], 20, dtype, heads))


@KERNELS
@HEADS
@DTYPES
def test_decode_one_token_with_different_cached_lengths(launch, heads, dtype):
    # positions 5 and 47: with 16-position splits, sequence 0 leaves three splits empty, sequence 1 one
    run_and_check(launch, make_inputs(1, [5, 47], 48, dtype, heads))


@KERNELS
@DTYPES
def test_later_chunk_of_three_after_a_cached_prefix(launch, dtype):
    # sequence 0's chunk sits at positions 14..16, across the boundary of the first two splits
    run_and_check(launch, make_inputs(3, [16, 40], 41, dtype, (4, 2, 16)))


def test_decode_rows_of_one_token_span_two_programs():
    # group 3 (Qwen-like odd groups): 6 tokens x 3 heads = 18 rows, token 5's heads straddle two 16-row blocks
    run_and_check(launch_decode, make_inputs(6, [20, 33], 34, torch.float16, (6, 2, 16)))


@KERNELS
def test_a_row_with_nothing_cached_or_new_writes_no_cache_row(launch):
    """seqlens_k -1 (an all-zero mask row) in a decode step puts its token at position -1: the general kernel wrote
    it there, into the last row of the plane before it (another kv head's, or another sequence's)."""
    inputs = make_inputs(1, [5, -1], 6, torch.float16, (4, 2, 16))
    before = {name: inputs[name].clone() for name in ("k_cache", "v_cache")}
    launch(*inputs.values())
    for name in before:
        changed = (inputs[name] != before[name]).any(dim=-1).nonzero().tolist()  # [b, kv head, position] rows
        assert changed == [[0, 0, 5], [0, 1, 5]], f"{name}: rows written {changed}"


@pytest.mark.parametrize("launch", [launch_general, launch_decode], ids=["general", "decode-split"])
def test_fp16_with_fp32_dots(launch):
    run_and_check(launch, make_inputs(3, [16, 40], 41, torch.float16, (4, 2, 16)), dot_in_fp32=True)


def test_default_blocks_and_a_single_split():
    inputs = make_inputs(1, [5, 47], 48, torch.float16, (4, 2, 16))
    assert fa.decode_splits(MAX_CONTEXT).num_splits == 1
    run_and_check(fa.flash_decode, inputs)
    run_and_check(fa.flash_attention, make_inputs(20, [18, 9], 20, torch.float16, (4, 2, 16)))


def test_block_choices_for_plugin_builds():
    assert fa.decode_splits(4096) == fa.DecodeSplits(split_size=256, num_splits=16)
    assert fa.decode_splits(100, split_size=16) == fa.DecodeSplits(split_size=16, num_splits=8)  # 7 -> power of 2
    assert fa.decode_blocks(64, group=7).block_r == 16 and fa.decode_blocks(128, group=32).block_r == 32
    assert fa.prefill_blocks(128).block_m >= 16


# Compiles the kernels to PTX for sm_90 exactly as the TensorRT AOT plugins will (runtime/kernels/aot.py; no GPU
# needed): catches what the interpreter lets through, such as a jit function reading a non-constexpr global.
AHEAD_OF_TIME_BUILD = """
from triton.backends.compiler import GPUTarget
from runtime.kernels import aot
h200 = GPUTarget("cuda", 90, 32)
for element in aot.ELEMENT_TYPES:
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):  # SmolLM2-135M; the GPU check's decode shape
        for compiled in (aot.flash_attention(element, heads, kv_heads, head_dim, head_dim**-0.5, h200),
                         aot.flash_decode(element, heads, kv_heads, head_dim, head_dim**-0.5, 8, 256, h200),
                         aot.flash_combine(element, heads, head_dim, 8, h200)):
            assert f".entry {compiled.name}(" in compiled.ptx, compiled.name
            # TensorRT passes exactly the inputs, int32 scalars and outputs: no Triton scratch pointers left over
            entry = compiled.ptx[compiled.ptx.index(f".entry {compiled.name}("):]
            parameters = entry[: entry.index(")")].count(".param")
            assert parameters == {"attention_kernel": 12, "decode_split_kernel": 13, "combine_kernel": 4}[compiled.name]
            assert compiled.shared_bytes <= 48 * 1024, (compiled.name, compiled.shared_bytes)  # no opt-in needed
            # the pointers' 16-byte alignment reached the compiler: its loads are 128-bit vectors, none a scalar
            # 16-bit one (320 in the prefill kernel without it)
            assert compiled.ptx.count("ld.global.v4") > 0 and "ld.global.b16" not in compiled.ptx, compiled.name
            print(element, compiled.name, compiled.num_warps, compiled.shared_bytes, "bytes of shared memory")
# a head group of 64 at head_dim 128 took 80 KiB in decode (its key tiles now narrow to fit); a head of 256 cannot fit
decode = aot.flash_decode("fp16", 64, 1, 128, 128**-0.5, 8, 256, h200)
assert decode.shared_bytes <= 48 * 1024, decode.shared_bytes
try:
    aot.flash_attention("fp16", 8, 1, 256, 256**-0.5, h200)
    raise AssertionError("a 98 KiB prefill kernel was handed to TensorRT")
except ValueError as error:
    assert "above the 48 KiB a TensorRT AOT launch gets" in str(error), error
# On the engine's GPU machine a driver older than Triton's ptxas caps the PTX version (no driver here: stood in for).
# Asking Triton's ptxas for its version is what failed there on triton 3.3-3.5 (get_ptxas changed its signature).
newest = aot._ptxas_ptx_version(h200)
assert 80 <= newest < 200, newest
aot._driver_ptx_version = lambda: 80  # a CUDA 12.0 driver
capped = aot.flash_combine("fp16", 9, 64, 8, h200)
assert ".version 8.0" in capped.ptx, capped.ptx[:300]
print("ptx capped at 8.0 from", newest)
"""


def test_kernels_compile_ahead_of_time_for_sm90():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    completed = subprocess.run([sys.executable, "-c", AHEAD_OF_TIME_BUILD], cwd=REPO, env=environment,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.count("bytes of shared memory") == 12, completed.stdout


def test_the_ptx_default_is_asked_through_tritons_options_whatever_get_ptxas_looks_like(monkeypatch):
    """triton 3.4-3.5's shape: get_ptxas() takes no arch (calling get_ptxas(arch) failed there, on the GPU machine
    only); Triton's own get_ptx_version_from_options(options, arch) copes, in each release."""
    from types import SimpleNamespace

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler

    from runtime.kernels import aot

    monkeypatch.setattr(compiler, "get_ptxas", lambda: SimpleNamespace(version="12.8"))
    monkeypatch.setattr(compiler, "get_ptx_version_from_options",
                        lambda options, arch: options.ptx_version or compiler.ptx_get_version(compiler.get_ptxas().version))
    assert aot._ptxas_ptx_version(GPUTarget("cuda", 90, 32)) == 87


@pytest.mark.parametrize("case", ["first prompt with right padding", "decode one token", "later chunk of three"])
def test_reference_matches_the_op_meaning_with_identity_rotary(case):
    """Ties the kernel contract to passes/flash_attention_op.reference: rotary with cos=1, sin=0 is the identity."""
    seq_len, seqlens, total = {"first prompt with right padding": (5, [4, 2], 5), "decode one token": (1, [6, 3], 7),
                               "later chunk of three": (3, [8, 5], 9)}[case]
    inputs = make_inputs(seq_len, seqlens, total, torch.float32, (4, 2, 16))
    numpy_inputs = [inputs[name].cpu().numpy() for name in ("q", "k", "v", "k_cache", "v_cache", "seqlens_k")]
    cos, sin = np.ones((MAX_CONTEXT, 8), np.float32), np.zeros((MAX_CONTEXT, 8), np.float32)
    op_out, op_keys, op_values = op.reference(*numpy_inputs, total, cos, sin, num_heads=4, kv_num_heads=2)
    out, keys, values = attention_reference(**inputs)
    for name, ours, theirs in (("output", out, op_out), ("k_cache", keys, op_keys), ("v_cache", values, op_values)):
        difference = np.abs(ours.numpy() - theirs).max()
        assert difference < 1e-12, f"{case}: {name} max |reference - op meaning| = {difference:.3g}"


@pytest.mark.parametrize("change, message", [
    (dict(kv_heads=3), "multiple of kv_heads"),
    (dict(k="short"), "k must have shape"),
    (dict(v_cache="float32"), "v_cache dtype"),
    (dict(seqlens_k="int64"), "seqlens_k must be an int32"),
    (dict(q="head_dim 12"), "head_dim must be a power of two"),
])
def test_rejects_bad_inputs_naming_what_is_wrong(change, message):
    inputs = make_inputs(1, [5, 47], 48, torch.float16, (4, 2, 16))
    for name, how in change.items():
        if how == "short":
            inputs[name] = inputs[name][:, :, :-1].contiguous()
        elif how == "float32":
            inputs[name] = inputs[name].float()
        elif how == "int64":
            inputs[name] = inputs[name].long()
        elif how == "head_dim 12":
            inputs[name] = inputs[name][:, :, :48].contiguous()  # 48 / 4 heads = 12
        else:
            inputs[name] = how
    with pytest.raises(ValueError, match=message):
        fa.flash_attention(*inputs.values())
