"""The compiled host step (``OFFLOAD_FSDP_HOST_STEP=auto``, the default, or ``compiled``) against the fused path.

Stated tolerance: none. The compiled C loop reproduces torch's fused Adam kernel
bit for bit (and the default path's bf16 casts and stochastic-rounding noise), so
every comparison here is ``torch.equal`` on params and on every state tensor.
"""

from __future__ import annotations

import io
import logging
import shutil
import warnings

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer, compiled_step, fused_step
from offload_fsdp.compiled_step import HOST_STEP_ENV, compiled_adam_bucket_step
from offload_fsdp.fused_step import PieceScratch, adam_bucket_step
from optim import PrecisionPolicy

BF16, FP32 = torch.bfloat16, torch.float32
SIZES = (37, 1000, 3, 129)  # partial vectors at every record end; 3 < one vector

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc) for the compiled host step")


def _params(dtype, sizes=SIZES):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in sizes]


def _build(monkeypatch, host_step, params, policy, opt_cls, piece=64, **hyper):
    if host_step is None:
        monkeypatch.delenv(HOST_STEP_ENV, raising=False)
    else:
        monkeypatch.setenv(HOST_STEP_ENV, host_step)
    monkeypatch.setattr(fused_step, "PIECE_NUMEL", piece)  # small pieces split params: calls start and end mid-record
    opt = HybridDeviceOptimizer(opt_cls(params, lr=0.01, **hyper), 1.0, precision=policy)
    # Private: which of two bit-identical host steps runs shows in speed only.
    assert opt._host.kernel.host_step is (adam_bucket_step if host_step == "fused" else compiled_adam_bucket_step)
    return opt


def _steps(opt, params, policy, start, stop, threads=1):
    """Steps ``start..stop-1`` on grads fixed by the step number (param 1 gets none at step 1)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(start, stop):
            gen = torch.Generator().manual_seed(100 + step)
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen) * 0.1
                if policy.main_grads_dtype == FP32:
                    p.decoupled_grad = None if (i == 1 and step == 1) else g
                else:
                    p.grad = None if (i == 1 and step == 1) else g.to(p.dtype)
            opt.step()
    finally:
        torch.set_num_threads(threads_before)


def _train(monkeypatch, host_step, dtype, policy, opt_cls, steps, *, piece=64, threads=1, sizes=SIZES, **hyper):
    """``steps`` steps from fixed initial params; returns (params, state_dict). ``host_step=None``: env unset."""
    params = _params(dtype, sizes)
    opt = _build(monkeypatch, host_step, params, policy, opt_cls, piece, **hyper)
    _steps(opt, params, policy, 0, steps, threads)
    return [p.detach().clone() for p in params], opt.state_dict()


class _Calls(list):
    """Elements per C call; ``threads`` holds the thread count each call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []


@pytest.fixture
def c_calls(monkeypatch):
    """Elements stepped by the C loop, so a silent fallback to the fused path cannot pass for parity."""
    seen = _Calls()
    run = compiled_step._run

    def counting(items, threads=1):
        seen.append(sum(item.n for item in items))
        seen.threads.append(threads)
        run(items, threads)

    monkeypatch.setattr(compiled_step, "_run", counting)
    return seen


def _assert_identical(a, b):
    (params_a, sd_a), (params_b, sd_b) = a, b
    for x, y in zip(params_a, params_b):
        assert torch.equal(x, y)
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for key, entry in sd_a["state"].items():
        for name, value in entry.items():
            assert value.dtype == sd_b["state"][key][name].dtype
            assert torch.equal(value, sd_b["state"][key][name]), (key, name)


BF16_STATE = PrecisionPolicy(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
CASES = {
    "bf16 params, fp32 state, AdamW": (BF16, PrecisionPolicy(), torch.optim.AdamW, {"weight_decay": 0.1}),
    "bf16 params, bf16 state (SR on exp_avg_sq), Adam L2 maximize": (
        BF16, BF16_STATE, torch.optim.Adam, {"weight_decay": 0.1, "maximize": True}),
    "fp32 params, bf16 state (SR on both), AdamW beta1=0.99": (
        FP32, BF16_STATE, torch.optim.AdamW, {"betas": (0.99, 0.999), "weight_decay": 0.0}),
    "bf16 params, fp32 grads, bf16 exp_avg_sq, Adam beta1=0.3": (
        BF16, PrecisionPolicy(main_grads_dtype=FP32, exp_avg_sq_dtype=BF16), torch.optim.Adam, {"betas": (0.3, 0.999)}),
}  # fmt: skip


@needs_cc
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_step_is_bit_identical_to_the_fused_path(monkeypatch, c_calls, case):
    dtype, policy, opt_cls, hyper = CASES[case]
    fused = _train(monkeypatch, "fused", dtype, policy, opt_cls, 4, **hyper)
    assert not c_calls
    compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 4, **hyper)
    assert sum(c_calls) == 4 * sum(SIZES) - SIZES[1]  # every active element, every step, in C
    _assert_identical(fused, compiled)


