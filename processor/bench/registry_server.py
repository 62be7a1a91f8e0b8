"""A small in-memory schema registry speaking the part of Confluent Schema Registry's REST API
that confluent-kafka's serializers and deserializers use, for ``bench kafka --format`` and the
broker tests of docs/operator-guide.md, "Formats and schema registries".

No Confluent-compatible registry installs from the package registries this project is built
with (Confluent's is not on Maven Central, Karapace not on PyPI, Apicurio's app needs a Quarkus
build), and confluent-kafka's own ``mock://`` registry lives inside one process, while a worker
is another process. This server stands in for the registry only: the records are written by
confluent-kafka's serializers and read by its deserializers, over HTTP(S) with basic auth, as
against a real registry. It keeps schemas in memory, assigns ids 1, 2, ... in registration order,
and answers: register (``POST /subjects/{s}/versions``), look up (``POST /subjects/{s}``), a
schema by id (``GET /schemas/ids/{id}``), a version or the latest (``GET
/subjects/{s}/versions/{v|latest}``) and the subjects (``GET /subjects``). It checks no
compatibility.
"""
from __future__ import annotations

import base64
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlparse


class RegistryServer:
    """``with RegistryServer() as url:`` a registry on a free local port until the block ends.
    ``user_info``: ``user:password`` every request must carry (basic auth); ``tls``: (certificate
    file, key file) to serve HTTPS."""

    def __init__(self, user_info: Optional[str] = None, tls: Optional[tuple[str, str]] = None, host: str = "127.0.0.1"):
        self.user_info, self.tls, self.host = user_info, tls, host
        self.schemas: list[dict] = []  # id - 1 -> {"schema", "schemaType", "references"}
        self.subjects: dict[str, list[int]] = {}  # subject -> ids by version
        self.lock = threading.Lock()
        self.httpd: Optional[ThreadingHTTPServer] = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                registry.answer(self, "GET")

            def do_POST(self) -> None:
                registry.answer(self, "POST")

        self.httpd = ThreadingHTTPServer((self.host, 0), Handler)
        if self.tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*self.tls)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{self.host}:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    # ------------------------------------------------------------------ requests
    def answer(self, request: BaseHTTPRequestHandler, method: str) -> None:
        if self.user_info is not None:
            expected = "Basic " + base64.b64encode(self.user_info.encode()).decode()
            if request.headers.get("Authorization") != expected:
                return self._send(request, 401, {"error_code": 40101, "message": "Unauthorized"})
        body = {}
        if method == "POST":
            length = int(request.headers.get("Content-Length") or 0)
            body = json.loads(request.rfile.read(length) or b"{}")
        parts = [unquote(p) for p in urlparse(request.path).path.strip("/").split("/")]
        with self.lock:
            status, answer = self._route(method, parts, body)
        self._send(request, status, answer)

    def _route(self, method: str, parts: list[str], body: dict) -> tuple[int, object]:
        not_found = (404, {"error_code": 40403, "message": "Schema not found"})
        if method == "GET" and parts[:2] == ["schemas", "ids"] and len(parts) == 3:
            sid = int(parts[2])
            return (200, dict(self.schemas[sid - 1])) if 0 < sid <= len(self.schemas) else not_found
        if method == "GET" and parts == ["subjects"]:
            return 200, sorted(self.subjects)
        if parts[:1] == ["subjects"] and len(parts) >= 2:
            subject = parts[1]
            ids = self.subjects.get(subject, [])
            if method == "POST" and len(parts) == 3 and parts[2] == "versions":
                sid = self._id_of(body)
                if sid not in ids:
                    ids.append(sid)
                    self.subjects[subject] = ids
                return 200, self._version(subject, ids.index(sid) + 1)
            if method == "POST" and len(parts) == 2:
                sid = self._id_of(body, register=False)
                return (200, self._version(subject, ids.index(sid) + 1)) if sid in ids else \
                    (404, {"error_code": 40403, "message": "Schema not found"})
            if method == "GET" and len(parts) == 4 and parts[2] == "versions":
                if not ids:
                    return 404, {"error_code": 40401, "message": "Subject not found"}
                version = len(ids) if parts[3] in ("latest", "-1") else int(parts[3])
                return (200, self._version(subject, version)) if 0 < version <= len(ids) else \
                    (404, {"error_code": 40402, "message": "Version not found"})
        return 404, {"error_code": 404, "message": "Not found"}

    def _id_of(self, body: dict, register: bool = True) -> Optional[int]:
        entry = {"schema": body["schema"], "schemaType": body.get("schemaType", "AVRO"), "references": body.get("references", [])}
        for i, known in enumerate(self.schemas):
            if known == entry:
                return i + 1
        if not register:
            return None
        self.schemas.append(entry)
        return len(self.schemas)

    def _version(self, subject: str, version: int) -> dict:
        sid = self.subjects[subject][version - 1]
        return {"subject": subject, "version": version, "id": sid, **self.schemas[sid - 1]}

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, answer: object) -> None:
        data = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
