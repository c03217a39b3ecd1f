"""A multi-tenant radix tree over token sequences with per-tenant LRU eviction.

This is the data structure of the vLLM Router's cache-aware policy (`src/tree.rs`, v0.1.17),
re-expressed over tuples of ints instead of strings of characters. One tree holds the requests
routed to every backend ("tenant"); each node records which tenants have routed a sequence that
runs through all of it, and when each last ended a sequence there:

- `insert(seq, t)` walks `seq` from the root, splitting a node where `seq` diverges inside its
  label, adds `t` to every node on the path (charging `t` the node's length the first time) and
  hangs the unmatched rest as a new leaf. Only the node where `seq` ends gets a fresh access
  stamp; a node `t` first joins in passing is stamped 0, as in the router.
- `match_lengths(seq)` is the router's `prefix_match_tenant_char_count` for every tenant in one
  walk: for tenant t, the length of the longest prefix of `seq` that t has routed. It does not
  touch access stamps (neither does the router's).
- `evict(max_size)` is `evict_tenant_by_size`: for each tenant over `max_size` tokens, drop it
  from its least recently stamped leaf nodes (a node is a leaf for t when no child holds t),
  oldest first, parents becoming leaves in turn, until it fits; nodes nobody holds are removed.

Invariant (asserted by `check`): a tenant held by a node is held by the node's parent, and
`size[t]` is the summed label length of the nodes holding t. Matching and inserting cost
O(len(seq)) element comparisons done by tuple slicing in C, plus O(log) per divergence.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class _Node:
    __slots__ = ("label", "children", "tenants", "parent")

    def __init__(self, label: tuple[int, ...], parent: _Node | None) -> None:
        self.label = label
        self.children: dict[int, _Node] = {}  # keyed by the first element of the child's label
        self.tenants: dict[str, int] = {}  # tenant -> access stamp (0: only passed through)
        self.parent = parent


def _shared_length(seq: tuple[int, ...], start: int, label: tuple[int, ...]) -> int:
    """Length of the common prefix of seq[start:] and label, given their first elements agree."""
    end = min(len(label), len(seq) - start)
    if seq[start : start + end] == label[:end]:
        return end
    # Gallop to bracket the divergence, then bisect: prefix `good` matches, prefix `bad` does not.
    good, bad = 1, 2
    while bad < end and seq[start : start + bad] == label[:bad]:
        good, bad = bad, bad * 2
    bad = min(bad, end)
    while bad - good > 1:
        mid = (good + bad) // 2
        if seq[start : start + mid] == label[:mid]:
            good = mid
        else:
            bad = mid
    return good


class PrefixTree:
    def __init__(self) -> None:
        self._root = _Node((), None)
        self._clock = 0  # access stamps: a counter, as the router's global epoch
        self.size: dict[str, int] = {}  # tenant -> tokens held; written only by this class

    def tenants(self) -> list[str]:
        return list(self.size)

    def _stamp(self) -> int:
        self._clock += 1
        return self._clock

    def insert(self, seq: tuple[int, ...], tenant: str) -> None:
        self._root.tenants.setdefault(tenant, 0)
        self.size.setdefault(tenant, 0)
        node, pos = self._root, 0
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                leaf = _Node(seq[pos:], node)
                leaf.tenants[tenant] = self._stamp()
                node.children[seq[pos]] = leaf
                self.size[tenant] += len(leaf.label)
                return
            shared = _shared_length(seq, pos, child.label)
            if shared < len(child.label):
                child = self._split(node, child, shared)
            if tenant not in child.tenants:
                child.tenants[tenant] = 0
                self.size[tenant] += len(child.label)
            node, pos = child, pos + shared
        node.tenants[tenant] = self._stamp()

    def _split(self, parent: _Node, child: _Node, at: int) -> _Node:
        """Cut child's label at `at`; the new upper node inherits child's tenants and stamps."""
        upper = _Node(child.label[:at], parent)
        upper.tenants = dict(child.tenants)
        child.label = child.label[at:]
        child.parent = upper
        upper.children[child.label[0]] = child
        parent.children[upper.label[0]] = upper
        return upper

    def match_lengths(self, seq: tuple[int, ...]) -> dict[str, int]:
        """For each tenant in the tree, the longest prefix of seq it has routed (0 if none)."""
        path: list[tuple[_Node, int]] = [(self._root, 0)]
        node, pos = self._root, 0
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                break
            shared = _shared_length(seq, pos, child.label)
            pos += shared
            path.append((child, pos))
            if shared < len(child.label):
                break
            node = child
        matched: dict[str, int] = {}
        for node, length in reversed(path):
            for tenant in node.tenants:
                matched.setdefault(tenant, length)
        return matched

    def evict(self, max_size: int) -> None:
        heap: list[tuple[int, int, str, _Node]] = []
        order = 0  # ties on the stamp: first pushed first, so eviction is deterministic
        for node in self._nodes():
            for tenant in _leaf_tenants(node):
                heap.append((node.tenants[tenant], order, tenant, node))
                order += 1
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.size.get(tenant, 0) <= max_size:
                continue
            if tenant not in node.tenants or _child_holds(node, tenant):
                continue
            self.size[tenant] -= len(node.label)
            del node.tenants[tenant]
            parent = node.parent
            if parent is None:
                continue
            if not node.children and not node.tenants:
                del parent.children[node.label[0]]
            if tenant in parent.tenants and not _child_holds(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], order, tenant, parent))
                order += 1

    def remove_tenant(self, tenant: str) -> None:
        """Forget a backend entirely (the router's `remove_tenant`)."""
        self._drop(self._root, tenant)
        self.size.pop(tenant, None)

    def _drop(self, node: _Node, tenant: str) -> None:
        if tenant not in node.tenants:
            return  # by the invariant, no descendant holds it either
        for key, child in list(node.children.items()):
            self._drop(child, tenant)
            if not child.children and not child.tenants:
                del node.children[key]
        del node.tenants[tenant]

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Assert the tree's invariants (for tests; O(size of tree))."""
        held: dict[str, int] = {}
        for node in self._nodes():
            for tenant in node.tenants:
                held[tenant] = held.get(tenant, 0) + len(node.label)
            for key, child in node.children.items():
                assert child.parent is node and child.label and child.label[0] == key
                assert set(child.tenants) <= set(node.tenants), "tenant held below, not above"
                assert child.tenants or child.children, "a node nobody holds was kept"
        for tenant, size in self.size.items():
            assert held.get(tenant, 0) == size, f"size[{tenant}] = {size}, held {held.get(tenant)}"


def _child_holds(node: _Node, tenant: str) -> bool:
    return any(tenant in child.tenants for child in node.children.values())


def _leaf_tenants(node: _Node) -> list[str]:
    below = {t for child in node.children.values() for t in child.tenants}
    return [t for t in node.tenants if t not in below]
