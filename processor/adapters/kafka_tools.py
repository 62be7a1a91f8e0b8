"""``dpstream produce`` and ``dpstream tail``: feed the input topic, read the releases topic.

Input records are keyed by the query's user field, the contract stage 1 relies on (a record
whose key is not its user id is dead-lettered). The producer uses librdkafka's
``murmur2_random`` partitioner, the one Java clients use by default, so records of one user land
in one partition whichever of these clients wrote them.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence, TextIO

from dpstream.topics.records import MAX_FIELD_CHARS, field_reader, set_field

PRODUCER_DEFAULTS = {"partitioner": "murmur2_random", "linger.ms": 20, "batch.num.messages": 10_000,
                     "queue.buffering.max.messages": 1_000_000, "acks": "all"}
#: s produce and tail wait for a broker that does not answer before they give up (one line, no traceback)
BROKER_WAIT_S = 15.0
#: without a config: events dated more than this before they are sent are reported as old
#: (the default allowed_lateness; docs/operations.md, "Trying it with a file")
OLD_MS = 60_000
#: without a config: events dated more than this after they are sent are reported (the default max_skew)
AHEAD_MS = 3_600_000
DOC = 'docs/operations.md, "Trying it with a file"'


class KafkaToolError(RuntimeError):
    """A failure of ``produce`` or ``tail`` said in one line, which the CLI prints without a
    traceback and exits with :attr:`exit_code` (2: the command's input or the Kafka client's
    settings, which a retry cannot mend; 1: the broker)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class _LastLine(logging.Handler):
    """Keeps librdkafka's last log line instead of printing it: a broker that does not answer
    makes it log every reconnect attempt; the command says once what went wrong."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.last: Optional[str] = None

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()


_LAST = _LastLine()
#: the ``logger`` of every client here (librdkafka's lines go to it, not to stderr)
RDKAFKA_LOG = logging.getLogger("dpstream.librdkafka")
RDKAFKA_LOG.addHandler(_LAST)
RDKAFKA_LOG.propagate = False


def last_reason() -> str:
    """librdkafka's last line, shortened to its reason (" (Connect to ... failed: Connection refused)")."""
    line = _LAST.last
    if not line:
        return ""
    text = line.rsplit("]: ", 1)[-1]
    head, _, rest = text.partition(": ")
    if rest and "/" in head:  # "127.0.0.1:9092/bootstrap: " names the connection
        text = rest
    return f" ({text.split(' (after ')[0].strip()})"


def no_broker(command: str, bootstrap: str, timeout: float) -> KafkaToolError:
    return KafkaToolError(f"{command}: no Kafka broker answered at {bootstrap} within {timeout:g} s{last_reason()}; start one "
                          f"(scripts/broker start) or pass --broker HOST:PORT{protocol_hint()}")


def protocol_hint() -> str:
    """A client speaking another protocol than the listener's (plaintext to TLS, TLS to SASL)
    is only ever disconnected, as by a broker going away: when librdkafka's last word is a
    disconnection, say which setting chooses the protocol."""
    from dpstream.topics.kafka import client_security

    if "Disconnected" not in last_reason():
        return ""
    protocol = client_security().get("security.protocol", "PLAINTEXT")
    return f"; something disconnected: is DPSTREAM_KAFKA_SECURITY_PROTOCOL ({protocol}) the listener's protocol?"


#: s each metadata request of :func:`wait_for_broker` waits; refused credentials or a failed TLS
#: handshake reach the error callback within one (a third of a second, measured)
ATTEMPT_S = 1.0
#: s without an answer before :func:`wait_for_broker` says it is waiting (a settings failure is
#: said instead, alone, if it comes first)
WAITING_S = 3.0


