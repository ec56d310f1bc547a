"""lorapub's patch for SGLang 0.5.17 (and its variant 0.5.17+relax), as source edits: exactly-once
release of every LoRA ref, no implicit reload of managed adapters, managed pinned adapters leave
only through lorapub. The runtime form recompiles each edited function from the fingerprinted
source; the diff form (``diffs/0.5.17``) is these edits applied to the files.
See docs/sglang-patch.md, "SGLang 0.5.17".
"""

from __future__ import annotations

import os

import attrs

from lorapub.sglang_patch.targets import MIXIN, MIXIN_FILE, TM, TM_FILE, PatchMismatch


@attrs.frozen
class Edit:
    old: str
    new: str


@attrs.frozen
class FunctionEdit:
    rel: str
    cls: str
    name: str
    edits: tuple[Edit, ...]


RELEASE_ONCE = "self._lorapub_release_lora_once(state)"

FUNCTION_EDITS = (
    FunctionEdit(TM_FILE, TM, "_handle_batch_output", (
        Edit(
            "                    asyncio.create_task(self.lora_registry.release(state.obj.lora_id))",
            f"                    {RELEASE_ONCE}",
        ),
        Edit(
            "            state = self.rid_to_state.get(rid, None)\n            if state is None:\n",
            "            state = self.rid_to_state.get(rid, None)\n            if state is None:\n"
            "                if recv_obj.finished_reasons[i] is not None:\n"
            "                    # lorapub: the terminal echo of a discarded, dispatched request\n"
            "                    self._lorapub_release_orphan(rid)\n",
        ),
    )),
    FunctionEdit(TM_FILE, TM, "_handle_abort_finish_reason", (
        Edit(
            "                await self.lora_registry.release(state.obj.lora_id)",
            f"                {RELEASE_ONCE}",
        ),
    )),
    FunctionEdit(TM_FILE, TM, "_handle_abort_req", (
        Edit(
            "        state = self.rid_to_state.get(recv_obj.rid)\n        if state is None:\n",
            "        state = self.rid_to_state.get(recv_obj.rid)\n        if state is None:\n"
            "            self._lorapub_release_orphan(recv_obj.rid)  # lorapub\n",
        ),
        Edit(
            "        self._remove_req_state(recv_obj.rid)\n\n        state.out_list.append(out)",
            "        self._remove_req_state(recv_obj.rid)\n"
            "        # lorapub: an abort echoed by the scheduler is this request's terminal\n"
            "        if self.enable_lora and state.obj.lora_path:\n"
            f"            {RELEASE_ONCE}\n\n        state.out_list.append(out)",
        ),
    )),
    FunctionEdit(TM_FILE, TM, "_discard_pending_req_states", (
        Edit(
            "                self._remove_req_state(child_rid, lifecycle_id)\n"
            "            self._remove_req_state(logical_rid, lifecycle_id)",
            "                self._lorapub_discard_req_state(child_rid, lifecycle_id)\n"
            "            self._lorapub_discard_req_state(logical_rid, lifecycle_id)",
        ),
    )),
    FunctionEdit(MIXIN_FILE, MIXIN, "_unload_lora_adapter_locked", (
        Edit(
            "        # Unregister the LoRA adapter from the registry to stop new requests for this adapter\n"
            "        # from being started.\n"
            "        lora_id = await self.lora_registry.unregister(obj.lora_name)\n"
            "        obj.lora_id = lora_id\n",
            "        if _is_managed_lora(obj.lora_name):\n"
            "            # lorapub: a managed adapter that starts unloading is gone for good; a late\n"
            "            # request must fail with \"never been loaded\", not reload it under a new lora_id.\n"
            "            self.lora_ref_cache.pop(obj.lora_name, None)\n"
            "        pending = self._lorapub_pending_unloads()\n"
            "        lora_id = pending.get(obj.lora_name)\n"
            "        if lora_id is None:\n"
            "            # Unregister the LoRA adapter from the registry to stop new requests for this adapter\n"
            "            # from being started.\n"
            "            lora_id = await self.lora_registry.unregister(obj.lora_name)\n"
            "            pending[obj.lora_name] = lora_id\n"
            "        obj.lora_id = lora_id\n",
        ),
        Edit(
            "            await self.update_lora_adapter_communicator(obj)\n        )\n\n        return result",
            "            await self.update_lora_adapter_communicator(obj)\n        )\n"
            "        if result.success:\n            pending.pop(obj.lora_name, None)\n        return result",
        ),
    )),
    FunctionEdit(MIXIN_FILE, MIXIN, "unload_lora_adapter", (
        Edit(
            "            async with self.lora_update_lock:\n"
            "                return await self._unload_lora_adapter_locked(obj)",
            "            self._lorapub_refuse_ordinary_unload(obj, _)\n"
            "            async with self.lora_update_lock:\n"
            "                return await self._unload_lora_adapter_locked(obj)",
        ),
    )),
)

