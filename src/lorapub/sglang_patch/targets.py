"""The one table of what lorapub's SGLang patch touches, per supported SGLang release.

Both forms of the patch read it: the runtime form checks every fingerprint before it
replaces a function, the diff form checks them before it touches a file. A release is
recognised by its code, not by its version string: every fingerprint must match.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os

import attrs

# Defined once: the naming value in the core, the protocol's names in wire (the HTTP adapter reads them there too).
from lorapub.core.identity import MANAGED_PREFIX
from lorapub.wire.routes import RECLAIM_HEADER, STATE_ROUTE

TM_FILE = "srt/managers/tokenizer_manager.py"
MIXIN_FILE = "srt/managers/tokenizer_control_mixin.py"
HTTP_FILE = "srt/entrypoints/http_server.py"
SCHEDULER_FILE = "srt/managers/scheduler.py"
LORA_MANAGER_FILE = "srt/lora/lora_manager.py"
MEM_POOL_FILE = "srt/lora/mem_pool.py"
LORA_FILE = "srt/lora/lora.py"
LORA_CONFIG_FILE = "srt/lora/lora_config.py"
POOL = "LoRAMemoryPool"
TM = "TokenizerManager"
MIXIN = "TokenizerControlMixin"
#: Relax's SGLang patch (``docker/patch/sglang/v0.5.17.patch`` of redai-studio/Relax) adds this route
#: handler: it replaces an adapter of the same name in place (unload, then register) without going
#: through ``unload_lora_adapter``. A tree that has it is the ``0.5.17+relax`` variant, never plain 0.5.17.
RELAX_ROUTE = (MIXIN_FILE, MIXIN, "update_lora_from_distributed")


class PatchMismatch(RuntimeError):
    """The SGLang code found is not a release this patch was written for."""


@attrs.frozen
class Release:
    version: str
    # (file, class, function) -> sha256 of the function's source text in that release
    fingerprints: dict[tuple[str, str, str], str]
    touched_files: tuple[str, ...] = (TM_FILE, MIXIN_FILE, HTTP_FILE, SCHEDULER_FILE)
    # the text a diff-patched file carries, so an applied patch is recognised
    applied_marker: tuple[str, str] = (MIXIN_FILE, "LORAPUB_MANAGED_PREFIX")
    # (file, class, function) this release must not have: code that has one is another variant
    absent: tuple[tuple[str, str, str], ...] = ()
    # a known variant: the upstream release it is built on, whose diffs and edits it takes
    base: str | None = None

    @property
    def upstream(self) -> str:
        """The SGLang release whose diffs apply (the release itself, or a variant's base)."""
        return self.base or self.version


#: Functions both releases have to the letter, each relied on unchanged.
_SAME_IN_0517_AND_0523 = {
    # the pool's slot clearing, which slot images rely on
    (MEM_POOL_FILE, POOL, "_clear_buffer_slot_for_base"):
        "e47bd573f068f58f2dcc4e8bf935a673f1540aaf7328e098a52942d2d9d6d8ea",
    # what the preparing helper (prepared_load/helper.py) runs in its own process: the adapter built with
    # the manager's arguments, its config, and its weights' processing
    (LORA_FILE, "LoRAAdapter", "__init__"):
        "6c8b31889dc5c2d0ff89c40a4c8f90fa1048988bd4ca7ad7ed5c7c996eee4b81",
    (LORA_FILE, "LoRAAdapter", "initialize_weights"):
        "bc574e811d121ee35135a8138ead263b2471a031d9f52304a365b32f719bbdb1",
    (LORA_FILE, "LoRAAdapter", "initialize_weights_from_tensors"):
        "734c9bc5a27587dc8a94fd2d962ffb919c3df1af9d58520d1b6fc5f52bb5341f",
    (LORA_CONFIG_FILE, "LoRAConfig", "__init__"):
        "576bd5c617388530a801d1d59a337db163b4200e6c4b1f462a015f866d4f90d8",
}

_FINGERPRINTS_0517 = {
    # patched: exactly-once release at every terminal, orphans of discarded requests
    (TM_FILE, TM, "_handle_batch_output"):
        "4adfb1cf333c597230e8ae239b3d435261bffb856d1837d747c329179a625830",
    (TM_FILE, TM, "_handle_abort_finish_reason"):
        "b53564ab76bbb12d3b5ee06a6f8866c277be1a0a2ab827c989f12ae75fc736c0",
    (TM_FILE, TM, "_handle_abort_req"):
        "8e49bca9d1d26f2c66640eda918afc67b04481ad5b0b51e8996ad3f47de7486b",
    (TM_FILE, TM, "_discard_pending_req_states"):
        "4ef7ec4c64bc33b9f16750be961284654e2fb941000df95782b8e6446d9a627d",
    # relied on unchanged: the implicit reload that patch 2 starves of its cache entry
    (TM_FILE, TM, "_resolve_lora_path"):
        "d5be9dde312f9d1679d170d6da389c1027463f35a2c190f7a3fa39cc060b9157",
    (MIXIN_FILE, MIXIN, "_unload_lora_adapter_locked"):
        "4d921cecf004faf986b5ff7936e5c289f7b3e755cf205bcc47abd3222a93271e",
    (MIXIN_FILE, MIXIN, "unload_lora_adapter"):
        "40a0c6ea0f6463c098e79f05c4f48a24081aa53794266f821b4ba477ff993e5e",
    (MIXIN_FILE, MIXIN, "load_lora_adapter"):
        "056532175533ab931e681a3acf826e1c624bb42a69af6d24785ee37343f44a70",
    # relied on unchanged by prepared_load: the load the scheduler runs, its weight read
    (SCHEDULER_FILE, "Scheduler", "load_lora_adapter"):
        "d728ebacda58c9d328944a7baebf1b8d181577fb7c72f7ab3c1d15c10b7f8be4",
    (LORA_MANAGER_FILE, "LoRAManager", "_load_lora_adapter"):
        "63364d7ea493dbbb04bff9aedee97a358451a47d5a56478a28b1f8d19ce75571",
    (LORA_MANAGER_FILE, "LoRAManager", "load_lora_weights"):
        "a143735cf64cff227fb352bc539b5cb55bc67728454afe1d4320099f84ea16dc",
    # ... and the slot fill its slot images replay, with the pool's slot buffers it names
    (MEM_POOL_FILE, POOL, "load_lora_weight_to_buffer"):
        "b09e9e460b105624e757f3f8e61d6e8ec9a6c77108d2323763a9437c54a23e30",
    **_SAME_IN_0517_AND_0523,
}

RELEASES: dict[str, Release] = {
    "0.5.17": Release("0.5.17", _FINGERPRINTS_0517, absent=(RELAX_ROUTE,)),
    # SGLang 0.5.17 with Relax's patch (redai-studio/Relax, docker/patch/sglang/v0.5.17.patch at
    # 0a91dd1db44022920f61f05948e89a5cb83f8b38): it edits none of the functions above, and adds the
    # route handler RELAX_ROUTE, which the variant's own edit guards (release_0517.RELAX_FUNCTION_EDITS).
    "0.5.17+relax": Release(
        "0.5.17+relax",
        {**_FINGERPRINTS_0517,
         RELAX_ROUTE: "bfec3b2e181b16f00840144af586be451e2de56ba84ad66a1319c8e57bbb80d3"},
        base="0.5.17",
    ),
    "0.5.23": Release(
        "0.5.23",
        {
            (TM_FILE, TM, "_release_lora_once"):
                "43c0ffb0b9b40bd47aded7006d1bf1435cb4c27f49c5e637bd62862c0783d44e",
            (TM_FILE, TM, "_resolve_lora_path"):
                "a0718ec3647eaae1c5bd42d2e5adec3422bea3aba80263700bcc4810fb14e8c1",
            (MIXIN_FILE, MIXIN, "_unload_lora_adapter_locked"):
                "d774b493d258aeff0cf2c09e9c6e966bcc5c68f21555002768c6064d75adc4b1",
            (MIXIN_FILE, MIXIN, "unload_lora_adapter"):
                "1b96d090c7dfc432b1497083e4a5c48756142059d1f0583f99afbef859bd6bac",
            (MIXIN_FILE, MIXIN, "load_lora_adapter"):
                "e96d92b277cf95f38cb8b4eda91672608d8e33561b44616dfc25ff96d39cb928",
            (SCHEDULER_FILE, "Scheduler", "load_lora_adapter"):
                "920b86878acade658f20718e165d920394bdb65105c45f96de7372adcc54d9d1",
            (LORA_MANAGER_FILE, "LoRAManager", "_load_lora_adapter"):
                "17dbc3acd7f987278437be5bfe645a7973aa466a65f0aaa7425569cc925e542a",
            (LORA_MANAGER_FILE, "LoRAManager", "load_lora_weights"):
                "7ad5ad02b5c660eeb07a18fb32e3c9e00c6f8a8a42c2d5a61f8ceb38f131db17",
            (MEM_POOL_FILE, POOL, "load_lora_weight_to_buffer"):
                "f8c86078e6b20444af0238b5d6b498b2e0a895a0c905134c23fe8be44b79d1f0",
            **_SAME_IN_0517_AND_0523,
        },
        absent=(RELAX_ROUTE,),
    ),
}
SUPPORTED = tuple(RELEASES)


def sglang_root() -> str:
    """The installed ``sglang`` package folder (found without importing sglang)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchMismatch(f"sglang is not installed; lorapub's patch supports SGLang {', '.join(SUPPORTED)}")
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=32)
def _parsed(path: str, mtime: float) -> tuple[str, ast.Module]:
    with open(path) as f:
        src = f.read()
    return src, ast.parse(src)


def parsed(path: str) -> tuple[str, ast.Module]:
    return _parsed(path, os.path.getmtime(path))


def function_source(rel: str, class_name: str, name: str, root: str | None = None) -> str:
    src, tree = parsed(os.path.join(root or sglang_root(), rel))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return ast.get_source_segment(src, item) or ""
    raise PatchMismatch(f"{rel}: {class_name}.{name} not found")


def fingerprint(rel: str, class_name: str, name: str, root: str | None = None) -> str:
    return hashlib.sha256(function_source(rel, class_name, name, root).encode()).hexdigest()


def _differences(release: Release, root: str) -> list[str]:
    bad = []
    for (rel, cls, name), expected in release.fingerprints.items():
        try:
            got = fingerprint(rel, cls, name, root)
        except (OSError, PatchMismatch) as e:
            bad.append(f"{cls}.{name}: {e}")
            continue
        if got != expected:
            bad.append(f"{cls}.{name}: fingerprint {got[:12]} != {expected[:12]}")
    for rel, cls, name in release.absent:
        try:
            function_source(rel, cls, name, root)
        except (OSError, PatchMismatch):
            continue  # absent, as this release has it
        bad.append(f"{cls}.{name}: present, and SGLang {release.version} has no such function")
    return bad


def detect(root: str | None = None) -> Release:
    """The supported release whose every fingerprint matches the code at ``root``.

    Raises :class:`PatchMismatch` naming the supported releases and, for each, what differs.
    """
    root = root or sglang_root()
    report = []
    for release in RELEASES.values():
        bad = _differences(release, root)
        if not bad:
            return release
        report.append(f"SGLang {release.version}:\n    " + "\n    ".join(bad))
    raise PatchMismatch(
        f"lorapub's SGLang patch supports SGLang {', '.join(SUPPORTED)} only; the code at {root} "
        "matches none of them, so nothing was patched:\n  " + "\n  ".join(report)
    )


def is_managed(name: object, prefix: str = MANAGED_PREFIX) -> bool:
    return isinstance(name, str) and bool(prefix) and name.startswith(prefix)
