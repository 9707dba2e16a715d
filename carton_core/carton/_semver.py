"""Cargo's `semver::VersionReq`, reproduced rule for rule, and framework versions normalized to SemVer.

carton.toml's ``required_framework_version`` is specified as a Rust ``semver::VersionReq``. This module parses and
evaluates requirements with exactly that crate's grammar and semantics (parse errors carry the crate's messages):

- comparators separated by commas (at most 32), each an optional operator ``=``, ``>``, ``>=``, ``<``, ``<=``,
  ``~``, ``^`` followed by a possibly partial version ``MAJOR[.MINOR[.PATCH[-PRE][+BUILD]]]``; no operator means ``^``;
- wildcards ``*``, ``x``, ``X`` as the whole requirement, or in the minor/patch position (``1.*``, ``1.2.x``);
- spaces (only ``' '``) are allowed around operators and commas, nowhere else;
- a pre-release version matches only if every comparator matches and at least one comparator has the same
  ``MAJOR.MINOR.PATCH`` and a pre-release of its own.

Versions are `semver.Version`. Framework versions reported by Python packages are PEP 440 strings; see
`framework_version` for the mapping (also in docs/runners.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import semver
from packaging.version import InvalidVersion as _InvalidPep440
from packaging.version import Version as _Pep440Version

from .errors import InvalidVersion, InvalidVersionReq

__all__ = ["Comparator", "Op", "VersionReq", "framework_version"]

_U64_MAX = 2**64 - 1
_MAX_COMPARATORS = 32
_WILDCARDS = ("*", "x", "X")


class Op(enum.StrEnum):
    """A comparator's operator; `WILDCARD` is the implicit one of ``1.*`` and ``1.2.*``."""

    EXACT = "="
    GREATER = ">"
    GREATER_EQ = ">="
    LESS = "<"
    LESS_EQ = "<="
    TILDE = "~"
    CARET = "^"
    WILDCARD = "*"


class _Position(enum.StrEnum):
    MAJOR = "major version number"
    MINOR = "minor version number"
    PATCH = "patch version number"
    PRE = "pre-release identifier"
    BUILD = "build metadata"


class _ParseError(Exception):
    """Internal: a requirement failed to parse; the message is the semver crate's."""


def _quote(char: str) -> str:
    # The crate prints the offending character with Rust's char escaping.
    escapes = {"\0": "\\0", "\t": "\\t", "\n": "\\n", "\r": "\\r", "'": "\\'", "\\": "\\\\"}
    if char in escapes:
        return f"'{escapes[char]}'"
    if not char.isprintable():
        return f"'\\u{{{ord(char):x}}}'"
    return f"'{char}'"


def _unexpected_end(pos: _Position) -> _ParseError:
    return _ParseError(f"unexpected end of input while parsing {pos}")


def _unexpected_char(pos: _Position, char: str) -> _ParseError:
    return _ParseError(f"unexpected character {_quote(char)} while parsing {pos}")


def _unexpected_after_wildcard() -> _ParseError:
    return _ParseError("unexpected character after wildcard in version req")


