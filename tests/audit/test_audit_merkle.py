"""RFC 6962 known answers (google/trillian merkle/testonly, transparency-dev/merkle proof tests)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from pathlib import Path

import pytest

from securetrain.audit import merkle as m

LEAVES = [bytes.fromhex(h) for h in ["", "00", "10", "2021", "3031", "40414243", "5051525354555657",
                                     "606162636465666768696a6b6c6d6e6f"]]
ROOTS = [bytes.fromhex(h) for h in [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]]
H = bytes.fromhex
INCLUSION = [  # (leaf index, tree size, proof)
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (0, 1, []),
]
CONSISTENCY = [  # (size1, size2, proof)
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
    (6, 7, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
]
LEAF_HASHES = [m.leaf_hash(x) for x in LEAVES]


def test_empty_root_is_sha256_of_nothing() -> None:
    assert m.root_hash([]) == m.EMPTY_ROOT == hashlib.sha256(b"").digest()
    assert m.EMPTY_ROOT.hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.parametrize("size", range(9))
def test_known_roots(size: int) -> None:
    assert m.root_hash(LEAF_HASHES[:size]) == ROOTS[size]


@pytest.mark.parametrize(("index", "size", "proof"), INCLUSION)
def test_inclusion_known_answers(index: int, size: int, proof: list[str]) -> None:
    want = [H(p) for p in proof]
    assert m.inclusion_proof(index, LEAF_HASHES[:size]) == want
    assert m.verify_inclusion(index, size, LEAF_HASHES[index], want, ROOTS[size])


@pytest.mark.parametrize(("index", "size", "proof"), [v for v in INCLUSION if v[2]])
def test_inclusion_rejects_corruptions(index: int, size: int, proof: list[str]) -> None:
    p, root, leaf = [H(x) for x in proof], ROOTS[size], LEAF_HASHES[index]
    some = H("abacaba000000000000000000000000000000000000000000060061e00123456")
    bad = [
        (index ^ 1, size, leaf, p, root), (index + 1, size, leaf, p, root), (index, size * 2, leaf, p, root),
        (index, size // 2, leaf, p, root), (index, size, some, p, root), (index, size, leaf, p, m.EMPTY_ROOT),
        (index, size, leaf, p + [root], root), (index, size, leaf, [root] + p, root), (index, size, leaf, p[:-1], root),
        (index, size, leaf, p + [b""], root),
    ]
    for i in range(len(p)):
        flipped = list(p)
        flipped[i] = bytes([flipped[i][0] ^ 8]) + flipped[i][1:]
        bad.append((index, size, leaf, flipped, root))
    for args in bad:
        assert not m.verify_inclusion(*args), args


@pytest.mark.parametrize(("size1", "size2", "proof"), CONSISTENCY)
def test_consistency_known_answers(size1: int, size2: int, proof: list[str]) -> None:
    want = [H(p) for p in proof]
    assert m.consistency_proof(size1, LEAF_HASHES[:size2]) == want
    assert m.verify_consistency(size1, size2, want, ROOTS[size1], ROOTS[size2])


@pytest.mark.parametrize(("size1", "size2", "proof"), [v for v in CONSISTENCY if v[2]])
def test_consistency_rejects_corruptions(size1: int, size2: int, proof: list[str]) -> None:
    p, r1, r2 = [H(x) for x in proof], ROOTS[size1], ROOTS[size2]
    bad = [
        (size1 - 1, size2, p, r1, r2), (size1 + 1, size2, p, r1, r2), (size1, size2 * 2, p, r1, r2),
        (size1, size2 // 2, p, r1, r2), (size1, size2, p, r2, r1), (size1, size2, [], r1, r2),
        (size1, size2, p + [r1], r1, r2), (size1, size2, [r2] + p, r1, r2), (size1, size2, p[:-1], r1, r2),
        (size1, size2, [p[0]] + p, r1, r2),
    ]
    for i in range(len(p)):
        flipped = list(p)
        flipped[i] = bytes([flipped[i][0] ^ 16]) + flipped[i][1:]
        bad.append((size1, size2, flipped, r1, r2))
    for args in bad:
        assert not m.verify_consistency(*args), args


def test_consistency_edge_cases() -> None:
    a, b = m.EMPTY_ROOT, ROOTS[1]
    # transparency-dev/merkle: a proof from the empty tree is meaningless, so size1 = 0 is rejected
    # (it used to return True for any new root without checking anything).
    assert not m.verify_consistency(0, 0, [], a, a)
    assert not m.verify_consistency(0, 0, [], a, b)
    assert not m.verify_consistency(0, 5, [], a, b)
    assert not m.verify_consistency(0, 8, [], a, ROOTS[8])
    assert not m.verify_consistency(0, 1, [a], a, a)
    assert not m.verify_consistency(2, 1, [], a, b)


def test_generated_proofs_verify_for_all_small_sizes() -> None:
    leaves = [m.leaf_hash(bytes([i])) for i in range(33)]
    for n in range(1, 34):
        root = m.root_hash(leaves[:n])
        for i in range(n):
            assert m.verify_inclusion(i, n, leaves[i], m.inclusion_proof(i, leaves[:n]), root)
        for k in range(1, n + 1):
            assert m.verify_consistency(k, n, m.consistency_proof(k, leaves[:n]), m.root_hash(leaves[:k]), root)


def test_compact_range_matches_recursive_definition() -> None:
    def mth(xs: list[bytes]) -> bytes:
        if len(xs) == 1:
            return xs[0]
        k = 1 << ((len(xs) - 1).bit_length() - 1)
        return m.node_hash(mth(xs[:k]), mth(xs[k:]))

    leaves = [m.leaf_hash(bytes([i])) for i in range(40)]
    cr = m.CompactRange()
    for n, leaf in zip(itertools.count(1), leaves, strict=False):
        cr.append(leaf)
        assert cr.root() == mth(leaves[:n])


VECTORS = json.loads((Path(__file__).parent / "data" / "transparency_dev_merkle_vectors.json").read_text())


def _b64(items: list[str] | None) -> list[bytes]:
    return [base64.b64decode(x) for x in items or []]


def test_vector_file_is_complete() -> None:
    assert len(VECTORS["consistency"]) == 98 and len(VECTORS["inclusion"]) == 98
    assert any(v["size1"] == 0 and v["wantErr"] for v in VECTORS["consistency"])


@pytest.mark.parametrize("probe", VECTORS["consistency"], ids=lambda v: v["file"])
def test_transparency_dev_consistency_vectors(probe: dict) -> None:
    got = m.verify_consistency(probe["size1"], probe["size2"], _b64(probe["proof"]),
                               base64.b64decode(probe["root1"] or ""), base64.b64decode(probe["root2"] or ""))
    assert got is not probe["wantErr"], probe["desc"]


@pytest.mark.parametrize("probe", VECTORS["inclusion"], ids=lambda v: v["file"])
def test_transparency_dev_inclusion_vectors(probe: dict) -> None:
    got = m.verify_inclusion(probe["leafIdx"], probe["treeSize"], base64.b64decode(probe["leafHash"] or ""),
                             _b64(probe["proof"]), base64.b64decode(probe["root"] or ""))
    assert got is not probe["wantErr"], probe["desc"]


@pytest.mark.parametrize("start", [0, 1, 3, 4, 5, 8, 13])
def test_extend_batch_matches_append(start: int) -> None:
    leaves = [m.leaf_hash(i.to_bytes(2, "big")) for i in range(300)]
    for cut in (0, 1, 2, 7, 64, 100, 257, 300 - start):
        one, batch = m.CompactRange(), m.CompactRange()
        one.extend(leaves[:start])
        batch.extend(leaves[:start])
        one.extend(leaves[start:start + cut])
        batch.extend_batch(leaves[start:start + cut])
        assert (one.size, one.root(), one._peaks) == (batch.size, batch.root(), batch._peaks)
        assert batch.root() == m.root_hash(leaves[:start + cut])
