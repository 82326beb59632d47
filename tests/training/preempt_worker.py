"""Child process for the SIGTERM test: trains a tiny MLP, prints ``step N`` after every step.

Usage: python preempt_worker.py OUTDIR FINAL_WEIGHTS [--pause-at K]
With --pause-at K it sleeps after reporting step K so the parent's SIGTERM lands mid-training at a
known step (the signal handler only sets a flag; the step in flight still completes).
With --hang-after-stop the step at K keeps running after the stop request (a long step), so a
second signal lands while the first one is still being honoured.
Exits with the trainer's exit code (75 when preempted by SIGTERM, 130 after Ctrl-C).
"""

from __future__ import annotations

import sys
import time

import torch
from safetensors.torch import save_file

from securetrain.training import Trainer, TrainerCallback, TrainingConfig
from securetrain.training.synthetic import SyntheticClassification, make_mlp


class Report(TrainerCallback):
    def __init__(self, pause_at: int | None, hang_after_stop: bool = False) -> None:
        self.pause_at = pause_at
        self.hang_after_stop = hang_after_stop

    def on_step(self, trainer, metrics):  # noqa: ANN001
        print(f"step {metrics.step}", flush=True)
        if metrics.step == self.pause_at:
            deadline = time.monotonic() + 30  # parent sends SIGTERM now
            while not trainer.stop_requested and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.hang_after_stop:
                print("stop requested", flush=True)
                time.sleep(30)  # a long step: only a second Ctrl-C ends it early


def main() -> int:
    out, final = sys.argv[1], sys.argv[2]
    pause_at = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--pause-at" else None
    hang = "--hang-after-stop" in sys.argv
    torch.set_num_threads(1)
    data = SyntheticClassification(samples=96, features=12, classes=3, seed=7)
    model = make_mlp(12, 3, hidden=32, dropout=0.2, seed=3)
    cfg = TrainingConfig(
        epochs=3, batch_size=8, grad_accumulation=2, lr=3e-3, seed=11, log_every=1, output_dir=out, keep_last=2
    )
    result = Trainer(model, data, cfg, callbacks=[Report(pause_at, hang)]).fit()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, final)
    print(f"done {result.reason} {result.steps}", flush=True)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
