"""Record decoders: the one place an input format is read (docs/architecture.md, "Where to add").

A :class:`RecordDecoder` turns a batch of raw record values (Kafka message values, replay input
lines) into one mapping per record, or an :class:`dpstream.topics.records.InvalidRecord` naming what is
wrong (never quoting the content). Query-level field extraction then works on mappings whatever
the format (:class:`dpstream.topics.records.EventParser`, :class:`dpstream.topics.records.UpdateParser`), so one
batch is decoded once however many queries read it. JSON is the format today; another one is a
class with a ``name`` and ``decode`` registered in :data:`DECODERS`.
"""
from __future__ import annotations

from typing import Mapping, Optional, Protocol, Sequence, Union

import orjson

from dpstream.topics.records import InvalidRecord


class RecordDecoder(Protocol):
    name: str

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        """One mapping (field name -> value) or InvalidRecord per raw value, in order."""


class JsonRecordDecoder:
    """One JSON object per record. orjson: about 3x the standard parser on small records, which
    is most of stage 1's per-event cost; it also rejects NaN/Infinity literals (invalid)."""

    name = "json"

    def decode(self, raws: Sequence[Optional[bytes]]) -> list[Union[Mapping, InvalidRecord]]:
        loads, bad_json, not_object = orjson.loads, InvalidRecord("not valid JSON"), InvalidRecord("not a JSON object")
        out: list[Union[Mapping, InvalidRecord]] = []
        append = out.append
        for raw in raws:
            if raw is None:
                append(bad_json)
                continue
            try:
                obj = loads(raw)
            except orjson.JSONDecodeError:
                append(bad_json)
                continue
            append(obj if isinstance(obj, dict) else not_object)
        return out


DECODERS: dict[str, type] = {JsonRecordDecoder.name: JsonRecordDecoder}


def decoder_for(name: str) -> RecordDecoder:
    """The decoder of an input format (``input_format`` in the config)."""
    try:
        return DECODERS[name]()
    except KeyError:
        raise ValueError(f"input_format: must be one of {', '.join(DECODERS)}, got {name!r}") from None
