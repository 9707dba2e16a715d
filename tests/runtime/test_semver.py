"""Cargo `semver::VersionReq`, table-driven from the crate's own test suite and the Cargo book, plus PEP 440."""

from __future__ import annotations

import pytest
import semver
from carton._semver import Comparator, Op, VersionReq, framework_version
from carton.errors import InvalidVersion, InvalidVersionReq
from hypothesis import given, settings
from hypothesis import strategies as st

# (requirement, its canonical display, versions that match, versions that do not) -- the crate's
# tests/test_version_req.rs, case for case.
CRATE_MATCH_TABLE: list[tuple[str, str | None, list[str], list[str]]] = [
    ("1.0.0", "^1.0.0", ["1.0.0", "1.1.0", "1.0.1"], ["0.9.9", "0.10.0", "0.1.0", "1.0.0-pre", "1.0.1-pre"]),
    ("=1.0.0", "=1.0.0", ["1.0.0"], ["1.0.1", "0.9.9", "0.10.0", "0.1.0", "1.0.0-pre"]),
    ("=0.9.0", "=0.9.0", ["0.9.0"], ["0.9.1", "1.9.0", "0.0.9", "0.9.0-pre"]),
    ("=0.0.2", "=0.0.2", ["0.0.2"], ["0.0.1", "0.0.3", "0.0.2-pre"]),
    ("=0.1.0-beta2.a", "=0.1.0-beta2.a", ["0.1.0-beta2.a"], ["0.9.1", "0.1.0", "0.1.1-beta2.a", "0.1.0-beta2"]),
    ("=0.1.0+meta", "=0.1.0", ["0.1.0", "0.1.0+meta", "0.1.0+any"], []),
    (">= 1.0.0", ">=1.0.0", ["1.0.0", "2.0.0"], ["0.1.0", "0.0.1", "1.0.0-pre", "2.0.0-pre"]),
    (">= 2.1.0-alpha2", ">=2.1.0-alpha2", ["2.1.0-alpha2", "2.1.0-alpha3", "2.1.0", "3.0.0"],
     ["2.0.0", "2.1.0-alpha1", "2.0.0-alpha2", "3.0.0-alpha2"]),
    ("< 1.0.0", "<1.0.0", ["0.1.0", "0.0.1"], ["1.0.0", "1.0.0-beta", "1.0.1", "0.9.9-alpha"]),
    ("<= 2.1.0-alpha2", "<=2.1.0-alpha2", ["2.1.0-alpha2", "2.1.0-alpha1", "2.0.0", "1.0.0"],
     ["2.1.0", "2.2.0-alpha1", "2.0.0-alpha2", "1.0.0-alpha2"]),
    (">1.0.0-alpha, <1.0.0", None, ["1.0.0-beta"], []),
    (">1.0.0-alpha, <1.0", None, [], ["1.0.0-beta"]),
    (">1.0.0-alpha, <1", None, [], ["1.0.0-beta"]),
    ("> 0.0.9, <= 2.5.3", ">0.0.9, <=2.5.3", ["0.0.10", "1.0.0", "2.5.3"], ["0.0.8", "2.5.4"]),
    ("0.3.0, 0.4.0", "^0.3.0, ^0.4.0", [], ["0.0.8", "0.3.0", "0.4.0"]),
    ("<= 0.2.0, >= 0.5.0", "<=0.2.0, >=0.5.0", [], ["0.0.8", "0.3.0", "0.5.1"]),
    ("0.1.0, 0.1.4, 0.1.6", "^0.1.0, ^0.1.4, ^0.1.6", ["0.1.6", "0.1.9"], ["0.1.0", "0.1.4", "0.2.0"]),
    (">=0.5.1-alpha3, <0.6", ">=0.5.1-alpha3, <0.6",
     ["0.5.1-alpha3", "0.5.1-alpha4", "0.5.1-beta", "0.5.1", "0.5.5"],
     ["0.5.1-alpha1", "0.5.2-alpha3", "0.5.5-pre", "0.5.0-pre", "0.6.0", "0.6.0-pre"]),
    ("~1", None, ["1.0.0", "1.0.1", "1.1.1"], ["0.9.1", "2.9.0", "0.0.9"]),
    ("~1.2", None, ["1.2.0", "1.2.1"], ["1.1.1", "1.3.0", "0.0.9"]),
    ("~1.2.2", None, ["1.2.2", "1.2.4"], ["1.2.1", "1.9.0", "1.0.9", "2.0.1", "0.1.3"]),
    ("~1.2.3-beta.2", None, ["1.2.3", "1.2.4", "1.2.3-beta.2", "1.2.3-beta.4"],
     ["1.3.3", "1.1.4", "1.2.3-beta.1", "1.2.4-beta.2"]),
    ("^1", None, ["1.1.2", "1.1.0", "1.2.1", "1.0.1"],
     ["0.9.1", "2.9.0", "0.1.4", "1.0.0-beta1", "0.1.0-alpha", "1.0.1-pre"]),
    ("^1.1", None, ["1.1.2", "1.1.0", "1.2.1"], ["0.9.1", "2.9.0", "1.0.1", "0.1.4"]),
    ("^1.1.2", None, ["1.1.2", "1.1.4", "1.2.1"],
     ["0.9.1", "2.9.0", "1.1.1", "0.0.1", "1.1.2-alpha1", "1.1.3-alpha1", "2.9.0-alpha1"]),
    ("^0.1.2", None, ["0.1.2", "0.1.4"],
     ["0.9.1", "2.9.0", "1.1.1", "0.0.1", "0.1.2-beta", "0.1.3-alpha", "0.2.0-pre"]),
    ("^0.5.1-alpha3", None, ["0.5.1-alpha3", "0.5.1-alpha4", "0.5.1-beta", "0.5.1", "0.5.5"],
     ["0.5.1-alpha1", "0.5.2-alpha3", "0.5.5-pre", "0.5.0-pre", "0.6.0"]),
    ("^0.0.2", None, ["0.0.2"], ["0.9.1", "2.9.0", "1.1.1", "0.0.1", "0.1.4"]),
    ("^0.0", None, ["0.0.2", "0.0.0"], ["0.9.1", "2.9.0", "1.1.1", "0.1.4"]),
    ("^0", None, ["0.9.1", "0.0.2", "0.0.0"], ["2.9.0", "1.1.1"]),
    ("^1.4.2-beta.5", None, ["1.4.2", "1.4.3", "1.4.2-beta.5", "1.4.2-beta.6", "1.4.2-c"],
     ["0.9.9", "2.0.0", "1.4.2-alpha", "1.4.2-beta.4", "1.4.3-beta.5"]),
    ("*", "*", ["0.9.1", "2.9.0", "0.0.9", "1.0.1", "1.1.1"], ["1.0.0-pre"]),
    ("1.*", "1.*", ["1.2.0", "1.2.1", "1.1.1", "1.3.0"], ["0.0.9", "1.2.0-pre"]),
    ("1.2.*", "1.2.*", ["1.2.0", "1.2.2", "1.2.4"], ["1.9.0", "1.0.9", "2.0.1", "0.1.3", "1.2.2-pre"]),
    ("=2.1.1-really.0", None, ["2.1.1-really.0"], []),
    ("0.*.*", "0.*", ["0.5.0"], []),
    ("0.0.*", "0.0.*", [], []),
]

