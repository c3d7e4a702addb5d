"""Optimizer states in host memory (ZeRO-Offload's pattern) under the user's own optimizer.

A parameter the plan offloads (``plan.offload``) lives twice: the program reads a device tensor, and
the module exposes, as the ``nn.Parameter`` the optimizer sees, a copy of it in host memory (pinned on
CUDA, so the copies run at the link's speed). Any torch optimizer then makes its states (Adam's
moments) next to that copy, in host memory, and runs its step there.

- Backward accumulates the gradient on the device; once it is complete (a post-accumulate-grad hook)
  it is copied into the host parameter's ``.grad`` (added to it when the user accumulates over several
  backwards) and the device gradient is freed.
- After the optimizer steps (a global optimizer step hook, and before any forward or state dict whose
  host parameters changed since the last upload) every updated host parameter is copied into its
  device tensor.

On CPU processes host and device are the same memory: the copies are plain copies, which is how the
offloaded program is tested on gloo.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.runtime.zero import after_optimizer_steps


@dataclass
class HostState:
    fqn: str
    device: torch.Tensor        # the local tensor under the parameter's layout, as the program reads it
    host: nn.Parameter          # its copy in host memory, what the optimizer steps


def split(local: torch.Tensor, requires_grad: bool) -> tuple[torch.Tensor, nn.Parameter]:
    """(the local tensor as a device autograd leaf, its copy in host memory as the parameter)."""
    device = local.detach().clone().requires_grad_(requires_grad)
    if local.is_meta:
        host = torch.empty_like(local, device="meta")
    else:
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.is_cuda)
        host.copy_(local.detach())
    return device, nn.Parameter(host, requires_grad=requires_grad)


class HostStates:
    def __init__(self, states: list[HostState]):
        self.states = states
        self._ids = {id(s.host) for s in states}
        for s in states:
            if s.device.requires_grad:
                s.device.register_post_accumulate_grad_hook(self._download_hook(s))
        self.mark_uploaded()
        after_optimizer_steps(self, "upload")

    @staticmethod
    def _download_hook(s: HostState):
        def download(device):
            if device.grad is None:
                return
            if s.host.grad is None:
                s.host.grad = device.grad.to(s.host.device, copy=True)
            else:
                s.host.grad.add_(device.grad.to(s.host.device))
            device.grad = None
        return download

    def upload(self) -> None:
        """Copy every host parameter into its device tensor."""
        with torch.no_grad():
            for s in self.states:
                s.device.detach().copy_(s.host.detach())
        self.mark_uploaded()

    def download(self) -> None:
        """Copy every device tensor into its host parameter (after loading weights into the device)."""
        with torch.no_grad():
            for s in self.states:
                s.host.detach().copy_(s.device.detach())
        self.mark_uploaded()

    def sync(self) -> None:
        """Upload if any host parameter changed since the last upload (an optimizer without step hooks,
        a manual edit)."""
        if any(s.host._version != self._seen[id(s.host)] for s in self.states):
            self.upload()

    def mark_uploaded(self) -> None:
        self._seen = {id(s.host): s.host._version for s in self.states}
