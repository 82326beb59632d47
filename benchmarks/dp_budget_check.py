"""The DP trainer's per-step budget check vs asking Opacus' RDP accountant directly.

After every optimizer step DPTrainer asks "would one more step exceed target ε?". Opacus'
``RDPAccountant.get_epsilon`` recomputes the RDP curve (fractional orders are slow) on every call;
DPTrainer computes the per-step curve once per (σ, q) and scales it by the step count, which gives
the same number (asserted here). Prints both timings and the ratio.

    python benchmarks/dp_budget_check.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

warnings.simplefilter("ignore")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as rdp_analysis

    sigma, q, delta, steps = 1.1, 0.01, 1e-5, (20 if args.quick else 100)
    acc = RDPAccountant()
    acc.history = [(sigma, q, 1000)]

    t0 = time.perf_counter()
    baseline = []
    for i in range(steps):
        a = copy.deepcopy(acc)
        a.history = [(sigma, q, 1000 + i + 1)]
        baseline.append(a.get_epsilon(delta))
    t_base = time.perf_counter() - t0

    t0 = time.perf_counter()
    curve = rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=acc.DEFAULT_ALPHAS)
    fast = [rdp_analysis.get_privacy_spent(orders=acc.DEFAULT_ALPHAS, rdp=curve * (1000 + i + 1), delta=delta)[0]
            for i in range(steps)]
    t_fast = time.perf_counter() - t0
    assert all(abs(a - b) <= 1e-9 * max(1.0, abs(a)) for a, b in zip(baseline, fast)), "results differ"
    print(f"budget checks: {steps}")
    print(f"opacus get_epsilon per check : {t_base / steps * 1e3:8.2f} ms")
    print(f"cached RDP curve per check   : {t_fast / steps * 1e3:8.2f} ms")
    print(f"ratio (opacus / cached)      : {t_base / t_fast:8.1f}x")


if __name__ == "__main__":
    main()
