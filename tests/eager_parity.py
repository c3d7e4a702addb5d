"""The correctness test of every plan kind: a compiled model trained beside single-device eager."""
from __future__ import annotations

import copy

import torch

STEPS, LR = 3, 1e-3


def full_gradient(pm, fqn: str, block: torch.Tensor | None = None) -> torch.Tensor:
    """The whole gradient of parameter ``fqn``, gathered from the ranks' blocks of its state layout:
    ``block`` on this rank (a gradient ``torch.autograd.grad`` returned), else the parameter's ``.grad``."""
    from torch.distributed.tensor import DTensor

    block = pm.local_parameter(fqn).grad if block is None else block
    placements = [x.to_dtensor() for x in pm.state_layout(fqn)]
    return DTensor.from_local(block, pm.mesh, placements, run_check=False).full_tensor()


def train_and_compare(pm, ref, ids, labels, where: str, *, gradient=full_gradient, call=None):
    """Train ``pm`` and its eager twin ``ref`` ``STEPS`` AdamW steps side by side: the losses of every
    step equal (relative 1e-5), the first step's gradients within 1e-5 of the model's largest entry,
    and the parameters after the last step within 1e-4, read back whole through ``full_state_dict``
    (which must hold every name of ``ref``'s state dict and load into it strictly). Returns ``pm``'s
    optimizer.

    ``gradient(pm, fqn)``: a parameter's whole gradient, or None for one this rank does not hold (a
    pipeline's other stages). ``call(model)``: the loss to train on, in place of ``model(ids,
    labels=labels).loss`` (``pm``'s through ``train_step``)."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        if call is None:
            loss = pm.train_step(ids, labels=labels)
            ref_loss = ref(ids, labels=labels).loss
            ref_loss.backward()
        else:
            loss, ref_loss = call(pm), call(ref)
            loss.backward(), ref_loss.backward()
        assert torch.allclose(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0), \
            f"{where}: step {step} loss {loss.item()} vs eager {ref_loss.item()}"
        if step == 0:
            scale = max(p.grad.abs().max().item() for p in ref_params.values())
            for fqn, p in ref_params.items():
                grad = gradient(pm, fqn)
                if grad is None:
                    continue
                err = (grad - p.grad).abs().max().item()
                assert err <= 1e-5 * scale, f"{where}: gradient of {fqn} off by {err} (largest entry {scale})"
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    full = pm.full_state_dict()
    assert set(full) == set(ref.state_dict()), where      # tied names and persistent buffers too
    copy.deepcopy(ref).load_state_dict(full)               # strict
    for fqn, p in ref_params.items():
        err = (full[fqn] - p.detach()).abs().max().item()
        assert err <= 1e-4, f"{where}: parameter {fqn} differs by {err} after {STEPS} steps"
    return opt
