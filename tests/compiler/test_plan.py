"""`aotlm plan`: parameter, weight and KV-cache arithmetic checked by hand; no artifact is built, nothing is timed."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from compiler import plan as plan_module
from compiler.cli import main
from compiler.errors import BuildError
from compiler.plan import load_source, plan
from compiler.recipe import load_recipe
from tests.conftest import TINY_RECIPE

LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B config.json (the keys the mapping reads)
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "max_position_embeddings": 8192, "rope_theta": 500000.0, "hidden_act": "silu",
}
FAKE_CPU = {"bandwidth": 10e9, "fp32_flops": 100e9, "measured": "2024-01-01T00:00:00+00:00", "method": "fake"}


@pytest.fixture
def llama3(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return str(path)


@pytest.fixture
def fake_cpu(tmp_path, monkeypatch):
    """The cpu device without measuring: a fixed result, cached in tmp_path; counts the measurements."""
    calls = []
    monkeypatch.setattr(plan_module, "CACHE_FILE", tmp_path / "cache" / "cpu.json")
    monkeypatch.setattr(plan_module, "measure_cpu", lambda: calls.append(1) or dict(FAKE_CPU))
    return calls


def test_llama3_8b_parameters_and_weights(llama3):
    result = plan(llama3, device="H100", context=8192)
    params = result["params"]["total"]
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert params == 2 * 128256 * 4096 + 32 * per_layer + 4096  # embeddings + layers + final norm + lm_head
    assert params == pytest.approx(8.03e9, rel=1e-3)
    weights = result["weight_bytes"]
    for precision, bytes_per_param, gb in (("fp32", 4, 32.1), ("fp16", 2, 16.1), ("int8", 1, 8.0),
                                           ("int4_no_scales", 0.5, 4.0)):
        assert weights[precision] == pytest.approx(params * bytes_per_param, rel=0.01)
        assert weights[precision] / 1e9 == pytest.approx(gb, rel=0.01)
    assert weights["bf16"] == weights["fp16"]
    assert weights["int4"] == pytest.approx(params * (0.5 + 2 / 32))  # fp16 scale per 32-weight block
    assert result["weights"] == weights["fp16"]  # the GPU default precision


def test_llama3_8b_kv_cache_and_max_concurrency_on_h100(llama3):
    result = plan(llama3, device="H100", precision="fp16", kv_dtype="fp16", context=8192, concurrency=64)
    kv_per_token = 2 * 32 * 8 * 128 * 2
    assert kv_per_token == 131072
    assert result["kv"] == {"bytes_per_token": kv_per_token, "held_context": 8192, "per_request": kv_per_token * 8192,
                            "total": kv_per_token * 8192 * 64, "read_per_step_per_request": kv_per_token * 8192}
    weights = 8_030_261_248 * 2
    usable = 0.9 * 81559 * 2**20  # the H100's memory as nvidia-smi reports it (it was taken as 80e9 bytes: 52)
    # the prefill and decode engines each hold the weights (it counted one copy: 56)
    assert result["memory"]["max_concurrency"] == int((usable - 2 * weights) // (kv_per_token * 8192)) == 41
    assert result["memory"]["total"] == 2 * weights + kv_per_token * 8192 * 64
    assert not result["memory"]["fits"]  # 64 x 1.07 GB of KV + 2 x 16 GB of weights > 72 GB
    bounds = result["bounds"]
    read = weights - 128256 * 4096 * 2  # a step gathers one row of the untied embedding table, not all of it
    assert bounds["decode_token_s"] == pytest.approx((read + kv_per_token * 8192) / 3.35e12)
    assert bounds["decode_step_s"] == pytest.approx((read + kv_per_token * 8192 * 64) / 3.35e12)
    assert bounds["decode_tokens_per_s"] == pytest.approx(64 / bounds["decode_step_s"])
    # FLOPs: every token through the projections (params less embedding and lm_head), but the last layer's o_proj
    # (4096 x 4096) and MLP (3 x 4096 x 14336) for the last token only (skip_unused_rows), lm_head once; causal
    # attention: query i against i keys, scores and weighted sum 2 x 128 FLOPs each per key, 32 heads, 32 layers
    projections = 8_030_261_248 - 2 * 128256 * 4096 - (2 * 32 + 1) * 4096
    last_layer_rows_only = 4096 * 4096 + 3 * 4096 * 14336
    attention = 32 * 32 * sum(4 * 128 * i for i in range(1, 513))
    assert bounds["prefill_s"] == pytest.approx(
        (2 * projections * 512 - 2 * last_layer_rows_only * 511 + attention + 2 * 128256 * 4096) / 989e12)
    long = plan(llama3, device="H100", precision="fp16", kv_dtype="fp16", context=8192, prompt=8192)["bounds"]
    attention_8k = 32 * 32 * 4 * 128 * 8192 * 8193 // 2  # 13.7% of the FLOPs at 8192 tokens, left out before
    assert long["prefill_s"] == pytest.approx(
        (2 * projections * 8192 - 2 * last_layer_rows_only * 8191 + attention_8k + 2 * 128256 * 4096) / 989e12)


def test_the_prefill_bound_follows_what_the_recipe_computes(tmp_path):
    """Without skip_unused_rows every token runs the last layer's o_proj and MLP; with prefill_logits: all, the
    lm_head runs on every position. Both had been counted as the default recipe computes them."""
    text = TINY_RECIPE.read_text()
    unskipped, all_logits = tmp_path / "unskipped.yaml", tmp_path / "all-logits.yaml"
    unskipped.write_text(text.replace("  - skip_unused_rows ", "  # skip_unused_rows "))
    all_logits.write_text(text.replace("max_context: 128", "max_context: 128\n  prefill_logits: all"))
    flops = {name: plan(str(path), device="H100", prompt=100)["bounds"]["prefill_flops"]
             for name, path in (("default", TINY_RECIPE), ("unskipped", unskipped), ("all", all_logits))}
    last_layer_rows_only = 64 * 4 * 16 + 3 * 64 * 128  # o_proj and the MLP of the tiny config
    assert flops["unskipped"] - flops["default"] == pytest.approx(2 * last_layer_rows_only * 99)
    # the lm_head on 99 more rows, and skip_unused_rows, listed, changes nothing when every row is returned
    assert flops["all"] - flops["default"] == pytest.approx(2 * 512 * 64 * 99 + 2 * last_layer_rows_only * 99)


def test_a_short_prompts_prefill_is_bounded_by_reading_the_weights(llama3):
    """Prefill reads every weight a step reads once, whatever its FLOPs: 64 tokens of an 8B model on an H100 take
    0.88 ms of FLOPs but 4.5 ms to read 15 GB, and the FLOPs alone were shown as the bound."""
    short = plan(llama3, device="H100", precision="fp16", prompt=64)["bounds"]
    read = 8_030_261_248 * 2 - 128256 * 4096 * 2  # fp16 weights, less the table a step only gathers from
    assert short["prefill_flops"] / 989e12 < read / 3.35e12
    assert short["prefill_s"] == pytest.approx(read / 3.35e12) and short["prefill_bound"] == "bandwidth"
    long = plan(llama3, device="H100", precision="fp16", prompt=2048)["bounds"]
    assert long["prefill_s"] == pytest.approx(long["prefill_flops"] / 989e12) and long["prefill_bound"] == "compute"


def test_a_sliding_window_bounds_the_context(tmp_path):
    """A Mistral-like config (32768 positions, a 4096-token window) was planned at 32768: a cache the build refuses
    (the decoder attends to the whole cache), 8x the KV it can hold."""
    folder = tmp_path / "mistral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA3_8B, "model_type": "mistral",
                                                    "max_position_embeddings": 32768, "sliding_window": 4096}))
    result = plan(str(folder), device="A100")
    assert result["inputs"]["context"] == 4096
    with pytest.raises(BuildError, match=r"context 8192 exceeds the model's sliding window \(4096 tokens\)"):
        plan(str(folder), device="A100", context=8192)


def test_precision_picks_the_compute_peak(llama3):
    assert plan(llama3, device="H100", precision="int8")["device"]["peak_flops"] == 1979e12
    assert plan(llama3, device="h100-sxm", precision="fp32")["device"]["peak_flops"] == 989e12 / 2  # TF32
    assert plan(llama3, device="rtx 4090", precision="int4")["device"]["peak_flops"] == 165.2e12


def test_unknown_device_lists_known_ones(llama3):
    with pytest.raises(BuildError, match="unknown device 'TPU'") as info:
        plan(llama3, device="TPU")
    for name in ("H100", "H200", "A100", "L40S", "L4", "RTX4090", "cpu"):
        assert name in str(info.value)


def test_bad_paths_and_context(llama3, tmp_path):
    with pytest.raises(BuildError, match="no such file"):
        plan(str(tmp_path / "missing.yaml"), device="H100")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(BuildError, match="not a recipe"):
        plan(str(tmp_path / "notes.txt"), device="H100")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BuildError, match="not a recipe"):
        plan(str(tmp_path / "empty"), device="H100")  # a folder with neither manifest.json nor config.json
    with pytest.raises(BuildError, match="exceeds the model's max_position_embeddings"):
        plan(llama3, device="H100", context=8193)


def test_tiny_recipe_plans():
    result = plan(str(TINY_RECIPE), device="L4")
    assert result["inputs"]["context"] == 128  # the recipe's export.max_context
    assert result["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # its export.dtype, float32
    assert result["memory"]["fits"] and result["bounds"]["decode_tokens_per_s"] > 0


def test_a_recipe_is_planned_in_its_export_dtype_as_its_artifact_is(tmp_path, tiny_artifact, fake_cpu):
    """The recipe branch took the device's default (fp16 on a GPU) where the recipe says float32, so a recipe and
    the artifact built from it got different plans; a TensorRT recipe planned on cpu is warned about."""
    assert plan(str(TINY_RECIPE), device="H100")["inputs"] == {
        **plan(str(tiny_artifact), device="H100")["inputs"], "precision": "fp32", "kv_dtype": "fp32"}
    half = tmp_path / "half.yaml"  # float16 is TensorRT's
    half.write_text(TINY_RECIPE.read_text().replace("export:\n", "export:\n  dtype: float16\n").split("passes:")[0]
                    + "backend: {name: tensorrt}\npasses: [cleanup, fuse_attention, lower_tensorrt]\n")
    assert plan(str(half), device="H100")["inputs"]["precision"] == "fp16"
    assert plan(str(half), device="H100", precision="int8")["inputs"]["precision"] == "int8"  # the flag wins
    assert any("builds tensorrt engines, which run on a GPU" in w for w in plan(str(half), device="cpu")["warnings"])


def with_required_fields(manifest: dict) -> dict:
    """The fields every manifest has (runtime/manifest.py refuses one without them) that plan does not read."""
    defaults = {"created": "2026-11-30T00:00:00+00:00", "passes": [], "model": {"source": {"kind": "random"}},
                "tokenizer": {"file": "tokenizer.json", "eos_token_ids": [2]},
                "kv_cache": {"shape": ["batch", 2, 128, 16], "bytes_per_token": 512,
                             "layout": ["batch", "kv_heads", "max_context", "head_dim"], "output_aliases_input": {}},
                "engines": {phase: {"file": f"{phase}.onnx", "inputs": [], "outputs": []} for phase in ("prefill", "decode")},
                "backend": {"name": "onnxruntime", "version": "1.32.0"}}
    for key, value in defaults.items():
        if isinstance(value, dict):
            manifest[key] = {**value, **manifest.get(key, {})}
        else:
            manifest.setdefault(key, value)
    manifest["model"].get("config", {}).setdefault("architecture", "llama")  # every built config has it
    return manifest


def tiny_float_artifact(folder) -> str:
    """A manifest alone (no engines): what plan reads of an fp32 artifact of a tiny model with a 128-token cache."""
    manifest = {"format": "aotlm-artifact", "format_version": 1, "name": "x",
                "recipe": {"export": {"dtype": "float32"}},
                "model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                     "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                     "max_position_embeddings": 256}},
                "kv_cache": {"max_context": 128, "dtype": "float32"},
                "tokenizer": {}, "engines": {}, "backend": {"name": "onnxruntime"}, "files": {}}
    (folder / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    return str(folder)


def test_artifact_manifest_and_cpu_measurement_wiring(tmp_path, fake_cpu, monkeypatch):
    tiny_float_artifact(tmp_path)
    gpu = plan(str(tmp_path), device="A100")
    assert gpu["model"]["source"]["kind"] == "artifact" and gpu["inputs"]["context"] == 128
    assert "measured" not in gpu
    seen = {}

    def fake_measure(info, config, dev, context):
        seen.update(info=info, context=context, bandwidth=dev["bandwidth"])
        return {"prompt_tokens": 111, "steps": 16, "measured_s": 2e-3, "predicted_s": 1e-3, "ratio": 2.0,
                "dtypes": "fp32 weights, fp32 KV (the artifact's)"}

    monkeypatch.setattr(plan_module, "measure_artifact", fake_measure)
    result = plan(str(tmp_path), device="cpu")
    assert seen == {"info": result["model"]["source"], "context": 128, "bandwidth": 10e9}
    assert seen["info"]["dtype"] == "fp32" and seen["info"]["kv_dtype"] == "fp32"
    assert result["inputs"]["precision"] == "fp32" and result["inputs"]["kv_dtype"] == "fp32"  # cpu defaults
    assert result["measured"]["ratio"] == 2.0


def test_a_cpu_measurement_taken_under_load_is_used_once_not_cached(llama3, fake_cpu, monkeypatch):
    """A bandwidth measured while a build ran (15.4 GB/s, where decode steps read 29.6) was cached for good."""
    monkeypatch.setattr(plan_module, "measure_cpu", lambda: fake_cpu.append(1) or {**FAKE_CPU, "other_cores": 1.2})
    result = plan(llama3, device="cpu", context=1024)
    assert "other processes kept 1.20 cores busy meanwhile" in result["device"]["name"]
    plan(llama3, device="cpu", context=1024)
    assert len(fake_cpu) == 2 and not plan_module.CACHE_FILE.exists()  # measured again, nothing cached
    monkeypatch.setattr(plan_module, "measure_cpu", lambda: fake_cpu.append(1) or {**FAKE_CPU, "other_cores": 0.02})
    plan(llama3, device="cpu", context=1024)
    plan(llama3, device="cpu", context=1024)
    assert len(fake_cpu) == 3 and plan_module.CACHE_FILE.exists()


def test_measure_cpu_reports_the_load_of_other_processes(monkeypatch):
    monkeypatch.setattr(plan_module, "_measure_cpu", lambda: dict(FAKE_CPU))
    busy = iter([100.0, 103.0])  # the machine spent 3 CPU seconds busy meanwhile, this process ~0 of them
    monkeypatch.setattr(plan_module, "busy_cpu_s", lambda: next(busy))
    measured = plan_module.measure_cpu()
    assert measured["bandwidth"] == FAKE_CPU["bandwidth"] and measured["other_cores"] > 2.0


def test_cpu_measurement_is_cached(llama3, fake_cpu):
    first = plan(llama3, device="cpu", context=1024)
    assert first["device"]["bandwidth_Bps"] == 10e9 and first["device"]["peak_flops"] == 100e9
    assert first["device"]["measured"] and len(fake_cpu) == 1
    plan(llama3, device="CPU", context=1024)
    assert len(fake_cpu) == 1  # read from the cache
    plan(llama3, device="cpu", context=1024, remeasure=True)
    assert len(fake_cpu) == 2
    assert first["bounds"]["decode_token_s"] == pytest.approx(
        ((8_030_261_248 - 128256 * 4096) * 4 + 2 * 32 * 8 * 128 * 4 * 1024) / 10e9)  # fp32 by default on cpu;
    # the untied embedding table is gathered (one row), not read


def test_a_full_disk_leaves_the_cached_figures_of_other_hosts_whole(llama3, fake_cpu, monkeypatch):
    """The cache was rewritten in place: a full disk cut it short, and every host's figures were lost with it."""
    import errno

    others = {f"host-{n}-2cpu-2use-ort-read-quiet": dict(FAKE_CPU) for n in range(20)}
    plan_module.CACHE_FILE.parent.mkdir(parents=True)
    plan_module.CACHE_FILE.write_text(json.dumps(others))
    real_fdopen = plan_module.os.fdopen

    class FullDisk:  # a file that takes a few bytes, then refuses the rest
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, text):
            self.handle.write(text[:100])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plan_module.os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    result = plan(llama3, device="cpu", context=1024)
    assert result["device"]["bandwidth_Bps"] == 10e9 and len(fake_cpu) == 1
    assert json.loads(plan_module.CACHE_FILE.read_text()) == others
    assert [p.name for p in plan_module.CACHE_FILE.parent.iterdir()] == ["cpu.json"]


