"""Sensitive-data detection: validated numbers only, never bare digit runs."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.common import sensitive
from services.common.sensitive import (
    Finding,
    detect,
    gb11643_check_char,
    is_mobile,
    is_resident_id,
    luhn_check_digit,
    luhn_valid,
    redact,
    screen,
    summary,
)

pytestmark = pytest.mark.unit

SEED_PATTERN = re.compile(r"\b\d{6,18}\b")


def kinds(text: str) -> list[str]:
    return [f.kind for f in detect(text)]


# --- generators -------------------------------------------------------------------------


def luhn_numbers(lengths: st.SearchStrategy[int], first: str = "3456") -> st.SearchStrategy[str]:
    """Luhn-valid numbers starting with a card-network digit."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        n = draw(lengths)
        payload = draw(st.sampled_from(first)) + draw(
            st.text("0123456789", min_size=n - 2, max_size=n - 2)
        )
        return payload + luhn_check_digit(payload)

    return build()


def corrupt_last(number: str) -> str:
    bad = (int(number[-1]) + 1 + int(number[0]) % 9) % 10
    return number[:-1] + str(bad)


@st.composite
def resident_ids(draw: st.DrawFn) -> str:
    region = draw(st.sampled_from(["11", "31", "44", "65", "81"])) + draw(
        st.text("0123456789", min_size=4, max_size=4)
    )
    born = draw(st.dates(dt.date(1900, 1, 1), dt.date(2099, 12, 31)))
    seq = draw(st.text("0123456789", min_size=3, max_size=3))
    first17 = region + born.strftime("%Y%m%d") + seq
    return first17 + gb11643_check_char(first17)


def group(number: str, sep: str) -> str:
    return sep.join(number[i : i + 4] for i in range(0, len(number), 4))


# --- validators -------------------------------------------------------------------------


def test_known_numbers() -> None:
    assert luhn_valid("4111111111111111")
    assert luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112")
    assert is_resident_id("11010519491231002X")
    assert is_resident_id("11010519491231002x")
    assert not is_resident_id("110105194912310021")
    assert not is_resident_id("11010519490231002X")  # no 31 February ... checksum aside
    assert is_mobile("13812345678")
    assert is_mobile("19912345678")
    assert not is_mobile("15412345678")  # 154 was never allocated
    assert not is_mobile("12012345678")


@given(luhn_numbers(st.integers(13, 19)))
def test_luhn_accepts_generated_and_rejects_corrupted(number: str) -> None:
    assert luhn_valid(number)
    assert not luhn_valid(corrupt_last(number))


@given(resident_ids())
def test_gb11643_accepts_generated_and_rejects_corrupted(rid: str) -> None:
    assert is_resident_id(rid)
    wrong = next(c for c in "0123456789X" if c != rid[-1])
    assert not is_resident_id(rid[:-1] + wrong)


@given(resident_ids(), st.integers(13, 99))
def test_gb11643_rejects_impossible_birth_dates(rid: str, month: int) -> None:
    first17 = rid[:10] + f"{month:02d}" + rid[12:17]
    assert not is_resident_id(first17 + gb11643_check_char(first17))


# --- detection ------------------------------------------------------------------------------


@settings(max_examples=200)
@given(
    st.sampled_from(["订单号：", "订单号 ", "order #", "Order no. ", "tracking: ", "单号"]),
    st.integers(6, 18),
    st.data(),
)
def test_order_numbers_are_not_flagged(label: str, length: int, data: st.DataObject) -> None:
    number = "20" + data.draw(st.text("0123456789", min_size=length - 2, max_size=length - 2))
    text = f"请帮我查一下{label}{number}的物流"
    assert SEED_PATTERN.fullmatch(number)  # what the seed would have flagged
    assert detect(text) == []


@given(st.integers(6, 15), st.data())
def test_short_digit_runs_without_context_are_not_flagged(length: int, data: st.DataObject) -> None:
    number = data.draw(st.sampled_from("23456789")) + data.draw(
        st.text("0123456789", min_size=length - 1, max_size=length - 1)
    )
    # "86" then a mobile number is that number with China's country code (written
    # without its "+"): a phone number, flagged on purpose (see the next test).
    assume(not (number.startswith("86") and is_mobile(number[2:])))
    assert detect(f"数量 {number} 件") == []


def test_a_mobile_number_with_the_country_code_and_no_plus_is_flagged() -> None:
    assert [f.kind for f in detect("数量 8613000000000 件")] == ["mobile"]


