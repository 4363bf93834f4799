"""XNNPACK's weight cache set from Python (hrm_edge.runtime.xnnpack_options): the option reaches the runtime, a weight
shared by several operators is then packed once (resident memory), and results are bit-identical."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower

from conftest import REPO
from hrm_edge.runtime.decoders import PteDecoder, decode_logits
from hrm_edge.runtime.xnnpack_options import set_weight_cache, weight_cache_enabled

# a fresh process: load a program with the cache on or off, run it once, report the resident-memory growth
# of the load + first run (the weight packing) and a digest of the output
CHILD = """
import json, sys
import torch
from executorch.runtime import Runtime
from hrm_edge.runtime.xnnpack_options import set_weight_cache
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
set_weight_cache(sys.argv[2] == "on")
before = rss_mb()
method = Runtime.get().load_program(sys.argv[1]).load_method("forward")
out = method.execute([torch.linspace(-1, 1, 256).reshape(1, 256)])[0]
print(json.dumps({"mb": rss_mb() - before, "out": out.double().sum().item(), "first": out[0, :4].tolist()}))
"""


def test_the_option_reads_back():
    was = weight_cache_enabled()
    try:
        set_weight_cache(True)
        assert weight_cache_enabled() is True
        set_weight_cache(False)
        assert weight_cache_enabled() is False
    finally:
        set_weight_cache(was)


@pytest.fixture(scope="module")
def shared_linear_pte(tmp_path_factory):
    """One 256 x 1024 fp32 linear (1 MiB) applied 8 times, as our block is: stored once in the file."""
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(256, 1024, bias=False)

        def forward(self, x):  # [1, 256]
            for _ in range(8):
                x = torch.tanh(self.up(x))[:, :256] + x  # [1, 256]
            return x

    torch.manual_seed(0)
    program = torch.export.export(Shared().eval(), (torch.randn(1, 256),))
    path = tmp_path_factory.mktemp("xnnpack") / "shared.pte"
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    return path


def run_child(path, cache: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), cache], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_shared_weight_is_packed_once_with_the_cache(shared_linear_pte):
    assert shared_linear_pte.stat().st_size < 2 * 2**20  # the file holds the 1 MiB weight once
    off, on = run_child(shared_linear_pte, "off"), run_child(shared_linear_pte, "on")
    # off: 8 packed copies of 1 MiB; on: one. Allow a few MiB for the allocator's rounding.
    assert off["mb"] - on["mb"] > 5.0, (off, on)
    assert on["out"] == off["out"] and on["first"] == off["first"]  # the same packing, bit for bit


@pytest.mark.slow
def test_kv_programs_decode_identically_with_the_cache(tiny_export):
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 24))  # [N, S]
    for name in ("hrm.fp32.kv.pte", "hrm.int8-dynamic.kv.pte"):
        logits = [decode_logits(PteDecoder(tiny_export / name, 1, cache), tokens, 16) for cache in (False, True)]
        np.testing.assert_array_equal(logits[0], logits[1])
    set_weight_cache(False)  # the wheel's default, for the tests that follow in this process
