"""Ports for the servers and rendezvous a test starts: random runs of bindable ports below the kernel's ephemeral
range, so that no client socket or gloo / Mooncake connection opened meanwhile (which the kernel numbers from that
range) can take a port between the test picking it and the server binding it."""
from __future__ import annotations

import contextlib
import random
import socket


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default low end


def free_port_run(n: int) -> int:
    """A base port with n consecutive ports bindable on 127.0.0.1, all below the ephemeral range."""
    top = min(_ephemeral_low(), 32768) - n
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, top)
        try:
            with contextlib.ExitStack() as stack:
                for i in range(n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports between 20000 and {top}")


def free_port() -> int:
    return free_port_run(1)
