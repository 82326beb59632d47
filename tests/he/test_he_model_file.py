"""Model files for the CLI (``save_sequential`` / ``load_sequential``): every layer the library
evaluates goes through the file, and the loader refuses anything it does not know."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from securetrain.he.errors import HEFormatError, HEModelError, HEUnsupportedLayerError
from securetrain.he.model_io import META_KEY, load_sequential, model_bytes, save_sequential
from securetrain.he.modules import Square
from securetrain.he.plan import compile_plan, reference_forward


class UserNet(nn.Module):
    """A user's model: BatchNorm1d on the inputs and after the first layer, Dropout, Flatten."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.bn_in = nn.BatchNorm1d(6)
        self.fc1 = nn.Linear(6, 5)
        self.bn1 = nn.BatchNorm1d(5, eps=1e-3)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.bn1(self.fc1(self.bn_in(self.flat(x))))))


def user_net(seed: int = 0) -> UserNet:
    """Trained a little, so the running statistics are not the defaults (0 mean, 1 variance)."""
    torch.manual_seed(seed)
    net = UserNet()
    with torch.no_grad():
        for _ in range(5):
            net(torch.randn(64, 6) * 3 + 1)  # training mode: updates the running statistics
        net.bn1.weight.uniform_(0.5, 2.0)
        net.bn1.bias.uniform_(-1.0, 1.0)
    return net.eval()


def _x(n: int = 40, d: int = 6) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(n, d)) * 3 + 1


def _layers(path) -> list[dict]:  # noqa: ANN001
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return json.loads(header["__metadata__"][META_KEY])["layers"]


def test_user_model_with_batchnorm_dropout_flatten_round_trips(tmp_path) -> None:  # noqa: ANN001
    net = user_net()
    path = tmp_path / "net.safetensors"
    sha = save_sequential(net, path)
    assert [s["type"] for s in _layers(path)] == ["Flatten", "BatchNorm1d", "Linear", "BatchNorm1d", "Dropout", "Linear"]
    loaded, sha2 = load_sequential(path)
    assert sha == sha2 and not loaded.training
    x = _x()
    with torch.no_grad():
        want = net.double()(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(reference_forward(loaded, x, "logits"), want, rtol=1e-12, atol=1e-12)
    assert compile_plan(loaded).sha256() == compile_plan(net).sha256()  # BN folded the same way


def test_sequential_with_batchnorm_and_flatten_keeps_its_layers(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(2)
    m = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.BatchNorm1d(4, affine=False), Square(), nn.Dropout(0.1),
                      nn.Linear(4, 3), nn.Softmax(dim=1))
    with torch.no_grad():
        m[2].running_mean.uniform_(-1, 1)
        m[2].running_var.uniform_(0.5, 3)
    path = tmp_path / "m.safetensors"
    save_sequential(m, path)
    loaded, _ = load_sequential(path)
    assert [type(layer).__name__ for layer in loaded] == [type(layer).__name__ for layer in m]
    x = _x()
    np.testing.assert_allclose(reference_forward(loaded, x, "probabilities"), reference_forward(m, x, "probabilities"),
                               rtol=1e-12)
    assert compile_plan(loaded).sha256() == compile_plan(m).sha256()


def test_traced_models_are_written_as_one_chain(tmp_path) -> None:  # noqa: ANN001
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.trunk(x.view(x.size(0), -1).float()))
            return torch.softmax(self.head(h), dim=-1)

    torch.manual_seed(3)
    net = Net().eval()
    path = tmp_path / "n.safetensors"
    save_sequential(net, path)
    assert [s["type"] for s in _layers(path)] == ["Flatten", "Linear", "BatchNorm1d", "ReLU", "Linear", "Softmax"]
    loaded, _ = load_sequential(path)
    x = _x()
    np.testing.assert_allclose(reference_forward(loaded, x, "probabilities"), reference_forward(net, x, "probabilities"),
                               rtol=1e-12)
    assert compile_plan(loaded).sha256() == compile_plan(net).sha256()


def test_layers_the_file_cannot_carry_are_refused(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(HEModelError, match="running statistics"):
        model_bytes(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2, track_running_stats=False)))
    with pytest.raises(HEModelError, match="start_dim=0"):
        model_bytes(nn.Sequential(nn.Flatten(0), nn.Linear(3, 1)))
    with pytest.raises(HEUnsupportedLayerError) as exc:
        model_bytes(nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU()), nn.Linear(3, 1)))
    assert exc.value.layer_path == "0.1" and exc.value.layer_type == "LeakyReLU"
    assert not list(tmp_path.iterdir())