# The Cargo book ("Specifying dependencies"): each requirement and the range it is documented to mean.
CARGO_BOOK_TABLE: list[tuple[str, list[str], list[str]]] = [
    ("^1.2.3", ["1.2.3", "1.9.9"], ["1.2.2", "2.0.0"]),
    ("^1.2", ["1.2.0", "1.99.0"], ["1.1.9", "2.0.0"]),
    ("^1", ["1.0.0", "1.99.99"], ["0.99.0", "2.0.0"]),
    ("^0.2.3", ["0.2.3", "0.2.99"], ["0.2.2", "0.3.0"]),
    ("^0.2", ["0.2.0", "0.2.99"], ["0.1.99", "0.3.0"]),
    ("^0.0.3", ["0.0.3"], ["0.0.2", "0.0.4"]),
    ("^0.0", ["0.0.0", "0.0.99"], ["0.1.0"]),
    ("^0", ["0.0.0", "0.99.99"], ["1.0.0"]),
    ("~1.2.3", ["1.2.3", "1.2.99"], ["1.2.2", "1.3.0"]),
    ("~1.2", ["1.2.0", "1.2.99"], ["1.1.99", "1.3.0"]),
    ("~1", ["1.0.0", "1.99.0"], ["0.99.0", "2.0.0"]),
    ("*", ["0.0.0", "99.0.0"], []),
    ("1.*", ["1.0.0", "1.99.0"], ["0.99.0", "2.0.0"]),
    ("1.2.*", ["1.2.0", "1.2.99"], ["1.1.99", "1.3.0"]),
    (">= 1.2.0", ["1.2.0", "5.0.0"], ["1.1.99"]),
    ("> 1", ["2.0.0"], ["1.99.99"]),
    ("< 2", ["1.99.99"], ["2.0.0"]),
    ("= 1.2.3", ["1.2.3"], ["1.2.4"]),
    (">= 1.2, < 1.5", ["1.2.0", "1.4.99"], ["1.1.99", "1.5.0"]),
    # docs.rs/semver VersionReq's own example
    (">=1.2.3, <1.8.0", ["1.2.3", "1.4.0", "1.7.99"], ["1.2.2", "1.8.0"]),
]