def _wildcard_not_alone(char: str) -> _ParseError:
    return _ParseError(f"wildcard req ({char}) must be the only comparator in the version req")


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparator:
    """One comparator of a requirement. ``minor``/``patch`` are ``None`` when the requirement left them out."""

    op: Op
    major: int
    minor: int | None = None
    patch: int | None = None
    pre: str = ""

    def __str__(self) -> str:
        text = "" if self.op is Op.WILDCARD else str(self.op)
        text += str(self.major)
        if self.minor is not None:
            text += f".{self.minor}"
            if self.patch is not None:
                text += f".{self.patch}"
                if self.pre:
                    text += f"-{self.pre}"
            elif self.op is Op.WILDCARD:
                text += ".*"
        elif self.op is Op.WILDCARD:
            text += ".*"
        return text

    def matches(self, version: semver.Version) -> bool:
        """Whether this comparator alone accepts ``version`` (pre-release rule included)."""
        return self._matches_ignoring_pre_rule(version) and (not version.prerelease or self._pre_is_compatible(version))

    def _matches_ignoring_pre_rule(self, version: semver.Version) -> bool:
        match self.op:
            case Op.EXACT | Op.WILDCARD:
                return self._exact(version)
            case Op.GREATER:
                return self._greater(version)
            case Op.GREATER_EQ:
                return self._exact(version) or self._greater(version)
            case Op.LESS:
                return self._less(version)
            case Op.LESS_EQ:
                return self._exact(version) or self._less(version)
            case Op.TILDE:
                return self._tilde(version)
            case Op.CARET:
                return self._caret(version)

    def _pre_is_compatible(self, version: semver.Version) -> bool:
        return (
            self.major == version.major
            and self.minor == version.minor
            and self.patch == version.patch
            and bool(self.pre)
        )

    def _exact(self, version: semver.Version) -> bool:
        if version.major != self.major:
            return False
        if self.minor is not None and version.minor != self.minor:
            return False
        if self.patch is not None and version.patch != self.patch:
            return False
        return _compare_pre(_pre(version), self.pre) == 0

    def _greater(self, version: semver.Version) -> bool:
        if version.major != self.major:
            return bool(version.major > self.major)
        if self.minor is None:
            return False
        if version.minor != self.minor:
            return bool(version.minor > self.minor)
        if self.patch is None:
            return False
        if version.patch != self.patch:
            return bool(version.patch > self.patch)
        return _compare_pre(_pre(version), self.pre) > 0

    def _less(self, version: semver.Version) -> bool:
        if version.major != self.major:
            return bool(version.major < self.major)
        if self.minor is None:
            return False
        if version.minor != self.minor:
            return bool(version.minor < self.minor)
        if self.patch is None:
            return False
        if version.patch != self.patch:
            return bool(version.patch < self.patch)
        return _compare_pre(_pre(version), self.pre) < 0

    def _tilde(self, version: semver.Version) -> bool:
        if version.major != self.major:
            return False
        if self.minor is not None and version.minor != self.minor:
            return False
        if self.patch is not None and version.patch != self.patch:
            return bool(version.patch > self.patch)
        return _compare_pre(_pre(version), self.pre) >= 0

    def _caret(self, version: semver.Version) -> bool:
        if version.major != self.major:
            return False
        if self.minor is None:
            return True
        if self.patch is None:
            return bool(version.minor >= self.minor) if self.major > 0 else bool(version.minor == self.minor)
        if self.major > 0:
            if version.minor != self.minor:
                return bool(version.minor > self.minor)
            if version.patch != self.patch:
                return bool(version.patch > self.patch)
        elif self.minor > 0:
            if version.minor != self.minor:
                return False
            if version.patch != self.patch:
                return bool(version.patch > self.patch)
        elif version.minor != self.minor or version.patch != self.patch:
            return False
        return _compare_pre(_pre(version), self.pre) >= 0


@dataclass(frozen=True, slots=True)
class VersionReq:
    """A parsed Cargo-style version requirement; ``VersionReq.parse("*")`` has no comparators and matches any
    release (but no pre-release)."""

    comparators: tuple[Comparator, ...]

    @classmethod
    def parse(cls, text: str) -> VersionReq:
        """Parse ``text`` exactly as ``semver::VersionReq::parse`` does; raises `InvalidVersionReq`."""
        if not isinstance(text, str):
            raise InvalidVersionReq(f"version requirement must be a string, got {type(text).__name__}")
        try:
            return cls(_parse_req(text))
        except _ParseError as exc:
            raise InvalidVersionReq(f"invalid version requirement {text!r}: {exc}") from None

    def matches(self, version: semver.Version | str) -> bool:
        """Whether ``version`` satisfies every comparator (a string is read with `framework_version`)."""
        if isinstance(version, str):
            version = framework_version(version)
        for comparator in self.comparators:
            if not comparator._matches_ignoring_pre_rule(version):
                return False
        if not version.prerelease:
            return True
        return any(comparator._pre_is_compatible(version) for comparator in self.comparators)

    def __str__(self) -> str:
        return ", ".join(str(c) for c in self.comparators) if self.comparators else "*"


