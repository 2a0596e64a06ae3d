"""`flintc.runtime.hostsync.forbid_host_sync`: each kind of host sync or graph-illegal
operation it is meant to catch raises, capturable work passes, and everything it
patched is restored afterwards."""

from __future__ import annotations

import pytest
import torch

from flintc.runtime.hostsync import HostSyncError, forbid_host_sync

x = torch.arange(6.0)
i = torch.tensor([2, 0])
SYNCS = {
    "item": lambda: x.sum().item(),
    "int": lambda: int(x[0]),
    "if tensor": lambda: bool(x.max() > 1),
    "tolist": lambda: i.tolist(),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "nonzero": lambda: torch.nonzero(x > 2),
    "where(cond)": lambda: torch.where(x > 2),
    "bool mask": lambda: x[x > 2],
    "bool mask put": lambda: x.clone().__setitem__(x > 2, 0.0),
    "masked_select": lambda: x.masked_select(x > 2),
    "unique": lambda: torch.unique(i),
    "bincount": lambda: torch.bincount(i),
    "repeat_interleave": lambda: torch.repeat_interleave(x[:2], i),
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "to another device": lambda: x.to("meta"),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_each_sync_raises(name):
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            SYNCS[name]()


def test_capturable_work_passes_and_patches_are_undone():
    with forbid_host_sync():
        y = x[i] * 2 + torch.arange(6)[i]  # integer indexing: sizes from shapes only
        z = torch.repeat_interleave(x[:2], i, output_size=2)
        order = torch.argsort(x, stable=True)
        counts = torch.zeros(3, dtype=torch.long).scatter_add_(0, i, torch.ones_like(i))
        torch.searchsorted(torch.cumsum(counts, 0), torch.arange(4), right=True)
        w = torch.where(x > 2, x, 0.0)
    assert y.tolist() == [6.0, 0.0] and z.tolist() == [0.0, 0.0] and order.numel() == 6
    assert w.sum().item() == 12.0 and x.cpu() is x and "tolist" not in torch.Tensor.__dict__
