"""The spot preemption watcher against fake AWS and GCP metadata servers on loopback."""

import asyncio
import logging
import time

import pytest

from node.ops.preemption import PreemptionWatcher
from tests.fake_metadata import FakeMetadataServer

pytestmark = pytest.mark.integration
INTERVAL = 0.1


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
