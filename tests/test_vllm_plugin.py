"""register() of the vLLM plugin (dsv4_cupy.vllm) on stand-ins for vLLM's
modules: off unless DSV4_CUPY_VLLM=1, idempotent, nothing patched on an
untested vLLM or an unserved platform, and what it patched logged. The
patched builders against vLLM itself are tests/test_vllm_builders.py."""
from __future__ import annotations

import logging
import sys
import types

import pytest

import dsv4_cupy.vllm as plugin


class Platform:
    def __init__(self, kind="cpu", major=None):
        self.kind, self.major = kind, major

    def is_cpu(self):
        return self.kind == "cpu"

    def is_cuda(self):
        return self.kind == "cuda"

    def get_device_capability(self):
        return types.SimpleNamespace(major=self.major, minor=0)


@pytest.fixture
def stand_ins(monkeypatch):
    """vllm (0.34.0, CPU platform) and the builders module, as stand-ins; the
    installs they see are counted in the returned list."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.34.0"
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = Platform()
    installs = []
    parts = {}
    for part in plugin.INSTALLED_PARTS:
        parts[part] = types.ModuleType(f"dsv4_cupy.vllm.{part}")
        parts[part].install = (lambda part=part: installs.append(part)
                               or {f"{part}.target": f"{part}.ours"})
    for name, module in (("vllm", vllm), ("vllm.platforms", platforms),
                         *((f"dsv4_cupy.vllm.{part}", module) for part, module in parts.items())):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(plugin, "_patched", {})
    return types.SimpleNamespace(vllm=vllm, platforms=platforms, installs=installs)


def test_off_unless_the_variable_says_1(stand_ins, monkeypatch):
    for value in (None, "0", "true"):
        if value is None:
            monkeypatch.delenv(plugin.ENABLE_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(plugin.ENABLE_VARIABLE, value)
        plugin.register()
    assert stand_ins.installs == [] and plugin.patched() == {}


def test_on_it_patches_once_and_says_what(stand_ins, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    with caplog.at_level(logging.INFO, logger="vllm.dsv4_cupy"):
        plugin.register()
        plugin.register()                     # vLLM may load plugins twice
    assert stand_ins.installs == list(plugin.INSTALLED_PARTS)
    assert plugin.patched() == {f"{part}.target": f"{part}.ours" for part in plugin.INSTALLED_PARTS}
    assert "dsv4_cupy: builders.target -> builders.ours" in caplog.text


def test_the_one_launch_step_can_be_left_out(stand_ins, monkeypatch):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    monkeypatch.setenv(plugin.STEP_VARIABLE, "0")
    plugin.register()
    assert stand_ins.installs == [part for part in plugin.INSTALLED_PARTS if part != "step"]


@pytest.mark.parametrize("version", ["0.33.1", "0.35.0", "1.0.0"])
def test_an_untested_version_patches_nothing_and_warns(stand_ins, monkeypatch, caplog, version):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    stand_ins.vllm.__version__ = version
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_cupy"):
        plugin.register()
    assert stand_ins.installs == [] and plugin.patched() == {}
    assert f"vLLM {version} is not a tested version (0.34); nothing patched" in caplog.text


@pytest.mark.parametrize("platform,served", [
    (Platform("cuda", 9), True), (Platform("cuda", 10), True), (Platform("cpu"), True),
    (Platform("cuda", 12), False), (Platform("cuda", 8), False), (Platform("rocm"), False)])
def test_only_served_platforms_are_patched(stand_ins, monkeypatch, caplog, platform, served):
    monkeypatch.setenv(plugin.ENABLE_VARIABLE, "1")
    stand_ins.platforms.current_platform = platform
    with caplog.at_level(logging.WARNING, logger="vllm.dsv4_cupy"):
        plugin.register()
    assert bool(stand_ins.installs) == served
    if not served:
        assert "is not served" in caplog.text and "nothing patched" in caplog.text


def graph_kernel_nodes(fn) -> int:
    """The nodes of a torch CUDA graph capturing ``fn`` (a sync inside fails the capture)."""
    import ctypes

    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()                                        # warm up: compile, load, first use
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    count = ctypes.c_size_t(0)
    libcuda = ctypes.CDLL("libcuda.so.1")
    assert libcuda.cuGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None,
                                   ctypes.byref(count)) == 0
    return count.value


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [4, 128])
def test_the_adapters_conversion_launches_nothing_more_and_never_syncs(ratio):
    """The plugin's C128A/C4A build (vLLM's metadata in, vLLM's out, here a
    stand-in class with its fields) captured in a CUDA graph: the library's
    own build's nodes plus vLLM's in-place clamp of a compressed group's table,
    nothing else; a device-to-host sync would have failed the capture."""
    import dataclasses

    import numpy as np
    torch = pytest.importorskip("torch")

    import dsv4_cupy as d4
    from dsv4_cupy.vllm.convert import FLASHMLA_FIELDS, flashmla_build, library_cm
    from helpers import common_metadata, group_ops_steps
    vllm_metadata = dataclasses.make_dataclass("DeepseekV4FlashMLAMetadata", FLASHMLA_FIELDS)
    batch, _ = group_ops_steps()
    library = d4.DeepseekV4MetadataBuilder(ratio, 1 << 18, 64, num_speculative_tokens=1,
                                           like="torch")
    cm = types.SimpleNamespace(**vars(common_metadata(batch, "torch_cuda")),
                               _token_to_req_indices_cache=None)
    bare = graph_kernel_nodes(lambda: library.build(0, library_cm(cm)))
    adapter = graph_kernel_nodes(lambda: flashmla_build(library, cm, vllm_metadata))
    assert (bare, adapter) == (1, 1 + 1)
    served = flashmla_build(library, cm, vllm_metadata)
    torch.cuda.synchronize()
    want = library.build(0, library_cm(cm))
    for name in FLASHMLA_FIELDS:
        a, b = getattr(served, name), getattr(want, name)
        assert (a is b) or (a == b if not isinstance(b, torch.Tensor) else a.data_ptr() == b.data_ptr())
    assert cm._token_to_req_indices_cache is served.req_id_per_token
    assert not np.any(cm.block_table_tensor.cpu().numpy() < 0)
