"""A slot's language as a syntax tree, and the regex subset that writes one.

The regex dialect is the subset of Python's `re` that JSON Schema patterns use in practice:
literals and escapes, `.`, classes with ranges and negation, `\\d \\w \\s` (ASCII), groups,
alternation, `* + ? {n} {n,} {n,m}`, `^`/`$` at the ends. Anything else raises `PatternError`.
"""

from __future__ import annotations

from collections.abc import Iterable

# --- the language syntax tree: hashable tuples, so compiled DFAs can be cached per language ---
# ("set", ascii_bits, non_ascii) one character: ascii_bits is a 128-bit mask, non_ascii is
#                                 "any" (every non-ASCII character) or a frozenset of them
# ("seq", nodes) / ("alt", nodes) / ("rep", node, low, high or None)

Node = tuple
ASCII_ALL = (1 << 128) - 1


class PatternError(ValueError):
    """A pattern outside the supported regex subset (or too large to compile)."""


def char_set(chars: Iterable[str] = (), non_ascii: object = frozenset()) -> Node:
    bits, extra = 0, set()
    for char in chars:
        if ord(char) < 128:
            bits |= 1 << ord(char)
        else:
            extra.add(char)
    if non_ascii == "any":
        return ("set", bits, "any")
    return ("set", bits, frozenset(extra) | frozenset(non_ascii))


def ascii_range(low: str, high: str) -> int:
    return sum(1 << c for c in range(ord(low), ord(high) + 1))


def seq(*nodes: Node) -> Node:
    return ("seq", tuple(nodes))


def alt(*nodes: Node) -> Node:
    return ("alt", tuple(nodes))


def rep(node: Node, low: int, high: int | None) -> Node:
    return ("rep", node, low, high)


def literal(text: str) -> Node:
    return seq(*(char_set(c) for c in text))


EMPTY = seq()
DIGITS = ascii_range("0", "9")
WORD = DIGITS | ascii_range("a", "z") | ascii_range("A", "Z") | (1 << ord("_"))
SPACE = sum(1 << ord(c) for c in " \t\n\r\f\v")
# Characters a JSON string holds unescaped: not '"', not '\\', not a control character.
JSON_STRING_BITS = ASCII_ALL & ~(1 << ord('"')) & ~(1 << ord("\\")) & ~((1 << 32) - 1) & ~(1 << 127)


def json_string_char() -> Node:
    return ("set", JSON_STRING_BITS, "any")


# --- parsing a pattern ---


