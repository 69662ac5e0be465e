"""Single-process, multi-device data parallelism (torch.nn.DataParallel's recipe) and central storage.

One process drives several devices (here several CPU "devices", which may all be ``cpu``): per call it

1. scatters the input batch along dim 0 into one chunk per device,
2. replicates the module: each replica is the module run with its parameters copied to that device
   (``Tensor.to`` is differentiable, so each replica's parameter gradient flows back to the original),
3. applies the replicas in parallel threads,
4. gathers the outputs onto the first device (``torch.cat``), and
5. on backward, autograd sums the replicas' gradients into the original parameters on the first
   device: the gradient reduction to device 0.

``variable_device`` places the variables elsewhere (TensorFlow's CentralStorageStrategy: variables on
the host, compute replicated on the devices, gradients aggregated on the host). No process group.
``ddp.mode = "dataparallel"`` / ``"central-storage"`` (``tessera.train.dp_modes.single_process``) is this
wrapper in the trainer.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.func import functional_call


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, devices: list[str | torch.device], variable_device=None):
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        self.module = module.to(variable_device or self.devices[0])
        self._pool = ThreadPoolExecutor(max_workers=len(self.devices))

    def replicate(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This device's view of every parameter and buffer (a differentiable copy)."""
        state = dict(self.module.named_parameters())
        state.update(dict(self.module.named_buffers()))
        return {n: t.to(device) for n, t in state.items()}

    def no_sync(self):
        """The wrapped module's (a master-weight engine's: reduce once per step), or nothing to hold back."""
        return self.module.no_sync() if hasattr(self.module, "no_sync") else contextlib.nullcontext()

    def forward(self, x_B: torch.Tensor) -> torch.Tensor:
        chunks = x_B.tensor_split(len(self.devices))  # [B/n, ...] per device (first ones 1 larger)
        pairs = [(c.to(d), d) for c, d in zip(chunks, self.devices) if len(c)]

        def run(pair):
            chunk, device = pair
            return functional_call(self.module, self.replicate(device), (chunk,))

        outs = list(self._pool.map(run, pairs))
        return torch.cat([o.to(self.devices[0]) for o in outs])


def central_storage(module: nn.Module, devices: list[str | torch.device], host="cpu") -> DataParallel:
    """Variables on the host, compute replicated on ``devices``, gradients summed on the host."""
    return DataParallel(module, devices, variable_device=host)