@pytest.mark.parametrize("cached", ["null", "[]", '"x"', "{KEY: {}}", "{KEY: null}",
                                    '{KEY: {"bandwidth": "fast", "fp32_flops": 1e11, "measured": "today"}}',
                                    '{KEY: {"bandwidth": 0, "fp32_flops": 1e11, "measured": "today"}}',  # a division
                                    '{KEY: {"bandwidth": true, "fp32_flops": 1e11, "measured": "today"}}'])
def test_a_cache_file_of_another_shape_is_measured_again_not_a_traceback(llama3, fake_cpu, cached):
    """The README suggests copying cpu.json between machines: `null`, a list, or an entry without its numbers were
    TypeErrors and KeyErrors (a 16-line traceback)."""
    key = f"{plan_module.socket.gethostname()}-{plan_module.os.cpu_count()}cpu-{plan_module.usable_cpus()}use-ort-read-quiet"
    plan_module.CACHE_FILE.parent.mkdir(parents=True)
    plan_module.CACHE_FILE.write_text(cached.replace("KEY", json.dumps(key)))
    result = plan(llama3, device="cpu", context=1024)
    assert len(fake_cpu) == 1 and result["device"]["bandwidth_Bps"] == 10e9
    assert json.loads(plan_module.CACHE_FILE.read_text()) == {key: FAKE_CPU}