# -- the 0.5.17+relax variant ---------------------------------------------------------------------
# Relax's patch adds TokenizerControlMixin.update_lora_from_distributed (POST /update_lora_from_distributed):
# under lora_update_lock it unloads a registered adapter of the same name through
# _unload_lora_adapter_locked (never unload_lora_adapter, so patch 3's refusal is not on its path),
# then registers the tensors it received under that name (pinned only if the caller says so) and
# evicts LRU unpinned adapters past max_loaded_loras. Aimed at a managed name it would overwrite an
# immutable version, or register one behind lorapub's back; the variant's edit refuses managed names.
RELAX_FUNCTION_EDITS = (
    FunctionEdit(MIXIN_FILE, MIXIN, "update_lora_from_distributed", (
        Edit(
            "            async with self.lora_update_lock:\n",
            "            self._lorapub_refuse_distributed_update(obj)  # lorapub\n"
            "            async with self.lora_update_lock:\n",
        ),
    )),
)

# Method added to TokenizerControlMixin in the 0.5.17+relax variant (before update_lora_from_distributed).
RELAX_MIXIN_METHODS = '''
    # -- lorapub: managed names never arrive through /update_lora_from_distributed ------------------
    def _lorapub_refuse_distributed_update(self, obj):
        """That route replaces an adapter of the same name in place; a managed version is immutable."""
        if _is_managed_lora(obj.lora_name):
            raise ValueError(
                f"LoRA adapter '{obj.lora_name}' is managed by lorapub; /update_lora_from_distributed "
                "refuses managed names (lorapub publishes a new version under a new name instead)"
            )
'''

#: The variant edits of each known variant, on top of its base release's edits.
VARIANT_EDITS = {"0.5.17+relax": (RELAX_FUNCTION_EDITS, RELAX_MIXIN_METHODS)}


def apply_variant_edits(root: str, version: str) -> list[str]:
    """Diff form of a variant: edit, in place, a tree at ``root`` its base release's diffs were applied
    to. Every anchor is checked before anything is written. Returns the files rewritten."""
    from lorapub.sglang_patch.edits import edited_source, insert_before, read

    if version not in VARIANT_EDITS:
        return []
    function_edits, methods = VARIANT_EDITS[version]
    texts = {fe.rel: read(root, fe.rel) for fe in function_edits}
    for fe in function_edits:
        original, edited = edited_source(fe, root)
        assert texts[fe.rel].count(original) == 1, fe.name
        texts[fe.rel] = texts[fe.rel].replace(original, edited)
    texts[MIXIN_FILE] = insert_before(
        texts.get(MIXIN_FILE) or read(root, MIXIN_FILE), "    async def update_lora_from_distributed(\n",
        methods.lstrip("\n") + "\n", MIXIN_FILE,
    )
    # the diff form's state route names the variant it runs on
    from lorapub.sglang_patch.targets import HTTP_FILE

    texts[HTTP_FILE] = read(root, HTTP_FILE)
    stamp = '        "sglang": "0.5.17",\n'
    if texts[HTTP_FILE].count(stamp) != 1:
        raise PatchMismatch(f"{HTTP_FILE}: lorapub's state route is not in place (apply the 0.5.17 diffs first)")
    texts[HTTP_FILE] = texts[HTTP_FILE].replace(stamp, f'        "sglang": "{version}",\n')
    for rel, text in texts.items():
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return sorted(texts)


# Methods added to TokenizerManager (tokenizer_manager.py), class-body indentation.
TM_METHODS = '''
    # -- lorapub: exactly-once LoRA release ------------------------------------------
    def _lorapub_release_lora_once(self, state):
        """Release the LoRA ref a request acquired, at most once, whatever its terminal path."""
        if state.__dict__.get("lorapub_lora_released"):
            return None
        state.__dict__["lorapub_lora_released"] = True
        if not (self.enable_lora and state.obj.lora_path) or getattr(state.obj, "lora_id", None) is None:
            return None  # rejected before acquire: nothing to release
        return asyncio.create_task(self.lora_registry.release(state.obj.lora_id))

    def _lorapub_orphans(self):
        orphans = self.__dict__.get("lorapub_lora_orphans")
        if orphans is None:
            orphans = self.__dict__["lorapub_lora_orphans"] = {}
        return orphans

    def _lorapub_release_orphan(self, rid):
        state = self._lorapub_orphans().pop(rid, None)
        if state is not None:
            self._lorapub_release_lora_once(state)

    def _lorapub_discard_req_state(self, rid, lifecycle_id):
        """Drop a failed request's state; release its LoRA ref now, or at the scheduler's echo."""
        state = self._remove_req_state(rid, lifecycle_id)
        if state is not None and self.enable_lora and state.obj.lora_path:
            if state.dispatched:
                self._lorapub_orphans()[rid] = state  # still in the scheduler until it echoes
            else:
                self._lorapub_release_lora_once(state)
        return state
'''

