"""Sensitive-data detection: find, then block or redact (DESIGN, "Pre-filter").

Ingress screens prompts with it; dead letters screen the excerpt they keep of a record.

Kinds, in priority order (an overlapping lower-priority candidate is dropped):

- ``credential``: an API key (``sk-`` and at least 20 key characters: seawall's
  ``sk-sw-…`` and OpenAI-style keys), wherever it stands; or a label — 密码,
  口令, 账号/帐号, 账户/帐户, 身份证(号/号码); English password, passwd,
  pwd, passcode, account, acct, ID card/number/no., identity card — then ``:``,
  ``=`` or ``：`` and a value. The finding spans the value, not the label. A bare
  English ``id=`` is deliberately *not* a label: it would flag every query string
  and SQL snippet, the same mistake as the seed's digit pattern.
- ``resident_id``: an 18-character PRC resident ID number (GB 11643-1999): a known
  province code, a real calendar date of birth between 1900 and 2099, and the ISO
  7064 MOD 11-2 check character (0-9 or X).
- ``mobile``: a PRC mobile number, ``1[3-9]`` plus 9 digits (optionally ``+86`` and
  3-4-4 grouping by spaces or dashes) whose 3-digit prefix has been allocated.
- ``bank_card``: 13–19 digits (spaces or dashes allowed between digits) passing the
  Luhn check, when a card word (卡号, 银行卡, 信用卡, card, visa, ...) precedes it;
  without one, only 16–19 digits, and not when an order word (订单, 单号, order,
  tracking, invoice, ...) precedes it instead.

Digit runs are never flagged on length alone: the seed's ``\\b\\d{6,18}\\b`` matches
every order number. Findings carry the kind and the span only, never the value, so
they (and ``summary``) are safe to log; ``redact`` replaces spans with
``[REDACTED:<kind>]``.

A text with more than ``MAX_FINDINGS`` findings is not redacted but refused
(``Screening.flooded``), whatever the tenant's policy: no honest prompt holds dozens of
credentials, and a prompt of ``"pwd:x "`` repeated over 16 KiB (2,666 findings) cost
ingress 137 ms of its event loop to screen — its findings were checked against each
other, quadratically — and then failed the size limit once redacted. Detection now
stops past the cap (0.4 ms for that prompt), and each finding is checked against its
neighbours only (bisect).
"""

from __future__ import annotations

import bisect
import datetime as dt
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

Kind = Literal["credential", "resident_id", "mobile", "bank_card"]
SensitivePolicy = Literal["block", "redact"]
Action = Literal["pass", "block", "redact"]


@dataclass(frozen=True, slots=True, order=True)
class Finding:
    start: int
    end: int
    kind: Kind


MAX_FINDINGS = 32
"""Findings in one text beyond which it is refused, not redacted (module notes)."""


@dataclass(frozen=True, slots=True)
class Screening:
    action: Action
    text: str
    """The text with every finding redacted (unchanged when nothing was found, or when
    it is ``flooded``)."""
    findings: tuple[Finding, ...]
    flooded: bool = False
    """More than ``MAX_FINDINGS`` findings (only the first ``MAX_FINDINGS + 1`` are
    kept): refused whatever the policy."""


