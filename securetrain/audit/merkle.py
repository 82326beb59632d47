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

    def _push(self, node: bytes, height: int) -> None:
        """Append the root of a perfect subtree of ``2**height`` leaves; ``size`` must be a multiple of it."""
        n = self.size >> height
        while n & 1:
            node = node_hash(self._peaks.pop(), node)
            n >>= 1
        self._peaks.append(node)
        self.size += 1 << height

    def extend_batch(self, leaves: Sequence[bytes]) -> None:
        """Same result as :meth:`extend`, faster: aligned perfect subtrees are hashed level by level."""
        sha256 = hashlib.sha256
        i, n = 0, len(leaves)
        while i < n:
            height = (n - i).bit_length() - 1
            if self.size:
                height = min(height, (self.size & -self.size).bit_length() - 1)
            if height == 0:
                self._push(leaves[i], 0)
                i += 1
                continue
            level = leaves[i : i + (1 << height)]
            while len(level) > 1:
                pairs = iter(level)
                level = [sha256(b"\x01" + left + right).digest() for left, right in zip(pairs, pairs, strict=True)]
            self._push(level[0], height)
            i += 1 << height

    def root(self) -> bytes:
        if not self._peaks:
            return EMPTY_ROOT
        acc = self._peaks[-1]
        for peak in reversed(self._peaks[:-1]):
            acc = node_hash(peak, acc)
        return acc

    def peaks(self) -> list[bytes]:
        """Roots of the perfect subtrees making up the tree, largest (leftmost) first."""
        return list(self._peaks)

    @classmethod
    def from_peaks(cls, size: int, peaks: Sequence[bytes]) -> CompactRange:
        """A range continuing a tree of ``size`` leaves; authenticate ``peaks`` by comparing :meth:`root`."""
        if size < 0 or len(peaks) != bin(size).count("1") or any(len(p) != 32 for p in peaks):
            raise ValueError(f"a tree of {size} leaves has {bin(max(size, 0)).count('1')} peaks of 32 bytes")
        cr = cls()
        cr.size, cr._peaks = size, list(peaks)
        return cr

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


#: Why a consistency proof needs an old size of at least 1 (the offline verifier rejects one from 0).
NO_PROOF_FROM_EMPTY_TREE = ("RFC 6962 has no consistency proof from tree size 0: the empty tree is a prefix of "
                            "every tree, so such a proof would prove nothing")


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


def _inner_proof_size(index: int, size: int) -> int:
    return (index ^ (size - 1)).bit_length()


def _decomp_inclusion(index: int, size: int) -> tuple[int, int]:
    inner = _inner_proof_size(index, size)
    return inner, bin(index >> inner).count("1")


def _chain_inner(seed: bytes, proof: Sequence[bytes], index: int) -> bytes:
    for i, h in enumerate(proof):
        seed = node_hash(seed, h) if (index >> i) & 1 == 0 else node_hash(h, seed)
    return seed


def _chain_inner_right(seed: bytes, proof: Sequence[bytes], index: int) -> bytes:
    for i, h in enumerate(proof):
        if (index >> i) & 1:
            seed = node_hash(h, seed)
    return seed


def _chain_border_right(seed: bytes, proof: Sequence[bytes]) -> bytes:
    for h in proof:
        seed = node_hash(h, seed)
    return seed


def root_from_inclusion_proof(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes | None:
    """The root implied by an inclusion proof, or ``None`` when the proof is malformed.

    A port of transparency-dev/merkle ``proof.RootFromInclusionProof``: the proof length must be
    exactly the one the (index, size) pair implies.
    """
    if not 0 <= index < size or len(leaf) != 32 or any(len(p) != 32 for p in proof):
        return None
    inner, border = _decomp_inclusion(index, size)
    if len(proof) != inner + border:
        return None
    return _chain_border_right(_chain_inner(leaf, proof[:inner], index), proof[inner:])


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> bool:
    got = root_from_inclusion_proof(index, size, leaf, proof)
    return got is not None and got == root


def root_from_consistency_proof(size1: int, size2: int, proof: Sequence[bytes], root1: bytes) -> bytes | None:
    """The new root implied by a consistency proof from (size1, root1), or ``None`` if malformed.

    A port of transparency-dev/merkle ``proof.RootFromConsistencyProof``: ``size1 = 0`` is
    rejected (a proof from the empty tree proves nothing), equal sizes need an empty proof.
    """
    if size1 < 0 or size2 < size1 or size1 == 0 or any(len(p) != 32 for p in proof):
        return None
    if size1 == size2:
        return None if proof else root1
    if not proof:
        return None
    end, size = size1, size2
    fork_level, border = _decomp_inclusion(end - 1, size)
    shift = (end & -end).bit_length() - 1  # trailing zeros of size1 (start = 0)
    inner = fork_level - shift
    seed, p_start = proof[0], 1
    if end == 1 << shift:  # size1 is a power of two: its root is a node of the new tree
        seed, p_start = root1, 0
    if len(proof) != p_start + inner + border:
        return None
    rest = proof[p_start:]
    mask = (end - 1) >> shift
    if p_start == 1:
        # The proof's nodes inside the old tree must rebuild root1.
        h = (end - 1).bit_length()  # height of the old tree (start = 0)
        fork = ((end - 1) ^ (size - 1)).bit_length()
        sub_inner = min(h, fork) - shift
        sub_border = max(0, border - bin((end - 1) >> h).count("1"))
        hash1 = _chain_border_right(_chain_inner_right(seed, rest[:sub_inner], mask), rest[inner : inner + sub_border])
        if hash1 != root1:
            return None
    return _chain_border_right(_chain_inner(seed, rest[:inner], mask), rest[inner:])


def verify_consistency(size1: int, size2: int, proof: Sequence[bytes], root1: bytes, root2: bytes) -> bool:
    """RFC 9162 §2.1.4.2 as transparency-dev/merkle implements it (``size1 = 0`` is rejected)."""
    got = root_from_consistency_proof(size1, size2, proof, root1)
    return got is not None and got == root2
