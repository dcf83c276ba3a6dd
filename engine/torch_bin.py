"""PyTorch `.bin` weight files (`pytorch_model.bin`, or shards named by
`pytorch_model.bin.index.json`), which older checkpoints hold instead of safetensors, read as
safetensors files are: names, each tensor, its shape and dtype. Loaded with
`torch.load(weights_only=True)` (only tensors and plain containers are unpickled, never code),
memory-mapped where the file is in PyTorch's zip format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.engine.errors import CheckpointError

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


class TorchBinFile:
    """One `.bin` file with the part of `safetensors.safe_open`'s interface the loader uses."""

    def __init__(self, file: Path) -> None:
        try:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # (a file in the legacy format cannot be mapped)
                state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any reason it cannot be read, named
            raise CheckpointError(f"{file}: not a readable PyTorch weights file ({exc})") from None
        if not isinstance(state, dict) or not all(
            isinstance(t, torch.Tensor) for t in state.values()
        ):
            raise CheckpointError(f"{file}: not a state dict of tensors")
        self.tensors: dict[str, torch.Tensor] = state

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> Any:
        return _Slice(self.tensors[name])


class _Slice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return _SAFETENSORS_DTYPES.get(self.tensor.dtype, str(self.tensor.dtype))
