"""linearize.units: token counts (powers of 1000), lengths (powers of 1024), byte sizes (KiB binary, K/KB decimal);
every accepted form, every rejected one with its one-line message, and the printers reading back."""

from __future__ import annotations

import pytest

from linearize.errors import LinearizeError
from linearize.units import (
    BYTE_FORMS,
    LENGTH_FORMS,
    TOKEN_FORMS,
    UnitError,
    format_bytes,
    format_length,
    format_tokens,
    parse_bytes,
    parse_length,
    parse_tokens,
)


def _rejects(parse, bad, message, **kw):
    with pytest.raises(UnitError) as e:
        parse(bad, **kw)
    assert str(e.value) == message and "\n" not in message
    assert isinstance(e.value, LinearizeError) and isinstance(e.value, ValueError) and e.value.exit_code == 2


# ------------------------------------------------------------------------------------------------- token counts


@pytest.mark.parametrize("value, expected", [
    ("500K", 500_000), ("256K", 256_000), ("256k", 256_000), ("20M", 20_000_000), ("40M", 40_000_000),
    ("1B", 10**9), ("2G", 2 * 10**9), ("1T", 10**12), ("1.5M", 1_500_000), ("1.1M", 1_100_000), (".5M", 500_000),
    ("1_000", 1000), ("1,000", 1000), ("2048", 2048), (" 3m ", 3_000_000), ("5 M", 5_000_000), ("1e6", 10**6),
    ("1E6", 10**6), ("1.5e3k", 1_500_000), ("70K", 70_000), (4096, 4096), (2.0, 2), (1e6, 10**6),
])
def test_parse_tokens(value, expected):
    assert parse_tokens(value) == expected


@pytest.mark.parametrize("bad", [
    "", " ", "abc", "0", "0K", "-5", "-5K", "+5", "1.5", "1.2345K", "1.5.3", "20X", "1KB", "1Ki", "M", "K", "1e-3",
    "nan", "inf", True, False, 0, -3, None, 2.5, float("nan"), float("inf"), [20],
])
def test_parse_tokens_rejects(bad):
    _rejects(parse_tokens, bad, f"invalid token count {bad!r}: expected {TOKEN_FORMS}")


# ------------------------------------------------------------------------------------------------------ lengths


@pytest.mark.parametrize("value, expected", [
    ("1K", 1024), ("1k", 1024), ("2K", 2048), ("4K", 4096), ("32K", 32768), ("128K", 131072), ("1M", 2**20),
    ("1.5K", 1536), (".5K", 512), (" 2 K ", 2048), ("512", 512), ("32_768", 32768), ("16K", 16384), (300, 300),
    (2048.0, 2048), ("1e3", 1000),
])
def test_parse_length(value, expected):
    assert parse_length(value) == expected


@pytest.mark.parametrize("bad", [
    "", "0", "0K", "-2K", "-1", "1.0001K", "1.3", "1.5.3", "1Q", "1G", "1KB", "1KiB", "K", "4K,8K", True, None,
    0, -4, 1.5, float("inf"),
])
def test_parse_length_rejects(bad):
    _rejects(parse_length, bad, f"bad length {bad!r}: expected {LENGTH_FORMS}")


def test_parse_length_names_what_it_reads():
    assert parse_length("8", what="batch size") == 8
    _rejects(parse_length, "x", f"bad batch size 'x': expected {LENGTH_FORMS}", what="batch size")


# --------------------------------------------------------------------------------------------------- byte sizes


@pytest.mark.parametrize("value, expected", [
    ("2GB", 2 * 10**9), ("2gb", 2 * 10**9), ("2G", 2 * 10**9), ("2g", 2 * 10**9), ("512MB", 512 * 10**6),
    ("512mb", 512 * 10**6), ("512M", 512 * 10**6), ("1k", 1000), ("1KB", 1000), ("100 KB", 100_000),
    ("1TB", 10**12), ("1T", 10**12), ("1.5GB", 1_500_000_000), ("1.5G", 1_500_000_000), ("4.35GB", 4_350_000_000),
    ("2KiB", 2048), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("40gib", 40 * 2**30), ("1TiB", 2**40),
    ("1PB", 10**15), ("1PiB", 2**50), (".5KiB", 512), ("2.", 2), ("100", 100), ("100B", 100), ("100 b", 100),
    ("1_000MB", 10**9), ("1.5B", 1), ("0", 0), ("0GB", 0), (0, 0), (123, 123), (1.5, 1),
])
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("bad", [
    "", "lots", "2 lots", "-1GB", "-1", "1.5.3", "2XB", "1.5XB", "GB", "KiB", "1Ki", "1KIBB", "1e-3GB", True, None,
    -1, float("nan"), float("-inf"),
])
def test_parse_bytes_rejects(bad):
    _rejects(parse_bytes, bad, f"bad size {bad!r}: expected {BYTE_FORMS}")


# ----------------------------------------------------------------------------------------------------- printers


@pytest.mark.parametrize("n, text", [
    (999, "999"), (1000, "1K"), (1500, "1.5K"), (256_000, "256K"), (159_744, "159.744K"), (20_000_000, "20M"),
    (40_000_000, "40M"), (12_345_678, "12.345678M"), (10**9, "1B"), (1_500_000_000, "1.5B"), (10**13, "10T"),
])
def test_format_tokens_reads_back(n, text):
    assert format_tokens(n) == text and parse_tokens(text) == n


@pytest.mark.parametrize("n, text", [(1024, "1K"), (4096, "4K"), (131072, "128K"), (2**20, "1M"), (1536, "1536"),
                                     (300, "300")])
def test_format_length_reads_back(n, text):
    assert format_length(n) == text and parse_length(text) == n


@pytest.mark.parametrize("n, text", [
    (512, "512.0 B"), (1536, "1.5 KiB"), (512 * 2**20, "512.0 MiB"), (2**30, "1.0 GiB"), (16 * 2**40, "16.0 TiB"),
    (2**50, "1.0 PiB"), (-2048, "-2.0 KiB"), ("oom", "oom"), ("", ""), (None, "None"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
    if isinstance(n, int) and n >= 0:
        assert abs(parse_bytes(text) - n) <= n / 20  # reads back (to the printed decimal)
