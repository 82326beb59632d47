"""Encrypt a model's state dict into one AES-256-GCM file (safetensors inside, no pickle) and load it back.

    python examples/scripts/encrypt_state_dict.py OUT_DIR
"""

import sys
from pathlib import Path

import torch

from securetrain.crypto import LocalKeyring, open_tensors, seal_tensors

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
keyring = LocalKeyring.create()  # in production: LocalKeyring.load(path) or VaultTransitProvider
sealed = seal_tensors(model.state_dict(), Path(sys.argv[1]) / "model.stenc", keyring)
print(f"sealed {sealed.tensor_count} tensors under {sealed.key_id}: sha256 {sealed.sha256}")

opened = open_tensors(sealed.path, keyring, expect_sha256=sealed.sha256)
restored = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
restored.load_state_dict(opened.tensors)
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored.state_dict().values()))
print("restored the model from", opened.path)
