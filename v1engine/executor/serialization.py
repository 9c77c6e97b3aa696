"""The only place that pickles: protocol 5 with out-of-band buffers.

`serialize(obj)` returns frames: frame 0 is the pickle stream, frames 1.. are the raw buffers of
numpy arrays and torch tensors, never copied into the pickle. `deserialize(frames)` rebuilds the
object on top of whatever buffers it is given, so the transport decides who owns the memory.
torch is only touched when the sender already imported it, keeping worker start-up light.
`pack_frames`/`unpack_frames` lay frames out in one flat buffer, a ring chunk of message_queue.py.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
from typing import Any

from v1engine.utils import round_up

Buffer = bytes | bytearray | memoryview
_ALIGN = 64


def _rebuild_tensor(buffer: Any, dtype_name: str, shape: tuple[int, ...]) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    raw = memoryview(buffer).cast("B")
    if raw.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_tensor(tensor: Any) -> tuple:
    # Data leaves as one raw byte buffer (out of band); CUDA tensors are copied to the host.
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if tensor.requires_grad:
        raise ValueError("cannot send a tensor that requires grad; call .detach() first")
    raw = flat.view(_uint8()).numpy() if flat.numel() else b""
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype_name, tuple(tensor.shape))


def _uint8() -> Any:
    return sys.modules["torch"].uint8


# Buffers smaller than this stay in the pickle stream: a separate frame costs more than it saves.
_MIN_OUT_OF_BAND_BYTES = 4096
_pickler_cls: type[pickle.Pickler] | None = None


def _get_pickler_cls() -> type[pickle.Pickler]:
    """A Pickler class whose dispatch table knows torch.Tensor once torch is imported; built once
    (per torch import), not per message.
    """
    global _pickler_cls
    torch = sys.modules.get("torch")
    if _pickler_cls is None or (torch is not None and not _pickler_cls.knows_torch):
        table = copyreg.dispatch_table.copy()
        if torch is not None:
            table[torch.Tensor] = _reduce_tensor
        _pickler_cls = type(
            "_Pickler", (pickle.Pickler,), {"dispatch_table": table, "knows_torch": bool(torch)}
        )
    return _pickler_cls


def serialize(obj: Any) -> list[Buffer]:
    """Returns [pickle stream, *out-of-band buffers]."""
    buffers: list[memoryview] = []

    def keep_in_band(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < _MIN_OUT_OF_BAND_BYTES:
            return True
        buffers.append(raw)
        return False

    stream = io.BytesIO()
    _get_pickler_cls()(stream, protocol=5, buffer_callback=keep_in_band).dump(obj)
    return [stream.getbuffer(), *buffers]


def deserialize(frames: list[Buffer]) -> Any:
    """Rebuilds from frames; arrays and tensors are views of frames[1:] (no copy here)."""
    return pickle.loads(frames[0], buffers=frames[1:])


# ---- frames in one flat buffer (a ring chunk) ----
#
#     [u32 num_frames][u64 size] * num_frames [pad to 64] frame 0 [pad] frame 1 ...


def pack_frames(view: memoryview, frames: list, sizes: list[int]) -> None:
    header = struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes)
    view[: len(header)] = header
    offset = round_up(len(header), _ALIGN)
    for frame, size in zip(frames, sizes):
        view[offset : offset + size] = memoryview(frame).cast("B")
        offset = round_up(offset + size, _ALIGN)


def unpack_frames(view: memoryview) -> Any:
    (num_frames,) = struct.unpack_from("<I", view, 0)
    sizes = struct.unpack_from(f"<{num_frames}Q", view, 4)
    offset = round_up(4 + 8 * num_frames, _ALIGN)
    if num_frames == 1:  # the common small message: no out-of-band buffers
        return deserialize([view[offset : offset + sizes[0]]])
    starts = []
    for size in sizes:
        starts.append(offset)
        offset = round_up(offset + size, _ALIGN)
    # Private copies of the out-of-band buffers, so nothing returned aliases the ring. Building
    # the bytearray from the slice copies once (a zeroed bytearray would touch the memory twice).
    buffers = [bytearray(view[start : start + size]) for start, size in zip(starts[1:], sizes[1:])]
    return deserialize([view[starts[0] : starts[0] + sizes[0]], *buffers])
