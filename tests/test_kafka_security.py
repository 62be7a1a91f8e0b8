"""The worker and the command-line tools against a secured Apache Kafka (issue 30, item 8;
docs/operations.md, "Kafka security"): scripts/broker start-secure's SASL_SSL listener
(SCRAM-SHA-512) and its SSL listener, which requires a client certificate.

* over either listener a worker releases exactly what replay does: every client it opens
  (confluent-kafka's, aiokafka's input consumer, Faust's own) takes the credentials, the CA and
  the client certificate;
* a failure of the client's own settings (a wrong password, a CA that did not sign the broker's
  certificate, a missing CA file, a misspelt protocol, no client certificate where one is
  required, a wrong key password, an expired client certificate) ends ``worker``, ``produce``, ``tail`` and ``reset`` at once
  with exit code 2 and one line naming the setting (its environment variable), with no traceback
  and no password, although --broker-timeout / --timeout would wait a minute for a broker that
  is away.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TEST_SECRET_HEX
from tests.test_kafka_worker import Scenario, free_port

DPSTREAM = [sys.executable, "-m", "dpstream.processor.cli"]
#: s the commands would wait for a broker that does not answer (--broker-timeout, --timeout)
BROKER_TIMEOUT_S = 60


@pytest.mark.parametrize("listener, assignment", [("sasl_ssl", "static"), ("ssl", "static"), ("ssl", "group")])
def test_a_worker_over_a_secured_listener_releases_what_replay_does(tmp_path, secure_broker, monkeypatch, listener, assignment):
    # (an elastic worker over SASL_SSL: tests/test_client_properties.py, from a properties file)
    for name, value in secure_broker.env(listener).items():  # the worker's, produce's and tail's clients read these
        monkeypatch.setenv(name, value)
    sc = Scenario(tmp_path, getattr(secure_broker, listener))
    try:
        sc.ready_worker("secured", extra=("--assignment", assignment))
        sc.write_events(8_000, users=800, keys=40, lead_s=4)
        assert sc.produce_events() == 8_000
        sc.assert_releases_equal_replay()
    finally:
        for w in sc.workers:
            w.stop()


#: (what is wrong, the listener, the settings changed (None: unset), the variable the line must name)
FAILURES = {
    "wrong SASL password": ("sasl_ssl", {"DPSTREAM_KAFKA_SASL_PASSWORD": "not-the-password"}, "DPSTREAM_KAFKA_SASL_PASSWORD"),
    "untrusted CA": ("sasl_ssl", {"DPSTREAM_KAFKA_SSL_CA_LOCATION": "<other CA>"}, "DPSTREAM_KAFKA_SSL_CA_LOCATION"),
    "missing CA file": ("sasl_ssl", {"DPSTREAM_KAFKA_SSL_CA_LOCATION": "<missing>"}, "DPSTREAM_KAFKA_SSL_CA_LOCATION"),
    "misspelt security protocol": ("sasl_ssl", {"DPSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SLL"},
                                   "DPSTREAM_KAFKA_SECURITY_PROTOCOL"),
    "no client certificate": ("ssl", {"DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": None, "DPSTREAM_KAFKA_SSL_KEY_LOCATION": None,
                                      "DPSTREAM_KAFKA_SSL_KEY_PASSWORD": None}, "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"),
    "wrong key password": ("ssl", {"DPSTREAM_KAFKA_SSL_KEY_PASSWORD": "not-the-key-password"}, "DPSTREAM_KAFKA_SSL_KEY_PASSWORD"),
    "expired client certificate": ("ssl", {"DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION": "<expired certificate>",
                                           "DPSTREAM_KAFKA_SSL_KEY_LOCATION": "<expired key>", "DPSTREAM_KAFKA_SSL_KEY_PASSWORD": None},
                                   "DPSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION"),
}


def expired_certificate(secure_broker, where) -> tuple[str, str]:
    """A client certificate the broker's CA signed, valid only in 2020 (certificate, key: PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    ca_dir = os.path.dirname(secure_broker.ca)
    ca = x509.load_pem_x509_certificate(open(secure_broker.ca, "rb").read())
    ca_key = serialization.load_pem_private_key(open(os.path.join(ca_dir, "ca.key"), "rb").read(), None)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired-client")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime(2020, 1, 1)).not_valid_after(datetime.datetime(2020, 1, 2))
            .sign(ca_key, hashes.SHA256()))
    (where / "expired.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (where / "expired.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    return str(where / "expired.pem"), str(where / "expired.key")


def _command(command: str, tmp_path, broker: str) -> list[str]:
    config = tmp_path / "queries.yaml"
    config.write_text("queries:\n  - name: q\n    input_topic: sec-events\n    output_topic: sec-out\n    window: 1h\n"
                      "    triggers: 1\n    contribution_bound: 1\n    epsilon: 1\n    delta: 1.0e-9\n")
    if command == "worker":
        key = tmp_path / "noise.key"
        key.write_text(TEST_SECRET_HEX + "\n")
        key.chmod(0o600)  # a key file others may read is refused (processor/mechanisms/noise.py)
        return ["worker", "--config", str(config), "--broker", broker, "--state-dir", str(tmp_path / "state"),
                "--noise-key-file", str(key), "--web-port", str(free_port()), "--web-host", "127.0.0.1",
                "--broker-timeout", f"{BROKER_TIMEOUT_S}s", "--log-level", "warn"]
    if command == "produce":
        return ["produce", "--broker", broker, "--topic", "sec-events", "--synthetic-users", "10",
                "--timeout", str(BROKER_TIMEOUT_S)]
    if command == "tail":
        return ["tail", "--broker", broker, "--topic", "sec-out", "--timeout", str(BROKER_TIMEOUT_S)]
    return ["reset", "--broker", broker, "--config", str(config), "--state-dir", str(tmp_path / "state")]  # only the plan


@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("command", ["worker", "produce", "tail", "reset"])
def test_a_settings_failure_is_named_at_once_with_exit_code_2(tmp_path, secure_broker, failure, command):
    listener, changes, setting = FAILURES[failure]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSTREAM_")}
    env.update(secure_broker.env(listener))
    stand_ins = {"<other CA>": secure_broker.other_ca, "<missing>": str(tmp_path / "no-such-ca.pem")}
    if failure == "expired client certificate":
        stand_ins["<expired certificate>"], stand_ins["<expired key>"] = expired_certificate(secure_broker, tmp_path)
    for name, value in changes.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = stand_ins.get(value, value)
    try:
        # a process still running at half the broker timeout retries the failure as if the
        # broker were away (what it did before): that is the behaviour under test, not its speed
        proc = subprocess.run([*DPSTREAM, *_command(command, tmp_path, getattr(secure_broker, listener))], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=BROKER_TIMEOUT_S / 2)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} with a {failure}: still waiting after {BROKER_TIMEOUT_S / 2:g} s of a "
                    f"{BROKER_TIMEOUT_S} s broker timeout, as for a broker that is away")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and "rdkafka" not in output and "%3|" not in output, output
    for secret in (secure_broker.password, secure_broker.key_password, "not-the-password", "not-the-key-password"):
        assert secret not in output
    lines = proc.stderr.strip().splitlines()
    if command == "worker":
        # the refusal is the last line; before it at most the note that the worker waits
        assert lines[-1].startswith("dpstream worker: refused: connecting to "), output
        assert all("waiting up to" in line for line in lines[:-1]), output
    else:
        assert len(lines) == 1 and not proc.stdout, output
        assert lines[0].startswith(f"dpstream{':' if command == 'reset' else ''} {command}: connecting to "), output
    assert setting in lines[-1], output
    # a failure of the settings, not the broker's absence
    assert "no Kafka broker answered" not in output
