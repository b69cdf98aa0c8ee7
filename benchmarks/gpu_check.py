"""One GPU check, sized for one 10-minute run on an H200: kernel tests natively, kernel timings, TensorRT.

    python3 benchmarks/gpu_check.py [--skip-tests] [--skip-tensorrt] [--json PATH]
    .venv/bin/python benchmarks/gpu_check.py --smoke      # tiny shapes on CPU through Triton's interpreter

Needs torch with CUDA, triton, rich, tokenizers and pytest (a GPU machine's python without the .venv does). The JSON
is written after each part (and each prefill length), and a part that fails is recorded with its error while the
rest go on: a run that a time limit ends keeps what it measured (give --json a path in the folder that is kept). It
exits 1 where anything failed.

1. The FlashAttention kernel tests (tests/runtime/kernels), natively on the GPU.
2. Copy bandwidth: a device-to-device copy of 2 GiB (bytes read + written per second): decode's ceiling.
3. Prefill, B1 H32 D128 causal bf16 at S = 2048 and 8192: our attention_kernel against torch's
   scaled_dot_product_attention backends (flash, efficient, cudnn), TFLOP/s counting the causal half
   (2 * 2 * B * H * S^2 * D / 2 flops).
4. Decode, B16, 4096 cached tokens, 32 query / 8 KV heads, D128 bf16: our flash_decode (split sizes swept) against
   SDPA with enable_gqa; GB/s = the K and V bytes read / time, and as a fraction of the copy bandwidth.
5. If tensorrt is installed: build recipes/smollm2-135m-tensorrt.yaml and time a 512-token prompt + 128 tokens.
Times are CUDA-event medians over repeated launches after warm-up. Prints a table, writes
benchmarks/results/gpu_check.json (--json).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter): checks the script")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-tensorrt", action="store_true")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "gpu_check.json"))
    args = parser.parse_args(argv)
    target = Path(args.json)  # checked now: a folder was an IsADirectoryError after the whole (scarce) GPU run
    if target.is_dir():
        parser.error(f"--json {target}: is a folder; give a file name, e.g. {target / 'gpu_check.json'}")
    existing = next(folder for folder in [target.parent, *target.parent.parents] if folder.exists())
    if not existing.is_dir():
        parser.error(f"--json {target}: {existing} is a file, not a folder; give another path")
    if not os.access(existing, os.W_OK):
        parser.error(f"--json {target}: its folder cannot be written here; give another path")
    return args


ARGS = parse_args(None if __name__ == "__main__" else [])
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import numpy
    import triton  # (a module pytorch-triton or triton-windows may provide: its own version, not a distribution's)

    from runtime.versions import release

    if release(triton.__version__) < (3, 7) and release(numpy.__version__) >= (2, 4):  # (the dev extra's floor)
        raise SystemExit(f"--smoke runs the kernels in Triton's interpreter, which before triton 3.7 fails on numpy "
                         f"2.4 and later (triton {triton.__version__}, numpy {numpy.__version__} here); the GPU run "
                         f"does not use it: run without --smoke on the GPU")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from runtime.kernels import flash_attention as fa  # noqa: E402
from compiler.console import print_table  # noqa: E402
from runtime.results import write_json  # noqa: E402

console = Console()
DEVICE = "cpu" if ARGS.smoke else "cuda"


def timed_ms(function, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of function() (CUDA events on a GPU, the wall clock in --smoke)."""
    if ARGS.smoke:  # the interpreter is slow; the smoke run checks the plumbing, not the numbers
        warmup, repeats = 0, 1
    for _ in range(warmup):
        function()
    samples = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            function()
            samples.append(1e3 * (time.perf_counter() - began))
    return sorted(samples)[len(samples) // 2]


def copy_bandwidth_gbs() -> float:
    elements = (1 << 20) if ARGS.smoke else (1 << 30)  # bf16: 2 GiB on the GPU
    source = torch.empty(elements, dtype=torch.bfloat16, device=DEVICE)
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), repeats=20)
    return 2 * source.numel() * 2 / (ms * 1e-3) / 1e9


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return names if not ARGS.smoke else {"math": SDPBackend.MATH}


