"""Plain sockets for the raw and span rows: buffer sizes, connections, whole sends and receives."""

from __future__ import annotations

import socket

IOV = 256  # buffers per sendmsg call (IOV_MAX is 1024)
RAW_BUFFER = 256 << 20  # the raw socket's buffers; a larger KV is sent through them in turn
RAW_RECV = 4 << 20  # bytes per receive call of the raw row
_SOCKET_BUFFER = 4 << 20  # socket buffers of the raw and span rows: 64 KiB receives keep up with them


def memory(addr: int, nbytes: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")


def accepted(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    return conn


def connected(host: str, port: int) -> socket.socket:
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    return conn


def recv_into_all(conn: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        count = conn.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("the sender closed the connection early")
        received += count


def send_all(conn: socket.socket, buffers: list[memoryview]) -> None:
    """sendmsg until every buffer is out (a call may send part of them)."""
    while buffers:
        sent = conn.sendmsg(buffers)
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]
