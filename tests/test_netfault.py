"""The fault-injecting TCP proxy (sim/netfault.py) does what each fault says, against an echo
server and a real Redis."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest
import redis

from sim.netfault import FaultProxy

pytestmark = pytest.mark.timeout(30)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def proxy():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = FaultProxy("127.0.0.1", server.server_address[1])
    yield p
    p.close()
    server.shutdown()
    server.server_close()


def _connect(p: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", p.port), timeout=timeout)


def test_it_forwards_both_ways_and_delays_by_the_latency(proxy):
    with _connect(proxy) as s:
        s.sendall(b"ping")
        assert s.recv(16) == b"ping"
        proxy.set_latency(0.2)
        t0 = time.monotonic()
        s.sendall(b"slow")
        assert s.recv(16) == b"slow"
        assert time.monotonic() - t0 >= 0.4  # 0.2 s each way


def test_a_blackhole_answers_nothing_and_closes_nothing_then_delivers(proxy):
    with _connect(proxy) as s:
        proxy.blackhole(True)
        time.sleep(0.1)
        s.sendall(b"lost?")
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.recv(16)  # no answer, and no close (recv would return b"")
        with _connect(proxy) as fresh:  # a new connection is accepted, and hangs too
            fresh.settimeout(0.3)
            fresh.sendall(b"new")
            with pytest.raises(socket.timeout):
                fresh.recv(16)
            proxy.blackhole(False)
            fresh.settimeout(5)
            assert fresh.recv(16) == b"new"
        s.settimeout(5)
        assert s.recv(16) == b"lost?"  # held, as TCP retransmits until the path heals


def test_a_reset_closes_every_connection_with_a_rst(proxy):
    with _connect(proxy) as s:
        s.sendall(b"x")
        assert s.recv(16) == b"x"
        assert proxy.reset() >= 1
        time.sleep(0.1)
        with pytest.raises(ConnectionResetError):
            s.sendall(b"y")
            s.recv(16)
    with _connect(proxy) as again:  # new connections work
        again.sendall(b"z")
        assert again.recv(16) == b"z"


@pytest.mark.redis
def test_redis_through_it(redis_url):
    host, port = redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
    p = FaultProxy(host, int(port))
    try:
        r = redis.Redis(host="127.0.0.1", port=p.port, socket_timeout=0.5)
        assert r.ping()
        p.blackhole(True)
        with pytest.raises(redis.TimeoutError):
            r.ping()
        p.blackhole(False)
        r.close()
        assert redis.Redis(host="127.0.0.1", port=p.port, socket_timeout=2).ping()
    finally:
        p.close()
