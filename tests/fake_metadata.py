"""A fake cloud metadata server (AWS IMDSv2 or GCP) for the preemption watcher's tests."""

import asyncio
import http.server
import threading
import time


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