def test_a_figure_another_plan_cached_while_this_one_measured_is_kept(llama3, fake_cpu, monkeypatch):
    """Read, measure (seconds), write: two plans at once (another taskset, another host sharing the home) each wrote
    what it had read, and one's figure was lost."""
    other = {"other-host-2cpu-2use-ort-read-quiet": dict(FAKE_CPU)}

    def measured_while_another_wrote():
        plan_module.CACHE_FILE.parent.mkdir(parents=True, exist_ok=True)
        plan_module.CACHE_FILE.write_text(json.dumps(other))
        return dict(FAKE_CPU)

    monkeypatch.setattr(plan_module, "measure_cpu", measured_while_another_wrote)
    plan(llama3, device="cpu", context=1024)
    assert set(json.loads(plan_module.CACHE_FILE.read_text())) == {*other, next(
        key for key in json.loads(plan_module.CACHE_FILE.read_text()) if key not in other)}
    assert len(json.loads(plan_module.CACHE_FILE.read_text())) == 2


def test_a_figure_cached_by_the_copy_measurement_is_measured_again(llama3, fake_cpu):
    """Before, the cache held one thread's copy rate (read + written bytes) under a key without "-read"; decode
    steps came out faster than that "bound". Such an entry must not be reused."""
    stale = {f"{plan_module.socket.gethostname()}-{plan_module.os.cpu_count()}cpu-ort": {**FAKE_CPU, "bandwidth": 1.0}}
    plan_module.CACHE_FILE.parent.mkdir(parents=True)
    plan_module.CACHE_FILE.write_text(json.dumps(stale))
    result = plan(llama3, device="cpu", context=1024)
    assert len(fake_cpu) == 1 and result["device"]["bandwidth_Bps"] == 10e9


