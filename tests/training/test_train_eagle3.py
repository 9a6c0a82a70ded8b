"""The training loop on a tiny random target: learning, resuming, the CLI and its output,
and data-parallel training on 4 simulated devices (a subprocess: the device count is set
before jax starts)."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import eagle3
from training import train_eagle3
from training.train_eagle3 import TrainConfig

# Every row of the 8 training rows in each batch: the loss sees the same data each step.
TINY = TrainConfig(target="tiny-random", steps=8, batch_size=8, seq_len=32, draft_vocab_size=64,
                   lr=3e-3, warmup_steps=1, text_tokens=10 * 32, eval_sequences=2, save_every=100)


def _weights(directory):
    return eagle3.load_draft(str(directory))[1]


def test_learns_and_resumes_where_it_stopped(tmp_path):
    full = train_eagle3.train(dataclasses.replace(TINY, out=str(tmp_path / "full")))
    assert full["start_step"] == 0 and full["step"] == 8
    # A random target's distributions are near uniform: the soft-label CE sits close to
    # their entropy, so learning shows as a small drop in loss and a jump in top-1 agreement.
    assert full["loss_history"][-1] < full["loss_history"][0] - 0.05
    assert min(full["metrics"]["acc"]) > 0.2

    out = str(tmp_path / "interrupted")
    first = train_eagle3.train(dataclasses.replace(TINY, out=out, max_steps=3))
    assert first["step"] == 3
    resumed = train_eagle3.train(dataclasses.replace(TINY, out=out))
    assert resumed["start_step"] == 3 and resumed["step"] == 8
    np.testing.assert_allclose(first["loss_history"] + resumed["loss_history"], full["loss_history"],
                               rtol=1e-5)
    want, got = _weights(tmp_path / "full"), _weights(out)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cli_smoke_writes_a_loadable_draft(tmp_path, capsys):
    """Against a target packed in Q8_0 blocks: the draft trains on a quantized target."""
    out = tmp_path / "draft"
    train_eagle3.main(["--target", "tiny-random", "--target-weights-dtype", "q8_0",
                       "--out", str(out), "--max-steps", "2",
                       "--steps", "8", "--batch-size", "8", "--seq-len", "32",
                       "--draft-vocab-size", "64", "--lr", "3e-3", "--warmup-steps", "1",
                       "--text-tokens", "320", "--eval-sequences", "2"])
    assert "acceptance by position" in capsys.readouterr().out
    config, params = eagle3.load_draft(str(out))
    assert config.target_layer_ids == (2, 4, 5) and config.draft_vocab_size == 64
    assert config.target_source == "tiny-random"
    saved = json.loads((out / "config.json").read_text())
    assert saved["hidden_size"] == 64 and saved["method"] == "eagle3"
    assert len(json.loads((out / "eval.json").read_text())["eval"]["text"]["acceptance"]) == 7
    hidden = eagle3.fuse_features(params, jnp.ones((1, 4, 3 * 64)))
    logits, out_hidden, _ = eagle3.draft_forward(
        params, config, hidden, jnp.arange(4)[None], jnp.arange(4)[None],
        eagle3.init_draft_cache(config, 1, 16))
    assert logits.shape == (1, 4, 64) and out_hidden.shape == (1, 4, 64)


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        train_eagle3.main(["--out", str(tmp_path), "--batch-size", "0"])
    with pytest.raises(SystemExit):
        train_eagle3.main(["--out", str(tmp_path), "--target", "/no/such/model"])
    with pytest.raises(SystemExit):
        train_eagle3.main(["--out", str(tmp_path), "--target-weights-dtype", "int3"])
    with pytest.raises(SystemExit):  # 8 rows do not split over 3 data ranks
        train_eagle3.main(["--out", str(tmp_path), "--batch-size", "8", "--data-parallel-size", "3"])


PARALLEL = r"""
import jax
jax.config.update("jax_num_cpu_devices", 4)
import dataclasses, sys, numpy as np
import jax.numpy as jnp
import model
from model import eagle3
from training import train_eagle3
from training.train_eagle3 import TrainConfig

out = sys.argv[1]
tiny = TrainConfig(target="tiny-random", steps=4, batch_size=4, seq_len=16, draft_vocab_size=64, ttt_steps=3,
                   lr=3e-3, warmup_steps=1, text_tokens=8 * 16, eval_sequences=2, save_every=100)

# the target's batch over a 2 x 2 mesh: rows split over "data", equal to one device
config, params, _ = train_eagle3.load_target("tiny-random")
mesh = model.make_mesh(tensor_parallel_size=2, data_parallel_size=2)
sharded_config, sharded = model.shard_params(params, config, mesh)
tokens = jnp.arange(4 * 16, dtype=jnp.int32).reshape(4, 16) % config.vocab_size
ids = jnp.arange(64, dtype=jnp.int32)
want = train_eagle3.target_batch(params, config, (2, 4, 5), ids, tokens)
got = train_eagle3.target_batch(sharded, sharded_config, (2, 4, 5), ids,
                                jax.device_put(tokens, jax.NamedSharding(mesh, jax.P("data"))), mesh)
assert got["features"].sharding.spec[0] == "data", got["features"].sharding
for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)

# 2 steps on the 2 x 2 mesh, resumed for 2 more on one device: the same run as 4 on one device
full = train_eagle3.train(dataclasses.replace(tiny, out=out + "/full"))
first = train_eagle3.train(dataclasses.replace(tiny, out=out + "/split", max_steps=2, data_parallel_size=2,
                                               tensor_parallel_size=2))
resumed = train_eagle3.train(dataclasses.replace(tiny, out=out + "/split"))
assert resumed["start_step"] == 2 and resumed["step"] == 4
np.testing.assert_allclose(first["loss_history"] + resumed["loss_history"], full["loss_history"], rtol=1e-5)
for a, b in zip(jax.tree.leaves(eagle3.load_draft(out + "/split")[1]), jax.tree.leaves(eagle3.load_draft(out + "/full")[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
print("losses", full["loss_history"])
"""


def test_data_parallel_training_equals_one_device_and_resumes_on_another_mesh(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", PARALLEL, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-4000:]
