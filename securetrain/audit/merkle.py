"""RFC 6962 / RFC 9162 Merkle tree: root hashes, inclusion and consistency proofs.

Leaf hash ``SHA-256(0x00 || entry)``, interior node ``SHA-256(0x01 || left || right)``, a tree of
``n > 1`` leaves splits at ``k``, the largest power of two ``< n``. The empty tree's root is
``SHA-256("")``. Proofs are lists of 32-byte hashes, bottom-up, exactly as in RFC 9162 §2.1.
Verification follows RFC 9162 §2.1.3.2 and §2.1.4.2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class CompactRange:
    """Incremental root over a growing list of leaves, O(log n) memory.

    Keeps the roots of the perfect subtrees ("peaks") that make up the tree; appending a leaf
    merges equal-sized peaks like a binary counter. The RFC 6962 root is the right-to-left fold.
    """

    def __init__(self) -> None:
        self.size = 0
        self._peaks: list[bytes] = []

    def append(self, leaf: bytes) -> None:
        node = leaf
        n = self.size
        while n & 1:
            node = node_hash(self._peaks.pop(), node)
            n >>= 1
        self._peaks.append(node)
        self.size += 1

    def extend(self, leaves: Iterable[bytes]) -> None:
        for leaf in leaves:
            self.append(leaf)

    def root(self) -> bytes:
        if not self._peaks:
            return EMPTY_ROOT
        acc = self._peaks[-1]
        for peak in reversed(self._peaks[:-1]):
            acc = node_hash(peak, acc)
        return acc

    def copy(self) -> CompactRange:
        other = CompactRange()
        other.size, other._peaks = self.size, list(self._peaks)
        return other


def root_hash(leaves: Sequence[bytes]) -> bytes:
    """Merkle Tree Hash of a list of *leaf hashes*."""
    cr = CompactRange()
    cr.extend(leaves)
    return cr.root()


def inclusion_proof(index: int, leaves: Sequence[bytes]) -> list[bytes]:
    """PATH(m, D[n]) of RFC 6962 §2.1.1 over *leaf hashes*."""
    n = len(leaves)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} outside tree of size {n}")
    return _path(index, leaves, 0, n)


def _path(m: int, leaves: Sequence[bytes], lo: int, hi: int) -> list[bytes]:
    n = hi - lo
    if n == 1:
        return []
    k = _split(n)
    if m < k:
        return _path(m, leaves, lo, lo + k) + [root_hash(leaves[lo + k : hi])]
    return _path(m - k, leaves, lo + k, hi) + [root_hash(leaves[lo : lo + k])]


def consistency_proof(size1: int, leaves: Sequence[bytes]) -> list[bytes]:
    """PROOF(m, D[n]) of RFC 6962 §2.1.2; empty when ``size1`` is 0 or equals the tree size."""
    n = len(leaves)
    if not 0 <= size1 <= n:
        raise ValueError(f"old size {size1} outside 0..{n}")
    if size1 in (0, n):
        return []
    return _subproof(size1, leaves, 0, n, True)


def _subproof(m: int, leaves: Sequence[bytes], lo: int, hi: int, complete: bool) -> list[bytes]:
    n = hi - lo
    if m == n:
        return [] if complete else [root_hash(leaves[lo:hi])]
    k = _split(n)
    if m <= k:
        return _subproof(m, leaves, lo, lo + k, complete) + [root_hash(leaves[lo + k : hi])]
    return _subproof(m - k, leaves, lo + k, hi, False) + [root_hash(leaves[lo : lo + k])]


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes | None:
    """The root implied by an inclusion proof, or ``None`` when the proof is malformed."""
    if not 0 <= index < size or len(leaf) != 32 or any(len(p) != 32 for p in proof):
        return None
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return r if sn == 0 else None


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> bool:
    got = root_from_inclusion_proof(index, size, leaf, proof)
    return got is not None and got == root


def verify_consistency(size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes) -> bool:
    """RFC 9162 §2.1.4.2; sizes 0 and equal sizes are handled like transparency-dev/merkle."""
    if size1 < 0 or size2 < size1 or any(len(p) != 32 for p in proof):
        return False
    if size1 == size2:
        return not proof and root1 == root2
    if size1 == 0:
        return not proof  # everything is consistent with the empty tree
    if not proof:
        return False
    path = list(proof)
    if size1 & (size1 - 1) == 0:  # exact power of two: the old root is a node of the new tree
        path.insert(0, root1)
    fn, sn = size1 - 1, size2 - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return sn == 0 and fr == root1 and sr == root2
