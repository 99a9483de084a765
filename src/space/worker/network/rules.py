"""nftables rule sets: one for each sandbox namespace, one for the host.

Guest traffic path: guest (tap `g0`) → sandbox namespace (forwards only TCP and DNS, masquerades
to its unique veth address) → host veth → host `prerouting` redirects TCP to the gateway's proxy
port and UDP/53 to its resolver. The redirect happens in the host namespace because the gateway
reads the original destination (SO_ORIGINAL_DST) from the host's conntrack.
"""

from __future__ import annotations

import subprocess

GUEST_LINK = "g0"
HOST_LINK = "h0"  # inside the sandbox namespace; its peer in the host is named per sandbox
GUEST_MAC = "02:00:00:00:00:01"
GUEST_IP = "10.0.2.2"
GATEWAY_IP = "10.0.2.1"
GUEST_PREFIX = 30
GUEST_IP6 = "fd00:5ace::2"
GATEWAY_IP6 = "fd00:5ace::1"


class NetworkError(Exception):
    """A sandbox's network could not be set up or torn down."""


def sandbox_ruleset(host_ip: str) -> str:
    """The namespace's rules; `host_ip` is the host end of its veth (where DNS is sent)."""
    return f"""
table netdev space_guard
delete table netdev space_guard
table netdev space_guard {{
    # Anti-spoofing: only the guest's MAC, and on it only its IPv4 address and honest ARP.
    chain ingress {{
        type filter hook ingress device "{GUEST_LINK}" priority -500; policy drop;
        ether saddr != {GUEST_MAC} drop
        ether type arp arp htype 1 arp ptype ip arp saddr ether {GUEST_MAC} \
            arp saddr ip {GUEST_IP} accept
        ether type ip ip saddr {GUEST_IP} accept
    }}
}}
table inet space
delete table inet space
table inet space {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{GUEST_LINK}" udp dport 53 dnat ip to {host_ip}
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{GUEST_LINK}" oifname "{HOST_LINK}" meta nfproto ipv4 meta l4proto tcp \
            ct state new accept
        iifname "{GUEST_LINK}" oifname "{HOST_LINK}" meta nfproto ipv4 udp dport 53 accept
    }}
    chain input {{
        type filter hook input priority filter; policy drop;
        iifname "lo" accept
        ct state established,related accept
    }}
    chain output {{
        type filter hook output priority filter; policy drop;
        oifname "lo" accept
        ct state established,related accept
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{HOST_LINK}" masquerade
    }}
}}
"""


def host_ruleset(
    table: str, link_glob: str, host_range: str, proxy_port: int, dns_port: int
) -> str:
    """The host's rules for every sandbox veth (`link_glob`, e.g. `sp-*`)."""
    return f"""
table inet {table}
delete table inet {table}
table inet {table} {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "{link_glob}" ip saddr {host_range} meta l4proto tcp redirect to :{proxy_port}
        iifname "{link_glob}" ip saddr {host_range} udp dport 53 redirect to :{dns_port}
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        # From a sandbox: only what was redirected to the gateway; the host is not reachable.
        iifname "{link_glob}" ct state established,related accept
        iifname "{link_glob}" ct status dnat tcp dport {proxy_port} accept
        iifname "{link_glob}" ct status dnat udp dport {dns_port} accept
        iifname "{link_glob}" drop
        # The gateway's ports are for sandboxes only.
        tcp dport {proxy_port} drop
        udp dport {dns_port} drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{link_glob}" drop
        oifname "{link_glob}" drop
    }}
}}
"""


def nft(ruleset: str) -> None:
    """Load `ruleset` atomically with `nft -f -`, in the calling thread's namespace."""
    proc = subprocess.run(
        ["nft", "-f", "-"], input=ruleset.encode(), capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise NetworkError(f"nft failed: {proc.stderr.decode(errors='replace').strip()}")
