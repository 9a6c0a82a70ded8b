"""Tensor parallelism over a device mesh, the way vLLM, tpu-inference and MaxText shard a
Llama-family decoder (Megatron-LM's column / row split).

The mesh has three named axes, ("data", "expert", "model"), of sizes dp, ep and tp / ep:
a data-parallel rank's tp devices form an ep x (tp / ep) grid, the way SGLang factors its
tensor-parallel group into expert-parallel groups (`--ep-size`). Dense weights are split
over both of those axes together (`TENSOR`, tp ways); only a mixture-of-experts layer tells
them apart. Every weight carries a PartitionSpec:

- q/k/v projections, the MLP's gate and up projections (and their biases) are split by
  output columns over the tp devices (column-parallel): each device computes its own
  heads and its own slice of the MLP's hidden units, with no communication;
- the attention output projection and the MLP's down projection are split by input rows
  (row-parallel): each device's partial product is summed across the tp devices, the
  all-reduce XLA's partitioner inserts where the replicated output sharding asks for it;
- the embedding table and the vocabulary projection are split over the vocabulary;
- norms and the output bias are replicated;
- a mixture-of-experts layer's experts are split whole over "expert" (expert parallelism:
  tokens travel to their experts' devices, model/moe.py `expert_parallel`) and each
  expert's hidden units over "model" (tensor parallelism inside an expert); its router is
  replicated. ep = 1 (the default, as in vLLM and SGLang) splits every expert tp ways;
  ep = tp puts E / tp whole experts on each device.

A weight whose split dimension the tensor-parallel size does not divide is replicated
instead (a vocabulary of 49,153 rows, say); query heads must divide, since attention runs
per head (`check_tensor_parallel`), and so must the experts and their hidden units
(`check_expert_parallel`).

KV pages are split by KV heads over the tp devices, so a device holds and reads only its heads' K/V.
When tp exceeds the number of KV heads, each KV head is repeated tp / num_kv_heads times
(`expand_kv_heads`, what tpu-inference and vLLM do): an exact reparametrisation of the same
model, whose every device then holds one KV head, and whose pool costs that many copies.

The attention entry (pallas_kernels.ragged_paged_attention, a Pallas kernel on TPU and GPU
that XLA cannot partition) runs under `jax.shard_map` over the tp devices: each device runs the
kernel on its own heads and pages (model/layers.py). Everything else is plain jnp that
XLA's SPMD partitioner splits from the weights' shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from quant.packed import PackedWeight

DATA, EXPERT, MODEL = "data", "expert", "model"
AXES = (DATA, EXPERT, MODEL)
TENSOR = (EXPERT, MODEL)  # the axes a tensor-parallel split spans: tp = ep * (tp / ep) devices

# Layer weights by how they split: output columns, input rows, or a per-head vector.
_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "shared_gate", "shared_up")
_ROW = ("wo", "w_down", "shared_down")
_HEAD_VECTOR = ("bq", "bk", "bv", "sinks", "k_center")
_HEAD_MATRIX = ("k_basis", "q_basis")  # [num_kv_heads, head_dim, head_dim] (model/key_centers.py)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None,
              expert_parallel_size: int = 1) -> Mesh:
    """A ("data", "expert", "model") mesh of data_parallel_size x expert_parallel_size x
    tensor_parallel_size / expert_parallel_size devices.

    devices: the devices to use (default jax.devices()); the mesh takes the first
    dp * tp of them, so a mesh may use fewer devices than exist.
    expert_parallel_size: how many groups of whole experts a MoE layer's experts are split
    into; it must divide tensor_parallel_size (each group runs its experts tp / ep ways).
    """
    sizes = (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size),
             ("expert_parallel_size", expert_parallel_size))
    for name, n in sizes:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if tensor_parallel_size % expert_parallel_size:
        raise ValueError(f"expert_parallel_size={expert_parallel_size} must divide tensor_parallel_size="
                         f"{tensor_parallel_size}: expert groups split a rank's tp devices")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(f"a mesh of data_parallel_size={data_parallel_size} x tensor_parallel_size="
                         f"{tensor_parallel_size} needs {need} devices; {len(devices)} are available")
    grid = np.asarray(devices[:need], dtype=object).reshape(
        data_parallel_size, expert_parallel_size, tensor_parallel_size // expert_parallel_size)
    return Mesh(grid, AXES)


def tensor_parallel_size(mesh) -> int:
    """The devices a mesh's tensor-parallel split spans ("expert" x "model")."""
    return mesh.shape[EXPERT] * mesh.shape[MODEL]