# The same requirement written differently parses to the same comparators (the crate's equality asserts).
EQUIVALENT = [("*", ["x", "X", "  *  "]), ("1.*", ["1.x", "1.X", "1.*.*"]), ("1.2.*", ["1.2.x", "1.2.X"]),
              ("1.2.3", ["^1.2.3", "  ^ 1.2.3  ", "^1.2.3+build"])]

# (requirement, the crate's exact error text)
CRATE_ERROR_TABLE = [
    ("", "unexpected end of input while parsing major version number"),
    ("> 0.1.0,", "unexpected end of input while parsing major version number"),
    ("> 0.3.0, ,", "unexpected character ',' while parsing major version number"),
    ("1.2.3 - 2.3.4", "expected comma after patch version number, found '-'"),
    (">1, >2, >3, >4, >5, >6, >7, >8, >9, >10, >11, >12, >13, >14, >15, >16, >17, >18, >19, >20, >21, >22, "
     ">23, >24, >25, >26, >27, >28, >29, >30, >31, >32, >33", "excessive number of version comparators"),
    ("> 0.0.9 <= 2.5.3", "expected comma after patch version number, found '<'"),
    ("=1.2.3 || =2.3.4", "expected comma after patch version number, found '|'"),
    ("1.1 || =1.2.3", "expected comma after minor version number, found '|'"),
    ("6.* || 8.* || >= 10.*", "expected comma after minor version number, found '|'"),
    ("\0", "unexpected character '\\0' while parsing major version number"),
    (">= >= 0.0.2", "unexpected character '>' while parsing major version number"),
    (">== 0.0.2", "unexpected character '=' while parsing major version number"),
    ("a.0.0", "unexpected character 'a' while parsing major version number"),
    ("1.0.0-", "empty identifier segment in pre-release identifier"),
    (">=", "unexpected end of input while parsing major version number"),
    ("1.2.3-01", "invalid leading zero in pre-release identifier"),
    ("1.2.3+4.", "empty identifier segment in build metadata"),
    (">", "unexpected end of input while parsing major version number"),
    ("1.", "unexpected end of input while parsing minor version number"),
    ("1.*.", "unexpected character after wildcard in version req"),
    ("*.1", "unexpected character after wildcard in version req"),
    ("1.*.1", "unexpected character after wildcard in version req"),
    (">=1.*.1", "unexpected character after wildcard in version req"),
    ("*, 0.20.0-any", "wildcard req (*) must be the only comparator in the version req"),
    ("0.20.0-any, *", "wildcard req (*) must be the only comparator in the version req"),
    ("0.20.0-any, *, 1.0", "wildcard req (*) must be the only comparator in the version req"),
    ("x, 1.0", "wildcard req (x) must be the only comparator in the version req"),
    # whitespace is only ' ', and never inside a version
    ("\t1.0", "unexpected character '\\t' while parsing major version number"),
    ("1 .0", "expected comma after major version number, found '.'"),
    ("01.2.3", "invalid leading zero in major version number"),
    ("1.2.18446744073709551616", "value of patch version number exceeds u64::MAX"),
    ("1.2-alpha", "expected comma after minor version number, found '-'"),
]