def wait_for_broker(bootstrap: str, timeout: float, waiting: Optional[Callable[[], None]] = None) -> bool:
    """Metadata round trips until the broker answers (True) or ``timeout`` s pass (False; then
    :func:`last_reason` has librdkafka's last word). ``waiting`` is called once after
    :data:`WAITING_S` s without an answer. A failure of the client's own settings (credentials,
    TLS, an invalid value) raises :class:`~dpstream.topics.kafka.KafkaSettingError` at once:
    librdkafka would retry it for ever as if the broker were away (docs/operations.md, "Kafka security")."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from dpstream.topics.kafka import SettingErrors, client_security, open_client, setting_error

    errors = SettingErrors()
    admin = open_client(AdminClient, {"bootstrap.servers": bootstrap, "logger": RDKAFKA_LOG, "error_cb": errors,
                                      **client_security()})
    started = time.monotonic()
    deadline = started + timeout
    while True:
        try:
            admin.list_topics(timeout=max(0.1, min(ATTEMPT_S, deadline - time.monotonic())))
            admin.poll(0)  # serves librdkafka's log lines to RDKAFKA_LOG (left queued, it prints that it drops them)
            return True
        except KafkaException as exc:
            admin.poll(0)  # serves the error callback and the log lines: the reason
            errors.raise_first()
            direct = setting_error(exc.args[0]) if exc.args else None
            if direct is not None:
                raise direct from None
        now = time.monotonic()
        if now >= deadline:
            return False
        if waiting is not None and now - started >= WAITING_S:
            waiting()
            waiting = None


def check_broker(command: str, bootstrap: str, timeout: float = BROKER_WAIT_S) -> None:
    """The broker answers within ``timeout``, or :class:`KafkaToolError`: exit code 2 for the
    client's own settings (said at once), 1 for no answer."""
    from dpstream.topics.kafka import KafkaSettingError

    try:
        answered = wait_for_broker(bootstrap, timeout)
    except KafkaSettingError as exc:
        raise KafkaToolError(f"{command}: connecting to {bootstrap}: {exc}", 2) from None
    if not answered:
        raise no_broker(command, bootstrap, timeout)


def user_key(obj, user_field: str) -> Optional[bytes]:
    """The decoded record's user id as its message key (None for records that are not JSON
    objects: they are still sent, and the worker dead-letters them)."""
    if not isinstance(obj, dict):
        return None
    user = field_reader(user_field)(obj)
    if isinstance(user, float) and user.is_integer():
        user = int(user)
    if isinstance(user, bool) or not isinstance(user, (str, int)):  # what the worker refuses as a user id
        return None
    text = str(user)
    return text.encode()[: MAX_FIELD_CHARS * 4] if text else None


def file_lines(path: str) -> Iterator[bytes]:
    """The non-empty lines of a .jsonl or .jsonl.gz file; a file that cannot be read is one
    line (:class:`KafkaToolError`, exit code 2)."""
    import gzip
    import zlib

    opener = gzip.open if path.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rb") as fh:
            for line_no, line in enumerate(fh, 1):
                line = line.rstrip(b"\r\n")
                if line:
                    yield line
    except FileNotFoundError:
        raise KafkaToolError(f"produce --input: no such file: {path}", 2) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise KafkaToolError(f"produce --input: cannot read {path} after line {line_no}: {exc}", 2) from None


def _int_time(obj, time_field: str) -> Optional[int]:
    """The event's time as the worker reads it (integer epoch ms), or None (dead-lettered as malformed)."""
    ts = field_reader(time_field)(obj) if isinstance(obj, dict) else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts in (float("inf"), float("-inf")) or ts != int(ts):
        return None
    return int(ts)


def earliest_time(lines: Iterable[bytes], time_field: str) -> Optional[int]:
    """The earliest integer ``time_field`` among the lines (None: no line has one)."""
    first = None
    for raw in lines:
        try:
            ts = _int_time(json.loads(raw), time_field)
        except (ValueError, UnicodeDecodeError):
            continue
        if ts is not None and (first is None or ts < first):
            first = ts
    return first


def rebased(lines: Iterable[bytes], time_field: str, shift_ms: int) -> Iterator[bytes]:
    """``produce --rebase-time``: every line's ``time_field`` moved by ``shift_ms`` (relative
    spacing kept); lines without an integer time are sent as they are."""
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            yield raw
            continue
        ts = _int_time(obj, time_field)
        if ts is None:
            yield raw
            continue
        set_field(obj, time_field, ts + shift_ms)
        yield json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@dataclass
