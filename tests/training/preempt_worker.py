"""Child process for the SIGTERM test: trains a tiny MLP, prints ``step N`` after every step.

Usage: python preempt_worker.py OUTDIR FINAL_WEIGHTS [--pause-at K]
With --pause-at K it sleeps after reporting step K so the parent's SIGTERM lands mid-training at a
known step (the signal handler only sets a flag; the step in flight still completes).
Exits with the trainer's exit code (75 when preempted).
"""

from __future__ import annotations

import sys
import time

import torch
from safetensors.torch import save_file

from securetrain.training import TrainerCallback, Trainer, TrainingConfig
from securetrain.training.synthetic import SyntheticClassification, make_mlp


class Report(TrainerCallback):
    def __init__(self, pause_at: int | None) -> None:
        self.pause_at = pause_at

    def on_step(self, trainer, metrics):  # noqa: ANN001
        print(f"step {metrics.step}", flush=True)
        if metrics.step == self.pause_at:
            deadline = time.monotonic() + 30  # parent sends SIGTERM now
            while not trainer.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)


def main() -> int:
    out, final = sys.argv[1], sys.argv[2]
    pause_at = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--pause-at" else None
    torch.set_num_threads(1)
    data = SyntheticClassification(samples=96, features=12, classes=3, seed=7)
    model = make_mlp(12, 3, hidden=32, dropout=0.2, seed=3)
    cfg = TrainingConfig(
        epochs=3, batch_size=8, grad_accumulation=2, lr=3e-3, seed=11, log_every=1, output_dir=out, keep_last=2
    )
    result = Trainer(model, data, cfg, callbacks=[Report(pause_at)]).fit()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, final)
    print(f"done {result.reason} {result.steps}", flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
