"""The worker's side of LoRA: slots in every decoder projection, which adapter sits in which
slot, and each step's token -> slot mapping.

The scheduler never runs more than `max_loras` adapters in one step, so a step's adapters always
fit the slots: one already in a slot stays there; a new one takes a free slot or one whose
adapter this step does not run. Loaded adapters are kept (on the host, up to `max_cpu_loras`,
least recently used dropped first), so an adapter that leaves its slot comes back without
reading its folder again.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from v1engine.config import LoRAConfig
from v1engine.logger import info_once, init_logger
from v1engine.lora.adapter import LoRAAdapter, load_adapter
from v1engine.lora.layers import LoRAMapping, LoRASlots
from v1engine.lora.request import LoRARequest
from v1engine.model.layers.linear import LinearBase
from v1engine.model.models.llama import STACKED_PARAMS

logger = init_logger(__name__)

# A decoder projection's module name: (layer index, projection), e.g. model.layers.3.mlp.down_proj
_PROJECTION = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


class LoRAModelManager:
    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.hf_config = hf_config
        self.config = config
        self.dtype, self.device = dtype, device
        # (layer index, slots) of every decoder projection, given to the layer as `lora`.
        self.layers: list[tuple[int, LoRASlots]] = []
        for name, module in model.named_modules():
            match = _PROJECTION.match(name)
            if match is None or not isinstance(module, LinearBase):
                continue
            merged = match[2]
            parts = [(part, shard) for fused, part, shard in STACKED_PARAMS if fused == merged]
            module.lora = LoRASlots(
                module,
                parts or [(merged, None)],
                config.max_loras,
                config.max_lora_rank,
                dtype,
                device,
            )
            self.layers.append((int(match[1]), module.lora))
        self.slot_ids: list[int] = [0] * config.max_loras  # adapter id per slot; 0: free
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(slots.nbytes for _, slots in self.layers)

    def step_mapping(
        self, row_loras: list[LoRARequest | None], query_lens: np.ndarray
    ) -> LoRAMapping | None:
        """The step's token -> slot mapping (rows computing `query_lens[row]` tokens with
        adapter `row_loras[row]`), with every adapter they name put in a slot first; None when
        no row runs an adapter.

        Raises:
            RuntimeError: the rows name more adapters than there are slots (a scheduler bug).
        """
        wanted = {lora.lora_int_id: lora for lora in row_loras if lora is not None}
        if not wanted:
            return None
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(
                f"a step runs {len(wanted)} LoRA adapters but the workers hold max_loras="
                f"{len(self.slot_ids)}; the scheduler must not schedule more"
            )
        for lora_id, lora in wanted.items():
            if lora_id not in self.slot_ids:
                self._put_in_slot(lora, keep=wanted.keys())
        row_slots = np.array(
            [-1 if lora is None else self.slot_ids.index(lora.lora_int_id) for lora in row_loras]
        )
        if len(wanted) == 1 and row_slots.min() >= 0:  # every row runs the one adapter
            return LoRAMapping(slot=int(row_slots[0]))
        token_slots = np.repeat(row_slots, query_lens)
        one_hot = np.zeros((len(token_slots), len(self.slot_ids)), dtype=np.float32)
        tokens = np.flatnonzero(token_slots >= 0)
        one_hot[tokens, token_slots[tokens]] = 1.0
        return LoRAMapping(None, torch.from_numpy(one_hot).to(self.device, self.dtype))

    def _put_in_slot(self, lora: LoRARequest, keep: Any) -> None:
        # A free slot first, else one whose adapter this step does not run.
        candidates = [i for i, lora_id in enumerate(self.slot_ids) if lora_id not in keep]
        slot = min(candidates, key=lambda i: self.slot_ids[i] != 0)
        adapter = self._adapter(lora)
        for layer, slots in self.layers:
            slots.set_slot(
                slot,
                {
                    projection: weights
                    for (index, projection), weights in adapter.weights.items()
                    if index == layer
                },
            )
        self.slot_ids[slot] = lora.lora_int_id
        logger.debug("LoRA adapter %r (id %d) in slot %d", lora.lora_name, lora.lora_int_id, slot)

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.adapters.pop(lora.lora_int_id, None)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
            info_once(logger, "Loaded LoRA adapter %r from %s", lora.lora_name, lora.lora_path)
        self.adapters[lora.lora_int_id] = adapter  # most recently used last
        while len(self.adapters) > self.config.num_cpu_loras:
            self.adapters.popitem(last=False)
        return adapter
