"""Shaped links between network namespaces, for benchmarks that need a WAN on one machine.

    with ShapedSwarm(n=4, rate="20mbit", delay_ms=50) as swarm:    # needs root (ip netns, tc)
        swarm.relay(i, 4101, ("127.0.0.1", 4100))      # node i's listener, reached +50 ms each way
        swarm.popen(i, [sys.executable, ...listen on 127.0.0.1:4100, announce address(i):4101...])
        swarm.tx_bytes(i)                               # bytes node i put on its access link

Each node has its own namespace (`lcbench-<pid>-<i>`, address 10.78.0.<i+1>) whose `eth0` is
one end of a veth pair; the other ends sit on one Linux bridge in a namespace of their own
(`lcbench-<pid>-br`). tbf limits both ends of each pair to `rate`, so a node's upload and its
download are each its access link. Latency: this kernel has no netem, so a small asyncio TCP
relay (`relay` subcommand, started by ShapedSwarm.relay inside the node's namespace in front of
its real listener) holds every chunk back `delay_ms` in each direction; a connection to a node
through its relay therefore sees `delay_ms` one way and 2 x `delay_ms` round trip. The relay
holds at most `--max-buffer` bytes per direction and stops reading beyond that, so TCP's flow
control still works end to end. ShapedLink is the two-node case with the older names.

Clean-up: every namespace (and with them the veth pairs, bridge and qdiscs) and every process
started with popen/relay goes on exit from the `with` block, on SIGINT/SIGTERM/SIGHUP (a handler
turns them into SystemExit so `finally` runs), and by `atexit`; namespaces left by a crashed
earlier run (their creator pid is gone) are swept on the next start.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque

PREFIX = "lcbench-"


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate word (bit, kbit, mbit, gbit: powers of 1000)."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"a rate like 100mbit or 1800kbit, not {rate!r}")


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """`signum` to the process group `process` leads (it started it: start_new_session)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def sweep_stale_namespaces(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named `<prefix><pid>...` whose creating process no longer exists and in
    which nothing runs. The second check matters because a pid is only unique within one pid
    namespace: a run in a container sees another container's live creator as dead."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-")[0])
            os.kill(pid, 0)
            continue  # its creator is alive: not ours to touch
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        if _run("ip", "netns", "pids", name, check=False).stdout.strip():
            continue  # processes still run in it: some live run owns it
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


class NamespaceSet:
    """The life of a set of network namespaces made for one run: built on entry, and on exit (or
    SIGINT/SIGTERM/SIGHUP, turned into SystemExit so that `finally` runs, or atexit) every process
    started in them stopped, then every namespace deleted with its veths, qdiscs and rules.
    Subclasses name their namespaces `<prefix><pid>-...`, build them in `_build` and say in
    `unavailable` why they cannot be built here."""

    prefix = PREFIX
    stop_timeout_s = 0.0  # how long a process has to exit after SIGTERM before SIGKILL

    def __init__(self) -> None:
        self.tag = f"{self.prefix}{os.getpid()}"
        self._processes: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    def unavailable(self) -> str | None:
        return None if os.geteuid() == 0 else \
            "network namespaces need root (ip netns, tc); run this as root."

    def _build(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        reason = self.unavailable()
        if reason:
            raise PermissionError(reason)
        sweep_stale_namespaces(self.prefix)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        raise SystemExit(128 + signum)

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _popen_in(self, namespace: str, argv: list[str], **options) -> subprocess.Popen:
        """Start a process in `namespace`, in a process group of its own; the whole group is
        stopped when the set closes."""
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv],
                                   start_new_session=True, **options)
        self._processes.append(process)
        return process

    def close(self) -> None:
        # By group: hivemind's trainer runs its DHT and averager in child processes (and p2pd
        # under them), which outlived a trainer stopped alone: a capped time-to-loss run left
        # 12 of them running for 30 min, through the runs after it.
        for process in self._processes:
            _signal_group(process, signal.SIGTERM)
        for process in self._processes:
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process, signal.SIGKILL)  # what is left of the group, leader or not
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        for namespace in reversed(self._created):
            _run("ip", "netns", "del", namespace, check=False)
        self._created.clear()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()


