"""The prelude of the tests that run on 8 simulated CPU devices, in a subprocess (XLA_FLAGS
must be set before jax starts): tests/model/test_sharding.py (the model's splits) and
tests/serving/test_sharded_engine.py (engines over several devices). Two files, so that
the test workers share them out."""

import os
import subprocess
import sys

from tests.conftest import suite_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = r"""
import os, time, jax, jax.numpy as jnp, numpy as np
start = time.time()
def say(*parts):
    print(f"[{time.time() - start:5.1f} s]", *parts)
import model
from serving import LLM, SamplingParams
from tests.model import golden

def shard_shape(a):
    return a.addressable_shards[0].data.shape

def check_forward(config, params, tokens, tp, what, ep=1):
    positions = jnp.tile(jnp.arange(tokens.shape[1]), (tokens.shape[0], 1))
    ref, _ = model.forward(params, config, tokens, positions, model.init_cache(config, tokens.shape[0], 64))
    mesh = model.make_mesh(tp, expert_parallel_size=ep)
    sharded_config, sharded = model.shard_params(params, config, mesh)
    cache = model.init_cache(sharded_config, tokens.shape[0], 64, mesh=mesh)
    out, cache = model.forward(sharded, sharded_config, tokens, positions, cache, mesh=mesh)
    err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    assert err < 1e-4, (what, tp, err)
    k = cache.layers[0]["k"]
    heads = max(config.num_kv_heads, tp) // tp
    assert len(k.sharding.device_set) == tp and shard_shape(k)[2] == heads, (what, tp, k.sharding)
    wq = sharded["layers"][0]["wq"]
    assert shard_shape(wq) == (config.hidden_size, config.num_heads * config.head_dim // tp), (what, shard_shape(wq))
    say(f"{what} tp={tp} ep={ep}: logits relative error {err:.1e}, KV heads per device {heads}")
    return sharded

"""


def run_on_8_devices(script: str) -> None:
    """Run PRELUDE + script in a fresh Python with 8 CPU devices; fails with its stderr."""
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags("--xla_force_host_platform_device_count=8"), "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", PRELUDE + script], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
