"""The training loop on a tiny random target: learning, resuming, the CLI and its output."""

import dataclasses
import json

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
