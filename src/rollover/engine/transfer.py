"""Host <-> device copies that let a GPU run ahead of the Python driving it.

A plain `torch.tensor(values, device="cuda")` or `tensor.tolist()` waits until the device has
finished everything queued: on an H100 a graphed decode step of TorchEngine waited so about 8
times a step (412 `cudaStreamSynchronize` calls in 48 profiled steps, docs/benchmarks.md, "Decode
on a GPU"), and each wait leaves the GPU idle while Python prepares the next launch. Here the
inputs go through page-locked memory without a wait (PyTorch's caching host allocator keeps that
memory until its copy has run), and a step's outputs come back in one wait. On a CPU both are
plain tensor operations.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python numbers (or a CPU tensor) on `device`, queued behind the device's work
    instead of waiting for it."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's values as Python lists, after a single wait for the device."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]  # into page-locked memory
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [t.tolist() for t in host]