@given(
    luhn_numbers(st.integers(13, 19)),
    st.sampled_from(["", " ", "-"]),
    st.sampled_from(["我的银行卡号是", "信用卡 ", "card number: ", "Visa ", "卡号"]),
)
def test_cards_in_card_context_are_flagged(number: str, sep: str, label: str) -> None:
    shown = group(number, sep) if sep else number
    text = f"{label}{shown}，谢谢"
    (finding,) = detect(text)
    assert finding.kind == "bank_card"
    assert text[finding.start : finding.end] == shown


@given(luhn_numbers(st.integers(16, 19)))
def test_long_luhn_numbers_are_flagged_alone(number: str) -> None:
    assert kinds(f"here: {number} ok") == ["bank_card"]


@given(luhn_numbers(st.integers(13, 15)))
def test_short_luhn_numbers_need_card_context(number: str) -> None:
    assert kinds(f"here: {number} ok") == []


@given(luhn_numbers(st.integers(13, 19)), st.sampled_from(["银行卡 ", "card "]))
def test_luhn_invalid_numbers_are_not_cards(number: str, label: str) -> None:
    assert "bank_card" not in kinds(label + corrupt_last(number))


def test_a_card_inside_a_longer_grouped_number_is_not_flagged() -> None:
    card = "4111111111111111"
    assert kinds("card " + group(card, " ")) == ["bank_card"]
    assert kinds("card " + group(card + "1234", " ")) == []


@given(resident_ids(), st.sampled_from(["身份证号", "ID: ", "证件 ", ""]))
def test_resident_ids_are_flagged(rid: str, label: str) -> None:
    text = f"{label}{rid} 已登记"
    found = detect(text)
    assert [f.kind for f in found] in (["resident_id"], ["credential"])
    assert rid not in redact(text, found)


@given(
    st.sampled_from(sorted({"130", "139", "147", "150", "166", "177", "186", "199"})),
    st.text("0123456789", min_size=8, max_size=8),
    st.sampled_from(["{}", "+86{}", "+86 {}", "86-{}"]),
    st.sampled_from(["", " ", "-"]),
)
def test_mobiles_are_flagged(prefix: str, rest: str, fmt: str, sep: str) -> None:
    number = f"{prefix}{sep}{rest[:4]}{sep}{rest[4:]}"
    text = "联系我 " + fmt.format(number) + " 谢谢"
    (finding,) = detect(text)
    assert finding.kind == "mobile"
    assert text[finding.start : finding.end] == fmt.format(number)


def test_mobile_needs_exactly_eleven_digits() -> None:
    assert kinds("电话 138123456789") == []
    assert kinds("电话 1381234567") == []


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("我的密码：abc123请帮我登录", "abc123"),
        ("账号=zhangsan_01, 谢谢", "zhangsan_01,"),
        ("帐户: 张三 你好", "张三"),
        ("password = hunter2 please", "hunter2"),
        ("PWD:s3cr3t!", "s3cr3t!"),
        ('password: "correct horse battery staple"', '"correct horse battery staple"'),
        ("ID card: X1234567", "X1234567"),
        ("身份证号码：110101199003070000", "110101199003070000"),
    ],
)
def test_credentials_flag_the_value(text: str, value: str) -> None:
    (finding,) = detect(text)
    assert finding.kind == "credential"
    assert text[finding.start : finding.end] == value


@pytest.mark.parametrize(
    "text",
    [
        "SELECT * FROM users WHERE id=5",
        "user id: 42",
        "the password policy is strict",
        "my account is overdrawn",
        "passwords: none",
        "密码",
    ],
)
def test_not_credentials(text: str) -> None:
    assert detect(text) == []


def test_overlaps_keep_the_higher_priority_kind() -> None:
    rid = "11010519491231002X"
    found = detect(f"身份证：{rid}")
    assert [f.kind for f in found] == ["credential"]
    assert detect("+86 13812345678") == [Finding(0, 15, "mobile")]


# --- redaction and policy -------------------------------------------------------------------

SECRETS = st.one_of(
    luhn_numbers(st.integers(16, 19)),
    resident_ids(),
    st.builds(lambda s: "13" + s, st.text("0123456789", min_size=9, max_size=9)),
)
FILLER = st.text(st.sampled_from("你好世界 abc,。"), max_size=8)