class _Parser:
    """Recursive descent over the regex subset. `in_json_string` drops from every character set
    what a JSON string cannot hold unescaped, so the value needs no escaping to be valid."""

    def __init__(self, text: str, in_json_string: bool) -> None:
        self.text, self.at, self.in_json_string = text, 0, in_json_string

    def fail(self, what: str) -> PatternError:
        return PatternError(f"pattern {self.text!r}: {what} (at offset {self.at}) is not supported")

    def peek(self) -> str | None:
        return self.text[self.at] if self.at < len(self.text) else None

    def take(self) -> str:
        char = self.text[self.at]
        self.at += 1
        return char

    def parse(self) -> Node:
        node = self.alternation()
        if self.at != len(self.text):
            raise self.fail(f"{self.text[self.at]!r}")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else alt(*branches)

    def sequence(self) -> Node:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else seq(*items)

    def quantified(self, node: Node) -> Node:
        while True:
            char = self.peek()
            if char == "*":
                low, high = 0, None
            elif char == "+":
                low, high = 1, None
            elif char == "?":
                low, high = 0, 1
            elif char == "{" and self._is_counted():
                low, high = self._counts()
                node = rep(node, low, high)
                self._skip_lazy()
                continue
            else:
                return node
            self.take()
            node = rep(node, low, high)
            self._skip_lazy()

    def _skip_lazy(self) -> None:
        if self.peek() == "?":  # lazy matching: the same language
            self.take()
        elif self.peek() == "+":
            raise self.fail("possessive quantifier")

    def _is_counted(self) -> bool:
        end = self.text.find("}", self.at)
        body = self.text[self.at + 1: end] if end > 0 else ""
        return bool(body) and all(c.isdigit() or c == "," for c in body) and body.count(",") <= 1

    def _counts(self) -> tuple[int, int | None]:
        end = self.text.index("}", self.at)
        body = self.text[self.at + 1: end]
        self.at = end + 1
        if "," not in body:
            return int(body), int(body)
        low, high = body.split(",")
        low_value, high_value = int(low or 0), (int(high) if high else None)
        if high_value is not None and high_value < low_value:
            raise self.fail("a {n,m} with m < n")
        return low_value, high_value

    def atom(self) -> Node:
        char = self.take()
        if char == "(":
            if self.peek() == "?":
                if self.text.startswith("?:", self.at):
                    self.at += 2
                elif self.text.startswith("?P<", self.at):
                    self.at = self.text.index(">", self.at) + 1
                else:
                    raise self.fail("a (?...) group")
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("an unclosed group")
            self.take()
            return node
        if char == "[":
            return self.restrict(self.bracket())
        if char == ".":
            return self.restrict(("set", ASCII_ALL & ~(1 << ord("\n")), "any"))
        if char == "\\":
            return self.restrict(self.escape())
        if char in "^$":
            raise self.fail("an anchor inside the pattern")
        if char in "*+?":
            raise self.fail("a quantifier with nothing to repeat")
        return self.restrict(char_set(char))

    def restrict(self, node: Node) -> Node:
        if not self.in_json_string:
            return node
        _, bits, non_ascii = node
        return ("set", bits & JSON_STRING_BITS, non_ascii)

    def escape(self) -> Node:
        if self.peek() is None:
            raise self.fail("a trailing backslash")
        char = self.take()
        classes = {"d": DIGITS, "w": WORD, "s": SPACE}
        if char in classes:
            return ("set", classes[char], frozenset())
        if char in "DWS":
            # Python's \D \W \S are Unicode-aware: keep their ASCII part only, so nothing we
            # emit can fall outside them.
            return ("set", ASCII_ALL & ~classes[char.lower()], frozenset())
        controls = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
        if char in controls:
            return char_set(controls[char])
        if char in "xu":
            digits = 2 if char == "x" else 4
            code = self.text[self.at: self.at + digits]
            if len(code) != digits or any(c not in "0123456789abcdefABCDEF" for c in code):
                raise self.fail(f"a malformed \\{char} escape")
            self.at += digits
            if 0xD800 <= int(code, 16) <= 0xDFFF:  # half of a UTF-16 pair: not a character
                raise self.fail(f"the surrogate \\{char}{code} (write the character itself)")
            return char_set(chr(int(code, 16)))
        if char.isalnum():
            raise self.fail(f"the escape \\{char}")
        return char_set(char)

    def _class_member(self) -> str | Node:
        """One member of a character class: a character, written as itself or escaped (an x41
        or u0041 escape included), or the set of a shorthand escape (digit, word, space, and
        their negations)."""
        char = self.take()
        if char != "\\":
            return char
        if self.peek() in ("d", "w", "s", "D", "W", "S"):
            return self.escape()
        _, bits, extra = self.escape()
        return chr(bits.bit_length() - 1) if bits else next(iter(extra))

    def _range_follows(self) -> bool:
        return self.peek() == "-" and self.at + 1 < len(self.text) and self.text[self.at + 1] != "]"

    def bracket(self) -> Node:
        negated = self.peek() == "^"
        if negated:
            self.take()
        bits, extra, shorthand = 0, set(), False
        first = True
        while True:
            char = self.peek()
            if char is None:
                raise self.fail("an unclosed character class")
            if char == "]" and not first:
                self.take()
                break
            first = False
            member = self._class_member()
            if isinstance(member, tuple):  # a shorthand (\d, \w, ...): a set, never a range end
                shorthand = True
                if self._range_follows():
                    raise self.fail("a class shorthand as a range start")
                bits |= member[1]
                extra |= set(member[2])
                continue
            if self._range_follows():
                self.take()  # the "-"
                high = self._class_member()
                if isinstance(high, tuple):
                    raise self.fail("a class shorthand as a range end")
                if ord(high) < ord(member):
                    raise self.fail("a reversed range")
                if ord(high) >= 128:
                    raise self.fail("a non-ASCII range")
                bits |= ascii_range(member, high)
                continue
            if ord(member) < 128:
                bits |= 1 << ord(member)
            else:
                extra.add(member)
        if not negated:
            return ("set", bits, frozenset(extra))
        if extra:
            raise self.fail("a negated class with non-ASCII members")
        # A negated class with \d \w \s excludes Unicode members we cannot list: stay ASCII.
        return ("set", ASCII_ALL & ~bits, frozenset() if shorthand else "any")


def parse_regex(pattern: str) -> Node:
    """A full-match language for an internal regex (no anchors)."""
    return _Parser(pattern, in_json_string=False).parse()


def json_string_pattern(pattern: str) -> Node:
    """The language of the *contents* of a JSON string whose value `re.search`es `pattern`.

    JSON Schema patterns are unanchored: without `^` (or `$`) any string characters may come
    before (or after) the match.
    """
    body = pattern
    anchored_start = body.startswith("^")
    anchored_end = body.endswith("$") and not body.endswith("\\$")
    body = body[1 if anchored_start else 0: len(body) - 1 if anchored_end else len(body)]
    node = _Parser(body, in_json_string=True).parse()
    free = rep(json_string_char(), 0, None)
    return seq(*([] if anchored_start else [free]), node, *([] if anchored_end else [free]))
