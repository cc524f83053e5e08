"""The status schema and its views: every field reaches the screen, in every layout."""

import asyncio
import json
import math
import threading
import time

import pytest
from rich.console import Console

from node.ops.status import DERIVED, SCHEMA_VERSION, NodeStatus
from node.ops.status_view import (StatusDisplay, StatusView, plain_line, sparkline, stragglers,
                              swarm_table)
from node.ops.telemetry import MqttUrlError, parse_mqtt_url, status_topic

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
PARTNER = "12D3KooWPartnerPeerIdForTheViewTestxxxxxxxxxxxxxZZ9"


def full_status(now: float) -> NodeStatus:
    s = NodeStatus(peer_id=PEER, swarm="tiny-swarm", protocol="dilocox", state="stopping",
                   started_at=now - 3725, round=17, step=4321, tokens_per_second=23456.0,
                   rounds_per_minute=1.75, device="cuda:0", device_name="Test GPU",
                   device_util_percent=87.0, device_memory_bytes=3 * 2**30,
                   device_memory_total_bytes=80 * 2**30, cpu_percent=143.0,
                   precision="fp16 with loss scaling: compute capability 7.5 has no bf16 units (< 8.0)",
                   compute="compiled (train.compile = auto)", micro_batch=24,
                   rss_bytes=1536 * 2**20, peers_known=9, peers_alive=7, partners=[PARTNER],
                   bytes_sent_round=5 * 2**20, bytes_received_round=6 * 2**20,
                   bytes_sent_total=700 * 2**20, bytes_received_total=800 * 2**20,
                   compression_ratio=12.5, refused={"bad_signature": 3, "wrong_manifest": 2},
                   last_exchange_at=now - 42, checkpoint_at=now - 185, checkpoint_step=4300)
    for loss in (4.0, 3.8, 3.7, 3.75, 3.5):
        s.record_train_loss(loss)
    for loss in (3.9, 3.6):
        s.record_val_loss(loss)
    return s


# What each layout must show, field by field (the view formats; these are its renderings).
EXPECTED = {
    "swarm": "tiny-swarm", "protocol": "dilocox", "state": "stopping", "round": "17",
    "step": "4321", "train_loss": "3.500", "val_loss": "3.600", "tokens_per_second": "23,456",
    "rounds_per_minute": "1.75", "device": "cuda:0 (Test GPU)", "device_util_percent": "87%",
    "device_memory": "3.0 GiB / 80.0 GiB",
    "precision": "fp16 with loss", "compute": "compiled", "micro_batch": "24 sequences", "cpu_percent": "143%", "rss_bytes": "1.5 GiB",
    "peers": "7 alive / 9 known", "bytes_sent_round": "5.0 MiB",
    "bytes_received_round": "6.0 MiB", "sent_total": "700.0 MiB", "recv_total": "800.0 MiB",
    "compression_ratio": "12.5x", "refused": "5 messages",
    "refused_signature": "bad_signature", "refused_manifest": "wrong_manifest",
    "refused_counts": "3", "last_exchange": "42s ago",
    "checkpoint_age": "3m05s ago", "checkpoint_step": "4300", "uptime": "1h02m",
}


def render(width: int, doc) -> str:
    console = Console(record=True, width=width, force_terminal=False, color_system=None)
    console.print(StatusView(doc))
    return console.export_text()


@pytest.mark.parametrize("width", [120, 60])
def test_every_field_is_drawn(width):
    now = time.time()
    text = render(width, full_status(now).to_dict(now))
    missing = {k: v for k, v in EXPECTED.items() if v not in text}
    assert not missing, f"width {width}: not drawn: {missing}\n{text}"
    assert ("12D3KooW" in text) and (PEER in text if width >= 80 else "…" in text)
    assert "12D3Ko…" in text  # the partner, shortened
    assert sparkline([4.0, 3.8, 3.7, 3.75, 3.5]) in text, "the loss trend is drawn"
    assert all(len(line) <= width for line in text.splitlines())


