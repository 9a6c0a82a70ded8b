"""Serving across hosts (serving/multihost.py): two processes of two CPU devices each, joined
by jax.distributed with gloo collectives on 127.0.0.1, serve one model tensor-parallel over
all four devices; process 0 schedules and broadcasts each step. Greedy output equals one
process on one device, and a TurboQuant pool's key bases, taken over both processes, equal one
process's."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import model
from model import key_centers
from serving import LLM, SamplingParams
from serving.multihost import BroadcastRunner
from tests.conftest import suite_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["The capital of France is", "Write a haiku about the sea."]

PROCESS = r"""
import json, sys
from serving import multihost
multihost.initialize("127.0.0.1:" + sys.argv[2], num_processes=2, process_id=int(sys.argv[1]),
                     local_device_count=2)
import jax
import model
from serving import LLM, SamplingParams
from tests.serving.test_multihost import PROMPTS, tiny

config, params, tok = tiny()
llm = LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=4)
if jax.process_index() == 0:
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    multihost.shutdown(llm)
    pool = llm.runner.pool["target"][0]["k"]
else:
    multihost.serve_worker(llm)
# a TurboQuant pool: its key centers and bases are taken over the mesh that spans both processes
turbo = LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=4,
                        kv_cache_dtype="turboquant-3.5")
if jax.process_index() == 0:
    shards = sorted(turbo.runner.params["layers"][0]["k_basis"].addressable_shards, key=lambda s: s.device.id)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "devices": len(pool.sharding.device_set),
                      "addressable": pool.is_fully_addressable, "k_basis": [s.data.tolist() for s in shards]}))
"""


def tiny():
    """8 query / 2 KV heads (repeated to 4 at tp = 4), weights scaled so greedy text varies."""
    tok = model.load_tokenizer("default")
    config = model.ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_heads=8,
                               num_kv_heads=2, head_dim=16, layer_kinds=("sliding_attention", "attention"),
                               max_position_embeddings=256, sliding_window=8, tie_word_embeddings=True)
    return config, jax.tree.map(lambda a: a * 10, model.init_params(config, jax.random.key(0))), tok


def test_two_processes_serve_like_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": suite_xla_flags()}
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(i), port], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 0)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = json.loads(outs[1][0].strip().splitlines()[-1])
    assert got["devices"] == 4 and not got["addressable"]  # the pool spans both processes
    config, params, tok = tiny()
    want = LLM.from_loaded(config, params, tok, max_model_len=128).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    assert got["tokens"] == [o.outputs[0].token_ids for o in want]
    # process 0's devices hold KV heads 0 and 1 of 4, both the model's KV head 0 repeated
    basis = key_centers.for_kv_cache(params, config, tok, "turboquant-3.5")["layers"][0]["k_basis"]
    np.testing.assert_allclose(np.asarray(got["k_basis"]), np.repeat(basis[:1], 2, axis=0)[:, None],
                               rtol=1e-3, atol=1e-4)


def test_process_zero_refuses_what_it_cannot_broadcast():
    runner = BroadcastRunner(object())
    with pytest.raises(ValueError, match="recompute"):
        runner.read_pages([0])
    with pytest.raises(ValueError, match="recompute"):
        runner.write_pages([0], None)
