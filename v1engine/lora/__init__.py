"""LoRA adapters served beside their base model (vLLM's multi-LoRA): requests name an adapter with
a `LoRARequest`; the scheduler runs at most `max_loras` adapters in one step; each worker keeps
their weights in `max_loras` slots of every projection and adds each token's adapter delta.

    request.py   LoRARequest, what a request names (crosses every process)
    adapter.py   reading a PEFT adapter folder and checking it against the model
    layers.py    the slots one projection holds and the delta it adds
    manager.py   the worker's side: which adapter sits in which slot, each step's token mapping
"""

from v1engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
