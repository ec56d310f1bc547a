"""Checks pack.sh's .areal/ here, on CPU, the way the GPU machine will import it, before device time is spent.

The machine has its image's packages, the SGLang bundle (.sgl/site.tar.xz), the checkout (lorapub, tests, bench),
lorapub's .whl/ (pyrsistent) and the pack: AReaL's part under .cache/areal/1.0.4 (appended to sys.path by the
harness) and the wheels run.sh installs beside the bundle. This machine has more (flask and the real Ray are
installed here, and a live attempt failed on both). So the check unpacks the pack into a temporary folder and runs
bench/areal_side_by_side.py (default: --quick, both paths, on SGLang doubles) behind an import gate that
replaces sys.meta_path: a top-level module that is in none of the standard library (Python 3.12's: the running
one's, less what 3.12 removed), IMAGE, BUNDLE, the checkout and the pack is refused, as it would be there
(``No module named ...``; an optional import then takes its fallback, as it would there). A top-level name the
pack holds is taken from the pack only (so the stand-in ray, never the ray installed here). The image's and
bundle's packages come from this environment, from .ci/install's .cache/areal/1.0.4 (numba, transformers,
tokenizers, httpx, uvloop...: installed there for the CPU tests) or from Ray's vendored folder (psutil), at this
machine's versions, not the image's.

It fails (exit 1) when the side-by-side fails or a packed module came from elsewhere; it lists the modules it
refused (and who asked), the packed ones nothing imported, and those loaded before the gate (by site's .pth
files) that the machine may lack.

    python3 bench/live_areal/check_pack.py                        # .areal/, side-by-side --quick
    python3 bench/live_areal/check_pack.py --bundle .sgl/site.tar.xz -- --quick --paths lorapub
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_AREAL = os.path.join(ROOT, ".cache", "areal", "1.0.4")

#: Import names of the GPU image's packages: those known to be there (click ... pyarrow; torch 2.11, numpy,
#: attrs and safetensors, which lorapub's own live runs used from the image), then what pip installed with them
#: (their required dependencies), then what SGLang's servers import there that its bundle lacks.
IMAGE = {
    # named
    "click", "jinja2", "markupsafe", "werkzeug", "numba", "llvmlite", "uvloop", "httpx", "httpcore", "aiofiles",
    "einops", "transformers", "tokenizers", "huggingface_hub", "yaml", "psutil", "requests", "rich", "tqdm",
    "typing_extensions", "msgpack", "cloudpickle", "google", "grpc", "prometheus_client", "aiohttp", "pandas",
    "pyarrow", "torch", "torchgen", "functorch", "numpy", "attr", "attrs", "safetensors",
    # required by those: torch (filelock, sympy, mpmath, networkx, fsspec, triton, setuptools on 3.12),
    # transformers and huggingface_hub (packaging, regex, hf_xet, typer, shellingham), httpx (anyio, certifi,
    # idna, h11), requests (charset_normalizer, urllib3), rich (markdown_it, mdurl, pygments), aiohttp
    # (aiohappyeyeballs, aiosignal, frozenlist, multidict, propcache, yarl), pandas (dateutil, pytz, tzdata, six)
    "filelock", "sympy", "mpmath", "networkx", "fsspec", "triton", "setuptools", "pkg_resources", "_distutils_hack",
    "distutils", "packaging", "regex", "hf_xet", "typer", "shellingham", "anyio", "certifi", "idna", "h11",
    "charset_normalizer", "urllib3", "markdown_it", "mdurl", "pygments", "aiohappyeyeballs", "aiosignal",
    "frozenlist", "multidict", "propcache", "yarl", "dateutil", "pytz", "tzdata", "six",
    # required by SGLang and not in its bundle, yet imported by every server there (sglang.srt.utils.common)
    "PIL",
}
#: The SGLang 0.5.17 bundle's top-level modules (docs/gpu-acceptance.md, "Reproduce"); --bundle reads them from
#: the bundle itself instead.
BUNDLE = {
    "IPython", "_cffi_backend", "_soundfile", "_soundfile_data", "annotated_types", "asttokens", "build_backend",
    "build_utils", "cffi", "compressed_tensors", "dill", "distro", "executing", "fastapi", "flashinfer", "gguf",
    "ipython_pygments_lexers", "jedi", "jiter", "jsonschema", "jsonschema_specifications", "loguru",
    "matplotlib_inline", "msgspec", "multipart", "openai", "opentelemetry", "orjson", "parso", "partial_json_parser",
    "pexpect", "prompt_toolkit", "ptyprocess", "pure_eval", "pybase64", "pycparser", "pydantic", "pydantic_core",
    "python_multipart", "referencing", "rpds", "setproctitle", "sgl_kernel", "sglang", "sniffio", "soundfile",
    "stack_data", "starlette", "tokenizers", "transformers", "triton_kernels", "truststore", "tvm_ffi",
    "typing_inspection", "uvicorn", "wcwidth", "xgrammar", "zmq",
}
#: The checkout and lorapub's .whl/ (pyrsistent); lorapub_sglang names the modules lorapub.testing loads from
#: SGLang's files itself.
CHECKOUT = {"lorapub", "tests", "bench", "pyrsistent", "pvectorc", "lorapub_sglang"}
#: Standard-library modules Python 3.12 removed (the machine's Python is 3.12).
GONE_IN_312 = {"asynchat", "asyncore", "imp", "smtpd"}
#: Made by compiled modules as they load, never looked up on a path (and, by prefix or suffix in Gate: the
#: standard library's _sysconfigdata_<platform>, mypyc's <hash>__mypyc).
BUILT = {"cython_runtime", "__main__", "__mp_main__"}


def top_names(folder: str) -> set[str]:
    """The importable top-level names in a folder (packages, modules, extension modules)."""
    names = set()
    for entry in os.listdir(folder):
        if entry.endswith((".dist-info", ".data")) or entry in ("bin", "share", "__pycache__"):
            continue
        path = os.path.join(folder, entry)
        if os.path.isdir(path):
            if entry.isidentifier():
                names.add(entry)
        elif entry.endswith(".py") or entry.endswith(".so"):
            names.add(entry.split(".", 1)[0])
    return names


def bundle_names(tarball: str) -> set[str]:
    with tarfile.open(tarball) as tar:
        firsts = {m.name.lstrip("./").split("/", 1)[0] for m in tar if m.name not in (".", "./")}
    names = set()
    for entry in firsts:
        if entry.endswith((".dist-info", ".data", ".libs")) or entry in ("bin", "share", "tools", ""):
            continue
        names.add(entry.split(".", 1)[0])
    return names


def unpack(pack: str, into: str) -> tuple[str, str]:
    """The pack as the machine has it: AReaL's part (run.sh's .cache/areal/1.0.4) and the wheels' contents."""
    areal_dir, site = os.path.join(into, "areal"), os.path.join(into, "site")
    os.makedirs(areal_dir)
    os.makedirs(site)
    with tarfile.open(os.path.join(pack, "areal-min.tar.xz")) as tar:
        tar.extractall(areal_dir, filter="data")
    for wheel in sorted(os.listdir(pack)):
        if wheel.endswith(".whl"):
            with zipfile.ZipFile(os.path.join(pack, wheel)) as z:
                z.extractall(site)
    return areal_dir, site