def test_read_bandwidth_reads_the_whole_array_on_every_thread(monkeypatch):
    import threading

    import numpy as np

    seen = []  # (thread, elements) per np.max call
    real_max = np.max
    monkeypatch.setattr(np, "max", lambda part: seen.append((threading.get_ident(), part.size)) or real_max(part))
    size = 3 * 2**20
    assert plan_module.read_bandwidth(3, size) > 0
    assert len(seen) == 12  # a warm-up, then best of 3; three parts each time
    assert sum(elements for _, elements in seen[:3]) == size // 4  # every float32 of the array, once per pass
    assert len({thread for thread, _ in seen}) == 3  # on three threads


def test_cli_prints_the_table(capsys):
    """On stdout, the command's output (`aotlm plan ... > plan.txt` had been empty: it all went to stderr)."""
    assert main(["plan", str(TINY_RECIPE), "--device", "H100"]) == 0
    out = capsys.readouterr().out
    for text in ("max concurrency", "KV cache / token", "weights int4", "decode tokens/s", "H100"):
        assert text in out


def test_cli_prints_names_with_brackets_as_written(tmp_path, capsys):
    """A file name or a warning is not rich markup: "[v3]" had vanished from the source line, as a style tag."""
    path = tmp_path / "llama[v3].json"
    path.write_text(json.dumps(LLAMA3_8B))
    assert main(["plan", str(path), "--device", "H100"]) == 0
    assert "llama[v3].json (hf config.json):" in capsys.readouterr().out


@pytest.mark.parametrize("old, new, message", [
    ("  - lower_onnxruntime ", "  - quantize\n  - lower_onnxruntime ", "passes[2] (quantize) comes after passes[1]"),
    ("export:\n  max_context: 128", "export:\n  max_context: 128\n  dtype: float16", "export.dtype: 'float16' with"),
    ("  - pack_projections", "  - pack_projections\n  - quantize: {block_size: 48}", "block_size=48: MatMulNBits"),
    ("head_dim: 16", "head_dim: 8", "lower the fused attention with lower_onnx_attention instead"),  # the config's
    ("  max_context: 128", "  max_context: 512", "export.max_context: 512 exceeds the model's max_position_embeddings"),
])
def test_a_recipe_the_build_refuses_is_refused_not_planned(tmp_path, capsys, old, new, message):
    """plan read the recipe's model and sizes only: it planned INT4 figures for a block size no build takes."""
    text = TINY_RECIPE.read_text()
    assert old in text
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace(old, new, 1))
    assert main(["plan", str(recipe), "--device", "H100"]) == 2
    assert message in capsys.readouterr().err


