"""Training-time test (TTT): the draft unrolled over its own outputs, its loss and acceptance.

At step 0, index t holds fc(features_t) with the embedding of token t + 1 and learns
the target's distribution at t + 1 (predicting token t + 2). At step i >= 1 the hidden
input is the draft's own step i - 1 output, tokens, labels and masks shift one more
and positions are t + i: index t at step i stands where the draft stands after
proposing i tokens past position t at inference. A query at step i attends causally
to the step-0 keys plus the same-index key of steps 1..i (`ttt_mask`), exactly the keys
a chain of draft steps would have in its cache.

A batch is a dict of
    features [B, T, 3H] float   the target's residuals entering its feature layers
    tokens [B, T] int32         the sequence
    target_logits [B, T, Vd]    the target's logits at t over the draft vocabulary
    target_ids [B, T] int32     the target's argmax at t over its full vocabulary
    loss_mask [B, T] bool       token t is one the draft should learn to predict
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.eagle3 import (Eagle3Config, draft_logits, draft_to_target, fuse_features, layer_input,
                          layer_output, project_qkv)
from quant import linear

NUM_STEPS = 7
STEP_DECAY = 0.8  # step i's loss weighs 0.8 ** i


def ttt_mask(seq_len: int, step: int) -> np.ndarray:
    """bool [T, (step + 1) * T]: which keys (step-major: step 0's T keys, then step 1's,
    ...) a query of TTT step `step` at each index sees."""
    i = np.arange(seq_len)
    causal = i[:, None] >= i[None, :]
    same = i[:, None] == i[None, :]
    return np.concatenate([causal] + [same] * step, axis=1)


def ttt_attention(q: jnp.ndarray, k0: jnp.ndarray, v0: jnp.ndarray, k_steps: jnp.ndarray,
                  v_steps: jnp.ndarray, step: jnp.ndarray, sm_scale: float,
                  soft_cap: float | None = None) -> jnp.ndarray:
    """GQA attention of TTT step `step`'s queries under `ttt_mask`, without materialising it.
    Scores as model.layers.attend takes them: scaled by sm_scale, then cap * tanh(s / cap)
    under a soft_cap (Gemma 2).

    q [B, T, Hq, D]; k0, v0 [B, T, Hkv, D]: step 0's keys and values (seen causally);
    k_steps, v_steps [S, B, T, Hkv, D]: slot j holds step j's (slot 0 unused), of which
    slots 1..step are seen at the query's own index only. Returns [B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    causal = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * sm_scale
    same = jnp.einsum("btkgd,sbtkd->bkgts", qg, k_steps, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        causal, same = (soft_cap * jnp.tanh(s / soft_cap) for s in (causal, same))
    causal = jnp.where(jnp.tril(jnp.ones((t, t), bool)), causal, -jnp.inf)
    slots = jnp.arange(k_steps.shape[0])
    same = jnp.where((slots >= 1) & (slots <= step), same, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([causal, same], axis=-1), axis=-1).astype(v0.dtype)
    out = (jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
           + jnp.einsum("bkgts,sbtkd->btkgd", probs[..., t:], v_steps))
    return out.reshape(b, t, hq, d)


def shift(x: jnp.ndarray, n, fill=0) -> jnp.ndarray:
    """x[:, n:] padded at the end with `fill` back to x's length (axis 1); n may be traced."""
    keep = jnp.arange(x.shape[1]) < x.shape[1] - n
    return jnp.where(keep.reshape((1, -1) + (1,) * (x.ndim - 2)), jnp.roll(x, -n, axis=1), fill)


def ttt_unroll(params: dict, config: Eagle3Config, batch: dict, num_steps: int = NUM_STEPS) -> dict:
    """Run the TTT steps (one compiled body under lax.scan) and score each against the target.

    Returns per step i (stacked on a leading axis of num_steps): `loss` (soft-label CE
    against softmax(target logits over the draft vocabulary), over positions whose
    target argmax is in the draft vocabulary), `acc` (top-1 agreement there),
    `proposed` [B, T] (the draft's top-1 as target ids) and `logits` [B, T, Vd].
    """
    tokens = batch["tokens"]
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    in_vocab = params["t2d"][batch["target_ids"]]
    kv_shape = (b, t, config.target.num_kv_heads, config.target.head_dim)
    dtype = params["fc"].dtype

    def step(carry, i):
        hidden, k0, v0, k_steps, v_steps = carry
        x = layer_input(params, config, hidden, shift(tokens, i + 1))
        q, k, v = project_qkv(params, config, x, positions + i)
        k0, v0 = jnp.where(i == 0, k, k0), jnp.where(i == 0, v, v0)
        k_steps, v_steps = k_steps.at[i].set(k), v_steps.at[i].set(v)
        attn = ttt_attention(q, k0, v0, k_steps, v_steps, i, config.target.sm_scale,
                             config.target.attn_logit_softcap)
        hidden = layer_output(params, config, hidden,
                              linear(attn.reshape(b, t, -1), params["layer"]["wo"]))
        logits = draft_logits(params, config, hidden)
        target = shift(batch["target_logits"], i + 1)
        mask = shift(batch["loss_mask"], i + 2, False) & shift(in_vocab, i + 1, False)
        count = jnp.maximum(mask.sum(), 1)
        ce = -jnp.sum(jax.nn.softmax(target) * jax.nn.log_softmax(logits), axis=-1)
        top = jnp.argmax(logits, -1).astype(jnp.int32)
        out = {"loss": jnp.sum(jnp.where(mask, ce, 0.0)) / count,
               "acc": jnp.sum(mask & (top == jnp.argmax(target, -1))) / count,
               "proposed": draft_to_target(params, top), "logits": logits}
        return (hidden, k0, v0, k_steps, v_steps), out

    zeros = jnp.zeros(kv_shape, dtype)
    steps = jnp.zeros((num_steps,) + kv_shape, dtype)
    carry = (fuse_features(params, batch["features"]), zeros, zeros, steps, steps)
    _, out = jax.lax.scan(step, carry, jnp.arange(num_steps))
    return out


def ttt_loss(params: dict, config: Eagle3Config, batch: dict, num_steps: int = NUM_STEPS
             ) -> tuple[jnp.ndarray, dict]:
    """sum_i 0.8^i * loss_i, and the per-step `loss` and `acc` [num_steps]."""
    out = ttt_unroll(params, config, batch, num_steps)
    total = jnp.sum(STEP_DECAY ** jnp.arange(num_steps) * out["loss"])
    return total, {"loss": out["loss"], "acc": out["acc"]}


def acceptance_counts(params: dict, config: Eagle3Config, batch: dict, num_steps: int = NUM_STEPS
                      ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Greedy chain acceptance as speculative decoding sees it: (tried [S], accepted [S]).

    A position tries step i when steps 0..i-1 were accepted and the sequence continued
    with the accepted token (so the token fed to the next step is the one the target
    chose); step i is accepted when the draft's top-1, mapped to a target id, equals the
    target's argmax. accepted[i] / tried[i] is the acceptance rate at draft position i.
    """
    proposed = ttt_unroll(params, config, batch, num_steps)["proposed"]
    chain = shift(batch["loss_mask"], 2, False)
    tried, accepted = [], []
    for i in range(num_steps):
        wanted = shift(batch["target_ids"], i + 1, -1)
        live = chain & shift(batch["loss_mask"], i + 2, False)
        hit = live & (proposed[i] == wanted)
        tried.append(live.sum())
        accepted.append(hit.sum())
        chain = hit & (shift(batch["tokens"], i + 2, -1) == wanted)
    return jnp.stack(tried), jnp.stack(accepted)


def acceptance_summary(tried: np.ndarray, accepted: np.ndarray) -> dict:
    """Per-position conditional acceptance and the mean accepted length tau of a chain
    draft (accepted drafts + the bonus token per target forward)."""
    rate = np.asarray(accepted, np.float64) / np.maximum(np.asarray(tried, np.float64), 1)
    tau = 1.0 + float(np.sum(np.cumprod(rate)))
    return {"acceptance": [round(float(r), 4) for r in rate], "tried": [int(n) for n in tried],
            "mean_accepted_length": round(tau, 3)}