def parent(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", default=os.path.join(ROOT, ".areal"), help="pack.sh's output (default .areal)")
    parser.add_argument("--bundle", help="the SGLang bundle's site.tar.xz, to read its modules from it")
    parser.add_argument("side_by_side", nargs="*", help="arguments for the side-by-side, after -- (default --quick)")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.pack, "areal-min.tar.xz")):
        print(f"no {args.pack}/areal-min.tar.xz: run bench/live_areal/pack.sh")
        return 2
    bundle = bundle_names(args.bundle) if args.bundle else BUNDLE
    with tempfile.TemporaryDirectory(prefix="check-pack-") as tmp:
        areal_dir, site = unpack(args.pack, tmp)
        packed = {name: areal_dir for name in top_names(areal_dir)}
        packed.update({name: site for name in top_names(site)})  # run.sh puts the wheels first on the path
        stdlib = set(sys.stdlib_module_names) - GONE_IN_312
        # where this machine has the image's packages outside its site-packages: .ci/install's AReaL folder
        # (numba, transformers, tokenizers, httpx, uvloop, ...) and Ray's vendored copies (psutil); the gate
        # lets only the image's and the bundle's names through from them
        proxies = [CPU_AREAL] if os.path.isdir(CPU_AREAL) else []
        ray = importlib.util.find_spec("ray")
        if ray is not None and ray.submodule_search_locations:
            proxies += [os.path.join(p, "thirdparty_files") for p in ray.submodule_search_locations
                        if os.path.isdir(os.path.join(p, "thirdparty_files"))]
        config = {
            "proxies": proxies,
            "allowed": sorted(stdlib | IMAGE | bundle | CHECKOUT | BUILT | set(packed)),
            "packed": packed, "areal_dir": areal_dir, "report": os.path.join(tmp, "report.json"),
            "argv": args.side_by_side or ["--quick"],
        }
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.path.join(ROOT, "src"), ROOT]))
        print(f"check_pack: side-by-side {' '.join(config['argv'])} behind the import gate; packed: "
              f"{', '.join(sorted(packed))}", flush=True)
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", config_path], env=env).returncode
        try:
            with open(config["report"]) as f:
                report = json.load(f)
        except FileNotFoundError:
            print(f"check_pack: FAILED, the run left no report (rc {rc})")
            return 1
    failures = []
    print("\ncheck_pack: refused (not on the machine), and who asked:")
    for name, where in sorted(report["refused"].items()):
        print(f"  {name:24s} {where}")
    for name, origin in sorted(report["packed_from"].items()):
        if origin is not None and not origin.startswith(tmp):
            failures.append(f"{name} came from {origin}, not the pack")
    unused = sorted(set(packed) - set(report["packed_from"]))
    if unused:
        print(f"check_pack: packed, never imported: {', '.join(unused)}")
    early = sorted(set(report["early"]) - set(config["allowed"]))
    if early:
        print(f"check_pack: loaded before the gate (site's .pth files), not known on the machine: {', '.join(early)}")
    if report["rc"] != 0:
        failures.append(f"the side-by-side failed (exit {report['rc']}): {report.get('error') or 'see above'}")
    for line in failures:
        print(f"check_pack: FAILED: {line}")
    if not failures:
        print(f"check_pack: OK: the side-by-side ran with the pack ({', '.join(sorted(report['packed_from']))} "
              "from it) and nothing the machine lacks")
    return 1 if failures else 0


