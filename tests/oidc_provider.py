"""A local OAuth 2.0 / OIDC provider for the OAUTHBEARER tests: a token endpoint granting client
credentials (RFC 6749 section 4.4) as RS256-signed JWTs (RFC 7519), and the JWKS endpoint
(RFC 7517) Apache Kafka's OAuthBearerValidatorCallbackHandler checks them against (KIP-768).
Test credentials only; signed with the ``cryptography`` package the product already pins."""
from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

#: what scripts/broker start-oauth expects of a token
AUDIENCE, ISSUER = "dpstream-test", "dpstream-test-issuer"
KEY_ID = "test-key-1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _uint(n: int) -> str:
    return _b64(n.to_bytes((n.bit_length() + 7) // 8, "big"))


class OidcProvider:
    """``/token`` (client id and secret by HTTP Basic or in the form) and ``/jwks``, on 127.0.0.1."""

    def __init__(self, client_id: str = "dpstream", client_secret: str = "oauth-test-secret", lifetime_s: int = 300):
        self.client_id, self.client_secret, self.lifetime_s = client_id, client_secret, lifetime_s
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.granted = 0
        self.refused = 0
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path != "/jwks":
                    return self._send(404, {})
                numbers = provider.key.public_key().public_numbers()
                self._send(200, {"keys": [{"kty": "RSA", "kid": KEY_ID, "use": "sig", "alg": "RS256",
                                           "n": _uint(numbers.n), "e": _uint(numbers.e)}]})

            def do_POST(self):  # noqa: N802
                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
                client = (form.get("client_id", [None])[0], form.get("client_secret", [None])[0])
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    user, _, secret = base64.b64decode(auth[6:]).decode().partition(":")
                    client = (urllib.parse.unquote(user), urllib.parse.unquote(secret))
                if self.path != "/token" or form.get("grant_type") != ["client_credentials"] or \
                        client != (provider.client_id, provider.client_secret):
                    provider.refused += 1
                    return self._send(401, {"error": "invalid_client"})
                provider.granted += 1
                scope = form.get("scope", [""])[0]
                self._send(200, {"access_token": provider.token(client[0], scope), "token_type": "Bearer",
                                 "expires_in": provider.lifetime_s})

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def token_url(self) -> str:
        return f"{self.url}/token"

    @property
    def jwks_url(self) -> str:
        return f"{self.url}/jwks"

    def token(self, subject: str, scope: str) -> str:
        now = int(time.time())
        header = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": KEY_ID}).encode())
        claims = {"iss": ISSUER, "sub": subject, "aud": AUDIENCE, "iat": now, "exp": now + self.lifetime_s, **({"scope": scope} if scope else {})}
        payload = _b64(json.dumps(claims).encode())
        signature = self.key.sign(f"{header}.{payload}".encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{header}.{payload}.{_b64(signature)}"

    def close(self) -> None:
        self.server.shutdown()