# Whitespace, CJK symbols and punctuation (、。「」…), full-width punctuation.
_STOP = r"\s\u3000-\u303f\uff01-\uff0f\uff1a-\uff20"
_IDEOGRAPHS = r"\u4e00-\u9fff"
_CREDENTIAL = re.compile(
    r"(?:密码|口令|[账帐](?:号|户)|身份证(?:号码|号)?"
    r"|(?<![a-z])(?:password|passwd|pwd|passcode|account|acct"
    r"|id[ _-]?(?:card|number|no\.?)|identity[ _-]?card)(?![a-z]))"
    r"\s*[:=：]\s*"
    # A quoted value, a run of ideographs, or a run of anything up to whitespace,
    # punctuation or the first ideograph (where the surrounding sentence resumes).
    rf"""(?P<value>"[^"\n]{{1,256}}"|'[^'\n]{{1,256}}'|[{_IDEOGRAPHS}]+|[^{_STOP}{_IDEOGRAPHS}]+)""",
    re.IGNORECASE,
)
_API_KEY = re.compile(r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9][A-Za-z0-9_-]{19,}")
_RESIDENT_ID = re.compile(r"(?<!\d)\d{17}[\dXx](?![\dXx])")
_MOBILE = re.compile(
    r"(?<!\d)(?<!\d[ -])(?:\+?86[ -]?)?(?P<number>1[3-9]\d(?:[ -]?\d{4}){2})(?!\d)(?![ -]\d)"
)
_CARD = re.compile(r"(?<!\d)(?<!\d[ -])\d(?:[ -]?\d){12,18}(?!\d)(?![ -]\d)")
_CARD_WORDS_PLAIN = (
    r"卡号|银行卡|信用卡|储蓄卡|借记卡|银联|"
    r"(?<![a-z])(?:card|visa|mastercard|amex|unionpay|credit|debit)(?![a-z])"
)
_ORDER_WORDS_PLAIN = (
    r"订单|单号|运单|流水号|交易号|"
    r"(?<![a-z])(?:order|tracking|invoice|txn|transaction|ref)(?![a-z])"
)
# Each led by a look-ahead for the words' first characters: the same matches (the class
# is case-folded as the words are), found four times faster, since the regex engine
# then skips ahead by that class instead of trying every alternative at every position
# (0.86 -> 0.22 ms on a 16 KiB prompt of order numbers).
_CARD_WORDS = re.compile(rf"(?=[卡银信储借cvmaud])(?:{_CARD_WORDS_PLAIN})", re.IGNORECASE)
_ORDER_WORDS = re.compile(rf"(?=[订单运流交otir])(?:{_ORDER_WORDS_PLAIN})", re.IGNORECASE)
_CONTEXT_CHARS = 24
"""How far before a number its context words are looked for."""

_PROVINCES = frozenset(
    {11, 12, 13, 14, 15, 21, 22, 23, 31, 32, 33, 34, 35, 36, 37, 41, 42, 43, 44, 45, 46}
    | {50, 51, 52, 53, 54, 61, 62, 63, 64, 65, 71, 81, 82, 83, 91}
)
_GB11643_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_WEIGHTED_ZEROS = 0x30 * sum(_GB11643_WEIGHTS)
_MOBILE_PREFIXES = frozenset(
    [f"13{d}" for d in range(10)]
    + ["145", "146", "147", "148", "149"]
    + ["150", "151", "152", "153", "155", "156", "157", "158", "159"]
    + ["162", "165", "166", "167"]
    + ["170", "171", "172", "173", "174", "175", "176", "177", "178"]
    + [f"18{d}" for d in range(10)]
    + ["190", "191", "192", "193", "195", "196", "197", "198", "199"]
)


def luhn_check_digit(payload: str) -> str:
    """The Luhn digit that completes ``payload`` (digits only)."""
    total = 0
    for i, ch in enumerate(reversed(payload)):
        d = int(ch)
        if i % 2 == 0:  # doubled: these sit at odd positions once the check digit is appended
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return str(-total % 10)


_DOUBLED = (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)
"""A digit doubled, its two digits summed (Luhn)."""
_DOUBLED_ASCII = bytes.maketrans(b"0123456789", bytes(0x30 + d for d in _DOUBLED))


