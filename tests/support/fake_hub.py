"""A local stand-in for the Hugging Face Hub's file API (what `huggingface_hub` downloads
through, with HF_ENDPOINT pointing here): one repository's files at one commit, served with
the headers the client reads, byte ranges for resumption, and faults on request."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def oid(data: bytes) -> str:
    """A file's id as git names a blob (what the Hub sends as its ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Serves every file under `model_dir` as repository `repo_id` at COMMIT, on a free port.

    `requests` counts the GETs of each file's bytes; `cut_once` names a file whose first
    GET stops halfway (the connection drops, as a network cut does); `seconds_per_file`
    slows each file down; `token`, when set, is the only bearer token accepted."""

    def __init__(self, repo_id: str, model_dir: Path, token: str | None = None) -> None:
        self.repo_id = repo_id
        self.files = {
            str(p.relative_to(model_dir)): p.read_bytes()
            for p in sorted(model_dir.rglob("*"))
            if p.is_file()
        }
        self.token = token
        self.requests: Counter[str] = Counter()
        self.ranges: list[tuple[str, int]] = []  # (file, first byte) of each resumed GET
        self.api_calls = 0  # repository info and file listings asked for
        self.cut_once: set[str] = set()
        self.seconds_per_file = 0.0  # how long each file's bytes take to send
        self.lock = threading.Lock()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, handler: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        if self.token is not None and handler.headers.get("Authorization") != (
            f"Bearer {self.token}"
        ):
            return self.send(handler, 401, b'{"error": "Invalid credentials"}', body)
        path = unquote(urlparse(handler.path).path)
        info = f"/api/models/{self.repo_id}/revision/"
        tree = f"/api/models/{self.repo_id}/tree/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith((tree, info)):
            with self.lock:
                self.api_calls += 1
        if path.startswith(tree):
            entries = [
                {"type": "file", "oid": oid(data), "size": len(data), "path": name}
                for name, data in self.files.items()
            ]
            return self.send(handler, 200, json.dumps(entries).encode(), body)
        if path.startswith(info):
            if path[len(info) :] not in ("main", COMMIT):
                headers = {"X-Error-Code": "RevisionNotFound"}
                return self.send(handler, 404, b'{"error": "Invalid rev id"}', body, headers)
            siblings = [{"rfilename": name, "size": len(d)} for name, d in self.files.items()]
            answer = {"id": self.repo_id, "sha": COMMIT, "siblings": siblings, "private": False}
            return self.send(handler, 200, json.dumps(answer).encode(), body)
        if path.startswith(resolve):
            name = path[len(resolve) :].split("/", 1)[1]
            if name not in self.files:
                headers = {"X-Error-Code": "EntryNotFound"}
                return self.send(handler, 404, b"{}", body, headers)
            return self.send_file(handler, name, body)
        self.send(
            handler,
            404,
            b'{"error": "Repository not found"}',
            body,
            {"X-Error-Code": "RepoNotFound"},
        )

    def send_file(self, handler: http.server.BaseHTTPRequestHandler, name: str, body: bool) -> None:
        data = self.files[name]
        headers = {
            "X-Repo-Commit": COMMIT,
            "ETag": f'"{oid(data)}"',
            "Accept-Ranges": "bytes",
        }
        start = 0
        wanted = handler.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            start = int(wanted[len("bytes=") :].split("-", 1)[0])
        if not body:
            return self.send(handler, 200, data, False, headers)
        with self.lock:
            self.requests[name] += 1
            if start:
                self.ranges.append((name, start))
            cut = name in self.cut_once
            self.cut_once.discard(name)
        part = data[start:]
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(part)))
        handler.end_headers()
        if cut:  # half the bytes, then the connection drops
            handler.wfile.write(part[: len(part) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        pieces = 20 if self.seconds_per_file else 1
        step = -(-len(part) // pieces)
        for i in range(0, len(part), step):
            handler.wfile.write(part[i : i + step])
            handler.wfile.flush()
            time.sleep(self.seconds_per_file / pieces)

    @staticmethod
    def send(
        handler: http.server.BaseHTTPRequestHandler,
        status: int,
        data: bytes,
        body: bool,
        headers: dict[str, str] | None = None,
    ) -> None:
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
