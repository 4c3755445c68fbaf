"""The cache tier: stores (device tier = packed chunks, host tier = exact originals, witnesses), the gate, the
telemetry of every read and the write/read events observers receive (docs/architecture.md)."""

from kvcert.cache.events import CacheObserver, ReadEvent, WriteEvent
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import Telemetry

__all__ = ["CacheObserver", "Gate", "LayerStore", "ReadEvent", "Telemetry", "WriteEvent"]
