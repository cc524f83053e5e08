"""Fixtures shared by the integration tests."""

from tests.mqtt_broker import mosquitto_broker  # noqa: F401  (a real mosquitto on loopback)