def test_a_recipes_model_path_is_checked_as_the_build_checks_it(tmp_path, capsys):
    """A folder given as a GGUF file had been "GGUF file not found"; a .gguf given as a Hugging Face folder
    "<file>/config.json: config.json not found"."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    for source, path, message in (("gguf", tmp_path, "a folder, not a GGUF file"),
                                  ("hf", tmp_path / "model.gguf", "a file, not a folder; model.path names the Hugging "
                                                                  "Face model folder")):
        recipe = tmp_path / f"{source}.yaml"
        recipe.write_text(f"name: x\nmodel: {{source: {source}, path: '{path}'}}\n")
        assert main(["plan", str(recipe), "--device", "H100"]) == 2
        assert message in capsys.readouterr().err


def test_cli_json_and_errors(llama3, capsys):
    assert main(["plan", llama3, "--device", "H200", "--precision", "int4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["inputs"]["precision"] == "int4" and result["device"]["memory_bytes"] == 143771 * 2**20
    assert main(["plan", llama3, "--device", "B200"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'B200'" in err and "RTX4090" in err


def test_a_quantized_artifact_is_planned_as_built(tmp_path, fake_cpu, monkeypatch):
    """An INT4 artifact with an int8 cache: its dtypes are the defaults and its weights file is what decode reads
    (before, the export dtype made it fp32 and the measured step came out faster than the bandwidth bound)."""
    manifest = {"format": "aotlm-artifact", "format_version": 1, "name": "x",
                "recipe": {"export": {"dtype": "float32"},
                           "passes": [{"cleanup": {}}, {"quantize": {"bits": 4, "block_size": 32}},
                                      {"quantize_kv_cache": {"bits": 8}}]},
                "model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                     "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                     "max_position_embeddings": 256}},
                "backend": {"weights": {"file": "weights.bin", "bytes": 200_000}}, "tokenizer": {}, "engines": {}, "files": {},
                "kv_cache": {"max_context": 128, "dtype": "int8"}}
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    monkeypatch.setattr(plan_module, "measure_artifact", lambda info, config, dev, context: {
        "prompt_tokens": 1, "steps": 1, "measured_s": 1.0, "predicted_s": 1.0, "ratio": 1.0, "dtypes": ""})
    built = plan(str(tmp_path), device="cpu")
    assert built["inputs"]["precision"] == "int4" and built["inputs"]["kv_dtype"] == "int8"
    assert built["weights"] == 200_000 and built["weights_from"] == "the artifact's weights file"
    assert built["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 1
    # Less the untied table a step gathers one row of, as stored: float32 (embedding: float, the default), 65% of
    # these bytes though 28% of the parameters (a share of the parameters made the bound 1.9x too high).
    read = 200_000 - 512 * 64 * 4
    assert built["bounds"]["decode_token_s"] == pytest.approx((read + 128 * 128) / 10e9)  # + one request's int8 cache
    asked = plan(str(tmp_path), device="cpu", precision="fp32", kv_dtype="fp16")  # explicit choices still win
    assert asked["weights"] == asked["weight_bytes"]["fp32"] == 4 * asked["params"]["total"]
    assert asked["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 2 and asked["weights_from"] == "params x fp32 bytes"


def test_a_quantized_recipe_defaults_to_its_precisions(tmp_path):
    text = TINY_RECIPE.read_text().replace("  - pack_projections", "  - pack_projections\n  - quantize: {bits: 4, "
                                           "block_size: 16, method: rtn}\n  - quantize_kv_cache: {calibration: "
                                           "{samples: 1, length: 8}}")
    recipe = tmp_path / "tiny-int4-kv8.yaml"
    recipe.write_text(text)
    result = plan(str(recipe), device="H100")
    assert result["inputs"]["precision"] == "int4" and result["inputs"]["kv_dtype"] == "int8"
    # Counted from the config and the recipe's options (nothing is built): 4-bit codes + a float32 scale per block
    # of 16 (onnxruntime), the float table (embedding: float, the default), norms in float.
    counts = result["params"]
    products = counts["attention"] + counts["mlp"] + 512 * 64  # the untied lm_head
    assert result["weights"] == pytest.approx(products * (0.5 + 4 / 16) + counts["embedding"] * 4 + counts["norms"] * 4)
    assert result["weights_from"] == "the recipe's quantize options"
    # A decode step reads all of them but the float table, of which it gathers one row (not its share of the params)
    one_request = result["kv"]["per_request"]
    assert result["bounds"]["decode_token_s"] == pytest.approx(
        (result["weights"] - counts["embedding"] * 4 + one_request) / result["device"]["bandwidth_Bps"])
    recipe.write_text(text.replace("method: rtn}", "method: rtn, embedding: quantized}"))
    quantized_table = plan(str(recipe), device="H100")  # untied: the table in 4 bits too, still only gathered
    assert quantized_table["weights"] == pytest.approx(result["weights"] - counts["embedding"] * (4 - 0.75))
    assert quantized_table["bounds"]["decode_token_s"] == pytest.approx(result["bounds"]["decode_token_s"])
    recipe.write_text(text.replace("tie_word_embeddings: false", "tie_word_embeddings: true"))
    tied = plan(str(recipe), device="H100")  # the lm_head in 4 bits, and beside it the float table, only gathered
    assert tied["bounds"]["decode_token_s"] == pytest.approx(
        (tied["weights"] - counts["embedding"] * 4 + one_request) / result["device"]["bandwidth_Bps"])
    recipe.write_text(text)
    float_recipe = plan(str(TINY_RECIPE), device="H100")  # no quantize pass: its export.dtype
    assert float_recipe["inputs"]["precision"] == "fp32" and float_recipe["inputs"]["kv_dtype"] == "fp32"
    assert result["memory"]["prefill_float_weights"] == 0

    # dequantize_weights on prefill: that session also holds the layers' products in float32
    recipe.write_text(text.replace("  - skip_unused_rows", "  - skip_unused_rows\n  - dequantize_weights: "
                                                           "{phases: [prefill]}"))
    float_prefill = plan(str(recipe), device="H100")
    assert float_prefill["memory"]["prefill_float_weights"] == 4 * (counts["attention"] + counts["mlp"])
    # the prefill engine's copy is then those float weights, in place of a second copy of the quantized ones
    assert float_prefill["memory"]["total"] == pytest.approx(result["memory"]["total"] - result["weights"] + 4 * (
        counts["attention"] + counts["mlp"]))


def test_int8_scales_are_counted_per_block_of_each_products_own_k(tmp_path):
    """INT8 without int8_kernel_block was counted as one scale per hidden_size weights. The lowering repeats each
    channel's scale over the largest power-of-two block <= 256 dividing the product's K (for_matmulnbits), and
    down_proj's K is intermediate_size: SmolLM2's int8 recipe planned 135.6 MB where 141.8 MB are stored."""
    import numpy as np

    from passes.quantized_lowering_ort import for_matmulnbits
    from passes.quantized_weights import quantize_rtn

    stored_block = {k: for_matmulnbits(quantize_rtn(np.ones((k, 8), np.float32), 8, k, True)).block_size
                    for k in (64, 128)}  # the tiny model's hidden and intermediate sizes, as the pass lowers them
    assert stored_block == {64: 64, 128: 128}
    recipe = tmp_path / "tiny-int8.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace(
        "  - pack_projections", "  - pack_projections\n  - quantize: {bits: 8, method: rtn}"))
    result = plan(str(recipe), device="H100")
    counts = result["params"]
    down = 2 * 64 * 128  # two layers' down_proj, K = 128
    reading_hidden = counts["attention"] + counts["mlp"] - down + 512 * 64  # o_proj's K (4 x 16) is 64 too
    assert result["weights"] == pytest.approx(reading_hidden * (1 + 4 / stored_block[64]) + down * (
        1 + 4 / stored_block[128]) + counts["embedding"] * 4 + counts["norms"] * 4)


def test_a_tensorrt_artifact_is_planned_on_cpu_but_not_timed(tmp_path, fake_cpu, monkeypatch):
    manifest = {"format": "aotlm-artifact", "format_version": 1, "name": "x", "recipe": {"export": {"dtype": "float16"}},
                "backend": {"name": "tensorrt"}, "tokenizer": {}, "engines": {}, "files": {},
                "model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                     "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                     "max_position_embeddings": 256}},
                "kv_cache": {"max_context": 128, "dtype": "float16"}}
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    monkeypatch.setattr(plan_module, "measure_artifact", lambda *args: pytest.fail("a TensorRT artifact was timed"))
    result = plan(str(tmp_path), device="cpu")
    assert "measured" not in result and any("tensorrt engines run on a GPU" in w for w in result["warnings"])
    assert result["inputs"]["precision"] == "fp16" and result["inputs"]["kv_dtype"] == "fp16"
    # a bfloat16 artifact's cache is bfloat16, not "fp16" (the bytes were right, the label was not)
    manifest["recipe"]["export"]["dtype"] = manifest["kv_cache"]["dtype"] = "bfloat16"
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    result = plan(str(tmp_path), device="cpu")
    assert (result["inputs"]["precision"], result["inputs"]["kv_dtype"]) == ("bf16", "bf16")


def test_a_context_past_an_artifacts_cache_is_warned_about(tmp_path):
    test_artifact = tiny_float_artifact(tmp_path)
    assert any("exceeds this artifact's cache (128 tokens)" in w
               for w in plan(test_artifact, device="H100", context=200)["warnings"])
    assert [w for w in plan(test_artifact, device="H100", context=128)["warnings"] if "context" in w] == []


@pytest.mark.parametrize("source", ["artifact", "recipe"])
def test_memory_counts_the_max_context_every_sequence_holds_and_a_step_reads_the_context(tmp_path, source):
    """A built engine holds export.max_context (128) rows per sequence whatever the requests' context: at --context 32
    the plan had counted a quarter of the cache the slots allocate, and four times the concurrency that fits."""
    planned = tiny_float_artifact(tmp_path) if source == "artifact" else str(TINY_RECIPE)
    short, full = (plan(planned, device="H100", context=c, concurrency=8) for c in (32, 128))
    token = short["kv"]["bytes_per_token"]
    assert short["kv"]["per_request"] == full["kv"]["per_request"] == token * 128
    assert short["memory"]["total"] == full["memory"]["total"]
    assert short["memory"]["max_concurrency"] == full["memory"]["max_concurrency"]
    assert short["kv"]["read_per_step_per_request"] == token * 32
    assert full["bounds"]["decode_token_s"] - short["bounds"]["decode_token_s"] == pytest.approx(
        token * 96 / full["device"]["bandwidth_Bps"])


def test_a_context_past_a_recipes_max_context_is_warned_about():
    recipe = str(TINY_RECIPE)  # export.max_context 128
    assert [w for w in plan(recipe, device="H100", context=200)["warnings"] if "export.max_context" in w] == [
        "context 200 exceeds the recipe's export.max_context (128): its artifact would serve at most 128 tokens; "
        "raise export.max_context to 200 to build what this plan sizes"]
    assert [w for w in plan(recipe, device="H100", context=128)["warnings"] if "context" in w] == []


def test_concurrency_past_a_tensorrt_max_batch_is_warned_about(tmp_path):
    """TensorRT's decode profile bounds a step's rows (export.max_batch) and the scheduler refuses more slots: a plan
    sized for more users at once than the engines take must say so. onnxruntime's engines take any number."""
    head, _ = TINY_RECIPE.read_text().split("passes:")
    recipe = tmp_path / "tiny-tensorrt.yaml"
    recipe.write_text(head.replace("  max_context: 128", "  max_context: 128\n  dtype: float16\n  max_batch: 4")
                      + "passes:\n  - cleanup\n  - fuse_attention\n  - lower_tensorrt\nbackend:\n  name: tensorrt\n")
    warned = [w for w in plan(str(recipe), device="H100", concurrency=8)["warnings"] if "max_batch" in w]
    assert warned == ["concurrency 8 exceeds export.max_batch (4): TensorRT's engines run at most 4 sequences per "
                      "step; rebuild with export.max_batch: 8 to serve this many at once"]
    assert [w for w in plan(str(recipe), device="H100", concurrency=4)["warnings"] if "max_batch" in w] == []
    onnxruntime = [w for w in plan(str(TINY_RECIPE), device="H100", concurrency=8)["warnings"] if "max_batch" in w]
    assert onnxruntime == []