def test_narrow_and_wide_layouts_differ():
    doc = full_status(time.time()).to_dict()
    assert "╭" in render(120, doc)      # panels
    assert "╭" not in render(60, doc)   # one compact column


def test_plain_line_has_every_field_and_no_markup():
    now = time.time()
    line = plain_line(full_status(now).to_dict(now))
    assert "\n" not in line and "▁" not in line and "[" not in line
    for value in EXPECTED.values():
        assert value in line, value
    for part in ("refused_bad_signature=3", "refused_wrong_manifest=2", "checkpoint_step=4300",
                 "step=4321", "checkpoint_age=\"3m05s ago\""):
        assert part in line, part


def test_empty_status_renders():
    doc = NodeStatus().to_dict()
    for width in (120, 60):
        assert "never" in render(width, doc)
    assert "last_exchange=never" in plain_line(doc) and "refused_total=none" in plain_line(doc)


def test_schema_round_trip_and_json():
    now = time.time()
    s = full_status(now)
    s.record_train_loss(float("nan"))  # a diverged step must not break telemetry
    doc = json.loads(s.to_json(now))
    assert doc["schema"] == SCHEMA_VERSION and doc["train_loss"] is None
    assert doc["last_exchange_age_s"] == pytest.approx(42, abs=1)
    assert set(DERIVED) <= set(doc)
    back = NodeStatus.from_dict({**doc, "a_field_from_the_future": 1})
    assert back.round == 17 and back.refused == {"bad_signature": 3, "wrong_manifest": 2}
    with pytest.raises(TypeError):
        s.update(no_such_field=1)
    with pytest.raises(ValueError):
        s.update(state="dancing")


def test_updates_from_another_thread_are_consistent():
    s = NodeStatus()
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            s.count_refused(f"reason{i % 50}")
            s.record_train_loss(float(i))

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(300):
            json.loads(s.to_json())
    finally:
        stop.set()
        t.join()


def test_swarm_table_totals_and_stragglers():
    now = time.time()
    base = full_status(now).to_dict(now)
    fast = {**base, "peer_id": "12D3KooWfast", "tokens_per_second": 1000.0}
    mid = {**base, "peer_id": "12D3KooWmid", "tokens_per_second": 900.0}
    slow = {**base, "peer_id": "12D3KooWslow", "tokens_per_second": 100.0}
    gone = {**base, "peer_id": "12D3KooWgone", "online": False, "tokens_per_second": 1.0}
    docs = [fast, mid, slow, gone]
    assert stragglers(docs) == {"12D3KooWslow"}
    console = Console(record=True, width=160, color_system=None)
    console.print(swarm_table(docs, title="swarm tiny", now=now))
    text = console.export_text()
    for peer in ("fast", "mid", "slow *", "gone"):
        assert f"12D3KooW{peer}" in text
    assert "offline" in text and "3/4 online" in text and "2,000" in text  # summed tok/s
    assert "straggler" in text


def test_display_prints_plain_lines_when_not_a_terminal():
    console = Console(record=True, width=200, force_terminal=False)
    s = NodeStatus(peer_id=PEER, swarm="s", protocol="noloco")

    async def main():
        display = StatusDisplay(s.to_dict, console, refresh=0.01, plain_every=3600)
        task = asyncio.create_task(display.run())
        for r in (1, 2):
            await asyncio.sleep(0.05)
            s.update(round=r)
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    lines = console.export_text().splitlines()
    assert [line.split("round=")[1].split()[0] for line in lines] == ["0", "1", "2"]


