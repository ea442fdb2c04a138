"""Client address from X-Forwarded-For and CIDR → region lookup."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.ingress.policy.filters.geo import (
    MAX_FORWARDED_HOPS,
    ClientAddress,
    IPAddress,
    RegionTable,
    TrustedProxies,
    _from_the_right,
    client_address,
    forwarded_entries,
    parse_ip,
)

pytestmark = pytest.mark.unit

ips = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))
junk = st.sampled_from(["unknown", "_hidden", "", "999.1.1.1", "1.2.3", "[::1", "not an ip"])


networks = st.one_of(
    st.tuples(st.ip_addresses(v=4), st.integers(0, 32)),
    st.tuples(st.ip_addresses(v=6), st.integers(0, 128)),
).map(lambda t: ipaddress.ip_network(t, strict=False))


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


# Trusted proxy networks for the properties below: documentation and private ranges,
# IPv4 and IPv6. Addresses drawn outside them are "the internet".
TRUSTED = TrustedProxies(["10.0.0.0/8", "192.0.2.0/24", "fd00::/8", "127.0.0.1/32"])
trusted_ips = st.one_of(
    st.integers(0, 2**24 - 1).map(lambda i: ipaddress.IPv4Address(0x0A000000 + i)),
    st.integers(0, 255).map(lambda i: ipaddress.IPv4Address(0xC0000200 + i)),
    st.integers(0, 2**120 - 1).map(lambda i: ipaddress.IPv6Address((0xFD << 120) + i)),
    st.just(ipaddress.IPv4Address("127.0.0.1")),
)


def canonical(ip: IPAddress) -> IPAddress:
    return ip.ipv4_mapped if ip.version == 6 and ip.ipv4_mapped else ip


untrusted_ips = ips.filter(lambda ip: canonical(ip) not in TRUSTED)
any_header = st.lists(st.one_of(ips.map(str), junk), max_size=6).map(", ".join)


@given(
    attacker=untrusted_ips,
    forged=st.one_of(st.none(), any_header, st.lists(any_header, max_size=3)),
)
def test_a_directly_connected_client_cannot_forge_its_address(
    attacker: IPAddress, forged: str | list[str] | None
) -> None:
    """The TCP peer is outside every trusted network: whatever X-Forwarded-For it sends
    (a victim's address, trusted addresses, garbage, several header lines), the answer
    is the peer, exactly as if it had sent none."""
    got = client_address(forged, str(attacker), TRUSTED)
    assert got == client_address(None, str(attacker), TRUSTED)
    assert got == ClientAddress(canonical(attacker), "peer")


@given(
    client=untrusted_ips,
    spoofed=st.lists(st.one_of(ips.map(str), junk), max_size=4),
    proxies=st.lists(trusted_ips, min_size=1, max_size=5),
    ports=st.booleans(),
)
def test_the_rightmost_untrusted_address_is_the_client(
    client: IPAddress, spoofed: list[str], proxies: list[IPAddress], ports: bool
) -> None:
    # The client sends any X-Forwarded-For it likes; each trusted proxy appends the
    # address it received the request from; the last proxy is the TCP peer.
    chain = [client, *proxies]
    xff = [*spoofed, *(show(hop, ports) for hop in chain[:-1])]
    peer = str(chain[-1])
    got = client_address(", ".join(xff), peer, TRUSTED)
    assert got == ClientAddress(canonical(client), "forwarded")
    # However the entries are split over header lines.
    lines = [", ".join(xff[:1]), ", ".join(xff[1:])]
    assert client_address(lines, peer, TRUSTED) == got


@given(
    entries=st.lists(st.one_of(ips, trusted_ips), max_size=8),
    peer=st.one_of(ips, trusted_ips),
    trusted=st.lists(st.sampled_from(["10.0.0.0/8", "fd00::/8", "0.0.0.0/1", "::/1"])),
)
def test_walk_matches_a_reference(
    entries: list[IPAddress], peer: IPAddress, trusted: list[str]
) -> None:
    """Against a direct statement of the rule, with any trusted set (the empty one
    included: then it is always the peer)."""
    nets = TrustedProxies(trusted)
    chain = [canonical(ip) for ip in [*entries, peer]]
    expected = ClientAddress(chain[-1], "peer")
    for i in range(len(chain) - 1, -1, -1):
        trusted_here = any(chain[i] in ipaddress.ip_network(n) for n in trusted)
        expected = ClientAddress(chain[i], "peer" if i == len(chain) - 1 else "forwarded")
        if not trusted_here:
            break
    assert client_address(", ".join(map(str, entries)), str(peer), nets) == expected


@given(xff=st.lists(ips.map(str), max_size=3), peer=ips)
def test_no_trusted_proxies_means_the_peer(xff: list[str], peer: IPAddress) -> None:
    got = client_address(", ".join(xff), str(peer), TrustedProxies())
    assert got == ClientAddress(canonical(peer), "peer")


def test_a_malformed_entry_stops_at_the_hop_that_appended_it() -> None:
    proxy = "10.0.0.5"
    # The peer (a trusted proxy) appended garbage: the proxy itself, not the forged
    # address to the left of the garbage.
    assert client_address("198.51.100.66, unknown", proxy, TRUSTED) == ClientAddress(
        ipaddress.ip_address(proxy), "peer"
    )
    # A second trusted proxy (10.0.0.9) appended the garbage: that proxy.
    assert client_address("198.51.100.66, garbage, 10.0.0.9", proxy, TRUSTED) == ClientAddress(
        ipaddress.ip_address("10.0.0.9"), "forwarded"
    )


def test_every_hop_trusted_or_too_many_hops_gives_the_last_one_reached() -> None:
    assert client_address("10.1.1.1, 10.2.2.2", "10.0.0.1", TRUSTED) == ClientAddress(
        ipaddress.ip_address("10.1.1.1"), "forwarded"
    )
    assert client_address(None, "10.0.0.1:443", TRUSTED) == ClientAddress(
        ipaddress.ip_address("10.0.0.1"), "peer"
    )
    # A header of thousands of trusted entries: only MAX_FORWARDED_HOPS are walked; the
    # entry that far from the right is the answer, the rest (the real left end) unread.
    hops = [f"10.0.{i // 256}.{i % 256}" for i in range(5000)]
    got = client_address(
        ["203.0.113.9, " + ", ".join(hops[:100]), ", ".join(hops[100:])], "10.0.0.1", TRUSTED
    )
    assert got == ClientAddress(ipaddress.ip_address(hops[-MAX_FORWARDED_HOPS]), "forwarded")


def test_entries_are_walked_right_to_left_within_the_bound() -> None:
    assert list(_from_the_right(["1, 2", " 3 ,, 4"], 10)) == ["4", "3", "2", "1"]
    assert list(_from_the_right(["1, 2", "3, 4"], 3)) == ["4", "3", "2"]
    assert list(_from_the_right("1,2,3,4,5", 2)) == ["5", "4"]
    assert list(_from_the_right("1,,,,5", 3)) == ["5"]  # empty entries count
    assert list(_from_the_right(None, 3)) == []


def test_an_unknown_peer_is_unknown_whatever_the_header() -> None:
    assert client_address("198.51.100.66", None, TRUSTED) == ClientAddress(None, "none")
    assert client_address("198.51.100.66", "unix:/tmp/sock", TRUSTED) == ClientAddress(None, "none")


def test_trusted_proxies_membership() -> None:
    nets = TrustedProxies(["10.1.2.3/8", " 2001:db8::/32 ", "", "192.0.2.7"])
    assert [str(n) for n in nets.networks] == ["10.0.0.0/8", "2001:db8::/32", "192.0.2.7/32"]
    assert ipaddress.ip_address("10.255.0.1") in nets
    assert ipaddress.ip_address("11.0.0.1") not in nets
    assert ipaddress.ip_address("192.0.2.7") in nets
    assert ipaddress.ip_address("192.0.2.8") not in nets
    assert ipaddress.ip_address("2001:db8::1") in nets
    assert ipaddress.ip_address("2001:db9::1") not in nets
    assert nets
    assert not TrustedProxies()
    with pytest.raises(ValueError, match=r"10\.0\.0\.0/33"):
        TrustedProxies(["10.0.0.0/33"])


@given(st.lists(networks, max_size=6), ips)
def test_membership_matches_ipaddress(
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network], ip: IPAddress
) -> None:
    assert (ip in TrustedProxies(map(str, nets))) == any(ip in n for n in nets)


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


@given(st.lists(networks, max_size=12, unique=True), ips)
def test_lookup_matches_brute_force(nets: list[ipaddress.IPv4Network], ip: IPAddress) -> None:
    table = RegionTable((str(n), f"r{i}") for i, n in enumerate(nets))
    containing = [(n.prefixlen, i) for i, n in enumerate(nets) if ip in n]
    expected = f"r{max(containing)[1]}" if containing else None
    assert table.lookup(ip) == expected