def _v(text: str) -> semver.Version:
    return semver.Version.parse(text)


@pytest.mark.parametrize(("req", "display", "good", "bad"), CRATE_MATCH_TABLE, ids=[r[0] for r in CRATE_MATCH_TABLE])
def test_crate_cases(req: str, display: str | None, good: list[str], bad: list[str]) -> None:
    parsed = VersionReq.parse(req)
    if display is not None:
        assert str(parsed) == display
    assert [v for v in good if not parsed.matches(_v(v))] == []
    assert [v for v in bad if parsed.matches(_v(v))] == []


@pytest.mark.parametrize(("req", "good", "bad"), CARGO_BOOK_TABLE, ids=[r[0] for r in CARGO_BOOK_TABLE])
def test_cargo_book_cases(req: str, good: list[str], bad: list[str]) -> None:
    parsed = VersionReq.parse(req)
    assert [v for v in good if not parsed.matches(_v(v))] == []
    assert [v for v in bad if parsed.matches(_v(v))] == []


@pytest.mark.parametrize(("canonical", "spellings"), EQUIVALENT)
def test_equivalent_spellings(canonical: str, spellings: list[str]) -> None:
    for spelling in spellings:
        assert VersionReq.parse(spelling) == VersionReq.parse(canonical), spelling


@pytest.mark.parametrize(("req", "message"), CRATE_ERROR_TABLE, ids=[repr(r[0])[:40] for r in CRATE_ERROR_TABLE])
def test_crate_errors(req: str, message: str) -> None:
    with pytest.raises(InvalidVersionReq) as info:
        VersionReq.parse(req)
    assert str(info.value) == f"invalid version requirement {req!r}: {message}"


def test_parsed_comparators() -> None:
    assert VersionReq.parse(">= 1.2, <2").comparators == (
        Comparator(op=Op.GREATER_EQ, major=1, minor=2),
        Comparator(op=Op.LESS, major=2),
    )
    assert VersionReq.parse("2.x.x").comparators == (Comparator(op=Op.WILDCARD, major=2),)
    assert VersionReq.parse(">=1.2.*").comparators == (Comparator(op=Op.GREATER_EQ, major=1, minor=2),)
    assert VersionReq.parse("~1.2.3-rc.1+b").comparators == (
        Comparator(op=Op.TILDE, major=1, minor=2, patch=3, pre="rc.1"),
    )
    assert VersionReq.parse("*").comparators == ()
    # 32 comparators are the most the crate accepts
    assert len(VersionReq.parse(", ".join(f">{i}" for i in range(32))).comparators) == 32


@pytest.mark.parametrize("op", ["=", ">", ">=", "<", "<=", "~", "^"])
def test_leading_digit_in_pre_and_build(op: str) -> None:
    for version in ["1.2.3-1a", "1.2.3+1a", "1.2.3-01a", "1.2.3+01", "1.2.3-1+1", "1.2.3-1-1+1-1-1",
                    "1.2.3-1a+1a", "1.2.3-1a-1a+1a-1a-1a"]:
        VersionReq.parse(f"{op} {version}")


def test_prerelease_ordering_is_semver() -> None:
    # numeric identifiers sort below alphanumeric ones, numerically among themselves; more fields sort higher
    req = VersionReq.parse(">1.0.0-alpha.9")
    assert req.matches(_v("1.0.0-alpha.10"))
    assert req.matches(_v("1.0.0-alpha.beta"))
    assert req.matches(_v("1.0.0-alpha.9.1"))
    assert not req.matches(_v("1.0.0-alpha.1"))
    assert not req.matches(_v("1.0.0-alph"))


def test_not_a_string() -> None:
    with pytest.raises(InvalidVersionReq, match="must be a string"):
        VersionReq.parse(1.2)  # type: ignore[arg-type]


