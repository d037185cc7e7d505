"""A language compiled to a DFA over UTF-8 bytes: Thompson's construction of an NFA (Thompson
1968), then the subset construction (Rabin & Scott 1959)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nowait.engines.structured.languages import Node, PatternError

MAX_NFA_STATES = 20_000
MAX_DFA_STATES = 4_000
TOO_LARGE = ("the value's language (its pattern, or its minLength/maxLength count) is too large to compile "
             "into slot constraints")


# --- Thompson NFA over bytes, then subset construction ---

# Well-formed UTF-8 for one non-ASCII character (Unicode Table 3-7), as byte ranges per byte.
_UTF8_SEQUENCES = (
    ((0xC2, 0xDF), (0x80, 0xBF)),
    ((0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)),
    ((0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xED, 0xED), (0x80, 0x9F), (0x80, 0xBF)),
    ((0xEE, 0xEF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF0, 0xF0), (0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF1, 0xF3), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)),
    ((0xF4, 0xF4), (0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)),
)


def _byte_bits(low: int, high: int) -> int:
    return sum(1 << b for b in range(low, high + 1))


class _NFA:
    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int]]] = []  # per state: (256-bit byte mask, target)
        self.epsilon: list[list[int]] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise PatternError(TOO_LARGE)
        self.edges.append([])
        self.epsilon.append([])
        return len(self.edges) - 1

    def build(self, node: Node) -> tuple[int, int]:
        kind = node[0]
        start, end = self.state(), self.state()
        if kind == "set":
            _, bits, non_ascii = node
            if bits:
                self.edges[start].append((bits, end))
            paths = (_UTF8_SEQUENCES if non_ascii == "any" else
                     [tuple((b, b) for b in c.encode("utf-8")) for c in sorted(non_ascii)])
            for path in paths:
                here = start
                for index, (low, high) in enumerate(path):
                    there = end if index == len(path) - 1 else self.state()
                    self.edges[here].append((_byte_bits(low, high), there))
                    here = there
        elif kind == "seq":
            here = start
            for child in node[1]:
                child_start, child_end = self.build(child)
                self.epsilon[here].append(child_start)
                here = child_end
            self.epsilon[here].append(end)
        elif kind == "alt":
            for child in node[1]:
                child_start, child_end = self.build(child)
                self.epsilon[start].append(child_start)
                self.epsilon[child_end].append(end)
        elif kind == "rep":
            _, child, low, high = node
            here = start
            for _ in range(low):
                child_start, child_end = self.build(child)
                self.epsilon[here].append(child_start)
                here = child_end
            if high is None:
                child_start, child_end = self.build(child)
                self.epsilon[here].extend([child_start, end])
                self.epsilon[child_end].extend([child_start, end])
            else:
                for _ in range(high - low):
                    child_start, child_end = self.build(child)
                    self.epsilon[here].extend([child_start, end])
                    here = child_end
            self.epsilon[here].append(end)
        else:
            raise PatternError(f"unknown node {kind!r}")
        return start, end

    def closure(self, states: Iterable[int]) -> frozenset[int]:
        stack = list(states)
        seen = set(stack)
        while stack:
            for target in self.epsilon[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)


@dataclass(frozen=True)
class ByteDFA:
    """`transitions[s, byte]`; the last state is the dead state (it loops to itself)."""

    transitions: np.ndarray  # [states + 1, 256] int32
    accepting: np.ndarray  # [states + 1] bool
    start: int = 0

    @property
    def dead(self) -> int:
        return self.transitions.shape[0] - 1

    def matches(self, data: bytes) -> bool:
        state = self.start
        for byte in data:
            state = int(self.transitions[state, byte])
        return bool(self.accepting[state])


@lru_cache(maxsize=256)
def compile_language(node: Node) -> ByteDFA:
    """The minimal-enough DFA of a language: subset construction over the Thompson NFA."""
    nfa = _NFA()
    nfa_start, nfa_end = nfa.build(node)
    first = nfa.closure([nfa_start])
    index = {first: 0}
    order = [first]
    rows: list[list[int]] = []
    while len(rows) < len(order):
        current = order[len(rows)]
        edges = [edge for state in current for edge in nfa.edges[state]]
        row = []
        for byte in range(256):
            targets = nfa.closure(target for bits, target in edges if bits >> byte & 1)
            if not targets:
                row.append(-1)
                continue
            if targets not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise PatternError(TOO_LARGE)
                index[targets] = len(order)
                order.append(targets)
            row.append(index[targets])
        rows.append(row)
    dead = len(order)
    transitions = np.array([*rows, [dead] * 256], dtype=np.int32)
    transitions[transitions < 0] = dead
    accepting = np.array([nfa_end in states for states in order] + [False])
    return ByteDFA(transitions=transitions, accepting=accepting)