def _pre(version: semver.Version) -> str:
    return version.prerelease or ""


def _compare_pre(left: str, right: str) -> int:
    """Order two pre-release strings as SemVer (and the crate) do; the empty pre-release is the greatest."""
    if left == right:
        return 0
    if not left:
        return 1
    if not right:
        return -1
    left_parts, right_parts = left.split("."), right.split(".")
    for a, b in zip(left_parts, right_parts, strict=False):
        a_numeric, b_numeric = a.isascii() and a.isdigit(), b.isascii() and b.isdigit()
        if a_numeric and b_numeric:
            if int(a) != int(b):
                return -1 if int(a) < int(b) else 1
        elif a_numeric:
            return -1
        elif b_numeric:
            return 1
        elif a != b:
            return -1 if a < b else 1
    return (len(left_parts) > len(right_parts)) - (len(left_parts) < len(right_parts))


# --- parsing (the semver crate's grammar) -----------------------------------------------------------------------


def _wildcard(text: str) -> tuple[str, str] | None:
    if text[:1] in _WILDCARDS and text:
        return text[0], text[1:]
    return None


def _numeric(text: str, pos: _Position) -> tuple[int, str]:
    length = 0
    value = 0
    while length < len(text) and "0" <= text[length] <= "9":
        if value == 0 and length > 0:
            raise _ParseError(f"invalid leading zero in {pos}")
        value = value * 10 + ord(text[length]) - ord("0")
        if value > _U64_MAX:
            raise _ParseError(f"value of {pos} exceeds u64::MAX")
        length += 1
    if length > 0:
        return value, text[length:]
    if text:
        raise _unexpected_char(pos, text[0])
    raise _unexpected_end(pos)


def _identifier(text: str, pos: _Position) -> tuple[str, str]:
    """A dot-separated run of ``[0-9A-Za-z-]`` segments (pre-release or build metadata)."""
    accumulated = 0
    segment = 0
    has_nondigit = False
    while True:
        index = accumulated + segment
        char = text[index] if index < len(text) else ""
        if char and char.isascii() and (char.isalpha() or char == "-"):
            segment += 1
            has_nondigit = True
        elif char and "0" <= char <= "9":
            segment += 1
        else:
            if segment == 0:
                if accumulated == 0 and char != ".":
                    return "", text
                raise _ParseError(f"empty identifier segment in {pos}")
            if pos is _Position.PRE and segment > 1 and not has_nondigit and text[accumulated] == "0":
                raise _ParseError(f"invalid leading zero in {pos}")
            accumulated += segment
            if char == ".":
                accumulated += 1
                segment = 0
                has_nondigit = False
            else:
                return text[:accumulated], text[accumulated:]


def _op(text: str) -> tuple[Op, str, bool]:
    for token, op in (
        (">=", Op.GREATER_EQ),
        ("<=", Op.LESS_EQ),
        ("=", Op.EXACT),
        (">", Op.GREATER),
        ("<", Op.LESS),
        ("~", Op.TILDE),
        ("^", Op.CARET),
    ):
        if text.startswith(token):
            return op, text[len(token) :], False
    return Op.CARET, text, True