class Gate:
    """sys.meta_path's only finder: refuses a top-level name outside the allowed ones, takes a packed one from the
    pack, and leaves everything else to the finders it replaced."""

    def __init__(self, finders: list, allowed: set[str], packed: dict[str, str]) -> None:
        self.finders, self.allowed, self.packed = finders, allowed, packed
        self.refused: dict[str, str] = {}

    def find_spec(self, name: str, path=None, target=None):  # noqa: ANN001, ANN201 - importlib's protocol
        if "." not in name:
            if name in self.packed:
                return importlib.machinery.PathFinder.find_spec(name, [self.packed[name]], target)
            if name not in self.allowed and not name.endswith("__mypyc") and not name.startswith("_sysconfigdata_"):
                self.refused.setdefault(name, asker())
                return None
        for finder in self.finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - importlib.metadata's
        for finder in self.finders:
            if hasattr(finder, "find_distributions"):
                yield from finder.find_distributions(*args, **kwargs)

    def invalidate_caches(self) -> None:
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()


def asker() -> str:
    """The first frame outside the import machinery: the module whose import was refused."""
    frame = sys._getframe(2)
    while frame is not None:
        file = frame.f_code.co_filename
        if not (file.startswith("<frozen") or "importlib" in file or file == __file__):
            return f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else file}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def child(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    early = sorted({n.partition(".")[0] for n in sys.modules})
    gate = Gate(list(sys.meta_path), set(config["allowed"]), config["packed"])
    sys.meta_path[:] = [gate]
    sys.path_importer_cache.clear()
    rc, error = 0, None
    try:
        from tests.integrations import areal_harness

        areal_harness.AREAL_DIR = __import__("pathlib").Path(config["areal_dir"])
        areal_harness.areal_on_path()
        sys.path.extend(config["proxies"])
        import runpy

        script = os.path.join(ROOT, "bench", "areal_side_by_side.py")
        sys.argv = [script, *config["argv"]]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as stop:
            rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - reported, with its traceback
        import traceback

        traceback.print_exc()
        rc, error = 1, f"{type(exc).__name__}: {exc}"
    packed_from = {name: getattr(sys.modules[name], "__file__", None)
                   for name in config["packed"] if name in sys.modules}
    with open(config["report"], "w") as f:
        json.dump({"rc": rc, "error": error, "refused": gate.refused, "packed_from": packed_from, "early": early}, f)
    sys.stdout.flush()
    os._exit(0)  # the side-by-side's threads and loops are done with; the report is written


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    sys.exit(parent(sys.argv[1:]))
