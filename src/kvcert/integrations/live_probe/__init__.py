"""The live heterogeneous-memory probe: serve one request through every memory path a model has and compose
per-layer chains into a ``kvcert.probe/1`` snapshot (:func:`~kvcert.integrations.live_probe.heterogeneous.
probe_request`). The snapshot schema and its acceptance gate are the pure package :mod:`kvcert.probe`.

Submodules are imported on use (they run models through transformers)."""

__all__ = ["dense", "heterogeneous", "pooled_path", "request"]
