"""Score a logistic model on CKKS-encrypted rows: the evaluator never holds the secret key.

    python examples/scripts/he_evaluate.py
"""

import torch

from securetrain.he import evaluate_encrypted

torch.manual_seed(0)
features = torch.randn(64, 10)
labels = (features[:, 0] + 0.5 * features[:, 1] > 0).long()
model = torch.nn.Linear(10, 1)  # a trained head would come from your checkpoint
with torch.no_grad():
    model.weight.copy_(torch.tensor([[2.0, 1.0] + [0.0] * 8]))
    model.bias.zero_()

report = evaluate_encrypted(model, features, labels)
print(report)
