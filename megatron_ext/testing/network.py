# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Networking helpers for single-host test and example set-ups."""

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (for ``MASTER_PORT`` / ``tcp://`` init).

    Returns:
        int: the port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
