"""Pure core: immutable state and transition functions. No I/O, clocks or randomness.

Importable without torch, ray, aiohttp or sglang. Each name is imported from the module that
defines it (``lorapub.core.registry``, ``lorapub.core.identity``…); this package re-exports nothing.
"""

__all__: list[str] = []
