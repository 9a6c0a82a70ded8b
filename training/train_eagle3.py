"""Train an EAGLE-3 draft for a target model, on text every machine has.

    python -m training.train_eagle3 --target default --out DIR [--max-steps N]
        [--data-parallel-size D] [--tensor-parallel-size T]

The target's features (residuals entering layers 2, L/2, L-3) and logits are computed
on the fly for each batch. The output directory is a draft `model.eagle3.load_draft`
reads (config.json + model.safetensors); it also keeps the prepared data (data.npz),
orbax checkpoints (a rerun with the same DIR resumes) and the held-out acceptance
(eval.json). `--target tiny-random` trains against a tiny random model (tests).

Over D x T devices (a ("data", "expert", "model") mesh, model/sharding.py) each batch is
split over "data": every data rank runs the frozen target on its rows, tensor-parallel over
its T devices as the serving engine shards it, and the draft's gradients are summed across ranks. The
checkpoints do not depend on the device count: a run resumes on another mesh.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

import model
from model.config import ModelConfig
from model.sharding import DATA
from model.eagle3 import FROZEN, Eagle3Config, feature_layers, init_draft_params, save_draft
from model.weights import WEIGHTS_DTYPES
from pallas_kernels.quant_matmul import prepare_params
from quant import WEIGHT_FORMATS, pack_params
from training import data
from training.ttt import NUM_STEPS, acceptance_counts, acceptance_summary, ttt_loss

TINY_RANDOM = "tiny-random"
_TINY = ModelConfig(vocab_size=data.ByteTokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                    num_heads=4, num_kv_heads=2, head_dim=16, layer_kinds=("attention",) * 8,
                    max_position_embeddings=1024, eos_token_id=data.ByteTokenizer.eos_token_id,
                    name=TINY_RANDOM)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Defaults fit the default target in under an hour on 2 CPU cores (the run in
    .drafts/smollm2-eagle3): a short schedule, hence a learning rate above the 5e-5..1e-4
    of GPU-scale EAGLE-3 runs, and a 4096-token draft vocabulary."""

    target: str = "default"
    target_weights_dtype: str | None = None  # model.load's weights_dtype for the frozen target
    out: str = "eagle3-draft"
    steps: int = 100  # length of the learning-rate schedule
    max_steps: int | None = None  # stop (checkpointed) at this global step
    max_minutes: float | None = 45.0  # stop (checkpointed) after this much training time
    batch_size: int = 2
    seq_len: int = 256
    draft_vocab_size: int = 4096
    lr: float = 5e-4
    warmup_steps: int = 5
    weight_decay: float = 0.01
    clip_norm: float = 0.5
    ttt_steps: int = NUM_STEPS
    text_tokens: int = 200_000
    chat_prompts: int = 32  # prompts the target answers itself (greedy)
    chat_max_tokens: int = 128
    eval_sequences: int = 8  # held out per kind (text, chat)
    save_every: int = 10
    seed: int = 0
    data_parallel_size: int = 1  # devices each batch is split over (mesh axis "data")
    tensor_parallel_size: int = 1  # devices the frozen target is split over (tensor parallel)

    def __post_init__(self):
        for name in ("steps", "batch_size", "draft_vocab_size", "ttt_steps", "text_tokens",
                     "eval_sequences", "save_every", "data_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.seq_len < self.ttt_steps + 4:
            raise ValueError(f"seq_len must be >= ttt_steps + 4, got {self.seq_len}")
        if self.target_weights_dtype is not None and self.target_weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"target_weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, "
                             f"got {self.target_weights_dtype!r}")
        if self.batch_size % self.data_parallel_size:
            raise ValueError(f"batch_size={self.batch_size} does not split over data_parallel_size="
                             f"{self.data_parallel_size} ranks")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be > 0, got {self.max_steps}")
        if self.chat_prompts < 0 or self.warmup_steps < 0 or self.clip_norm <= 0 or self.lr <= 0:
            raise ValueError("chat_prompts and warmup_steps must be >= 0, clip_norm and lr > 0")


