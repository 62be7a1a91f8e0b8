"""Kafka topic declarations, record schemas and input validation. Lands with the Kafka service."""
