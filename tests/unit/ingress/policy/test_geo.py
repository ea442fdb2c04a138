"""Client address from X-Forwarded-For and CIDR → region lookup."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.ingress.policy.filters.geo import (
    ClientAddress,
    IPAddress,
    RegionTable,
    client_address,
    forwarded_entries,
    parse_ip,
)

pytestmark = pytest.mark.unit

ips = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))
junk = st.sampled_from(["unknown", "_hidden", "", "999.1.1.1", "1.2.3", "[::1", "not an ip"])


def show(ip: IPAddress, port: bool) -> str:
    if not port:
        return str(ip)
    return f"[{ip}]:443" if ip.version == 6 else f"{ip}:443"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1.2.3.4", "1.2.3.4"),
        (" 1.2.3.4:5678 ", "1.2.3.4"),
        ("2001:db8::1", "2001:db8::1"),
        ("[2001:db8::1]:443", "2001:db8::1"),
        ('"[2001:db8::1]"', "2001:db8::1"),
        ("fe80::1%eth0", "fe80::1"),
        ("::ffff:10.0.0.1", "10.0.0.1"),
        ("unknown", None),
        ("256.0.0.1", None),
        ("[2001:db8::1", None),
        ("", None),
    ],
)
def test_parse_ip(raw: str, expected: str | None) -> None:
    ip = parse_ip(raw)
    assert (str(ip) if ip is not None else None) == expected


def test_forwarded_entries_joins_header_lines() -> None:
    assert forwarded_entries(["1.1.1.1, 2.2.2.2", " 3.3.3.3 ,"]) == [
        "1.1.1.1",
        "2.2.2.2",
        "3.3.3.3",
    ]
    assert forwarded_entries(None) == []


@given(
    client=ips,
    spoofed=st.lists(st.one_of(ips.map(str), junk), max_size=4),
    proxies=st.lists(ips, min_size=1, max_size=5),
    ports=st.booleans(),
)
def test_first_untrusted_hop_is_the_client(
    client: IPAddress, spoofed: list[str], proxies: list[IPAddress], ports: bool
) -> None:
    # The client sends any X-Forwarded-For it likes; each trusted proxy appends the
    # address it received the request from; the last proxy is the TCP peer.
    chain = [client, *proxies]
    xff = [*spoofed, *(show(hop, ports) for hop in chain[:-1])]
    peer = str(chain[-1])
    got = client_address(", ".join(xff), peer, trusted_proxies=len(proxies))
    expected = client.ipv4_mapped if client.version == 6 and client.ipv4_mapped else client
    assert got == ClientAddress(expected, "forwarded")


@given(xff=st.lists(ips.map(str), max_size=3), peer=ips)
def test_no_trusted_proxies_means_the_peer(xff: list[str], peer: IPAddress) -> None:
    assert client_address(", ".join(xff), str(peer), 0).source == "peer"


def test_short_or_corrupt_chains_fall_back_to_the_peer() -> None:
    assert client_address("1.1.1.1", "9.9.9.9", 2) == ClientAddress(
        ipaddress.ip_address("9.9.9.9"), "peer"
    )
    assert client_address("1.1.1.1, garbage", "9.9.9.9", 1).source == "peer"
    assert client_address(None, "9.9.9.9:1234", 1).source == "peer"
    assert client_address("garbage", None, 1) == ClientAddress(None, "none")
    assert client_address(None, "unix:/tmp/sock", 0) == ClientAddress(None, "none")
    with pytest.raises(ValueError, match="negative"):
        client_address(None, None, -1)


def test_longest_prefix_wins() -> None:
    table = RegionTable(
        {
            "10.0.0.0/8": "internal",
            "10.1.0.0/16": "cn-east",
            "10.1.2.0/24": "cn-east-hot",
            "0.0.0.0/0": "world",
            "2001:db8::/32": "v6-doc",
        }
    )
    assert table.lookup(parse_ip("10.1.2.3")) == "cn-east-hot"
    assert table.lookup(parse_ip("10.1.9.9")) == "cn-east"
    assert table.lookup(parse_ip("10.200.0.1")) == "internal"
    assert table.lookup(parse_ip("8.8.8.8")) == "world"
    assert table.lookup(parse_ip("2001:db8::5")) == "v6-doc"
    assert table.lookup(parse_ip("2001:db9::5")) is None
    assert table.lookup(None) is None


def test_invalid_cidr_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/33"):
        RegionTable([("10.0.0.0/33", "bad")])


networks = st.one_of(
    st.tuples(st.ip_addresses(v=4), st.integers(0, 32)),
    st.tuples(st.ip_addresses(v=6), st.integers(0, 128)),
).map(lambda t: ipaddress.ip_network(t, strict=False))


@given(st.lists(networks, max_size=12, unique=True), ips)
def test_lookup_matches_brute_force(nets: list[ipaddress.IPv4Network], ip: IPAddress) -> None:
    table = RegionTable((str(n), f"r{i}") for i, n in enumerate(nets))
    containing = [(n.prefixlen, i) for i, n in enumerate(nets) if ip in n]
    expected = f"r{max(containing)[1]}" if containing else None
    assert table.lookup(ip) == expected
