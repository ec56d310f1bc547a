"""Pure core: immutable state and transition functions. No I/O, clocks or randomness.

Importable without torch, ray, aiohttp or sglang. Each name is imported from the module that
defines it (``lorapub.core.registry``, ``lorapub.core.identity``…); this package re-exports nothing.
"""

__all__: list[str] = []

# The names this package re-exported until it stopped: where each one is imported from now. An old
# ``from lorapub.core import X`` fails naming that place instead of a bare "cannot import name".
_MOVED = {
    **dict.fromkeys(("AttemptToken", "SessionKey", "VersionKey", "VersionState"), "lorapub"),
    **dict.fromkeys(("Phase", "ReadyLocal", "SendBegin"), "lorapub.ports"),
    **dict.fromkeys(("TargetState",), "lorapub.core.attempt"),
    **dict.fromkeys(("SOURCE", "Ignored", "ReadyToCommit", "ReclaimEligible", "SendCleanup", "SendEnd",
                     "SendReclaim", "TransferBucket"), "lorapub.core.effects"),
    **dict.fromkeys(("is_managed_name", "lora_name_for"), "lorapub.core.identity"),
    **dict.fromkeys(("Bucket", "BucketPlan", "Manifest", "TensorEntry"), "lorapub.core.manifest"),
    **dict.fromkeys(("Outcome", "RegistryState", "Result", "handle", "new_registry"), "lorapub.core.registry"),
    **dict.fromkeys(("Binding", "SessionState"), "lorapub.core.session"),
    **dict.fromkeys(("CommitReceipt",), "lorapub.core.version"),
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        # ImportError (not AttributeError, which ``from … import`` would replace with its own words)
        raise ImportError(f"lorapub.core no longer re-exports {name}: use `from {_MOVED[name]} import {name}`",
                          name=name)
    raise AttributeError(f"module 'lorapub.core' has no attribute {name!r}")
