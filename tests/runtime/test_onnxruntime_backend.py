"""The onnxruntime backend's session settings: an engine's session_config entries (recorded by passes, copied into
the manifest) reach its session, and a malformed one is refused with the fix."""
from __future__ import annotations

import io
import json
import os
import re
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from runtime.errors import AotlmWarning, ArtifactError
from runtime.onnxruntime_backend import (ALLOW_SPINNING, STOP_SPINNING_AFTER_RUN, cache_dtype, check_version,
                                         session_options)


def test_an_engines_session_config_entries_are_set_on_its_session_options():
    options = session_options({"graph_optimization_level": "all"}, 2, {"session.disable_quant_qdq": "1"})
    assert options.get_session_config_entry("session.disable_quant_qdq") == "1"
    assert options.intra_op_num_threads == 2
    plain = session_options({}, None)
    with pytest.raises(RuntimeError, match="does not have configuration with key"):  # never set
        plain.get_session_config_entry("session.disable_quant_qdq")


@pytest.mark.parametrize("config", [["session.disable_quant_qdq"], {"session.disable_quant_qdq": 1}, {1: "1"}])
def test_a_malformed_session_config_is_refused_naming_the_engine(config):
    with pytest.raises(ArtifactError, match=r"manifest engines\.prefill: session_config must map onnxruntime config "
                                            r"keys to strings.*rebuild the artifact"):
        session_options({}, None, config, "manifest engines.prefill")


def test_sessions_stop_spinning_after_each_run_unless_asked_or_the_engine_says_otherwise():
    assert session_options({}, None).get_session_config_entry(STOP_SPINNING_AFTER_RUN) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration with key"):  # unset: spinning on after a run
        session_options({}, None, spin_after_run=True).get_session_config_entry(STOP_SPINNING_AFTER_RUN)
    recorded = session_options({}, None, {STOP_SPINNING_AFTER_RUN: "0"})  # an engine's own entry wins
    assert recorded.get_session_config_entry(STOP_SPINNING_AFTER_RUN) == "0"


def test_an_engine_opens_its_sessions_with_the_spinning_setting(tiny_artifact, opened_sessions_stop_spinning):
    from runtime import Engine

    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=False)
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=True)
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=["decode"])
    Engine.load(tiny_artifact, huge_pages=False, spin_after_run=("prefill",))
    # per engine: its prefill session, then its decode session
    assert opened_sessions_stop_spinning == [True, True, False, False, True, False, False, True]