def _pack(params: dict, weights_dtype: str) -> dict:
    """The tiny random target's projections packed (it has no file to keep blocks of)."""
    if weights_dtype not in WEIGHT_FORMATS:
        raise ValueError(f"the {TINY_RANDOM} target packs to one of {', '.join(WEIGHT_FORMATS)}, "
                         f"not {weights_dtype!r}")
    return prepare_params(pack_params(params, weights_dtype))


def load_target(source: str, weights_dtype: str | None = None):
    """(config, params, tokenizer) of the target; 'tiny-random' is a small random Llama
    reading UTF-8 bytes. weights_dtype: as model.load (a packed target trains the same
    draft: the projections go through the quantized matmul, the draft copies floats)."""
    if source == TINY_RANDOM:
        params = model.init_params(_TINY, jax.random.key(0))
        return _TINY, params if weights_dtype is None else _pack(params, weights_dtype), data.ByteTokenizer()
    config, params = model.load(source, weights_dtype=weights_dtype)
    return config, params, model.load_tokenizer(source)


@functools.partial(jax.jit, static_argnames=("config", "layer_ids", "mesh"))
def target_batch(params: dict, config: ModelConfig, layer_ids: tuple[int, ...],
                 draft_target_ids: jnp.ndarray, tokens: jnp.ndarray, mesh=None) -> dict:
    """The target's features [B, T, 3H], logits over the draft vocabulary [B, T, Vd] and
    argmax over its full vocabulary [B, T] for `tokens` [B, T].

    mesh: the target's params are sharded over it (model.shard_params); when its "data"
    axis splits B, each data rank runs the target on its own rows (a shard_map over "data",
    attention tensor-parallel inside it over "model")."""
    def run(params, tokens):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cache = model.init_cache(config, b, t)
        hidden, _, captured = model.forward_hidden(params, config, tokens, positions, cache, layer_ids,
                                                   mesh=mesh)
        logits = model.lm_head(params, config, hidden)
        return {"features": jnp.concatenate(captured, axis=-1), "tokens": tokens,
                "target_logits": logits[..., draft_target_ids],
                "target_ids": jnp.argmax(logits, -1).astype(jnp.int32)}
    ranks = 1 if mesh is None else mesh.shape[DATA]
    if ranks == 1 or tokens.shape[0] % ranks:  # a ragged held-out batch runs whole
        return run(params, tokens)
    return jax.shard_map(run, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P(DATA), axis_names={DATA},
                         check_vma=False)(params, tokens)