# Methods added to TokenizerControlMixin (tokenizer_control_mixin.py).
MIXIN_METHODS = '''
    # -- lorapub: managed adapters -----------------------------------------------------
    def _lorapub_pending_unloads(self):
        """Unloads started but not finished (name -> lora_id), so a retry resumes the same one."""
        pending = self.__dict__.get("lorapub_pending_unloads")
        if pending is None:
            pending = self.__dict__["lorapub_pending_unloads"] = {}
        return pending

    def _lorapub_refuse_ordinary_unload(self, obj, request):
        """A managed pinned adapter leaves only through lorapub's reclaim or cleanup."""
        ref = self.lora_registry.get_all_adapters().get(obj.lora_name)
        if (
            _is_managed_lora(obj.lora_name)
            and ref is not None
            and ref.pinned
            and obj.lora_name not in self._lorapub_pending_unloads()
            and not (request is not None and request.headers.get(LORAPUB_RECLAIM_HEADER))
        ):
            raise ValueError(
                f"LoRA adapter '{obj.lora_name}' is managed by lorapub; "
                f"unload refused without {LORAPUB_RECLAIM_HEADER}"
            )
'''

# Module-level names the mixin methods use (the runtime form puts them in the module's globals).
MIXIN_GLOBALS = '''
# lorapub: adapters under this name prefix are managed (versioned, pinned, reclaimed by lorapub).
LORAPUB_MANAGED_PREFIX = os.environ.get("SGLANG_LORAPUB_MANAGED_PREFIX", "relax_policy_lora@")
LORAPUB_RECLAIM_HEADER = "X-Lorapub-Reclaim-Id"


def _is_managed_lora(lora_name) -> bool:
    return bool(LORAPUB_MANAGED_PREFIX) and isinstance(lora_name, str) and lora_name.startswith(LORAPUB_MANAGED_PREFIX)
'''

# The state route, added to http_server.py by the diff form (the runtime form adds routes.py's).
HTTP_ROUTE = '''_LORAPUB_INCARNATION = uuid.uuid4().hex


@app.get("/lorapub/state")
@auth_level(AuthLevel.ADMIN_OPTIONAL)
async def lorapub_state():
    """lorapub: this server's incarnation and its LoRA registry (ids, pins, native refs)."""
    from lorapub.sglang_patch.routes import adapter_table

    tm = _global_state.tokenizer_manager
    registry = tm.lora_registry
    return {
        "incarnation": _LORAPUB_INCARNATION,
        "sglang": "0.5.17",
        "patch": "diff",
        "managed_patch": True,
        "stamps": True,
        "max_loaded_loras": tm.server_args.max_loaded_loras,
        "adapters": adapter_table(registry),
        "pending_unloads": dict(tm._lorapub_pending_unloads()),
        "staging": _LORAPUB_STAGING.report(),
    }


'''


def patched_files(root: str) -> dict[str, str]:
    """The three files of an SGLang 0.5.17 tree at ``root`` with lorapub's edits (for the diffs)."""
    from lorapub.sglang_patch.edits import edited_source, insert_before, read
    from lorapub.sglang_patch.routes import HTTP_STAGING_BLOCK
    from lorapub.sglang_patch.targets import HTTP_FILE

    texts = {rel: read(root, rel) for rel in (TM_FILE, MIXIN_FILE, HTTP_FILE)}
    for fe in FUNCTION_EDITS:
        original, edited = edited_source(fe, root)
        assert texts[fe.rel].count(original) == 1, fe.name
        texts[fe.rel] = texts[fe.rel].replace(original, edited)
    texts[TM_FILE] = insert_before(texts[TM_FILE], "    def _discard_pending_req_states(\n", TM_METHODS.lstrip("\n") + "\n", TM_FILE)
    mixin = texts[MIXIN_FILE]
    mixin = insert_before(mixin, "import time\n", "import os\n", MIXIN_FILE)
    mixin = insert_before(mixin, "def _merge_lora_update_results(", MIXIN_GLOBALS.lstrip("\n") + "\n\n", MIXIN_FILE)
    mixin = insert_before(mixin, "    async def _unload_lora_adapter_locked(\n", MIXIN_METHODS.lstrip("\n") + "\n", MIXIN_FILE)
    texts[MIXIN_FILE] = mixin
    texts[HTTP_FILE] = insert_before(
        texts[HTTP_FILE], '@app.api_route("/load_lora_adapter", methods=["POST"])\n', HTTP_ROUTE + HTTP_STAGING_BLOCK,
        HTTP_FILE
    )
    return texts