def luhn_valid(digits: str) -> bool:
    """Whether ``digits`` end in their Luhn check digit (``luhn_check_digit``'s rule,
    by the digits' values, so a number in Arabic-Indic digits is judged too). The card
    scan checks every card-shaped number of a text, so ASCII digits are summed as bytes,
    in C: a bomb of 700 numbers cost 2.9 ms here in a Python loop."""
    if len(digits) < 2 or not digits.isdigit():
        return False
    if digits.isascii():
        backwards = digits.encode()[::-1]
        total = sum(backwards[0::2]) + sum(backwards[1::2].translate(_DOUBLED_ASCII))
        return (total - 0x30 * len(backwards)) % 10 == 0
    backwards_str = digits[::-1]
    kept = sum(map(int, backwards_str[0::2]))
    doubled = sum(map(_DOUBLED.__getitem__, map(int, backwards_str[1::2])))
    return (kept + doubled) % 10 == 0


def gb11643_check_char(first17: str) -> str:
    """GB 11643-1999's check character (ISO 7064 MOD 11-2) for 17 digits. ASCII digits
    are weighted as bytes (less the weighted ``'0'``s): the resident-ID scan checks
    every ID-shaped number of a text, and parsing each digit was half of that check."""
    if len(first17) != len(_GB11643_WEIGHTS):
        raise ValueError("GB 11643 checks 17 digits")
    if first17.isascii():
        total = sum(map(operator.mul, first17.encode(), _GB11643_WEIGHTS)) - _WEIGHTED_ZEROS
    else:
        total = sum(map(operator.mul, map(int, first17), _GB11643_WEIGHTS))
    return "10X98765432"[total % 11]


def is_resident_id(value: str) -> bool:
    if len(value) != 18 or not value[:17].isdigit() or int(value[:2]) not in _PROVINCES:
        return False
    year, month, day = int(value[6:10]), int(value[10:12]), int(value[12:14])
    if not 1900 <= year <= 2099:
        return False
    try:
        dt.date(year, month, day)
    except ValueError:
        return False
    return gb11643_check_char(value[:17]) == value[17].upper()


def is_mobile(digits: str) -> bool:
    return len(digits) == 11 and digits.isdigit() and digits[:3] in _MOBILE_PREFIXES


def _digits(s: str) -> str:
    return s.replace(" ", "").replace("-", "")


def _credentials(text: str) -> Iterator[Finding]:
    for m in _API_KEY.finditer(text):
        yield Finding(m.start(), m.end(), "credential")
    for m in _CREDENTIAL.finditer(text):
        yield Finding(m.start("value"), m.end("value"), "credential")


def _resident_ids(text: str) -> Iterator[Finding]:
    for m in _RESIDENT_ID.finditer(text):
        if is_resident_id(m.group()):
            yield Finding(m.start(), m.end(), "resident_id")


def _mobiles(text: str) -> Iterator[Finding]:
    for m in _MOBILE.finditer(text):
        if is_mobile(_digits(m.group("number"))):
            yield Finding(m.start(), m.end(), "mobile")


def _cards(text: str) -> Iterator[Finding]:
    """Luhn-valid card-shaped numbers, but for those an order word precedes (an order
    or tracking number): a card word within ``_CONTEXT_CHARS`` before a number makes it
    a card; else one of 16 digits or more is, unless an order word is there. Each kind
    of word is found once in the whole text (a word is whole in the text, not cut by
    the window's edge) and looked up by position: a search per number was a third of
    the scan of a prompt of 700 numbers."""
    card_words: list[tuple[int, int]] | None = None
    order_words: list[tuple[int, int]] | None = None
    for m in _CARD.finditer(text):
        digits = _digits(m.group())
        if not luhn_valid(digits):
            continue
        start = m.start()
        if card_words is None:
            card_words = [w.span() for w in _CARD_WORDS.finditer(text)]
        if _word_before(card_words, start):
            yield Finding(start, m.end(), "bank_card")
            continue
        if len(digits) < 16:
            continue
        if order_words is None:
            order_words = [w.span() for w in _ORDER_WORDS.finditer(text)]
        if not _word_before(order_words, start):
            yield Finding(start, m.end(), "bank_card")


