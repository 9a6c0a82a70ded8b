"""One optax step on deepseek-v4.1-tiny lowers the loss; gradients reach every layer kind."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import model
from tests.model.deepseek_tiny import positions, tiny

INDEXER = ("w_iq", "w_iw", "w_ik")  # selection is discrete: no gradient from the LM loss


def test_one_adam_step_lowers_the_loss():
    config, params = tiny(1)
    b, t = 2, 24
    tokens = jax.random.randint(jax.random.key(5), (b, t + 1), 0, config.vocab_size)

    @jax.jit
    def loss_and_grad(params):
        def loss(params):
            logits, _ = model.forward(params, config, tokens[:, :-1], positions(b, 0, t),
                                      model.init_cache(config, b, t))
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return jax.value_and_grad(loss)(params)

    loss0, grads = loss_and_grad(params)
    for i, (kind, g) in enumerate(zip(config.layer_kinds, grads["layers"])):
        for name, leaf in g.items():
            norm = float(jnp.linalg.norm(leaf))
            if name in INDEXER:
                assert norm == 0.0, (i, kind, name)
            else:
                assert norm > 0.0 and np.isfinite(norm), (i, kind, name)
    opt = optax.adam(1e-3)
    updates, _ = opt.update(grads, opt.init(params), params)
    loss1, _ = loss_and_grad(optax.apply_updates(params, updates))
    print(f"loss {float(loss0):.4f} -> {float(loss1):.4f}")
    assert float(loss1) < float(loss0) - 1e-3
