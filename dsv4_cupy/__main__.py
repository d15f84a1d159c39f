"""Command line: ``python -m dsv4_cupy {info,compile,warmup,demo,bench}``."""
from __future__ import annotations

import argparse
import platform
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
        print(f"{type(error).__name__}: {error}")
    print(f"kernels: {loader.kernel_dir()} ({', '.join(loader.kernel_files())})")
    return 0


def _compile(args) -> int:
    import re

    from . import families, loader
    from .errors import Dsv4Error
    archs = args.arch or list(loader.DEFAULT_ARCHS)
    bad = [arch for arch in archs if not re.fullmatch(r"sm_\d+[af]?", arch)]
    if bad:
        print(f"FAILED: --arch: expected names like 'sm_90' or 'sm_100a', got {', '.join(bad)}")
        return 1
    failures = 0
    print(f"{'kernel family':26} {'arch':8} {'entry points':>12} {'cubin bytes':>12} "
          f"{'seconds':>8}  status")
    for family in families.ALL:
        for arch in archs:
            start = time.perf_counter()
            try:
                size, status = len(loader.compile_for(family, arch)), "ok"
            except Dsv4Error as error:
                size, status = 0, f"FAILED: {error}"
                failures += 1
            print(f"{family.file + ':' + family.function:26} {arch:8} "
                  f"{len(family.entry_points()):12d} {size:12d} "
                  f"{time.perf_counter() - start:8.2f}  {status}")
    print(f"{failures} failed" if failures else "all kernels compiled")
    return 1 if failures else 0


def _warmup(args) -> int:
    from .warmup import warmup
    start = time.perf_counter()
    done = warmup(gpu=True if args.gpu else None, cpu=True if args.cpu else None)
    print(f"warmed {len(done['gpu'])} GPU kernels and {len(done['cpu'])} CPU kernels "
          f"in {time.perf_counter() - start:.2f} s")
    return 0


def _demo(args) -> int:
    from .demo import main
    return main(device=args.device, max_model_len=args.max_model_len)


def _bench(args) -> int:
    from .device import has_gpu
    if not args.cpu_only and not has_gpu():
        print("bench: the GPU benchmark needs a CUDA GPU and none was found (no GPU or no "
              "NVIDIA driver); run `python -m dsv4_cupy bench --cpu-only` for the CPU path's "
              "benchmark", file=sys.stderr)
        return 2
    from .bench.cli import main
    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4_cupy",
        description="DeepSeek-V4 sparse-MLA metadata with CuPy kernels: tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, NVRTC, GPU and backend support").set_defaults(func=_info)
    compile_parser = sub.add_parser(
        "compile", help="compile every kernel for the given archs (no GPU needed)")
    compile_parser.add_argument("--arch", action="append",
                                help="target such as sm_90 or sm_100 (repeatable; default both)")
    compile_parser.set_defaults(func=_compile)
    warm = sub.add_parser("warmup", help="compile and load every kernel for this machine")
    warm.add_argument("--gpu", action="store_true", help="CUDA kernels for the current device")
    warm.add_argument("--cpu", action="store_true", help="numba kernels for every dtype")
    warm.set_defaults(func=_warmup)
    demo = sub.add_parser("demo", help="build metadata for a realistic DeepSeek-V4 step")
    demo.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    demo.add_argument("--max-model-len", type=int, default=1 << 20)
    demo.set_defaults(func=_demo)
    from .bench.cli import add_arguments
    bench = sub.add_parser("bench", help="benchmark against torch-eager (and vLLM if importable)")
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
