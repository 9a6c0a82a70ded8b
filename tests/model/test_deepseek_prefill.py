"""CED prefill equals the full forward; SWA replay's error against the tokens it replays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model
from model.deepseek.ced import ced_prefill, decoder_rows
from model.deepseek.replay import decode_logits, persistent_part, resume
from tests.model.deepseek_tiny import positions, tiny

B, PROMPT, DECODE = 2, 40, 8


@pytest.fixture(scope="module")
def run():
    """Full forward over prompt + decode tokens, and a CED prefill of the prompt."""
    config, params = tiny()
    tokens = jax.random.randint(jax.random.key(11), (B, PROMPT + DECODE), 0, config.vocab_size)
    full, full_cache = model.forward(params, config, tokens, positions(B, 0, PROMPT + DECODE),
                                     model.init_cache(config, B, PROMPT + DECODE))
    last, cache = ced_prefill(params, config, tokens[:, :PROMPT], positions(B, 0, PROMPT),
                              model.init_cache(config, B, PROMPT + DECODE))
    return config, params, tokens, np.asarray(full), full_cache, np.asarray(last), cache


def test_ced_prefill_equals_full_forward(run):
    config, params, tokens, full, full_cache, last, cache = run
    # The tail really is shorter than the prompt for every decoder layer.
    assert max(decoder_rows(config)) < PROMPT
    np.testing.assert_allclose(last, full[:, PROMPT - 1], atol=1e-5)
    for i in config.kv_sources:  # every global row of the prompt, bit for bit
        rows = PROMPT // config.compress_ratios[i]
        for got, want in zip(jax.tree.leaves(cache.layers[i]["global"]),
                             jax.tree.leaves(full_cache.layers[i]["global"])):
            np.testing.assert_array_equal(np.asarray(got[:, :rows]).view(np.uint8),
                                          np.asarray(want[:, :rows]).view(np.uint8))
    # Decoding on from the CED cache (ratio-2 groups split across steps) stays on the full forward.
    logits, _ = decode_logits(params, config, tokens[:, PROMPT:], PROMPT, jax.tree.map(jnp.copy, cache))
    np.testing.assert_allclose(np.asarray(logits), full[:, PROMPT:], atol=1e-5)


def test_replay_error_shrinks_with_the_replay_and_vanishes_over_the_receptive_field(run):
    """Resume from the global rows alone, replaying the last tokens to rebuild window KV.

    Replaying r tokens from s = C - r into empty windows, layer l's window rows are exact
    from position s + l (W - 1) on (layer l - 1's output at q reads its window back to
    q - (W - 1)); decode reads every layer's last W - 1 rows, so num_layers * (W - 1) + 1
    tokens (capped at the prefix) reproduce the full forward to float32 rounding, and fewer
    leave the deeper layers' rows wrong, less so the more is replayed. The error also
    reaches the global rows the decode writes, so it does not die out over the decoded
    tokens. Bounded replay (r = W) is the tier's default: exact only for the first layer.
    """
    config, params, tokens, full, _, _, cache = run
    want = full[:, PROMPT:]

    def error(replay_len):  # max |logit error| over the decoded tokens
        restored = persistent_part(cache)
        if replay_len:
            restored = resume(params, config, tokens, PROMPT, restored, replay_len)
        got, _ = decode_logits(params, config, tokens[:, PROMPT:], PROMPT, restored)
        return float(np.abs(np.asarray(got) - want).max())

    w = config.window
    receptive_field = config.num_layers * (w - 1) + 1  # 57 > PROMPT here: the whole prefix
    errors = {r: error(r) for r in (0, w, receptive_field)}
    print(f"max |logit error| by replayed tokens {errors}, max |logit| {np.abs(want).max():.3f}")
    assert errors[receptive_field] < 1e-5  # float32 rounding, as CED prefill vs forward
    assert errors[0] > 1e-3  # empty windows are far off: there is an error to shrink
    assert errors[0] > errors[w] > errors[receptive_field]