@given(st.lists(st.tuples(FILLER, SECRETS), min_size=1, max_size=4), FILLER)
def test_redaction_removes_every_value(parts: list[tuple[str, str]], tail: str) -> None:
    text = "".join(f"{filler} {secret} " for filler, secret in parts) + tail
    findings = detect(text)
    redacted = redact(text, findings)
    for _, secret in parts:
        assert secret not in redacted
    assert len(findings) == len(parts)
    for f in findings:
        assert f"[REDACTED:{f.kind}]" in redacted
    log_line = f"{findings!r} {summary(findings)!r}"
    assert not any(secret in log_line for _, secret in parts)


def test_redact_rejects_overlapping_findings() -> None:
    with pytest.raises(ValueError, match="overlap") as info:
        redact("secret 12345", [Finding(0, 8, "credential"), Finding(7, 12, "mobile")])
    assert "12345" not in str(info.value)


def test_screen_applies_the_policy() -> None:
    text = "卡号 4111 1111 1111 1111，手机 13812345678"
    blocked = screen(text, "block")
    redacted = screen(text, "redact")
    assert blocked.action == "block"
    assert redacted.action == "redact"
    assert blocked.text == redacted.text == "卡号 [REDACTED:bank_card]，手机 [REDACTED:mobile]"
    assert summary(blocked.findings) == {"bank_card": 1, "mobile": 1}
    clean = screen("订单号 2024031512345678 已发货", "block")
    assert clean.action == "pass"
    assert clean.findings == ()


LABELS = [
    "password",
    "PASSWD",
    "pwd",
    "Passcode",
    "account",
    "acct",
    "ID card",
    "id_no",
    "id-number",
    "identity card",
    "密码",
    "口令",
    "账号",
    "帐户",
    "身份证号",
    "paſſword",
    "ıd card",
    "İD CARD",
    "sk-sw-0123456789abcdefghijkl",
]


@st.composite
def texts_with_near_misses(draw: st.DrawFn) -> str:
    """Text mixing what the scans look for, what they must not take, and noise."""
    pieces = st.one_of(
        st.text(max_size=40),
        st.sampled_from(LABELS),
        st.builds(
            "".join,
            st.tuples(
                st.sampled_from(LABELS),
                st.sampled_from([":", "=", "：", " = "]),
                st.text("abcXYZ019密", min_size=1, max_size=8),
            ),
        ),
        st.sampled_from([":", "=", "：", " ", "-", "\n", '"']),
        st.text("0123456789 -+Xx", max_size=24),
        resident_ids(),
        luhn_numbers(st.integers(13, 19)),
        st.sampled_from(["13812345678", "+86 138-1234-5678", "卡号", "order", "visa"]),
    )
    return "".join(draw(st.lists(pieces, max_size=12)))


@settings(max_examples=400)
@given(texts_with_near_misses())
def test_the_cheap_tests_never_skip_a_scan_that_would_find_something(text: str) -> None:
    every_scan = (
        sensitive._credentials,
        sensitive._resident_ids,
        sensitive._mobiles,
        sensitive._cards,
    )
    assert detect(text) == sensitive._accept(text, every_scan, sensitive.MAX_FINDINGS)


def test_a_flood_of_findings_is_refused_before_redaction_and_detection_stops_there() -> None:
    bomb = ("pwd:x " * 3000)[:16_000]  # 2,666 credential findings
    assert len(detect(bomb)) == sensitive.MAX_FINDINGS + 1
    for policy in ("redact", "block"):
        flooded = screen(bomb, policy)  # type: ignore[arg-type]
        assert (flooded.action, flooded.flooded) == ("block", True)
        assert flooded.text == bomb  # not redacted
    at_the_cap = " ".join(["pwd:x"] * sensitive.MAX_FINDINGS)
    within = screen(at_the_cap, "redact")
    assert (within.action, within.flooded, len(within.findings)) == ("redact", False, 32)


FRAGMENTS = st.sampled_from(
    [
        *("密码: hunter2 ", "pwd=abc ", "13812345678 ", "+86 138-1234-5678 "),
        *("卡号 4111 1111 1111 1111 ", "11010519491231002X ", "order 4111111111111111 "),
        *("sk-" + "a" * 24 + " ", "hello ", "12 "),
    ]
)


@given(st.lists(FRAGMENTS, max_size=40))
def test_the_findings_are_those_of_checking_each_against_every_one_before(
    parts: list[str],
) -> None:
    """The bisect keeps exactly what comparing each candidate with every accepted one
    kept (the quadratic rule it replaced), whatever the mix."""
    text = "".join(parts)
    scans = [sensitive._credentials, sensitive._resident_ids, sensitive._mobiles, sensitive._cards]
    expected: list[Finding] = []
    for scan in scans:
        for f in scan(text):
            if all(f.end <= a.start or a.end <= f.start for a in expected):
                expected.append(f)
    assert detect(text, limit=10_000) == sorted(expected)