@needs_cc
def test_compiled_step_spread_over_threads_and_whole_pieces_is_still_bit_identical(monkeypatch, c_calls):
    dtype, policy, opt_cls, hyper = CASES["bf16 params, bf16 state (SR on exp_avg_sq), Adam L2 maximize"]
    for piece in (64, 1 << 19):
        fused = _train(monkeypatch, "fused", dtype, policy, opt_cls, 3, piece=piece, **hyper)
        compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 3, piece=piece, threads=2, **hyper)
        _assert_identical(fused, compiled)
    assert c_calls and set(c_calls.threads) == {2}  # every C call spread over the 2 torch threads


@needs_cc
@pytest.mark.parametrize("saved_by", ["fused", "compiled"])
def test_resume_with_the_compiled_step_is_bit_exact(monkeypatch, saved_by):
    """5 straight steps == 3 steps, save (weights_only round trip), load into a fresh optimizer, 2 steps."""
    dtype, policy, opt_cls, hyper = CASES["bf16 params, bf16 state (SR on exp_avg_sq), Adam L2 maximize"]
    straight = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 5, **hyper)
    first = _params(dtype)
    saver = _build(monkeypatch, saved_by, first, policy, opt_cls, **hyper)
    _steps(saver, first, policy, 0, 3)
    buffer = io.BytesIO()
    torch.save(saver.state_dict(), buffer)
    buffer.seek(0)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt = _build(monkeypatch, "compiled", resumed, policy, opt_cls, **hyper)
    opt.load_state_dict(torch.load(buffer, weights_only=True))
    _steps(opt, resumed, policy, 3, 5)
    _assert_identical(straight, ([p.detach() for p in resumed], opt.state_dict()))


def test_an_unknown_host_step_name_is_a_value_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(HOST_STEP_ENV, "fastest")
    with pytest.raises(ValueError, match=HOST_STEP_ENV):
        HybridDeviceOptimizer([torch.zeros(3, requires_grad=True)], 1.0, lr=0.1)


def _probe_disagrees(library):
    raise RuntimeError("its arithmetic does not reproduce this torch build's fused Adam kernel bit for bit")


@pytest.fixture(params=["no compiler", "failed self-check"])
def failing_build(request, monkeypatch, tmp_path):
    """Fresh module state and a build that fails: no C compiler, or a loaded loop whose self-check disagrees.

    Yields the text the fallback message must quote. The self-check case loads a
    stand-in library (the probe is what fails, so no real build is needed).
    """
    monkeypatch.setattr(compiled_step, "_library", None)
    monkeypatch.setattr(compiled_step, "_load_failed", False)
    monkeypatch.setenv("OFFLOAD_FSDP_CACHE_DIR", str(tmp_path))
    if request.param == "no compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        yield "no-such-compiler"
    else:
        monkeypatch.setattr(compiled_step, "_compile_and_load", lambda: object())
        monkeypatch.setattr(compiled_step, "_probe_vec_width", _probe_disagrees)
        yield "does not reproduce"
    assert compiled_step._library is None, "a library that failed its build or self-check must never be used"


def test_a_failed_build_warns_once_and_falls_back_to_the_fused_path(monkeypatch, c_calls, failing_build):
    dtype, policy, opt_cls, hyper = CASES["bf16 params, fp32 state, AdamW"]
    with pytest.warns(RuntimeWarning, match="falling back") as caught:
        compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 2, **hyper)
        _train(monkeypatch, "compiled", dtype, policy, opt_cls, 1, **hyper)
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1 and failing_build in warned[0]
    assert not c_calls
    _assert_identical(_train(monkeypatch, "fused", dtype, policy, opt_cls, 2, **hyper), compiled)


