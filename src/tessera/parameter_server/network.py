"""Where the parameter server's RPC listens: the network interface that holds ``ps.address``.

Every role's TensorPipe agent listens on its "uv" transport (one TCP socket) and on its "mpt_uv" channel
(one TCP socket per lane); it also has a "shm" transport on an abstract UNIX socket, which only processes
on this machine reach. TensorPipe binds the TCP sockets to the first address of the interface named by
``TP_SOCKET_IFNAME`` or, without it, to the address the machine's hostname resolves to, usually a
network address. So each role sets ``TP_SOCKET_IFNAME`` to the interface of ``ps.address`` before it
starts RPC (lo for the default 127.0.0.1): the listeners follow the configured address, and by default
nothing is reachable from another machine. (A variable of TensorPipe's, set in processes tessera
started; it switches nothing of tessera's.)

The interface is found with Linux's ``SIOCGIFADDR`` (an interface's first IPv4 address, the one
TensorPipe takes); an address that is not such an address is refused before any process starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from tessera.errors import ConfigError

TENSORPIPE_IFNAME = "TP_SOCKET_IFNAME"  # read by TensorPipe when its RPC agent starts
_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: get an interface's (first) IPv4 address


def interface_address(ifname: str) -> str | None:
    """The first IPv4 address of interface ``ifname``, or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (address at +4)


def listen_interface(address: str) -> tuple[str, str]:
    """(interface, IPv4 address) for ``address`` (a name is resolved first): the interface whose first
    IPv4 address it is. ConfigError when there is none, so that nothing listens where the user did not ask."""
    try:
        resolved = socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"ps.address '{address}' is not an IPv4 address of this machine (it does not "
                          f"resolve to one); use 127.0.0.1 or the address of one of its interfaces") from None
    if ipaddress.ip_address(resolved).is_unspecified:
        raise ConfigError(f"ps.address '{address}' means every interface; the RPC listeners bind to one: "
                          f"use 127.0.0.1 or the address of one of this machine's interfaces")
    for _, name in socket.if_nameindex():
        if interface_address(name) == resolved:
            return name, resolved
    raise ConfigError(f"ps.address '{address}' is not the (first) IPv4 address of any network interface of "
                      f"this machine; use 127.0.0.1 or one of: {', '.join(local_addresses())}")


def local_addresses() -> list[str]:
    """Every interface's first IPv4 address on this machine."""
    found = (interface_address(name) for _, name in socket.if_nameindex())
    return sorted({a for a in found if a})


def bind_rpc_to(ifname: str) -> None:
    """In a role's own process, before ``rpc.init_rpc``: TensorPipe's TCP listeners on ``ifname``."""
    os.environ[TENSORPIPE_IFNAME] = ifname
