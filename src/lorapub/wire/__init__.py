"""The staging protocol both sides share: the publisher's engine adapter and the engine-side staging.

Routes, refusals, the token and plan codecs, the safetensors layout with the one dtype table, and the
collective barrier. Imports only the standard library and ``lorapub.core`` (docs/design.md).
"""

__all__: list[str] = []
