"""A long run on 2 gloo ranks: 200 AdamW steps of a small GPT, where live memory after each step stops
growing once the optimizer state exists (MemTracker), and every step runs the same collectives the
same number of times."""
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed_utils import run_distributed

STEPS, WARMUP = 200, 3


class _CountCollectives(TorchDispatchMode):
    """Counts every c10d collective op dispatched, by op name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d", "_c10d_functional_autograd"):
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _long_run(rank, world):
    from torch.distributed._tools.mem_tracker import MemTracker

    import autopar
    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq=16))
    ids = torch.randint(0, 64, (4, 8))
    labels = ids.clone()
    # Data x tensor split, so that every step runs collectives of several kinds.
    pins = {"input_ids": ["S(0)"], "labels": ["S(0)"], "*.fc1.weight": ["S(0)"], "*.fc2.weight": ["S(1)"]}
    pm = autopar.compile(model, autopar.ClusterSpec.local_cpu(world), (ids,), {"labels": labels}, pins=pins)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(pm, opt)
    live, per_step = [], []
    with tracker:
        for _ in range(STEPS):
            counter = _CountCollectives()
            with counter:
                pm.train_step(ids, labels=labels)
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()
            live.append(tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"])
            per_step.append(counter.counts)
    state = sum(p.numel() * p.element_size() * 3 for p in pm.parameters())      # parameters + Adam's two
    assert live[WARMUP] >= state, (live[WARMUP], state)
    assert max(live[WARMUP:]) == live[WARMUP], \
        f"live memory grows after step {WARMUP}: {live[WARMUP]} -> max {max(live[WARMUP:])} bytes"
    assert per_step[0] and sum(per_step[0].values()) > 0, per_step[0]
    changed = [i for i, c in enumerate(per_step) if c != per_step[0]]
    assert not changed, f"step {changed[0]} runs {dict(per_step[changed[0]])}, step 0 ran {dict(per_step[0])}"


def test_two_hundred_steps_hold_memory_and_collectives_constant():
    run_distributed(_long_run, 2, timeout=600)