def _comparator(text: str) -> tuple[Comparator, _Position, str]:
    op, text, default_op = _op(text)
    text = text.lstrip(" ")
    pos = _Position.MAJOR
    major, text = _numeric(text, pos)
    has_wildcard = False

    minor: int | None = None
    if text.startswith("."):
        text = text[1:]
        pos = _Position.MINOR
        wild = _wildcard(text)
        if wild is not None:
            has_wildcard = True
            if default_op:
                op = Op.WILDCARD
            text = wild[1]
        else:
            minor, text = _numeric(text, pos)

    patch: int | None = None
    if text.startswith("."):
        text = text[1:]
        pos = _Position.PATCH
        wild = _wildcard(text)
        if wild is not None:
            if default_op:
                op = Op.WILDCARD
            text = wild[1]
        elif has_wildcard:
            raise _unexpected_after_wildcard()
        else:
            patch, text = _numeric(text, pos)

    pre = ""
    if patch is not None and text.startswith("-"):
        pos = _Position.PRE
        pre, text = _identifier(text[1:], pos)
        if not pre:
            raise _ParseError(f"empty identifier segment in {pos}")
    if patch is not None and text.startswith("+"):
        pos = _Position.BUILD
        build, text = _identifier(text[1:], pos)
        if not build:
            raise _ParseError(f"empty identifier segment in {pos}")

    return Comparator(op=op, major=major, minor=minor, patch=patch, pre=pre), pos, text.lstrip(" ")


def _parse_req(text: str) -> tuple[Comparator, ...]:
    text = text.lstrip(" ")
    wild = _wildcard(text)
    if wild is not None:
        rest = wild[1].lstrip(" ")
        if not rest:
            return ()
        if rest.startswith(","):
            raise _wildcard_not_alone(wild[0])
        raise _unexpected_after_wildcard()

    comparators: list[Comparator] = []
    while True:
        try:
            comparator, pos, rest = _comparator(text)
        except _ParseError as exc:
            wild = _wildcard(text)
            if wild is not None:
                after = wild[1].lstrip(" ")
                if not after or after.startswith(","):
                    raise _wildcard_not_alone(wild[0]) from exc
            raise
        comparators.append(comparator)
        if not rest:
            return tuple(comparators)
        if not rest.startswith(","):
            raise _ParseError(f"expected comma after {pos}, found {_quote(rest[0])}")
        if len(comparators) == _MAX_COMPARATORS:
            raise _ParseError("excessive number of version comparators")
        text = rest[1:].lstrip(" ")


# --- framework versions -------------------------------------------------------------------------------------------

_PEP440_PRE_LABELS = {"a": "alpha", "b": "beta", "rc": "rc"}


def framework_version(text: str) -> semver.Version:
    """A framework version as SemVer: valid SemVer 2.0.0 as is, otherwise PEP 440 mapped as documented.

    PEP 440 mapping: the release is padded to three numbers (``1.2`` -> ``1.2.0``; numbers past the third move to
    build metadata, ``1.2.3.4`` -> ``1.2.3+4``); ``aN``/``bN``/``rcN`` -> ``-alpha.N``/``-beta.N``/``-rc.N``;
    ``.devN`` -> pre-release ``dev.N`` (after the pre-release if any); ``.postN`` -> build metadata ``post.N``;
    the local version ``+cpu`` -> build metadata ``cpu`` (after ``post.N``). Epochs other than 0 are refused.
    Raises `InvalidVersion`.
    """
    if not isinstance(text, str):
        raise InvalidVersion(f"framework version must be a string, got {type(text).__name__}")
    try:
        return semver.Version.parse(text)
    except (ValueError, TypeError):
        pass
    try:
        pep = _Pep440Version(text)
    except _InvalidPep440:
        raise InvalidVersion(f"framework version {text!r} is neither SemVer nor PEP 440") from None
    if pep.epoch != 0:
        raise InvalidVersion(
            f"framework version {text!r} has a PEP 440 epoch ({pep.epoch}!), which SemVer cannot express"
        )
    major, minor, patch = (*pep.release, 0, 0)[:3]
    pre_parts: list[str] = []
    if pep.pre is not None:
        pre_parts += [_PEP440_PRE_LABELS[pep.pre[0]], str(pep.pre[1])]
    if pep.dev is not None:
        pre_parts += ["dev", str(pep.dev)]
    build_parts = [str(n) for n in pep.release[3:]]
    if pep.post is not None:
        build_parts += ["post", str(pep.post)]
    if pep.local is not None:
        build_parts.append(pep.local)
    return semver.Version(
        major,
        minor,
        patch,
        prerelease=".".join(pre_parts) or None,
        build=".".join(build_parts) or None,
    )