@needs_cc
def test_the_default_host_step_runs_bf16_buckets_in_the_compiled_loop_with_identical_results(monkeypatch, c_calls):
    dtype, policy, opt_cls, hyper = CASES["bf16 params, fp32 state, AdamW"]
    default = _train(monkeypatch, None, dtype, policy, opt_cls, 3, **hyper)
    assert sum(c_calls) == 3 * sum(SIZES) - SIZES[1]
    _assert_identical(_train(monkeypatch, "fused", dtype, policy, opt_cls, 3, **hyper), default)


def test_the_compiled_steps_16_bit_noise_windows_hold_the_fused_paths_int32_noise_values():
    """The C loop reads the rounding noise as uint16; every window must be the int32 one, value for value."""
    scratch = PieceScratch(1000)
    for counter in (0, 1, 7919 * 3 + 104729, 2**40 + 5):
        wide, narrow = scratch.noise(1000, counter), scratch.noise(1000, counter, torch.uint16)
        assert narrow.dtype == torch.uint16 and narrow.element_size() == 2
        assert torch.equal(wide, narrow.to(torch.int32))
    assert int(wide.max()) >= 1 << 15  # the top bit is used: a signed 16-bit read would differ


@needs_cc
def test_staging_written_in_streamed_blocks_matches_the_fused_path_across_block_and_piece_edges(monkeypatch, c_calls):
    """Records longer than the C loop's 2048-element staging block, starting at odd offsets."""
    dtype, policy, opt_cls, hyper = CASES["bf16 params, fp32 state, AdamW"]
    sizes = (5001, 2048, 7, 4099)
    for piece in (3000, 1 << 19):
        fused = _train(monkeypatch, "fused", dtype, policy, opt_cls, 2, piece=piece, sizes=sizes, **hyper)
        compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 2, piece=piece, sizes=sizes, **hyper)
        _assert_identical(fused, compiled)
    assert sum(c_calls) == 2 * (2 * sum(sizes) - sizes[1])  # two piece sizes; param 1 has no grad at step 1


def test_a_failed_build_under_the_default_logs_once_without_a_warning_and_uses_the_fused_path(
    monkeypatch, caplog, c_calls, failing_build
):
    dtype, policy, opt_cls, hyper = CASES["bf16 params, fp32 state, AdamW"]
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger=compiled_step.__name__):
        warnings.simplefilter("error", RuntimeWarning)  # auto must not raise a RuntimeWarning
        default = _train(monkeypatch, None, dtype, policy, opt_cls, 2, **hyper)
        _train(monkeypatch, None, dtype, policy, opt_cls, 1, **hyper)
    logged = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(logged) == 1 and failing_build in logged[0]
    assert not c_calls
    _assert_identical(_train(monkeypatch, "fused", dtype, policy, opt_cls, 2, **hyper), default)


@needs_cc
def test_the_built_step_is_cached_so_a_later_process_loads_it_without_compiling(monkeypatch, tmp_path):
    # The build into the empty cache copies the library this machine's cache holds (the one every other test here
    # loads): what is checked is the cache, not the compiler, which test_without_openmp_... runs for real (~15 s).
    assert compiled_step.compiled_step_available()
    built = compiled_step.library_path()
    monkeypatch.setattr(compiled_step, "_compile", lambda compiler, out: shutil.copyfile(built, out))
    monkeypatch.setenv("OFFLOAD_FSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_step, "_library", None)
    monkeypatch.setattr(compiled_step, "_load_failed", False)
    assert compiled_step.compiled_step_available()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".so"]  # the library and its build lock
    monkeypatch.setattr(compiled_step, "_library", None)  # a "later process": fresh module state
    monkeypatch.setattr(compiled_step, "_compile", lambda *a: pytest.fail("compiled again despite the cache"))
    assert compiled_step.compiled_step_available()


@needs_cc
def test_without_openmp_the_pthread_build_is_bit_identical_over_two_threads(monkeypatch, tmp_path, c_calls):
    monkeypatch.setenv("OFFLOAD_FSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_step, "_library", None)
    monkeypatch.setattr(compiled_step, "_load_failed", False)
    monkeypatch.setattr(compiled_step, "_OPENMP_FLAGS", ["-fno-such-openmp-flag"])  # the OpenMP build fails
    assert compiled_step.compiled_step_available()
    library = compiled_step._library
    assert not any("GOMP" in line for line in _dynamic_symbols(library._name))  # the pthread variant
    dtype, policy, opt_cls, hyper = CASES["bf16 params, bf16 state (SR on exp_avg_sq), Adam L2 maximize"]
    fused = _train(monkeypatch, "fused", dtype, policy, opt_cls, 3, **hyper)
    compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 3, threads=2, **hyper)
    assert compiled_step._library is library and set(c_calls.threads) == {2}
    _assert_identical(fused, compiled)


