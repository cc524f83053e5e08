"""A shaped link between two network namespaces, for benchmarks that need a WAN on one machine.

    with ShapedLink(rate="100mbit") as link:                  # needs root (ip netns, tc)
        relay = link.popen(link.b, [sys.executable, "benchmarks/netns.py", "relay",
                                    "--listen", f"{link.addr_b}:4001", "--target", "127.0.0.1:4000",
                                    "--delay-ms", "50"])
        server = link.popen(link.b, [...listen on 127.0.0.1:4000...])
        client = link.popen(link.a, [...connect to {link.addr_b}:4001...])

Two namespaces joined by a veth pair; each veth end gets a tbf qdisc at `rate` (both
directions shaped). Latency: this kernel has no netem, so a small asyncio TCP relay adds a
fixed delay to every byte in each direction (`relay` subcommand, run inside a namespace in front
of the real listener). The relay holds at most `--max-buffer` bytes per direction and stops
reading beyond that, so TCP's flow control still works end to end.

Clean-up: the namespaces (and with them the veth pair and qdiscs) are deleted on exit from the
`with` block, on SIGINT/SIGTERM/SIGHUP (a handler turns them into SystemExit so `finally` runs),
and by `atexit`; namespaces left by a crashed earlier run (their creator pid is gone) are swept
on the next start. Names are `lcbench-<pid>-a` / `-b`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import signal
import subprocess
import time
from collections import deque

PREFIX = "lcbench-"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def sweep_stale_namespaces() -> list[str]:
    """Delete lcbench namespaces whose creating process no longer exists."""
    removed = []
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
            continue  # its creator is alive: not ours to touch
        except (ValueError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


class ShapedLink:
    """Namespaces `a` and `b` on a veth pair, each direction limited to `rate` by tbf."""

    def __init__(self, rate: str = "100mbit", subnet: str = "10.77.0", burst: str = "128kb",
                 queue_latency: str = "100ms"):
        tag = f"{PREFIX}{os.getpid()}"
        self.a, self.b = f"{tag}-a", f"{tag}-b"
        self.addr_a, self.addr_b = f"{subnet}.1", f"{subnet}.2"
        self.rate, self.burst, self.queue_latency = rate, burst, queue_latency
        self._veth = (f"lcv{os.getpid() % 100000}a", f"lcv{os.getpid() % 100000}b")
        self._processes: list[subprocess.Popen] = []
        self._created = False
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> "ShapedLink":
        if os.geteuid() != 0:
            raise PermissionError("the shaped link needs root (ip netns, tc); run the benchmark as root.")
        sweep_stale_namespaces()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        raise SystemExit(128 + signum)

    def _create(self) -> None:
        veth_a, veth_b = self._veth
        self._created = True
        _run("ip", "netns", "add", self.a)
        _run("ip", "netns", "add", self.b)
        _run("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for namespace, veth, address in ((self.a, veth_a, self.addr_a), (self.b, veth_b, self.addr_b)):
            _run("ip", "link", "set", veth, "netns", namespace)
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
            _run("ip", "-n", namespace, "link", "set", veth, "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                 "rate", self.rate, "burst", self.burst, "latency", self.queue_latency)

    def popen(self, namespace: str, argv: list[str], **options) -> subprocess.Popen:
        """Start a process inside `namespace`; it is killed when the link closes."""
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], **options)
        self._processes.append(process)
        return process

    def qdisc_stats(self, namespace: str) -> str:
        veth = self._veth[0] if namespace == self.a else self._veth[1]
        return _run("ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", veth, check=False).stdout

    def close(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._processes.clear()
        if self._created:
            for namespace in (self.a, self.b):
                _run("ip", "netns", "del", namespace, check=False)
            self._created = False
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()


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
