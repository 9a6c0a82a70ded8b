"""Serving across hosts with JAX's multi-controller model: one process per host, every
process running the same jitted step over one global device mesh.

    # on every host (process_id 0 .. N-1), before anything else touches jax:
    serving.multihost.initialize("10.0.0.1:1234", num_processes=N, process_id=i)
    llm = LLM(..., tensor_parallel_size=tp)      # identical arguments on every host
    if jax.process_index() == 0:
        outputs = llm.generate(prompts, params)  # the scheduler and the API live here
        serving.multihost.shutdown(llm)
    else:
        serving.multihost.serve_worker(llm)      # returns when process 0 shuts down

Process 0 owns the engine (scheduler, KV manager, prefix cache, output processing) and
its runner is a `BroadcastRunner`: before each runner call (a step's rows, page copies)
it broadcasts the call to the other processes, which make the same call on their own
runner, so every process enters the same jitted step with the same inputs and XLA's
collectives (gloo on CPU, NCCL / ICI on accelerators) join them. The step's outputs are
replicated, so each process reads them from its own devices.

Preemption by swapping is not supported across hosts (a page's bytes live on several
hosts); recompute, the default, is.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

_STOP = "stop"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_count: int | None = None) -> None:
    """jax.distributed.initialize, with gloo collectives on CPU hosts. With no arguments
    JAX reads them from the cluster (TPU pods, Slurm, ...). local_device_count: simulate
    that many CPU devices in this process (testing on one machine)."""
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)


def _broadcast(message=None):
    """Process 0's picklable message, on every process (others pass None)."""
    payload = np.frombuffer(pickle.dumps(message), np.uint8) if jax.process_index() == 0 else None
    size = int(multihost_utils.broadcast_one_to_all(np.int64(0 if payload is None else payload.size)))
    padded = 1 << max(size - 1, 0).bit_length()  # power-of-two lengths: few broadcast shapes to compile
    buffer = np.zeros(padded, np.uint8)
    if payload is not None:
        buffer[:size] = payload
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes())


class BroadcastRunner:
    """Process 0's runner: each call is sent to the other processes, which make it too."""

    def __init__(self, runner):
        self.runner = runner

    def _call(self, op: str, *args):
        _broadcast((op, args))
        return getattr(self.runner, op)(*args)

    def execute(self, rows):
        return self._call("execute", rows)

    def copy_pages(self, pairs):
        return self._call("copy_pages", pairs)

    def read_pages(self, pages, wait=True):
        raise ValueError("swap preemption is not supported across hosts: use preemption_mode='recompute'")

    def write_pages(self, pages, data):
        raise ValueError("swap preemption is not supported across hosts: use preemption_mode='recompute'")

    def add_lora(self, request):
        return self._call("add_lora", request)

    def restore_state(self, rows):
        return self._call("restore_state", rows)

    def __getattr__(self, name):  # params, pool, num_compilations, ...
        return getattr(self.runner, name)


def serve_worker(llm) -> None:
    """On a process other than 0: make every runner call process 0 broadcasts, until it
    calls `shutdown`."""
    if jax.process_index() == 0:
        raise ValueError("serve_worker runs on processes other than 0; process 0 drives the engine")
    while True:
        op, args = _broadcast()
        if op == _STOP:
            return
        getattr(llm.runner, op)(*args)


def shutdown(llm) -> None:
    """On process 0: release the workers (their serve_worker returns)."""
    if jax.process_index() != 0:
        raise ValueError("shutdown runs on process 0")
    _broadcast((_STOP, ()))