# -- the fast paths give the answers of the plain definitions ---------------------------


def _reference_luhn_valid(digits: str) -> bool:
    """By the digits' values: a check digit written in another script (Arabic-Indic,
    say) counts as what it is, so a card number cannot slip past the scan in one."""
    return (
        len(digits) > 1
        and digits.isdigit()
        and int(luhn_check_digit(digits[:-1])) == int(digits[-1])
    )


def _reference_gb11643(first17: str) -> str:
    weights = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
    return "10X98765432"[sum(int(c) * w for c, w in zip(first17, weights, strict=True)) % 11]


def _reference_cards(text: str) -> list[sensitive.Finding]:
    """The card scan written plainly: for every Luhn-valid number, every card word and
    every order word of the text, whether it lies whole in the 24 characters before."""

    def word_before(words: re.Pattern[str], at: int) -> bool:
        return any(at - 24 <= w.start() and w.end() <= at for w in words.finditer(text))

    found = []
    for m in sensitive._CARD.finditer(text):
        digits = sensitive._digits(m.group())
        if not _reference_luhn_valid(digits):
            continue
        if word_before(sensitive._CARD_WORDS, m.start()) or (
            len(digits) >= 16 and not word_before(sensitive._ORDER_WORDS, m.start())
        ):
            found.append(sensitive.Finding(m.start(), m.end(), "bank_card"))
    return found


@given(st.text(alphabet="0123456789٣", min_size=0, max_size=25))
def test_luhn_in_c_is_luhn(digits: str) -> None:
    assert luhn_valid(digits) == _reference_luhn_valid(digits)


def test_a_card_number_in_arabic_indic_digits_is_found() -> None:
    arabic = "4111111111111111".translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    assert luhn_valid(arabic)
    assert [f.kind for f in sensitive.detect(f"my card {arabic}")] == ["bank_card"]


@given(st.text(alphabet="0123456789٣٧", min_size=17, max_size=17))
def test_gb11643_in_c_is_gb11643(first17: str) -> None:
    assert gb11643_check_char(first17) == _reference_gb11643(first17)


_CARD_TEXT = st.lists(
    st.sampled_from(
        [
            "4111111111111111",
            "4111 1111 1111 1111",
            "4111-1111-1111-1112",
            "79927398713",
            "5500005555555559",
            "order",
            "Order#",
            "xorder",
            "orders",
            "card",
            "CARD",
            "scard",
            "cards",
            "visa",
            "ref",
            "txn",
            "卡号",
            "银行卡号",
            "订单",
            "流水号",
            "ſ",
            " ",
            "  ",
            "-",
            ":",
            "x",
            "a" * 20,
        ]
    ),
    max_size=30,
).map("".join)


@settings(max_examples=800)
@given(_CARD_TEXT)
def test_the_card_scan_finds_what_the_plain_scan_finds(text: str) -> None:
    """The card scan with its Luhn check summed in C answers as the plain scan does,
    the context windows' edges included."""
    assert list(sensitive._cards(text)) == _reference_cards(text)


_WORDY = st.lists(
    st.sampled_from(
        [
            *("card", "VISA", "MasterCard", "amex", "UnionPay", "credit", "debit"),
            *("order", "Tracking", "INVOICE", "txn", "transaction", "ref", "Ref"),
            *("卡号", "银行卡", "信用卡", "储蓄卡", "借记卡", "银联"),
            *("订单", "单号", "运单", "流水号", "交易号"),
            *"ſKİıxs -:1",
        ]
    ),
    max_size=12,
).map("".join)


@settings(max_examples=500)
@given(_WORDY)
def test_the_context_words_lead_in_finds_what_the_words_alone_find(text: str) -> None:
    """The look-ahead for the first characters only skips ahead: the same words are
    found as by the plain alternation, under every case folding it allows."""
    for fast, plain in (
        (sensitive._CARD_WORDS, sensitive._CARD_WORDS_PLAIN),
        (sensitive._ORDER_WORDS, sensitive._ORDER_WORDS_PLAIN),
    ):
        slow = re.compile(plain, re.IGNORECASE)
        assert [m.span() for m in fast.finditer(text)] == [m.span() for m in slow.finditer(text)]