@pytest.mark.parametrize("url,host,port,tls,user,password", [
    ("mqtt://broker", "broker", 1883, False, None, None),
    ("mqtts://broker.example:9999", "broker.example", 9999, True, None, None),
    ("mqtt://al%40ice:p%3Ass@10.0.0.1:1884", "10.0.0.1", 1884, False, "al@ice", "p:ss"),
])
def test_mqtt_urls(url, host, port, tls, user, password):
    t = parse_mqtt_url(url)
    assert (t.host, t.port, t.tls, t.username, t.password) == (host, port, tls, user, password)
    assert "ss" not in t.display().split("@")[-1] and "p:ss" not in repr(t)


@pytest.mark.parametrize("url,words", [
    ("http://broker", "scheme"), ("mqtt://", "no host"), ("mqtt://h:99999", "port"),
    ("mqtt://h/topic", "path"), ("mqtt://h?x=1", "unknown option"),
])
def test_bad_mqtt_urls_say_why(url, words):
    with pytest.raises(MqttUrlError, match=words):
        parse_mqtt_url(url)


def test_topic_levels_are_checked():
    assert status_topic("s", "p") == "lowcomm/s/p/status"
    for bad in ("", "a/b", "a+", "#"):
        with pytest.raises(ValueError):
            status_topic(bad, "p")


def test_sparkline_shapes():
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2, 2]) == "▄▄" and sparkline([1]) == "" and sparkline([]) == ""
    assert math.isnan(float("nan")) and sparkline([1.0, None, 2.0]) == "▁█"


def test_swarm_table_drops_columns_to_fit():
    now = time.time()
    docs = [{**full_status(now).to_dict(now), "peer_id": f"12D3KooWnode{i}"} for i in range(3)]
    for width, present, absent in ((160, ("ckpt", "ratio", "step"), ()),
                                   (80, ("tok/s", "loss", "round"), ("ckpt",)),
                                   (50, ("tok/s", "loss", "round"), ("ckpt", "state"))):
        console = Console(record=True, width=width, color_system=None)
        console.print(swarm_table(docs, title="swarm tiny", now=now))
        text = console.export_text()
        assert "3/3 online" in text and "…" not in text.split("online")[0].splitlines()[-1]
        assert all(f"12D3KooWnode{i}" in text for i in range(3)), text
        assert all(c in text for c in present) and not any(c in text for c in absent), text


def test_display_is_live_on_a_terminal_and_logs_print_above_it():
    import logging

    console = Console(record=True, width=100, force_terminal=True, color_system=None)
    s = NodeStatus(peer_id=PEER, swarm="live-swarm", protocol="noloco")
    display = StatusDisplay(s.to_dict, console, refresh=0.01)
    logger = logging.getLogger("test.status_view.live")
    logger.propagate = False
    logger.addHandler(display.log_handler())

    async def main():
        task = asyncio.create_task(display.run())
        await asyncio.sleep(0.05)
        s.update(round=41)
        logger.warning("a log line during the live view")
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        logger.handlers.clear()
    text = console.export_text()
    assert "live-swarm" in text and "41" in text and "a log line during the live view" in text


def test_a_link_too_slow_for_the_swarm_is_shown_until_it_carries_the_rounds_again():
    from node.events import EventBus, LinkJudged
    from node.ops.status_feed import StatusFeed
    status = NodeStatus(peer_id=PEER, swarm="tiny-swarm", protocol="noloco")
    bus = EventBus()
    StatusFeed(status, param_bytes=4, snapshot_sets=1, traffic=lambda: (0, 0),
               peers_known=lambda: 0).subscribe(bus)
    sentence = "this node's link, 0.3 Mbit/s as its last swaps measured it, is too slow for swarm 'x'."
    bus.publish(LinkJudged(round=1, level="slower", measured_mbit=0.3, round_seconds=10.0, text=sentence))
    assert status.to_dict()["link"] == sentence
    assert sentence in " ".join(render(60, status.to_dict()).split())  # wrapped in the value column
    bus.publish(LinkJudged(round=5, level="ok", measured_mbit=8.0, round_seconds=10.0, text="carries"))
    assert status.to_dict()["link"] == "" and "measured it" not in render(60, status.to_dict())
