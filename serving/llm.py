"""The public API, in vLLM's names: LLM(...).generate / .chat / .stream.

    from serving import LLM, SamplingParams
    llm = LLM()                                   # the embedded default model
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)

Several decode steps per call (vLLM's multi-step scheduling): while every running
sequence is a plain decode row, one jitted call runs 8 steps, each sampling exactly as a
single step would, so the host's dispatch and bookkeeping are paid once per 8 tokens;
tokens after a stop are dropped (each sequence holds 7 KV slots more for them):

    llm = LLM(num_scheduler_steps=8)

Speculative decoding with an EAGLE-3 draft (`python -m training.train_eagle3` writes one):

    llm = LLM(speculative_config={"method": "eagle3", "model": "path/to/draft",
                                  "num_speculative_tokens": 15, "depth": 4, "top_k": 4})

Tensor parallelism over the first N devices (model/sharding.py: heads and MLP columns
split over the devices, KV pages split by KV heads):

    llm = LLM(tensor_parallel_size=3)             # SmolLM2's 9 query / 3 KV heads

A mixture-of-experts model splits each expert over the tp devices by default, or its
experts whole into expert_parallel_size groups (tokens travel to their experts):

    llm = LLM("path/to/qwen3-moe", tensor_parallel_size=4, expert_parallel_size=4)

Data parallelism: one engine per rank (its own pool, prefix cache and scheduler), each
request routed to one (serving/data_parallel.py):

    llm = LLM(tensor_parallel_size=3, data_parallel_size=2)   # 6 devices

Many fine-tunes of one base (S-LoRA): PEFT adapters chosen per request, mixed in a batch:

    llm = LLM(enable_lora=True, max_loras=4, max_lora_rank=16)
    out = llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "path/to/peft_dir"))

DeepSeek-V4.1's attention (CSA2: compressed FP4 rows in the pages, FP8 window rings in a
state slot per sequence, sparse indexer) on the tiny preset with random weights:

    llm = LLM("deepseek-v4.1-tiny", seed=0)        # window_replay="exact" | "bounded" after a prefix hit

Prefixes the device pool evicts kept in host memory and on disk (SGLang's HiCache), so
they are loaded back, not recomputed; the disk tier outlives the engine
(serving/kv_tiers.py):

    llm = LLM(enable_hierarchical_cache=True, host_cache_bytes=2 << 30,
              disk_cache_dir="/var/cache/kvfold", hicache_write_policy="write_through")
    llm.engine.kv.hits                            # prompt tokens served, by tier

Host rows live in JAX's pinned_host memory on an accelerator that has it, numpy on the
CPU backend (hicache_host_memory="auto" | "pinned_host" | "numpy").

Or under a Mooncake Store shared by several engine processes (`mooncake_master` running
at that address; each engine lends disk_cache_bytes of host memory to the pool):

    llm = LLM(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
              mooncake_master="10.0.0.1:50051", disk_cache_bytes=8 << 30)
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import numbers
import os
import threading
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import Mesh

import model
from model.weights import WEIGHTS_DTYPES
from pallas_kernels.quant_matmul import prepare_params
from model.deepseek import paged as paged_csa2
from model import eagle3, key_centers
from model.config import ATTENTION, SLIDING_ATTENTION
from model.kv_formats import KV_CACHE_DTYPES, bytes_per_token, check_kv_cache_dtype
from model.sharding import check_expert_parallel, check_tensor_parallel
from model import compile_cache
from serving import scheduler as sched
from serving.draft_tree import TreeSpec
from serving.kv_tiers import TierConfig
from serving.data_parallel import DataParallelEngine
from serving.engine import PREEMPTION_MODES, RECOMPUTE, SWAP, EngineCore
from serving.multihost import BroadcastRunner
from serving.params import (CompletionOutput, LoRARequest, RequestOutput, SamplingParams, check_bool, check_int,
                            check_text)
from serving.lora import LoRAManager
from serving.runner import EXACT_REPLAY, WINDOW_REPLAYS, Drafter, ModelRunner
from serving.structured import GrammarCompiler

DEFAULT_KV_CACHE_GIB = 1.0
SERVING_KV_CACHE_DTYPES = tuple(d for d in KV_CACHE_DTYPES if not d.startswith("kivi"))


class LLM:
    """A model with its tokenizer, KV page pool, scheduler and engine."""

    def __init__(self, model: str = "default", max_model_len: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 kv_cache_dtype: str = "auto", scheduling_policy: str = "fcfs",
                 capacity_policy: str = sched.MAX_UTILIZATION,
                 chunking_policy: str = sched.FIRST_COME_FIRST_SERVED,
                 preemption_mode: str = RECOMPUTE, seed: int = 0, dtype=jnp.float32,
                 speculative_config: dict | None = None, jump_forward: bool = True,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, weights_dtype: str | None = None,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, expert_parallel_size: int = 1,
                 precompile: bool = False, enable_hierarchical_cache: bool = False,
                 host_cache_bytes: int | None = None, disk_cache_dir: str | None = None,
                 disk_cache_bytes: int = TierConfig.disk_cache_bytes,
                 hicache_write_policy: str = TierConfig.write_policy,
                 hicache_storage_backend: str = TierConfig.storage_backend, mooncake_master: str | None = None,
                 hicache_storage_prefetch_policy: str = TierConfig.prefetch_policy,
                 hicache_host_memory: str = TierConfig.host_memory, window_replay: str = EXACT_REPLAY,
                 num_scheduler_steps: int = 1):
        import model as model_lib

        if weights_dtype is None and tensor_parallel_size > 1:  # packed weights are not sharded yet
            weights_dtype = "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"
        config, params = model_lib.load(model, dtype, weights_dtype, seed=check_int("seed", seed))
        self._setup(config, params, model_lib.load_tokenizer(model), max_model_len, block_size,
                    num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
                    kv_cache_dtype, scheduling_policy, capacity_policy, chunking_policy,
                    preemption_mode, seed, dtype, speculative_config, jump_forward, enable_lora,
                    max_loras, max_lora_rank, max_cpu_loras, weights_dtype, tensor_parallel_size,
                    data_parallel_size, expert_parallel_size, precompile, enable_hierarchical_cache,
                    host_cache_bytes, disk_cache_dir, disk_cache_bytes, hicache_write_policy,
                    hicache_storage_backend, mooncake_master, hicache_storage_prefetch_policy,
                    hicache_host_memory, window_replay, num_scheduler_steps)

    @classmethod
    def from_loaded(cls, config: model.ModelConfig, params: dict, tokenizer: model.Tokenizer,
                    **kwargs) -> "LLM":
        """An LLM over an already loaded model (same keyword arguments as the constructor;
        weights_dtype names how `params` were loaded, for update_weights from a path)."""
        llm = cls.__new__(cls)
        signature = inspect.signature(cls.__init__)  # the constructor's defaults, in one place
        unknown = sorted(set(kwargs) - set(signature.parameters) | {"self", "model"} & set(kwargs))
        if unknown:
            raise ValueError(f"unknown LLM arguments {unknown}")
        bound = signature.bind(llm, **kwargs)
        bound.apply_defaults()
        del bound.arguments["self"], bound.arguments["model"]
        llm._setup(config, params, tokenizer, **bound.arguments)
        return llm

    def _setup(self, config, params, tokenizer, max_model_len, block_size, num_kv_blocks,
               max_num_seqs, max_num_batched_tokens, enable_prefix_caching, kv_cache_dtype,
               scheduling_policy, capacity_policy, chunking_policy, preemption_mode, seed, dtype,
               speculative_config, jump_forward, enable_lora, max_loras, max_lora_rank, max_cpu_loras,
               weights_dtype, tensor_parallel_size, data_parallel_size, expert_parallel_size, precompile,
               enable_hierarchical_cache, host_cache_bytes, disk_cache_dir, disk_cache_bytes,
               hicache_write_policy, hicache_storage_backend, mooncake_master,
               hicache_storage_prefetch_policy, hicache_host_memory, window_replay, num_scheduler_steps):
        # Every argument is checked here, before anything is built.
        if weights_dtype is not None and weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"unknown weights_dtype {weights_dtype!r}; allowed: {', '.join(WEIGHTS_DTYPES)}")
        self._weights_dtype = weights_dtype
        compile_cache.enable()  # steps compiled by an earlier process load from disk
        context = config.max_position_embeddings
        max_model_len = context if max_model_len is None else check_int("max_model_len", max_model_len, 1, context)
        block_size = check_int("block_size", block_size, 1)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_kv_blocks is not None:
            num_kv_blocks = check_int("num_kv_blocks", num_kv_blocks, 1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        csa2 = paged_csa2.is_csa2(config)
        if not isinstance(window_replay, str) or window_replay not in WINDOW_REPLAYS:
            raise ValueError(f"window_replay must be one of {list(WINDOW_REPLAYS)}, got {window_replay!r}")
        enable_prefix_caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        seed = check_int("seed", seed)
        jump_forward = check_bool("jump_forward", jump_forward)
        for name, value, allowed in (("scheduling_policy", scheduling_policy, sched.ORDERS),
                                     ("capacity_policy", capacity_policy, sched.CAPACITY_POLICIES),
                                     ("chunking_policy", chunking_policy, sched.CHUNKING_POLICIES),
                                     ("preemption_mode", preemption_mode, PREEMPTION_MODES)):
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
        try:
            float_dtype = jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16, jnp.float16)
        except TypeError:
            float_dtype = False
        if not float_dtype:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in SERVING_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {SERVING_KV_CACHE_DTYPES}, got "
                             f"{kv_cache_dtype!r} (KIVI keeps a per-batch-row buffer the engine cannot "
                             "page yet)")
        check_kv_cache_dtype(kv_cache_dtype, config, block_size)
        if csa2:
            _check_csa2(config, block_size, kv_cache_dtype, speculative_config, enable_lora, tensor_parallel_size,
                        data_parallel_size)
        tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
        dp = check_int("data_parallel_size", data_parallel_size, 1)
        ep = check_int("expert_parallel_size", expert_parallel_size, 1)
        steps = check_int("num_scheduler_steps", num_scheduler_steps, 1)
        if steps > 1 and (speculative_config is not None or csa2 or tp * dp > 1):
            raise ValueError("num_scheduler_steps > 1 is not supported with speculative decoding, a CSA2 model "
                             "or tensor / data parallelism yet")
        multihost = jax.process_count() > 1  # process 0 broadcasts each runner call (serving/multihost.py)
        if multihost and (dp > 1 or preemption_mode != RECOMPUTE):
            raise ValueError("across hosts, data_parallel_size must be 1 and preemption_mode 'recompute'")
        draft = _drafter(speculative_config, config, dtype)
        tiers = None
        if check_bool("enable_hierarchical_cache", enable_hierarchical_cache):
            tiers = TierConfig(host_cache_bytes, disk_cache_dir, disk_cache_bytes, hicache_write_policy,
                               hicache_storage_backend, mooncake_master, hicache_storage_prefetch_policy,
                               hicache_host_memory)
            if not enable_prefix_caching:
                raise ValueError("enable_hierarchical_cache extends the prefix cache: it needs "
                                 "enable_prefix_caching=True")
            if dp > 1 or multihost:
                raise ValueError("the hierarchical cache serves one engine on one host yet: use it with "
                                 "data_parallel_size=1")
        elif (host_cache_bytes, disk_cache_dir, mooncake_master) != (None, None, None):
            raise ValueError("host_cache_bytes, disk_cache_dir and mooncake_master need "
                             "enable_hierarchical_cache=True")
        if check_bool("precompile", precompile) and multihost:
            raise ValueError("precompile does not cover several hosts yet")
        lora = None
        if check_bool("enable_lora", enable_lora):
            if draft is not None:
                raise ValueError("enable_lora with speculative_config is not supported yet")
            if any(kind not in (ATTENTION, SLIDING_ATTENTION) for kind in config.layer_kinds):
                raise ValueError("LoRA adapters need a Llama-family model (standard attention layers)")
            lora = LoRAManager(config, max_loras, max_lora_rank, max_cpu_loras, dtype)
        if draft is not None and max_num_batched_tokens < draft.spec.num_tokens:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot fit one draft tree "
                             f"({draft.spec.num_tokens} tokens)")
        # The model as the devices hold it: one copy per data-parallel rank, each on its row
        # of a (data, expert, model) mesh, tensor-parallel over the row with KV heads repeated
        # when tp exceeds them and a MoE layer's experts in ep groups (model/sharding.py);
        # self.config stays the model's own.
        params = prepare_params(params)  # packed weights in the layout this backend's kernel reads
        params = key_centers.without_key_centers(params)  # the engine takes its own (below)
        rank_meshes, step_config, rank_params = [None], config, [params]
        self._loaded = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        self._kv_cache_dtype = kv_cache_dtype
        check_tensor_parallel(config, tp)
        check_expert_parallel(config, tp, ep)
        if tp * dp > 1:
            if draft is not None or lora is not None:
                raise ValueError("speculative decoding and LoRA adapters are not sharded yet: use them with "
                                 "tensor_parallel_size=1 and data_parallel_size=1")
            mesh = model.make_mesh(tp, dp, expert_parallel_size=ep)
            rank_meshes = [Mesh(mesh.devices[r:r + 1], mesh.axis_names) for r in range(dp)]
            rank_params = []
            for rank_mesh in rank_meshes:
                step_config, placed = model.shard_params(params, config, rank_mesh)
                rank_params.append(placed)
        rank_params = self._with_key_centers(config, step_config, tokenizer, rank_params, rank_meshes)
        # KV slots each running sequence holds past its next token: a draft tree's, or the
        # further positions a multi-step decode call writes
        lookahead = draft.spec.lookahead if draft else steps - 1
        max_pages_per_seq = -(-(max_model_len + lookahead) // block_size)
        if num_kv_blocks is None:
            # Every running sequence at full length, capped by a memory budget. Not larger:
            # XLA:CPU still copies a whole bfloat16 pool in each write through XLA
            # (kv_formats._scatter_rows), a cost per step that grows with the pool.
            per_token = (config.kv_bytes_per_token if csa2  # the window rings are per sequence, not per token
                         else bytes_per_token(kv_cache_dtype, step_config, dtype, block_size))
            if draft is not None:
                per_token += bytes_per_token(kv_cache_dtype, draft.config.layer_config, dtype, block_size)
            budget = DEFAULT_KV_CACHE_GIB * 2**30 // per_token
            num_kv_blocks = max(min(int(budget) // block_size, max_num_seqs * max_pages_per_seq),
                                max_pages_per_seq)
        self.config, self.tokenizer, self.max_model_len = config, tokenizer, max_model_len
        sched_config = sched.SchedulerConfig(
            page_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, capacity_policy=capacity_policy,
            chunking_policy=chunking_policy, order=scheduling_policy,
            chunk_unit_size=min(sched.SchedulerConfig.chunk_unit_size, max_num_batched_tokens),
            tokens_per_decode=draft.spec.num_tokens if draft else 1, num_lookahead_slots=lookahead,
            max_loras=lora.max_loras if lora else 0)
        # one runner (its own pool) and one engine (its own scheduler and prefix cache) per rank
        self.runners = [ModelRunner(step_config, placed, num_kv_blocks, block_size, max_pages_per_seq,
                                    max_num_seqs, dtype, kv_cache_dtype, draft, lora, rank_mesh, window_replay,
                                    steps)
                        for placed, rank_mesh in zip(rank_params, rank_meshes)]
        self.runner = self.runners[0]
        grammars = GrammarCompiler(tokenizer, config.vocab_size, tokenizer.eos_token_id)
        engines = [EngineCore(BroadcastRunner(runner) if multihost and jax.process_index() == 0 else runner,
                              sched_config, num_kv_blocks, max_model_len,
                              tokenizer.eos_token_id, enable_prefix_caching, preemption_mode, seed + rank,
                              decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                              grammars=grammars, jump_forward=jump_forward,
                              encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                              vocab_size=config.vocab_size, tiers=tiers,
                              fingerprint=b"" if tiers is None else self._fingerprint(runner), state_slots=csa2)
                   for rank, runner in enumerate(self.runners)]
        self.engine = engines[0] if dp == 1 else DataParallelEngine(engines)
        if precompile:  # every step shape now, so serving never stops to compile
            for runner in self.runners:
                runner.precompile(max_num_batched_tokens, swap=preemption_mode == SWAP)
        self._ids = itertools.count()
        self._lock = threading.RLock()  # one engine step (or request change) at a time
        self._closed = False

    def close(self) -> None:
        """Shut the engine down: requests still in flight are aborted, copies down land in
        the tiers, their threads stop, and a Mooncake Store client leaves its pool (the
        pages it lent go with it; without close, at process exit). The disk tier's files
        stay for the next engine. Idempotent; `with LLM(...) as llm:` closes at the end.
        Generating afterwards raises RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._forget([(rid, None) for rid in list(self.engine.requests)])
            for engine in getattr(self.engine, "ranks", [self.engine]):
                engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update_weights(self, params) -> None:
        """Swap the model's weights, as an RL loop does between rollouts.

        params: a pytree with the loaded params' structure and leaf shapes (leaves are cast
        to the running dtype, so a bfloat16 trainer state fits a float32 engine), or a
        checkpoint path `model.load` reads, of the same model config. Nothing recompiles:
        the weights are arguments of the jitted step, never constants. The prefix cache is
        flushed, since its pages hold K/V the old weights computed; the key centers (and bases)
        of a pool in key_centers.CENTERED_FORMATS are taken again over the new weights. Call it between
        `generate` calls: with requests in flight it raises ValueError, as it does for a
        pytree or checkpoint that does not match; the old weights stay on error."""
        with self._lock:
            if self.engine.has_unfinished():
                raise ValueError("update_weights needs an idle engine: requests are still in flight")
            if isinstance(params, (str, os.PathLike)):
                path = os.fspath(params)
                config, params = model.load(path, self.runner.params["final_norm"].dtype, self._weights_dtype)
                if config != self.config:
                    raise ValueError(f"checkpoint {path!r} is another model: its config differs "
                                     f"from the running one ({config} != {self.config})")
            params = _matching_params(self._loaded, key_centers.without_key_centers(prepare_params(params)))
            placed = [params if runner.mesh is None else model.shard_params(params, self.config, runner.mesh)[1]
                      for runner in self.runners]
            placed = self._with_key_centers(self.config, self.runner.config, self.tokenizer, placed,
                                            [runner.mesh for runner in self.runners])
            for runner, rank_params in zip(self.runners, placed):
                runner.params = rank_params
            self.__dict__.pop("kv_fingerprint", None)  # the new weights compute other K/V
            if getattr(self.engine, "tiers", None) is not None:
                self.engine.kv.reseed(self.kv_fingerprint)  # the tiers' pages are the old model's
            else:
                self.engine.kv.flush_prefix_cache()

    def _with_key_centers(self, config, step_config, tokenizer, rank_params: list, rank_meshes: list) -> list:
        """Each rank's params with the key centers (and for key_centers.BASIS_FORMATS the key
        bases) its quantized pages store (model/key_centers.py), when the format and model
        call for them: taken over rank 0's copy as its devices hold it
        (step_config: the config it runs under, KV heads repeated for tp) and placed like
        every weight."""
        if not key_centers.applies(config, self._kv_cache_dtype):
            return rank_params
        ids = key_centers.model_calibration_ids(tokenizer, config)
        transforms = key_centers.key_transforms(rank_params[0], step_config, ids, self._kv_cache_dtype,
                                                rank_meshes[0], config.num_kv_heads)
        placed = [key_centers.set_key_centers(params, *transforms) for params in rank_params]
        return [params if mesh is None else model.shard_params(params, step_config, mesh)[1]
                for params, mesh in zip(placed, rank_meshes)]

    @functools.cached_property
    def kv_fingerprint(self) -> bytes:
        """The identity of the K/V this LLM computes (`_fingerprint` of its runner): equal
        fingerprints mean one engine's pages are valid in another (serving/kv_transfer.py)."""
        return self._fingerprint(self.runner)

    def _fingerprint(self, runner: ModelRunner) -> bytes:
        """The identity of the K/V a runner computes, the root of the tiers' page keys: the
        model config, the pool's page layout and a strided sample of every weight (the
        draft's too: its K/V shares the pages), so another model never reads these pages."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((self.config, runner.page_size, jax.tree.map(
            lambda a: (a.shape, str(a.dtype)), runner.pool))).encode())
        weights = [runner.params] + ([runner.draft.params] if runner.draft is not None else [])
        for leaf in jax.tree.leaves(weights):
            flat = jnp.ravel(leaf)
            sample = np.asarray(flat[::max(1, flat.size // 4096)])
            digest.update(repr((leaf.shape, str(leaf.dtype))).encode() + sample.tobytes())
        return digest.digest()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now, so its first request does not wait for it (vLLM's
        add_lora); ValueError for a bad adapter or without enable_lora. Returns True."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        with self._lock:
            self.runner.add_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its slot, host copy and cached prefixes go (the id may then
        name another adapter). ValueError while a request of it is in flight; False when
        the id is unknown."""
        with self._lock:
            if self.runner.lora is None:
                return False
            if any(r.lora_id == lora_int_id and not self.engine.request_finished(r.request_id)
                   for r in self.engine.requests.values()):
                raise ValueError(f"LoRA adapter {lora_int_id} has requests in flight")
            if not self.runner.lora.remove(lora_int_id):
                return False
            self.engine.kv.flush_prefix_cache(namespace=lora_int_id)
            return True

    def list_loras(self) -> set[int]:
        """The lora_int_ids this engine knows."""
        return set(self.runner.lora.requests) if self.runner.lora is not None else set()

    def get_tokenizer(self) -> model.Tokenizer:
        return self.tokenizer

    # -- input ---------------------------------------------------------------------

    def _prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text = check_text("prompt", prompt)
            if not text:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(text)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if text is not None:
                check_text("prompt", text)
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            ids = list(ids)
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt(prompt["prompt"])
        else:
            raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt has no tokens")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_))
               or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        return text, [int(t) for t in ids]  # the engine checks the length against max_model_len

    def _requests(self, prompts, sampling_params, lora_request=None
                  ) -> list[tuple[str | None, list[int], SamplingParams, LoRARequest | None]]:
        """Every prompt, its SamplingParams and LoRARequest, all checked before any is
        scheduled."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError("sampling_params must be SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        for p in sampling_params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if not isinstance(lora_request, (list, tuple)) or len(lora_request) != len(prompts):
            raise ValueError("lora_request must be a LoRARequest, None, or a list of them (one per prompt)")
        for r in lora_request:
            if r is not None and not isinstance(r, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {type(r).__name__}")
        return [(*self._prompt(p), sp, lr) for p, sp, lr in zip(prompts, sampling_params, lora_request)]

    # -- output (read only: the engine's output processor wrote it) ----------------------

    def _output(self, request_id: str, prompt: str | None, marks: list[tuple[int, int]] | None = None
                ) -> RequestOutput:
        """The request's outputs; with `marks` (per sequence: text pieces and tokens already
        returned), only what is new since, and `marks` moves on."""
        req = self.engine.requests[request_id]
        first = marks is None or not any(t for _, t in marks)
        outputs = []
        for i, sid in enumerate(req.seq_ids):
            seq = self.engine.seqs[sid]
            out = seq.output
            pieces, tokens = marks[i] if marks is not None else (0, 0)
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = [_logprob_dict(tok, entry, seq.params.logprobs)
                            for tok, entry in zip(out.tokens[tokens:], out.logprobs[tokens:])]
            outputs.append(CompletionOutput(seq.index, "".join(out.text_pieces[pieces:]), out.tokens[tokens:],
                                            logprobs, out.finish_reason, out.stop_reason))
            if marks is not None:
                marks[i] = (len(out.text_pieces), len(out.tokens))
        finished = self.engine.request_finished(request_id)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and first and (finished or any(o.token_ids for o in outputs)):
            # streamed once, with the first tokens (the prompt is computed by then)
            prompt_logprobs = [None if entry is None else _logprob_dict(token, entry, req.params.prompt_logprobs)
                               for token, entry in zip(req.prompt_ids, req.prompt_logprobs)]
        return RequestOutput(request_id, prompt, list(req.prompt_ids), outputs, finished,
                             req.num_cached_tokens, prompt_logprobs)

    # -- generation ------------------------------------------------------------------

    def _add(self, prompts, sampling_params, lora_request=None, remote_kv=None) -> list[tuple[str, str | None]]:
        """Validate every request, then add them all or none. remote_kv: per prompt, its
        K/V on its way from another engine (EngineCore.add_request), or None."""
        requests = self._requests(prompts, sampling_params, lora_request)
        remote_kv = [None] * len(requests) if remote_kv is None else list(remote_kv)
        if len(remote_kv) != len(requests):
            raise ValueError(f"remote_kv has {len(remote_kv)} entries for {len(requests)} prompts")
        added = []
        with self._lock:
            if self._closed:
                raise RuntimeError("this LLM is closed")
            try:
                for (text, ids, params, lora), remote in zip(requests, remote_kv):
                    rid = str(next(self._ids))
                    self.engine.add_request(rid, ids, params, lora_request=lora,
                                            **({"remote_kv": remote} if remote is not None else {}))
                    added.append((rid, text))
            except BaseException:
                self._forget(added)
                raise
        return added

    def _forget(self, added: list[tuple[str, str | None]]) -> None:
        """Abort and drop `added` requests (finished or not): their pages go back now."""
        with self._lock:
            for rid, _ in added:
                if rid in self.engine.requests:
                    self.engine.abort(rid)
                    self.engine.release(rid)

    def _step(self, added: list[tuple[str, str | None]]) -> None:
        """One engine step for `added`, unless they are all finished. Calls from several
        threads share the engine one step at a time (a step advances every thread's requests)."""
        with self._lock:
            if all(self.engine.request_finished(rid) for rid, _ in added):
                return
            if not self.engine.has_unfinished():  # every unfinished request is scheduled somewhere
                raise RuntimeError("requests are unfinished but the engine holds no sequence")
            self.engine.step()

    def stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> Iterator[RequestOutput]:
        """Yield RequestOutputs whose outputs hold only what is new (text and token deltas);
        the work per step does not grow with the text already generated."""
        added = self._add(prompts, sampling_params, lora_request)
        marks = {rid: [(0, 0)] * len(self.engine.requests[rid].seq_ids) for rid, _ in added}
        pending = dict(added)
        try:
            while pending:
                self._step(added)
                for rid in list(pending):
                    with self._lock:
                        out = self._output(rid, pending[rid], marks[rid])
                    if out.finished or any(o.token_ids or o.text for o in out.outputs):
                        if out.finished:
                            del pending[rid]
                        yield out
        finally:
            self._forget(added)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order (use_tqdm:
        a progress bar over finished requests; lora_request: the adapter every prompt, or
        each prompt, runs under, None for the base model; needs enable_lora=True)."""
        added = self._add(prompts, sampling_params, lora_request)
        try:
            with tqdm.tqdm(total=len(added), desc="requests", disable=not use_tqdm) as bar:
                while (done := sum(self.engine.request_finished(rid) for rid, _ in added)) < len(added):
                    bar.update(done - bar.n)
                    self._step(added)
                bar.update(done - bar.n)
            with self._lock:
                if getattr(self.engine, "tiers", None) is not None:
                    self.engine.tiers.flush()  # what the batch cached is in host memory and on disk
                return [self._output(rid, text) for rid, text in added]
        finally:
            self._forget(added)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        conversations = messages if messages and isinstance(messages, list) and isinstance(messages[0], list) \
            else [messages]
        for conversation in conversations:
            check_messages(conversation)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(c, tokenize=True)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, lora_request=lora_request)


def _matching_params(current, new):
    """`new` on device with `current`'s leaf dtypes; ValueError naming the first leaf whose
    path or shape differs (a different structure would recompile every step)."""
    want, structure = jax.tree_util.tree_flatten_with_path(current)
    try:
        got, new_structure = jax.tree_util.tree_flatten_with_path(new)
    except Exception as e:  # noqa: BLE001 - any non-pytree
        raise ValueError(f"params must be a pytree of arrays: {e}") from e
    if new_structure != structure:
        missing = {jax.tree_util.keystr(p) for p, _ in want} ^ {jax.tree_util.keystr(p) for p, _ in got}
        raise ValueError(f"params differ in structure from the loaded ones (keys only on one side: "
                         f"{sorted(missing)[:5]})")
    leaves = []
    for (path, old), (_, leaf) in zip(want, got):
        shape = getattr(leaf, "shape", None)
        if shape is None or tuple(shape) != old.shape:
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {shape}, the loaded "
                             f"weights {old.shape}")
        if not jnp.issubdtype(old.dtype, jnp.floating) and jnp.dtype(leaf.dtype) != old.dtype:
            raise ValueError(f"params{jax.tree_util.keystr(path)} is {leaf.dtype}; the loaded packed "
                             f"weights hold {old.dtype} codes (pack the new weights the same way)")
        leaves.append(jnp.asarray(leaf, old.dtype))
    return jax.tree.unflatten(structure, leaves)


def _logprob_dict(token: int, entry: tuple[float, dict[int, float]], k: int) -> dict[int, float]:
    """vLLM's per-token logprobs: the token's own, then the top k at its position."""
    logprob, top = entry
    return {token: logprob, **dict(sorted(top.items(), key=lambda kv: -kv[1])[:k])}


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages) -> None:
    """A conversation is a non-empty list of {"role": one of CHAT_ROLES, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts (or a "
                         f"list of such lists), got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"message {i} role must be one of {list(CHAT_ROLES)}, got {m['role']!r}")
        check_text(f"message {i} content", m.get("content"))


SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "depth", "top_k")


def _drafter(speculative_config: dict | None, config: model.ModelConfig, dtype) -> Drafter | None:
    """Load and check the draft that `speculative_config` names (None: no speculation).

    Keys: method ("eagle3"), model (a draft directory), num_speculative_tokens (draft
    tokens the target scores per step), and the tree's depth (default 7) and top_k
    (default 10) (the EAGLE-3 paper's tree).
    """
    if speculative_config is None:
        return None
    if not isinstance(speculative_config, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
    unknown = sorted(set(speculative_config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; known: {list(SPECULATIVE_KEYS)}")
    if speculative_config.get("method") != "eagle3":
        raise ValueError(f"speculative_config method must be 'eagle3', got {speculative_config.get('method')!r}")
    for key in ("model", "num_speculative_tokens"):
        if key not in speculative_config:
            raise ValueError(f"speculative_config needs {key!r}")
    for key in ("num_speculative_tokens", "depth", "top_k"):
        value = speculative_config.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config {key!r} must be a positive int, got {value!r}")
    other = sorted(set(config.layer_kinds) - {ATTENTION, SLIDING_ATTENTION})
    if other:
        raise ValueError(f"speculative decoding needs standard attention layers; this model has {other}")
    n = speculative_config["num_speculative_tokens"]
    spec = TreeSpec(depth=speculative_config.get("depth", min(7, n)),
                    top_k=speculative_config.get("top_k", 10), num_tokens=n + 1)
    if config.sliding_window is not None and config.sliding_window <= spec.depth:
        raise ValueError(f"a tree of depth {spec.depth} does not fit the sliding window {config.sliding_window}")
    draft_config, draft_params = eagle3.load_draft(speculative_config["model"], dtype)
    target = draft_config.target
    mismatch = [f for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                            "head_dim") if getattr(target, f) != getattr(config, f)]
    if mismatch:
        raise ValueError(f"the draft in {speculative_config['model']!r} was trained for another target "
                         f"(differs in {mismatch})")
    if spec.top_k > draft_config.draft_vocab_size:
        raise ValueError(f"top_k={spec.top_k} exceeds the draft vocabulary ({draft_config.draft_vocab_size})")
    return Drafter(draft_config, draft_params, spec)


def _check_csa2(config, block_size, kv_cache_dtype, speculative_config, enable_lora, tensor_parallel_size,
                data_parallel_size) -> None:
    """What a DeepSeek-V4.1 (CSA2) model is served with: ValueError naming what it is not (yet)."""
    if kv_cache_dtype != "auto":
        raise ValueError(f"{config.name} stores its KV in fixed formats (NVFP4 rows, MXFP4 index keys, FP8 "
                         f"window): kv_cache_dtype must be 'auto', got {kv_cache_dtype!r}")
    paged_csa2.check_page_size(config, block_size)
    unsupported = [name for name, on in (
        ("speculative_config", speculative_config is not None), ("enable_lora", enable_lora),
        ("tensor_parallel_size > 1", tensor_parallel_size != 1),
        ("data_parallel_size > 1", data_parallel_size != 1)) if on]
    if unsupported:
        raise ValueError(f"{config.name} (CSA2 attention) is not served with {', '.join(unsupported)} yet")