class ShapedSwarm(NamespaceSet):
    """`n` namespaces on one bridge, each node's access link limited to `rate` both ways."""

    def __init__(self, n: int, rate: str = "100mbit", delay_ms: float = 0.0, subnet: str = "10.78.0",
                 burst: str = "128kb", queue_latency: str = "100ms", rates: dict[int, str] | None = None):
        """`rates`: nodes whose access link differs from `rate`, e.g. {3: "1mbit"}."""
        if not 1 <= n <= 200:
            raise ValueError(f"a shaped swarm has 1 to 200 nodes, not {n}")
        super().__init__()
        self.rates = [(rates or {}).get(i, rate) for i in range(n)]
        self.n, self.rate, self.delay_ms = n, rate, delay_ms
        self.namespaces = [f"{self.tag}-{i}" for i in range(n)]
        self.bridge_namespace = f"{self.tag}-br"
        self.subnet, self.burst, self.queue_latency = subnet, burst, queue_latency

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def _shape(self, namespace: str, device: str, rate: str) -> None:
        _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
             "rate", rate, "burst", self.burst, "latency", self.queue_latency)

    def _build(self) -> None:
        bridge = self.bridge_namespace
        self._namespace(bridge)
        _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, namespace in enumerate(self.namespaces):
            self._namespace(namespace)
            # made in the node's namespace so that no name can clash with the root namespace's
            _run("ip", "-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}",
                 "netns", bridge)
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", bridge, "link", "set", f"port{i}", "master", "br0")
            _run("ip", "-n", bridge, "link", "set", f"port{i}", "up")
            self._shape(namespace, "eth0", self.rates[i])     # the node's upload
            self._shape(bridge, f"port{i}", self.rates[i])    # its download

    def popen(self, i: int | str, argv: list[str], **options) -> subprocess.Popen:
        """Start a process inside node i's namespace (or a namespace by name); it is killed when
        the swarm closes."""
        return self._popen_in(self.namespaces[i] if isinstance(i, int) else i, argv, **options)

    def relay(self, i: int, listen_port: int, target: tuple[str, int]) -> subprocess.Popen:
        """A delaying relay on node i's address:`listen_port` in front of `target` (inside node
        i's namespace); returns once it listens."""
        process = self.popen(i, [sys.executable, os.path.abspath(__file__), "relay",
                                 "--listen", f"{self.address(i)}:{listen_port}",
                                 "--target", f"{target[0]}:{target[1]}", "--delay-ms", str(self.delay_ms)],
                             stdout=subprocess.PIPE, text=True)
        if not process.stdout.readline().startswith("relay"):
            raise RuntimeError(f"the delaying relay of node {i} did not start (exit {process.poll()})")
        return process

    def tx_bytes(self, i: int) -> int:
        """Bytes node i has sent on its access link (its eth0's counter)."""
        shown = json.loads(_run("ip", "-n", self.namespaces[i], "-j", "-s", "link", "show", "eth0").stdout)
        return int(shown[0]["stats64"]["tx"]["bytes"])

    def qdisc_stats(self, i: int | str) -> str:
        namespace = self.namespaces[i] if isinstance(i, int) else i
        return _run("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", "eth0",
                    check=False).stdout


class ShapedLink(ShapedSwarm):
    """Two shaped nodes, `a` and `b` (namespace names) at `addr_a` and `addr_b`."""

    def __init__(self, rate: str = "100mbit", **options):
        super().__init__(2, rate, **options)
        self.a, self.b = self.namespaces
        self.addr_a, self.addr_b = self.address(0), self.address(1)


# ---------------------------------------------------------------------------- delaying relay

async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, max_buffer: int) -> None:
    """Copy reader to writer, each chunk held back `delay_s`; read at most `max_buffer` ahead."""
    queue: deque[tuple[float, bytes]] = deque()
    buffered = 0
    space, data_ready = asyncio.Event(), asyncio.Event()
    space.set()
    done = False

    async def read_side():
        nonlocal buffered, done
        try:
            while True:
                await space.wait()
                chunk = await reader.read(64 * 1024)
                if not chunk:
                    return
                queue.append((time.monotonic() + delay_s, chunk))
                buffered += len(chunk)
                if buffered >= max_buffer:
                    space.clear()
                data_ready.set()
        except (ConnectionError, OSError):
            return
        finally:  # end of input, or a reset: let the writer flush what it holds and stop
            done = True
            data_ready.set()

    async def write_side():
        nonlocal buffered
        while True:
            if not queue:
                if done:
                    break
                data_ready.clear()
                await data_ready.wait()
                continue
            due, chunk = queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            queue.popleft()
            writer.write(chunk)
            await writer.drain()
            buffered -= len(chunk)
            if buffered < max_buffer:
                space.set()
        if writer.can_write_eof():
            writer.write_eof()

    reading = asyncio.create_task(read_side())
    try:
        await write_side()
    finally:
        reading.cancel()


async def relay(listen: tuple[str, int], target: tuple[str, int], delay_s: float, max_buffer: int) -> None:
    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*target)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(_pipe(client_reader, server_writer, delay_s, max_buffer),
                                 _pipe(server_reader, client_writer, delay_s, max_buffer))
        except (ConnectionError, OSError):
            pass
        finally:
            client_writer.close()
            server_writer.close()

    server = await asyncio.start_server(handle, *listen)
    print(f"relay {listen[0]}:{listen[1]} -> {target[0]}:{target[1]} (+{delay_s * 1000:.0f} ms)", flush=True)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description="delaying TCP relay (run inside a namespace)")
    parser.add_argument("command", choices=["relay", "sweep"])
    parser.add_argument("--listen", type=_address)
    parser.add_argument("--target", type=_address)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--max-buffer", type=int, default=8 << 20)
    args = parser.parse_args()
    if args.command == "sweep":
        print("removed:", sweep_stale_namespaces())
        return
    asyncio.run(relay(args.listen, args.target, args.delay_ms / 1000, args.max_buffer))


if __name__ == "__main__":
    main()
