"""pallas_kernels.gpu_check without a GPU: plan, arguments, the no-GPU exit, the step runner,
and the two test switches it sets (compiled kernels, synthetic tokenizer)."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import dispatch, gpu_check
from tests import conftest
from tests.pallas_kernels import helpers

GPU = dict(platform="gpu", device_kind="NVIDIA H200", count=1, jax="0.11.2")
CPU = dict(platform="cpu", device_kind="cpu", count=1, jax="0.10.2", warnings="")


def test_dry_run_lists_every_step_with_its_switch(capsys):
    assert gpu_check.main(["--dry-run"], probe=pytest.fail) == 0
    out = capsys.readouterr().out
    assert [m for m in re.findall(r"^  (\w+) +cap", out, re.M)] == ["kernels", "engine", "bench"]
    assert f"{conftest.KERNELS_ENV}=compiled" in out and "tests/pallas_kernels" in out
    assert f"{conftest.TOKENIZER_ENV}=synthetic" in out
    assert "--ops paged --batch 64 --context 4096 --page-size 16" in out
    total = sum(s.timeout_s for s in gpu_check.STEPS.values())
    assert total <= 8 * 60  # one 10-minute device command, with room for start-up


def test_steps_subset_order_and_time_scale():
    args = gpu_check.parse_args(["--steps", "bench,kernels", "--time-scale", "0.5"])
    steps = gpu_check.plan(args, xdist=False)
    assert [s.name for s in steps] == ["bench", "kernels"]
    assert steps[0].timeout_s == round(gpu_check.STEPS["bench"].timeout_s / 2)
    assert steps[1] == dataclasses.replace(gpu_check.STEPS["kernels"], timeout_s=steps[1].timeout_s)


@pytest.mark.parametrize("serial", [False, True])
def test_test_steps_run_files_in_parallel_with_xdist_unless_serial(serial):
    args = gpu_check.parse_args(["--serial"] if serial else [])
    steps = {s.name: s for s in gpu_check.plan(args, xdist=True)}
    for name in ("kernels", "engine"):
        line = gpu_check.command_line(steps[name], "python3")
        parallel = f"-m pytest -n {gpu_check.STEPS[name].workers} --dist loadfile -q" in line
        assert parallel == (not serial)
        assert ("XLA_PYTHON_CLIENT_PREALLOCATE=false" in line) == (not serial)
    assert steps["bench"] == gpu_check.STEPS["bench"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--steps", "kernels,nope"], "subset of"),
        (["--steps", ","], "subset of"),
        (["--steps", "bench,bench"], "twice"),
        (["--time-scale", "0"], "positive"),
    ],
)
def test_bad_arguments_rejected(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("info", [CPU, dict(error="`import jax` failed in python3: boom")])
def test_no_gpu_exits_nonzero_and_says_so(info, capsys, tmp_path):
    ran = []
    status = gpu_check.main(["--log-dir", str(tmp_path)], probe=lambda py: ran.append(py) or info)
    assert status == gpu_check.NO_GPU_STATUS != 0 and ran == [sys.executable]
    err = capsys.readouterr().err
    assert "no GPU found" in err and ("cpu device" in err or "boom" in err)
    assert "no GPU found" in (tmp_path / "gpu_check.log").read_text()


def test_steps_run_in_order_and_status_reflects_each(monkeypatch, tmp_path, capsys):
    def step(name, code, timeout_s=30):
        return gpu_check.Step(name, name, ("-c", code), (("KVFOLD_PROBE", name),), timeout_s)

    steps = {
        "kernels": step("kernels", "import os; print('env', os.environ['KVFOLD_PROBE'])"),
        "engine": step("engine", "import sys; print('2 failed'); sys.exit(1)"),
        "bench": step("bench", "import time; time.sleep(30)", timeout_s=1),
    }
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    status = gpu_check.main(
        ["--log-dir", str(tmp_path), "--wheels", str(tmp_path)], probe=lambda py: GPU
    )
    assert status == 1
    log = (tmp_path / "gpu_check.log").read_text()
    assert log == capsys.readouterr().out
    table = log[log.index("gpu_check summary") :]
    assert re.search(r"kernels +PASS .*env kernels", table)
    assert re.search(r"engine +FAIL .*2 failed", table)
    assert re.search(r"bench +TIMEOUT .*killed after 1 s", table)
    assert "NOT READY" in table
    monkeypatch.setattr(gpu_check, "STEPS", {"kernels": steps["kernels"]})
    assert gpu_check.main(["--wheels", str(tmp_path)], probe=lambda py: GPU) == 0
    assert "GPU READY" in capsys.readouterr().out


def test_wheels_are_installed_to_a_site_on_the_steps_path(tmp_path):
    (tmp_path / "gguf-0.17.1-py3-none-any.whl").write_bytes(b"")
    wheels = gpu_check.wheels_in(str(tmp_path))
    cmd = gpu_check.install_command("python3", wheels)
    assert cmd[-1] == wheels[0] and "--no-index" in cmd and "--no-deps" in cmd
    assert cmd[cmd.index("--target") + 1] == gpu_check.site_dir()


def test_engine_and_kernel_tests_named_exist():
    for path in gpu_check.KERNEL_TESTS:
        assert (gpu_check.ROOT / path).is_dir()
    for node in gpu_check.ENGINE_TESTS:
        path, name = node.split("::")
        assert f"def {name}(" in (gpu_check.ROOT / path).read_text(), node


def _fake_kernel(x, *, interpret):
    return x + (1.0 if interpret else 2.0)


def test_compiled_mode_routes_interpret_to_the_platform_kernel(monkeypatch):
    """The switch behind KVFOLD_KERNELS=compiled: None -> the reference (when traced, the
    real dispatch), True -> the platform's own (compiled) branch, InterpretParams -> skip;
    kernel_gpu calls compiled."""
    calls = []
    monkeypatch.setattr(
        dispatch, "_staged", lambda *a, interpret, **kw: calls.append(interpret) or a[0]
    )
    monkeypatch.setattr(_fake_kernel, "__module__", "pallas_kernels.some_op.kernel_gpu")
    test_module = types.SimpleNamespace(some_gpu_kernel=_fake_kernel)
    helpers.compile_kernels(monkeypatch, test_module)
    x = jnp.arange(3.0)
    ref = functools.partial(jnp.multiply, 3.0)
    run = lambda interpret: dispatch.dispatch(x, ref=ref, tpu=None, gpu=None, interpret=interpret)
    np.testing.assert_array_equal(run(None), 3 * x)
    assert calls == []
    run(True)
    assert calls == [None]
    jax.jit(lambda x: dispatch.dispatch(x, ref=ref, tpu=None, gpu=None, interpret=None))(x)
    assert calls == [None, None]  # traced (export, lowering checks): the real dispatch
    with pytest.raises(pytest.skip.Exception, match="TPU interpret semantics"):
        run(pltpu.InterpretParams())
    np.testing.assert_array_equal(test_module.some_gpu_kernel(x, interpret=True), x + 2.0)


def test_synthetic_tokenizer_round_trips_the_default_vocabulary():
    tok = conftest._synthetic_tokenizer()
    assert tok.vocab_size == conftest.DEFAULT_VOCAB_SIZE and tok.eos_token_id == 2
    ids = np.random.default_rng(0).integers(3, conftest.DEFAULT_VOCAB_SIZE, 50).tolist()
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.decode([2, *ids[:2]], skip_special_tokens=True) == f"w{ids[0]} w{ids[1]}"