def test_aotlm_run_keeps_only_the_decode_session_spinning(tiny_artifact, opened_sessions_stop_spinning, capsys):
    from compiler.cli import main

    assert main(["run", str(tiny_artifact), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert opened_sessions_stop_spinning == [True, False]  # one request: prefill stops, decode spins on


def test_sessions_may_be_told_never_to_spin_and_an_engines_own_entry_wins():
    """spin_during_run=False, for a host whose cores other processes use: no spinning while a run waits either."""
    assert session_options({}, None, spin_during_run=False).get_session_config_entry(ALLOW_SPINNING) == "0"
    with pytest.raises(RuntimeError):  # the default: never set, onnxruntime's threads spin during a run
        session_options({}, None).get_session_config_entry(ALLOW_SPINNING)
    own = session_options({}, None, {ALLOW_SPINNING: "1"}, spin_during_run=False)
    assert own.get_session_config_entry(ALLOW_SPINNING) == "1"


@pytest.mark.parametrize("command", [
    ["run", "--prompt", "hi", "--max-new-tokens", "2"],
    ["chat"],
    ["bench", "--requests", "1", "--prompt-tokens", "4", "--output-tokens", "2", "--warmup", "0"],
    ["eval", "--text", "builtin:pydoc-held-out", "--max-tokens", "40", "--window", "16"],
])
def test_no_spin_reaches_every_session_an_engine_opens(command, chat_artifact, monkeypatch, capsys, tmp_path):
    """`--no-spin` on run, chat, bench and eval (serve: tests/compiler/test_cli_serve.py) opens both sessions
    without spinning; without it, both spin during runs. bench records which in its JSON."""
    import runtime.onnxruntime_backend as backend
    from compiler.cli import main

    artifact = chat_artifact[0]
    allowed: list[str | None] = []
    real = backend.session_options

    def recording(*args, **keywords):
        options = real(*args, **keywords)
        try:
            allowed.append(options.get_session_config_entry(ALLOW_SPINNING))
        except RuntimeError:
            allowed.append(None)
        return options

    monkeypatch.setattr(backend, "session_options", recording)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    out = ["--out", str(tmp_path / "bench.json")] if command[0] == "bench" else []
    for flags, expected in (([], [None, None]), (["--no-spin"], ["0", "0"])):
        allowed.clear()
        assert main([command[0], str(artifact), *command[1:], *out, *flags]) == 0, capsys.readouterr()
        assert allowed == expected, (command[0], flags)
        if out:
            settings = json.loads((tmp_path / "bench.json").read_text())["settings"]
            assert settings["spin_during_run"] is (flags == [])


def test_an_engine_refuses_a_spinning_flag_that_is_not_a_bool(tiny_artifact):
    from runtime import Engine
    from runtime.errors import RequestError

    with pytest.raises(RequestError, match="spin_during_run must be True or False, got 'no'"):
        Engine.load(tiny_artifact, spin_during_run="no")


def test_a_recipes_thread_count_above_this_machines_cores_runs_with_the_cores(monkeypatch):
    """An artifact built with backend.intra_op_threads for a bigger machine: more threads than cores only contend
    (thousands hang), as Engine.load refuses for an explicit count; the manifest's is capped, with a warning."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr("runtime.cpus.cgroup_cpu_quota", lambda: None)
    with pytest.warns(RuntimeWarning, match="backend.intra_op_threads: 16, more than the 2 CPUs this process may use"):
        assert session_options({"intra_op_threads": 16}, None).intra_op_num_threads == 2
    assert session_options({"intra_op_threads": 2}, None).intra_op_num_threads == 2


def test_an_explicit_thread_count_wins_over_the_recipes_even_zero():
    """0 asks for onnxruntime's default: it must not fall back to the manifest's count as a falsy value would."""
    assert session_options({"intra_op_threads": 2}, 0).intra_op_num_threads == 0
    assert session_options({"intra_op_threads": 2}, 1).intra_op_num_threads == 1
    assert session_options({}, None).graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_as_many_threads_as_cores_runs_without_a_warning(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert session_options({"intra_op_threads": 2}, None).intra_op_num_threads == 2


def test_engine_load_takes_zero_threads_and_as_many_as_cores(tiny_artifact):
    from runtime import Engine

    for threads in (0, os.cpu_count()):
        engine = Engine.load(tiny_artifact, intra_op_threads=threads, huge_pages=False)
        assert [session.get_session_options().intra_op_num_threads for session in engine.backend.sessions.values()] \
            == [threads, threads]


def test_a_cache_type_this_runtime_does_not_keep_is_refused_with_the_fix():
    assert cache_dtype({"dtype": "int8"}) is np.int8 and cache_dtype({}) is np.float32
    with pytest.raises(ArtifactError, match="kv_cache.dtype 'float16'.*rebuild the artifact for backend onnxruntime"):
        cache_dtype({"dtype": "float16"})


def test_an_onnxruntime_older_than_the_builds_is_noted_down_to_the_patch_release():
    assert check_version("1.24.1", "1.24.1") is None and check_version("1.24.1", "1.25.0rc1") is None
    assert "built with onnxruntime 1.24.1, and 1.24.0 is installed (older)" in check_version("1.24.1", "1.24.0")


def test_an_onnxruntime_older_than_aotlms_floor_is_refused_whatever_built_the_artifact():
    """onnxruntime 1.20-1.22 built artifacts that not even they could load (GroupQueryAttention's output_qk came in
    1.23): the load and the build say which release to install."""
    with pytest.raises(ArtifactError, match=r"onnxruntime 1.22.0 is installed; aotlm's graphs need 1.23.1 or later .*"
                                            r"pip install -U 'onnxruntime>=1.23.1'"):
        check_version("1.22.0", "1.22.0")
    with pytest.raises(ArtifactError, match="Attention's grouped heads"):  # 1.23.0's gave other tokens
        check_version("1.23.0", "1.23.0")
    check_version("1.23.1", "1.23.1")


def test_an_int8_cache_on_an_onnxruntime_without_its_inputs_is_refused_at_load():
    """1.25 and 1.26 loaded an int8-cache artifact ("it loaded, and runs") and failed at its first step with a
    traceback from inside onnxruntime; 1.23 and 1.24 named the release that built it, not the one it needs."""
    with pytest.raises(ArtifactError, match=r"onnxruntime 1.26.0 is installed; an int8 KV cache .* needs 1.27 or "
                                            r"later: .* -m pip install -U 'onnxruntime>=1.27'"):
        check_version("1.32.0", "1.26.0", ["int8_kv_cache"])
    assert "older" in check_version("1.32.0", "1.27.0", ["int8_kv_cache"])  # loads, with the warning
    assert check_version("1.32.0", "1.26.0", ["session_config"]) is not None  # not a cache: tried



def test_the_cache_counts_every_buffer_of_its_dtype(tiny_engine):
    backend = tiny_engine.backend
    cache = backend.cache
    assert cache.nbytes == sum(buffer.numpy().nbytes for buffer in cache.buffers) == backend.bytes_per_sequence
    assert {buffer.numpy().dtype for buffer in cache.buffers} == {np.dtype(backend.cache_dtype)}


def test_multi_token_logits_are_not_overwritten_by_a_later_run(tiny_engine):
    """Only single-token steps write into a reused logits array; a chunk's logits are the caller's to keep
    (runtime/evaluate.py holds every piece's logits of a prompt)."""
    backend = tiny_engine.backend
    ones = np.ones((1, 64), dtype=np.int64)
    backend.run("prefill", np.array([[1, 5]]), np.arange(2)[None], ones[:, :2])
    chunks, kept = [], []
    for start, ids in ((2, [7, 8, 9]), (5, [10, 11, 12]), (8, [13, 14, 15])):
        chunks.append(backend.run("decode", np.array([ids]), np.arange(start, start + 3)[None], ones[:, : start + 3]))
        kept.append(chunks[-1].copy())  # as this run returned them
    for logits, copy in zip(chunks, kept):
        np.testing.assert_array_equal(logits, copy)


def test_an_idle_binding_lets_go_of_its_last_multi_token_logits(tiny_engine):
    """A slot's binding that ran a prompt piece (scored, or a chunk on the decode graph) then sits idle: it held the
    piece's [1, count, vocab] logits until its next run (8 slots after 120-token scored prompts: 180 MiB of
    SmolLM2's). It lets go after the run; the caller's array stays valid."""
    cache = tiny_engine.backend.allocate_slots(2)
    ids, ones = np.array([[1, 5, 6, 7, 8]]), np.ones((1, 6), dtype=np.int64)
    logits = cache.run("decode", (1, 2), ids, np.arange(5)[None], ones[:, :5])
    kept = logits.copy()
    binding = cache._bindings[("decode", 1, 2)][0]
    assert not binding.get_outputs()[0].is_tensor()  # nothing bound to hold: onnxruntime allocates at the next run
    step = cache.run("decode", (1, 2), np.array([[9]]), np.array([[5]]), ones)
    assert step.shape == (1, 1, logits.shape[-1]) and binding.get_outputs()[0].is_tensor()  # single-token: reused
    np.testing.assert_array_equal(logits, kept)


def test_an_int8_cache_is_sized_by_its_own_element_type(tiny_engine):
    """The memory checks (check_slots, allocate_cache) count an int8 cache's bytes, a quarter of float32's."""
    backend = tiny_engine.backend
    float32_bytes = backend.bytes_per_sequence
    backend.cache_dtype = np.int8  # what an artifact built with quantize_kv_cache loads with (not run here)
    assert backend.bytes_per_sequence * 4 == float32_bytes
    assert backend.allocate_cache(batch=2).nbytes == 2 * backend.bytes_per_sequence


def test_numpy_integer_slot_counts_are_checked_as_python_integers(tiny_engine, monkeypatch):
    """An int32 count times a sequence's bytes wrapped in numpy (300 of SmolLM2's 90 MiB passed a 21 GiB check), an
    int8 one raised numpy's OverflowError, and an int32 max_queue of 2**31 - 1 refused every request as full."""
    from runtime import onnxruntime_backend
    from runtime.errors import RequestError

    monkeypatch.setattr(onnxruntime_backend, "available_memory_bytes", lambda: 21 << 30)
    with pytest.raises(RequestError, match="slots: 300 sequences need 26.4 GiB"):
        onnxruntime_backend.check_slot_memory(np.int32(300), np.int32(94_371_840))
    with pytest.raises(RequestError, match="slots: 100 sequences need"):
        onnxruntime_backend.check_slot_memory(np.int8(100), np.int64(1 << 30))
    monkeypatch.undo()
    scheduler = tiny_engine.start_scheduler(slots=np.int8(2), max_queue=np.int32(2**31 - 1))
    try:
        assert type(scheduler.slots) is int and type(scheduler.max_queue) is int
        assert len(tiny_engine.submit([1, 5, 6], max_new_tokens=3, ignore_eos=True).result(timeout=30).token_ids) == 3
    finally:
        tiny_engine.close()


def test_the_memory_refusal_advises_an_int8_cache_only_where_the_cache_is_float(monkeypatch):
    """An artifact with an int8 cache was told to build one."""
    from runtime import onnxruntime_backend
    from runtime.errors import RequestError

    monkeypatch.setattr(onnxruntime_backend, "available_memory_bytes", lambda: 1 << 30)
    for int8_cache, advised in ((False, True), (True, False)):
        with pytest.raises(RequestError, match="use at most 2, or build with a smaller export.max_context") as refused:
            onnxruntime_backend.check_slot_memory(100, 256 << 20, int8_cache=int8_cache)
        assert ("an int8 cache (quantize_kv_cache)" in str(refused.value)) == advised


def test_both_onnxruntime_packages_installed_is_said_with_the_fix(monkeypatch):
    """aotlm[cpu,gpu] (or onnxruntime-genai beside aotlm[gpu]) installs onnxruntime and onnxruntime-gpu into one
    module, mixed, without a word from pip."""
    from importlib import metadata

    import runtime.onnxruntime_backend as backend

    monkeypatch.setattr(metadata, "version", lambda name: {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}[name])
    with pytest.warns(AotlmWarning, match=r"both onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1 are installed.*"
                                         r"pip uninstall -y onnxruntime onnxruntime-gpu"):
        backend._one_onnxruntime()

    def cpu_only(name):
        if name == "onnxruntime-gpu":
            raise metadata.PackageNotFoundError(name)
        return "1.32.0"

    monkeypatch.setattr(metadata, "version", cpu_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend._one_onnxruntime()


def test_runs_of_many_tokens_give_their_arena_growth_back_and_decode_steps_keep_theirs(tiny_artifact, monkeypatch):
    """onnxruntime's arena kept the peak of the longest prompt for good (+296 MiB after four 1800-token prompts on
    the default model); the run option that shrinks it is given to prefills and prompt pieces, not decode steps."""
    from runtime import Engine, onnxruntime_backend

    engine = Engine.load(tiny_artifact)
    options = []
    for session in engine.backend.sessions.values():
        real = session.run_with_iobinding
        monkeypatch.setattr(session, "run_with_iobinding",
                            lambda binding, run_options=None, real=real: options.append(run_options) or
                            real(binding, run_options))
    engine.generate("a prompt of several tokens", max_new_tokens=3, ignore_eos=True)
    assert options[0] is onnxruntime_backend.SHRINK_ARENA and options[1:] == [None, None]
    assert onnxruntime_backend.SHRINK_ARENA.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"


def test_what_the_arena_gives_back_is_given_back_to_the_system_at_most_once_a_second(tiny_artifact, monkeypatch):
    """glibc kept the shrunk arena's blocks in its heap: with prompts of every length, resident memory grew 37-52%
    from the 100th to the 1,000th request of a tiny model (in use: flat). malloc_trim after a run of many tokens gives
    them back, at most once a second (1-4 ms each for the default model's heap)."""
    import ctypes

    from runtime import Engine, onnxruntime_backend

    assert onnxruntime_backend.FREED_MEMORY.trim is not None  # glibc: these hosts, CI
    calls, clock = [], [100.0]
    freed = onnxruntime_backend.FreedMemory()
    freed.trim, freed.clock = (lambda pad: calls.append(pad)), (lambda: clock[0])
    monkeypatch.setattr(onnxruntime_backend, "FREED_MEMORY", freed)
    engine = Engine.load(tiny_artifact)
    engine.generate("a prompt of several tokens", max_new_tokens=3, ignore_eos=True)  # a prefill, two decode steps
    assert calls == [0]
    clock[0] += 0.5
    engine.generate("another prompt of several tokens", max_new_tokens=3, ignore_eos=True)
    assert calls == [0]  # within the second
    clock[0] += 0.6
    engine.generate("a third prompt", max_new_tokens=3, ignore_eos=True)
    assert calls == [0, 0]
    assert ctypes.CDLL(None).malloc_trim(0) in (0, 1)  # the real one: callable as the engine calls it


def test_a_c_library_without_malloc_trim_or_a_windows_ctypes_leaves_the_trim_out(monkeypatch):
    """Windows' ctypes refuses CDLL(None) with a TypeError, which the import let through: no engine loaded there."""
    import ctypes

    from runtime import onnxruntime_backend

    for error in (TypeError("argument of type 'NoneType' is not iterable"), OSError("no such library")):
        def refused(name, error=error):
            raise error
        monkeypatch.setattr(ctypes, "CDLL", refused)
        assert onnxruntime_backend.FreedMemory().trim is None


def test_the_fix_for_an_old_onnxruntime_installs_into_this_interpreter_s_environment():
    """`pip install -U ...` named whichever pip came first on PATH (pyenv's, here), not the .venv's that runs aotlm
    (README runs .venv/bin/aotlm without activating it): following it upgraded another Python."""
    import shlex
    import sys

    from runtime import ArtifactError
    from runtime.onnxruntime_backend import check_installed

    with pytest.raises(ArtifactError, match=re.escape(f"{shlex.quote(sys.executable)} -m pip install -U "
                                                      f"'onnxruntime>=1.23.1'")):
        check_installed("1.23.0")


def test_decode_steps_never_trim_only_runs_of_many_tokens_do(tiny_artifact, monkeypatch):
    """A trim after every decode step would cost 1-4 ms a token for nothing: the arena keeps a step's memory."""
    from runtime import Engine, onnxruntime_backend

    calls, clock = [], [100.0]
    freed = onnxruntime_backend.FreedMemory()

    def advancing():
        clock[0] += 5.0  # past the interval at every look: only the runs that may trim decide
        return clock[0]

    freed.trim, freed.clock = (lambda pad: calls.append(pad)), advancing
    monkeypatch.setattr(onnxruntime_backend, "FREED_MEMORY", freed)
    engine = Engine.load(tiny_artifact)
    calls.clear()
    engine.generate("a prompt of several tokens", max_new_tokens=6, ignore_eos=True)  # a prefill, five decode steps
    assert calls == [0]


def test_a_gpu_install_is_told_to_upgrade_onnxruntime_gpu_not_to_add_the_cpu_package(monkeypatch):
    """Told `pip install -U onnxruntime`, an onnxruntime-gpu install got both packages in one module."""
    from importlib import metadata

    monkeypatch.setattr(metadata, "packages_distributions", lambda: {"onnxruntime": ["onnxruntime-gpu"]})
    assert "install onnxruntime-gpu>=1.32.0, or rebuild" in check_version("1.32.0", "1.31.1")
    with pytest.raises(ArtifactError, match=r"-U 'onnxruntime-gpu>=1.27'"):
        check_version("1.32.0", "1.26.0", ["int8_kv_cache"])
    with pytest.raises(ArtifactError, match=r"-U 'onnxruntime-gpu>=1.23.1'"):
        check_version("1.22.0", "1.22.0")
    # both packages in one module (_one_onnxruntime warns), or none found: the CPU package's name
    for found in (["onnxruntime", "onnxruntime-gpu"], []):
        monkeypatch.setattr(metadata, "packages_distributions", lambda: {"onnxruntime": found})
        assert "install onnxruntime>=1.32.0, or rebuild" in check_version("1.32.0", "1.31.1")


def test_an_engine_says_it_runs_on_the_cpu_where_onnxruntime_offers_cuda(tiny_artifact, monkeypatch):
    """onnxruntime-gpu installed: the sessions are still CPU ones (the graphs are lowered for its CPU kernels), and a
    user who expected the GPU is told so, with what runs there."""
    from runtime import Engine

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["AzureExecutionProvider", "CPUExecutionProvider"])
    with warnings.catch_warnings(record=True) as caught:  # the CPU package's providers
        warnings.simplefilter("always")
        Engine.load(tiny_artifact, huge_pages=False).close()
    assert not [w for w in caught if "CUDA build" in str(w.message)]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.warns(AotlmWarning, match="a CUDA build .* runs onnxruntime artifacts on the CPU.*TensorRT artifact"):
        engine = Engine.load(tiny_artifact, huge_pages=False)
    assert {s.get_providers()[0] for s in engine.backend.sessions.values()} == {"CPUExecutionProvider"}
    engine.close()