class TimeReport:
    """What the worker will make of the events' own times, judged as they are sent.

    The worker puts an event in the trigger its own time says, but judges it by the broker's
    stamp, its arrival (docs/privacy.md, "Time"): it is late, dropped, if its trigger's fire time
    (trigger end plus ``allowed_lateness``) has passed when it arrives, and future, dropped, if it
    is dated more than ``max_skew`` after that. With the worker's ``queries`` (those reading the
    topic) the counts are theirs, exactly as of the moment each event is sent (it arrives a
    little later: at least these); without, events older than :data:`OLD_MS` or more than
    :data:`AHEAD_MS` ahead are counted."""

    time_field: str = "ts"
    queries: Sequence = ()
    #: what to do about it, ending the summary line
    advice: str = f"--rebase-time dates the file from now ({DOC})"
    events: int = 0
    undated: int = 0
    old: int = 0
    ahead: int = 0
    oldest_ms: int = 0  # how far before sending the oldest event is dated
    late: Counter = field(default_factory=Counter)
    future: Counter = field(default_factory=Counter)

    def __post_init__(self):
        from dpstream.processor.config import parse_duration_ms

        # (name, window ms, trigger interval ms, allowed lateness ms, max_skew ms)
        self._schedules = [(q.name, q.window_ms, q.window_ms // q.triggers, parse_duration_ms(q.allowed_lateness, allow_zero=True),
                            parse_duration_ms(q.max_skew)) for q in self.queries]

    def observe(self, obj, sent_ms: int) -> None:
        self.events += 1
        ts = _int_time(obj, self.time_field)
        if ts is None:
            self.undated += 1
            return
        if ts < sent_ms - OLD_MS:
            self.old += 1
        elif ts > sent_ms + AHEAD_MS:
            self.ahead += 1
        self.oldest_ms = max(self.oldest_ms, sent_ms - ts)
        for name, window, interval, lateness, skew in self._schedules:
            start = ts - ts % window
            if start + ((ts - start) // interval + 1) * interval + lateness <= sent_ms:
                self.late[name] += 1
            elif ts > sent_ms + skew:
                self.future[name] += 1

    def summary(self) -> Optional[str]:
        """One line when some events will not count as their times say, else None."""
        f = self.time_field
        undated = (f"; {self.undated:,} have no integer {f!r} (epoch ms) and are dead-lettered as malformed"
                   if self.undated else "")
        if self.queries:
            parts = [f"query {name} drops {self.late[name]:,} as late (their trigger by {f!r} had fired when sent) and "
                     f"{self.future[name]:,} as future (dated more than its max_skew ahead)"
                     for name, *_ in self._schedules if self.late[name] or self.future[name]]
            if not parts and not self.undated:
                return None
            return (f"produce: of {self.events:,} events, " + ("; ".join(parts) or "all are on time") + undated
                    + f". The worker judges each event by the broker's arrival time, not by {f!r}; {self.advice}")
        if not (self.old or self.ahead or self.undated):
            return None
        oldest = f" (the oldest by {_span(self.oldest_ms)})" if self.old else ""
        return (f"produce: {self.old:,} of {self.events:,} events are dated more than {OLD_MS // 60_000} min before they were sent"
                f"{oldest} and {self.ahead:,} more than {AHEAD_MS // 3_600_000} h after{undated}. The worker judges each event "
                f"by the broker's arrival time: one whose trigger (by {f!r}) has fired is dropped as late, one dated more than "
                f"max_skew (default 1h) ahead as future; --config FILE counts them exactly; {self.advice}")


def _span(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000)):
        if ms >= size:
            return f"{ms / size:.1f} {unit}"
    return f"{ms / 1000:.1f} s"


def synthetic_lines(users: int, keys: int, seed: int, start_ms: int, window_ms: int) -> Iterator[bytes]:
    """The DP-SQLP workload's shape (dpstream.processor.synthetic) as JSON events in time order."""
    from dpstream.processor.synthetic import KEYS_Q, generate

    stream = generate(users, keys, seed, window_ms=window_ms, start_ms=start_ms, key_q=KEYS_Q * keys / 1_000_000)
    for u, k, t in zip(stream.users.tolist(), stream.keys.tolist(), stream.ts.tolist()):
        yield f'{{"user_id":"user-{u}","key":"page-{k}","ts":{t}}}'.encode()


