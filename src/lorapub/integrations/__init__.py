"""Framework integrations: the few hooks a framework's own rollout code calls.

Each uses only lorapub's public face (:mod:`lorapub`, :mod:`lorapub.adapters`) and imports its framework,
Ray, torch and aiohttp lazily, so importing it costs nothing where the framework is absent.
:mod:`lorapub.integrations.relax`: Relax (agentic session service, LoRA adapter mode).
:mod:`lorapub.integrations.areal`: AReaL (its remote SGLang engine; docs/areal.md).
See docs/relax.md, "What changes in Relax's code".
"""

__all__: list[str] = []