def test_many_sequences_make_a_decode_step_compute_bound(llama3):
    """1024 short sequences: the step's 2 x (projections + lm_head) FLOPs per sequence outlast reading the weights
    and the caches once; one sequence is bandwidth-bound."""
    batched = plan(llama3, device="H100", precision="fp16", kv_dtype="fp16", context=128, concurrency=1024)["bounds"]
    products = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096  # the embedding: a lookup
    read = 8_030_261_248 * 2 - 128256 * 4096 * 2 + 131072 * 128 * 1024
    assert 2 * products * 1024 / 989e12 > read / 3.35e12
    assert batched["decode_step_s"] == pytest.approx(2 * products * 1024 / 989e12)
    assert batched["decode_bound"] == "compute"
    assert batched["decode_tokens_per_s"] == pytest.approx(1024 / batched["decode_step_s"])
    single = plan(llama3, device="H100", precision="fp16", kv_dtype="fp16", context=128)["bounds"]
    assert single["decode_bound"] == "bandwidth"


def test_weights_larger_than_the_device_fit_no_sequence(llama3):
    """fp32 Llama 3 8B (32 GB) on a 24 GB L4: no room for any cache, not a negative number of sequences."""
    result = plan(llama3, device="L4", precision="fp32", context=1024)
    assert result["memory"]["max_concurrency"] == 0 and not result["memory"]["fits"]


def test_a_zero_prompt_or_concurrency_is_refused(llama3):
    for options in ({"prompt": 0}, {"concurrency": 0}, {"context": 0}):
        with pytest.raises(BuildError, match="must be at least 1"):
            plan(llama3, device="H100", **options)


def test_qwen2_attention_biases_are_counted(tmp_path):
    """Qwen2's q, k and v projections carry biases: q + 2 x kv widths per layer."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "model_type": "qwen2", "use_sliding_window": False}))
    params = plan(str(tmp_path), device="H100", context=1024)["params"]
    assert params["attention"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 + 2 * 1024)


def test_a_tied_float_model_reads_its_whole_table_each_step(tmp_path):
    """A tied table is the lm_head's weight: a decode step reads all of it, unlike an untied embedding table."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "tie_word_embeddings": True}))
    result = plan(str(tmp_path), device="H100", precision="fp16", kv_dtype="fp16", context=1024)
    weights = (8_030_261_248 - 128256 * 4096) * 2  # no separate lm_head
    assert result["weights"] == weights
    assert result["bounds"]["decode_token_s"] == pytest.approx((weights + 131072 * 1024) / 3.35e12)


def test_a_tensorrt_quantized_artifact_counts_half_precision_scales_and_zero_points(tmp_path):
    """TensorRT engines hold their own weights (no weights file in the manifest): the recipe's options are counted,
    with float16 scales, norms and table (onnxruntime's graphs keep them float32), and an asymmetric INT4's zero
    point, half a byte per block."""
    manifest = {"format": "aotlm-artifact", "format_version": 1, "name": "x",
                "recipe": {"export": {"dtype": "float16"},
                           "passes": [{"quantize": {"bits": 4, "block_size": 32, "symmetric": False}}]},
                "model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                     "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                     "max_position_embeddings": 256}},
                "backend": {"name": "tensorrt"}, "tokenizer": {}, "engines": {}, "files": {},
                "kv_cache": {"max_context": 128, "dtype": "float16"}}
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    result = plan(str(tmp_path), device="H100")
    counts = result["params"]
    products = counts["attention"] + counts["mlp"] + 512 * 64  # the untied lm_head
    assert result["weights_from"] == "the recipe's quantize options"
    assert result["weights"] == pytest.approx(
        products * (0.5 + 2 / 32 + 0.5 / 32) + counts["embedding"] * 2 + counts["norms"] * 2)


def test_int8_o_proj_scales_follow_the_heads_width(tmp_path):
    """o_proj's K is heads x head_dim (32 here), not the hidden size (64): its own weights, and int8 scales repeated
    over a block of 32, not 64."""
    recipe = tmp_path / "tiny-int8-narrow-heads.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("head_dim: 16", "head_dim: 8").replace(
        "  - pack_projections", "  - pack_projections\n  - quantize: {bits: 8, method: rtn}").replace(
        "  - lower_onnxruntime ", "  - lower_onnx_attention "))  # GroupQueryAttention takes head_dim 16, 32, ...
    result = plan(str(recipe), device="H100")
    counts = result["params"]
    o_proj, down = 2 * 32 * 64, 2 * 128 * 64
    assert counts["attention"] == 2 * (2 * 64 * 32 + 2 * 64 * 16)
    reading_hidden = counts["attention"] - o_proj + counts["mlp"] - down + 512 * 64
    assert result["weights"] == pytest.approx(reading_hidden * (1 + 4 / 64) + o_proj * (1 + 4 / 32)
                                              + down * (1 + 4 / 128) + counts["embedding"] * 4 + counts["norms"] * 4)


