"""The base of every stats record a loss returns: frozen, detached, read with one device sync."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class Stats:
    """Fields are 0-d detached tensors, so building the record never waits on the device.

    `as_floats()` turns them into Python floats for a metric sink, with one sync for all fields.
    """

    def as_floats(self) -> dict[str, float]:
        names = [f.name for f in fields(self)]
        if not names:
            return {}
        # One device sync for the whole record instead of one `.item()` per field.
        # (Fields of one record live on one device; stack there, copy once.)
        values = torch.stack([torch.as_tensor(getattr(self, n)).detach().to(torch.float64).reshape(())
                              for n in names])
        return dict(zip(names, values.tolist(), strict=True))
