"""A Prefect result serializer that stores task results encrypted (no pickle anywhere).

Results may be tensors, or dicts/lists/tuples of tensors and JSON scalars. They are encoded as a
safetensors payload (the object tree as JSON in ``__metadata__``) inside the AEAD container, with
associated data binding the blob to this purpose. The key comes from the environment or a keyring
path at call time (an opened keyring is cached per file identity and passphrase, so a changed or
re-permissioned keyring is re-read and re-checked) - the serializer's fields (which Prefect persists next to the result) hold no
secret: only an optional keyring *path* and key id.

    @task(result_serializer=EncryptedTensorSerializer(), persist_result=True)
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from typing import Any, Literal

import torch
from prefect.serializers import Serializer
from pydantic import Field

from securetrain.crypto._container import decode_tensors, decrypt_bytes, encode_tensors, encrypt_bytes
from securetrain.crypto.errors import UnsafePayloadError, UnsupportedTensorError
from securetrain.crypto.keys import KeyProvider, provider_from_env

AAD = b"securetrain prefect result v1"
_TREE = "securetrain.tree"


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj
        return {"$t": name}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise UnsupportedTensorError("result dict keys must be strings",
                                         hint="use str keys, e.g. {str(k): v for k, v in result.items()}")
        return {"$d": {k: _encode(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, tuple):
        return {"$u": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise UnsupportedTensorError(f"cannot serialize a {type(obj).__name__} result without pickle",
                                 hint="return tensors, dicts/lists of tensors, or JSON scalars")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if set(node) == {"$t"}:
            try:
                return tensors[node["$t"]]
            except (KeyError, TypeError):
                raise UnsafePayloadError("result tree names a tensor that is not in the payload") from None
        if set(node) == {"$d"} and isinstance(node["$d"], dict):
            return {k: _decode(v, tensors) for k, v in node["$d"].items()}
        if set(node) == {"$u"} and isinstance(node["$u"], list):
            return tuple(_decode(v, tensors) for v in node["$u"])
        raise UnsafePayloadError("malformed result tree")
    return node


def _provider(keyring_path: str | None) -> KeyProvider:
    """The key source, with a keyring file cached per (file identity, passphrase) - scrypt is slow."""
    import hashlib
    import os

    from securetrain.crypto.keys import ENV_KEYRING, ENV_PASSPHRASE

    path = keyring_path or os.environ.get(ENV_KEYRING)
    if not path:
        return provider_from_env(None)
    try:
        st = os.stat(path)
    except OSError:
        return provider_from_env(path)  # raises the usual typed error
    secret = hashlib.sha256(os.environ.get(ENV_PASSPHRASE, "").encode()).hexdigest()
    return _cached_keyring(os.path.abspath(path), st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode, secret)


@functools.lru_cache(maxsize=4)
def _cached_keyring(path: str, ino: int, mtime_ns: int, size: int, mode: int, secret_digest: str) -> KeyProvider:
    return provider_from_env(path)


class EncryptedTensorSerializer(Serializer):  # type: ignore[type-arg]
    type: Literal["securetrain-encrypted"] = Field(default="securetrain-encrypted", frozen=True)
    keyring_path: str | None = None  # a path only; passphrase from SECURETRAIN_KEYRING_PASSPHRASE
    key_id: str | None = None

    def dumps(self, obj: Any) -> bytes:
        tensors: dict[str, torch.Tensor] = {}
        tree = _encode(obj, tensors)
        payload = encode_tensors(tensors, {_TREE: json.dumps(tree, separators=(",", ":"))})
        sealed = encrypt_bytes(payload, _provider(self.keyring_path), associated_data=AAD, key_id=self.key_id)
        # Prefect stores serialized results inside a JSON record, so (like its own pickle
        # serializer) the bytes must be text: base64 of the container.
        return base64.b64encode(sealed)

    def loads(self, blob: bytes) -> Any:
        try:
            sealed = base64.b64decode(bytes(blob), validate=True)
        except (binascii.Error, ValueError):
            raise UnsafePayloadError("encrypted result is not base64 text") from None
        payload = decrypt_bytes(sealed, _provider(self.keyring_path), associated_data=AAD)
        tensors, meta = decode_tensors(payload)
        try:
            tree = json.loads(meta[_TREE])
        except (KeyError, ValueError):
            raise UnsafePayloadError("encrypted result has no object tree") from None
        return _decode(tree, tensors)