def produce(broker: str, topic: str, lines: Iterator[bytes], user_field: str = "user_id", client_config: Optional[dict] = None,
            *, timeout: float = BROKER_WAIT_S, report: Optional[TimeReport] = None) -> int:
    """Send the lines keyed by their user. Gives up with one line (:class:`KafkaToolError`)
    when nothing is acknowledged for ``timeout`` seconds while records wait, or when the broker
    refuses records. ``report``: each event's time judged as it is sent (:class:`TimeReport`)."""
    from confluent_kafka import Producer

    from dpstream.topics.kafka import KafkaSettingError, client_security, open_client

    errors: list[str] = []
    acked = [time.monotonic()]

    def on_delivery(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            acked[0] = time.monotonic()

    try:
        producer = open_client(Producer, {"bootstrap.servers": broker, **PRODUCER_DEFAULTS, "logger": RDKAFKA_LOG,
                                          **client_security(), **(client_config or {})})
    except KafkaSettingError as exc:
        raise KafkaToolError(f"produce: connecting to {broker}: {exc}", 2) from None

    def give_up(left: int) -> KafkaToolError:
        producer.purge()
        producer.flush(0)
        return KafkaToolError(f"produce: the broker at {broker} acknowledged nothing for {timeout:g} s{last_reason()}; {left:,} "
                              f"of {sent:,} records sent to {topic} were not acknowledged")

    sent = 0
    now_ms = int(time.time() * 1000)
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            obj = None  # still sent: the worker dead-letters it
        if report is not None:
            report.observe(obj, now_ms)
        key = user_key(obj, user_field)
        while True:
            try:
                producer.produce(topic, raw, key, on_delivery=on_delivery)
                break
            except BufferError:  # the queue is full: wait for acknowledgements
                if producer.poll(0.05) == 0 and time.monotonic() - acked[0] > timeout:
                    raise give_up(len(producer)) from None
        sent += 1
        if sent % 10_000 == 0:
            producer.poll(0)
            now_ms = int(time.time() * 1000)
    while (left := producer.flush(0.5)) and not errors:
        if time.monotonic() - acked[0] > timeout:
            raise give_up(left)
    if errors:
        producer.purge()
        raise KafkaToolError(f"produce: the broker refused {len(errors):,} of {sent:,} records sent to {topic} (first: {errors[0]})")
    return sent


def tail(broker: str, topic: str, out: TextIO = sys.stdout, idle_seconds: Optional[float] = None, max_records: Optional[int] = None,
         from_beginning: bool = True) -> int:
    """Print release records (one JSON object per line) as they arrive. Stops after
    ``idle_seconds`` without a record (waiting for the topic counts: the worker creates it when
    it starts), or after ``max_records``; otherwise runs until interrupted. No broker within
    ``idle_seconds`` (at most :data:`BROKER_WAIT_S`), or no such topic, is one line
    (:class:`KafkaToolError`)."""
    from confluent_kafka import (
        OFFSET_BEGINNING,
        OFFSET_END,
        Consumer,
        KafkaError,
        KafkaException,
        TopicPartition,
    )

    from dpstream.topics.kafka import client_security

    started = time.monotonic()
    wait = BROKER_WAIT_S if idle_seconds is None else min(BROKER_WAIT_S, max(idle_seconds, 1.0))
    check_broker("tail", broker, wait)  # the client's own settings' failure at once (exit code 2), no broker in one line
    consumer = Consumer({"bootstrap.servers": broker, "group.id": "dpstream-tail", "enable.auto.commit": False,
                         "logger": RDKAFKA_LOG, **client_security()})
    try:
        while True:
            try:
                meta = consumer.list_topics(topic, timeout=wait).topics.get(topic)
            except KafkaException:
                consumer.poll(0)  # serves librdkafka's log lines to RDKAFKA_LOG: the reason
                raise no_broker("tail", broker, wait) from None
            if meta is not None and meta.error is None and meta.partitions:
                break
            if idle_seconds is None or time.monotonic() - started > idle_seconds:
                waited = "" if idle_seconds is None else f" within {idle_seconds:g} s"
                raise KafkaToolError(f"tail: topic {topic!r} does not exist on {broker}{waited}: the worker creates its output "
                                     f"topics when it starts (is it running? see its log), or pass --topic NAME")
            time.sleep(0.5)
    except BaseException:
        consumer.close()
        raise
    # assigned, not subscribed: a reader needs every partition and no group membership
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in sorted(meta.partitions)])
    seen, last = 0, started  # waiting for the topic counts as time without a record
    try:
        while max_records is None or seen < max_records:
            msgs = consumer.consume(1000 if max_records is None else min(1000, max_records - seen), 0.2)
            for msg in msgs:
                if msg.error():
                    if msg.error().code() != KafkaError._PARTITION_EOF:
                        raise KafkaToolError(f"tail: reading {topic}-{msg.partition()}: {msg.error()}")
                    continue
                out.write(msg.value().decode() + "\n")
                seen += 1
            if msgs:
                out.flush()
                last = time.monotonic()
            elif idle_seconds is not None and time.monotonic() - last > idle_seconds:
                break
    finally:
        consumer.close()
    return seen
