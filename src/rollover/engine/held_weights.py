"""What both decoder runners (`ModelRunner`, `HFRunner`) do with the weights they hold: check a
weight update's names and shapes before copying anything, free the weights' memory while a
colocated rank trains and give it back, and lend a trainer their tensors (one copy in sync
mode)."""

from __future__ import annotations

import torch


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of the same memory, laid out alike (a lent weight is copied
    onto itself otherwise)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def check_named(views: dict[str, torch.Tensor], named_tensors, skip: tuple[str, ...] = ()) -> list:
    """The named tensors of a weight update as (name, tensor), names without a wrapper's prefix;
    ValueError for an unknown name or a wrong shape, before anything is copied (`skip`: names
    taken and not checked, such as a tied head)."""
    items = [(k.removeprefix("_orig_mod.").removeprefix("module."), v) for k, v in named_tensors]
    for name, t in items:
        if name in skip:
            continue
        if name not in views:
            raise ValueError(f"update_weights: unknown weight {name!r}")
        if tuple(t.shape) != tuple(views[name].shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(t.shape)}, expected {tuple(views[name].shape)}")
    return items


def free_storage(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Shrink each tensor's storage to nothing (`release_weights`); (tensor, bytes) to restore."""
    released = [(t, t.untyped_storage().nbytes()) for t in tensors]
    for t in tensors:
        t.untyped_storage().resize_(0)
    return released


def restore_storage(released: list[tuple[torch.Tensor, int]]) -> None:
    """Room again for the tensors `free_storage` emptied (their values are loaded after)."""
    for t, nbytes in released:
        t.untyped_storage().resize_(nbytes)


def lend_views(views: dict[str, torch.Tensor], model, missing: set[str]) -> int:
    """`model`'s parameters rebound to the engine's tensors of the same names (`lend_weights`),
    after checking each one's shape, dtype, device and values; the bytes no longer held twice."""
    params = list(model.named_parameters())
    for name, param in params:
        view = views.get(name.removeprefix("_orig_mod."))
        if view is None or view.shape != param.shape or view.dtype != param.dtype or view.device != param.device:
            raise ValueError(f"lend_weights: the engine has no {param.dtype} weight of shape {tuple(param.shape)} "
                             f"on {param.device} named {name!r}")
        if not torch.equal(view, param.detach()):
            raise ValueError(f"lend_weights: {name!r} holds other values than the engine's weight")
    if missing:
        raise RuntimeError(f"lend_weights: the engine's weights are released ({min(missing)!r} missing)")
    with torch.no_grad():
        for name, param in params:
            param.data = views[name.removeprefix("_orig_mod.")]
    return sum(param.numel() * param.element_size() for _, param in params)
