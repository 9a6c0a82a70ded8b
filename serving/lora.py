"""Many LoRA adapters on one base model (S-LoRA): adapters in host memory, device slots.

The runner owns a LoRAManager. Adapters a request names are read and checked when the
request is added (`add`), and kept in host memory, an LRU of `max_cpu_loras` adapters
(one evicted there is read again from its directory when needed). The device holds
`max_loras` slots: fixed-shape stacks per projection (model/lora.py), so a step never
recompiles for another adapter. Before each step `slots_for` puts the step's adapters
into slots, evicting the least recently used slot whose adapter the step does not use;
the scheduler admits at most max_loras distinct adapters among running sequences, so
the step's adapters always fit.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp

from model import ModelConfig
from model import lora as model_lora
from pallas_kernels.lora.tiles import MAX_SLOTS
from serving.params import LoRARequest, check_int


class LoRAManager:
    def __init__(self, config: ModelConfig, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, dtype=jnp.float32):
        self.config = config
        self.max_loras = check_int("max_loras", max_loras, 1, MAX_SLOTS)
        self.max_lora_rank = check_int("max_lora_rank", max_lora_rank, 1)
        max_cpu_loras = self.max_loras if max_cpu_loras is None else max_cpu_loras
        self.max_cpu_loras = check_int("max_cpu_loras", max_cpu_loras, self.max_loras)
        self.stacks = model_lora.init_stacks(config, self.max_loras, self.max_lora_rank, dtype)
        self.requests: dict[int, LoRARequest] = {}  # every adapter added, by id
        self.host: collections.OrderedDict[int, model_lora.LoRAAdapter] = collections.OrderedDict()
        self.slots: list[int | None] = [None] * self.max_loras  # adapter id held by each slot
        self._last_use = [0] * self.max_loras
        self._tick = 0
        self.num_device_loads = 0  # adapters written into a slot
        self.num_host_loads = 0  # adapters read from their directory

    def add(self, request: LoRARequest) -> None:
        """Know `request`'s adapter: read and check it now (ValueError: a bad adapter, a rank
        above max_lora_rank, or an id already used by another name or path)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path!r}")
            return
        self._host_adapter(request)
        self.requests[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is cleared when no step uses it); False if unknown."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        if lora_int_id in self.slots:
            slot = self.slots.index(lora_int_id)
            self.slots[slot] = None
            self.stacks = model_lora.write_slot(self.stacks, slot, None)
        return True

    def _host_adapter(self, request: LoRARequest) -> model_lora.LoRAAdapter:
        adapter = self.host.get(request.lora_int_id)
        if adapter is None:
            adapter = model_lora.load_peft_adapter(request.lora_path, self.config)
            if adapter.rank > self.max_lora_rank:
                raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {adapter.rank}, above "
                                 f"max_lora_rank={self.max_lora_rank}")
            self.num_host_loads += 1
            self.host[request.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return adapter

    def slots_for(self, ids) -> dict[int, int]:
        """Device slot of each adapter id in `ids` (at most max_loras of them), loading the
        missing ones into free or least recently used slots the step does not use."""
        ids = set(ids)
        if len(ids) > self.max_loras:
            raise ValueError(f"a step uses {len(ids)} LoRA adapters; max_loras={self.max_loras}")
        self._tick += 1
        for i in ids - set(self.slots):
            spare = [s for s, held in enumerate(self.slots) if held not in ids]
            slot = min(spare, key=lambda s: (self.slots[s] is not None, self._last_use[s]))
            self.stacks = model_lora.write_slot(self.stacks, slot, self._host_adapter(self.requests[i]))
            self.slots[slot] = i
            self.num_device_loads += 1
        where = {i: self.slots.index(i) for i in ids}
        for slot in where.values():
            self._last_use[slot] = self._tick
        return where