def test_int8_weights_with_a_float_prefill_count_both_and_may_not_fit(tmp_path):
    """dequantize_weights keeps float32 copies of INT8 products too, and they count against the device's memory."""
    recipe = tmp_path / "tiny-int8-float-prefill.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace(  # in the order the build takes
        "  - skip_unused_rows", "  - quantize: {bits: 8, method: rtn}\n  - skip_unused_rows\n"
                                "  - dequantize_weights: {phases: [prefill]}"))
    result = plan(str(recipe), device="H100")
    counts = result["params"]
    float_copies = 4 * (counts["attention"] + counts["mlp"])
    assert result["inputs"]["precision"] == "int8" and result["memory"]["prefill_float_weights"] == float_copies
    total = result["weights"] + float_copies + result["kv"]["total"]
    assert result["memory"]["total"] == pytest.approx(total)
    # memory that holds the weights and the cache but not the float copies too
    headroom = (total - float_copies / 2) / (81559 * 2**20)
    assert not plan(str(recipe), device="H100", headroom=headroom)["memory"]["fits"]


def test_a_decode_step_of_a_float16_artifact_skips_its_float16_table(tmp_path):
    """artifact_step_weight_bytes (what bench divides by a step's time) less the untied table at its stored float16
    size; a tied table quantized with the lm_head is the head's own codes, read whole."""
    from compiler.plan import artifact_step_weight_bytes

    manifest = {"format": "aotlm-artifact", "format_version": 1, "name": "x",
                "recipe": {"export": {"dtype": "float16"}, "passes": [{"quantize": {"bits": 4, "block_size": 32}}]},
                "model": {"config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                     "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                     "max_position_embeddings": 256}},
                "backend": {"weights": {"file": "weights.bin", "bytes": 200_000}}, "tokenizer": {}, "engines": {},
                "files": {}, "kv_cache": {"max_context": 128, "dtype": "float16"}}
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    assert artifact_step_weight_bytes(tmp_path) == 200_000 - 512 * 64 * 2
    manifest["model"]["config"]["tie_word_embeddings"] = True
    manifest["recipe"]["passes"] = [{"quantize": {"bits": 4, "block_size": 32, "embedding": "quantized"}}]
    manifest["passes"] = [{"name": "quantize", "phase": "decode", "seconds": 0.1,
                           "report": {"embedding": {"quantized": True}}}]
    (tmp_path / "manifest.json").write_text(json.dumps(with_required_fields(manifest)))
    assert artifact_step_weight_bytes(tmp_path) == 200_000