def _dynamic_symbols(path: str) -> list[str]:
    """Undefined dynamic symbols of a shared library (``nm -D -u``)."""
    import subprocess

    return subprocess.run(["nm", "-D", "-u", path], capture_output=True, text=True, check=True).stdout.splitlines()


def _odd_values_train(monkeypatch, host_step, policy):
    """Three AdamW steps whose bf16 casts see NaN and denormal values, as c10::BFloat16 rounds them."""
    params = _params(BF16, (1000, 77))
    with torch.no_grad():
        params[0][200:240] = 1e-39  # bf16 denormals: the master stays denormal where the grad is 0
    opt = _build(monkeypatch, host_step, params, policy, torch.optim.AdamW, 1 << 19, weight_decay=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen) * 0.1
            if i == 0:
                g[100:140] = 1e-40  # fp32 denormal grads: exp_avg = 0.1 * g is denormal
                g[200:240] = 0.0
                g[500] = float("nan")  # NaN in one lane of a vector; its neighbours are ordinary
            p.decoupled_grad = g
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


@needs_cc
def test_bf16_casts_of_nan_and_denormal_values_match_the_fused_path(monkeypatch, c_calls):
    """The C loop's fast bf16 cast (vcvtneps2bf16 where the CPU has it) flushes denormals and keeps NaN
    payloads; c10::BFloat16 does neither, so those lanes must come out as the fused path's."""
    policy = PrecisionPolicy(main_grads_dtype=FP32, exp_avg_dtype=BF16)  # exp_avg: round-to-nearest (beta1 0.9)
    fused = _odd_values_train(monkeypatch, "fused", policy)
    compiled = _odd_values_train(monkeypatch, "compiled", policy)
    assert sum(c_calls) == 3 * 1077
    params, sd = compiled
    m = sd["state"][0]["exp_avg"]
    assert m[100:140].abs().max() < torch.finfo(torch.float32).tiny  # the denormals were really there
    assert params[0][200:240].abs().max() < torch.finfo(torch.float32).tiny and params[0][200:240].abs().min() > 0
    assert params[0][500].isnan()
    # Every lane bit for bit, NaN lanes excepted: those must be NaN in both, but torch's own casts
    # disagree on a NaN's bits (its vectorised fp32->bf16 gives 0xffff, c10's scalar cast 0x7fc0).
    for x, y in [*zip(fused[0], params), *((v, sd["state"][k][n]) for k, e in fused[1]["state"].items()
                                           for n, v in e.items() if v.dim())]:  # fmt: skip
        nan = x.isnan()
        assert torch.equal(nan, y.isnan())
        assert torch.equal(x[~nan], y[~nan])
    assert torch.equal(fused[1]["state"][0]["exp_avg"][100:140], m[100:140])  # denormal moments, not flushed


def _has_avx512_body(library) -> bool:
    return bool(library.offload_fsdp_adam_avx512_body())


@needs_cc
def test_the_auto_vectorised_body_for_cpus_without_avx512_bf16_is_bit_identical_too(monkeypatch, tmp_path, c_calls):
    """On an AVX512_BF16 machine the default build uses the intrinsic body; this builds the portable one."""
    assert compiled_step.compiled_step_available()
    if not _has_avx512_body(compiled_step._library):
        pytest.skip("this CPU has no AVX512_BF16: every other test here already runs the portable body")
    monkeypatch.setenv("OFFLOAD_FSDP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_step, "_library", None)
    monkeypatch.setattr(compiled_step, "_load_failed", False)
    monkeypatch.setattr(compiled_step, "_CFLAGS", [*compiled_step._CFLAGS, "-mno-avx512bf16"])
    assert compiled_step.compiled_step_available()
    assert not _has_avx512_body(compiled_step._library)
    for case in ("bf16 params, bf16 state (SR on exp_avg_sq), Adam L2 maximize", "bf16 params, fp32 state, AdamW"):
        dtype, policy, opt_cls, hyper = CASES[case]
        fused = _train(monkeypatch, "fused", dtype, policy, opt_cls, 3, **hyper)
        compiled = _train(monkeypatch, "compiled", dtype, policy, opt_cls, 3, **hyper)
        _assert_identical(fused, compiled)
    assert c_calls
