"""The daemon's local control socket: `lowcomm-node status` reads the live status through it.

A unix socket `control.sock` in the node's data directory, mode 0600 (only the owner of the
daemon can attach). The protocol is one request line, one JSON reply line, then close:

    status\\n   ->  {"ok": true, "status": {...NodeStatus.to_dict()...}}\\n
    other\\n    ->  {"ok": false, "error": "unknown request ..."}\\n

Server (in the daemon's event loop):

    server = ControlServer(data_dir, status.to_dict)
    await server.start()     # removes a stale socket; refuses if another daemon answers
    ...
    await server.stop()      # closes and unlinks the socket

Client (blocking, for the CLI): `query_status(data_dir)` returns the status dict or raises
`NoDaemonError` with one sentence a user can act on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any, Callable

from node.data_dir import DataDir
from node.ops.status import json_safe

MAX_REQUEST = 1024
REQUEST_TIMEOUT = 5.0
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), NUL included.
MAX_SOCKET_PATH = 103

log = logging.getLogger("lowcomm.control")


class NoDaemonError(RuntimeError):
    """No daemon answers on this data directory's control socket."""


class ControlSocketError(RuntimeError):
    """The control socket cannot be created (path too long, another daemon running)."""


def control_socket_path(data_dir: str | os.PathLike) -> Path:
    return DataDir(data_dir).control_socket


def _check_length(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ControlSocketError(
            f"the control socket path {path} is longer than a unix socket allows "
            f"({MAX_SOCKET_PATH} bytes); use a shorter data directory")


def _answers(path: Path, timeout: float = 1.0) -> bool:
    """Whether something listens on the socket file (a live daemon, not a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
            return True
        except OSError:
            return False


class ControlServer:
    def __init__(self, data_dir: str | os.PathLike, get_status: Callable[[], dict[str, Any]]):
        self.path = control_socket_path(data_dir)
        self.get_status = get_status
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None

    async def start(self) -> None:
        _check_length(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise ControlSocketError(
                    f"{self.path} exists and is not a socket; move it away and start again")
            if await asyncio.to_thread(_answers, self.path):
                raise ControlSocketError(
                    f"another lowcomm-node daemon is already running with data directory "
                    f"{self.path.parent} (it answers on {self.path})")
            log.info("removing stale control socket %s", self.path)
            self.path.unlink()
        # The socket is created 0600 (umask), then chmod'ed again in case the platform
        # ignores the umask for sockets: nobody else may read the status or, later, steer.
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._handle, path=os.fspath(self.path), limit=MAX_REQUEST)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._inode = self.path.stat().st_ino

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        try:
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        except asyncio.TimeoutError:
            pass
        self._server = None
        try:  # only our own socket: a successor may already have replaced it
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass

    async def __aenter__(self) -> "ControlServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT)
            except (asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError):
                return
            request = line.decode("utf-8", "replace").strip()
            if request == "status":
                try:
                    reply = {"ok": True, "status": self.get_status()}
                except Exception as exc:  # a bug in the getter must not kill the server
                    log.exception("status getter failed")
                    reply = {"ok": False, "error": f"the daemon could not read its status: "
                                                   f"{exc}"}
            else:
                reply = {"ok": False, "error": f"unknown request {request[:40]!r}; "
                                               f"this daemon answers 'status'"}
            writer.write(_dumps(reply).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()


def _dumps(obj: Any) -> str:
    # non-finite losses travel as null
    return json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False, default=str)


def request(data_dir: str | os.PathLike, line: str = "status",
            timeout: float = 5.0) -> dict[str, Any]:
    """Sends one request to the daemon and returns its parsed reply."""
    path = control_socket_path(data_dir)
    where = f"with data directory {Path(data_dir)}"
    if not path.exists():
        raise NoDaemonError(f"no lowcomm-node daemon is running {where} "
                            f"(no control socket at {path}).")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except PermissionError:
            raise NoDaemonError(f"cannot attach to the daemon {where}: permission denied on "
                                f"{path} (it belongs to another user).") from None
        except (ConnectionRefusedError, FileNotFoundError):
            raise NoDaemonError(f"no lowcomm-node daemon is running {where} "
                                f"(stale control socket at {path}).") from None
        except OSError as exc:
            raise NoDaemonError(f"cannot attach to the daemon {where}: {exc}.") from None
        try:
            sock.sendall(line.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (socket.timeout, OSError) as exc:
            raise NoDaemonError(f"the daemon {where} did not answer in {timeout:g} s "
                                f"({exc or 'timed out'}).") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise NoDaemonError(f"the daemon {where} sent an unreadable reply.") from None
    if not reply.get("ok"):
        raise RuntimeError(reply.get("error") or "the daemon refused the request")
    return reply


def query_status(data_dir: str | os.PathLike, timeout: float = 5.0) -> dict[str, Any]:
    return request(data_dir, "status", timeout)["status"]
