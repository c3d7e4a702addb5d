"""Training step time and peak memory on one CUDA GPU, side by side in one run: eager PyTorch,
torch.compile, and autopar's one-device plan with the ATen and the Triton kernel backends; each
autopar row also prints the plan's predicted step time and peak beside the measured ones.

    python bench/train_gpu.py [--models gpt2,llama] [--steps 10] [--batch 8] [--seq 1024]

Models are Hugging Face GPT-2 (12 layers, d 768, vocab 50304) and a LLaMA (8 layers, d 1024, 16 heads,
4 KV heads, vocab 32000), random weights, fp32 parameters with TF32 matmuls, AdamW. Step time is the
median of --steps steps after 3 warm-up steps; memory is `torch.cuda.max_memory_allocated` over
training steps after the first (parameters, gradients and Adam states included), the model's output
held through backward. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import traceback

# This folder's kernels.py (the Triton kernel bench) would shadow the `kernels` package transformers imports.
sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import torch


def build(name: str):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50304, n_positions=1024,
                                      use_cache=False, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                       num_key_value_heads=4, intermediate_size=2816, vocab_size=32000,
                                       max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}; use gpt2 or llama")


def measure(model, ids, steps):
    """(median step seconds, peak bytes allocated) of AdamW training steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        # The caller holds the outputs (the logits) through backward: the step the memory model predicts
        # (docs/cost-model.md), and how a loop that keeps ``out`` for logging runs.
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/train_gpu.py measures training on a CUDA GPU; none is available here.")
        return 0
    import autopar

    for var, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(var, value)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cluster = autopar.ClusterSpec.from_env()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; cluster {cluster.name}; "
          f"fp32 parameters, TF32 matmuls, AdamW, batch {args.batch} x {args.seq}")
    header = (f"{'model':6} {'system':15} {'step ms':>9} {'vs eager':>9} {'peak GiB':>9} "
              f"{'pred ms':>9} {'pred GiB':>9} {'meas/pred mem':>13}")
    print(header)
    print("-" * len(header))
    for name in [m for m in args.models.split(",") if m]:
        torch.manual_seed(0)
        base = build(name)
        vocab = base.config.vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
        systems = {
            "eager": lambda: copy.deepcopy(base).cuda(),
            "torch.compile": lambda: torch.compile(copy.deepcopy(base).cuda()),
            "autopar aten": lambda: autopar.compile(copy.deepcopy(base), cluster, (ids,), {"labels": ids.clone()},
                                                    kernels="aten", sharded_outputs=True),
            "autopar triton": lambda: autopar.compile(copy.deepcopy(base), cluster, (ids,), {"labels": ids.clone()},
                                                      kernels="triton", sharded_outputs=True),
        }
        eager_s = None
        for system, make in systems.items():
            try:
                model = make()
                seconds, peak = measure(model, ids, args.steps)
            except Exception as exc:  # one failing system must not hide the others' figures
                print(f"{name:6} {system:15} failed: {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc()
                continue
            eager_s = seconds if system == "eager" else eager_s
            plan = getattr(model, "plan", None)
            pred = (f"{plan.step_time * 1e3:9.1f} {plan.memory['peak'] / 2**30:9.2f} "
                    f"{peak / plan.memory['peak']:13.2f}") if plan is not None else ""
            ratio = seconds / eager_s if eager_s else float("nan")
            print(f"{name:6} {system:15} {seconds * 1e3:9.1f} {ratio:9.2f} {peak / 2**30:9.2f} {pred}", flush=True)
            del model
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