def test_a_pre_quantized_checkpoint_is_refused_as_the_build_refuses_it(tmp_path):
    """A GPTQ folder's config.json describes the float model it was made from: the plan had counted it as that."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(BuildError, match=r"config.json: quantization_config \(gptq\): a pre-quantized checkpoint"):
        plan(str(tmp_path), device="H100")


def test_a_tied_config_beside_a_stored_head_is_warned_of(tmp_path):
    """The build unties a tied model whose weights store their own lm_head (unless it equals the table); the plan
    reads tensor names only, so it counts the head tied and says what it would add."""
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "tie_word_embeddings": True}))
    assert plan(str(tmp_path), device="H100")["warnings"] == []  # a config alone: nothing stored to see
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    assert plan(str(tmp_path), device="H100")["warnings"] == []
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32), "lm_head.weight": np.ones((2, 2), np.float32)},
              str(tmp_path / "model.safetensors"))
    warnings = plan(str(tmp_path), device="H100")["warnings"]
    assert len(warnings) == 1 and "also store lm_head.weight" in warnings[0] and "525M parameters" in warnings[0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model.safetensors"}}))  # the index is what the build reads by
    assert plan(str(tmp_path), device="H100")["warnings"] == []
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))  # untied: counted, nothing to warn of
    (tmp_path / "model.safetensors.index.json").unlink()
    assert plan(str(tmp_path / "config.json"), device="H100")["warnings"] == []


def test_a_hub_id_is_answered_with_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BuildError, match=r"HuggingFaceTB/SmolLM2-135M: no such file or folder\. 'HuggingFaceTB/"
                                         r"SmolLM2-135M' reads like a Hugging Face Hub id: aotlm reads local files only"):
        plan("HuggingFaceTB/SmolLM2-135M", device="H100")
    (tmp_path / "r.yaml").write_text("name: r\nmodel: {source: gguf, path: someone/model-GGUF}\n")
    with pytest.raises(BuildError, match=r"GGUF file not found: .*model-GGUF\. Check the model path in the recipe\. "
                                         r"'someone/model-GGUF' reads like a "
                                         r"Hugging Face Hub id: .* `hf download someone/model-GGUF FILE\.gguf"):
        plan(str(tmp_path / "r.yaml"), device="H100")
    with pytest.raises(BuildError, match=r"x\.gguf: no such file or folder\.$"):
        plan("models/x.gguf", device="H100")


def test_onnxruntime_graphs_planned_on_a_gpu_are_said_to_run_on_cpu(tmp_path):
    """The README's tour planned the default (onnxruntime, CPU) recipe on an H100 and printed 0.19 ms a token with no
    word that its engines never run on a GPU."""
    for source in (str(TINY_RECIPE), tiny_float_artifact(tmp_path)):
        warnings = plan(source, device="H100")["warnings"]
        assert any("builds onnxruntime CPU graphs, which the runtime runs on cpu, not on a GPU" in w for w in warnings)
    assert not any("CPU graphs" in w for w in plan(str(TINY_RECIPE), device="cpu", measure=False)["warnings"])


def test_a_tensorrt_recipes_max_concurrency_is_at_most_its_max_batch(tmp_path):
    head, _ = TINY_RECIPE.read_text().split("passes:")
    recipe = tmp_path / "tiny-tensorrt.yaml"
    recipe.write_text(head.replace("  max_context: 128", "  max_context: 128\n  dtype: float16\n  max_batch: 4")
                      + "passes:\n  - cleanup\n  - fuse_attention\n  - lower_tensorrt\nbackend:\n  name: tensorrt\n")
    assert plan(str(recipe), device="H100")["memory"]["max_concurrency"] == 4  # memory alone: thousands


def test_a_tied_float_table_is_held_once_more_per_onnxruntime_session(tmp_path):
    """Each session prepacks the lm_head's product and its Gather reads the table itself: SmolLM2's fp32 artifact
    measured 1.46-1.52 GB resident, and plan counted 2 x 539 MB."""
    tied = dataclasses.replace(load_recipe(TINY_RECIPE).model.config, tie_word_embeddings=True)
    config_file = tmp_path / "tied.yaml"
    text = TINY_RECIPE.read_text().replace("tie_word_embeddings: false", "tie_word_embeddings: true")
    config_file.write_text(text)
    result = plan(str(config_file), device="cpu", measure=False)
    table = tied.vocab_size * tied.hidden_size * 4
    assert result["memory"]["gather_tables"] == 2 * table
    assert result["memory"]["total"] == 2 * result["weights"] + 2 * table + result["kv"]["total"]
    untied = plan(str(TINY_RECIPE), device="cpu", measure=False)
    assert untied["memory"]["gather_tables"] == 0


def test_a_recipes_weights_follow_its_overrides_and_excludes(tmp_path):
    """Only the pass-wide bits were read: excluding the MLP (kept float) planned 84 MB for SmolLM2's ~353 MB."""
    text = TINY_RECIPE.read_text().replace("  - pack_projections", "  - pack_projections\n  - quantize: {bits: 4, "
                                           "block_size: 16, method: rtn" + "{extra}}")
    config = load_recipe(TINY_RECIPE).model.config
    mlp = config.num_layers * 3 * config.hidden_size * config.intermediate_size

    def weights(extra: str) -> float:
        recipe = tmp_path / "q.yaml"
        recipe.write_text(text.replace("{extra}", extra))
        return plan(str(recipe), device="H100")["weights"]

    plain = weights("")
    int4_per_param = 0.5 + 4 / 16  # codes and a float32 scale per block of 16 (onnxruntime's)
    assert weights(', exclude: ["*mlp*"]') == pytest.approx(plain + mlp * (4 - int4_per_param))
    assert weights(', overrides: [{pattern: "*mlp*", skip: true}]') == pytest.approx(plain + mlp * (4 - int4_per_param))
    assert weights(', overrides: [{pattern: "*mlp*", bits: 8}]') > plain
    # pack_projections' names, which the pass matches after it (as its own error message suggests writing them)
    assert weights(', overrides: [{pattern: "*gate_proj+up_proj*", skip: true}]') == pytest.approx(
        plain + 2 * mlp // 3 * (4 - int4_per_param))
    # first match wins, as in the pass: down_proj in INT8 (its K the intermediate size), then gate and up float
    down = mlp // 3
    int8_per_param = 1 + 4 / config.intermediate_size  # one float32 scale per channel, kernel block = K here
    assert weights(', overrides: [{pattern: "*down_proj*", bits: 8}, {pattern: "*mlp*", skip: true}]') == \
        pytest.approx(plain + 2 * down * (4 - int4_per_param) + down * (int8_per_param - int4_per_param))
    # what the build refuses, plan refuses (it had sized them: Hugging Face weight names the graph does not have, a
    # pattern naming v_proj alone of the packed q/k/v, one trimmed from the packed name)
    for extra, said in ((', overrides: [{pattern: "model.layers.*.mlp.down_proj.weight", bits: 8}]', "match no MatMul"),
                        (', exclude: ["lm_head.weight"]', "match no MatMul"),
                        (', overrides: [{pattern: "*v_proj*", bits: 8}]', "names v_proj of the packed MatMul"),
                        (', overrides: [{pattern: "*k_proj+v_proj*", bits: 8}]', "names k_proj, v_proj of the packed")):
        with pytest.raises(BuildError, match=re.escape(said)):
            weights(extra)
    # what the build takes, plan takes: the packed weights' names; and nothing packed where min_group says so
    assert weights(', exclude: ["*.packed_weight"]') == pytest.approx(weights(', exclude: ["*packed_MatMul"]'))
    text = text.replace("  - pack_projections\n", "  - pack_projections: {min_group: 4}\n")
    assert weights(', exclude: ["*/q_proj/MatMul"]') < weights(', exclude: ["*_proj/MatMul"]')


def test_plan_finds_a_recipe_that_comes_with_aotlm_by_its_name(tmp_path, monkeypatch):
    """`aotlm build tiny-random` found the bundled recipe from any folder; `aotlm plan` said "no such file"."""
    monkeypatch.chdir(tmp_path)
    for given in ("tiny-random", "recipes/tiny-random.yaml"):
        config, info = load_source(given)
        assert info["kind"] == "recipe (random)" and info["path"].endswith("tiny-random.yaml")
    with pytest.raises(BuildError, match="tiny-randum: no such file or folder"):
        load_source("tiny-randum")


def test_without_pack_projections_plan_matches_the_unpacked_names(tmp_path):
    """A recipe that does not pack: '*v_proj*' names v_proj alone, as the build takes it (plan had assumed packed
    names for any recipe)."""
    text = TINY_RECIPE.read_text().replace("  - pack_projections\n", "  - quantize: {bits: 4, block_size: 16, "
                                           "method: rtn, overrides: [{pattern: \"*v_proj*\", bits: 8}]}\n")
    assert "pack_projections" not in text
    recipe = tmp_path / "q.yaml"
    recipe.write_text(text)
    with_override = plan(str(recipe), device="H100")["weights"]
    recipe.write_text(text.replace(', overrides: [{pattern: "*v_proj*", bits: 8}]', ""))
    assert with_override > plan(str(recipe), device="H100")["weights"]


def test_the_cpu_figures_are_cached_per_count_of_usable_cpus(monkeypatch, tmp_path):
    """A figure measured on 1 of 2 CPUs (taskset, a container) was served to later runs on both, and back."""
    calls = []
    monkeypatch.setattr(plan_module, "CACHE_FILE", tmp_path / "cpu.json")
    monkeypatch.setattr(plan_module, "measure_cpu", lambda: calls.append(1) or dict(FAKE_CPU))
    monkeypatch.setattr(plan_module, "usable_cpus", lambda: 1)
    plan_module.cpu_device()
    plan_module.cpu_device()
    monkeypatch.setattr(plan_module, "usable_cpus", lambda: 2)
    plan_module.cpu_device()
    assert len(calls) == 2  # once per count, each cached


def test_the_cpu_cache_follows_xdg_and_a_user_without_a_home_measures_each_time(monkeypatch, tmp_path):
    """Path.home() at import raised for a user id with no passwd entry (OpenShift's): every `aotlm plan` failed."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert plan_module._cpu_cache_file() == tmp_path / "aotlm" / "cpu.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the specification says

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(plan_module.Path, "home", staticmethod(no_home))
    assert plan_module._cpu_cache_file() is None
    monkeypatch.setattr(plan_module, "CACHE_FILE", None)
    measured = []
    monkeypatch.setattr(plan_module, "measure_cpu", lambda: measured.append(1) or dict(FAKE_CPU))
    plan_module.cpu_device()
    plan_module.cpu_device()
    assert len(measured) == 2
