"""A real telemetry publisher in its own process, for tests that kill it.

    python tests/integration/publish_status.py URL SWARM PEER [INTERVAL]

Publishes a fixed NodeStatus through node.ops.telemetry, prints `published` after the first
publish, runs until SIGTERM (clean stop: publishes offline) or SIGKILL (the last will does).
"""

import asyncio
import signal
import sys

from node.ops.status import NodeStatus
from node.ops.telemetry import TelemetryPublisher


async def main(url: str, swarm: str, peer: str, interval: float) -> None:
    status = NodeStatus(peer_id=peer, swarm=swarm, protocol="noloco", state="training",
                        round=3, step=300, tokens_per_second=1000.0, rounds_per_minute=2.0)
    publisher = TelemetryPublisher(url, swarm, peer, status.to_dict, interval=interval)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    publisher.start()
    await publisher.first_publish.wait()
    print("published", flush=True)
    await stop.wait()
    await publisher.stop()


if __name__ == "__main__":
    url, swarm, peer = sys.argv[1:4]
    asyncio.run(main(url, swarm, peer, float(sys.argv[4]) if len(sys.argv) > 4 else 0.5))
