"""The staging protocol both sides share: the publisher's engine adapter and the engine-side staging.

Route, header and variable names, the typed bodies with one codec each (``messages``), refusals, the
token and plan codecs, the safetensors layout with the one dtype table, and the collective barrier.
Imports only the standard library, attrs and ``lorapub.core`` (docs/design.md).
"""

__all__: list[str] = []