def mesh_platform(mesh) -> str:
    """The platform ("cpu", "tpu", "gpu", ...) of a Mesh's or an AbstractMesh's devices."""
    device = mesh.abstract_device if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh.abstract_device
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


def valid_expert_parallel_sizes(config: ModelConfig, tp: int) -> list[int]:
    """The ep sizes a MoE model runs at tensor_parallel_size tp: divisors of tp that divide
    the experts, whose tp / ep split divides each expert's hidden units."""
    hidden = config.moe_intermediate_size or config.intermediate_size
    return [ep for ep in range(1, tp + 1)
            if tp % ep == 0 and config.num_experts % ep == 0 and hidden % (tp // ep) == 0]


def check_expert_parallel(config: ModelConfig, tp: int, ep: int) -> None:
    """ValueError unless a MoE model's experts split into ep groups of tp / ep devices
    (a dense model takes only ep = 1)."""
    if not config.num_experts:
        if ep != 1:
            raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; this one is dense")
        return
    valid = valid_expert_parallel_sizes(config, tp)
    if ep not in valid:
        hidden = config.moe_intermediate_size or config.intermediate_size
        raise ValueError(f"expert_parallel_size={ep} does not split this model's {config.num_experts} experts "
                         f"of {hidden} hidden units over tensor_parallel_size={tp}; valid sizes: {valid}")


def valid_tensor_parallel_sizes(config: ModelConfig) -> list[int]:
    """The tp sizes this model shards to: divisors of the query heads that are either
    divisors or multiples of the KV heads (KV heads are repeated in the second case)."""
    return [tp for tp in range(1, config.num_heads + 1)
            if config.num_heads % tp == 0 and (config.num_kv_heads % tp == 0 or tp % config.num_kv_heads == 0)]


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """ValueError naming the valid sizes unless the model's heads split tp ways."""
    valid = valid_tensor_parallel_sizes(config)
    if tp not in valid:
        raise ValueError(f"tensor_parallel_size={tp} does not split this model's {config.num_heads} query "
                         f"heads and {config.num_kv_heads} KV heads evenly; valid sizes: {valid}")


def expand_kv_heads(config: ModelConfig, params: dict, tp: int) -> tuple[ModelConfig, dict]:
    """(config, params) with each KV head repeated tp / num_kv_heads times when tp exceeds
    the KV heads, else unchanged.

    Query head i reads KV head i // (num_heads / num_kv_heads) in both models: the
    repeated heads are consecutive, so the groups line up.
    """
    check_tensor_parallel(config, tp)
    if tp <= config.num_kv_heads:
        return config, params
    repeat, hd = tp // config.num_kv_heads, config.head_dim

    def widen(x):  # [..., kv * hd] -> [..., kv * repeat * hd]
        if isinstance(x, PackedWeight):
            raise ValueError("tensor_parallel_size above the KV heads needs float weights; "
                             "load with weights_dtype='float32' or 'bfloat16'")
        heads = x.reshape(*x.shape[:-1], config.num_kv_heads, hd)
        return jnp.repeat(heads, repeat, axis=-2).reshape(*x.shape[:-1], tp * hd)

    def widen_heads(name, w):
        if name in ("wk", "wv", "bk", "bv", "k_center"):
            return widen(w)
        return jnp.repeat(w, repeat, axis=0) if name in _HEAD_MATRIX else w

    layers = [{name: widen_heads(name, w) for name, w in layer.items()} for layer in params["layers"]]
    return dataclasses.replace(config, num_kv_heads=tp), {**params, "layers": layers}


def _split(shape, axis: int, tp: int) -> P:
    """P with the tensor-parallel axes on `axis` when tp divides that dimension, else replicated."""
    if tp == 1 or shape[axis] % tp:
        return P()
    spec = [None] * len(shape)
    spec[axis] = TENSOR
    return P(*spec)


def expert_spec(name: str) -> P:
    """An expert weight's spec: experts over "expert", hidden units over "model"."""
    if name in ("experts_gate", "experts_up"):  # [E, H, I]
        return P(EXPERT, None, MODEL)
    if name == "experts_down":  # [E, I, H]
        return P(EXPERT, MODEL, None)
    return P(EXPERT, MODEL) if name != "experts_down_bias" else P(EXPERT)  # [E, I] / [E, H]


def param_specs(params: dict, config: ModelConfig, tp: int) -> dict:
    """A PartitionSpec for every leaf of params (same tree), as the module docstring says.
    A MoE layer's expert specs name "expert" and "model" apart: their sizes come from the
    mesh (`check_expert_parallel` checks they divide)."""
    def leaf(name: str, x, moe: bool):
        if isinstance(x, PackedWeight):
            if tp > 1:
                raise ValueError(f"packed weights ({name}) are not sharded yet: load with "
                                 "weights_dtype='float32' or 'bfloat16' for tensor_parallel_size > 1")
            return jax.tree.map(lambda _: P(), x)
        shape = np.shape(x)
        if moe and name.startswith("experts_"):
            return expert_spec(name) if tp > 1 else P()
        if moe and name.startswith("router"):
            return P()  # (shared experts split like a dense MLP, by the rules below)
        if name in _COLUMN or name in _HEAD_VECTOR:
            return _split(shape, len(shape) - 1, tp)
        if name in _ROW or name in _HEAD_MATRIX:
            return _split(shape, 0, tp)
        if name == "embed":  # [V, H] over the vocabulary
            return _split(shape, 0, tp)
        if name == "lm_head":  # [H, V]
            return _split(shape, 1, tp)
        return P()

    specs = {name: leaf(name, x, False) for name, x in params.items() if name != "layers"}
    specs["layers"] = [{name: leaf(name, x, "router" in layer) for name, x in layer.items()}
                       for layer in params["layers"]]
    return specs


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> tuple[ModelConfig, dict]:
    """(config, params) laid out over the mesh: KV heads expanded when tp exceeds them,
    every weight placed by `param_specs` (replicated over "data")."""
    tp = tensor_parallel_size(mesh)
    check_expert_parallel(config, tp, mesh.shape[EXPERT])
    config, params = expand_kv_heads(config, params, tp)
    specs = param_specs(params, config, tp)
    shardings = jax.tree.map(lambda s: named(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    return config, jax.device_put(params, shardings)


def named(mesh: Mesh, spec: P) -> NamedSharding:
    """NamedSharding(mesh, spec) without the mesh's size-1 axes in the spec, the form XLA
    gives a step's outputs: a KV pool created so comes back from each step with the same
    sharding, and the step is not compiled a second time for the new form."""
    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if mesh.shape[a] > 1)
        return axes[0] if len(axes) == 1 else (axes or None)
    return NamedSharding(mesh, P(*map(keep, spec)))


def manual_over_model(fn, mesh, in_specs, out_specs):
    """fn under jax.shard_map, manual over the mesh's tensor-parallel axes ("expert", "model").

    At the top of a step the map is manual over every axis (specs without "data" replicate
    over it): Mosaic kernels refuse a partly automatic mesh. Inside an outer shard_map over
    "data" (a data-parallel training step) it is manual over the tensor-parallel axes only,
    on the context's mesh, and together the two leave no axis automatic."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.shard_map(fn, mesh=context, in_specs=in_specs, out_specs=out_specs, axis_names=set(TENSOR),
                         check_vma=False)


def kv_spec(leaf) -> P:
    """A KV page leaf's spec: [num_pages, page_size, num_kv_heads, ...] split on its heads;
    a scalar (a format's tensor scale) replicated."""
    return P(None, None, TENSOR) if getattr(leaf, "ndim", 0) >= 3 else P()


def kv_shardings(pool, mesh: Mesh):
    """NamedShardings of a KV pool (any pytree of page leaves) split by KV heads."""
    return jax.tree.map(lambda a: named(mesh, kv_spec(a)), pool)
