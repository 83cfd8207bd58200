# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

import socket

from megatron_ext.testing.network import free_port


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
