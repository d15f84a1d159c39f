"""Command line: ``python -m dsv4_cupy {info,compile,warmup,demo,bench}`` (also
installed as ``dsv4-cupy``). A command that fails prints one line on stderr and
exits non-zero; ``--debug`` shows the traceback."""
from __future__ import annotations

import argparse
import platform
import re
import sys
import time


def _info(args) -> int:
    import numba
    import numpy

    from . import __version__, device, loader
    from .errors import Dsv4Error
    from .spec import DeepseekV4FlashMLABackend
    print(f"dsv4_cupy {__version__}  python {platform.python_version()}  numpy {numpy.__version__}"
          f"  numba {numba.__version__}")
    try:
        import cupy
        print(f"cupy {cupy.__version__}")
        print(f"nvrtc {'.'.join(map(str, device.nvrtc_version()))}")
        gpu = device.require_gpu()
        cap = DeepseekV4FlashMLABackend.current_device_capability()
        supported = DeepseekV4FlashMLABackend.supports_compute_capability(cap)
        name = cupy.cuda.runtime.getDeviceProperties(gpu.id)["name"].decode()
        print(f"gpu {gpu.id}: {name} ({cap}), "
              f"{'supported' if supported else 'not a 9.x/10.x device'}")
    except ImportError:
        print("cupy not installed: CPU path only")
    except Dsv4Error as error:
        print(f"gpu: none usable, CPU path only ({type(error).__name__}: {error})")
    print(f"kernels: {loader.kernel_dir()} ({', '.join(loader.kernel_files())})")
    return 0


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d+[af]?", text):
        raise argparse.ArgumentTypeError(f"expected a name like 'sm_90' or 'sm_100a', got {text!r}")
    return text


def _compile(args) -> int:
    from . import families, loader
    from .errors import Dsv4Error
    archs = args.arch or list(loader.DEFAULT_ARCHS)
    failures = 0
    name_width = max(len(f"{family.file}:{family.function}") for family in families.ALL)
    print(f"{'kernel family':{name_width}} {'arch':8} {'entry points':>12} {'cubin bytes':>12} "
          f"{'seconds':>8}  status")
    for family in families.ALL:
        for arch in archs:
            start = time.perf_counter()
            try:
                size, status = len(loader.compile_for(family, arch)), "ok"
            except Dsv4Error as error:
                size, status = 0, f"FAILED: {error}"
                failures += 1
            print(f"{family.file + ':' + family.function:{name_width}} {arch:8} "
                  f"{len(family.entry_points()):12d} {size:12d} "
                  f"{time.perf_counter() - start:8.2f}  {status}")
    print(f"{failures} failed" if failures else "all kernels compiled")
    return 1 if failures else 0


def _warmup(args) -> int:
    from .warmup import summary, warmup
    start = time.perf_counter()
    done = warmup(gpu=True if args.gpu else None, cpu=True if args.cpu else None,
                  progress=False if args.no_progress else None)
    print(f"warmed {summary(done)} in {time.perf_counter() - start:.2f} s")
    return 0


def _demo(args) -> int:
    from .demo import main
    return main(device=args.device, max_model_len=args.max_model_len)


def _bench(args) -> int:
    from .device import has_gpu
    if not args.cpu_only and not has_gpu():
        print("python -m dsv4_cupy bench: the GPU benchmark needs a CUDA GPU and none was found (no GPU or no "
              "NVIDIA driver); run `python -m dsv4_cupy bench --cpu-only` for the CPU path's "
              "benchmark", file=sys.stderr)
        return 2
    from .bench.cli import main
    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4_cupy",
        description="DeepSeek-V4 sparse-MLA metadata with CuPy kernels: tools.")
    debug_help = "show the traceback of an error instead of one line"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    # --debug after the command too (SUPPRESS: absent there, the one before it stands).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, **kwargs):
        return sub.add_parser(name, parents=[common], **kwargs)

    add("info", help="versions, NVRTC, GPU and backend support").set_defaults(func=_info)
    compile_parser = add(
        "compile", help="compile every kernel for the given archs (no GPU needed)")
    compile_parser.add_argument("--arch", action="append", type=_arch,
                                help="target such as sm_90 or sm_100 (repeatable; default both)")
    compile_parser.set_defaults(func=_compile)
    warm = add("warmup", help="compile and load every kernel for this machine")
    warm.add_argument("--gpu", action="store_true", help="CUDA kernels for the current device")
    warm.add_argument("--cpu", action="store_true", help="numba kernels for every dtype")
    warm.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    warm.set_defaults(func=_warmup)
    demo = add("demo", help="build every KV-cache group's metadata of a realistic "
                                       "DeepSeek-V4 step")
    demo.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                      help="gpu: the CUDA kernels (torch arrays if torch is installed, else "
                           "cupy); cpu: the numba path; auto (default): the GPU when there is one")
    demo.add_argument("--max-model-len", type=_demo_model_len, default=1 << 20,
                      help="tokens per request at most (default 1048576, DeepSeek-V4's)")
    demo.set_defaults(func=_demo)
    from .bench.cli import add_arguments
    bench = add("bench", help="benchmark against vLLM's Triton path (when importable) and torch eager")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def _demo_model_len(text: str) -> int:
    from .demo import MIN_MODEL_LEN
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < MIN_MODEL_LEN:
        raise argparse.ArgumentTypeError(
            f"expected at least {MIN_MODEL_LEN} (the demo's prefills reach that far), got {value}")
    return value


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as error:   # one line, not a traceback
        if args.debug:
            raise
        what = "interrupted" if isinstance(error, KeyboardInterrupt) else \
            f"{type(error).__name__}: {error}".splitlines()[0]
        print(f"{parser.prog} {args.command}: {what} (--debug shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
