"""Spot/preemptible instance notices: start the daemon's clean exit before the cloud kills it.

AWS gives a spot instance two minutes: `GET /latest/meta-data/spot/instance-action` answers
404 until a stop or terminate is scheduled, then 200 with {"action": ..., "time": ...}
(IMDSv2: a token from `PUT /latest/api/token` goes in X-aws-ec2-metadata-token). GCP gives
about 30 s: `GET /computeMetadata/v1/instance/preempted` (header Metadata-Flavor: Google)
answers "TRUE" once the instance is being preempted.

    watcher = PreemptionWatcher("aws", on_notice=daemon.request_stop)   # or "gcp"
    watcher.start()            # an asyncio task; polls every `interval` seconds
    ...
    await watcher.stop()

`on_notice(reason)` is called once (a plain function or a coroutine function), then the
watcher ends. HTTP goes through urllib in a worker thread, with no proxy (metadata is
link-local): a slow or absent metadata server never blocks the event loop. Errors are logged
once (and once when the server answers again); polling goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import urllib.error
import urllib.request
from typing import Any, Callable

log = logging.getLogger("lowcomm.preemption")

DEFAULT_BASE_URLS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal"}
AWS_TOKEN_TTL = 21600
PROVIDERS = tuple(DEFAULT_BASE_URLS)

# Metadata servers are link-local: an HTTP(S)_PROXY from the environment must not apply.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MetadataError(OSError):
    """The metadata server could not be asked or gave an answer we do not understand."""


def _http(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, str]:
    """One blocking request; returns (status, body) for any HTTP status, raises on no answer."""
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=b"" if method == "PUT" else None)
    try:
        with _opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(65536).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MetadataError(f"{method} {url}: {reason}") from None


class PreemptionWatcher:
    def __init__(self, provider: str, on_notice: Callable[[str], Any], *,
                 base_url: str | None = None, interval: float = 5.0, timeout: float = 2.0,
                 logger: logging.Logger | None = None):
        if provider not in PROVIDERS:
            raise ValueError(f"preemption provider {provider!r} is not one of "
                             f"{', '.join(PROVIDERS)}")
        self.provider = provider
        self.base_url = (base_url or DEFAULT_BASE_URLS[provider]).rstrip("/")
        self.on_notice = on_notice
        self.interval, self.timeout = interval, timeout
        self.log = logger or log
        self.polls = 0          # answered polls, for tests and the status view
        self.failures = 0       # polls that got no usable answer
        self.notice: str | None = None
        self._token: str | None = None
        self._failing = False
        self._task: asyncio.Task | None = None

    # ---- one poll (blocking: runs in a worker thread) ---------------------------------------
    def _aws_token(self) -> str | None:
        status, body = _http("PUT", f"{self.base_url}/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)},
                             self.timeout)
        if status == 200 and body.strip():
            return body.strip()
        return None  # IMDSv1-only or token refused: ask without one

    def _check_aws(self) -> str | None:
        url = f"{self.base_url}/latest/meta-data/spot/instance-action"
        for attempt in range(2):
            if self._token is None:
                self._token = self._aws_token()
            headers = {"X-aws-ec2-metadata-token": self._token} if self._token else {}
            status, body = _http("GET", url, headers, self.timeout)
            if status == 401 and attempt == 0:  # the token expired: fetch a new one
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status == 200:
            return f"AWS spot instance-action notice: {body.strip()[:200]}"
        raise MetadataError(f"GET {url}: unexpected HTTP {status}")

    def _check_gcp(self) -> str | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        status, body = _http("GET", url, {"Metadata-Flavor": "Google"}, self.timeout)
        if status != 200:
            raise MetadataError(f"GET {url}: unexpected HTTP {status}")
        return "GCP instance preempted" if body.strip().upper() == "TRUE" else None

    def check_once(self) -> str | None:
        """Asks the metadata server once: the notice text, or None when there is none."""
        return self._check_aws() if self.provider == "aws" else self._check_gcp()

    # ---- the task ------------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(),
                                                                name="preemption-watcher")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> str:
        """Polls until a notice arrives; calls on_notice once and returns the notice."""
        while True:
            try:
                notice = await asyncio.to_thread(self.check_once)
            except MetadataError as exc:
                self.failures += 1
                if not self._failing:
                    self.log.warning("preemption watcher: %s; still polling every %gs",
                                     exc, self.interval)
                    self._failing = True
            else:
                self.polls += 1
                if self._failing:
                    self.log.warning("preemption watcher: the %s metadata server answers "
                                     "again", self.provider)
                    self._failing = False
                if notice:
                    self.notice = notice
                    self.log.warning("%s: starting a clean exit", notice)
                    result = self.on_notice(notice)
                    if inspect.isawaitable(result):
                        await result
                    return notice
            await asyncio.sleep(self.interval)
