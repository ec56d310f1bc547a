"""lorapub's SGLang patch for every SGLang release lorapub supports (0.5.17, its variant 0.5.17+relax,
and 0.5.23), in two forms of the same change: at runtime (:func:`apply`; ``python -m
lorapub.sglang_patch launch``) and as diffs (package data, ``python -m lorapub.sglang_patch
check|apply``). Both recognise a release by the fingerprints of every function they touch
(:mod:`lorapub.sglang_patch.targets`) and refuse any other code with :class:`PatchMismatch`.
See docs/sglang-patch.md.
"""

from __future__ import annotations

from typing import Any

from lorapub.core.identity import MANAGED_PREFIX
from lorapub.sglang_patch import provenance as _provenance
from lorapub.sglang_patch import release_0517, release_0523
from lorapub.sglang_patch.edits import edited_source, install_method, install_methods
from lorapub.sglang_patch.routes import INCARNATION, state_of
from lorapub.sglang_patch.routes import add_staging_routes as _add_staging_routes
from lorapub.sglang_patch.routes import add_state_route as _add_state_route
from lorapub.wire.routes import RECLAIM_HEADER
from lorapub.sglang_patch.targets import (
    RELEASES,
    SUPPORTED,
    PatchMismatch,
    detect,
    fingerprint,
    function_source,
    is_managed,
    sglang_root,
)

PATCH_MARK = "__lorapub_patched__"

__all__ = [
    "INCARNATION", "MANAGED_PREFIX", "PATCH_MARK", "RECLAIM_HEADER", "RELEASES", "SUPPORTED", "PatchMismatch",
    "apply", "detect", "fingerprint", "function_source", "is_managed", "sglang_root", "state_of", "verify",
]


def verify(root: str | None = None) -> str:
    """The supported release found at ``root``; :class:`PatchMismatch` for any other code."""
    return detect(root).version


def _apply_0517(cls: Any, root: str | None, managed_prefix: str, version: str = "0.5.17") -> None:
    import os

    # Edit every source first: a missing anchor raises before the class is touched.
    function_edits, variant_methods = release_0517.VARIANT_EDITS.get(version, ((), ""))
    edited = [(fe, edited_source(fe, root)[1]) for fe in (*release_0517.FUNCTION_EDITS, *function_edits)]
    mixin_globals = cls._unload_lora_adapter_locked.__globals__
    names: dict[str, Any] = {"os": os}
    exec(release_0517.MIXIN_GLOBALS, names)
    names["LORAPUB_MANAGED_PREFIX"] = managed_prefix  # _is_managed_lora reads it from `names`
    names["LORAPUB_RECLAIM_HEADER"] = RECLAIM_HEADER
    for key in ("LORAPUB_MANAGED_PREFIX", "LORAPUB_RECLAIM_HEADER", "_is_managed_lora"):
        mixin_globals[key] = names[key]
    install_methods(cls, release_0517.TM_METHODS, cls._handle_batch_output.__globals__)
    install_methods(cls, release_0517.MIXIN_METHODS, mixin_globals)
    if variant_methods:
        install_methods(cls, variant_methods, mixin_globals)
    for fe, source in edited:
        install_method(cls, fe.name, source, getattr(cls, fe.name).__globals__)


def apply(
    tokenizer_manager_cls: Any = None,
    *,
    root: str | None = None,
    managed_prefix: str = MANAGED_PREFIX,
    app: Any = None,
    add_state_route: bool = True,
    prepare_loads: bool = True,
) -> Any:
    """Patch ``tokenizer_manager_cls`` (default: SGLang's TokenizerManager) in place. Idempotent.

    ``root`` is the ``sglang`` package folder the class was loaded from (default: the
    installed one); its code decides the release. ``prepare_loads`` (patching SGLang's own class):
    SGLang's schedulers start with :mod:`lorapub.sglang_patch.prepared_load`, so an adapter load
    is prepared off the scheduler thread, which stops decoding only to swap it in (1-8 ms live).
    """
    release = detect(root)
    if tokenizer_manager_cls is None:
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        tokenizer_manager_cls = TokenizerManager

        if prepare_loads:
            from lorapub.sglang_patch.prepared_load import route_schedulers

            route_schedulers()
    if getattr(tokenizer_manager_cls, PATCH_MARK, None):
        return tokenizer_manager_cls
    if release.version == "0.5.23":
        release_0523.apply(tokenizer_manager_cls, managed_prefix)
    else:
        _apply_0517(tokenizer_manager_cls, root, managed_prefix, release.version)
    tokenizer_manager_cls.lorapub_managed_prefix = managed_prefix
    _provenance.install(tokenizer_manager_cls)  # every managed response carries its stamp
    setattr(tokenizer_manager_cls, PATCH_MARK, release.version)
    if add_state_route:
        _add_state_route(app, release.version)
        _add_staging_routes(app, release.version)
    return tokenizer_manager_cls
