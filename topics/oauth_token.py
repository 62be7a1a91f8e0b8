"""OAUTHBEARER tokens for the worker's aiokafka clients (its input consumer and Faust's own),
fetched as librdkafka's ``sasl.oauthbearer.method=oidc`` fetches them for the confluent-kafka
clients: the OAuth 2.0 client credentials grant (RFC 6749 section 4.4) against
``sasl.oauthbearer.token.endpoint.url``, as KIP-768 specifies for Kafka's clients
(docs/operator-guide.md, "Connecting to a secured cluster")."""
from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request

from aiokafka.abc import AbstractTokenProvider

from dpstream.topics.client_properties import KafkaSettingError

#: a token is renewed this share of its lifetime before it expires (librdkafka renews at 80 %)
RENEW_AT = 0.8
FETCH_TIMEOUT_S = 10


class OidcTokenProvider(AbstractTokenProvider):
    """Client-credentials tokens from a token endpoint, kept until 80 % of their lifetime."""

    def __init__(self, settings: dict):
        self.url = settings["sasl.oauthbearer.token.endpoint.url"]
        self.client_id = settings["sasl.oauthbearer.client.id"]
        self.secret = settings["sasl.oauthbearer.client.secret"]
        self.scope = settings.get("sasl.oauthbearer.scope")
        self._token: str | None = None
        self._renew_at = 0.0

    def fetch(self) -> tuple[str, float]:
        """One token and its lifetime in seconds; a refusal raises :class:`KafkaSettingError`."""
        form = {"grant_type": "client_credentials", **({"scope": self.scope} if self.scope else {})}
        basic = base64.b64encode(f"{urllib.parse.quote(self.client_id)}:{urllib.parse.quote(self.secret)}".encode()).decode()
        request = urllib.request.Request(self.url, data=urllib.parse.urlencode(form).encode(), method="POST",
                                         headers={"Authorization": f"Basic {basic}",
                                                  "Content-Type": "application/x-www-form-urlencoded"})
        try:
            with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise KafkaSettingError(f"OAUTHBEARER: the token endpoint {self.url} refused the client credentials "
                                    f"(HTTP {exc.code}); check sasl.oauthbearer.client.id and sasl.oauthbearer.client.secret") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise KafkaSettingError(f"OAUTHBEARER: no token from {self.url} ({getattr(exc, 'reason', exc)}); "
                                    f"check sasl.oauthbearer.token.endpoint.url") from None
        if not isinstance(body, dict) or not isinstance(body.get("access_token"), str):
            raise KafkaSettingError(f"OAUTHBEARER: the token endpoint {self.url} answered without an access_token; "
                                    f"check sasl.oauthbearer.token.endpoint.url")
        return body["access_token"], float(body.get("expires_in", 3600))

    def current(self) -> str:
        if self._token is None or time.monotonic() >= self._renew_at:
            token, lifetime = self.fetch()
            self._token, self._renew_at = token, time.monotonic() + RENEW_AT * lifetime
        return self._token

    async def token(self) -> str:
        return await asyncio.get_running_loop().run_in_executor(None, self.current)
