"""kvcert inside vLLM: a CPU attention backend whose decode reads go through kvcert's certified read path.

Switched on by ``KVCERT_VLLM=1`` and configured by ``KVCERT_VLLM_*`` environment variables
(:mod:`kvcert.integrations.vllm.settings`); vLLM loads :func:`kvcert.integrations.vllm.plugin.register` from
the ``vllm.general_plugins`` entry point in each of its processes. ``kvcert serve`` starts vLLM's OpenAI server
with the plugin, the response field and the ``kvcert_*`` metrics (:mod:`kvcert.integrations.vllm.http`).
See ``docs/serving-vllm.md``.

Nothing in this package's ``__init__``, :mod:`~kvcert.integrations.vllm.settings`,
:mod:`~kvcert.integrations.vllm.records` or :mod:`~kvcert.integrations.vllm.runtime` imports vLLM; only
:mod:`~kvcert.integrations.vllm.backend` (loaded inside vLLM processes) does.
"""

from kvcert.integrations.vllm.records import RecordStore, RequestRecord
from kvcert.integrations.vllm.settings import Settings

__all__ = ["RecordStore", "RequestRecord", "Settings"]