@functools.lru_cache(maxsize=8)
def make_optimizer(lr: float, warmup_steps: int, steps: int, clip_norm: float,
                   weight_decay: float) -> optax.GradientTransformation:
    """AdamW (0.9, 0.95) with linear warmup then cosine decay to lr/10, clipped by global norm."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup_steps, steps - 1) or 1,
                                                  max(steps, 2), lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "num_steps"),
                   donate_argnames=("state",))
def train_step(state: dict, frozen: dict, config: Eagle3Config, optimizer, num_steps: int,
               batch: dict) -> tuple[dict, dict]:
    def loss_fn(trainable):
        return ttt_loss({**trainable, **frozen}, config, batch, num_steps)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state}, {"total": loss, **metrics}


eval_counts = jax.jit(acceptance_counts, static_argnames=("config", "num_steps"))


# --- data ---

def prepare_data(cfg: TrainConfig, target_config: ModelConfig, target_params: dict,
                 tokenizer) -> dict[str, np.ndarray]:
    """Tokenized sequences, held-out split and draft vocabulary; cached in DIR/data.npz so
    that a resumed run sees the same data and vocabulary."""
    path = os.path.join(cfg.out, "data.npz")
    if os.path.exists(path):
        with np.load(path) as f:
            cached = dict(f)
        if (len(cached["draft_ids"]), cached["train_tokens"].shape[1]) != (cfg.draft_vocab_size, cfg.seq_len):
            raise ValueError(f"{path} was prepared for draft_vocab_size={len(cached['draft_ids'])}, "
                             f"seq_len={cached['train_tokens'].shape[1]}; use those or a new --out")
        return cached
    text = data.pack_text(tokenizer, cfg.text_tokens, cfg.seq_len, cfg.seed)
    kinds = [("text", text, np.ones(text.shape, bool))]
    if cfg.chat_prompts and getattr(tokenizer, "chat_template", None):
        start = time.time()
        chat, chat_mask = data.regenerate_chats(target_params, target_config, tokenizer,
                                                data.chat_prompts(cfg.chat_prompts, cfg.seed),
                                                cfg.chat_max_tokens, cfg.seq_len)
        print(f"regenerated {len(chat)} answers with the target in {time.time() - start:.0f}s")
        kinds.append(("chat", chat, chat_mask))
    out: dict[str, np.ndarray] = {}
    train_tokens, train_mask = [], []
    for kind, tokens, mask in kinds:
        held = min(cfg.eval_sequences, len(tokens) // 4)
        if held == 0:
            raise ValueError(f"too little {kind} data ({len(tokens)} sequences) to hold any out")
        out[f"eval_{kind}_tokens"], out[f"eval_{kind}_mask"] = tokens[-held:], mask[-held:]
        train_tokens.append(tokens[:-held])
        train_mask.append(mask[:-held])
    out["train_tokens"] = np.concatenate(train_tokens)
    out["train_mask"] = np.concatenate(train_mask)
    out["draft_ids"] = data.select_draft_vocab(out["train_tokens"], out["train_mask"],
                                               cfg.draft_vocab_size, target_config.vocab_size)
    os.makedirs(cfg.out, exist_ok=True)
    np.savez(path, **out)
    return out


def batch_indices(step: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Rows of the batch at `step`: a fresh seeded permutation every epoch, so a resumed
    run continues with exactly the batches it would have seen."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    rows = np.empty(batch_size, np.int64)
    for epoch in np.unique(flat // num_rows):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_rows)
        sel = flat // num_rows == epoch
        rows[sel] = perm[flat[sel] % num_rows]
    return rows


# --- the loop ---

def evaluate(params: dict, draft_config: Eagle3Config, target_params: dict, target_config: ModelConfig,
             tokens: np.ndarray, mask: np.ndarray, batch_size: int, num_steps: int, mesh=None) -> dict:
    """Held-out greedy acceptance by draft position (see training.ttt.acceptance_counts);
    mesh: as target_batch."""
    draft_target_ids = jnp.asarray(np.flatnonzero(np.asarray(params["t2d"])), jnp.int32)
    tried, accepted = np.zeros(num_steps), np.zeros(num_steps)
    for start in range(0, len(tokens) - batch_size + 1, batch_size):
        batch = target_batch(target_params, target_config, draft_config.target_layer_ids,
                             draft_target_ids, jnp.asarray(tokens[start:start + batch_size]), mesh)
        batch["loss_mask"] = jnp.asarray(mask[start:start + batch_size])
        n, a = eval_counts(params, draft_config, batch, num_steps)
        tried += np.asarray(n)
        accepted += np.asarray(a)
    return acceptance_summary(tried, accepted)


def _checkpoint_manager(cfg: TrainConfig) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(os.path.join(cfg.out, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) the draft; export it into cfg.out; return the results
    (`start_step`, `step`, last `metrics`, this run's `loss_history`, held-out `eval`
    per kind)."""
    target_config, target_params, tokenizer = load_target(cfg.target, cfg.target_weights_dtype)
    dataset = prepare_data(cfg, target_config, target_params, tokenizer)
    draft_config = Eagle3Config(target_config, cfg.draft_vocab_size,
                                feature_layers(target_config.num_layers), cfg.target)
    params = init_draft_params(draft_config, target_params, dataset["draft_ids"],
                               jax.random.key(cfg.seed))
    frozen = {k: params[k] for k in FROZEN}
    optimizer = make_optimizer(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.clip_norm, cfg.weight_decay)
    trainable = {k: v for k, v in params.items() if k not in FROZEN}
    state = {"params": trainable, "opt_state": optimizer.init(trainable)}
    mesh, rows_on = None, lambda x: jnp.asarray(x)
    if cfg.data_parallel_size * cfg.tensor_parallel_size > 1:
        mesh = model.make_mesh(cfg.tensor_parallel_size, cfg.data_parallel_size)
        target_config, target_params = model.shard_params(target_params, target_config, mesh)
        replicated = NamedSharding(mesh, P())
        state, frozen = jax.device_put(state, replicated), jax.device_put(frozen, replicated)
        rows_on = lambda x: jax.device_put(x, NamedSharding(mesh, P(DATA)))  # batch rows over "data"

    manager = _checkpoint_manager(cfg)
    start = manager.latest_step() or 0
    if start:
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
    stop = min(cfg.steps, cfg.max_steps or cfg.steps)
    draft_target_ids = jnp.asarray(dataset["draft_ids"])
    tokens, masks = dataset["train_tokens"], dataset["train_mask"]
    began, step, metrics, history = time.time(), start, {}, []
    bar = tqdm(total=stop, initial=start, desc="eagle3", dynamic_ncols=True)
    while step < stop:
        rows = batch_indices(step, cfg.batch_size, len(tokens), cfg.seed)
        batch = target_batch(target_params, target_config, draft_config.target_layer_ids,
                             draft_target_ids, rows_on(tokens[rows]), mesh)
        batch["loss_mask"] = rows_on(masks[rows])
        state, m = train_step(state, frozen, draft_config, optimizer, cfg.ttt_steps, batch)
        step += 1
        metrics = {k: np.asarray(v).tolist() for k, v in m.items()}
        history.append(metrics["total"])
        bar.update(1)
        bar.set_postfix_str(f"loss {metrics['total']:.3f} acc "
                            + "/".join(f"{a:.2f}" for a in metrics["acc"]))
        out_of_time = cfg.max_minutes is not None and time.time() - began > 60 * cfg.max_minutes
        if step % cfg.save_every == 0 or step == stop or out_of_time:
            manager.save(step, args=ocp.args.StandardSave(state))
        if out_of_time:
            break
    bar.close()
    manager.wait_until_finished()
    manager.close()

    params = {**state["params"], **frozen}
    save_draft(cfg.out, draft_config, params)
    results = {"start_step": start, "step": step, "metrics": metrics, "loss_history": history,
               "eval": {}}
    for kind in ("text", "chat"):
        if f"eval_{kind}_tokens" in dataset:
            results["eval"][kind] = evaluate(
                params, draft_config, target_params, target_config, dataset[f"eval_{kind}_tokens"],
                dataset[f"eval_{kind}_mask"], min(cfg.batch_size, len(dataset[f"eval_{kind}_tokens"])),
                cfg.ttt_steps, mesh)
    with open(os.path.join(cfg.out, "eval.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


def format_results(results: dict) -> str:
    lines = [f"trained steps {results['start_step']} -> {results['step']}"]
    for kind, r in results["eval"].items():
        rates = " ".join(f"{a:.3f}" for a in r["acceptance"])
        lines.append(f"held-out {kind:4s} acceptance by position: {rates}   "
                     f"mean accepted length {r['mean_accepted_length']:.2f} "
                     f"(tried {r['tried'][0]} positions)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    defaults = TrainConfig()
    parser.add_argument("--target", default=defaults.target,
                        help="'default', a .gguf file, a HF directory, or 'tiny-random'")
    parser.add_argument("--out", required=True, help="draft directory (resumes if it has checkpoints)")
    for field in dataclasses.fields(TrainConfig):
        if field.name in ("target", "out"):
            continue
        kind = {"max_steps": int, "max_minutes": float, "target_weights_dtype": str}.get(
            field.name, type(field.default))
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default)
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        if cfg.target not in (TINY_RANDOM, "default") and not os.path.exists(cfg.target):
            raise ValueError(f"target {cfg.target!r} is not 'default', 'tiny-random' or an existing path")
    except ValueError as e:
        parser.error(str(e))
    print(format_results(train(cfg)))


if __name__ == "__main__":
    main()