# --- PEP 440 framework versions ----------------------------------------------------------------------------------

PEP440_TABLE = [
    ("2.13.0", "2.13.0"),
    ("2.13.0+cpu", "2.13.0+cpu"),
    ("1.16.0rc1", "1.16.0-rc.1"),
    ("1.16.0-rc1", "1.16.0-rc1"),  # already SemVer: taken as is
    ("1.2", "1.2.0"),
    ("1", "1.0.0"),
    ("2.0.0.post1", "2.0.0+post.1"),
    ("2.0.0.post1+cpu", "2.0.0+post.1.cpu"),
    ("1.0.0a2", "1.0.0-alpha.2"),
    ("1.0.0b3", "1.0.0-beta.3"),
    ("1.0.0c1", "1.0.0-rc.1"),
    ("1.0.dev4", "1.0.0-dev.4"),
    ("1.0a1.dev2", "1.0.0-alpha.1.dev.2"),
    ("1.2.3.4", "1.2.3+4"),
    ("2.1.0+cu121.fast", "2.1.0+cu121.fast"),
    ("v1.4", "1.4.0"),
]


@pytest.mark.parametrize(("pep440", "expected"), PEP440_TABLE)
def test_framework_version_mapping(pep440: str, expected: str) -> None:
    assert str(framework_version(pep440)) == expected


def test_framework_version_matching() -> None:
    assert VersionReq.parse("=2.13.0").matches("2.13.0+cpu")  # build metadata never affects matching
    assert VersionReq.parse("^2.0.0").matches("2.0.0.post1")
    assert not VersionReq.parse(">=1.16").matches("1.16.0rc1")  # a pre-release needs a pre-release comparator
    assert VersionReq.parse(">=1.16.0-rc.1").matches("1.16.0rc1")
    assert VersionReq.parse("=1.2").matches("1.2")


@pytest.mark.parametrize("bad", ["", "latest", "1!2.0", "1.2.3 4", "1..2"])
def test_bad_framework_versions(bad: str) -> None:
    with pytest.raises(InvalidVersion, match="framework version"):
        framework_version(bad)


# --- properties -------------------------------------------------------------------------------------------------

_REQ_ALPHABET = st.sampled_from(list("0123456789.,*xX^~=<>- +abc|"))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=_REQ_ALPHABET, max_size=24) | st.text(max_size=12))
def test_any_text_parses_or_raises_invalid_version_req(text: str) -> None:
    try:
        req = VersionReq.parse(text)
    except InvalidVersionReq:
        return
    # what parses displays canonically, and the display parses back to the same requirement
    assert VersionReq.parse(str(req)) == req


_NUMBER = st.integers(min_value=0, max_value=3)
_PRE = st.sampled_from(["", "alpha", "alpha.1", "beta", "rc.1", "0"])


@st.composite
def _comparators(draw: st.DrawFn) -> str:
    op = draw(st.sampled_from(["", "=", ">", ">=", "<", "<=", "~", "^"]))
    parts = [str(draw(_NUMBER)) for _ in range(draw(st.integers(min_value=1, max_value=3)))]
    pre = draw(_PRE) if len(parts) == 3 else ""
    return op + ".".join(parts) + (f"-{pre}" if pre else "")


@settings(max_examples=400, deadline=None)
@given(st.lists(_comparators(), min_size=1, max_size=3), _NUMBER, _NUMBER, _NUMBER, _PRE)
def test_a_requirement_is_the_conjunction_of_its_comparators(
    comparators: list[str], major: int, minor: int, patch: int, pre: str
) -> None:
    version = semver.Version(major, minor, patch, prerelease=pre or None)
    req = VersionReq.parse(", ".join(comparators))
    every = all(c._matches_ignoring_pre_rule(version) for c in req.comparators)
    pre_ok = not pre or any(
        c.pre and (c.major, c.minor, c.patch) == (major, minor, patch) for c in req.comparators
    )
    assert req.matches(version) == (every and pre_ok)
    if len(req.comparators) == 1:
        assert req.matches(version) == req.comparators[0].matches(version)
