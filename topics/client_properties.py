"""The Kafka client properties every client of dpstream opens with (docs/operator-guide.md,
"Connecting to a secured cluster").

They come from three places, later ones winning property by property:

1. ``DPSTREAM_KAFKA_PROPERTIES_FILE``: one or more files (comma-separated) in the Java clients'
   ``.properties`` syntax, as a cluster's admins hand them out (the Helm chart mounts
   ``kafka.properties`` and a Secret's file there);
2. the worker config's ``kafka:`` map (:func:`use_config_properties`, when a command loads one);
3. the ``DPSTREAM_KAFKA_*`` variables of :data:`SECURITY_ENV`.

dpstream opens librdkafka clients (confluent-kafka) and aiokafka clients (the worker's input
consumer and Faust's own), so a property is taken only where both can honour it: librdkafka's
name is used as is, a Java name with an equivalent is translated (``sasl.mechanism``,
``sasl.jaas.config`` of the PLAIN, SCRAM and OAuthBearer login modules, a PEM trust store, the
OIDC login callback handler), so that the file a Java client or Kafka's console tools use serves
dpstream too, and anything else is refused at start naming the property and, where there is
one, what to use instead. Values are never logged.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

SECURITY_ENV = {
    "DPSTREAM_KAFKA_SECURITY_PROTOCOL": "security.protocol",  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    "DPSTREAM_KAFKA_SASL_MECHANISM": "sasl.mechanisms",  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 | OAUTHBEARER
    "DPSTREAM_KAFKA_SASL_USERNAME": "sasl.username",
    "DPSTREAM_KAFKA_SASL_PASSWORD": "sasl.password",
    "DPSTREAM_KAFKA_SSL_CA_LOCATION": "ssl.ca.location",  # PEM file of the broker's CA
    # a client certificate, for listeners that require one (ssl.client.auth=required)
    "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": "ssl.certificate.location",  # PEM file of the client's certificate
    "DPSTREAM_KAFKA_SSL_KEY_LOCATION": "ssl.key.location",  # PEM file of its private key
    "DPSTREAM_KAFKA_SSL_KEY_PASSWORD": "ssl.key.password",  # the key's password, if it is encrypted
}
PROPERTIES_FILE_ENV = "DPSTREAM_KAFKA_PROPERTIES_FILE"

#: the properties taken, by librdkafka's name: each has its aiokafka equivalent (topics/kafka.py
#: aiokafka_security, oauth.OidcTokenProvider)
CLIENT_PROPERTIES = {
    "security.protocol": ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    "sasl.mechanisms": ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"),
    "sasl.username": None,
    "sasl.password": None,
    "ssl.ca.location": None,
    "ssl.certificate.location": None,
    "ssl.key.location": None,
    "ssl.key.password": None,
    "ssl.endpoint.identification.algorithm": ("https", "none"),
    # OAUTHBEARER with an OIDC token endpoint (client credentials grant, KIP-768)
    "sasl.oauthbearer.method": ("oidc",),
    "sasl.oauthbearer.client.id": None,
    "sasl.oauthbearer.client.secret": None,
    "sasl.oauthbearer.token.endpoint.url": None,
    "sasl.oauthbearer.scope": None,
}
#: settings whose values are never printed, not even in an error naming them
SECRET_SETTINGS = ("sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret")
#: Java names with a librdkafka equivalent
ALIASES = {"sasl.mechanism": "sasl.mechanisms"}
#: properties dpstream sets itself, and where the operator sets what they mean
OWN_PROPERTIES = {
    "bootstrap.servers": "--broker (or DPSTREAM_BROKER; the chart's kafka.bootstrapServers)",
    "group.id": "--app-id", "client.id": "--app-id", "transactional.id": "--delivery",
    "isolation.level": "--delivery", "enable.idempotence": "--delivery", "enable.auto.commit": "--delivery",
    "auto.offset.reset": "the worker's own offsets", "partitioner": "--partitioner",
    "key.serializer": "input_format", "value.serializer": "input_format",
    "key.deserializer": "input_format", "value.deserializer": "input_format",
}
#: Java-only properties and their librdkafka equivalent
JAVA_ONLY = {
    "ssl.truststore.location": "ssl.ca.location, or ssl.truststore.type PEM (a PEM file; keytool -exportcert -rfc writes one)",
    "ssl.truststore.password": "ssl.ca.location (a PEM file needs no password)",
    "ssl.truststore.type": "ssl.truststore.type PEM or ssl.ca.location (a PEM file)",
    "ssl.keystore.location": "ssl.certificate.location and ssl.key.location (PEM files)",
    "ssl.keystore.password": "ssl.key.password",
    "ssl.keystore.type": "ssl.certificate.location and ssl.key.location (PEM files)",
}
#: the Java clients' OIDC login handler (KIP-768), which librdkafka's sasl.oauthbearer.method oidc is
_OIDC_HANDLER = re.compile(r"^org\.apache\.kafka\.common\.security\.oauthbearer\.(secured\.)?OAuthBearerLoginCallbackHandler$")
_JAAS = re.compile(r"^\s*org\.apache\.kafka\.common\.security\.(?P<module>plain\.PlainLoginModule|scram\.ScramLoginModule"
                   r"|oauthbearer\.OAuthBearerLoginModule)\s+required"
                   r"(?P<options>(?:\s+[A-Za-z]+\s*=\s*\"[^\"]*\")*)\s*;?\s*$")


class KafkaSettingError(RuntimeError):
    """A Kafka client's own settings failed, not the broker's presence: the broker refused the
    credentials or the TLS handshake, a file the settings name cannot be used, a value is not
    valid. Waiting for the broker cannot help; the message names the failure and the setting to
    check (where it was set), never a password (docs/operations.md, "Kafka security")."""


class ClientPropertyError(KafkaSettingError):
    """A client property dpstream cannot honour in every client it opens, or a file of them that
    cannot be read; the message names the property and where it was set."""


def read_properties_file(path: str) -> dict[str, str]:
    """A Java ``.properties`` file: ``key=value`` or ``key: value`` lines, ``#`` and ``!``
    comments, a backslash at the end of a line continuing it."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise ClientPropertyError(f"{PROPERTIES_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
    out: dict[str, str] = {}
    pending = ""
    for line in text.splitlines():
        line = pending + line.strip()
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = line[:-1]
            continue
        pending = ""
        if not line or line[0] in "#!":
            continue
        m = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)$", line)
        if m is None:
            raise ClientPropertyError(f"{PROPERTIES_FILE_ENV} {path}: not a property line: {line.split('=')[0][:40]!r}")
        out[m.group(1)] = m.group(2)
    return out