def _word_before(words: list[tuple[int, int]], at: int) -> bool:
    """Whether one of ``words`` (their spans, in text order, not overlapping) lies whole
    within the ``_CONTEXT_CHARS`` before ``at``: the last one ending by ``at`` is the
    only one that can, since those before it start earlier still."""
    i = bisect.bisect_right(words, (at, at))  # words starting after ``at`` sort after
    while i > 0 and words[i - 1][1] > at:  # one starting before ``at`` but ending past it
        i -= 1
    return i > 0 and words[i - 1][0] >= at - _CONTEXT_CHARS


_DIGIT_RUN = re.compile(r"\d[\d -]{10,}")
"""A digit and ten more digits, spaces or dashes: every resident ID, mobile number and
card number the scans below find holds such a run, and a text without one (most
prompts, most records) needs none of those scans, the costliest of the screening."""
_LABEL_HINTS = (
    *("密码", "口令", "账号", "帐号", "账户", "帐户", "身份证", "pass", "pwd", "acc", "identity"),
    *(f"id{sep}{word}" for sep in ("", " ", "_", "-") for word in ("card", "num", "no")),
)
"""Text every credential label holds (case-folded): a text holding none has no label
for ``_CREDENTIAL`` to find. Case folding covers what its IGNORECASE matches, but for
the dotless ı and the dotted İ (folded to i and a combining dot), mapped to i first."""


def _may_hold_credential(text: str) -> bool:
    if "sk-" in text:
        return True
    folded = text.casefold().replace("ı", "i").replace("i\u0307", "i")
    return any(hint in folded for hint in _LABEL_HINTS)


def _accept(
    text: str, detectors: Iterable[Callable[[str], Iterator[Finding]]], limit: int
) -> list[Finding]:
    """The findings of each detector in turn that overlap none accepted before, in text
    order; at most ``limit`` + 1 (past that the caller only needs to know there are
    more). A finding is checked against the two accepted findings around it."""
    accepted: list[Finding] = []  # in text order, non-overlapping
    for detector in detectors:
        for f in detector(text):
            i = bisect.bisect_left(accepted, f)
            if i > 0 and accepted[i - 1].end > f.start:
                continue
            if i < len(accepted) and accepted[i].start < f.end:
                continue
            accepted.insert(i, f)
            if len(accepted) > limit:
                return accepted
    return accepted


def detect(text: str, limit: int = MAX_FINDINGS) -> list[Finding]:
    """Every sensitive span in ``text``, non-overlapping, in text order — at most
    ``limit`` + 1 of them (more: the text is flooded; detection stops there). The scans
    run in priority order, each only where its cheap test says it could find something
    (the screening of a 600-character prompt that passes neither test: about 140 µs →
    12)."""
    scans: list[Callable[[str], Iterator[Finding]]] = []
    if _may_hold_credential(text):
        scans.append(_credentials)
    if _DIGIT_RUN.search(text) is not None:
        scans += (_resident_ids, _mobiles, _cards)
    return _accept(text, scans, limit)


def redact(text: str, findings: Iterable[Finding]) -> str:
    """``text`` with each finding's span replaced by ``[REDACTED:<kind>]``."""
    out: list[str] = []
    pos = 0
    for f in sorted(findings):
        if f.start < pos or f.end > len(text) or f.start > f.end:
            raise ValueError("findings overlap or fall outside the text")
        out += [text[pos : f.start], f"[REDACTED:{f.kind}]"]
        pos = f.end
    out.append(text[pos:])
    return "".join(out)


def summary(findings: Iterable[Finding]) -> dict[Kind, int]:
    """Counts per kind: what may go into logs and audit events."""
    return dict(Counter(f.kind for f in findings))


def screen(text: str, policy: SensitivePolicy) -> Screening:
    """Apply a tenant's policy: ``block`` refuses the request, ``redact`` forwards the
    redacted text. Either way the returned text is the redacted one."""
    findings = tuple(detect(text))
    if not findings:
        return Screening("pass", text, ())
    if len(findings) > MAX_FINDINGS:  # refused before any redaction
        return Screening("block", text, findings, flooded=True)
    return Screening(policy, redact(text, findings), findings)