def _write(tmp_path, layers: list[dict], tensors: dict[str, torch.Tensor]):  # noqa: ANN001, ANN202
    from safetensors.torch import save

    meta = json.dumps({"format": "securetrain.sequential/1", "layers": layers})
    path = tmp_path / "f.safetensors"
    path.write_bytes(save(tensors, metadata={META_KEY: meta}))
    return path


def test_loader_refuses_unknown_fields_and_bad_statistics(tmp_path) -> None:  # noqa: ANN001
    f64 = torch.float64
    bn = {"0.running_mean": torch.zeros(3, dtype=f64), "0.running_var": torch.ones(3, dtype=f64)}
    ok = _write(tmp_path, [{"type": "BatchNorm1d", "num_features": 3, "eps": 1e-5, "affine": False}], bn)
    load_sequential(ok)
    # a field the loader does not know would change what the layer means: refused, not ignored
    with pytest.raises(HEFormatError, match="unknown fields"):
        load_sequential(_write(tmp_path, [{"type": "Flatten", "start_dim": 0}], {}))
    with pytest.raises(HEFormatError, match="lacks"):
        load_sequential(_write(tmp_path, [{"type": "BatchNorm1d", "num_features": 3, "affine": False}], bn))
    with pytest.raises(HEFormatError, match="invalid field"):
        load_sequential(_write(tmp_path, [{"type": "BatchNorm1d", "num_features": 3, "eps": -1.0, "affine": False}], bn))
    with pytest.raises(HEFormatError, match="invalid field"):
        load_sequential(_write(tmp_path, [{"type": "Softmax", "dim": 0}], {}))
    with pytest.raises(HEFormatError, match="running variance"):
        load_sequential(_write(tmp_path, [{"type": "BatchNorm1d", "num_features": 3, "eps": 1e-5, "affine": False}],
                               {**bn, "0.running_var": torch.tensor([1.0, -2.0, 1.0], dtype=f64)}))
    with pytest.raises(HEFormatError, match="do not match"):  # affine BN without its weight and bias
        load_sequential(_write(tmp_path, [{"type": "BatchNorm1d", "num_features": 3, "eps": 1e-5, "affine": True}], bn))
    with pytest.raises(HEFormatError, match="do not match"):
        load_sequential(_write(tmp_path, [{"type": "BatchNorm1d", "num_features": 4, "eps": 1e-5, "affine": False}], bn))
    with pytest.raises(HEModelError, match="unsupported layer type 'BatchNorm2d'"):
        load_sequential(_write(tmp_path, [{"type": "BatchNorm2d", "num_features": 3}], {}))
    with pytest.raises(HEFormatError, match="not an object"):
        load_sequential(_write(tmp_path, [["Linear"]], {}))


@pytest.mark.he
def test_user_model_through_the_cli_encrypted_equals_plaintext(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """BatchNorm1d + Dropout + Flatten: saved, loaded by every `securetrain he` command, evaluated
    encrypted; the released scores equal the user's model in plaintext (decimals=5)."""
    pytest.importorskip("tenseal", reason="homomorphic evaluation needs the [he] extra (tenseal)")
    from typer.testing import CliRunner

    from securetrain.cli.main import app

    for var in ("SECURETRAIN_KEYRING", "SECURETRAIN_VAULT_TRANSIT_KEY", "SECURETRAIN_AUDIT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SECURETRAIN_KEK", "5a" * 32)
    net = user_net()
    x = _x(64)
    with torch.no_grad():
        want = net.double()(torch.as_tensor(x)).numpy()[:, 0]
    np.save(tmp_path / "x.npy", x)
    model, keys = tmp_path / "net.safetensors", tmp_path / "keys"
    save_sequential(net, model)

    def run(*args: object):  # noqa: ANN202
        r = CliRunner().invoke(app, ["he", *[str(a) for a in args]])
        assert r.exit_code == 0, (r.output, r.exception)
        return r

    assert "depth 1" in run("plan", "--model", model).output  # both BatchNorms folded into the Linears
    run("keygen", "--out-dir", keys, "--model", model, "--calibrate-features", tmp_path / "x.npy")
    run("encrypt", "--context", keys / "secret.stctx", "--features", tmp_path / "x.npy", "--out", tmp_path / "in.stcts",
        "--calibrate-model", model)
    run("evaluate", "--context", keys / "public.stctx", "--model", model, "--input", tmp_path / "in.stcts",
        "--out", tmp_path / "out.stcts")
    run("decrypt", "--context", keys / "secret.stctx", "--input", tmp_path / "out.stcts", "--out", tmp_path / "s.csv",
        "--encrypted-inputs", tmp_path / "in.stcts")
    scores = np.loadtxt(tmp_path / "s.csv", delimiter=",")
    assert np.max(np.abs(scores - want)) <= 1e-4  # documented: CKKS error ~1e-7, rounding 5e-6
