"""Benchmark: SIMD-packed (feature-major) CKKS evaluation vs one ciphertext per sample.

    python benchmarks/he_eval.py [--quick]

Model: logistic regression (30 features, breast-cancer data, standardised). Both strategies run in
the same process on the same machine; the ratio is what to read, not the absolute times.
Also reports the max error vs plaintext and the effect of the scale compensation on an MLP.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small per-sample subset (< 60 s)")
    args = ap.parse_args()

    import tenseal as ts
    import torch
    from sklearn.datasets import load_breast_cancer
    from torch import nn

    from securetrain.he import DataOwner, Evaluator, PolyActivation, choose_params, compile_plan

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    torch.manual_seed(0)
    model = nn.Linear(30, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)[:, None]
    for _ in range(200):
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(xt), yt).backward()
        opt.step()
    plan = compile_plan(model)
    ref = plan.evaluate_plain(x)[:, 0]
    n = len(x)

    # --- SIMD packed: one ciphertext per feature, samples in slots -----------------------------
    params = choose_params(plan.depth)
    owner = DataOwner(params)
    ev = Evaluator(owner.public_context())
    t0 = time.perf_counter()
    bundle = owner.encrypt(x)
    t1 = time.perf_counter()
    out = ev.evaluate(plan, bundle)
    t2 = time.perf_counter()
    simd = owner.decrypt(out, decimals=8)[:, 0]
    t3 = time.perf_counter()
    simd_eval = (t2 - t1) * 1e3 / n
    simd_e2e = (t3 - t0) * 1e3 / n

    # --- baseline: one ciphertext per sample, dot product with rotations -------------------------
    m = 16 if args.quick else 64
    ctx = ts.context(ts.SCHEME_TYPE.CKKS, params.poly_modulus_degree, coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes))
    ctx.global_scale = params.scale
    ctx.generate_galois_keys()
    w = model.weight.detach().double().numpy()[0].tolist()
    b = float(model.bias.detach()[0])
    t0 = time.perf_counter()
    cts = [ts.ckks_vector(ctx, x[i].tolist()) for i in range(m)]
    t1 = time.perf_counter()
    res = [c.dot(w) + b for c in cts]
    t2 = time.perf_counter()
    per = np.array([r.decrypt()[0] for r in res])
    t3 = time.perf_counter()
    per_eval = (t2 - t1) * 1e3 / m
    per_e2e = (t3 - t0) * 1e3 / m

    print(f"params: {params.describe()}")
    print(f"SIMD packed   : eval {simd_eval:.4f} ms/sample, end-to-end {simd_e2e:.4f} ms/sample "
          f"({n} samples), max |err| {np.abs(simd - ref).max():.2e}")
    print(f"per-sample    : eval {per_eval:.4f} ms/sample, end-to-end {per_e2e:.4f} ms/sample "
          f"({m} samples), max |err| {np.abs(per - ref[:m]).max():.2e}")
    print(f"speed-up (per-sample / SIMD): eval x{per_eval / simd_eval:.1f}, end-to-end x{per_e2e / simd_e2e:.1f}")
    print(f"sizes: public context {len(owner.public_context()):,} B, secret context {len(owner.secret_context()):,} B, "
          f"input ciphertexts {len(bundle) / n:,.0f} B/sample at {n}/{params.slots} slots used "
          f"({len(bundle) / params.slots:,.0f} B/sample when full)")

    # --- scale compensation on a depth-3 MLP ------------------------------------------------------
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(30, 8), PolyActivation([0.0, 0.5, 0.125]), nn.Linear(8, 1))
    mplan = compile_plan(mlp)
    xs = x[: 64 if args.quick else n]
    mref = mplan.evaluate_plain(xs)
    mowner = DataOwner(choose_params(mplan.depth))
    mev = Evaluator(mowner.public_context())
    enc = mowner.encrypt(xs)
    err_on = np.abs(mowner.decrypt(mev.evaluate(mplan, enc), decimals=8) - mref).max()
    mev._ratio = lambda level: 1.0  # what plain TenSEAL does
    err_off = np.abs(mowner.decrypt(mev.evaluate(mplan, enc), decimals=8) - mref).max()
    print(f"MLP 30-8-1 (depth {mplan.depth}): max |err| with scale compensation {err_on:.2e}, without {err_off:.2e} "
          f"(x{err_off / err_on:.0f})")


if __name__ == "__main__":
    main()