def sdpa_ms(backend, q, k, v, causal: bool) -> float | str:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    gqa = q.shape[1] != k.shape[1]
    try:
        with sdpa_kernel(backend):
            return timed_ms(lambda: scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))
    except RuntimeError as error:  # a backend that does not take these shapes says so; keep the first line
        return f"n/a ({str(error).splitlines()[0][:60]})"


def prefill_rows(copy_gbs: float, rows: list[dict], checkpoint) -> None:
    """Appends its rows to `rows`, calling checkpoint() after each length (the JSON keeps the lengths done)."""
    batch, heads, head_dim = 1, (2 if ARGS.smoke else 32), (16 if ARGS.smoke else 128)
    for length in ((32,) if ARGS.smoke else (2048, 8192)):
        flops = 2 * 2 * batch * heads * length * length * head_dim / 2
        q, k, v = (torch.randn(batch, length, heads * head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
        caches = [torch.zeros(batch, heads, length, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
        seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device=DEVICE)
        total = torch.tensor([length], dtype=torch.int32, device=DEVICE)
        blocks = [fa.PrefillBlocks(16, 16)] if ARGS.smoke else [
            fa.prefill_blocks(head_dim), fa.PrefillBlocks(128, 128, 8, 3), fa.PrefillBlocks(64, 64, 4, 4),
            fa.PrefillBlocks(128, 64, 4, 3)]
        for choice in blocks:
            name = f"aotlm triton {choice.block_m}x{choice.block_n} w{choice.num_warps} s{choice.num_stages}"
            try:  # one tile choice that does not fit (shared memory) must not cost the rest of the run
                ms = timed_ms(lambda: fa.flash_attention(q, k, v, *caches, seqlens, total, heads, heads, blocks=choice))
            except Exception as error:  # noqa: BLE001 - recorded in the table instead
                rows.append({"phase": "prefill", "S": length, "impl": name, "note": f"failed: {str(error)[:60]}"})
                continue
            rows.append({"phase": "prefill", "S": length, "impl": name, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12})
        bhsd = [t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
        try:  # the first row's tiles against torch's attention
            ours = fa.flash_attention(q, k, v, *caches, seqlens, total, heads, heads, blocks=blocks[0])
            theirs = torch.nn.functional.scaled_dot_product_attention(*bhsd, is_causal=True)
            rows[-len(blocks)]["max_abs_diff_vs_sdpa"] = (
                ours.view(batch, length, heads, head_dim).transpose(1, 2) - theirs).abs().max().item()
        except Exception as error:  # noqa: BLE001 - its tiles failed above, say; the timings stand
            rows[-len(blocks)]["compare_failed"] = f"{type(error).__name__}: {str(error)[:200]}"
        for name, backend in sdpa_backends().items():
            if name == "math" and length > 2048:
                continue  # materializes S x S scores: minutes and gigabytes, not a reference worth timing
            result = sdpa_ms(backend, *bhsd, causal=True)
            rows.append({"phase": "prefill", "S": length, "impl": f"torch sdpa {name}", **(
                {"ms": result, "tflops": flops / (result * 1e-3) / 1e12} if isinstance(result, float) else {"note": result})})
        checkpoint()


def decode_rows(copy_gbs: float, rows: list[dict], checkpoint) -> None:
    """Appends its rows to `rows` (one length: checkpoint is part()'s write at the end)."""
    batch, heads, kv_heads, head_dim, cached = (2, 4, 2, 16, 64) if ARGS.smoke else (16, 32, 8, 128, 4096)
    kv_bytes = 2 * batch * kv_heads * cached * head_dim * 2  # K and V, bf16, each read once
    q = torch.randn(batch, 1, heads * head_dim, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(batch, 1, kv_heads * head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    caches = [torch.randn(batch, kv_heads, cached, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    seqlens = torch.full((batch,), cached - 1, dtype=torch.int32, device=DEVICE)  # the new token is the last row
    total = torch.tensor([cached], dtype=torch.int32, device=DEVICE)
    of_copy = (lambda gbs: gbs / copy_gbs) if copy_gbs else (lambda gbs: None)  # (the copy may have failed)
    compared = None
    blocks = fa.DecodeBlocks(16, 16) if ARGS.smoke else None
    for split in ((16, 32) if ARGS.smoke else (256, 512, 1024)):
        name = f"aotlm triton split {split}"
        try:  # one split that fails must not cost the others
            ms = timed_ms(lambda: fa.flash_decode(q, k, v, *caches, seqlens, total, heads, kv_heads, split_size=split,
                                                  blocks=blocks), repeats=50)
        except Exception as error:  # noqa: BLE001 - recorded in the table instead
            rows.append({"phase": "decode", "S": cached, "impl": name, "note": f"failed: {str(error)[:60]}"})
            continue
        gbs = kv_bytes / (ms * 1e-3) / 1e9
        rows.append({"phase": "decode", "S": cached, "impl": name, "ms": ms, "gbs": gbs, "of_copy": of_copy(gbs)})
        compared = (rows[-1], split)
    q4 = q.view(batch, 1, heads, head_dim).transpose(1, 2)
    if compared is not None:  # the last split that ran, against torch's attention
        row, split = compared
        try:
            ours = fa.flash_decode(q, k, v, *caches, seqlens, total, heads, kv_heads, split_size=split,
                                   blocks=blocks)  # (it rewrites the cache's last row with the same k, v)
            theirs = torch.nn.functional.scaled_dot_product_attention(q4, *caches, enable_gqa=True)
            row["max_abs_diff_vs_sdpa"] = (ours.view(batch, 1, heads, head_dim).transpose(1, 2) - theirs
                                           ).abs().max().item()
        except Exception as error:  # noqa: BLE001
            row["compare_failed"] = f"{type(error).__name__}: {str(error)[:200]}"
    for name, backend in sdpa_backends().items():
        result = sdpa_ms(backend, q4, *caches, causal=False)  # one query after every cached key: no mask needed
        rows.append({"phase": "decode", "S": cached, "impl": f"torch sdpa {name}", **(
            {"ms": result, "gbs": kv_bytes / (result * 1e-3) / 1e9, "of_copy": of_copy(kv_bytes / (result * 1e-3) / 1e9)}
            if isinstance(result, float) else {"note": result})})


KERNEL_TESTS_TIMEOUT_S = 300


def kernel_tests() -> dict:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    began = time.perf_counter()
    try:
        completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "tests/runtime/kernels"], cwd=REPO,
                                   env=environment, capture_output=True, text=True, timeout=KERNEL_TESTS_TIMEOUT_S)
        returncode, stdout, stderr = completed.returncode, completed.stdout, completed.stderr
    except subprocess.TimeoutExpired as expired:  # what it printed until then still says which tests ran
        returncode, stdout, stderr = f"timed out after {KERNEL_TESTS_TIMEOUT_S} s", expired.stdout, expired.stderr
        stdout, stderr = (text.decode(errors="replace") if isinstance(text, bytes) else text or ""
                          for text in (stdout, stderr))
    last = (stdout.strip().splitlines() or ["(no output)"])[-1]
    # the failures' names and messages (-ra) and a missing module's error (stderr): the log's end, both streams
    return {"returncode": returncode, "summary": last, "seconds": round(time.perf_counter() - began, 1),
            "output_tail": (stdout + stderr)[-4000:]}


def tensorrt_run() -> dict:
    if importlib.util.find_spec("tensorrt") is None:
        return {"skipped": "tensorrt is not installed"}
    from compiler.build import build
    from compiler.recipe import load_recipe
    from runtime import Engine

    began = time.perf_counter()
    artifact = build(load_recipe(REPO / "recipes" / "smollm2-135m-tensorrt.yaml"), "/tmp/aotlm-gpu-check")
    built = time.perf_counter() - began
    engine = Engine.load(artifact, generation_config="none")  # greedy, as the CPU benchmarks
    prompt = list(range(100, 612))  # 512 tokens
    engine.generate(prompt, max_new_tokens=8)  # warm-up (CUDA graph capture)
    result = engine.generate(prompt, max_new_tokens=128)
    return {"build_s": round(built, 1), "ttft_ms": 1e3 * result.timings.ttft_s, "tpot_ms": 1e3 * result.timings.tpot_s,
            "version": engine.manifest["backend"]["version"]}


def checkpoint(report: dict) -> bool:
    """The report so far into --json; a write that fails is said (and counted by failures()), and the run goes on
    (its table still prints). Whether it was written."""
    try:
        write_json(ARGS.json, report)
    except OSError as error:
        console.print(f"[red]could not write {ARGS.json}[/red]: {error}")
        WRITE_FAILURES.append(str(error))
        return False
    return True


WRITE_FAILURES: list[str] = []  # checkpoint()'s, for the exit status


def part(report: dict, name: str, measure):
    """report[name] = measure() (None: it added rows itself), the JSON written at once: a part that raises is
    recorded with its error (and the next part runs), and a run the time limit kills keeps every part before it."""
    try:
        result = measure()
        if result is not None:
            report[name] = result
    except Exception as error:  # noqa: BLE001 - the scarce run goes on to the other parts
        report.setdefault("failed", {})[name] = {"error": f"{type(error).__name__}: {error}"[:2000],
                                                 "traceback": traceback.format_exc()[-4000:]}
        console.print(f"[red]{name} failed[/red]: {type(error).__name__}: {str(error)[:300]}")
    checkpoint(report)
    return report.get(name)


def failures(report: dict) -> list[str]:
    """What failed in the run, for its exit status: parts, kernel tests, rows (a tile or split), comparisons."""
    failed = [f"{name}: {entry['error']}" for name, entry in report.get("failed", {}).items()]
    tests = report.get("kernel_tests")
    if tests is not None and tests["returncode"] != 0:
        failed.append(f"kernel tests: {tests['summary']}")
    failed += [f"{row['impl']} at S={row['S']}: {row.get('compare_failed') or row['note']}" for row in report["rows"]
               if "compare_failed" in row or str(row.get("note", "")).startswith("failed")]
    if WRITE_FAILURES:
        failed.append(f"--json {ARGS.json} not written: {WRITE_FAILURES[-1]}")
    return failed


def main() -> None:
    if not ARGS.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU (or --smoke for a CPU check of the script itself)")
    report = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
              "torch": torch.__version__, "triton": importlib.import_module("triton").__version__}
    if not ARGS.skip_tests and not ARGS.smoke:
        console.print("kernel tests (native) ...")
        console.print(part(report, "kernel_tests", kernel_tests))
    if part(report, "copy_gbs", copy_bandwidth_gbs) is not None:
        console.print(f"copy bandwidth: {report['copy_gbs']:.0f} GB/s")
    report["rows"] = []
    for phase, measure in (("prefill", prefill_rows), ("decode", decode_rows)):
        part(report, phase, lambda: measure(report.get("copy_gbs"), report["rows"], lambda: checkpoint(report)))
    table = Table(title=f"FlashAttention kernels on {report['device']}")
    for column in ("phase", "S", "impl", "ms", "TFLOP/s", "GB/s", "of copy", "max|diff| vs sdpa"):
        table.add_column(column, justify="left" if column == "impl" else "right")
    for row in report["rows"]:
        number = lambda key, fmt: format(row[key], fmt) if row.get(key) is not None else ""  # noqa: E731
        table.add_row(row["phase"], str(row["S"]), row["impl"], number("ms", ".3f") or row.get("note", ""),
                      number("tflops", ".1f"), number("gbs", ".0f"), number("of_copy", ".0%"),
                      number("max_abs_diff_vs_sdpa", ".1e"))
    print_table(table, console)
    if not ARGS.skip_tensorrt and not ARGS.smoke:
        console.print("TensorRT:", part(report, "tensorrt", tensorrt_run))
    WRITE_FAILURES.clear()  # the last write is the one that counts: it holds everything
    if checkpoint(report):
        console.print(f"wrote {ARGS.json}")
    if failed := failures(report):
        console.print(f"[red]{len(failed)} failed[/red]:\n  " + "\n  ".join(failed))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
