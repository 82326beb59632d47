"""Engine overhead: Trainer step time vs. a bare PyTorch loop doing the same math.

Both sides train the same MLP on the same in-memory data with the same DataLoader batch size,
AdamW, cross-entropy and grad-norm clipping (the engine's defaults), no checkpoints, on CPU. Runs
are interleaved (bare, engine, bare, engine, ...) so drifting machine load hits both equally, and
we report the ratio of medians of per-step time. Goal: ratio <= 1.05.

    python benchmarks/training_overhead.py [--quick] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from securetrain.training import Trainer, TrainingConfig
from securetrain.training.synthetic import SyntheticClassification, make_mlp

FEATURES, CLASSES, HIDDEN, BATCH = 256, 10, 512, 128


def bare_loop(data: SyntheticClassification, steps: int, device: torch.device) -> float:
    model = make_mlp(FEATURES, CLASSES, hidden=HIDDEN, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=g)
    params = list(model.parameters())
    done = 0
    t0 = time.perf_counter()
    while done < steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                break
    float(loss.item())  # one final sync, like the engine's last log
    return (time.perf_counter() - t0) / steps


def engine(data: SyntheticClassification, steps: int, device: str, out: str) -> float:
    model = make_mlp(FEATURES, CLASSES, hidden=HIDDEN, seed=0)
    cfg = TrainingConfig(
        epochs=None, max_steps=steps, batch_size=BATCH, lr=1e-3, precision="fp32", device=device,
        output_dir=out, checkpoint_at_end=False, resume=False, log_every=50,
    )
    trainer = Trainer(model, data, cfg)
    t0 = time.perf_counter()
    trainer.fit()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter repetitions (< 60 s)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    steps, reps = (60, 5) if args.quick else (200, 9)
    data = SyntheticClassification(samples=BATCH * 16, features=FEATURES, classes=CLASSES, seed=0)
    from securetrain.devices import resolve_backend

    dev = resolve_backend(args.device).device()
    bare, eng = [], []
    with tempfile.TemporaryDirectory() as out:
        bare_loop(data, 10, dev)  # warm-up both paths (allocator, kernels, imports)
        engine(data, 10, args.device, out)
        for i in range(reps):
            if i % 2 == 0:  # alternate who goes first, too
                bare.append(bare_loop(data, steps, dev))
                eng.append(engine(data, steps, args.device, out))
            else:
                eng.append(engine(data, steps, args.device, out))
                bare.append(bare_loop(data, steps, dev))
    b, e = statistics.median(bare), statistics.median(eng)
    print(f"device={dev} steps/run={steps} reps={reps} threads={torch.get_num_threads()}")
    print(f"bare loop : {b * 1e3:8.3f} ms/step (median)")
    print(f"engine    : {e * 1e3:8.3f} ms/step (median)")
    ratio = e / b
    print(f"ratio engine/bare = {ratio:.3f}  (goal <= 1.05: {'OK' if ratio <= 1.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
