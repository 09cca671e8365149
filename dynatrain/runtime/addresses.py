"""Whether a host is this machine's loopback: what a token-less endpoint (the control server, the rendezvous
store) is limited to."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (a name that does not resolve is not)."""
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        pass
    else:
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
