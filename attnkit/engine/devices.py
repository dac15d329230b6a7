"""Which devices a run uses, and one model replica per device.

`devices` (`--devices`) takes "all" (every visible GPU, else the CPU), or a comma-separated list such as
"cuda:0,cuda:1".
The CPU can be named more than once ("cpu,cpu"): each entry is a replica with its own thread, which is how the
multi-device path is tested on machines without GPUs.
"""
from __future__ import annotations

import collections
import copy
from collections.abc import Sequence

import torch

from ..errors import AttnkitError, arg
from ..models import resolve_device, runtime_of


def parse_devices(spec: str | None) -> list[torch.device]:
    """Devices from "all", "cuda:0,cuda:1", "cpu,cpu", … (None: the default device alone; an empty string is
    refused, not taken for the default)."""
    if spec is None:
        return [resolve_device(None)]
    if not str(spec).strip():
        raise AttnkitError(f"{arg('devices')} is empty: name the devices (e.g. cuda:0,cuda:1, or all)")
    spec = str(spec).strip()
    if spec == "all":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise AttnkitError(f"empty entry in {arg('devices')} {spec!r}; write e.g. cuda:0,cuda:1")
        dev = resolve_device(part)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if dev.index >= torch.cuda.device_count():
                raise AttnkitError(f"device {part!r} does not exist: this machine has {torch.cuda.device_count()} "
                                   "GPU(s)")
            if dev in out:
                raise AttnkitError(f"device {part!r} is listed twice in {arg('devices')}")
        out.append(dev)
    return out


def replicate(model, devices: list[torch.device]) -> list:
    """`model` (instrumented) followed by instrumented copies on the other devices; the first device is the
    model's own (it is moved there if needed)."""
    first = devices[0]
    if next(model.parameters()).device != first:
        model.to(first)
    out = [model]
    for dev in devices[1:]:
        # a deep copy is instrumented already, with a Runtime of its own shared by its own modules
        clone = copy.deepcopy(model).to(dev).eval()
        assert runtime_of(clone) is not runtime_of(model)
        out.append(clone)
    return out


def device_labels(devices: Sequence[torch.device]) -> list[str]:
    """"cuda:0", "cuda:1", … — and "cpu#0", "cpu#1" when a device hosts more than one replica."""
    names = [str(d) for d in devices]
    counts = collections.Counter(names)
    seen: collections.Counter = collections.Counter()
    out = []
    for n in names:
        out.append(f"{n}#{seen[n]}" if counts[n] > 1 else n)
        seen[n] += 1
    return out
