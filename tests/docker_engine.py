"""A private Docker engine for tests, a stand-in base image, and a wheelhouse for offline builds.

`PrivateEngine` starts Debian's `dockerd` with its own data root, exec root, unix socket and
pidfile, so it shares nothing with any other engine on the machine; it touches no firewall
(`--iptables=false`, no IP masquerading, no forwarding) and makes no `docker0` (`--bridge=none`):
containers talk over one user-defined bridge that the test names. `stop()` removes what it made
and `leftovers()` says what is still there (processes, mounts, links, rules, sysctls).

No image registry is reachable here, so the base image is a stand-in: `debootstrap` makes a
minimal Debian bookworm with python3, imported under the base image's tag and labelled as a
stand-in. Debian's python3 (3.11.2) stands in for the official image's 3.11.x.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TAG = "lcd"  # prefix of every name this module gives (bridge, network, volumes, containers)
DOCKER = "/usr/bin/docker"  # Debian's CLI: its BuildKit is built in (a newer CLI needs buildx)
DOCKERD = "/usr/sbin/dockerd"
STANDIN_LABEL = "org.lowcomm-node.stand-in"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lowcomm-node"


class EngineError(RuntimeError):
    """The engine or a docker command failed; the message has its output."""


def missing_tools() -> str | None:
    """Why the engine cannot run here, or None."""
    if os.geteuid() != 0:
        return "the Docker smoke test runs its own dockerd, which needs root"
    for tool in (DOCKERD, DOCKER, "/usr/sbin/debootstrap"):
        if not Path(tool).exists():
            return (f"{tool} is missing: .ci/setup installs docker.io and debootstrap with "
                    f"apt-get (root only)")
    return None


def host_state() -> dict:
    """What the engine could leave behind on the host: compared before and after."""
    rules = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    return {"nft": rules.stdout if rules.returncode == 0 else "(nft not available)",
            "links": sorted(line.split(":")[1].strip().split("@")[0]
                            for line in links.stdout.splitlines()),
            "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()}


class PrivateEngine:
    def __init__(self, root: Path | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix=f"{TAG}-", dir="/tmp"))
        self.socket = self.root / "docker.sock"
        self.process: subprocess.Popen | None = None
        self.stop_phases: dict[str, float] = {}
        self.before = host_state()
        self.log = self.root / "dockerd.log"

    # ------------------------------------------------------------------ life
    def start(self, timeout_s: float = 60) -> "PrivateEngine":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [DOCKERD, "--data-root", str(self.root / "data"), "--exec-root",
                 str(self.root / "exec"), "-H", f"unix://{self.socket}", "--pidfile",
                 str(self.root / "docker.pid"), "--iptables=false", "--ip-masq=false",
                 "--ip-forward=false", "--bridge=none", "--log-level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"dockerd exited ({self.process.returncode}): {self.tail()}")
            if self.socket.exists() and self.docker("version", check=False,
                                                    timeout=10).returncode == 0:
                return self
            time.sleep(0.5)
        raise EngineError(f"dockerd did not answer within {timeout_s:.0f}s: {self.tail()}")

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Containers, networks and the engine go; then its mounts, links and files."""
        started = time.monotonic()
        if self.process is not None and self.process.poll() is None:
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", "-v", *ids, check=False, timeout=120)
            for net in self.docker("network", "ls", "-q", "--filter", f"name={TAG}-",
                                   check=False, timeout=30).stdout.split():
                self.docker("network", "rm", net, check=False, timeout=30)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.stop_phases = {"engine_s": round(time.monotonic() - started, 1)}
        unmount_under(self.root)
        for link in set(host_state()["links"]) - set(self.before["links"]):
            if link.startswith(TAG):
                subprocess.run(["ip", "link", "delete", link], capture_output=True)
        remove_tree(self.root)
        self.stop_phases["files_s"] = round(time.monotonic() - started, 1)

    def leftovers(self) -> list[str]:
        """What the engine left on the host; empty when it cleaned up after itself."""
        found = []
        root = str(self.root)
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                if root.encode() in cmdline:
                    found.append(f"process {pid}: {cmdline.decode(errors='replace')[:120]}")
        found += [f"mount {m}" for m in mounts_under(self.root)]
        after = host_state()
        found += [f"link {link}" for link in set(after["links"]) - set(self.before["links"])]
        if after["nft"] != self.before["nft"]:
            found.append("the nft ruleset changed")
        if after["ip_forward"] != self.before["ip_forward"]:
            found.append(f"net.ipv4.ip_forward changed to {after['ip_forward']}")
        return found

    # ------------------------------------------------------------------ commands
    def docker(self, *args: str, check: bool = True, timeout: float = 120,
               input: bytes | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "DOCKER_BUILDKIT": "1", "DOCKER_CONFIG": str(self.root / "config")}
        result = subprocess.run([DOCKER, "-H", f"unix://{self.socket}", *args], env=env,
                                capture_output=True, timeout=timeout, input=input,
                                text=input is None)
        if check and result.returncode != 0:
            out = result.stdout + result.stderr
            out = out if isinstance(out, str) else out.decode(errors="replace")
            raise EngineError(f"docker {' '.join(args[:3])} failed ({result.returncode}): "
                              f"{out[-3000:]}")
        return result

    def inspect(self, name: str) -> dict:
        return json.loads(self.docker("inspect", name).stdout)[0]


