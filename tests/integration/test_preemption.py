"""The spot preemption watcher against fake AWS and GCP metadata servers on loopback."""

import asyncio
import http.server
import logging
import threading
import time

import pytest

from node.preemption import PreemptionWatcher

pytestmark = pytest.mark.integration
INTERVAL = 0.1


class FakeMetadataServer:
    """A fake cloud metadata server (AWS IMDSv2 or GCP) in a thread on 127.0.0.1.

    `notice` flips the answer; `requests` counts the polls that reached it; `polled` is set
    at every poll so a test waits on it instead of sleeping."""

    def __init__(self, provider: str, port: int = 0):
        self.provider = provider
        self.notice = False
        self.requests = 0
        self.bad_requests: list[str] = []
        self.polled = threading.Event()
        self.tokens_issued = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                if fake.provider == "aws" and self.path == "/latest/api/token" and \
                        self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    fake.tokens_issued += 1
                    return self.reply(200, f"token-{fake.tokens_issued}")
                fake.bad_requests.append(f"PUT {self.path}")
                self.reply(400)

            def do_GET(self):
                if fake.provider == "aws":
                    ok = (self.path == "/latest/meta-data/spot/instance-action"
                          and self.headers.get("X-aws-ec2-metadata-token", "").startswith("token-"))
                    answer = (200, '{"action": "terminate", "time": "2030-01-01T00:02:00Z"}') \
                        if fake.notice else (404, "Not Found")
                else:
                    ok = (self.path == "/computeMetadata/v1/instance/preempted"
                          and self.headers.get("Metadata-Flavor") == "Google")
                    answer = (200, "TRUE" if fake.notice else "FALSE")
                if not ok:
                    fake.bad_requests.append(f"GET {self.path} {dict(self.headers)}")
                    return self.reply(401 if fake.provider == "aws" else 403)
                fake.requests += 1
                self.reply(*answer)
                fake.polled.set()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    async def wait_polls(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.requests < n:
            self.polled.clear()
            if self.requests >= n:
                break
            left = deadline - time.monotonic()
            if left <= 0 or not await asyncio.to_thread(self.polled.wait, left):
                raise AssertionError(f"only {self.requests} polls, expected {n}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def fake_metadata(request):
    servers = []

    def start(provider: str, port: int = 0) -> FakeMetadataServer:
        servers.append(FakeMetadataServer(provider, port))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_no_notice_no_callback_then_notice_within_the_interval(fake_metadata, provider):
    fake = fake_metadata(provider)
    calls = []

    async def main():
        fired = asyncio.Event()

        def on_notice(reason):
            calls.append((time.monotonic(), reason))
            fired.set()

        watcher = PreemptionWatcher(provider, on_notice, base_url=fake.url, interval=INTERVAL)
        task = watcher.start()
        try:
            await fake.wait_polls(3)  # three answered polls without a notice
            assert not calls and not task.done()
            fake.notice = True
            noticed_at = time.monotonic()
            await asyncio.wait_for(fired.wait(), 5)
            assert await asyncio.wait_for(task, 5) == calls[0][1]
            return calls[0][0] - noticed_at
        finally:
            await watcher.stop()

    delay = asyncio.run(main())
    assert len(calls) == 1 and not fake.bad_requests, fake.bad_requests
    assert delay < INTERVAL + 0.5, delay  # the next poll after the notice, plus a request
    assert ("AWS spot" if provider == "aws" else "GCP") in calls[0][1]
    if provider == "aws":
        assert "terminate" in calls[0][1]
        assert fake.tokens_issued == 1, "the IMDSv2 token is reused while valid"


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_server_down_keeps_polling_and_recovers(fake_metadata, provider, caplog):
    caplog.set_level(logging.WARNING, logger="lowcomm.preemption")
    fake = fake_metadata(provider)
    port = fake.port
    fake.close()  # nobody listens on the port now

    async def main():
        fired = asyncio.Event()

        async def on_notice(reason):  # a coroutine callback is awaited
            fired.set()

        watcher = PreemptionWatcher(provider, on_notice, base_url=f"http://127.0.0.1:{port}",
                                    interval=INTERVAL, timeout=1.0)
        task = watcher.start()
        try:
            deadline = time.monotonic() + 10
            while watcher.failures < 4:  # several failed polls...
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            assert len(caplog.records) == 1  # ...and a single warning about them
            revived = fake_metadata(provider, port)
            revived.notice = True
            await asyncio.wait_for(fired.wait(), 10)
            return await asyncio.wait_for(task, 5)
        finally:
            await watcher.stop()

    notice = asyncio.run(main())
    assert notice
    messages = [r.getMessage() for r in caplog.records]
    assert "still polling" in messages[0] and "answers again" in messages[1], messages


def test_aws_token_refresh_on_401(fake_metadata):
    fake = fake_metadata("aws")
    watcher = PreemptionWatcher("aws", lambda reason: None, base_url=fake.url, interval=INTERVAL)
    assert watcher.check_once() is None and fake.tokens_issued == 1
    watcher._token = "expired"  # as after the token's TTL: the server answers 401
    assert watcher.check_once() is None and fake.tokens_issued == 2


def test_unknown_provider_is_refused():
    with pytest.raises(ValueError, match="aws, gcp"):
        PreemptionWatcher("azure", print)
