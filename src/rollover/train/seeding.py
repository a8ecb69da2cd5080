"""Seeds and deterministic kernels, set the same way in the driver and in every trainer process."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def use_deterministic_kernels() -> None:
    """`train.deterministic`: the same bits on every run, process-wide. cuBLAS reads its
    workspace setting when it starts (a process that used cuBLAS before keeps its own);
    the flash and memory-efficient attention backward passes accumulate with atomics, so
    attention falls back to the math backend."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