def normalized(props: Mapping, where: str, origins: dict | None = None) -> dict[str, str]:
    """``props`` by librdkafka's names, each value a string; a property that no client of
    dpstream's can take raises :class:`ClientPropertyError` naming it and ``where``. ``origins``
    gets, for each name returned, the name the operator wrote (``sasl.jaas.config``, ...)."""
    out: dict[str, str] = {}
    origins = {} if origins is None else origins
    props, renamed = dict(props), {}
    if str(props.get("ssl.truststore.type", "")).upper() == "PEM":
        # the Java clients' PEM trust store (KIP-651) is librdkafka's CA file
        props.pop("ssl.truststore.type")
        if "ssl.truststore.location" in props:
            props["ssl.ca.location"] = props.pop("ssl.truststore.location")
            renamed["ssl.ca.location"] = "ssl.truststore.location"
    for name, value in props.items():
        name = str(name)
        if isinstance(value, bool):
            value = "true" if value else "false"
        value = "" if value is None else str(value)
        key = ALIASES.get(name, name)
        if name == "sasl.jaas.config":
            found = _jaas(value, where)
            out.update(found)
            origins.update(dict.fromkeys(found, name))
            continue
        if name == "sasl.login.callback.handler.class" and _OIDC_HANDLER.match(value):
            out["sasl.oauthbearer.method"], origins["sasl.oauthbearer.method"] = "oidc", name
            continue
        if name in OWN_PROPERTIES:
            raise ClientPropertyError(f"{where}: {name} is set by dpstream; use {OWN_PROPERTIES[name]}")
        if name in JAVA_ONLY:
            raise ClientPropertyError(f"{where}: {name} is a Java client property with no equivalent here; use {JAVA_ONLY[name]}")
        if key not in CLIENT_PROPERTIES:
            raise ClientPropertyError(f"{where}: {name} is not a client property dpstream can apply to all its clients "
                                      f"(librdkafka's and aiokafka's); it takes {', '.join(CLIENT_PROPERTIES)}")
        allowed = CLIENT_PROPERTIES[key]
        if key in ("security.protocol", "sasl.mechanisms"):
            value = value.upper()
        if allowed is not None and value not in allowed:
            raise ClientPropertyError(f"{where}: {name} {value!r} is not one of {', '.join(allowed)}")
        out[key], origins[key] = value, renamed.get(key, name)
    return out