# ---------------------------------------------------------------------- the stand-in base
def standin_rootfs_tar(timeout_s: float = 600) -> Path:
    """A minimal bookworm with python3 (debootstrap), as a tarball; cached between runs."""
    tar = CACHE / "standin-bookworm-python3.tar"
    if tar.exists():
        return tar
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = Path(tempfile.mkdtemp(prefix=f"{TAG}-rootfs-", dir=CACHE))
    try:
        subprocess.run(["/usr/sbin/debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,ca-certificates", "bookworm",
                        str(rootfs), "http://deb.debian.org/debian"],
                       check=True, capture_output=True, timeout=timeout_s)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        partial = tar.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True,
                       timeout=timeout_s)
        partial.rename(tar)
    except subprocess.CalledProcessError as exc:
        raise EngineError(f"debootstrap failed: {exc.stderr.decode(errors='replace')[-2000:]}")
    finally:
        unmount_under(rootfs)  # debootstrap mounts /proc and /sys inside while it installs
        remove_tree(rootfs)
    return tar


def mounts_under(root: Path) -> list[str]:
    prefix = str(root)
    return [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1] == prefix or line.split()[1].startswith(prefix + "/")]


def remove_tree(root: Path) -> None:
    """rm -rf, never across a mount point (a mount left inside is not ours to empty)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], capture_output=True,
                   timeout=600)


def unmount_under(root: Path) -> None:
    for mount in reversed(mounts_under(root)):
        subprocess.run(["umount", "-l", mount], capture_output=True)


def import_standin(engine: PrivateEngine, tag: str) -> None:
    """The stand-in imported under `tag` (the Dockerfile's base), labelled as a stand-in."""
    tar = standin_rootfs_tar()
    changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "ENV LANG=C.UTF-8", 'CMD ["python3"]',
               f"LABEL {STANDIN_LABEL}=\"debootstrap bookworm + Debian python3, standing in "
               f"for {tag}\""]
    args = ["import"]
    for change in changes:
        args += ["--change", change]
    with open(tar, "rb") as f:
        engine.docker(*args, "-", tag, input=f.read(), timeout=300)


# ---------------------------------------------------------------------- the wheelhouse
def normalized(filename: str) -> str:
    """The project name of a wheel (name-version-...whl) or sdist (name-version.tar.gz)."""
    name = filename.split("-")[0] if filename.endswith(".whl") else filename.rsplit("-", 1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def fill_wheelhouse(wheelhouse: Path, lock: Path, torch_requirement: str) -> None:
    """Every distribution of `lock` (hashes checked by pip) and torch's CPU wheel, in a directory
    laid out as a simple index (wheelhouse/simple/<name>/index.html) that pip reads offline."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheelhouse),
           "--quiet"]

    def download(*args: str, check: bool = True) -> bool:
        done = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=900)
        if check and done.returncode != 0:
            raise EngineError(f"pip download {' '.join(args)} failed: {done.stderr[-2000:]}")
        return done.returncode == 0

    download("--require-hashes", "-r", str(lock))
    # An sdist in the lock (prefetch-generator) is built in the image: pip's isolated build
    # environment takes setuptools and wheel from the same index.
    download("--only-binary=:all:", "setuptools", "wheel")
    if not list(wheelhouse.glob("torch-*.whl")):
        # this machine's pip configuration first (a local wheel), then PyTorch's CPU index
        if not download(torch_requirement, check=False):
            download("--index-url", "https://download.pytorch.org/whl/cpu", torch_requirement)
    simple = wheelhouse / "simple"
    shutil.rmtree(simple, ignore_errors=True)
    for dist in sorted([*wheelhouse.glob("*.whl"), *wheelhouse.glob("*.tar.gz")]):
        page = simple / normalized(dist.name) / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        with open(page, "a") as f:
            f.write(f'<a href="../../{dist.name}">{dist.name}</a><br>\n')
