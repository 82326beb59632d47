"""Benchmark: CKKS evaluation layouts and parameter choices, each against a baseline in the same run.

    python benchmarks/he_eval.py [--quick]

1. small batch (171 samples, logistic on 30 features): feature-packed (several features per
   ciphertext) vs one ciphertext per feature — end-to-end ms/sample (encrypt + evaluate + decrypt).
2. 30-16-1 MLP (depth 3): parameters searched by choose_params (ring size and scale from the
   calibrated value bound) vs the fixed choice (scale 2^40, 20 integer bits → N=16384).
3. full batch (569 samples): SIMD feature-major vs one ciphertext per sample (dot with rotations).
4. 64-32-16-10 MLP: calibrated value bound vs the worst-case interval bound (no timing).

Data: scikit-learn's bundled breast-cancer set (standardised) and synthetic blobs. The ratios are
what to read, not the absolute times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import best_of  # noqa: E402


def _train(model, x, y, steps=200):  # noqa: ANN001, ANN202
    import torch
    from torch import nn

    torch.manual_seed(0)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)[:, None]
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(xt), yt).backward()
        opt.step()
    return model.eval()


def _best_report(repeat: int, **kwargs):  # noqa: ANN003, ANN202
    from securetrain.he import evaluate_encrypted

    reports = [evaluate_encrypted(**kwargs) for _ in range(repeat)]
    return min(reports, key=lambda r: r.ms_per_sample_end_to_end)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and samples (< 60 s)")
    args = ap.parse_args()
    repeat = 1 if args.quick else 3

    import tenseal as ts
    import torch
    from sklearn.datasets import load_breast_cancer
    from torch import nn

    from securetrain.he import (
        PolyActivation,
        calibrate,
        check_plan_fits,
        choose_params,
        compile_plan,
    )
    from securetrain.he.errors import HEParameterError
    from securetrain.he.strategy import max_abs_bound

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    logistic = _train(nn.Linear(30, 1), x, y)

    # 1. packed vs unpacked small batch ---------------------------------------------------------
    small = slice(0, 171)
    packed = _best_report(repeat, model=logistic, features=x[small], labels=y[small], packing="on")
    unpacked = _best_report(repeat, model=logistic, features=x[small], labels=y[small], packing="off")
    print(f"[1] 171 samples, logistic 30 features, {packed.params['poly_modulus_degree']=}")
    print(f"    packed ({packed.features_per_ciphertext} features/ciphertext): "
          f"{packed.ms_per_sample_end_to_end:.3f} ms/sample end-to-end, {packed.ciphertext_bytes_per_sample:,.0f} B/sample in, "
          f"max |err| {packed.max_abs_error:.1e}")
    print(f"    unpacked (1 feature/ciphertext): {unpacked.ms_per_sample_end_to_end:.3f} ms/sample, "
          f"{unpacked.ciphertext_bytes_per_sample:,.0f} B/sample in, max |err| {unpacked.max_abs_error:.1e}")
    print(f"    ratio unpacked/packed: time x{unpacked.ms_per_sample_end_to_end / packed.ms_per_sample_end_to_end:.1f}, "
          f"input bytes x{unpacked.ciphertext_bytes_per_sample / packed.ciphertext_bytes_per_sample:.1f}")

    # 2. searched vs fixed parameters on a depth-3 MLP ------------------------------------------
    torch.manual_seed(0)
    mlp = _train(nn.Sequential(nn.Linear(30, 16), PolyActivation([0.0, 0.5, 0.1]), nn.Linear(16, 1)), x, y)
    n2 = 256 if args.quick else len(x)
    searched = _best_report(repeat, model=mlp, features=x[:n2], labels=y[:n2])
    fixed = _best_report(repeat, model=mlp, features=x[:n2], labels=y[:n2], params=choose_params(3))
    print(f"[2] MLP 30-16-1 (depth 3), {n2} samples")
    for name, r in (("searched", searched), ("fixed   ", fixed)):
        print(f"    {name}: N={r.params['poly_modulus_degree']} {r.params['coeff_mod_bit_sizes']} "
              f"eval {r.ms_per_sample_eval:.3f} ms/sample, end-to-end {r.ms_per_sample_end_to_end:.3f} ms/sample, "
              f"public context {r.public_context_bytes / 1e6:.1f} MB, max |err| vs exact {r.max_abs_error:.1e}, "
              f"acc {r.accuracy_encrypted:.4f}")
    print(f"    ratio fixed/searched: eval x{fixed.ms_per_sample_eval / searched.ms_per_sample_eval:.1f}, "
          f"end-to-end x{fixed.ms_per_sample_end_to_end / searched.ms_per_sample_end_to_end:.1f}")

    # 3. SIMD feature-major vs one ciphertext per sample ----------------------------------------
    full = _best_report(repeat, model=logistic, features=x, labels=y, packing="off")
    params = choose_params(1)
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, params.poly_modulus_degree, coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes))
    ctx.global_scale = params.scale
    ctx.generate_galois_keys()
    w = logistic.weight.detach().double().numpy()[0].tolist()
    b = float(logistic.bias.detach()[0])
    m = 16 if args.quick else 64

    def per_sample() -> None:
        [(ts.ckks_vector(ctx, x[i].tolist()).dot(w) + b).decrypt() for i in range(m)]

    per_ms = best_of(per_sample, repeat) * 1e3 / m
    print(f"[3] {len(x)} samples: SIMD feature-major {full.ms_per_sample_end_to_end:.3f} ms/sample end-to-end; "
          f"one ciphertext per sample {per_ms:.3f} ms/sample ({m} samples); ratio x{per_ms / full.ms_per_sample_end_to_end:.0f}")

    # 4. calibrated vs worst-case value bound ---------------------------------------------------
    torch.manual_seed(5)
    deep = nn.Sequential(nn.Linear(64, 32), PolyActivation([0.0, 1.0, 0.1]), nn.Linear(32, 16),
                         PolyActivation([0.0, 1.0, 0.1]), nn.Linear(16, 10))
    with torch.no_grad():
        for layer in deep[::2]:
            layer.weight.mul_(3.0)
    plan = compile_plan(deep)
    xs = np.clip(np.random.default_rng(6).normal(size=(2000, 64)), -4, 4)
    t = time.perf_counter()
    cal = calibrate(plan, xs)
    cal_ms = (time.perf_counter() - t) * 1e3
    worst = max_abs_bound(plan, 4.0)
    try:
        check_plan_fits(plan, choose_params(plan.depth), 4.0)
        verdict = "accepted"
    except HEParameterError:
        verdict = "REFUSED"
    print(f"[4] MLP 64-32-16-10 (depth {plan.depth}): calibrated peak {cal.value_abs_max:.0f} (bound "
          f"{cal.value_bound:g}, {cal_ms:.0f} ms for 2000 rows) vs worst case {worst:.3g} ({verdict} at "
          f"{choose_params(plan.depth).describe()}); ratio x{worst / cal.value_abs_max:.0f}; searched params: "
          f"{choose_params(plan.depth, scale_bits=None, integer_bits=None, value_bound=cal.value_bound).describe()}")


if __name__ == "__main__":
    main()