def _jaas(value: str, where: str) -> dict[str, str]:
    """What a ``sasl.jaas.config`` says (the Java clients' way): the username and password of
    the PLAIN and SCRAM login modules, the client id, secret and scope of the OAUTHBEARER one."""
    m = _JAAS.match(value)
    if m is None:
        raise ClientPropertyError(f"{where}: sasl.jaas.config: only the Plain, Scram and OAuthBearer login modules "
                                  f"with their options in double quotes are understood")
    options = dict(re.findall(r"([A-Za-z]+)\s*=\s*\"([^\"]*)\"", m.group("options")))
    names = ({"username": "sasl.username", "password": "sasl.password"} if "OAuthBearer" not in m.group("module") else
             {"clientId": "sasl.oauthbearer.client.id", "clientSecret": "sasl.oauthbearer.client.secret",
              "scope": "sasl.oauthbearer.scope"})
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ClientPropertyError(f"{where}: sasl.jaas.config: option {unknown[0]} has no equivalent here; "
                                  f"it takes {', '.join(names)}")
    return {names[k]: v for k, v in options.items()}


#: the worker config's ``kafka:`` map, once a command has loaded one
_configured: dict[str, str] = {}
#: the client.id of every client a worker process opens (:func:`use_client_id`), "" elsewhere
_client_id: list[str] = [""]


def use_client_id(client_id: str) -> None:
    """Every client opened from now on names itself ``client_id`` to the broker (its
    ``client.id``: the worker's own, so that a group's members, the broker's logs and quotas
    tell the workers apart; docs/operations.md, "Consumer offsets")."""
    _client_id[0] = client_id


def use_config_properties(props: Mapping) -> None:
    """Every client opened from now on takes the config's ``kafka:`` map (already checked by the
    config's validation)."""
    _configured.clear()
    _configured.update(normalized(props, "kafka"))


def client_properties(environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The merged properties and, for each, where it was set (an error names that)."""
    environ = os.environ if environ is None else environ
    settings: dict[str, str] = {}
    sources: dict[str, str] = {}
    for path in [p.strip() for p in environ.get(PROPERTIES_FILE_ENV, "").split(",") if p.strip()]:
        where, origins = f"{PROPERTIES_FILE_ENV} {path}", {}
        for key, value in normalized(read_properties_file(path), where, origins).items():
            settings[key], sources[key] = value, f"{origins[key]} in {path} ({PROPERTIES_FILE_ENV})"
    for key, value in _configured.items():
        settings[key], sources[key] = value, f"kafka.{key} in the config"
    for var, key in SECURITY_ENV.items():
        if environ.get(var):
            settings[key], sources[key] = environ[var], var
    if _client_id[0]:
        settings["client.id"], sources["client.id"] = _client_id[0], "the worker's client id"
    if settings.get("sasl.oauthbearer.method") == "oidc" or settings.get("sasl.mechanisms") == "OAUTHBEARER":
        missing = [k for k in ("sasl.oauthbearer.client.id", "sasl.oauthbearer.client.secret",
                               "sasl.oauthbearer.token.endpoint.url") if not settings.get(k)]
        if settings.get("sasl.mechanisms") != "OAUTHBEARER" or settings.get("sasl.oauthbearer.method") != "oidc" or missing:
            raise ClientPropertyError("OAUTHBEARER takes sasl.mechanisms OAUTHBEARER with sasl.oauthbearer.method oidc, "
                                      "sasl.oauthbearer.client.id, sasl.oauthbearer.client.secret and "
                                      "sasl.oauthbearer.token.endpoint.url" + (f"; missing {', '.join(missing)}" if missing else ""))
    return settings, sources


def client_security(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """librdkafka (confluent-kafka) settings for every client: :func:`client_properties`.
    Values are never logged."""
    return client_properties(environ)[0]


def setting_name(key: str) -> str:
    """Where the operator set a property (or, when it is not set, the variable that sets it)."""
    try:
        sources = client_properties()[1]
    except ClientPropertyError:
        sources = {}
    if key in sources:
        return sources[key]
    for var, prop in SECURITY_ENV.items():
        if prop == key:
            return var
    return key
