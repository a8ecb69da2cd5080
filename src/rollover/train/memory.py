"""Memory: micro-batches sized from a budget, and the process's resident memory.

Activation estimate. Training a decoder keeps, per token and layer, what the backward pass
needs: the inputs and outputs of the two norms and of every projection, q/k/v after rotary and
the attention output (about 18 x hidden values in all), the MLP's gate, up, activation and
product (6 x intermediate), and the attention weights of the token's row (heads x row length,
twice: scores and probabilities). The counts are fitted to SmolLM2-135M: the training step's
peak over the resident size grew by 2.2 to 2.8 MB per token between micro-batches of 112 and
896 tokens (`rollover bench memory --skip-half-b --set train.micro_batch_tokens=N`); the
estimate says 2.6. With gradient checkpointing (Hugging Face's) far less should be kept, but
measured on SmolLM2-135M the step's peak per token fell only to about a third of the plain
path's (the recomputed layer, the LM head, what the wrapper keeps), so the estimate is 0.45 x
the plain one there. `micro_batch_tokens_for` turns a budget in GB into tokens per micro-batch
with the estimate; `rollover bench memory` measures what a budget really costs.

Resident memory. glibc's allocator keeps freed heap memory mapped (the training step frees
gigabytes of activations in pieces below its mmap threshold), so a process's resident size
ratchets up step after step unless it is told to return it: `release()` calls `malloc_trim`
(a no-op off glibc). `peak_rss_gb` / `reset_peak` read and restart the kernel's high-water
mark (Linux), which `rollover bench memory` uses to attribute the peak to phases.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_VALUES_PER_LAYER_HIDDEN = 18  # norm inputs and outputs, q/k/v/o inputs and outputs, rotary, residuals (x hidden)
_VALUES_PER_LAYER_MLP = 6  # gate, up, act(gate) and its input, act(gate) * up, down's input (x intermediate)
_CHECKPOINTED_SHARE = 0.45  # measured, SmolLM2-135M (see the module docstring)


def activation_bytes_per_token(config, row_length: int, checkpointing: bool, dtype_bytes: int = 4) -> int:
    """Estimated bytes of saved activations per trained token (see the module docstring); a
    vision-language model's by its language model (its images' tokens are a row's tokens too)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", None) or 4 * h  # GPT-2's n_inner may be None
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    one_layer = _VALUES_PER_LAYER_HIDDEN * h + _VALUES_PER_LAYER_MLP * inter + 2 * heads * row_length
    plain = dtype_bytes * layers * one_layer
    return int(_CHECKPOINTED_SHARE * plain) if checkpointing else plain


def micro_batch_tokens_for(config, budget_gb: float, pack_length: int, checkpointing: bool) -> int:
    """Tokens per micro-batch whose estimated activations fit `budget_gb`, rounded down to whole
    rows of `pack_length` and never below one row."""
    per_token = activation_bytes_per_token(config, pack_length, checkpointing)
    rows = int(budget_gb * 1e9 // (per_token * pack_length))
    return max(1, rows) * pack_length


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lib if hasattr(lib, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def large_blocks_from_the_heap() -> bool:
    """Serve large blocks from the heap and let `free` keep them there, process-wide (glibc;
    `ROLLOVER_MALLOC_DEFAULTS=0` leaves the allocator as it is). Returns whether it was done.

    glibc gives every block above its mmap threshold a fresh mapping and unmaps it on free: each
    micro-batch's [tokens, vocab] logits and their gradients, each update's gradient tensors, the
    engine's K/V cache. Each one is page-faulted in and zeroed by the kernel again. A training step
    of SmolLM2 on 2 cores faulted about 500,000 pages this way. With these settings the
    blocks come from the heap, and a freed one is reused without a fault until `release()` hands
    the free heap back after the step. Nothing stays resident that `release()` would have freed."""
    if _LIBC is None or not hasattr(_LIBC, "mallopt") or os.environ.get("ROLLOVER_MALLOC_DEFAULTS", "1") == "0":
        return False
    return bool(_LIBC.mallopt(_M_MMAP_MAX, 0)) and bool(_LIBC.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release() -> None:
    """Hand the allocator's free heap memory back to the OS (glibc; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _status(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def rss_gb() -> float | None:
    """Resident memory now, in GB (Linux; None elsewhere)."""
    return _status("VmRSS")


def peak_rss_gb() -> float | None:
    """The resident high-water mark since the start or the last `reset_peak`, in GB."""
    return _status("VmHWM")


def reset_peak() -> bool:
    """Restart the high-water mark at the current resident size (Linux); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
